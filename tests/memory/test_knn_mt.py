"""kNN-MT: the datastore of a Transformer translator and decoding with it."""

import types

import keras
import numpy as np
import pytest

from keras_attn.memory import (
    NearestNeighborDecoding,
    TranslationDatastore,
    choose_knn,
    knn_target_log_probs,
    translation_datastore,
    translation_states,
)
from keras_attn.models import RNNTranslator
from tests.models.test_transformer_translator import SOURCE, TARGET, small_translator
from tests.test_case import to_numpy

# Targets: TARGET shifted left (what each decoder position predicts).
LABELS = np.array([[4, 5, 6, 3, 0], [7, 8, 9, 10, 3]], "int32")


def batches():
    """Two `translation_dataset`-style batches: (inputs, targets, weights)."""
    inputs = {"encoder_inputs": SOURCE, "decoder_inputs": TARGET}
    weights = (LABELS != 0).astype("float32")
    return [(inputs, LABELS, weights), (inputs, LABELS)]


def brute_force_knn(query, store, k, temperature, vocabulary_size):
    distances = ((store.keys - query) ** 2).sum(-1)
    nearest = np.argsort(distances, kind="stable")[:k]
    weights = np.exp(-(distances[nearest] - distances[nearest].min()) / temperature)
    weights /= weights.sum()
    probabilities = np.zeros(vocabulary_size)
    np.add.at(probabilities, store.values[nearest], weights)
    return probabilities


def test_the_datastore_keeps_each_non_padding_target_and_its_state():
    model = small_translator()
    store = translation_datastore(model, batches())
    states, _ = model.call_with_states(
        {"encoder_inputs": SOURCE, "decoder_inputs": TARGET}
    )
    keep = LABELS != 0
    assert len(store) == 2 * keep.sum() == 18 and store.vocabulary_size == 30
    expected_keys = np.asarray(to_numpy(states), "float32")[keep]
    np.testing.assert_allclose(store.keys[:9], expected_keys, atol=1e-6)
    np.testing.assert_allclose(store.keys[9:], expected_keys, atol=1e-6)
    np.testing.assert_array_equal(store.values, np.tile(LABELS[keep], 2))
    assert store.keys.dtype == np.float32 and store.values.dtype == np.int32


def test_states_come_with_the_models_log_probability_of_each_target():
    model = small_translator()
    found = translation_states(model, batches()[:1], log_probs=True)
    logits = to_numpy(model({"encoder_inputs": SOURCE, "decoder_inputs": TARGET}))
    logits = logits.astype("float64")
    log_softmax = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    keep = LABELS != 0
    expected = np.take_along_axis(log_softmax, LABELS[..., None], -1)[..., 0][keep]
    np.testing.assert_allclose(found["log_probs"], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(found["targets"], LABELS[keep])
    assert "log_probs" not in translation_states(model, batches()[:1])


def test_the_datastore_survives_a_save_and_load(tmp_path):
    store = TranslationDatastore(
        np.arange(12, dtype="float32").reshape(4, 3), [1, 2, 3, 1], 5
    )
    restored = TranslationDatastore.load(store.save(tmp_path / "store" / "de.npz"))
    np.testing.assert_array_equal(restored.keys, store.keys)
    np.testing.assert_array_equal(restored.values, store.values)
    assert restored.vocabulary_size == 5


def first_step(model, knn, reference_store):
    """The mixed first decoding step's probabilities `(2, vocab)`, and the
    brute-force mixture of the model with `reference_store`'s neighbours."""
    start = np.full((2, 1), 2, "int32")  # the start token
    logits, _ = model.call_with_cache(start, model.encode(SOURCE, 6), 0)
    log_probs, _ = model.call_with_cache(
        start, model.encode(SOURCE, 6), 0, nearest_neighbors=knn
    )
    states, _ = model.call_with_states(
        {"encoder_inputs": SOURCE, "decoder_inputs": start}
    )
    logits = to_numpy(logits)[:, -1].astype("float64")
    model_probs = np.exp(logits - logits.max(-1, keepdims=True))
    model_probs /= model_probs.sum(-1, keepdims=True)
    queries = np.asarray(to_numpy(states), "float32")[:, 0]
    expected = [
        (1 - knn.lam) * model_probs[row]
        + knn.lam
        * brute_force_knn(queries[row], reference_store, knn.k, knn.temperature, 30)
        for row in range(2)
    ]
    return np.exp(to_numpy(log_probs)[:, -1]), np.array(expected)


def test_a_decoding_step_mixes_the_model_with_its_neighbours():
    model = small_translator()
    store = translation_datastore(model, batches()[:1])
    knn = NearestNeighborDecoding(store, k=4, temperature=2.0, lam=0.4)
    got, expected = first_step(model, knn, store)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("key_dtype", ["bfloat16", "float16"])
def test_keys_held_in_half_precision_decode_as_their_rounded_values(key_dtype):
    """Half the memory; the step mixes in the neighbours of the rounded keys
    (distances rounded too, so within that precision of the brute force)."""
    import ml_dtypes

    # Seeded weights: with rounded distances, a near-tie between the k-th and
    # the next neighbour may swap them, which no tolerance covers; the weights
    # of seed 0 (and of every seed 0-11 tried) have no such tie.
    keras.utils.set_random_seed(0)
    model = small_translator()
    store = translation_datastore(model, batches()[:1])
    knn = NearestNeighborDecoding(
        store, k=4, temperature=2.0, lam=0.4, key_dtype=key_dtype
    )
    layer = knn.weights_layer()
    assert layer.datastore_keys.dtype == key_dtype
    rounded = store.keys.astype(getattr(ml_dtypes, key_dtype, np.float16))
    rounded = rounded.astype("float32")
    np.testing.assert_array_equal(to_numpy(layer.datastore_keys.value), rounded)
    np.testing.assert_allclose(
        to_numpy(layer.datastore_key_norms.value), (rounded**2).sum(-1), rtol=1e-6
    )
    rounded_store = TranslationDatastore(rounded, store.values, 30)
    got, expected = first_step(model, knn, rounded_store)
    np.testing.assert_allclose(got, expected, atol=0.02)


def test_beam_search_with_a_zero_weight_is_the_models_own():
    model = small_translator()
    store = translation_datastore(model, batches())
    knn = NearestNeighborDecoding(store, k=3, temperature=1.0, lam=0.0)
    plain, _ = model.translate_ids(SOURCE, 6, beam_width=3)
    mixed, _ = model.translate_ids(SOURCE, 6, beam_width=3, nearest_neighbors=knn)
    np.testing.assert_array_equal(to_numpy(mixed), to_numpy(plain))


def test_a_dominant_datastore_steers_greedy_decoding():
    """Every key names token 11: at lambda 0.99 greedy search writes it."""
    model = small_translator()
    store = translation_datastore(model, batches())
    store = TranslationDatastore(store.keys, np.full(len(store), 11), 30)
    knn = NearestNeighborDecoding(store, k=5, temperature=10.0, lam=0.99)
    tokens, _ = model.translate_ids(SOURCE, 4, beam_width=1, nearest_neighbors=knn)
    tokens = to_numpy(tokens)
    np.testing.assert_array_equal(tokens, np.full((2, 4), 11))


def test_target_log_probs_follow_the_mixture_formula():
    distances = np.array([[0.0, 1.0, 4.0], [2.0, 2.0, 9.0]], "float32")
    values = np.array([[7, 3, 7], [5, 6, 5]])
    targets = np.array([7, 6])
    model_log_probs = np.log(np.array([0.2, 0.5], "float32"))
    got = knn_target_log_probs(
        model_log_probs, distances, values, targets, k=2, temperature=1.0, lam=0.25
    )
    knn_first = 1.0 / (1.0 + np.exp(-1.0))  # only the nearest names token 7
    expected = np.log([0.75 * 0.2 + 0.25 * knn_first, 0.75 * 0.5 + 0.25 * 0.5])
    np.testing.assert_allclose(got, expected, rtol=1e-5)


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: TranslationDatastore(np.zeros((3, 2)), [0, 1], 4),
            "`values` must be 3 integers, one per key",
        ),
        (
            lambda: TranslationDatastore(np.zeros((2, 2)), [0, 4], 4),
            r"`values` must be token ids in \[0, 4\). Received: ids from 0 to 4",
        ),
        (
            lambda: TranslationDatastore(np.zeros((0, 2)), [], 4),
            r"`keys` must be a non-empty \(entries, dim\) array",
        ),
        (
            lambda: NearestNeighborDecoding(
                TranslationDatastore(np.zeros((2, 2)), [0, 1], 4), k=3
            ),
            r"`k` must be at most the datastore's size \(2\). Received: k=3",
        ),
        (
            lambda: NearestNeighborDecoding(
                TranslationDatastore(np.zeros((2, 2)), [0, 1], 4),
                k=1,
                temperature=-1.0,
            ),
            "`temperature` must be a positive number. Received: temperature=-1.0",
        ),
        (
            lambda: NearestNeighborDecoding(
                TranslationDatastore(np.zeros((2, 2)), [0, 1], 4),
                k=1,
                key_dtype="int8",
            ),
            r"`key_dtype` must be one of \['float32', 'bfloat16', 'float16'\]. "
            "Received: key_dtype='int8'",
        ),
        (
            lambda: NearestNeighborDecoding(np.zeros((2, 2))),
            "`datastore` must be a TranslationDatastore. Received: datastore=ndarray",
        ),
        (
            lambda: knn_target_log_probs(
                np.zeros(1),
                np.zeros((1, 2)),
                np.zeros((1, 2)),
                [0],
                k=3,
                temperature=1.0,
                lam=0.1,
            ),
            r"`k` must be at most the neighbours searched \(2\). Received: k=3",
        ),
        (
            lambda: translation_datastore(small_translator(), [SOURCE]),
            r"`dataset` must yield `\(inputs, targets\)`",
        ),
    ],
)
def test_bad_arguments_are_named(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_the_rnn_translator_is_refused():
    model = RNNTranslator(30, 30, embedding_dim=8, units=12, dropout=0.0)
    store = TranslationDatastore(np.zeros((2, 24), "float32"), [0, 1], 30)
    with pytest.raises(ValueError, match="needs a Transformer translator"):
        model.translate_ids(
            SOURCE, 4, nearest_neighbors=NearestNeighborDecoding(store, k=1)
        )
    with pytest.raises(ValueError, match="kNN-MT needs a Transformer translator"):
        translation_states(model, batches())


def test_the_validation_search_keeps_the_setting_of_lowest_loss():
    model = small_translator()
    store = translation_datastore(model, batches())
    knn, report = choose_knn(
        model, store, batches()[:1], k=(2, 40), temperature=(1.0, 5.0), lam=(0.0, 0.5)
    )
    trials, model_nats = report["trials"], report["model_validation_nats_per_token"]
    # k is capped at the datastore's 18 entries; every combination is tried.
    assert [(t["k"], t["temperature"], t["lambda"]) for t in trials] == [
        (k, t, lam) for k in (2, 18) for t in (1.0, 5.0) for lam in (0.0, 0.5)
    ]
    found = translation_states(model, batches()[:1], log_probs=True)
    np.testing.assert_allclose(model_nats, -found["log_probs"].mean(), rtol=1e-6)
    for trial in trials:  # each loss is the brute-force mixture's
        expected = []
        for state, target, log_prob in zip(
            found["states"], found["targets"], found["log_probs"], strict=True
        ):
            probs = brute_force_knn(state, store, trial["k"], trial["temperature"], 30)
            lam = trial["lambda"]
            expected.append(np.log((1 - lam) * np.exp(log_prob) + lam * probs[target]))
        np.testing.assert_allclose(
            trial["validation_nats_per_token"], -np.mean(expected), rtol=1e-4
        )
        if trial["lambda"] == 0.0:
            np.testing.assert_allclose(
                trial["validation_nats_per_token"], model_nats, rtol=1e-6
            )
    best = min(trials, key=lambda trial: trial["validation_nats_per_token"])
    assert (knn.k, knn.temperature, knn.lam) == (
        best["k"], best["temperature"], best["lambda"]
    )  # fmt: skip
    assert (report["k"], report["lambda"]) == (knn.k, knn.lam)
    assert report["validation_nats_per_token"] == best["validation_nats_per_token"]
    assert report["datastore_entries"] == 18 and report["key_dtype"] == "float32"


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_the_knn_recipe_builds_chooses_and_tunes_the_length_penalty(policy):
    """`training.choose_knn_decoding`: the datastore of the first batches,
    `choose_knn`'s setting on the second, then the penalty of the best BLEU
    decoding the held-out pairs with those neighbours."""
    from keras_attn import training

    model = small_translator()
    decodings = []

    def evaluate_translations(pairs, **options):  # BLEU 20 + the penalty
        decodings.append({"pairs": pairs, **options})
        return {"bleu": types.SimpleNamespace(score=20 + options["length_penalty"])}

    model.evaluate_translations = evaluate_translations
    pairs = [("a b", "c d")]
    grid = dict(k=(2, 40), temperature=(1.0, 5.0), lam=(0.0, 0.5))
    keras.config.set_dtype_policy(policy)  # the tests' fixture resets it
    knn, penalty, report = training.choose_knn_decoding(
        model, batches(), batches()[:1], pairs, length_penalty=(1.0, 0.6), **grid,
        beam_width=2,
    )  # fmt: skip
    keras.config.set_dtype_policy("float32")
    expected, expected_report = choose_knn(
        model, translation_datastore(model, batches()), batches()[:1], **grid
    )
    assert report["datastore_entries"] == len(knn.datastore) == 18
    assert (knn.k, knn.temperature, knn.lam) == (
        expected.k, expected.temperature, expected.lam
    )  # fmt: skip
    assert report["trials"] == expected_report["trials"]
    compute_dtype = "bfloat16" if policy == "mixed_bfloat16" else "float32"
    assert knn.key_dtype == report["key_dtype"] == compute_dtype  # "auto"
    assert penalty == 1.0 and list(report["length_penalty_results"]) == [1.0, 0.6]
    assert [call["length_penalty"] for call in decodings] == [1.0, 0.6]
    for call in decodings:
        assert call["pairs"] == pairs and call["nearest_neighbors"] is knn
        assert call["beam_width"] == 2 and "kNN-MT" in call["title"]
