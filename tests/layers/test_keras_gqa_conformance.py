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
        "grouped_query_attention_test.py",
        "GroupedQueryAttention",
        keras_attn.layers.GroupedQueryAttention,
    )


_keras_tests = _load_keras_test_module()


class KerasGroupedQueryAttentionTest(_keras_tests.GroupedQueryAttentionTest):
    """Keras's `GroupedQueryAttentionTest`, constructing keras-attn's layer."""


mark_expected_failures(KerasGroupedQueryAttentionTest, EXPECTED_FAILURES)

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
