"""Nearest-neighbour next-token distributions (kNN-LM / kNN-MT)."""

import math

import numpy as np
import pytest

from keras_attn.ops import (
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
