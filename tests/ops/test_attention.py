import keras
import numpy as np
import pytest

from keras_attn.ops import dot_product_attention
from tests.test_case import to_numpy

RNG = np.random.default_rng(1)
Q = RNG.normal(size=(2, 4, 3, 8)).astype("float32")  # (B, Tq, N, H)
K = RNG.normal(size=(2, 6, 3, 8)).astype("float32")
V = RNG.normal(size=(2, 6, 3, 8)).astype("float32")
V_NARROW = RNG.normal(size=(2, 6, 3, 5)).astype("float32")  # Hv != H


def numpy_attention(q, k, v, mask):
    logits = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    logits = np.where(mask, logits, -np.inf)
    with np.errstate(invalid="ignore"):
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        weights = weights / weights.sum(-1, keepdims=True)
    weights = np.nan_to_num(weights)
    return np.einsum("bnts,bsnh->btnh", weights, v), weights


def make_mask():
    mask = np.ones((2, 1, 4, 6), bool)
    mask[0, :, :, 4:] = False  # padded keys
    mask[1, :, 2, :] = False  # a query row with no keys at all
    return mask


@pytest.mark.parametrize("value", [V, V_NARROW], ids=["same_head_dim", "narrow_values"])
def test_fused_and_explicit_paths_agree_with_numpy_including_masked_rows(value):
    V = value
    mask = make_mask()
    fused = to_numpy(dot_product_attention(Q, K, V, mask=mask))
    explicit, weights = dot_product_attention(Q, K, V, mask=mask, return_weights=True)
    expected, expected_weights = numpy_attention(Q, K, V, mask)
    np.testing.assert_allclose(fused, expected, atol=1e-5)
    np.testing.assert_allclose(to_numpy(explicit), expected, atol=1e-5)
    np.testing.assert_allclose(to_numpy(weights), expected_weights, atol=1e-6)
    np.testing.assert_array_equal(fused[1, 2], 0.0)
    np.testing.assert_array_equal(to_numpy(explicit)[1, 2], 0.0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_paths_are_finite_and_agree(dtype):
    mask = make_mask()
    q, k, v = (keras.ops.cast(x * 30.0, dtype) for x in (Q, K, V))  # big logits
    fused = to_numpy(
        keras.ops.cast(dot_product_attention(q, k, v, mask=mask), "float32")
    )
    explicit = to_numpy(
        keras.ops.cast(
            dot_product_attention(q, k, v, mask=mask, return_weights=True)[0], "float32"
        )
    )
    assert np.isfinite(fused).all() and np.isfinite(explicit).all()
    np.testing.assert_array_equal(fused[1, 2], 0.0)
    np.testing.assert_allclose(fused, explicit, atol=0.5, rtol=2e-2)


def test_dropout_only_in_training():
    seed = keras.random.SeedGenerator(0)
    inference = dot_product_attention(
        Q, K, V, dropout_rate=0.5, training=False, seed_generator=seed
    )
    np.testing.assert_allclose(
        to_numpy(inference), to_numpy(dot_product_attention(Q, K, V)), atol=1e-6
    )
    trained = dot_product_attention(
        Q, K, V, dropout_rate=0.5, training=True, seed_generator=seed
    )
    assert not np.allclose(to_numpy(trained), to_numpy(inference))
