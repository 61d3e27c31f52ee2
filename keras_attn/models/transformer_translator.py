"""`TransformerTranslator`: Vaswani et al.'s encoder-decoder (2017)."""

from __future__ import annotations

import keras
from keras import ops

from keras_attn import _validation as v
from keras_attn.layers._transformer_block import (
    block_class,
    block_structure_config,
    blocks_of_config,
)
from keras_attn.layers.token_and_position_embedding import TokenAndPositionEmbedding
from keras_attn.layers.transformer_decoder_block import TransformerDecoderBlock
from keras_attn.layers.transformer_encoder_block import TransformerEncoderBlock
from keras_attn.models import _task
from keras_attn.models.translator import Translator

ENCODER_LAYOUTS = ("transformer", "bert")
POSITIONS = ("sinusoidal", "learned")


def translator_embedding(
    vocabulary_size, sequence_length, embedding_dim, name, position
):
    """A translator's `TokenAndPositionEmbedding`: scaled by `sqrt(d)` as in
    the paper, initialised with standard deviation `d ** -0.5` (so tied
    output logits start near unit scale), padding (id 0) masked."""
    return TokenAndPositionEmbedding(
        vocabulary_size,
        sequence_length,
        embedding_dim,
        position=position,
        mask_zero=True,
        position_initializer="glorot_uniform",
        scale_embeddings=True,
        embeddings_initializer=keras.initializers.RandomNormal(
            stddev=embedding_dim**-0.5
        ),
        name=name,
    )


@keras.saving.register_keras_serializable(package="keras_attn")
class TransformerTranslator(Translator):
    """Vaswani et al.'s encoder-decoder Transformer for translation.

    Inputs `{"encoder_inputs": (batch, S), "decoder_inputs": (batch, T)}` int
    ids, 0 = padding; output float32 logits `(batch, T, target_vocabulary_size)`
    predicting token `t + 1` at position `t`. Source and target tokens get
    `TokenAndPositionEmbedding`s (scaled by `sqrt(d)` as in the paper), one
    table for both with `shared_vocabulary=True`. With `tie_embeddings=True`
    the output projection is the transposed target embedding (section 3.4 of
    the paper). `normalize_first=True` gives pre-norm blocks and a final
    layer norm, which train more stably without warm-up.

    `encoder_layout="bert"` makes the encoder a BERT encoder (learned
    positions, no scaling, an embedding layer norm, post-norm GELU blocks
    with `encoder_layer_norm_epsilon`) of its own sizes (`encoder_dim`,
    `encoder_num_heads`, `encoder_intermediate_dim`, `source_sequence_length`):
    what `from_bert` loads a pretrained checkpoint into.

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
        **kwargs: `keras.Model` arguments (`name`, `dtype`, `trainable`).
    """

    def __init__(
        self,
        source_vocabulary_size: int,
        target_vocabulary_size: int,
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
        **kwargs,
    ):
        kwargs.setdefault("name", "transformer_translator")
        for name, value in (
            ("source_vocabulary_size", source_vocabulary_size),
            ("target_vocabulary_size", target_vocabulary_size),
            ("sequence_length", sequence_length),
            ("embedding_dim", embedding_dim),
            ("num_encoder_layers", num_encoder_layers),
            ("num_decoder_layers", num_decoder_layers),
        ):
            v.check_positive_int(name, value)
        for name, value in (
            ("encoder_dim", encoder_dim),
            ("encoder_num_heads", encoder_num_heads),
            ("encoder_intermediate_dim", encoder_intermediate_dim),
            ("source_sequence_length", source_sequence_length),
        ):
            v.check_positive_int(name, value, allow_none=True)
        v.check_rate("dropout", dropout)
        v.check_choice("position", position, POSITIONS)
        v.check_choice("encoder_layout", encoder_layout, ENCODER_LAYOUTS)
        bert = encoder_layout == "bert"
        if shared_vocabulary and (
            source_vocabulary_size != target_vocabulary_size
            or bert
            or (encoder_dim or embedding_dim) != embedding_dim
        ):
            raise ValueError(
                "A shared vocabulary needs equal vocabulary sizes and widths and "
                "the Transformer encoder layout. Received: "
                f"source_vocabulary_size={source_vocabulary_size}, "
                f"target_vocabulary_size={target_vocabulary_size}, "
                f"encoder_dim={encoder_dim}, encoder_layout={encoder_layout!r}"
            )
        source_tokenizer = _task.check_tokenizer("source_tokenizer", source_tokenizer)
        target_tokenizer = _task.check_tokenizer("target_tokenizer", target_tokenizer)
        epsilon = encoder_layer_norm_epsilon
        if epsilon is None:
            epsilon = 1e-12 if bert else 1e-5
        source_dim = encoder_dim or embedding_dim
        source_length = source_sequence_length or sequence_length

        encoder_inputs = keras.Input((None,), dtype="int32", name="encoder_inputs")
        decoder_inputs = keras.Input((None,), dtype="int32", name="decoder_inputs")

        # The layers are made and called in graph order (their initializers
        # draw their seeds as they are made).
        if bert:
            self.source_embedding = TokenAndPositionEmbedding(
                source_vocabulary_size,
                source_length,
                source_dim,
                position="learned",
                mask_zero=True,
                position_initializer="glorot_uniform",
                trainable=not freeze_source_embedding,
                name="source_embedding",
            )
        elif shared_vocabulary:
            self.source_embedding = translator_embedding(
                source_vocabulary_size,
                sequence_length,
                embedding_dim,
                "shared_embedding",
                position,
            )
        else:
            self.source_embedding = translator_embedding(
                source_vocabulary_size,
                source_length,
                source_dim,
                "source_embedding",
                position,
            )
            self.target_embedding = translator_embedding(
                target_vocabulary_size,
                sequence_length,
                embedding_dim,
                "target_embedding",
                position,
            )
        if freeze_source_embedding:
            self.source_embedding.trainable = False
        x = self.source_embedding(encoder_inputs)  # (B, S, d), masked
        self.source_embedding_norm = None
        if bert:
            self.source_embedding_norm = keras.layers.LayerNormalization(
                epsilon=epsilon, name="source_embedding_norm"
            )
            x = self.source_embedding_norm(x)
        x = keras.layers.Dropout(dropout, name="source_dropout")(x)
        encoder_normalize_first = normalize_first and not bert
        self.encoder_blocks = []
        for index in range(num_encoder_layers):
            block = block_class(TransformerEncoderBlock)(
                num_heads=encoder_num_heads or num_heads,
                intermediate_dim=encoder_intermediate_dim or intermediate_dim,
                dropout=dropout,
                normalize_first=encoder_normalize_first,
                activation="gelu" if bert else "relu",
                layer_norm_epsilon=epsilon,
                name=f"encoder_{index}",
            )
            x = block(x)
            self.encoder_blocks.append(block)
        self.encoder_norm = None
        if encoder_normalize_first:
            self.encoder_norm = keras.layers.LayerNormalization(
                epsilon=epsilon, name="encoder_norm"
            )
            x = self.encoder_norm(x)
        encoder_outputs = x

        if bert:
            self.target_embedding = translator_embedding(
                target_vocabulary_size,
                sequence_length,
                embedding_dim,
                "target_embedding",
                position,
            )
        elif shared_vocabulary:
            self.target_embedding = self.source_embedding
        y = self.target_embedding(decoder_inputs)  # (B, T, d), masked
        y = keras.layers.Dropout(dropout, name="target_dropout")(y)
        # A pretrained (post-norm) encoder gets a pre-norm decoder.
        decoder_normalize_first = normalize_first or bert
        self.decoder_blocks = []
        for index in range(num_decoder_layers):
            block = block_class(TransformerDecoderBlock)(
                num_heads=num_heads,
                intermediate_dim=intermediate_dim,
                dropout=dropout,
                normalize_first=decoder_normalize_first,
                name=f"decoder_{index}",
            )
            y = block(y, encoder_outputs)
            self.decoder_blocks.append(block)
        self.decoder_norm = None
        if decoder_normalize_first:
            self.decoder_norm = keras.layers.LayerNormalization(
                epsilon=1e-5, name="decoder_norm"
            )
            y = self.decoder_norm(y)
        states = y
        if tie_embeddings:
            self.logits_layer = keras.layers.Activation(
                "linear", dtype="float32", name="logits"
            )
            logits = self.logits_layer(self.target_embedding(y, reverse=True))
        else:
            self.logits_layer = keras.layers.Dense(
                target_vocabulary_size, dtype="float32", name="logits"
            )
            logits = self.logits_layer(y)
        inputs = {"encoder_inputs": encoder_inputs, "decoder_inputs": decoder_inputs}
        super().__init__(inputs, logits, **kwargs)
        # The same graph with the decoder's last states as a second output;
        # kept out of Keras' tracking (it holds no state of its own).
        object.__setattr__(self, "_states_model", keras.Model(inputs, [states, logits]))

        self.source_vocabulary_size = source_vocabulary_size
        self.target_vocabulary_size = target_vocabulary_size
        self.sequence_length = sequence_length
        self.embedding_dim = embedding_dim
        self.num_encoder_layers = num_encoder_layers
        self.num_decoder_layers = num_decoder_layers
        self.num_heads = num_heads
        self.intermediate_dim = intermediate_dim
        self.dropout = dropout
        self.shared_vocabulary = shared_vocabulary
        self.tie_embeddings = tie_embeddings
        self.normalize_first = normalize_first
        self.position = position
        self.encoder_layout = encoder_layout
        self.encoder_dim = encoder_dim
        self.encoder_num_heads = encoder_num_heads
        self.encoder_intermediate_dim = encoder_intermediate_dim
        self.source_sequence_length = source_sequence_length
        self.encoder_layer_norm_epsilon = encoder_layer_norm_epsilon
        self.freeze_source_embedding = freeze_source_embedding
        self.source_tokenizer = source_tokenizer
        self.target_tokenizer = target_tokenizer

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

        The encoder (`encoder_layout="bert"`, the checkpoint's sizes) gets
        the checkpoint's weights (`keras_attn.checkpoints.load_bert_encoder`);
        the decoder, a pre-norm `TransformerDecoderBlock` stack with
        sinusoidal positions and its own target vocabulary, starts fresh.
        Inputs are the checkpoint's WordPiece ids (`checkpoint.tokenizer()`,
        the natural `source_tokenizer`), at most `checkpoint.max_positions`
        long.

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
        from keras_attn.checkpoints import load_bert_encoder

        model = cls(
            len(checkpoint.vocabulary),
            target_vocabulary_size,
            sequence_length=sequence_length,
            embedding_dim=embedding_dim or checkpoint.hidden_size,
            num_encoder_layers=checkpoint.num_layers,
            num_decoder_layers=num_decoder_layers,
            num_heads=num_heads or checkpoint.num_heads,
            intermediate_dim=intermediate_dim or checkpoint.intermediate_size,
            dropout=dropout,
            tie_embeddings=tie_embeddings,
            encoder_layout="bert",
            encoder_dim=checkpoint.hidden_size,
            encoder_num_heads=checkpoint.num_heads,
            encoder_intermediate_dim=checkpoint.intermediate_size,
            source_sequence_length=checkpoint.max_positions,
            encoder_layer_norm_epsilon=checkpoint.layer_norm_epsilon,
            freeze_source_embedding=freeze_source_embedding,
            **kwargs,
        )
        load_bert_encoder(
            checkpoint,
            model.source_embedding,
            model.source_embedding_norm,
            model.encoder_blocks,
        )
        return model

    # -- the decoding contract -------------------------------------------------

    def encode_source(self, encoder_inputs):
        """`(encoder_outputs (B, S, d), source_mask (B, S))` of source ids."""
        encoder_inputs = ops.convert_to_tensor(encoder_inputs, "int32")
        mask = ops.not_equal(encoder_inputs, 0)  # (B, S)
        x = self.source_embedding(encoder_inputs)
        if self.source_embedding_norm is not None:
            x = self.source_embedding_norm(x)
        for block in self.encoder_blocks:
            x = block(x, padding_mask=mask)
        if self.encoder_norm is not None:
            x = self.encoder_norm(x)
        return x, mask

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

        With `nearest_neighbors` (a `keras_attn.memory.NearestNeighborDecoding`)
        the first output is the log-probabilities of the kNN-MT mixture
        instead (which the samplers' log-softmax leaves as they are).
        """
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

    def get_config(self):
        return {
            "name": self.name,
            "trainable": self.trainable,
            "source_vocabulary_size": self.source_vocabulary_size,
            "target_vocabulary_size": self.target_vocabulary_size,
            "sequence_length": self.sequence_length,
            "embedding_dim": self.embedding_dim,
            "num_encoder_layers": self.num_encoder_layers,
            "num_decoder_layers": self.num_decoder_layers,
            "num_heads": self.num_heads,
            "intermediate_dim": self.intermediate_dim,
            "dropout": self.dropout,
            "shared_vocabulary": self.shared_vocabulary,
            "tie_embeddings": self.tie_embeddings,
            "normalize_first": self.normalize_first,
            "position": self.position,
            "encoder_layout": self.encoder_layout,
            "encoder_dim": self.encoder_dim,
            "encoder_num_heads": self.encoder_num_heads,
            "encoder_intermediate_dim": self.encoder_intermediate_dim,
            "source_sequence_length": self.source_sequence_length,
            "encoder_layer_norm_epsilon": self.encoder_layer_norm_epsilon,
            "freeze_source_embedding": self.freeze_source_embedding,
            **self._tokenizer_config(),
            **block_structure_config(self.encoder_blocks + self.decoder_blocks),
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        with blocks_of_config(config):  # old configs: blocks of their structure
            return super().from_config(config)
