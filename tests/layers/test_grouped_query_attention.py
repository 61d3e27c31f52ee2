"""`keras_attn.layers.GroupedQueryAttention` against Keras's class (weights,
variables, configs and outputs both ways), on each attention path, and with a
key/value cache of the key/value heads only. Keras's own test module runs
against it in test_keras_gqa_conformance.py."""

import os

import keras
import numpy as np
import pytest

from keras_attn.layers import (
    GroupedQueryAttention,
    MultiHeadAttention,
    MultiHeadSelfAttention,
    TransformerDecoder,
    TransformerEncoder,
)
from tests.test_case import outputs_and_gradients, to_numpy

B, T, D = 2, 7, 16
RNG = np.random.default_rng(36)
X = RNG.normal(size=(B, T, D)).astype("float32")
Y = RNG.normal(size=(B, T + 2, D)).astype("float32")
VALUE_MASK = np.ones((B, T + 2), bool)
VALUE_MASK[0, -3:] = False
ATTENTION_MASK = RNG.uniform(size=(B, T, T + 2)) > 0.3
SIZES = dict(head_dim=4, num_query_heads=4, num_key_value_heads=2)


def pair(**options):
    """keras-attn's and Keras's layer with the same weights (ours built first,
    Keras's given them)."""
    ours = GroupedQueryAttention(**SIZES, **options)
    theirs = keras.layers.GroupQueryAttention(**SIZES, **options)
    ours(X, Y)
    theirs(X, Y)
    theirs.set_weights(ours.get_weights())
    return ours, theirs


@pytest.mark.parametrize(
    "arguments",
    [
        {},
        {"value_mask": VALUE_MASK},
        {"attention_mask": ATTENTION_MASK},
        {"use_causal_mask": True},
    ],
    ids=["none", "value_mask", "attention_mask", "causal"],
)
@pytest.mark.parametrize("options", [{}, {"use_gate": True}, {"sliding_window": 3}])
def test_outputs_and_weights_equal_keras(arguments, options):
    ours, theirs = pair(**options)
    got, got_weights = ours(X, Y, return_attention_scores=True, **arguments)
    want, want_weights = theirs(X, Y, return_attention_scores=True, **arguments)
    np.testing.assert_allclose(to_numpy(got), to_numpy(want), atol=1e-5)
    np.testing.assert_allclose(to_numpy(got_weights), to_numpy(want_weights), atol=1e-6)
    # Without the weights: keras-attn's path, Keras's fused op.
    np.testing.assert_allclose(
        to_numpy(ours(X, Y, **arguments)),
        to_numpy(theirs(X, Y, **arguments)),
        atol=1e-5,
    )


def test_variables_configs_and_weight_files_move_both_ways(tmp_path):
    ours, theirs = pair(use_gate=True, dropout=0.1, seed=3)

    def paths(layer):  # below the layer's own name
        return [w.path.split("/", 1)[1] for w in layer.weights]

    assert paths(ours) == paths(theirs)
    assert [w.shape for w in ours.weights] == [w.shape for w in theirs.weights]
    assert ours._key_dense.kernel.shape == (D, 2, 4)  # key/value heads only
    assert len(ours._dropout_layer.seed_generator.state.shape) == 1
    config = {k: v for k, v in ours.get_config().items() if k != "name"}
    assert config == {k: v for k, v in theirs.get_config().items() if k != "name"}
    assert GroupedQueryAttention.from_config(theirs.get_config()).num_repeats == 2
    assert keras.layers.GroupQueryAttention.from_config(config).head_dim == 4

    def model(layer_class):
        query = keras.Input((T, D))
        value = keras.Input((T + 2, D))
        layer = layer_class(**SIZES, name="attention")
        return keras.Model([query, value], layer(query, value))

    for source, target in (
        (GroupedQueryAttention, keras.layers.GroupQueryAttention),
        (keras.layers.GroupQueryAttention, GroupedQueryAttention),
    ):
        written, read = model(source), model(target)
        path = os.path.join(tmp_path, f"{source.__module__}.weights.h5")
        written.save_weights(path)
        read.load_weights(path)
        np.testing.assert_allclose(
            to_numpy(read([X, Y])), to_numpy(written([X, Y])), atol=1e-5
        )


@pytest.mark.parametrize(
    "arguments",
    [{"value_mask": VALUE_MASK}, {"use_causal_mask": True, "value_mask": VALUE_MASK}],
    ids=["value_mask", "causal"],
)
def test_memory_efficient_path_equals_the_explicit_path(arguments):
    layer = GroupedQueryAttention(**SIZES, flash_attention=True)
    layer(X, Y)
    explicit = GroupedQueryAttention(**SIZES, flash_attention=False)
    explicit(X, Y)
    explicit.set_weights(layer.get_weights())
    cotangent = RNG.normal(size=(B, T, D)).astype("float32")
    got = outputs_and_gradients(
        lambda q, v: layer(q, v, **arguments), [X, Y], cotangent
    )
    want = outputs_and_gradients(
        lambda q, v: explicit(q, v, **arguments), [X, Y], cotangent
    )
    np.testing.assert_allclose(got[0], want[0], atol=1e-5)
    for a, b in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "tuple"])
def test_cached_decoding_equals_the_causal_pass_with_a_cache_of_key_value_heads(
    stacked,
):
    layer = GroupedQueryAttention(**SIZES)
    full = to_numpy(layer(X, X, use_causal_mask=True))
    if stacked:
        cache = np.zeros((B, 2, T, 2, 4), "float32")  # (B, 2, Tmax, K, H)
    else:
        cache = (np.zeros((B, T, 2, 4), "float32"), np.zeros((B, T, 2, 4), "float32"))
    steps = []
    for index in range(T):
        step = X[:, index : index + 1]
        output, cache = layer(
            step, step, use_causal_mask=True, cache=cache, cache_update_index=index
        )
        steps.append(to_numpy(output))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5)
    shape = cache.shape if stacked else cache[0].shape
    assert tuple(shape)[-2:] == (2, 4)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"num_query_heads=6, num_key_value_heads=4"):
        GroupedQueryAttention(4, 6, 4)
    with pytest.raises(ValueError, match=r"argument `num_key_value_heads`"):
        GroupedQueryAttention(4, 6, 0)
    layer = GroupedQueryAttention(**SIZES)
    layer(X, X)
    with pytest.raises(ValueError, match=r"cache"):
        layer(X, X, cache=np.zeros((B, 2, T, 4, 4), "float32"), cache_update_index=0)
    with pytest.raises(ValueError, match=r"`cache_update_index` needs a `cache`"):
        layer(X, X, cache_update_index=0)


# -- MultiHeadAttention(num_key_value_heads=...) -------------------------------------


def grouped_mha(**options):
    """keras-attn's MultiHeadAttention with 2 key/value heads for 4 query
    heads, and Keras's GroupedQueryAttention with its weights."""
    ours = MultiHeadAttention(num_heads=4, key_dim=4, num_key_value_heads=2, **options)
    theirs = keras.layers.GroupQueryAttention(**SIZES, **options)
    ours(X, Y)
    theirs(X, Y)
    assert [w.shape for w in ours.weights] == [w.shape for w in theirs.weights]
    theirs.set_weights(ours.get_weights())
    return ours, theirs


@pytest.mark.parametrize(
    "arguments",
    [{"value_mask": VALUE_MASK}, {"use_causal_mask": True}],
    ids=["value_mask", "causal"],
)
@pytest.mark.parametrize("flash_attention", [False, True], ids=["explicit", "memory"])
def test_multi_head_attention_with_key_value_heads_equals_keras_gqa(
    arguments, flash_attention
):
    ours, theirs = grouped_mha(use_gate=True)
    ours.flash_attention = flash_attention
    np.testing.assert_allclose(
        to_numpy(ours(X, Y, **arguments)),
        to_numpy(theirs(X, Y, **arguments)),
        atol=1e-5,
    )
    assert ours.key_dense.kernel.shape == (D, 2, 4)
    assert ours.get_config()["num_key_value_heads"] == 2
    assert "num_key_value_heads" not in MultiHeadAttention(4, 4).get_config()
    restored = MultiHeadAttention.from_config(ours.get_config())
    assert restored.key_value_heads == 2


def test_a_subclass_overriding_compute_attention_gets_repeated_heads():
    seen = []

    class Sub(MultiHeadAttention):
        def _compute_attention(self, query, key, value, attention_mask=None, **kw):
            seen.append(key.shape[2])
            return super()._compute_attention(query, key, value, attention_mask, **kw)

    ours, theirs = grouped_mha()
    sub = Sub(num_heads=4, key_dim=4, num_key_value_heads=2)
    sub(X, Y)
    sub.set_weights(ours.get_weights())
    np.testing.assert_allclose(
        to_numpy(sub(X, Y, use_causal_mask=True)),
        to_numpy(theirs(X, Y, use_causal_mask=True)),
        atol=1e-5,
    )
    assert seen and set(seen) == {4}


def test_self_attention_decodes_with_a_cache_of_key_value_heads():
    layer = MultiHeadSelfAttention(num_heads=4, num_key_value_heads=1, causal=True)
    full = to_numpy(layer(X))
    cache = np.zeros((B, 2, T, 1, 4), "float32")  # multi-query: one head
    steps = []
    for index in range(T):
        output, cache = layer(
            X[:, index : index + 1], cache=cache, cache_update_index=index
        )
        steps.append(to_numpy(output))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5)
    with pytest.raises(ValueError, match=r"num_heads=4, num_key_value_heads=3"):
        MultiHeadAttention(4, 4, num_key_value_heads=3)


def test_the_blocks_take_key_value_heads_and_decode_with_their_cache():
    encoder = TransformerEncoder(32, 4, num_key_value_heads=2)
    encoded = encoder(X)
    assert encoder._self_attention_layer.key_dense.kernel.shape == (D, 2, 4)
    assert encoder.get_config()["num_key_value_heads"] == 2
    assert "num_key_value_heads" not in TransformerEncoder(32, 4).get_config()
    decoder = TransformerDecoder(32, 4, num_key_value_heads=1)
    full = to_numpy(decoder(X, encoded, use_causal_mask=True))
    cache = decoder.initial_cache(B, T)
    assert tuple(cache[0].shape) == (B, T, 1, 4)
    steps = []
    for index in range(T):
        output, cache = decoder(
            X[:, index : index + 1],
            encoded,
            self_attention_cache=cache,
            cache_update_index=index,
        )
        steps.append(to_numpy(output))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5)
    restored = TransformerDecoder.from_config(decoder.get_config())
    assert restored.num_key_value_heads == 1
    with pytest.raises(ValueError, match=r"num_heads=4, num_key_value_heads=3"):
        TransformerEncoder(32, 4, num_key_value_heads=3)
