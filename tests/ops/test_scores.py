import math

import numpy as np
import pytest

from keras_attn import ops as attn_ops
from tests.test_case import to_numpy

RNG = np.random.default_rng(0)
QUERY = RNG.normal(size=(2, 3, 4)).astype("float32")
KEY = RNG.normal(size=(2, 5, 4)).astype("float32")
KEY6 = RNG.normal(size=(2, 5, 6)).astype("float32")


def numpy_additive(query, key, w_q, w_k, v, b=None):
    """Bahdanau: e_ij = vᵀ tanh(W_q q_i + W_k k_j + b), loop over pairs."""
    b = np.zeros(v.shape) if b is None else b
    out = np.zeros((*query.shape[:2], key.shape[1]))
    for n in range(query.shape[0]):
        for i in range(query.shape[1]):
            for j in range(key.shape[1]):
                out[n, i, j] = v @ np.tanh(query[n, i] @ w_q + key[n, j] @ w_k + b)
    return out


def test_lecture_scaled_dot_numbers():
    # Raw scores 112, 96, 16, 8 over sqrt(64) give weights ~.87, .12, .01, .00.
    query = np.ones((1, 1, 64), "float32")
    key = (np.array([112.0, 96.0, 16.0, 8.0]) / 64)[None, :, None] * np.ones(
        (1, 4, 64), "float32"
    )
    raw = to_numpy(attn_ops.dot_score(query, key))
    np.testing.assert_allclose(raw, [[[112, 96, 16, 8]]], rtol=1e-6)
    scaled = to_numpy(attn_ops.scaled_dot_score(query, key))
    np.testing.assert_allclose(scaled, [[[14, 12, 2, 1]]], rtol=1e-6)
    weights = to_numpy(attn_ops.masked_softmax(scaled))
    np.testing.assert_allclose(weights, [[[0.87, 0.12, 0.01, 0.0]]], atol=0.015)
    # The context is the weighted sum of the values.
    values = RNG.normal(size=(1, 4, 3)).astype("float32")
    context = to_numpy(attn_ops.weighted_sum(weights, values))
    np.testing.assert_allclose(
        context[0, 0], (weights[0, 0][:, None] * values[0]).sum(0), atol=1e-6
    )


def test_dot_and_scaled_dot_against_numpy():
    expected = np.einsum("bqd,bkd->bqk", QUERY, KEY)
    np.testing.assert_allclose(
        to_numpy(attn_ops.dot_score(QUERY, KEY)), expected, atol=1e-5
    )
    np.testing.assert_allclose(
        to_numpy(attn_ops.scaled_dot_score(QUERY, KEY)), expected / 2.0, atol=1e-5
    )
    np.testing.assert_allclose(
        to_numpy(attn_ops.scaled_dot_score(QUERY, KEY, scale=0.1)),
        expected * 0.1,
        atol=1e-5,
    )


def test_dot_score_rejects_different_depths():
    with pytest.raises(
        ValueError, match=r"query.shape=\(2, 3, 4\), key.shape=\(2, 5, 6\)"
    ):
        attn_ops.dot_score(QUERY, KEY6)


def test_general_score_against_numpy():
    kernel = RNG.normal(size=(4, 6)).astype("float32")
    expected = np.einsum("bqd,de,bke->bqk", QUERY, kernel, KEY6)
    np.testing.assert_allclose(
        to_numpy(attn_ops.general_score(QUERY, KEY6, kernel)), expected, atol=1e-4
    )


def test_additive_score_against_numpy():
    w_q = RNG.normal(size=(4, 7)).astype("float32")
    w_k = RNG.normal(size=(6, 7)).astype("float32")
    v = RNG.normal(size=(7,)).astype("float32")
    b = RNG.normal(size=(7,)).astype("float32")
    np.testing.assert_allclose(
        to_numpy(attn_ops.additive_score(QUERY, KEY6, w_q, w_k, v, b)),
        numpy_additive(QUERY, KEY6, w_q, w_k, v, b),
        atol=1e-5,
    )


def test_concat_score_is_v_tanh_w_concat():
    kernel = RNG.normal(size=(10, 7)).astype("float32")
    v = RNG.normal(size=(7,)).astype("float32")
    expected = np.zeros((2, 3, 5))
    for n in range(2):
        for i in range(3):
            for j in range(5):
                both = np.concatenate([QUERY[n, i], KEY6[n, j]])
                expected[n, i, j] = v @ np.tanh(both @ kernel)
    np.testing.assert_allclose(
        to_numpy(attn_ops.concat_score(QUERY, KEY6, kernel, v)), expected, atol=1e-5
    )
    with pytest.raises(ValueError, match="kernel must have dq \\+ dk rows"):
        attn_ops.concat_score(QUERY, KEY6, kernel[:9], v)


def test_float16_dot_scores_do_not_overflow():
    big = np.full((1, 1, 64), 60.0, "float16")  # q·k = 230400 > float16 max
    scores = to_numpy(attn_ops.dot_score(big, big))
    assert np.isfinite(scores).all()
    np.testing.assert_allclose(scores, [[[230400.0]]], rtol=1e-3)
    scaled = to_numpy(attn_ops.scaled_dot_score(big, big))
    np.testing.assert_allclose(scaled, [[[230400.0 / math.sqrt(64)]]], rtol=1e-3)
