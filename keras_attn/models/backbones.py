"""Backbones: the Transformer stacks the tasks are made of, one place each.

keras-hub's pattern (https://keras.io/keras_hub/api/base_classes/backbone/):
a backbone is a functional `keras.Model` from token ids to hidden states with
no task head, whose constructor arguments are its `get_config`; a task
(`TextClassifier`, `TransformerTranslator`, `TransformerLanguageModel`) puts
a head on one (or two) and adds the text methods.

- `TransformerEncoderBackbone`: token and position embedding -> (layer norm,
  as BERT) -> dropout -> `TransformerEncoder` blocks -> (final layer norm
  when pre-norm). `from_bert` builds one with BERT's layout and loads a
  pretrained checkpoint into it.
- `TransformerDecoderBackbone`: token and position embedding -> dropout ->
  causal `TransformerDecoder` blocks (with cross-attention to an encoder's
  states when `cross_attention=True`) -> (final layer norm when pre-norm).

Token id 0 is padding: the embedding's Keras mask reaches every block, and
the output carries it on. Each backbone's variable paths start with its
name (`"encoder_backbone/encoder_0/self_attention/query/kernel"`), so the
two stacks of a translator have distinct paths. Imports no TensorFlow.
"""

from __future__ import annotations

import keras
from keras import ops

from keras_attn import _validation as v
from keras_attn._compat_0_2 import (
    block_class,
    block_structure_config,
    blocks_of_config,
)
from keras_attn.layers.token_and_position_embedding import TokenAndPositionEmbedding
from keras_attn.layers.transformer_decoder_block import TransformerDecoderBlock
from keras_attn.layers.transformer_encoder_block import TransformerEncoderBlock
from keras_attn.models._saving import ExplicitSignatures
from keras_attn.models._setattr import SetattrBeforeInit
from keras_attn.models._task import cached
from keras_attn.models.layouts import layout_map
from keras_attn.models.task import serialize_dtype_policy
from keras_attn.ops.attention_paths import sequence_length_bound

POSITIONS = ("sinusoidal", "learned", "rotary", "alibi")
# Added to the embeddings; the other two act inside the blocks' attention.
ABSOLUTE_POSITIONS = ("sinusoidal", "learned")


def _check_sizes(vocabulary_size, sequence_length, num_layers, dropout, position):
    v.check_positive_int("vocabulary_size", vocabulary_size)
    v.check_positive_int("sequence_length", sequence_length)
    v.check_positive_int("num_layers", num_layers)
    v.check_rate("dropout", dropout)
    v.check_choice("position", position, POSITIONS)


class _Backbone(SetattrBeforeInit, ExplicitSignatures, keras.Model):
    """What the backbones share: the embedding's name for tied heads
    (`token_embedding`, as keras-hub's `Backbone`), the blocks, the config
    entries every backbone has, and the dtype policy.

    As keras-hub's `Backbone`: each subclass hands `dtype` to every layer it
    builds and then to this constructor, which sets the model's policy;
    `get_config` records it (a `DTypePolicyMap` of the quantized layers'
    policies once `quantize` has run, so the quantized backbone rebuilds).
    """

    def __init__(self, inputs, outputs, dtype=None, **kwargs):
        super().__init__(inputs, outputs, **kwargs)
        if dtype is not None:
            self.dtype_policy = keras.dtype_policies.get(dtype)

    @staticmethod
    def _make_embedding(
        vocabulary_size,
        sequence_length,
        embedding_dim,
        position,
        scale_embeddings,
        embeddings_initializer,
        dtype,
    ):
        return TokenAndPositionEmbedding(
            vocabulary_size,
            sequence_length,
            embedding_dim,
            position=(
                position if position in ABSOLUTE_POSITIONS else None
            ),  # rotary / ALiBi: token embeddings alone
            mask_zero=True,
            position_initializer="glorot_uniform",
            scale_embeddings=scale_embeddings,
            embeddings_initializer=keras.initializers.get(embeddings_initializer),
            dtype=dtype,
            name="embedding",
        )

    @staticmethod
    def _attention_options(position, num_key_value_heads, sliding_window) -> dict:
        """The blocks' attention options that were set (grouped-query heads,
        rotary / ALiBi positions, the window); the blocks check the values."""
        options = {
            "num_key_value_heads": num_key_value_heads,
            "sliding_window": sliding_window,
        }
        options = {name: value for name, value in options.items() if value is not None}
        if position not in ABSOLUTE_POSITIONS:
            options["position"] = position
        return options

    @property
    def token_embedding(self):
        """The `TokenAndPositionEmbedding` (`reverse=True` gives tied logits)."""
        return self.embedding

    def longest_input(self) -> int | None:
        """The longest sequence this backbone's attention reads: its
        `sequence_length` where its positions bound the input (learned or
        sinusoidal positions, which the embedding refuses past it), without
        keys of another stack (cross-attention); else `None`."""
        if self.position not in ABSOLUTE_POSITIONS:
            return None  # rotary / ALiBi: no table, no bound
        if getattr(self, "cross_attention", False):
            return None  # the encoder's states: another stack's length
        return self.sequence_length

    def call(self, inputs, training=None, mask=None, **kwargs):
        # Traced with unknown lengths (Keras's retrace, an export), attention
        # that cannot reach the switch-over builds the explicit path alone.
        with sequence_length_bound(self.longest_input()):
            return super().call(inputs, training=training, mask=mask, **kwargs)

    # keras-hub's static `get_layout_map(device_mesh, model_parallel_dim_name,
    # data_parallel_dim_name)`, with `fsdp`: `keras_attn.models.layouts`.
    get_layout_map = staticmethod(layout_map)

    def save_to_preset(self, preset_dir):
        """Write `config.json`, `model.weights.h5` and `metadata.json` to
        `preset_dir`, as keras-hub's `Backbone.save_to_preset`."""
        from keras_attn.models.presets import save_backbone

        return save_backbone(self, preset_dir)

    @classmethod
    def from_preset(cls, preset, load_weights: bool = True, **kwargs):
        """The backbone of a preset directory (a task's or a backbone's:
        `config.json` and `model.weights.h5`); `kwargs` override its config
        (`dropout`, `dtype`, ...)."""
        from keras_attn.models.presets import load_backbone

        return load_backbone(cls, preset, load_weights=load_weights, **kwargs)

    def _set_config(
        self,
        vocabulary_size,
        sequence_length,
        embedding_dim,
        num_layers,
        num_heads,
        intermediate_dim,
        dropout,
        position,
        normalize_first,
        layer_norm_epsilon,
        scale_embeddings,
        embeddings_initializer,
        num_key_value_heads,
        sliding_window,
    ):
        """The constructor arguments both backbones take, as attributes."""
        self.vocabulary_size = vocabulary_size
        self.sequence_length = sequence_length
        self.embedding_dim = embedding_dim
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.intermediate_dim = intermediate_dim
        self.dropout = dropout
        self.position = position
        self.normalize_first = normalize_first
        self.layer_norm_epsilon = layer_norm_epsilon
        self.scale_embeddings = scale_embeddings
        self.embeddings_initializer = keras.initializers.serialize(
            keras.initializers.get(embeddings_initializer)
        )
        self.num_key_value_heads = num_key_value_heads
        self.sliding_window = sliding_window

    def get_config(self):
        # Not Functional's config (its layer graph): the constructor's
        # arguments, as keras-hub's `Backbone.get_config`; subclasses add
        # theirs. The attention options only when set (configs written
        # before them read the same).
        config = {
            "name": self.name,
            "trainable": self.trainable,
            "dtype": serialize_dtype_policy(self),
            **block_structure_config(self.blocks),
            "vocabulary_size": self.vocabulary_size,
            "sequence_length": self.sequence_length,
            "embedding_dim": self.embedding_dim,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "intermediate_dim": self.intermediate_dim,
            "dropout": self.dropout,
            "position": self.position,
            "normalize_first": self.normalize_first,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "scale_embeddings": self.scale_embeddings,
            "embeddings_initializer": self.embeddings_initializer,
        }
        for name in ("num_key_value_heads", "sliding_window"):
            if getattr(self, name) is not None:
                config[name] = getattr(self, name)
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if isinstance(config.get("dtype"), dict):
            config["dtype"] = keras.dtype_policies.get(config["dtype"])
        with blocks_of_config(config):  # configs of 0.2: blocks of that structure
            return cls(**config)


@keras.saving.register_keras_serializable(package="keras_attn")
class TransformerEncoderBackbone(_Backbone):
    """A Transformer encoder stack: token ids -> hidden states.

    Input `token_ids` `(batch, T)` int (0 = padding); output
    `(batch, T, embedding_dim)` in the compute dtype, with the padding mask
    as its Keras mask. BERT's layout is `position="learned"`,
    `activation="gelu"`, `layer_norm_epsilon=1e-12`, `embedding_norm=True`
    (what `from_bert` builds).

    Args:
        vocabulary_size: token ids are in `[0, vocabulary_size)`.
        sequence_length: the longest input (size of learned positions;
            sinusoids extrapolate).
        embedding_dim, num_layers, num_heads, intermediate_dim: sizes.
        dropout: of the embeddings and the blocks.
        position: `"sinusoidal"` or `"learned"` (added to the embeddings),
            `"rotary"` or `"alibi"` (inside the blocks' self-attention; the
            embedding then has no position table).
        normalize_first: pre-norm blocks and a final layer norm.
        activation: of the blocks' feed-forward networks.
        layer_norm_epsilon: of every layer norm.
        embedding_norm: a layer norm on the embeddings (BERT).
        scale_embeddings: multiply token embeddings by `sqrt(embedding_dim)`
            (Vaswani et al.).
        embeddings_initializer: of the token table.
        num_key_value_heads: keyword-only, grouped-query attention in every
            block (see `TransformerEncoderBlock`).
        sliding_window: keyword-only, the blocks' self-attention window.
        dtype: keyword-only, the dtype policy of every layer (`"float32"`,
            `"bfloat16"`, `"mixed_bfloat16"`, `"mixed_float16"`, a
            `keras.DTypePolicy` or a `DTypePolicyMap`); default the global
            policy. Recorded in the config.
        **kwargs: `keras.Model` arguments (`name`, `trainable`).
    """

    def __init__(
        self,
        vocabulary_size: int,
        sequence_length: int,
        embedding_dim: int = 128,
        num_layers: int = 2,
        num_heads: int = 4,
        intermediate_dim: int = 256,
        dropout: float = 0.1,
        position: str = "sinusoidal",
        normalize_first: bool = False,
        activation="relu",
        layer_norm_epsilon: float = 1e-5,
        embedding_norm: bool = False,
        scale_embeddings: bool = False,
        embeddings_initializer="uniform",
        *,
        num_key_value_heads: int | None = None,
        sliding_window: int | None = None,
        dtype=None,
        **kwargs,
    ):
        kwargs.setdefault("name", "encoder_backbone")
        _check_sizes(vocabulary_size, sequence_length, num_layers, dropout, position)
        attention = self._attention_options(
            position, num_key_value_heads, sliding_window
        )
        # === Layers and functional model ===
        with keras.name_scope(kwargs["name"]):
            token_ids = keras.Input((None,), dtype="int32", name="token_ids")
            self.embedding = self._make_embedding(
                vocabulary_size,
                sequence_length,
                embedding_dim,
                position,
                scale_embeddings,
                embeddings_initializer,
                dtype,
            )
            x = self.embedding(token_ids)  # (B, T, d), masked token_ids != 0
            self.embedding_norm = None
            if embedding_norm:
                self.embedding_norm = keras.layers.LayerNormalization(
                    epsilon=layer_norm_epsilon, dtype=dtype, name="embedding_norm"
                )
                x = self.embedding_norm(x)
            x = keras.layers.Dropout(dropout, dtype=dtype, name="embedding_dropout")(x)
            self.blocks = []
            for index in range(num_layers):
                block = block_class(TransformerEncoderBlock)(
                    num_heads=num_heads,
                    intermediate_dim=intermediate_dim,
                    dropout=dropout,
                    normalize_first=normalize_first,
                    activation=activation,
                    layer_norm_epsilon=layer_norm_epsilon,
                    dtype=dtype,
                    name=f"encoder_{index}",
                    **attention,
                )
                x = block(x)
                self.blocks.append(block)
            self.final_norm = None
            if normalize_first:
                self.final_norm = keras.layers.LayerNormalization(
                    epsilon=layer_norm_epsilon, dtype=dtype, name="final_norm"
                )
                x = self.final_norm(x)
        super().__init__(token_ids, x, dtype=dtype, **kwargs)

        # === Config ===
        self._set_config(
            vocabulary_size,
            sequence_length,
            embedding_dim,
            num_layers,
            num_heads,
            intermediate_dim,
            dropout,
            position,
            normalize_first,
            layer_norm_epsilon,
            scale_embeddings,
            embeddings_initializer,
            num_key_value_heads,
            sliding_window,
        )
        self.activation = activation

    def get_config(self):
        return {
            **super().get_config(),
            "activation": self.activation,
            # `embedding_norm` is the layer (or None); the argument is
            # whether there is one.
            "embedding_norm": self.embedding_norm is not None,
        }

    @classmethod
    def from_bert(cls, checkpoint, dropout: float = 0.1, **kwargs):
        """An encoder of a pretrained BERT-style checkpoint's sizes and weights.

        The token and position embeddings (BERT's token-type embedding of
        type 0 added to the position table: every input is one segment), the
        embedding layer norm and every block get the checkpoint's weights.
        Inputs are the checkpoint's WordPiece ids (`checkpoint.tokenizer()`),
        at most `checkpoint.max_positions` long.

        Args:
            checkpoint: a `keras_attn.checkpoints.BertCheckpoint`.
            dropout: of the embeddings and blocks (BERT's own is 0.1).
            **kwargs: other constructor arguments (`name`, `dtype`).
        """
        from keras_attn.checkpoints import load_bert_encoder

        backbone = cls(**bert_encoder_config(checkpoint, dropout), **kwargs)
        load_bert_encoder(
            checkpoint, backbone.embedding, backbone.embedding_norm, backbone.blocks
        )
        return backbone

    def encode(self, token_ids, padding_mask=None, return_attention_scores=False):
        """The hidden states of `token_ids` with an explicit padding mask
        (default `token_ids != 0`), through the backbone's layers as a
        functional graph with a padding-mask input (`_encoding_model`; no
        embedding dropout); with `return_attention_scores=True` also each
        block's weights, float32 `(B, heads, T, T)`: `(states, [weights])`."""
        token_ids = ops.convert_to_tensor(token_ids, "int32")
        if padding_mask is None:
            padding_mask = ops.not_equal(token_ids, 0)
        found = self._encoding_model(return_attention_scores)(
            {"token_ids": token_ids, "padding_mask": padding_mask}
        )
        if not return_attention_scores:
            return found
        states, *maps = found
        return states, [ops.cast(weights, "float32") for weights in maps]

    def _encoding_model(self, return_attention_scores: bool = False) -> keras.Model:
        """`encode`'s model: `{"token_ids", "padding_mask"}` -> the states
        (and each block's weights after them), sharing this backbone's
        layers; built once per setting and kept, out of Keras' tracking."""

        def build():
            token_ids = keras.Input((None,), dtype="int32", name="token_ids")
            padding_mask = keras.Input((None,), dtype="bool", name="padding_mask")
            x = self.embedding(token_ids)
            if self.embedding_norm is not None:
                x = self.embedding_norm(x)
            maps = []
            for block in self.blocks:
                if return_attention_scores:
                    x, weights = _WithAttentionScores(block)(x, padding_mask)
                    maps.append(weights)
                else:
                    x = block(x, padding_mask=padding_mask)
            if self.final_norm is not None:
                x = self.final_norm(x)
            inputs = {"token_ids": token_ids, "padding_mask": padding_mask}
            return keras.Model(inputs, [x, *maps] if return_attention_scores else x)

        key = ("encoding_model", bool(return_attention_scores))
        return cached(self, key, (), build)


class _WithAttentionScores(keras.layers.Layer):
    """`block(x, padding_mask=..., return_attention_scores=True)` as a layer
    of its own (no weights of its own: the block's): a functional graph
    checks a layer's outputs by its first call, which gave the block one
    output, not the two it gives here."""

    def __init__(self, block):
        super().__init__(name=f"{block.name}_with_scores", dtype=block.dtype_policy)
        self.block = block
        self.supports_masking = True

    def compute_mask(self, x, padding_mask=None, mask=None):
        return [mask, None]  # the states keep the embedding's mask

    def call(self, x, padding_mask, mask=None):
        return self.block(
            x, padding_mask=padding_mask, mask=mask, return_attention_scores=True
        )


def bert_encoder_config(checkpoint, dropout: float = 0.1) -> dict:
    """`TransformerEncoderBackbone` arguments of a BERT checkpoint's layout."""
    return {
        "vocabulary_size": len(checkpoint.vocabulary),
        "sequence_length": checkpoint.max_positions,
        "embedding_dim": checkpoint.hidden_size,
        "num_layers": checkpoint.num_layers,
        "num_heads": checkpoint.num_heads,
        "intermediate_dim": checkpoint.intermediate_size,
        "dropout": dropout,
        "position": "learned",
        "activation": "gelu",
        "layer_norm_epsilon": checkpoint.layer_norm_epsilon,
        "embedding_norm": True,
    }


@keras.saving.register_keras_serializable(package="keras_attn")
class TransformerDecoderBackbone(_Backbone):
    """A causal Transformer decoder stack: token ids -> hidden states.

    Without cross-attention (a language model's stack) the input is
    `token_ids` `(batch, T)` int (0 = padding). With `cross_attention=True`
    (a translator's decoder) the inputs are a dict: `"token_ids"`,
    `"encoder_sequence_output"` `(batch, S, d_encoder)` and
    `"encoder_padding_mask"` `(batch, S)` bool. Output `(batch, T,
    embedding_dim)` in the compute dtype, with the padding mask as its Keras
    mask.

    Args:
        vocabulary_size: token ids are in `[0, vocabulary_size)`.
        sequence_length: the longest input (size of learned positions).
        embedding_dim, num_layers, num_heads, intermediate_dim: sizes.
        dropout: of the embeddings and the blocks.
        position: `"learned"` or `"sinusoidal"` (added to the embeddings),
            `"rotary"` or `"alibi"` (inside the blocks' self-attention, at the
            cache offset when decoding; the embedding then has no position
            table).
        normalize_first: pre-norm blocks and a final layer norm.
        cross_attention: blocks attend to an encoder's states too.
        encoder_dim: the width of those states (default `embedding_dim`).
        layer_norm_epsilon: of every layer norm.
        scale_embeddings: multiply token embeddings by `sqrt(embedding_dim)`.
        embeddings_initializer: of the token table.
        token_embedding: an existing `TokenAndPositionEmbedding` to use
            (a translator's table shared by source and target); not part of
            the config (the task that shares it passes it again).
        num_key_value_heads: keyword-only, grouped-query attention in every
            block's attention layers (see `TransformerDecoderBlock`).
        sliding_window: keyword-only, the blocks' self-attention window.
        dtype: keyword-only, the dtype policy of every layer (`"float32"`,
            `"bfloat16"`, `"mixed_bfloat16"`, `"mixed_float16"`, a
            `keras.DTypePolicy` or a `DTypePolicyMap`); default the global
            policy. Recorded in the config.
        **kwargs: `keras.Model` arguments (`name`, `trainable`).
    """

    def __init__(
        self,
        vocabulary_size: int,
        sequence_length: int,
        embedding_dim: int = 256,
        num_layers: int = 4,
        num_heads: int = 4,
        intermediate_dim: int = 1024,
        dropout: float = 0.1,
        position: str = "learned",
        normalize_first: bool = True,
        cross_attention: bool = False,
        encoder_dim: int | None = None,
        layer_norm_epsilon: float = 1e-5,
        scale_embeddings: bool = False,
        embeddings_initializer="uniform",
        token_embedding=None,
        *,
        num_key_value_heads: int | None = None,
        sliding_window: int | None = None,
        dtype=None,
        **kwargs,
    ):
        kwargs.setdefault("name", "decoder_backbone")
        _check_sizes(vocabulary_size, sequence_length, num_layers, dropout, position)
        if token_embedding is not None and not isinstance(
            token_embedding, TokenAndPositionEmbedding
        ):
            raise ValueError(
                "`token_embedding` must be a TokenAndPositionEmbedding or None. "
                f"Received: token_embedding={token_embedding!r}"
            )
        attention = self._attention_options(
            position, num_key_value_heads, sliding_window
        )
        # === Layers and functional model ===
        with keras.name_scope(kwargs["name"]):
            token_ids = keras.Input((None,), dtype="int32", name="token_ids")
            inputs = token_ids
            if cross_attention:
                encoder_states = keras.Input(
                    (None, encoder_dim or embedding_dim),
                    name="encoder_sequence_output",
                )
                encoder_mask = keras.Input(
                    (None,), dtype="bool", name="encoder_padding_mask"
                )
                inputs = {
                    "token_ids": token_ids,
                    "encoder_sequence_output": encoder_states,
                    "encoder_padding_mask": encoder_mask,
                }
            self.embedding = (
                token_embedding
                if token_embedding is not None
                else self._make_embedding(
                    vocabulary_size,
                    sequence_length,
                    embedding_dim,
                    position,
                    scale_embeddings,
                    embeddings_initializer,
                    dtype,
                )
            )
            x = self.embedding(token_ids)  # (B, T, d), masked token_ids != 0
            x = keras.layers.Dropout(dropout, dtype=dtype, name="embedding_dropout")(x)
            self.blocks = []
            for index in range(num_layers):
                block = block_class(TransformerDecoderBlock)(
                    num_heads=num_heads,
                    intermediate_dim=intermediate_dim,
                    dropout=dropout,
                    normalize_first=normalize_first,
                    layer_norm_epsilon=layer_norm_epsilon,
                    dtype=dtype,
                    name=f"decoder_{index}",
                    **attention,
                )
                if cross_attention:
                    x = block(x, encoder_states, encoder_padding_mask=encoder_mask)
                else:
                    x = block(x)
                self.blocks.append(block)
            self.final_norm = None
            if normalize_first:
                self.final_norm = keras.layers.LayerNormalization(
                    epsilon=layer_norm_epsilon, dtype=dtype, name="final_norm"
                )
                x = self.final_norm(x)
        super().__init__(inputs, x, dtype=dtype, **kwargs)

        # === Config ===
        self._set_config(
            vocabulary_size,
            sequence_length,
            embedding_dim,
            num_layers,
            num_heads,
            intermediate_dim,
            dropout,
            position,
            normalize_first,
            layer_norm_epsilon,
            scale_embeddings,
            embeddings_initializer,
            num_key_value_heads,
            sliding_window,
        )
        self.cross_attention = cross_attention
        self.encoder_dim = encoder_dim

    def get_config(self):
        return {
            **super().get_config(),
            "cross_attention": self.cross_attention,
            "encoder_dim": self.encoder_dim,
        }
