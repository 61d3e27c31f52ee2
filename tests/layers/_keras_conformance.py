"""Keras's own test modules for a layer, as shipped in the installed Keras,
run against keras-attn's class: the loader and the expected-failure marks
that test_keras_mha_conformance.py and test_keras_gqa_conformance.py share."""

import importlib.util
import os
import types

import keras
import pytest


def load_keras_test_module(file_name: str, class_name: str, our_class):
    """Keras's `keras/src/layers/attention/<file_name>` with its `layers`
    module swapped for one whose `<class_name>` is `our_class`: every
    `layers.<class_name>(...)` in it, and every subclass it defines, builds
    keras-attn's layer. Fails loudly (at collection) when the installed Keras
    does not ship the module."""
    path = os.path.join(
        os.path.dirname(keras.__file__), "src", "layers", "attention", file_name
    )
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"Keras's {class_name} test module is not in the installed Keras "
            f"{keras.__version__}: the conformance suite cannot run. "
            f"Received: path={path}"
        )
    spec = importlib.util.spec_from_file_location(f"keras_{file_name[:-3]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    keras_layers = module.layers
    substituted = types.ModuleType(f"keras_layers_with_keras_attn_{class_name}")
    substituted.__getattr__ = lambda name: getattr(keras_layers, name)
    setattr(substituted, class_name, our_class)
    module.layers = substituted
    return module


def mark_expected_failures(test_class, expected_failures: dict) -> None:
    """Mark each test of `expected_failures` (name -> (backends, reason),
    backends "all", "tensorflow" or "jax") a strict xfail on its backends: one
    that starts passing fails the run, so the list stays true."""
    backend = keras.backend.backend()
    for name, (backends, reason) in expected_failures.items():
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
