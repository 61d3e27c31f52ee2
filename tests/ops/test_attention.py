import keras
import numpy as np
import pytest

from keras_attn.ops import attention_path, dot_product_attention
from keras_attn.ops.attention import check_flash_attention
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


@pytest.mark.parametrize("mask", [None, "padding"], ids=["causal_only", "and_mask"])
def test_is_causal_equals_an_explicit_causal_mask_on_both_paths(mask):
    mask = None if mask is None else make_mask()
    causal = np.tril(np.ones((4, 6), bool))[None, None]
    combined = causal if mask is None else mask & causal
    expected, _ = numpy_attention(Q, K, V, combined)
    for flash in (None, False):  # fused where the backend has it, explicit
        got = dot_product_attention(
            Q, K, V, mask=mask, is_causal=True, flash_attention=flash
        )
        np.testing.assert_allclose(to_numpy(got), expected, atol=1e-5)
    _, weights = dot_product_attention(
        Q, K, V, mask=mask, is_causal=True, return_weights=True
    )
    np.testing.assert_array_equal(to_numpy(weights)[..., ~causal[0, 0]], 0.0)


@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
def test_attention_path_honours_flash_attention(backend):
    fused = "explicit" if backend == "tensorflow" else "fused"
    assert attention_path(None, backend=backend) == fused
    assert attention_path(False, backend=backend) == "explicit"
    for needs in (
        {"return_weights": True},
        {"dropout_active": True},
        {"same_head_dims": False},
    ):
        assert attention_path(None, backend=backend, **needs) == "explicit"
        assert attention_path(False, backend=backend, **needs) == "explicit"
        with pytest.raises(ValueError, match="Received: flash_attention=True"):
            attention_path(True, backend=backend, **needs)
    if backend == "tensorflow":
        with pytest.raises(ValueError, match="TensorFlow backend has no fused"):
            attention_path(True, backend=backend)
    else:
        assert attention_path(True, backend=backend) == "fused"


def test_attention_path_follows_keras_flash_attention_config(monkeypatch):
    monkeypatch.setattr(keras.config, "is_flash_attention_enabled", lambda: False)
    assert attention_path(None, backend="jax") == "explicit"
    monkeypatch.setattr(keras.config, "is_flash_attention_enabled", lambda: True)
    assert attention_path(None, backend="jax") == "fused"
    with pytest.raises(ValueError, match="attention weights are requested"):
        attention_path(None, backend="jax", return_weights=True)
    assert attention_path(False, backend="jax", return_weights=True) == "explicit"


def test_check_flash_attention():
    assert check_flash_attention(None, 0.5) is None
    assert check_flash_attention(True, 0.0) is True
    with pytest.raises(
        ValueError, match=r"Received: flash_attention=True, dropout=0\.1"
    ):
        check_flash_attention(True, 0.1)
    with pytest.raises(ValueError, match="Received: flash_attention=1"):
        check_flash_attention(1)


def test_check_flash_attention_follows_keras_flash_attention_config(monkeypatch):
    monkeypatch.setattr(keras.config, "is_flash_attention_enabled", lambda: True)
    with pytest.raises(
        ValueError, match=r"Received: flash_attention=None, dropout=0\.1"
    ):
        check_flash_attention(None, 0.1)
    assert check_flash_attention(False, 0.1) is False
