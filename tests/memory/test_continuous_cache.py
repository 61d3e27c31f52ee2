"""The continuous cache (Grave et al. 2017) over a token stream."""

import math

import numpy as np
import pytest

from keras_attn.memory import (
    ContinuousCache,
    choose_continuous_cache,
    continuous_cache_log_probs,
    continuous_cache_mixture,
    continuous_cache_probabilities,
    continuous_cache_stream_probabilities,
)
from tests.test_case import to_numpy


def stream(*args, **kwargs):
    """`continuous_cache_stream_probabilities` as NumPy arrays."""
    probabilities, has_memory = continuous_cache_stream_probabilities(*args, **kwargs)
    return to_numpy(probabilities), to_numpy(has_memory)


def naive_cache(states, targets, documents, theta, window):
    """One position at a time, straight from the paper's formula."""
    probabilities, has_memory = [], []
    for t in range(len(targets)):
        memory = [
            i
            for i in range(t)
            if documents[i] == documents[t] and (window is None or i >= t - window)
        ]
        if not memory:
            probabilities.append(0.0)
            has_memory.append(False)
            continue
        scores = np.array([theta * float(states[t] @ states[i]) for i in memory])
        weights = np.exp(scores - scores.max())
        weights /= weights.sum()
        probabilities.append(
            sum(
                w
                for w, i in zip(weights, memory, strict=True)
                if targets[i] == targets[t]
            )
        )
        has_memory.append(True)
    return np.array(probabilities), np.array(has_memory)


def test_hand_checked_stream():
    # h0 = h2 = [1, 0], h1 = [0, 1]; targets 5, 7, 5; theta 1.
    states = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]], "float32")
    targets = np.array([5, 7, 5])
    probabilities, has_memory = stream(states, targets, np.zeros(3, int), theta=1.0)
    # Position 0: no memory. Position 1: all weight on position 0, whose next
    # token is 5, not 7. Position 2: scores 1 (h0) and 0 (h1), weights
    # e / (e + 1) and 1 / (e + 1); only position 0 was followed by 5.
    np.testing.assert_array_equal(has_memory, [False, True, True])
    np.testing.assert_allclose(
        probabilities, [0.0, 0.0, math.e / (math.e + 1)], atol=1e-6
    )
    # The mixture at lambda 0.5 with model probabilities 0.1, 0.2, 0.3: the
    # model alone at position 0, halves elsewhere.
    log_probs = to_numpy(
        continuous_cache_mixture(
            np.log([0.1, 0.2, 0.3]), probabilities, has_memory, 0.5
        )
    )
    np.testing.assert_allclose(
        np.exp(log_probs),
        [0.1, 0.5 * 0.2, 0.5 * 0.3 + 0.5 * math.e / (math.e + 1)],
        rtol=1e-5,
    )


@pytest.mark.parametrize(
    "window, chunk_size",
    [(None, 512), (None, 3), (4, 3), (4, 16), (1, 5), (50, 7)],
)
def test_stream_matches_the_formula_position_by_position(window, chunk_size):
    rng = np.random.default_rng(0)
    length = 40
    states = rng.normal(size=(length, 6)).astype("float32")
    targets = rng.integers(4, 9, size=length)  # few ids: many repeats
    # Three documents, one of a single position, chunks crossing them.
    documents = np.array([0] * 17 + [1] + [2] * 22)
    expected, expected_memory = naive_cache(states, targets, documents, 0.7, window)
    probabilities, has_memory = stream(
        states, targets, documents, theta=0.7, window=window, chunk_size=chunk_size
    )
    np.testing.assert_array_equal(has_memory, expected_memory)
    np.testing.assert_allclose(probabilities, expected, atol=1e-5)
    # Every document's first position, and only it, has no memory.
    assert list(np.flatnonzero(~has_memory)) == [0, 17, 18]
    # Bounding the reach by the longest document (22) changes nothing.
    bounded = stream(
        states,
        targets,
        documents,
        theta=0.7,
        window=window,
        chunk_size=chunk_size,
        max_document_length=22,
    )
    np.testing.assert_array_equal(bounded[1], expected_memory)
    np.testing.assert_allclose(bounded[0], expected, atol=1e-5)


def test_a_batch_of_streams_scores_each_as_on_its_own_and_skips_padding():
    rng = np.random.default_rng(3)
    states = rng.normal(size=(3, 11, 5)).astype("float32")
    targets = rng.integers(4, 8, size=(3, 11))
    documents = np.zeros((3, 11), int)
    documents[2, 6:] = 1
    valid = np.ones((3, 11), bool)
    valid[1, 7:] = False  # a shorter text, padded
    probabilities, has_memory = stream(
        states, targets, documents, theta=0.4, valid=valid, chunk_size=4
    )
    assert probabilities.shape == has_memory.shape == (3, 11)
    for text in range(3):
        length = int(valid[text].sum())
        expected, memory = naive_cache(
            states[text, :length], targets[text, :length], documents[text], 0.4, None
        )
        np.testing.assert_allclose(probabilities[text, :length], expected, atol=1e-5)
        np.testing.assert_array_equal(has_memory[text, :length], memory)
    np.testing.assert_array_equal(probabilities[1, 7:], 0.0)
    assert not has_memory[1, 7:].any()


def test_documents_are_told_apart_by_id_wherever_they_are():
    # Ids need not be sorted: position 3 (document 0) remembers 0 and 1 only.
    states = np.ones((4, 2), "float32")
    targets = np.array([5, 6, 5, 5])
    probabilities, has_memory = stream(
        states, targets, np.array([0, 0, 1, 0]), theta=1.0
    )
    np.testing.assert_array_equal(has_memory, [False, True, False, True])
    np.testing.assert_allclose(probabilities, [0.0, 0.0, 0.0, 0.5], atol=1e-6)


@pytest.mark.tf_only
def test_the_same_function_runs_in_a_traced_graph_with_unknown_lengths():
    import tensorflow as tf

    rng = np.random.default_rng(5)
    states = rng.normal(size=(2, 13, 4)).astype("float32")
    targets = rng.integers(0, 4, size=(2, 13)).astype("int32")
    valid = np.arange(13)[None, :] < np.array([[13], [9]])

    @tf.function(
        input_signature=[
            tf.TensorSpec([None, None, 4], tf.float32),
            tf.TensorSpec([None, None], tf.int32),
            tf.TensorSpec([None, None], tf.bool),
        ]
    )
    def traced(states, targets, valid):
        return continuous_cache_stream_probabilities(
            states, targets, theta=0.6, valid=valid, window=5, chunk_size=4
        )

    got = [to_numpy(x) for x in traced(states, targets, valid)]
    want = stream(states, targets, theta=0.6, valid=valid, window=5, chunk_size=4)
    np.testing.assert_allclose(got[0], want[0], atol=1e-6)
    np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.jax_only
def test_the_same_function_runs_under_jit():
    import jax

    rng = np.random.default_rng(5)
    states = rng.normal(size=(2, 13, 4)).astype("float32")
    targets = rng.integers(0, 4, size=(2, 13)).astype("int32")
    jitted = jax.jit(
        lambda s, t: continuous_cache_stream_probabilities(
            s, t, theta=0.6, window=5, chunk_size=4
        )
    )
    got = [to_numpy(x) for x in jitted(states, targets)]
    want = stream(states, targets, theta=0.6, window=5, chunk_size=4)
    np.testing.assert_allclose(got[0], want[0], atol=1e-6)
    np.testing.assert_array_equal(got[1], want[1])


def test_the_cache_never_crosses_documents():
    # Document 1 repeats document 0's tokens with the same states: its first
    # position must not find them.
    states = np.ones((4, 2), "float32")
    targets = np.array([9, 9, 9, 9])
    probabilities, has_memory = stream(
        states, targets, np.array([0, 0, 1, 1]), theta=1.0
    )
    np.testing.assert_array_equal(has_memory, [False, True, False, True])
    np.testing.assert_allclose(probabilities, [0.0, 1.0, 0.0, 1.0])


def test_chunk_op_masks_and_normalises():
    query = np.array([[1.0, 0.0], [0.0, 2.0]], "float32")
    memory = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], "float32")
    next_ids = np.array([3, 4, 3])
    targets = np.array([3, 4])
    mask = np.array([[True, True, True], [False, False, False]])
    probabilities, has_memory = continuous_cache_probabilities(
        query, memory, next_ids, targets, mask, theta=2.0
    )
    scores = 2.0 * np.array([1.0, 0.0, 1.0])
    weights = np.exp(scores) / np.exp(scores).sum()
    np.testing.assert_allclose(
        to_numpy(probabilities), [weights[0] + weights[2], 0.0], atol=1e-6
    )
    np.testing.assert_array_equal(to_numpy(has_memory), [True, False])


def test_chunk_op_and_mixture_take_a_batch_of_texts():
    """With a leading batch axis, each text is scored as on its own."""
    rng = np.random.default_rng(4)
    batch, queries, memories = 3, 4, 6
    query = rng.normal(size=(batch, queries, 5)).astype("float32")
    memory = rng.normal(size=(batch, memories, 5)).astype("float32")
    next_ids = rng.integers(0, 3, size=(batch, memories))
    targets = rng.integers(0, 3, size=(batch, queries))
    mask = rng.random((batch, queries, memories)) < 0.6
    mask[1, 2] = False  # a query with no memory
    model_log_probs = np.log(rng.uniform(0.05, 0.9, size=(batch, queries)))
    probabilities, has_memory = continuous_cache_probabilities(
        query, memory, next_ids, targets, mask, theta=0.5
    )
    mixed = continuous_cache_mixture(model_log_probs, probabilities, has_memory, 0.3)
    assert tuple(probabilities.shape) == tuple(mixed.shape) == (batch, queries)
    for text in range(batch):
        one_probabilities, one_memory = continuous_cache_probabilities(
            query[text], memory[text], next_ids[text], targets[text], mask[text], 0.5
        )
        np.testing.assert_allclose(
            to_numpy(probabilities)[text], to_numpy(one_probabilities), atol=1e-6
        )
        np.testing.assert_array_equal(to_numpy(has_memory)[text], to_numpy(one_memory))
        np.testing.assert_allclose(
            to_numpy(mixed)[text],
            to_numpy(
                continuous_cache_mixture(
                    model_log_probs[text], one_probabilities, one_memory, 0.3
                )
            ),
            rtol=1e-6,
        )
    assert not to_numpy(has_memory)[1, 2]
    np.testing.assert_allclose(  # no memory: the model alone
        to_numpy(mixed)[1, 2], model_log_probs[1, 2], rtol=1e-6
    )


def test_mixture_lambda_zero_is_the_model_and_log_space_stays_finite():
    model_log_probs = np.array([-0.5, -200.0, -300.0], "float32")
    probabilities = np.array([0.4, 0.0, 0.25], "float32")
    has_memory = np.array([True, True, True])
    np.testing.assert_allclose(
        to_numpy(
            continuous_cache_mixture(model_log_probs, probabilities, has_memory, 0.0)
        ),
        model_log_probs,
    )
    mixed = to_numpy(
        continuous_cache_mixture(model_log_probs, probabilities, has_memory, 0.2)
    )
    # exp(-200) underflows float32, the log-space sum does not.
    np.testing.assert_allclose(mixed[1], -200.0 + math.log(0.8), rtol=1e-6)
    np.testing.assert_allclose(mixed[2], math.log(0.2 * 0.25), rtol=1e-6)
    np.testing.assert_allclose(
        mixed[0], math.log(0.8 * math.exp(-0.5) + 0.2 * 0.4), rtol=1e-6
    )


def test_log_probs_compose_stream_and_mixture():
    rng = np.random.default_rng(1)
    states = rng.normal(size=(12, 4)).astype("float32")
    targets = rng.integers(0, 3, size=12)
    documents = np.array([0] * 5 + [1] * 7)
    model_log_probs = np.log(rng.uniform(0.05, 0.9, size=12)).astype("float32")
    expected, memory = naive_cache(states, targets, documents, 0.3, None)
    expected = np.where(
        memory,
        np.log(0.7 * np.exp(model_log_probs) + 0.3 * expected),
        model_log_probs,
    )
    np.testing.assert_allclose(
        to_numpy(
            continuous_cache_log_probs(
                states, targets, model_log_probs, documents, theta=0.3, lam=0.3
            )
        ),
        expected,
        rtol=1e-5,
    )


def test_an_empty_stream_gives_empty_arrays():
    probabilities, has_memory = stream(
        np.zeros((0, 3)), np.zeros((0,), int), np.zeros((0,), int), theta=1.0
    )
    assert probabilities.shape == has_memory.shape == (0,)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"theta": 0.0}, "`theta` must be a positive number. Received: theta=0.0"),
        ({"theta": True}, "Received: theta=True"),
        (
            {"window": 0},
            "`window` must be a positive integer or None. Received: window=0",
        ),
        (
            {"chunk_size": 2.5},
            "`chunk_size` must be a positive integer. Received: chunk_size=2.5",
        ),
    ],
)
def test_bad_stream_arguments_are_named(kwargs, message):
    arguments = {"theta": 1.0, **kwargs}
    with pytest.raises(
        ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
    ):
        continuous_cache_stream_probabilities(
            np.zeros((2, 3)), np.zeros(2, int), np.zeros(2, int), **arguments
        )


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match=r"`states` must have one row per target"):
        continuous_cache_stream_probabilities(
            np.zeros((2, 3)), np.zeros(3, int), np.zeros(3, int), theta=1.0
        )
    with pytest.raises(ValueError, match=r"`document_ids` must have the shape of"):
        continuous_cache_stream_probabilities(
            np.zeros((3, 3)), np.zeros(3, int), np.zeros(2, int), theta=1.0
        )
    with pytest.raises(ValueError, match=r"`model_log_probs` must have one entry"):
        continuous_cache_log_probs(
            np.zeros((3, 3)),
            np.zeros(3, int),
            np.zeros(2),
            np.zeros(3, int),
            theta=1.0,
            lam=0.1,
        )


@pytest.mark.parametrize("lam", [1.0, -0.1, "0.5"])
def test_bad_lambda_is_named(lam):
    with pytest.raises(ValueError, match=r"`lam` must be a float in \[0, 1\)"):
        continuous_cache_mixture(np.zeros(2), np.zeros(2), np.ones(2, bool), lam)


def test_cache_and_mixture_are_distributions_over_the_vocabulary():
    # For one query, asking for every token of the vocabulary in turn: the
    # cache's probabilities sum to 1 (0 without memory), and so does the
    # mixture with any model distribution.
    rng = np.random.default_rng(2)
    vocabulary, length = 6, 9
    states = rng.normal(size=(length, 4)).astype("float32")
    next_ids = rng.integers(0, vocabulary, size=length)
    model_probs = rng.dirichlet(np.ones(vocabulary)).astype("float32")
    for query in (0, 5, 8):
        candidates = np.arange(vocabulary)
        mask = np.broadcast_to(np.arange(length) < query, (vocabulary, length))
        probabilities, has_memory = continuous_cache_probabilities(
            np.repeat(states[query : query + 1], vocabulary, axis=0),
            states,
            next_ids,
            candidates,
            mask,
            theta=0.8,
        )
        probabilities = to_numpy(probabilities)
        np.testing.assert_allclose(
            probabilities.sum(), 1.0 if query else 0.0, atol=1e-6
        )
        mixed = to_numpy(
            continuous_cache_mixture(
                np.log(model_probs), probabilities, to_numpy(has_memory), 0.35
            )
        )
        np.testing.assert_allclose(np.exp(mixed).sum(), 1.0, atol=1e-5)


def test_continuous_cache_settings_score_as_the_function():
    rng = np.random.default_rng(2)
    states = rng.normal(size=(9, 4)).astype("float32")
    targets = rng.integers(0, 3, size=9)
    documents = np.array([0] * 4 + [1] * 5)
    model_log_probs = np.log(rng.uniform(0.05, 0.9, size=9)).astype("float32")
    cache = ContinuousCache(theta=0.3, lam=0.2, window=2)
    np.testing.assert_array_equal(
        to_numpy(cache.log_probs(states, targets, model_log_probs, documents)),
        to_numpy(
            continuous_cache_log_probs(
                states,
                targets,
                model_log_probs,
                documents,
                theta=0.3,
                lam=0.2,
                window=2,
            )
        ),
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"theta": -1.0}, "`theta` must be a positive number. Received: theta=-1.0"),
        ({"lam": 1.0}, "`lam` must be a float in [0, 1). Received: lam=1.0"),
        (
            {"window": 0},
            "`window` must be a positive integer or None. Received: window=0",
        ),
    ],
)
def test_bad_continuous_cache_settings_are_named(kwargs, message):
    with pytest.raises(ValueError) as error:
        ContinuousCache(**{"theta": 0.1, "lam": 0.3, **kwargs})
    assert str(error.value) == message


def test_the_validation_search_keeps_the_setting_of_lowest_loss():
    rng = np.random.default_rng(6)
    length = 30
    states = rng.normal(size=(length, 4)).astype("float32")
    targets = rng.integers(4, 7, size=length)
    documents = np.array([0] * 12 + [1] * 18)
    log_probs = np.log(rng.uniform(0.05, 0.9, size=length)).astype("float32")
    validation = {
        "states": states,
        "targets": targets,
        "log_probs": log_probs,
        "document_ids": documents,
    }
    cache, trials = choose_continuous_cache(
        validation, theta=(0.1, 1.0), lam=(0.0, 0.2, 0.5)
    )
    assert [(t["theta"], t["lambda"]) for t in trials] == [
        (0.1, 0.0), (0.1, 0.2), (0.1, 0.5), (1.0, 0.0), (1.0, 0.2), (1.0, 0.5)
    ]  # fmt: skip
    for trial in trials:  # each loss is the formula's, position by position
        probabilities, memory = naive_cache(
            states, targets, documents, trial["theta"], None
        )
        lam = trial["lambda"]
        mixed = np.where(
            memory,
            np.log((1 - lam) * np.exp(log_probs) + lam * probabilities),
            log_probs,
        )
        np.testing.assert_allclose(trial["nats"], -mixed.sum(), rtol=1e-5)
    best = min(trials, key=lambda trial: trial["nats"])
    assert (cache.theta, cache.lam, cache.window) == (
        best["theta"], best["lambda"], None
    )  # fmt: skip
