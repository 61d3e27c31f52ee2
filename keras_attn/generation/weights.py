"""`WeightsReadOnce`: a decoding loop's weights read, and cast to a mixed
policy's compute dtype, once per call instead of at every step; on
TensorFlow the tied output projection's table transposed once too."""

from __future__ import annotations

import keras


class WeightsReadOnce(keras.StatelessScope):
    """A scope in which `layers`' weights are read once, at its start, and
    cast once to each compute dtype of their layers; every later read in the
    scope (each step of a decoding loop) takes those tensors.

    Under a mixed policy (`mixed_bfloat16`, `mixed_float16`) a layer casts
    its float32 variables to its compute dtype each time it is called.
    JAX's compiled loops move those reads and casts out of the loop;
    TensorFlow's `tf.while_loop` and PyTorch's eager loop run them at every
    step. Run a decoding inside this scope (inside the `tf.function`, so the
    reads are part of each call and weights set later are seen):

    ```python
    with WeightsReadOnce([model]):
        tokens = greedy_search(model.call_with_cache, prompt, cache, 32)
    ```

    The values are Keras's own reads bit for bit: a read under an autocast
    scope of dtype `d` (a layer whose compute dtype is `d`) gets the
    variable cast to `d`, any other read the variable's value. An
    assignment inside the scope (a layer's state, a seed generator) is made
    on the variable, and later reads in the scope read the variable.

    On TensorFlow the scope also lays out, once, the transposed table of
    each tied `keras.layers.ReversibleEmbedding` (float, not LoRA), which a
    `keras_attn.layers.TokenAndPositionEmbedding` called with `reverse=True`
    then multiplies (`reverse_table`): inside a loop, `ops.matmul(x,
    ops.transpose(table))` is folded into one product that reads the table
    transposed, which TensorFlow's Eigen kernels (TF Serving's release
    builds run no oneDNN) multiply at about a ninth of their speed on a
    contiguous `(d, V)` table for a few rows. The logits are the same
    products, up to the summation order of the kernel that runs.

    Args:
        layers: the models or layers whose weights the code inside reads
            (a draft model too); weights of other layers are read as usual.
    """

    def __init__(self, layers):
        super().__init__()
        layers = list(layers)
        for layer in layers:
            if not isinstance(layer, keras.layers.Layer):
                raise ValueError(
                    "`layers` must hold Keras layers or models. Received: "
                    f"an element {layer!r} of type {type(layer).__name__}"
                )
        floatx = keras.config.floatx()
        dtypes = {
            sublayer.compute_dtype
            for layer in layers
            for sublayer in layer._flatten_layers()
            if keras.backend.is_float_dtype(sublayer.compute_dtype)
        }
        self._values = {}
        for layer in layers:
            for variable in layer.variables:
                value = _read(variable)
                self._values[id(variable), variable.dtype] = value
                if not keras.backend.is_float_dtype(variable.dtype):
                    continue
                # `variable.dtype` reads as `floatx` under a layer that
                # turns autocasting off: for that dtype only the variable's
                # own value is kept.
                for dtype in dtypes - {variable.dtype, floatx}:
                    self._values[id(variable), dtype] = keras.ops.cast(value, dtype)
        # id(layer) -> (id(table variable), the table transposed, in the
        # dtype the layer reads it).
        self._tables = {}
        if keras.backend.backend() == "tensorflow":
            for layer in layers:
                for sublayer in layer._flatten_layers():
                    if not _plain_tied_embedding(sublayer):
                        continue
                    variable = sublayer.embeddings  # the variable itself here
                    # The dtype the layer's own read gives: Keras's embeddings
                    # do not autocast, so a mixed policy's logits are float32.
                    dtype = variable.dtype
                    if sublayer.autocast:
                        dtype = sublayer.compute_dtype
                    value = self._values.get((id(variable), dtype))
                    if value is None:
                        value = keras.ops.cast(
                            self._values[id(variable), variable.dtype], dtype
                        )
                    self._tables[id(sublayer)] = (
                        id(variable),
                        keras.ops.transpose(value),
                    )

    def reverse_table(self, embedding):
        """The `(d, V)` table this scope transposed for a tied
        `keras.layers.ReversibleEmbedding`, or None: on other backends, or
        for an embedding it does not lay out (untied, quantized, LoRA,
        `reverse_dtype` or `logit_soft_cap` set). Read through
        `keras_attn.layers.token_and_position_embedding.reverse_table`."""
        found = self._tables.get(id(embedding))
        return None if found is None else found[1]

    def get_current_value(self, variable):
        # `variable.dtype` is the dtype Keras casts this read to.
        found = self._values.get((id(variable), variable.dtype))
        if found is None and self.original_scope is not None:
            return self.original_scope.get_current_value(variable)  # nested
        return found

    def add_update(self, update):
        from keras.src.backend.common import global_state

        variable, value = update
        for key in [key for key in self._values if key[0] == id(variable)]:
            del self._values[key]
        for key in [k for k, (i, _) in self._tables.items() if i == id(variable)]:
            del self._tables[key]
        global_state.set_global_attribute("stateless_scope", self.original_scope)
        try:
            variable.assign(value)
        finally:
            global_state.set_global_attribute("stateless_scope", self)


def _plain_tied_embedding(layer) -> bool:
    """A tied, float, LoRA-less `ReversibleEmbedding` whose reverse call is
    `ops.matmul(x, ops.transpose(embeddings))` and nothing else."""
    return (
        isinstance(layer, keras.layers.ReversibleEmbedding)
        and layer.built
        and layer.tie_weights
        and layer.quantization_mode is None
        and not layer.lora_enabled
        and layer.reverse_dtype is None
        and layer.logit_soft_cap is None
        and keras.backend.is_float_dtype(layer.compute_dtype)
    )


def _read(variable):
    """The variable's value as a tensor (on TensorFlow a read of it: its
    `value` is the `tf.Variable`, which each op would read again)."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.convert_to_tensor(variable.value)
    return keras.ops.convert_to_tensor(variable.value)
