"""Nearest-neighbour next-token distributions (kNN-LM / kNN-MT)."""

import math

import numpy as np
import pytest

from keras_attn.memory import (
    knn_mixture_log_probs,
    knn_probabilities,
    knn_weights,
    nearest_neighbors,
)
from tests.test_case import to_numpy


def naive_neighbors(queries, keys, k):
    """Every distance written out, then a stable sort."""
    distances = np.array(
        [[float(np.sum((q - key) ** 2)) for key in keys] for q in queries]
    )
    order = np.argsort(distances, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(distances, order, axis=1), order


@pytest.mark.parametrize("key_chunk_size", [65536, 7, 1])
def test_nearest_neighbors_match_a_brute_force_search(key_chunk_size):
    rng = np.random.default_rng(0)
    keys = rng.normal(size=(40, 5)).astype("float32")
    queries = rng.normal(size=(6, 5)).astype("float32")
    distances, indices = nearest_neighbors(
        queries, keys, k=4, key_chunk_size=key_chunk_size
    )
    expected_distances, expected_indices = naive_neighbors(queries, keys, 4)
    np.testing.assert_array_equal(to_numpy(indices), expected_indices)
    np.testing.assert_allclose(to_numpy(distances), expected_distances, rtol=1e-4)
    assert to_numpy(indices).dtype == np.int32


@pytest.mark.parametrize(
    "num_keys, k, key_chunk_size",
    [
        (3000, 5, 65536),  # one chunk
        (3000, 5, 1000),  # three chunks merged
        (3000, 64, 1000),  # k of a chunk's 1000 keys, merged
        (5000, 7, 64),  # many small chunks, the last one short
    ],
)
def test_the_chunked_search_is_exact_on_larger_stores(num_keys, k, key_chunk_size):
    """Chunk by chunk, the result is still the brute-force one."""
    rng = np.random.default_rng(3)
    keys = rng.normal(size=(num_keys, 8)).astype("float32")
    # Neighbours clustered in one chunk, and spread across chunks.
    queries = np.concatenate(
        [keys[[10, 11, 2900]] + 0.01, rng.normal(size=(5, 8)).astype("float32")]
    )
    distances, indices = nearest_neighbors(
        queries, keys, k=k, key_chunk_size=key_chunk_size
    )
    squared = ((queries[:, None, :] - keys[None, :, :]) ** 2).sum(-1)
    expected = np.argsort(squared, axis=1, kind="stable")[:, :k]
    np.testing.assert_array_equal(to_numpy(indices), expected)
    np.testing.assert_allclose(
        to_numpy(distances),
        np.take_along_axis(squared, expected, axis=1),
        rtol=1e-4,
        atol=1e-4,
    )


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_keys_are_searched_in_their_dtype(dtype):
    """Products in the keys' dtype: the neighbours of well-separated keys are
    found, with distances within that dtype's rounding."""
    from keras import ops

    rng = np.random.default_rng(5)
    keys = rng.normal(size=(3000, 16)).astype("float32")
    queries = keys[[5, 1234, 2999]] + 0.05 * rng.normal(size=(3, 16))
    distances, indices = nearest_neighbors(
        queries, ops.cast(keys, dtype), k=3, key_chunk_size=1000
    )
    assert to_numpy(distances).dtype == np.float32
    np.testing.assert_array_equal(to_numpy(indices)[:, 0], [5, 1234, 2999])
    rounded = to_numpy(ops.cast(ops.cast(keys, dtype), "float32"))
    squared = ((queries[:, None, :] - rounded[None, :, :]) ** 2).sum(-1)
    np.testing.assert_allclose(
        to_numpy(distances), np.sort(squared, axis=1)[:, :3], atol=0.5
    )


def test_given_key_norms_are_used_and_checked():
    rng = np.random.default_rng(4)
    keys = rng.normal(size=(200, 4)).astype("float32")
    queries = rng.normal(size=(3, 4)).astype("float32")
    norms = (keys**2).sum(-1)
    given = nearest_neighbors(queries, keys, k=5, key_norms=norms)
    computed = nearest_neighbors(queries, keys, k=5)
    np.testing.assert_array_equal(to_numpy(given[1]), to_numpy(computed[1]))
    # Wrong norms move the neighbours: they are what the search uses.
    shifted = norms.copy()
    shifted[to_numpy(computed[1])[0, 0]] += 100.0
    moved = nearest_neighbors(queries, keys, k=5, key_norms=shifted)
    assert to_numpy(moved[1])[0, 0] != to_numpy(computed[1])[0, 0]
    with pytest.raises(
        ValueError,
        match=r"`key_norms` must have one entry per key \(200\). "
        r"Received: key_norms.shape=\(199,\)",
    ):
        nearest_neighbors(queries, keys, k=5, key_norms=norms[:199])


def test_a_query_equal_to_a_key_finds_it_at_distance_zero():
    keys = np.array([[3.0, 4.0], [0.0, 0.0], [1.0, 1.0]], "float32")
    distances, indices = nearest_neighbors(keys[:1] * 1.0, keys, k=3)
    np.testing.assert_array_equal(to_numpy(indices), [[0, 2, 1]])
    np.testing.assert_allclose(to_numpy(distances), [[0.0, 13.0, 25.0]], atol=1e-5)


def test_weights_are_a_softmax_of_negative_distances_over_temperature():
    distances = np.array([[0.0, 10.0, 20.0]], "float32")
    weights = to_numpy(knn_weights(distances, temperature=10.0))
    expected = np.exp([0.0, -1.0, -2.0])
    np.testing.assert_allclose(weights[0], expected / expected.sum(), rtol=1e-6)
    flat = to_numpy(knn_weights(distances, temperature=1e6))
    np.testing.assert_allclose(flat[0], [1 / 3] * 3, rtol=1e-4)


def test_probabilities_add_up_the_weights_of_neighbours_sharing_a_token():
    values = np.array([[2, 0, 2], [1, 1, 1]], "int32")
    weights = np.array([[0.5, 0.3, 0.2], [0.2, 0.3, 0.5]], "float32")
    probabilities = to_numpy(knn_probabilities(values, weights, vocabulary_size=4))
    np.testing.assert_allclose(
        probabilities, [[0.3, 0.0, 0.7, 0.0], [0.0, 1.0, 0.0, 0.0]], atol=1e-7
    )


def test_mixture_is_a_distribution_and_matches_the_formula():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(3, 6))
    model_log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    knn = np.zeros((3, 6), "float32")
    knn[:, 2] = 0.75
    knn[:, 4] = 0.25
    mixed = to_numpy(knn_mixture_log_probs(model_log_probs, knn, lam=0.3))
    expected = np.log(0.7 * np.exp(model_log_probs) + 0.3 * knn)
    np.testing.assert_allclose(mixed, expected, rtol=1e-5)
    np.testing.assert_allclose(np.exp(mixed).sum(-1), 1.0, rtol=1e-5)
    assert np.all(np.isfinite(mixed))  # tokens no neighbour names stay finite
    unchanged = to_numpy(knn_mixture_log_probs(model_log_probs, knn, lam=0.0))
    np.testing.assert_allclose(unchanged, model_log_probs, rtol=1e-6)


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: nearest_neighbors(np.zeros((2, 3)), np.zeros((5, 3)), k=6),
            "`k` must be at most the number of keys (5). Received: k=6",
        ),
        (
            lambda: nearest_neighbors(np.zeros((2, 3)), np.zeros((5, 3)), k=0),
            "`k` must be a positive integer. Received: k=0",
        ),
        (
            lambda: nearest_neighbors(np.zeros((2, 4)), np.zeros((5, 3)), k=1),
            "`queries` and `keys` must have the same last dimension. Received: "
            "queries.shape=(2, 4), keys.shape=(5, 3)",
        ),
        (
            lambda: nearest_neighbors(np.zeros((4,)), np.zeros((5, 4)), k=1),
            "`queries` must have rank 2. Received: queries.shape=(4,)",
        ),
        (
            lambda: knn_weights(np.zeros((1, 2)), temperature=0.0),
            "`temperature` must be a positive number. Received: temperature=0.0",
        ),
        (
            lambda: knn_weights(np.zeros((1, 2)), temperature=math.inf),
            "`temperature` must be a positive number. Received: temperature=inf",
        ),
        (
            lambda: knn_mixture_log_probs(np.zeros((1, 2)), np.zeros((1, 2)), 1.0),
            "`lam` must be a float in [0, 1). Received: lam=1.0",
        ),
        (
            lambda: knn_probabilities(np.zeros((1, 2)), np.ones((1, 2)), 0),
            "`vocabulary_size` must be a positive integer. Received: vocabulary_size=0",
        ),
    ],
)
def test_bad_arguments_are_named(call, message):
    with pytest.raises(
        ValueError,
        match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\["),
    ):
        call()
