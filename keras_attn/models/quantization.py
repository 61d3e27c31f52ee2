"""`task.quantize(mode)`: what the tasks quantize by default, and how a
quantized task records the layers it quantized outside its backbones so
that it saves, loads and rebuilds quantized.

Keras's `Model.quantize(mode, config=None, filters=None)` quantizes every
leaf layer that implements `quantize` (in Keras 3.15: `Dense`,
`EinsumDense`, `Embedding`, `ReversibleEmbedding`) and `filters` selects.
A task's `quantize` is Keras's with one difference: with `filters=None` it
quantizes its default set, those layers less the ones the task keeps in
float32 (`float32_layers`: the classifier's one-unit `positive_probability`
head), and leaves the rest alone (no warning per dropout or layer norm that
has nothing to quantize). A `filters` given is Keras's, as it is.

Imports no TensorFlow.
"""

from __future__ import annotations

import contextlib
import functools
import gc

import keras

QUANTIZABLE_LAYERS = (
    keras.layers.Dense,
    keras.layers.EinsumDense,
    keras.layers.Embedding,
    keras.layers.ReversibleEmbedding,
)
"""The layers Keras quantizes (each checks its exact type: a subclass's
`quantize` raises `NotImplementedError`)."""

# What calibration-based modes need, which the tasks do not define.
_STRUCTURE_MODES = ("gptq", "awq")


class QuantizableTask:
    """Mixin of the tasks (before `keras.Model` in the bases): `quantize`
    with the task's default set."""

    def __new__(cls, *args, **kwargs):
        task = super().__new__(cls, *args, **kwargs)
        # Keras's `Layer.__new__` has set `task.quantize` to its wrapper of
        # the method below (it checks `mode`, resolves `config` and lets the
        # layer add variables), which locks the layer's tracker when it
        # returns. Keras 3.15 locks a functional model's tracker too, whose
        # state otherwise stays open after build (`Functional._lock_state`
        # does nothing), so a quantized task refused any layer attribute:
        # `task.tokenizer = tokenizer` raised "ValueError: None". Unlocked
        # again here, it accepts them as before `quantize`.
        keras_quantize = task.quantize

        @functools.wraps(keras_quantize)
        def quantize(*args, **kwargs):
            try:
                return keras_quantize(*args, **kwargs)
            finally:
                tracker = getattr(task, "_tracker", None)
                if tracker is not None:
                    tracker.unlock()

        task.quantize = quantize
        return task

    def float32_layers(self) -> list:
        """The task's layers that `quantize()` keeps in float32 by default
        (none here; the classifiers keep their one-unit head)."""
        return []

    def quantize(self, mode=None, config=None, filters=None, **kwargs):
        """Quantize the task's weights: `keras.Model.quantize`, whose
        arguments it takes.

        With `filters=None`, every `Dense`, `EinsumDense`, `Embedding` and
        `ReversibleEmbedding` of the task is quantized except
        `float32_layers()` (a classifier's one-unit output layer); softmax,
        layer norms, the recurrent cells and the attention pooling keep
        their dtype (Keras has no quantized form of them). A tied output
        projection is its token embedding's table, quantized with it.
        `filters` (a regex of layer names, a list of them, or a callable
        of the layer) selects the layers instead, as in Keras.

        Afterwards the task saves (`save`, `save_to_preset`) and loads
        quantized, and its compiled methods (`classify`, `translate`,
        `generate`, ...) compile again for the quantized weights. See
        docs/TASKS.md, "Quantization".
        """
        # Keras's wrapper has checked `mode` and resolved `config` by now
        # (`ValueError` "Invalid quantization mode ... Received: mode=...").
        if mode in _STRUCTURE_MODES and config is not None:
            structure = getattr(config, "quantization_layer_structure", None)
            if (
                structure is None
                and self.get_quantization_layer_structure(mode) is None
            ):
                # Keras raises this only after building every selected
                # layer's uncalibrated variables, leaving the model broken.
                raise ValueError(
                    f"`mode={mode!r}` needs `config.quantization_layer_structure` "
                    "(the layers to calibrate block by block); "
                    f"{type(self).__name__} defines no default one. Received: "
                    "config.quantization_layer_structure=None"
                )
        if filters is None:
            kept = {id(layer) for layer in self.float32_layers()}

            def filters(layer):
                return type(layer) in QUANTIZABLE_LAYERS and id(layer) not in kept

        with _one_collection():
            return super().quantize(mode, config=config, filters=filters, **kwargs)


@contextlib.contextmanager
def _one_collection():
    """Keras's `Layer.__delattr__` runs a full `gc.collect()` for each
    variable `quantize` replaces (to free its buffer soon): in a process
    holding millions of objects each pass takes a sizeable fraction of a
    second. Within this scope those calls do nothing, and one collection
    runs at the end, which frees the same buffers."""
    collect = gc.collect
    skipped = []
    gc.collect = lambda *args, **kwargs: skipped.append(args) or 0
    try:
        yield
    finally:
        gc.collect = collect
        if skipped:
            collect()


def layer_policy(layer):
    """`layer`'s own dtype policy: its entry in the `DTypePolicyMap` it was
    built with (a quantized model loaded), or its policy."""
    policy = layer.dtype_policy
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap) and layer.path:
        return policy[layer.path]
    return policy


def plain_policy(policy):
    """`policy`, or the default policy of a `DTypePolicyMap` (a quantized
    model's map of its quantized layers)."""
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        return policy.default_policy
    return policy


def rebased_policy_map(policy_map, default_policy):
    """A new `DTypePolicyMap` with `policy_map`'s entries (None: none) under
    `default_policy`."""
    entries = (
        {} if policy_map is None else {path: policy_map[path] for path in policy_map}
    )
    return keras.dtype_policies.DTypePolicyMap(
        default_policy=default_policy, policy_map=entries
    )


def quantized_policy_map(default_policy, layers, start=None):
    """A `DTypePolicyMap` under `default_policy` of the quantized `layers`'
    policies by path (after `start`'s entries, a map to extend), or None
    when it would be empty."""
    found = rebased_policy_map(start, default_policy)
    for layer in layers:
        if layer.quantization_mode is None or layer.path in found:
            continue
        found[layer.path] = layer_policy(layer)
    return found if len(found) > 0 else None


def float32_head_policy(dtype):
    """The dtype of a task layer kept in float32 whatever the task's policy
    (an output layer): `"float32"`, or, when the task is given a
    `DTypePolicyMap` (a quantized task's config), the map's entries over a
    float32 default, so a quantized output layer is built quantized, by its
    path, as the backbones' layers are."""
    if not isinstance(dtype, keras.dtype_policies.DTypePolicyMap):
        return "float32"
    return rebased_policy_map(dtype, "float32")


def head_policy_config(task) -> dict:
    """`{"dtype": map}` for a task's config when layers outside its
    backbones are quantized (the map of those, under the task's policy),
    else `{}`: an unquantized task's config is as before."""
    inside = {id(layer) for b in task.backbones for layer in b._flatten_layers()}
    outside = [
        layer
        for layer in task._flatten_layers(include_self=False)
        if id(layer) not in inside
    ]
    found = quantized_policy_map(plain_policy(task.dtype_policy), outside)
    if found is None:
        return {}
    return {"dtype": keras.dtype_policies.serialize(found)}


def deserialize_dtype(config: dict) -> dict:
    """`config` with a serialized `dtype` (a `DTypePolicyMap`'s dict) as a
    policy object."""
    if isinstance(config.get("dtype"), dict):
        config = {**config, "dtype": keras.dtype_policies.get(config["dtype"])}
    return config
