"""`BahdanauDecoder`: an attention RNN decoder over any cell and attention."""

from __future__ import annotations

import keras
from keras import ops

from keras_attn import _validation as v
from keras_attn.layers.bahdanau_attention import BahdanauAttention
from keras_attn.layers.base_attention import BaseAttention


@keras.saving.register_keras_serializable(package="keras_attn")
class BahdanauDecoder(keras.layers.Layer):
    """An RNN decoder that attends to a memory before every step.

    Bahdanau, Cho and Bengio (2015), "Neural Machine Translation by Jointly
    Learning to Align and Translate": at step `i` the context `c_i` is
    computed from the previous decoder state `s_{i-1}`, and the cell reads
    the input and the context `[y_{i-1}; c_i]`:

        c_i = Σ_j softmax_j(score(s_{i-1}, h_j)) h_j
        s_i = cell([y_{i-1}; c_i], s_{i-1})

    The Keras 3 successor of TF Addons' `AttentionWrapper`: any Keras
    recurrent cell (`GRUCell`, `LSTMCell`, `SimpleRNNCell`, or your own with
    `state_size` and `call(inputs, states)`) and any keras_attn attention
    layer (`BahdanauAttention`, `LuongAttention`, `MultiHeadAttention`). The
    memory (the encoder's outputs) is a call argument, never bound at
    construction, so the decoder works in the functional API, saves in a
    `.keras` file and exports. `call` runs teacher-forced over a whole target
    sequence; `step` runs one decoding step (the `keras_attn.generation`
    loops call it through a model's `call_with_cache`).

    The attention's query is the cell's first state (`h` of an LSTM). The
    memory's part of the score (`W_k h_j` of a `BahdanauAttention`) is
    computed once per call (or once per source with `project_memory`), not at
    every step.

    Args:
        cell: a Keras recurrent cell, or an int: `GRUCell(cell)`.
        attention: a keras_attn attention layer; default
            `BahdanauAttention(units)` with `units` the cell's state size.
        **kwargs: base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        inputs: `(batch, T, E)`, the (embedded) target inputs, teacher forcing.
        memory: `(batch, S, dm)`, what is attended to (encoder outputs).
        initial_state: the cell's initial state: a tensor `(batch, units)`,
            or a list of tensors for a cell of several states (`[h, c]`);
            default zeros.
        memory_mask: boolean `(batch, S)`, True at the positions to attend
            to; filled from the memory's Keras mask.
        return_attention_scores: also return the attention weights.
        training: passed to the cell and the attention (dropout).

    Returns:
        `(batch, T, units + dc)`: `[s_i; c_i]`, the cell's output and the
        context at every step (`dc` the attention's output size); with
        `return_attention_scores=True`, `(outputs, weights)` with weights
        `(batch, T, S)` (averaged over heads for a multi-head attention).

    Example:

    ```python
    decoder = keras_attn.layers.BahdanauDecoder(
        keras.layers.GRUCell(64), keras_attn.BahdanauAttention(32)
    )
    outputs = decoder(embedded_targets, encoder_outputs, initial_state=state)
    ```
    """

    def __init__(self, cell, attention=None, **kwargs):
        super().__init__(**kwargs)
        if isinstance(cell, int) and not isinstance(cell, bool):
            cell = keras.layers.GRUCell(
                v.check_positive_int("cell", cell), dtype=self.dtype_policy, name="cell"
            )
        if not isinstance(cell, keras.layers.Layer) or not hasattr(cell, "state_size"):
            raise ValueError(
                "`cell` must be a Keras recurrent cell (a layer with `state_size`) "
                f"or a number of GRU units. Received: cell={cell!r}"
            )
        if attention is None:
            attention = BahdanauAttention(
                self._state_sizes(cell)[0], dtype=self.dtype_policy, name="attention"
            )
        if not isinstance(attention, keras.layers.Layer):
            raise ValueError(
                "`attention` must be a keras_attn attention layer. "
                f"Received: attention={attention!r}"
            )
        self.cell = cell
        self.attention = attention
        self.supports_masking = True

    @staticmethod
    def _state_sizes(cell) -> list[int]:
        sizes = cell.state_size
        return list(sizes) if isinstance(sizes, (list, tuple)) else [sizes]

    @property
    def units(self) -> int:
        """The cell's output size (its first state's)."""
        return self._state_sizes(self.cell)[0]

    def build(self, inputs_shape, memory_shape, initial_state_shape=None):
        v.check_rank("inputs", inputs_shape, 3)
        v.check_rank("memory", memory_shape, 3)
        query_shape = (None, self.units) if self._flat_query else (None, 1, self.units)
        if not self.attention.built:  # a deserialized attention is built
            self.attention.build(query_shape, memory_shape)
        context = self.attention.compute_output_spec(
            keras.KerasTensor(query_shape), keras.KerasTensor(memory_shape)
        )
        self.context_dim = int(context.shape[-1])
        if not self.cell.built:
            self.cell.build((None, inputs_shape[-1] + self.context_dim))
        self.built = True

    @property
    def _flat_query(self) -> bool:
        """keras_attn's single-head attentions take a `(B, dq)` query."""
        return isinstance(self.attention, BaseAttention)

    def project_memory(self, memory):
        """The memory's part of the attention score, computed once per source
        and passed to every `step` (a beam search keeps it in its cache):
        the attention's `project_key(memory)` for keras_attn's single-head
        attentions (`W_k h_j` of a `BahdanauAttention`, `(B, S, units)`; the
        memory itself for `LuongAttention(score="dot")`), the memory itself
        for other attentions (which `step` does not give it to). Never None.
        """
        memory = ops.cast(memory, self.compute_dtype)
        if not self._flat_query:
            return memory
        return self.attention.project_key(memory)

    def initial_state(self, batch_size):
        """Zero states, one per state of the cell."""
        return [
            ops.zeros((batch_size, size), self.compute_dtype)
            for size in self._state_sizes(self.cell)
        ]

    def step(
        self,
        inputs,
        states,
        memory,
        memory_mask=None,
        projected_memory=None,
        training=None,
    ):
        """One decoding step.

        Args:
            inputs: `(B, E)`, this step's input `y_{i-1}`.
            states: the cell's states `s_{i-1}`: a tensor, or a list.
            memory, memory_mask: as in `call`.
            projected_memory: `project_memory(memory)`, or None (then the
                attention projects the memory itself, at this step).
            training: passed to the cell and the attention.

        Returns:
            `(outputs, new_states, weights)`: `[s_i; c_i]` `(B, units + dc)`,
            the new states (the structure of `states`), the attention
            weights `(B, S)`.
        """
        single = not isinstance(states, (list, tuple))
        state_list = [states] if single else list(states)
        query = state_list[0]  # (B, units)
        if not self._flat_query:
            query = query[:, None, :]  # (B, 1, units)
        extra = (
            {"projected_key": projected_memory}
            if projected_memory is not None and self._flat_query
            else {}
        )
        context, weights = self.attention(
            query,
            memory,
            value_mask=memory_mask,
            return_attention_scores=True,
            training=training,
            **extra,
        )
        if not self._flat_query:
            context = context[:, 0]  # (B, dc)
            if len(weights.shape) == 4:  # (B, heads, 1, S)
                weights = ops.mean(ops.cast(weights, "float32"), axis=1)
            weights = weights[:, 0]  # (B, S)
        cell_inputs = ops.concatenate(
            [inputs, ops.cast(context, inputs.dtype)], axis=-1
        )  # (B, E + dc)
        output, new_states = self.cell(cell_inputs, state_list, training=training)
        new_states = (
            list(new_states) if isinstance(new_states, (list, tuple)) else [new_states]
        )
        outputs = ops.concatenate([output, ops.cast(context, output.dtype)], axis=-1)
        return outputs, (new_states[0] if single else new_states), weights

    def call(
        self,
        inputs,
        memory,
        initial_state=None,
        memory_mask=None,
        return_attention_scores: bool = False,
        training=None,
    ):
        steps = ops.transpose(inputs, (1, 0, 2))  # (T, B, E)
        projected_memory = self.project_memory(memory)  # once, not at every step
        batch = ops.shape(inputs)[0]
        if initial_state is None:
            states = self.initial_state(batch)
        elif isinstance(initial_state, (list, tuple)):
            states = [ops.cast(state, self.compute_dtype) for state in initial_state]
        else:
            states = [ops.cast(initial_state, self.compute_dtype)]
        output_dim = self.units + self.context_dim

        # keras.ops.scan on TensorFlow needs the per-step outputs to have the
        # carry's structure, so the carry holds this step's outputs too.
        def scan_step(carry, inputs_t):
            outputs, new_states, weights = self.step(
                inputs_t,
                list(carry[0]),
                memory,
                memory_mask,
                projected_memory,
                training=training,
            )
            new_states = tuple(ops.cast(s, self.compute_dtype) for s in new_states)
            new_carry = (
                new_states,
                ops.cast(outputs, self.compute_dtype),
                ops.cast(weights, self.compute_dtype),
            )
            return new_carry, new_carry

        initial_carry = (
            tuple(states),
            ops.zeros((batch, output_dim), self.compute_dtype),  # (B, units + dc)
            ops.zeros((batch, ops.shape(memory)[1]), self.compute_dtype),  # (B, S)
        )
        _, (_, outputs, weights) = ops.scan(scan_step, initial_carry, steps)
        outputs = ops.transpose(outputs, (1, 0, 2))  # (B, T, units + dc)
        if return_attention_scores:
            return outputs, ops.transpose(weights, (1, 0, 2))  # (B, T, S)
        return outputs

    def compute_output_shape(
        self, inputs_shape, memory_shape, initial_state_shape=None
    ):
        if not self.built:
            self.build(inputs_shape, memory_shape)
        return (inputs_shape[0], inputs_shape[1], self.units + self.context_dim)

    def compute_output_spec(
        self,
        inputs,
        memory,
        initial_state=None,
        memory_mask=None,
        return_attention_scores=False,
        training=None,
    ):
        if not self.built:
            self.build(inputs.shape, memory.shape)
        batch, length = inputs.shape[0], inputs.shape[1]
        outputs = keras.KerasTensor(
            (batch, length, self.units + self.context_dim), dtype=self.compute_dtype
        )
        if not return_attention_scores:
            return outputs
        return outputs, keras.KerasTensor(
            (batch, length, memory.shape[1]), dtype=self.compute_dtype
        )

    def compute_mask(self, inputs, previous_mask=None):
        return previous_mask

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "cell": keras.saving.serialize_keras_object(self.cell),
                "attention": keras.saving.serialize_keras_object(self.attention),
            }
        )
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if "units" in config:  # keras_attn 0.1's GRU decoder of additive attention
            units, attention_units = config.pop("units"), config.pop("attention_units")
            config["cell"] = keras.layers.GRUCell(units, name="cell")
            config["attention"] = BahdanauAttention(attention_units, name="attention")
        else:
            config["cell"] = keras.saving.deserialize_keras_object(config["cell"])
            config["attention"] = keras.saving.deserialize_keras_object(
                config["attention"]
            )
        return cls(**config)
