"""`WeightsReadOnce`: a decoding loop's weights read, and cast to a mixed
policy's compute dtype, once per call instead of at every step."""

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
        global_state.set_global_attribute("stateless_scope", self.original_scope)
        try:
            variable.assign(value)
        finally:
            global_state.set_global_attribute("stateless_scope", self)


def _read(variable):
    """The variable's value as a tensor (on TensorFlow a read of it: its
    `value` is the `tf.Variable`, which each op would read again)."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.convert_to_tensor(variable.value)
    return keras.ops.convert_to_tensor(variable.value)
