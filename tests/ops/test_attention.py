import keras
import numpy as np
import pytest

from keras_attn.ops import attention_path, dot_product_attention, switch_over_length
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


LONG = {"query_length": 4096, "key_length": 4096}
SHORT = {"query_length": 512, "key_length": 512}


@pytest.mark.parametrize(
    ("flash", "call", "expected"),
    [
        # A fused kernel runs the call (JAX with cuDNN, PyTorch on CUDA): it
        # keeps priority at every length, unless dropout or narrow value heads.
        (None, {"fused_kernel": True, **LONG}, "fused"),
        (None, {"fused_kernel": True, **SHORT}, "fused"),
        (True, {"fused_kernel": True, **SHORT}, "fused"),
        (
            None,
            {"fused_kernel": True, "dropout_active": True, **LONG},
            "memory_efficient",
        ),
        (None, {"fused_kernel": True, "dropout_active": True, **SHORT}, "explicit"),
        (
            None,
            {"fused_kernel": True, "same_head_dims": False, **LONG},
            "memory_efficient",
        ),
        (
            True,
            {"fused_kernel": True, "same_head_dims": False, **SHORT},
            "memory_efficient",
        ),
        # No fused kernel (TensorFlow, JAX on a CPU or on a GPU in float32):
        # the memory-efficient path from the switch-over length on.
        (None, {**LONG}, "memory_efficient"),
        (None, {**SHORT}, "explicit"),
        (None, {"query_length": 2, "key_length": 1024}, "memory_efficient"),
        (None, {"query_length": 2, "key_length": 1023}, "explicit"),
        (None, {"query_length": 1, "key_length": 8192}, "explicit"),  # decoding
        (
            None,
            {"query_length": 2048, "key_length": 1024, "dtype": "bfloat16"},
            "explicit",
        ),
        (
            None,
            {"query_length": 2048, "key_length": 2048, "dtype": "float16"},
            "memory_efficient",
        ),
        (None, {"dropout_active": True, **LONG}, "memory_efficient"),
        (None, {"same_head_dims": False, **LONG}, "memory_efficient"),
        # Lengths unknown when traced: decided when the graph runs.
        (None, {}, "by_length"),
        (None, {"query_length": 8, "key_length": None}, "by_length"),
        (None, {"query_length": None, "key_length": 100}, "explicit"),
        (None, {"query_length": 1, "key_length": None}, "explicit"),
        # True: fused, else memory-efficient at any length; False: explicit.
        (True, {**SHORT}, "memory_efficient"),
        (True, {"query_length": 1, "key_length": 4}, "memory_efficient"),
        (True, {"dropout_active": True, "fused_kernel": True}, "memory_efficient"),
        (False, {"fused_kernel": True, **LONG}, "explicit"),
        (False, {**LONG}, "explicit"),
        # Weights requested: only the explicit path returns them.
        (None, {"return_weights": True, "fused_kernel": True, **LONG}, "explicit"),
        (False, {"return_weights": True}, "explicit"),
    ],
)
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_attention_path_decisions(flash, call, expected, backend):
    assert attention_path(flash, backend=backend, **call) == expected


def test_tensorflow_has_no_fused_kernel_whatever_it_is_told():
    for flash, call, expected in (
        (None, {"fused_kernel": True, **SHORT}, "explicit"),
        (None, {"fused_kernel": True, **LONG}, "memory_efficient"),
        (True, {"fused_kernel": True, **SHORT}, "memory_efficient"),
    ):
        assert attention_path(flash, backend="tensorflow", **call) == expected


def test_switch_over_length_by_dtype():
    assert switch_over_length("float32") == 1024
    assert switch_over_length("bfloat16") == switch_over_length("float16") == 2048
    assert switch_over_length("float64") == 1024


def test_flash_attention_true_refuses_a_call_that_needs_the_weights():
    with pytest.raises(
        ValueError,
        match=r"weights are requested.*Received: flash_attention=True, "
        r"return_attention_scores=True",
    ):
        attention_path(True, return_weights=True, backend="jax", fused_kernel=True)


def test_attention_path_follows_keras_flash_attention_config(monkeypatch):
    monkeypatch.setattr(keras.config, "is_flash_attention_enabled", lambda: False)
    assert attention_path(None, backend="jax", fused_kernel=True) == "explicit"
    assert attention_path(None, backend="tensorflow", **LONG) == "explicit"
    monkeypatch.setattr(keras.config, "is_flash_attention_enabled", lambda: True)
    assert attention_path(None, backend="jax", fused_kernel=True) == "fused"
    assert attention_path(None, backend="tensorflow", **SHORT) == "memory_efficient"
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
