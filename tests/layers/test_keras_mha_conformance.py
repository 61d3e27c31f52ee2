"""Keras's own MultiHeadAttention test module, as shipped, run against ours.

`keras/src/layers/attention/multi_head_attention_test.py` is loaded from the
installed Keras (no copy of it lives here) with its `layers` module swapped
for one whose `MultiHeadAttention` is `keras_attn.layers.MultiHeadAttention`:
every `layers.MultiHeadAttention(...)` in it, and every subclass it defines,
builds keras-attn's layer. Keras's tests run as they are, on the backend of
the run (TensorFlow, or JAX with `KERAS_BACKEND=jax`); those that skip
themselves on a backend (flash attention on TensorFlow) skip here too.

The tests that still fail are expected failures, listed in `EXPECTED_FAILURES`
with the reason (strict: one that starts passing fails the run, so the list
stays true). docs/COMING_FROM_KERAS.md records the counts.
"""

import keras

import keras_attn
from tests.layers._keras_conformance import (
    load_keras_test_module,
    mark_expected_failures,
)

# test name -> why keras-attn differs from Keras there (per backend: "all",
# "tensorflow" or "jax").
EXPECTED_FAILURES: dict[str, tuple[str, str]] = {}


def _load_keras_test_module():
    return load_keras_test_module(
        "multi_head_attention_test.py",
        "MultiHeadAttention",
        keras_attn.layers.MultiHeadAttention,
    )


_keras_tests = _load_keras_test_module()


class KerasMultiHeadAttentionTest(_keras_tests.MultiHeadAttentionTest):
    """Keras's `MultiHeadAttentionTest`, constructing keras-attn's layer."""


mark_expected_failures(KerasMultiHeadAttentionTest, EXPECTED_FAILURES)

# Only the subclass is collected (the imported Keras class would run twice).
del _keras_tests


def test_the_keras_suite_constructs_keras_attn_layers():
    module = _load_keras_test_module()
    assert module.layers.MultiHeadAttention is keras_attn.layers.MultiHeadAttention
    assert module.layers.Embedding is keras.layers.Embedding
    names = [
        name for name in dir(KerasMultiHeadAttentionTest) if name.startswith("test")
    ]
    assert len(names) >= 40  # the parameterized tests are expanded
