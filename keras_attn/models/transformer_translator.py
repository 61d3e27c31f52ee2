"""`TransformerTranslator`: Vaswani et al.'s encoder-decoder (2017)."""

from __future__ import annotations

import keras
from keras import ops

from keras_attn import _validation as v
from keras_attn._compat_0_2 import blocks_of_config
from keras_attn.layers import kv_cache
from keras_attn.models import _task
from keras_attn.models.backbones import (
    ABSOLUTE_POSITIONS,
    TransformerDecoderBackbone,
    TransformerEncoderBackbone,
)
from keras_attn.models.quantization import deserialize_dtype, float32_head_policy
from keras_attn.models.task import BackboneTask, deserialize_backbone
from keras_attn.models.translator import Translator
from keras_attn.models.translator_backbones import (
    ENCODER_LAYOUTS,
    POSITIONS,
    backbones_of_sizes,
    decoder_sizes,
    given_backbones,
)
from keras_attn.ops.attention_paths import sequence_length_bound

__all__ = ["ENCODER_LAYOUTS", "POSITIONS", "TransformerTranslator"]


@keras.saving.register_keras_serializable(package="keras_attn")
class TransformerTranslator(BackboneTask, Translator):
    """Vaswani et al.'s encoder-decoder Transformer for translation.

    Inputs `{"encoder_inputs": (batch, S), "decoder_inputs": (batch, T)}` int
    ids, 0 = padding; output float32 logits `(batch, T, target_vocabulary_size)`
    predicting token `t + 1` at position `t`. Two backbones: the encoder
    (`backbone`, a `TransformerEncoderBackbone`) and the decoder
    (`decoder_backbone`, a `TransformerDecoderBackbone` with
    cross-attention). Source and target tokens get `TokenAndPositionEmbedding`s
    (scaled by `sqrt(d)` as in the paper), one table for both with
    `shared_vocabulary=True`. With `tie_embeddings=True` the output
    projection is the transposed target embedding (section 3.4 of the
    paper). `normalize_first=True` gives pre-norm blocks and final layer
    norms, which train more stably without warm-up.

    `encoder_layout="bert"` makes the encoder a BERT encoder (learned
    positions, no scaling, an embedding layer norm, post-norm GELU blocks
    with `encoder_layer_norm_epsilon`) of its own sizes (`encoder_dim`,
    `encoder_num_heads`, `encoder_intermediate_dim`, `source_sequence_length`):
    what `from_bert` loads a pretrained checkpoint into.

    Build it from backbones (`TransformerTranslator(backbone=...,
    decoder_backbone=...)`, the decoder's `encoder_dim` the encoder's width)
    or from the sizes below, which build them.

    Decoding: `encode` / `call_with_cache` (the `keras_attn.generation`
    contract, over a KV cache), `translate_ids`, and with its tokenizers
    `translate`, `evaluate_translations`, `export` (see `Translator`);
    `call_with_states` and `attention_maps` for kNN-MT and heatmaps.

    Args:
        source_vocabulary_size, target_vocabulary_size: vocabulary sizes.
        sequence_length: the longest decoder input (size of learned target
            positions; sinusoids extrapolate), and the source's unless
            `source_sequence_length`.
        embedding_dim: the model width (the decoder's, and the encoder's
            unless `encoder_dim`).
        num_encoder_layers, num_decoder_layers: blocks per side.
        num_heads, intermediate_dim: of every block (the encoder's unless
            `encoder_num_heads`, `encoder_intermediate_dim`).
        dropout: dropout rate of the embeddings and blocks.
        shared_vocabulary: one embedding table for both sides (equal
            vocabulary sizes and widths).
        tie_embeddings: output projection = transposed target embedding.
        normalize_first: pre-norm blocks (and final layer norms).
        position: `"sinusoidal"` or `"learned"` positions.
        encoder_layout: `"transformer"` or `"bert"` (above).
        encoder_dim, encoder_num_heads, encoder_intermediate_dim,
            source_sequence_length: the encoder's sizes, when they differ.
        encoder_layer_norm_epsilon: of the encoder's layer norms (default
            1e-12 for `"bert"`, else 1e-5).
        freeze_source_embedding: keep the source token and position table
            fixed (a pretrained encoder's large vocabulary, of which a small
            parallel corpus would move only the rows of the words it holds).
        source_tokenizer, target_tokenizer: tokenizers of `translate` and
            `export` (optional: the network decodes token ids without them).
        backbone, decoder_backbone: the two stacks, given together (then
            leave the sizes out); with `shared_vocabulary=True` the decoder
            is built on the encoder's embedding and `decoder_backbone` is
            its config (a dict) or None.
        assistant_model: keyword-only, the translator's own draft for
            speculative greedy search (a smaller `TransformerTranslator` on
            the same vocabularies; the `assistant_model` attribute):
            greedy decodings use it unless given another. Saved with the
            translator, not among its weights.
        dtype: keyword-only, the dtype policy of the backbones built here
            (the logits stay float32); with backbones given, their policy
            is the task's (`dtype` may repeat it; the two must agree).
            Default the global policy. A quantized task's config gives a
            `DTypePolicyMap` of its quantized `logits` layer (built
            quantized from it).
        **kwargs: `keras.Model` arguments (`name`, `trainable`).
    """

    def __init__(
        self,
        source_vocabulary_size: int | None = None,
        target_vocabulary_size: int | None = None,
        sequence_length: int = 128,
        embedding_dim: int = 256,
        num_encoder_layers: int = 3,
        num_decoder_layers: int = 3,
        num_heads: int = 8,
        intermediate_dim: int = 1024,
        dropout: float = 0.1,
        shared_vocabulary: bool = False,
        tie_embeddings: bool = True,
        normalize_first: bool = False,
        position: str = "sinusoidal",
        encoder_layout: str = "transformer",
        encoder_dim: int | None = None,
        encoder_num_heads: int | None = None,
        encoder_intermediate_dim: int | None = None,
        source_sequence_length: int | None = None,
        encoder_layer_norm_epsilon: float | None = None,
        freeze_source_embedding: bool = False,
        source_tokenizer=None,
        target_tokenizer=None,
        *,
        backbone=None,
        decoder_backbone=None,
        assistant_model=None,
        dtype=None,
        **kwargs,
    ):
        kwargs.setdefault("name", "transformer_translator")
        sizes = {
            "source_vocabulary_size": source_vocabulary_size,
            "target_vocabulary_size": target_vocabulary_size,
            "sequence_length": sequence_length,
            "embedding_dim": embedding_dim,
            "num_encoder_layers": num_encoder_layers,
            "num_decoder_layers": num_decoder_layers,
            "num_heads": num_heads,
            "intermediate_dim": intermediate_dim,
            "dropout": dropout,
            "normalize_first": normalize_first,
            "position": position,
            "encoder_layout": encoder_layout,
            "encoder_dim": encoder_dim,
            "encoder_num_heads": encoder_num_heads,
            "encoder_intermediate_dim": encoder_intermediate_dim,
            "source_sequence_length": source_sequence_length,
            "encoder_layer_norm_epsilon": encoder_layer_norm_epsilon,
        }
        source_tokenizer = v.check_tokenizer("source_tokenizer", source_tokenizer)
        target_tokenizer = v.check_tokenizer("target_tokenizer", target_tokenizer)
        dtype = self.check_dtype(dtype, [backbone, decoder_backbone])
        if backbone is None and decoder_backbone is None:
            backbone, decoder_backbone = backbones_of_sizes(
                shared_vocabulary=shared_vocabulary, dtype=dtype, **sizes
            )
        else:
            self.check_sizes_unset(
                TransformerTranslator.__init__, sizes, "backbone` and `decoder_backbone"
            )
            backbone, decoder_backbone = given_backbones(
                backbone, decoder_backbone, shared_vocabulary
            )
        if freeze_source_embedding:
            backbone.embedding.trainable = False
        self.backbone = backbone
        self.decoder_backbone = decoder_backbone
        self._set_stack_attributes(backbone, decoder_backbone)

        encoder_inputs = keras.Input((None,), dtype="int32", name="encoder_inputs")
        decoder_inputs = keras.Input((None,), dtype="int32", name="decoder_inputs")
        encoder_outputs = backbone(encoder_inputs)  # (B, S, d), masked
        states = decoder_backbone(
            {
                "token_ids": decoder_inputs,
                "encoder_sequence_output": encoder_outputs,
                "encoder_padding_mask": ops.not_equal(encoder_inputs, 0),
            }
        )
        if tie_embeddings:
            self.logits_layer = keras.layers.Activation(
                "linear", dtype="float32", name="logits"
            )
            logits = self.logits_layer(decoder_backbone.embedding(states, reverse=True))
        else:
            self.logits_layer = keras.layers.Dense(
                decoder_backbone.vocabulary_size,
                dtype=float32_head_policy(dtype),
                name="logits",
            )
            logits = self.logits_layer(states)
        inputs = {"encoder_inputs": encoder_inputs, "decoder_inputs": decoder_inputs}
        super().__init__(inputs, logits, **kwargs)
        self._adopt_dtype_policy(decoder_backbone)
        # The same graph with the decoder's last states as a second output;
        # kept out of Keras' tracking (it holds no state of its own).
        object.__setattr__(self, "_states_model", keras.Model(inputs, [states, logits]))
        self.shared_vocabulary = shared_vocabulary
        self.tie_embeddings = tie_embeddings
        self.freeze_source_embedding = freeze_source_embedding
        self.source_tokenizer = source_tokenizer
        self.target_tokenizer = target_tokenizer
        self.assistant_model = assistant_model

    def _set_stack_attributes(self, backbone, decoder_backbone):
        """The stacks' parts and sizes as the model's attributes, as before
        the backbones (set before the graph: on PyTorch, untracked; the
        graph tracks the layers)."""
        self.encoder_backbone = backbone
        self.source_embedding = backbone.embedding
        self.source_embedding_norm = backbone.embedding_norm
        self.encoder_blocks = backbone.blocks
        self.encoder_norm = backbone.final_norm
        self.target_embedding = decoder_backbone.embedding
        self.decoder_blocks = decoder_backbone.blocks
        self.decoder_norm = decoder_backbone.final_norm
        self.source_vocabulary_size = backbone.vocabulary_size
        self.target_vocabulary_size = decoder_backbone.vocabulary_size
        self.sequence_length = decoder_backbone.sequence_length
        self.source_sequence_length = backbone.sequence_length
        self.embedding_dim = decoder_backbone.embedding_dim
        self.encoder_dim = backbone.embedding_dim
        self.num_encoder_layers = backbone.num_layers
        self.num_decoder_layers = decoder_backbone.num_layers
        self.num_heads = decoder_backbone.num_heads
        self.encoder_num_heads = backbone.num_heads
        self.intermediate_dim = decoder_backbone.intermediate_dim
        self.encoder_intermediate_dim = backbone.intermediate_dim
        self.dropout = decoder_backbone.dropout
        self.position = decoder_backbone.position
        self.encoder_layer_norm_epsilon = backbone.layer_norm_epsilon

    def longest_input(self) -> int | None:
        """The longest sequence the model's attention reads: the longer of
        the source and target `sequence_length`s where both stacks'
        positions bound their inputs (learned or sinusoidal), else `None`
        (`keras_attn.ops.sequence_length_bound`)."""
        source = self.backbone.longest_input()
        if source is None or self.decoder_backbone.position not in ABSOLUTE_POSITIONS:
            return None
        return max(source, self.decoder_backbone.sequence_length)

    def call(self, inputs, training=None, mask=None, **kwargs):
        # The decoder's cross-attention reads the source: bounded here, where
        # both lengths are known.
        with sequence_length_bound(self.longest_input()):
            return super().call(inputs, training=training, mask=mask, **kwargs)

    @property
    def backbones(self) -> tuple:
        return (self.backbone, self.decoder_backbone)

    @property
    def preprocessor(self):
        """`{"source", "target"}` strings -> training examples, a Keras layer
        for `tf.data` (`keras_attn.text.TranslatorPreprocessor` of the
        tokenizers, the source positions and `sequence_length` target ids;
        built once per pair of tokenizers)."""
        tokenizers = [
            _task.require_tokenizer(self, name, "preprocessor")
            for name in ("source_tokenizer", "target_tokenizer")
        ]

        def build():
            from keras_attn.text import TranslatorPreprocessor

            return TranslatorPreprocessor(
                *tokenizers, self.source_sequence_length, self.sequence_length
            )

        return _task.cached(self, "preprocessor", tokenizers, build)

    @property
    def normalize_first(self) -> bool:
        return self.backbone.normalize_first or self.decoder_backbone.normalize_first

    @property
    def encoder_layout(self) -> str:
        """`"bert"` for an encoder of BERT's layout (an embedding layer norm),
        else `"transformer"`."""
        return "bert" if self.backbone.embedding_norm is not None else "transformer"

    @classmethod
    def from_bert(
        cls,
        checkpoint,
        target_vocabulary_size: int,
        sequence_length: int = 128,
        embedding_dim: int | None = None,
        num_decoder_layers: int = 3,
        num_heads: int | None = None,
        intermediate_dim: int | None = None,
        dropout: float = 0.1,
        tie_embeddings: bool = True,
        freeze_source_embedding: bool = True,
        **kwargs,
    ) -> TransformerTranslator:
        """A translator whose encoder is a pretrained BERT-style checkpoint's.

        The encoder is `TransformerEncoderBackbone.from_bert(checkpoint)`
        (the checkpoint's sizes and weights); the decoder, a pre-norm
        `TransformerDecoderBackbone` with sinusoidal positions and its own
        target vocabulary, starts fresh. Inputs are the checkpoint's
        WordPiece ids (`checkpoint.tokenizer()`, the natural
        `source_tokenizer`), at most `checkpoint.max_positions` long.

        Args:
            checkpoint: a `keras_attn.checkpoints.BertCheckpoint`.
            target_vocabulary_size: target ids are in `[0, size)`, with
                `keras_attn.text`'s special ids (0 padding, 2 start, 3 end).
            sequence_length: the longest decoder input.
            embedding_dim, num_heads, intermediate_dim: the decoder's; by
                default the encoder's.
            num_decoder_layers, dropout, tie_embeddings: as in the
                constructor (BERT's own dropout is 0.1).
            freeze_source_embedding: keep the pretrained token and position
                table fixed.
            **kwargs: other constructor arguments (`source_tokenizer`,
                `target_tokenizer`, `name`, ...).
        """
        backbone = TransformerEncoderBackbone.from_bert(checkpoint, dropout=dropout)
        embedding_dim = embedding_dim or checkpoint.hidden_size
        decoder_backbone = TransformerDecoderBackbone(
            **decoder_sizes(
                target_vocabulary_size,
                sequence_length,
                embedding_dim,
                num_decoder_layers,
                num_heads or checkpoint.num_heads,
                intermediate_dim or checkpoint.intermediate_size,
                dropout,
                "sinusoidal",
                normalize_first=True,
                encoder_dim=checkpoint.hidden_size,
            )
        )
        return cls(
            backbone=backbone,
            decoder_backbone=decoder_backbone,
            tie_embeddings=tie_embeddings,
            freeze_source_embedding=freeze_source_embedding,
            **kwargs,
        )

    # -- the decoding contract -------------------------------------------------

    def encode_source(self, encoder_inputs):
        """`(encoder_outputs (B, S, d), source_mask (B, S))` of source ids."""
        encoder_inputs = ops.convert_to_tensor(encoder_inputs, "int32")
        mask = ops.not_equal(encoder_inputs, 0)  # (B, S)
        return self.backbone.encode(encoder_inputs, padding_mask=mask), mask

    def encode(self, encoder_inputs, max_length):
        """The decoding cache of a batch of sources, for `max_length` target
        positions: the encoder runs once, every decoder block's
        cross-attention keys and values are computed once. A dict with batch
        on axis 0: `memory_mask` `(B, S)`, `cross` (one `(key, value)` per
        block), `self` (one zero `(key_cache, value_cache)` of `max_length`
        positions per block)."""
        x, mask = self.encode_source(encoder_inputs)
        batch = ops.shape(mask)[0]
        return {
            "memory_mask": mask,
            "cross": tuple(
                block.compute_cross_attention_cache(x) for block in self.decoder_blocks
            ),
            "self": tuple(
                block.initial_cache(batch, max_length) for block in self.decoder_blocks
            ),
        }

    def _to_logits(self, states):
        if self.tie_embeddings:
            return self.logits_layer(self.target_embedding(states, reverse=True))
        return self.logits_layer(states)

    def call_with_cache(self, token_ids, cache, index, nearest_neighbors=None):
        """One decoding call: decoder tokens `(B, T)` at positions
        `index .. index + T - 1` -> `(logits (B, T, vocab) float32, cache)`.
        `index` is an int, a scalar, or an int tensor `(B,)` placing each row
        at its own position (speculative decoding).

        With `nearest_neighbors` (a `keras_attn.memory.NearestNeighborDecoding`)
        the first output is the log-probabilities of the kNN-MT mixture
        instead (which the samplers' log-softmax leaves as they are).
        """
        if kv_cache.is_per_row(index):  # speculative decoding
            positions = kv_cache.row_positions(index, ops.shape(token_ids)[1])
            # A speculative block may run past the positions; those outputs
            # are never used, but a learned table has no row there.
            if self.sequence_length is not None:
                positions = ops.minimum(positions, self.sequence_length - 1)
            y = self.target_embedding(token_ids, positions=positions)  # (B, T, d)
        else:
            y = self.target_embedding(token_ids, start_index=index)  # (B, T, d)
        new_self = []
        for block, self_cache, cross_cache in zip(
            self.decoder_blocks, cache["self"], cache["cross"], strict=True
        ):
            y, self_cache = block(
                y,
                encoder_padding_mask=cache["memory_mask"],
                self_attention_cache=self_cache,
                cross_attention_cache=cross_cache,
                cache_update_index=index,
            )
            new_self.append(self_cache)
        if self.decoder_norm is not None:
            y = self.decoder_norm(y)
        logits = self._to_logits(y)
        if nearest_neighbors is not None:
            batch, steps = ops.shape(y)[0], ops.shape(y)[1]
            mixed = nearest_neighbors.mix_fn()(
                ops.reshape(y, (batch * steps, y.shape[-1])),
                ops.reshape(logits, (batch * steps, logits.shape[-1])),
            )
            logits = ops.reshape(mixed, (batch, steps, logits.shape[-1]))
        return logits, dict(cache, self=tuple(new_self))

    def call_with_states(self, inputs, training=False):
        """`(states, logits)`, teacher-forced: `states` `(B, T, d)` are the
        decoder's last hidden states, those the output projection turns into
        `logits` (after the final norm of a pre-norm decoder): the keys of a
        kNN-MT datastore. One call of the model's own graph gives both."""
        with sequence_length_bound(self.longest_input()):
            return self._states_model(inputs, training=training)

    def attention_maps(self, encoder_inputs, decoder_inputs) -> dict:
        """The attention weights of a teacher-forced pass, float32:
        `"cross_attention"`, one `(B, heads, T, S)` per decoder block, and
        `"alignment"` `(B, T, S)`, the last block's averaged over its heads
        (what the export's `translate_with_alignment` serves)."""
        decoder_inputs = ops.convert_to_tensor(decoder_inputs, "int32")
        target_mask = ops.not_equal(decoder_inputs, 0)
        x, source_mask = self.encode_source(encoder_inputs)
        y = self.target_embedding(decoder_inputs)
        cross = []
        for block in self.decoder_blocks:
            y, scores = block(
                y,
                x,
                decoder_padding_mask=target_mask,
                encoder_padding_mask=source_mask,
                return_attention_scores=True,
            )
            cross.append(ops.cast(scores["cross_attention"], "float32"))
        return {"cross_attention": cross, "alignment": ops.mean(cross[-1], axis=1)}

    # -- TF Serving (`Translator.serving_spec`) --------------------------------

    model_kind = "transformer"
    per_row_cache = True

    def alignment_description(self) -> str:
        return "cross-attention of the last decoder block, averaged over heads"

    def get_config(self):
        return {
            "name": self.name,
            "trainable": self.trainable,
            "backbone": keras.saving.serialize_keras_object(self.backbone),
            "decoder_backbone": keras.saving.serialize_keras_object(
                self.decoder_backbone
            ),
            "shared_vocabulary": self.shared_vocabulary,
            "tie_embeddings": self.tie_embeddings,
            "freeze_source_embedding": self.freeze_source_embedding,
            **self._tokenizer_config(),
            "assistant_model": _task.serialize_assistant(
                self.assistant_model, ("source_tokenizer", "target_tokenizer")
            ),
            **self.head_policy_config(),
        }

    @classmethod
    def from_config(cls, config):
        config = _task.deserialize_assistant(config)
        config = deserialize_dtype(config)  # a quantized head's map
        for name in ("source_tokenizer", "target_tokenizer"):
            config[name] = _task.deserialize_tokenizer(config.get(name))
        if "backbone" in config:
            backbone = deserialize_backbone(config.pop("backbone"))
            extra = {}
            if config.get("shared_vocabulary"):
                extra["token_embedding"] = backbone.embedding
            decoder = deserialize_backbone(config.pop("decoder_backbone"), **extra)
            return cls(backbone=backbone, decoder_backbone=decoder, **config)
        # A config saved before the backbones (keras-attn 0.2, and this
        # version until the backbones).
        with blocks_of_config(config):  # 0.2's: blocks of that structure
            return cls(**config)
