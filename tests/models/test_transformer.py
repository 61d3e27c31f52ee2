import keras
import numpy as np
import pytest

from keras_attn import generation
from keras_attn.models import (
    rnn_translator,
    transformer_language_model,
    transformer_language_model_decoding,
    transformer_language_model_states,
    transformer_translator,
    translator_adapter,
)
from tests.test_case import to_numpy

SOURCE = np.array([[5, 6, 7, 8, 0, 0], [9, 10, 11, 12, 13, 14]], "int32")
TARGET = np.array([[2, 4, 5, 6, 0], [2, 7, 8, 9, 10]], "int32")
TOKENS = np.array([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]], "int32")


def small_translator(**kwargs):
    return transformer_translator(
        30,
        30,
        sequence_length=12,
        embedding_dim=16,
        num_encoder_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        intermediate_dim=32,
        dropout=0.0,
        **kwargs,
    )


def small_language_model(**kwargs):
    return transformer_language_model(
        30,
        sequence_length=12,
        embedding_dim=16,
        num_layers=2,
        num_heads=2,
        intermediate_dim=32,
        dropout=0.0,
        **kwargs,
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"shared_vocabulary": True, "normalize_first": True},
        {"tie_embeddings": False},
    ],
    ids=["post_norm_tied", "shared_pre_norm", "untied"],
)
def test_translator_cached_steps_equal_the_teacher_forced_pass(kwargs):
    model = small_translator(**kwargs)
    inputs = {"encoder_inputs": SOURCE, "decoder_inputs": TARGET}
    full = to_numpy(model(inputs))
    assert full.shape == (2, 5, 30) and full.dtype == np.float32
    adapter = translator_adapter(model)
    cache = adapter.encode(SOURCE, 8)
    for index in range(TARGET.shape[1]):
        logits, cache = adapter.next_fn(TARGET[:, index : index + 1], cache, index)
        valid = TARGET[:, index] != 0
        np.testing.assert_allclose(
            to_numpy(logits)[valid, -1], full[valid, index], atol=1e-5
        )
    weights = to_numpy(adapter.alignment(SOURCE, TARGET))
    assert weights.shape == (2, 5, 6)
    np.testing.assert_array_equal(weights[0, :, 4:], 0.0)
    np.testing.assert_allclose(weights[1].sum(-1), 1.0, atol=1e-5)


@pytest.mark.parametrize("builder", ["transformer", "rnn"])
def test_adapter_decodes_and_survives_a_keras_round_trip(builder, tmp_path):
    model = (
        small_translator()
        if builder == "transformer"
        else rnn_translator(30, 30, embedding_dim=8, units=12, dropout=0.0)
    )
    path = tmp_path / "translator.keras"
    model.save(path)
    restored = keras.saving.load_model(path)
    beams, scores = translator_adapter(restored).beam_search_fn(7, beam_width=3)(SOURCE)
    greedy = translator_adapter(restored).greedy_fn(7)(SOURCE)
    assert tuple(beams.shape) == (2, 7) and tuple(scores.shape) == (2,)
    width_one, _ = translator_adapter(model).beam_search_fn(7, beam_width=1)(SOURCE)
    np.testing.assert_array_equal(to_numpy(width_one), to_numpy(greedy))


def test_language_model_cache_equals_full_pass_and_generates():
    model = small_language_model()
    full = to_numpy(model(TOKENS))
    initial_cache, next_fn = transformer_language_model_decoding(model)
    cache = initial_cache(2, 12)
    logits, cache = next_fn(TOKENS[:, :3], cache, 0)  # prefill 3 tokens
    np.testing.assert_allclose(to_numpy(logits), full[:, :3], atol=1e-5)
    for index in range(3, 6):
        logits, cache = next_fn(TOKENS[:, index : index + 1], cache, index)
        np.testing.assert_allclose(to_numpy(logits)[:, -1], full[:, index], atol=1e-5)
    tokens = to_numpy(
        generation.greedy_search(next_fn, TOKENS[:, :3], initial_cache(2, 12), 12)
    )
    assert tokens.shape == (2, 12)
    np.testing.assert_array_equal(tokens[:, :3], TOKENS[:, :3])
    # The first generated token is the argmax of the full pass's last logits.
    np.testing.assert_array_equal(tokens[:, 3], full[:, 2].argmax(-1))


def test_language_model_is_causal_and_ties_embeddings():
    model = small_language_model()
    changed = TOKENS.copy()
    changed[:, 4:] = 20
    np.testing.assert_allclose(
        to_numpy(model(changed))[:, :4], to_numpy(model(TOKENS))[:, :4], atol=1e-6
    )
    untied = small_language_model(tie_embeddings=False)
    assert len(untied.trainable_weights) == len(model.trainable_weights) + 2


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"tie_embeddings": False}, {"normalize_first": False}],
    ids=["pre_norm_tied", "untied", "post_norm"],
)
def test_language_model_states_are_what_the_output_projection_sees(kwargs):
    model = small_language_model(**kwargs)
    states, logits = transformer_language_model_states(model)(TOKENS)
    assert tuple(states.shape) == (2, 6, 16)
    np.testing.assert_allclose(to_numpy(logits), to_numpy(model(TOKENS)), atol=1e-6)
    if kwargs.get("tie_embeddings", True):
        projected = model.get_layer("embedding")(states, reverse=True)
    else:
        projected = model.get_layer("logits")(states)
    np.testing.assert_allclose(to_numpy(projected), to_numpy(logits), atol=1e-5)


def test_bad_arguments():
    with pytest.raises(ValueError, match="shared vocabulary needs equal"):
        transformer_translator(10, 12, shared_vocabulary=True)
    with pytest.raises(ValueError, match="Received: num_layers=0"):
        transformer_language_model(10, num_layers=0)
    with pytest.raises(ValueError, match="rnn_translator or transformer_translator"):
        translator_adapter(small_language_model())
    with pytest.raises(ValueError, match="Expected a model built by transformer_lang"):
        transformer_language_model_states(small_translator())
