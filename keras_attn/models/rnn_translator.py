"""The classic attentional RNN translator (Bahdanau et al.; Luong et al.)."""

from __future__ import annotations

import keras
from keras import ops

from keras_attn import _validation as v
from keras_attn.layers.bahdanau_attention import BahdanauAttention
from keras_attn.layers.luong_attention import LuongAttention
from keras_attn.models._structure import translator_config

ATTENTIONS = ("bahdanau", "luong_dot", "luong_general", "luong_concat")


@keras.saving.register_keras_serializable(package="keras_attn")
class BahdanauDecoder(keras.layers.Layer):
    """GRU decoder that attends to the encoder states before every step.

    Bahdanau et al. (2015): at step `i` the context `c_i` is computed from the
    previous decoder state `s_{i-1}`, and the GRU reads `[y_{i-1}; c_i]`:

        c_i = Σ_j softmax_j(vᵀ tanh(W_q s_{i-1} + W_k h_j)) h_j
        s_i = GRU([y_{i-1}; c_i], s_{i-1})

    Args:
        units: GRU units.
        attention_units: units of the additive attention.
        **kwargs: base layer arguments.

    Call arguments:
        inputs: embedded target tokens `(batch, Tt, E)` (teacher forcing).
        encoder_outputs: `(batch, Ts, dv)`.
        initial_state: `(batch, units)`.
        encoder_outputs_mask: boolean `(batch, Ts)`; filled from a Keras mask.
        return_attention_scores: also return the weights `(batch, Tt, Ts)`.

    Returns:
        `(batch, Tt, units + dv)`: `[s_i; c_i]` at every step (and the weights
        with `return_attention_scores=True`).
    """

    def __init__(self, units: int, attention_units: int, **kwargs):
        super().__init__(**kwargs)
        self.units = v.check_positive_int("units", units)
        self.attention_units = v.check_positive_int("attention_units", attention_units)
        self.supports_masking = True

    def build(self, inputs_shape, encoder_outputs_shape, initial_state_shape=None):
        v.check_rank("inputs", inputs_shape, 3)
        v.check_rank("encoder_outputs", encoder_outputs_shape, 3)
        self.cell = keras.layers.GRUCell(
            self.units, dtype=self.dtype_policy, name="cell"
        )
        self.cell.build((None, inputs_shape[-1] + encoder_outputs_shape[-1]))
        self.attention = BahdanauAttention(
            self.attention_units, dtype=self.dtype_policy, name="attention"
        )
        self.attention.build((None, self.units), encoder_outputs_shape)
        self.built = True

    def project_memory(self, encoder_outputs):
        """`W_k h_j` of the attention, `(B, Ts, dv) -> (B, Ts, attention_units)`.

        Computed once per source; pass it to every `step`.
        """
        return self.attention.project_key(ops.cast(encoder_outputs, self.compute_dtype))

    def step(
        self, inputs, state, encoder_outputs, encoder_mask=None, projected_memory=None
    ):
        """One decoding step: `(B, E), (B, units) -> (B, units), (B, dv), (B, Ts)`.

        `projected_memory` is `project_memory(encoder_outputs)`; without it the
        step projects the encoder states itself.
        """
        context, weights = self.attention(
            state,
            encoder_outputs,
            value_mask=encoder_mask,
            return_attention_scores=True,
            projected_key=projected_memory,
        )  # (B, dv), (B, Ts)
        cell_inputs = ops.concatenate(
            [inputs, ops.cast(context, inputs.dtype)], axis=-1
        )  # (B, E + dv)
        _, new_states = self.cell(cell_inputs, [state])
        new_state = (
            new_states[0] if isinstance(new_states, (list, tuple)) else new_states
        )
        return new_state, context, weights

    def call(
        self,
        inputs,
        encoder_outputs,
        initial_state,
        encoder_outputs_mask=None,
        return_attention_scores: bool = False,
    ):
        steps = ops.transpose(inputs, (1, 0, 2))  # (Tt, B, E)
        # W_k h_j once per source, not at every step of the loop.
        projected_memory = self.project_memory(encoder_outputs)  # (B, Ts, units)

        # keras.ops.scan on TensorFlow needs the per-step outputs to have the
        # carry's structure, so the carry holds this step's outputs too.
        def scan_step(carry, inputs_t):
            state = carry[0]
            new_state, context, weights = self.step(
                inputs_t, state, encoder_outputs, encoder_outputs_mask, projected_memory
            )
            output = ops.concatenate(
                [new_state, ops.cast(context, new_state.dtype)], -1
            )
            new_carry = (new_state, output, ops.cast(weights, new_state.dtype))
            return new_carry, new_carry

        initial_state = ops.cast(initial_state, self.compute_dtype)
        batch = ops.shape(initial_state)[0]
        output_dim = self.units + encoder_outputs.shape[-1]
        initial_carry = (
            initial_state,  # (B, units)
            ops.zeros((batch, output_dim), self.compute_dtype),  # (B, units + dv)
            ops.zeros((batch, ops.shape(encoder_outputs)[1]), self.compute_dtype),
        )
        _, (_, outputs, weights) = ops.scan(scan_step, initial_carry, steps)
        outputs = ops.transpose(outputs, (1, 0, 2))  # (B, Tt, units + dv)
        if return_attention_scores:
            return outputs, ops.transpose(weights, (1, 0, 2))  # (B, Tt, Ts)
        return outputs

    def compute_output_spec(
        self,
        inputs,
        encoder_outputs,
        initial_state,
        encoder_outputs_mask=None,
        return_attention_scores=False,
    ):
        batch, length = inputs.shape[0], inputs.shape[1]
        outputs = keras.KerasTensor(
            (batch, length, self.units + encoder_outputs.shape[-1]),
            dtype=self.compute_dtype,
        )
        if not return_attention_scores:
            return outputs
        return outputs, keras.KerasTensor(
            (batch, length, encoder_outputs.shape[1]), dtype=self.compute_dtype
        )

    def compute_mask(self, inputs, previous_mask=None):
        return previous_mask

    def get_config(self):
        config = super().get_config()
        config.update({"units": self.units, "attention_units": self.attention_units})
        return config


def rnn_translator(
    source_vocabulary_size: int,
    target_vocabulary_size: int,
    embedding_dim: int = 256,
    units: int = 512,
    attention: str = "bahdanau",
    attention_units: int | None = None,
    dropout: float = 0.2,
    name: str = "rnn_translator",
) -> keras.Model:
    """Attentional RNN encoder-decoder of the lectures, trained with teacher forcing.

    - Encoder: token embedding, a bidirectional GRU with `units // 2` units per
      direction; its outputs `h_j` (`units` wide) are the attention memory and
      its two final states, concatenated, start the decoder.
    - `attention="bahdanau"` (Bahdanau et al. 2015): the decoder attends from
      its *previous* state `s_{i-1}` and reads `[y_{i-1}; c_i]`
      (`BahdanauDecoder`); the output layer sees `[s_i; c_i]`.
    - `attention="luong_dot" | "luong_general" | "luong_concat"` (Luong et al.
      2015, global attention without input feeding): a GRU runs over the
      target, each *current* state `h_t` attends to the encoder with the chosen
      score, and the attentional state `h̃_t = tanh(W_c [c_t; h_t])` feeds the
      output layer.

    Inputs: `{"encoder_inputs": (batch, Ts), "decoder_inputs": (batch, Tt)}`
    int token ids with 0 as padding. Output: float32 logits
    `(batch, Tt, target_vocabulary_size)`. Decode with
    `keras_attn.models.rnn_translator_decoding(model)`.

    Args:
        source_vocabulary_size, target_vocabulary_size: vocabulary sizes.
        embedding_dim: size of both token embeddings.
        units: decoder GRU units (the encoder has `units // 2` per direction);
            must be even.
        attention: one of `"bahdanau"`, `"luong_dot"`, `"luong_general"`,
            `"luong_concat"`.
        attention_units: units of the additive / concat score (default `units`).
        dropout: dropout on embeddings and before the output layer.
        name: model name.
    """
    v.check_positive_int("source_vocabulary_size", source_vocabulary_size)
    v.check_positive_int("target_vocabulary_size", target_vocabulary_size)
    v.check_positive_int("embedding_dim", embedding_dim)
    v.check_positive_int("units", units)
    if units % 2:
        raise ValueError(f"`units` must be even. Received: units={units}")
    v.check_choice("attention", attention, ATTENTIONS)
    attention_units = v.check_positive_int("attention_units", attention_units or units)
    v.check_rate("dropout", dropout)

    encoder_inputs = keras.Input((None,), dtype="int32", name="encoder_inputs")
    decoder_inputs = keras.Input((None,), dtype="int32", name="decoder_inputs")

    source = keras.layers.Embedding(
        source_vocabulary_size, embedding_dim, mask_zero=True, name="source_embedding"
    )(encoder_inputs)
    source = keras.layers.Dropout(dropout, name="source_dropout")(source)
    encoder_outputs, forward_state, backward_state = keras.layers.Bidirectional(
        keras.layers.GRU(units // 2, return_sequences=True, return_state=True),
        name="encoder",
    )(source)  # (B, Ts, units), (B, units // 2) x 2
    decoder_state = keras.layers.Concatenate(name="encoder_state")(
        [forward_state, backward_state]
    )  # (B, units)

    target = keras.layers.Embedding(
        target_vocabulary_size, embedding_dim, mask_zero=True, name="target_embedding"
    )(decoder_inputs)
    target = keras.layers.Dropout(dropout, name="target_dropout")(target)

    if attention == "bahdanau":
        features = BahdanauDecoder(units, attention_units, name="decoder")(
            target, encoder_outputs, decoder_state
        )  # (B, Tt, 2 * units): [s_i; c_i]
    else:
        score = attention.split("_", 1)[1]
        decoder_outputs = keras.layers.GRU(
            units, return_sequences=True, name="decoder"
        )(target, initial_state=decoder_state)  # (B, Tt, units)
        context = LuongAttention(
            score=score,
            units=attention_units if score == "concat" else None,
            name="attention",
        )(decoder_outputs, encoder_outputs)  # (B, Tt, units)
        features = keras.layers.Concatenate(name="context_and_state")(
            [context, decoder_outputs]
        )  # (B, Tt, 2 * units): [c_t; h_t]
    hidden = keras.layers.Dense(
        units, activation="tanh", use_bias=attention == "bahdanau", name="attentional"
    )(features)  # Luong's h̃_t = tanh(W_c [c_t; h_t]); Bahdanau's output layer
    hidden = keras.layers.Dropout(dropout, name="output_dropout")(hidden)
    logits = keras.layers.Dense(target_vocabulary_size, dtype="float32", name="logits")(
        hidden
    )
    model = keras.Model(
        {"encoder_inputs": encoder_inputs, "decoder_inputs": decoder_inputs},
        logits,
        name=name,
    )
    return model


def rnn_translator_decoding(model: keras.Model):
    """`(encode, next_fn)` for decoding an `rnn_translator` step by step.

    - `encode(encoder_inputs) -> cache`: runs the encoder once per source; the
      cache is a dict of tensors with batch on axis 0 (`state`, `memory`,
      `memory_mask`, and for Bahdanau attention `projected_memory`, the
      attention's `W_k h_j`), so beam search can repeat and reorder it.
    - `next_fn(token_ids, cache, index) -> (logits, cache)`: one decoder step
      for `token_ids` `(batch, 1)`, float32 logits `(batch, vocab)`: the
      `keras_attn.generation` contract. `index` is unused (the recurrent state
      carries the position).
    """
    layers = _decoding_layers(model)

    def encode(encoder_inputs):
        encoder_inputs = ops.convert_to_tensor(encoder_inputs, "int32")
        mask = ops.not_equal(encoder_inputs, 0)  # (B, Ts)
        embedded = layers["source_embedding"](encoder_inputs)
        memory, forward_state, backward_state = layers["encoder"](embedded, mask=mask)
        state = ops.concatenate([forward_state, backward_state], axis=-1)
        cache = {"state": state, "memory": memory, "memory_mask": mask}
        if layers["kind"] == "bahdanau":
            cache["projected_memory"] = layers["decoder"].project_memory(memory)
        return cache

    def next_fn(token_ids, cache, index=None):
        del index
        logits, new_state, _ = _decoder_step(layers, token_ids, cache)
        new_cache = dict(cache, state=ops.cast(new_state, cache["state"].dtype))
        return logits, new_cache

    return encode, next_fn


def rnn_translator_alignment(model: keras.Model):
    """`align(encoder_inputs, decoder_inputs) -> (batch, Tt, Ts)` float32 weights.

    The attention weights of every target step over the source: for the
    Bahdanau decoder those computed from `s_{i-1}`, for Luong from `h_t`.
    Run it on a decoded translation (teacher-forced) to draw alignments.
    """
    layers = _decoding_layers(model)
    encode, _ = rnn_translator_decoding(model)

    def align(encoder_inputs, decoder_inputs):
        cache = encode(encoder_inputs)
        decoder_inputs = ops.convert_to_tensor(decoder_inputs, "int32")
        steps = ops.transpose(decoder_inputs, (1, 0))[:, :, None]  # (Tt, B, 1)

        def scan_step(carry, token_ids):
            _, new_state, weights = _decoder_step(layers, token_ids, carry[0])
            new_cache = dict(
                carry[0], state=ops.cast(new_state, carry[0]["state"].dtype)
            )
            new_carry = (new_cache, ops.cast(weights, "float32"))
            return new_carry, new_carry

        initial_weights = ops.zeros(ops.shape(cache["memory_mask"]), "float32")
        _, (_, weights) = ops.scan(scan_step, (cache, initial_weights), steps)
        return ops.transpose(weights, (1, 0, 2))  # (B, Tt, Ts)

    return align


def _decoding_layers(model):
    names = [
        "source_embedding",
        "encoder",
        "target_embedding",
        "decoder",
        "attentional",
        "logits",
    ]
    attention = translator_config(model)["attention"]
    if attention != "bahdanau":
        names.append("attention")
    layers = {name: model.get_layer(name) for name in names}
    layers["kind"] = attention
    return layers


def _decoder_step(layers, token_ids, cache):
    """`(B, 1)` tokens -> float32 logits `(B, vocab)`, new state, weights `(B, Ts)`."""
    embedded = layers["target_embedding"](token_ids)[:, 0]  # (B, E)
    state, memory, mask = cache["state"], cache["memory"], cache["memory_mask"]
    if layers["kind"] == "bahdanau":
        new_state, context, weights = layers["decoder"].step(
            embedded, state, memory, mask, cache.get("projected_memory")
        )
        features = [new_state, ops.cast(context, new_state.dtype)]  # [s_i; c_i]
    else:
        _, new_states = layers["decoder"].cell(embedded, [state])
        new_state = (
            new_states[0] if isinstance(new_states, (list, tuple)) else new_states
        )
        context, weights = layers["attention"](
            new_state, memory, value_mask=mask, return_attention_scores=True
        )
        features = [ops.cast(context, new_state.dtype), new_state]  # [c_t; h_t]
    logits = layers["logits"](layers["attentional"](ops.concatenate(features, -1)))
    return logits, new_state, weights
