"""`RNNTranslator`: the attentional RNN translator of the lectures (Bahdanau
et al. 2015; Luong et al. 2015)."""

from __future__ import annotations

import keras
from keras import ops

from keras_attn import _validation as v
from keras_attn.layers.bahdanau_attention import BahdanauAttention
from keras_attn.layers.bahdanau_decoder import BahdanauDecoder
from keras_attn.layers.luong_attention import LuongAttention
from keras_attn.models.quantization import float32_head_policy
from keras_attn.models.task import serialize_dtype_policy
from keras_attn.models.translator import Translator

ATTENTIONS = ("bahdanau", "luong_dot", "luong_general", "luong_concat")


@keras.saving.register_keras_serializable(package="keras_attn")
class Float32Orthogonal(keras.initializers.Orthogonal):
    """Keras's `Orthogonal` initializer drawn in float32 and cast to the
    variable's dtype: its QR decomposition has no bfloat16 or float16
    kernel (JAX: "Unsupported dtype bfloat16"), which a GRU's recurrent
    kernel under the `"bfloat16"` policy needs. The same values as
    `Orthogonal` in float32."""

    def __call__(self, shape, dtype=None):
        return ops.cast(super().__call__(shape, dtype="float32"), dtype or "float32")


@keras.saving.register_keras_serializable(package="keras_attn")
class RNNTranslator(Translator):
    """Attentional RNN encoder-decoder, trained with teacher forcing.

    - Encoder: token embedding, a bidirectional GRU with `units // 2` units per
      direction; its outputs `h_j` (`units` wide) are the attention memory and
      its two final states, concatenated, start the decoder.
    - `attention="bahdanau"` (Bahdanau et al. 2015): the decoder attends from
      its *previous* state `s_{i-1}` and reads `[y_{i-1}; c_i]`
      (`keras_attn.layers.BahdanauDecoder` over a `GRUCell` and a
      `BahdanauAttention`); the output layer sees `[s_i; c_i]`.
    - `attention="luong_dot" | "luong_general" | "luong_concat"` (Luong et al.
      2015, global attention without input feeding): a GRU runs over the
      target, each *current* state `h_t` attends to the encoder with the chosen
      score, and the attentional state `h̃_t = tanh(W_c [c_t; h_t])` feeds the
      output layer.

    Inputs: `{"encoder_inputs": (batch, Ts), "decoder_inputs": (batch, Tt)}`
    int token ids with 0 as padding. Output: float32 logits
    `(batch, Tt, target_vocabulary_size)`. Decoding and text: see
    `Translator` (`encode`, `call_with_cache`, `translate`, `export`).

    Args:
        source_vocabulary_size, target_vocabulary_size: vocabulary sizes.
        embedding_dim: size of both token embeddings.
        units: decoder GRU units (the encoder has `units // 2` per direction);
            must be even.
        attention: one of `"bahdanau"`, `"luong_dot"`, `"luong_general"`,
            `"luong_concat"`.
        attention_units: units of the additive / concat score (default `units`).
        dropout: dropout on embeddings and before the output layer.
        source_tokenizer, target_tokenizer: tokenizers of `translate` and
            `export` (optional).
        dtype: keyword-only, the dtype policy of every layer (the logits
            stay float32); default the global policy. Recorded in the
            config: after `quantize`, a `DTypePolicyMap` of the quantized
            layers' policies by path (the `logits` layer's included), from
            which they are built quantized.
        **kwargs: `keras.Model` arguments (`name`, `trainable`).
    """

    def __init__(
        self,
        source_vocabulary_size: int,
        target_vocabulary_size: int,
        embedding_dim: int = 256,
        units: int = 512,
        attention: str = "bahdanau",
        attention_units: int | None = None,
        dropout: float = 0.2,
        source_tokenizer=None,
        target_tokenizer=None,
        *,
        dtype=None,
        **kwargs,
    ):
        kwargs.setdefault("name", "rnn_translator")
        v.check_positive_int("source_vocabulary_size", source_vocabulary_size)
        v.check_positive_int("target_vocabulary_size", target_vocabulary_size)
        v.check_positive_int("embedding_dim", embedding_dim)
        v.check_positive_int("units", units)
        if units % 2:
            raise ValueError(f"`units` must be even. Received: units={units}")
        v.check_choice("attention", attention, ATTENTIONS)
        v.check_positive_int("attention_units", attention_units, allow_none=True)
        score_units = attention_units or units
        v.check_rate("dropout", dropout)
        source_tokenizer = v.check_tokenizer("source_tokenizer", source_tokenizer)
        target_tokenizer = v.check_tokenizer("target_tokenizer", target_tokenizer)

        encoder_inputs = keras.Input((None,), dtype="int32", name="encoder_inputs")
        decoder_inputs = keras.Input((None,), dtype="int32", name="decoder_inputs")
        # Made and called in graph order (initializers draw their seeds as
        # they are made).
        self.source_embedding = keras.layers.Embedding(
            source_vocabulary_size,
            embedding_dim,
            mask_zero=True,
            dtype=dtype,
            name="source_embedding",
        )
        source = self.source_embedding(encoder_inputs)
        source = keras.layers.Dropout(dropout, dtype=dtype, name="source_dropout")(
            source
        )
        self.encoder = keras.layers.Bidirectional(
            keras.layers.GRU(
                units // 2,
                return_sequences=True,
                return_state=True,
                recurrent_initializer=Float32Orthogonal(),
                dtype=dtype,
            ),
            dtype=dtype,
            name="encoder",
        )
        encoder_outputs, forward_state, backward_state = self.encoder(
            source
        )  # (B, Ts, units), (B, units // 2) x 2
        decoder_state = keras.layers.Concatenate(dtype=dtype, name="encoder_state")(
            [forward_state, backward_state]
        )  # (B, units)

        self.target_embedding = keras.layers.Embedding(
            target_vocabulary_size,
            embedding_dim,
            mask_zero=True,
            dtype=dtype,
            name="target_embedding",
        )
        target = self.target_embedding(decoder_inputs)
        target = keras.layers.Dropout(dropout, dtype=dtype, name="target_dropout")(
            target
        )

        if attention == "bahdanau":
            cell = keras.layers.GRUCell(
                units,
                recurrent_initializer=Float32Orthogonal(),
                dtype=dtype,
                name="cell",
            )
            self.decoder = BahdanauDecoder(
                cell,
                BahdanauAttention(score_units, dtype=dtype, name="attention"),
                dtype=dtype,
                name="decoder",
            )
            self.attention_layer = self.decoder.attention
            features = self.decoder(
                target, encoder_outputs, decoder_state
            )  # (B, Tt, 2 * units): [s_i; c_i]
        else:
            score = attention.split("_", 1)[1]
            self.decoder = keras.layers.GRU(
                units,
                return_sequences=True,
                recurrent_initializer=Float32Orthogonal(),
                dtype=dtype,
                name="decoder",
            )
            decoder_outputs = self.decoder(
                target, initial_state=decoder_state
            )  # (B, Tt, units)
            self.attention_layer = LuongAttention(
                score=score,
                units=score_units if score == "concat" else None,
                dtype=dtype,
                name="attention",
            )
            context = self.attention_layer(
                decoder_outputs, encoder_outputs
            )  # (B, Tt, units)
            features = keras.layers.Concatenate(dtype=dtype, name="context_and_state")(
                [context, decoder_outputs]
            )  # (B, Tt, 2 * units): [c_t; h_t]
        self.attentional = keras.layers.Dense(
            units,
            activation="tanh",
            use_bias=attention == "bahdanau",
            dtype=dtype,
            name="attentional",
        )  # Luong's h̃_t = tanh(W_c [c_t; h_t]); Bahdanau's output layer
        hidden = self.attentional(features)
        hidden = keras.layers.Dropout(dropout, dtype=dtype, name="output_dropout")(
            hidden
        )
        self.logits_layer = keras.layers.Dense(
            target_vocabulary_size, dtype=float32_head_policy(dtype), name="logits"
        )  # float32 logits; quantized by its path when `dtype` is a map
        logits = self.logits_layer(hidden)
        super().__init__(
            {"encoder_inputs": encoder_inputs, "decoder_inputs": decoder_inputs},
            logits,
            **kwargs,
        )
        if dtype is not None:
            self.dtype_policy = keras.dtype_policies.get(dtype)
        self.source_vocabulary_size = source_vocabulary_size
        self.target_vocabulary_size = target_vocabulary_size
        self.embedding_dim = embedding_dim
        self.units = units
        self.attention = attention
        self.attention_units = attention_units
        self.dropout = dropout
        self.source_tokenizer = source_tokenizer
        self.target_tokenizer = target_tokenizer

    # -- the decoding contract -------------------------------------------------

    def encode(self, encoder_inputs, max_length=None):
        """The decoding cache of a batch of sources: the encoder runs once. A
        dict of tensors with batch on axis 0 (`state`, `memory`,
        `memory_mask`, and for Bahdanau attention `projected_memory`, the
        attention's `W_k h_j`), which beam search repeats and reorders.
        `max_length` is unused (the recurrent state carries the position)."""
        del max_length
        encoder_inputs = ops.convert_to_tensor(encoder_inputs, "int32")
        mask = ops.not_equal(encoder_inputs, 0)  # (B, Ts)
        embedded = self.source_embedding(encoder_inputs)
        memory, forward_state, backward_state = self.encoder(embedded, mask=mask)
        state = ops.concatenate([forward_state, backward_state], axis=-1)
        cache = {"state": state, "memory": memory, "memory_mask": mask}
        if self.attention == "bahdanau":
            cache["projected_memory"] = self.decoder.project_memory(memory)
        return cache

    def _step(self, token_ids, cache):
        """`(B, 1)` tokens -> float32 logits `(B, vocab)`, new state, weights
        `(B, Ts)`."""
        embedded = self.target_embedding(token_ids)[:, 0]  # (B, E)
        state, memory, mask = cache["state"], cache["memory"], cache["memory_mask"]
        if self.attention == "bahdanau":
            features, new_state, weights = self.decoder.step(
                embedded, state, memory, mask, cache.get("projected_memory")
            )  # [s_i; c_i]
        else:
            _, new_states = self.decoder.cell(embedded, [state])
            new_state = (
                new_states[0] if isinstance(new_states, (list, tuple)) else new_states
            )
            context, weights = self.attention_layer(
                new_state, memory, value_mask=mask, return_attention_scores=True
            )
            features = ops.concatenate(
                [ops.cast(context, new_state.dtype), new_state], -1
            )  # [c_t; h_t]
        logits = self.logits_layer(self.attentional(features))
        return logits, new_state, weights

    def call_with_cache(self, token_ids, cache, index=None, nearest_neighbors=None):
        """One decoder step for `token_ids` `(B, 1)` -> `(logits (B, vocab)
        float32, cache)`: the `keras_attn.generation` contract. `index` is
        unused (the recurrent state carries the position)."""
        del index
        if nearest_neighbors is not None:
            raise ValueError(
                "`nearest_neighbors` (kNN-MT) needs a Transformer translator. "
                f"Received: the RNN translator {self.name!r}"
            )
        logits, new_state, _ = self._step(token_ids, cache)
        return logits, dict(cache, state=ops.cast(new_state, cache["state"].dtype))

    def attention_maps(self, encoder_inputs, decoder_inputs) -> dict:
        """`{"alignment": (B, Tt, Ts)}` float32: the attention weights of
        every target step over the source, teacher-forced (for the Bahdanau
        decoder those computed from `s_{i-1}`, for Luong from `h_t`)."""
        cache = self.encode(encoder_inputs)
        decoder_inputs = ops.convert_to_tensor(decoder_inputs, "int32")
        steps = ops.transpose(decoder_inputs, (1, 0))[:, :, None]  # (Tt, B, 1)

        def scan_step(carry, token_ids):
            _, new_state, weights = self._step(token_ids, carry[0])
            new_cache = dict(
                carry[0], state=ops.cast(new_state, carry[0]["state"].dtype)
            )
            new_carry = (new_cache, ops.cast(weights, "float32"))
            return new_carry, new_carry

        initial_weights = ops.zeros(ops.shape(cache["memory_mask"]), "float32")
        _, (_, weights) = ops.scan(scan_step, (cache, initial_weights), steps)
        return {"alignment": ops.transpose(weights, (1, 0, 2))}  # (B, Tt, Ts)

    # -- TF Serving (`Translator.serving_spec`) --------------------------------

    model_kind = "rnn"

    def alignment_description(self) -> str:
        return f"attention weights of the decoder's {self.attention} attention"

    def get_config(self):
        return {
            "name": self.name,
            "trainable": self.trainable,
            "source_vocabulary_size": self.source_vocabulary_size,
            "target_vocabulary_size": self.target_vocabulary_size,
            "embedding_dim": self.embedding_dim,
            "units": self.units,
            "attention": self.attention,
            "attention_units": self.attention_units,
            "dropout": self.dropout,
            **self._tokenizer_config(),
            "dtype": serialize_dtype_policy(self),
        }
