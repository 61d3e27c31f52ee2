"""Keras's own GroupedQueryAttention test module, as shipped, run against ours.

`keras/src/layers/attention/grouped_query_attention_test.py` is loaded from the
installed Keras (no copy of it lives here) with its `layers` module swapped
for one whose `GroupedQueryAttention` is
`keras_attn.layers.GroupedQueryAttention`: every
`layers.GroupedQueryAttention(...)` in it, and every subclass it defines,
builds keras-attn's layer. Keras's tests run as they are, on the backend of
the run (TensorFlow, or JAX with `KERAS_BACKEND=jax`); those that skip
themselves on a backend (flash attention on TensorFlow) skip here too.

The tests that still fail are expected failures, listed in `EXPECTED_FAILURES`
with the reason (strict: one that starts passing fails the run, so the list
stays true). docs/COMING_FROM_KERAS.md records the counts.
"""

import importlib.util
import os
import types

import keras
import pytest

import keras_attn

KERAS_TEST_FILE = os.path.join(
    os.path.dirname(keras.__file__),
    "src",
    "layers",
    "attention",
    "grouped_query_attention_test.py",
)

# test name -> why keras-attn differs from Keras there (per backend: "all",
# "tensorflow" or "jax").
EXPECTED_FAILURES: dict[str, tuple[str, str]] = {}


def _load_keras_test_module():
    """Keras's test module with `layers.GroupedQueryAttention` replaced by ours.

    Fails loudly (at collection) when the installed Keras does not ship it.
    """
    if not os.path.isfile(KERAS_TEST_FILE):
        raise FileNotFoundError(
            "Keras's GroupedQueryAttention test module is not in the installed "
            f"Keras {keras.__version__}: the conformance suite cannot run. "
            f"Received: path={KERAS_TEST_FILE}"
        )
    spec = importlib.util.spec_from_file_location(
        "keras_grouped_query_attention_test", KERAS_TEST_FILE
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    keras_layers = module.layers
    substituted = types.ModuleType("keras_layers_with_keras_attn_gqa")
    substituted.__getattr__ = lambda name: getattr(keras_layers, name)
    substituted.GroupedQueryAttention = keras_attn.layers.GroupedQueryAttention
    module.layers = substituted
    return module


_keras_tests = _load_keras_test_module()


class KerasGroupedQueryAttentionTest(_keras_tests.GroupedQueryAttentionTest):
    """Keras's `GroupedQueryAttentionTest`, constructing keras-attn's layer."""


def _mark_expected_failures(test_class):
    backend = keras.backend.backend()
    for name, (backends, reason) in EXPECTED_FAILURES.items():
        if not hasattr(test_class, name):
            raise AttributeError(
                f"EXPECTED_FAILURES names a test Keras's module does not have. "
                f"Received: name={name!r}"
            )
        if backends in ("all", backend):
            marked = pytest.mark.xfail(strict=True, reason=reason)(
                _copy_function(getattr(test_class, name))
            )
            setattr(test_class, name, marked)


def _copy_function(function):
    """A copy of `function` to carry a mark (Keras's class stays unmarked)."""
    copy = types.FunctionType(
        function.__code__,
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    copy.__dict__.update(function.__dict__)
    copy.__qualname__ = function.__qualname__
    return copy


_mark_expected_failures(KerasGroupedQueryAttentionTest)

# Only the subclass is collected (the imported Keras class would run twice).
del _keras_tests


def test_the_keras_suite_constructs_keras_attn_layers():
    module = _load_keras_test_module()
    assert (
        module.layers.GroupedQueryAttention is keras_attn.layers.GroupedQueryAttention
    )
    assert module.layers.Embedding is keras.layers.Embedding
    names = [
        name for name in dir(KerasGroupedQueryAttentionTest) if name.startswith("test")
    ]
    assert len(names) >= 25  # the parameterized tests are expanded
