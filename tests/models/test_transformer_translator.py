import keras
import numpy as np
import pytest

from keras_attn.models import RNNTranslator, TransformerTranslator
from tests.test_case import to_numpy

SOURCE = np.array([[5, 6, 7, 8, 0, 0], [9, 10, 11, 12, 13, 14]], "int32")
TARGET = np.array([[2, 4, 5, 6, 0], [2, 7, 8, 9, 10]], "int32")


def small_translator(**kwargs):
    return TransformerTranslator(
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


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"shared_vocabulary": True, "normalize_first": True},
        {"tie_embeddings": False},
    ],
    ids=["post_norm_tied", "shared_pre_norm", "untied"],
)
def test_cached_steps_equal_the_teacher_forced_pass(kwargs):
    model = small_translator(**kwargs)
    inputs = {"encoder_inputs": SOURCE, "decoder_inputs": TARGET}
    full = to_numpy(model(inputs))
    assert full.shape == (2, 5, 30) and full.dtype == np.float32
    cache = model.encode(SOURCE, 8)
    for index in range(TARGET.shape[1]):
        logits, cache = model.call_with_cache(
            TARGET[:, index : index + 1], cache, index
        )
        valid = TARGET[:, index] != 0
        np.testing.assert_allclose(
            to_numpy(logits)[valid, -1], full[valid, index], atol=1e-5
        )
    maps = model.attention_maps(SOURCE, TARGET)
    weights = to_numpy(maps["alignment"])
    assert weights.shape == (2, 5, 6) and len(maps["cross_attention"]) == 2
    np.testing.assert_array_equal(weights[0, :, 4:], 0.0)
    np.testing.assert_allclose(weights[1].sum(-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(
        weights, to_numpy(maps["cross_attention"][-1]).mean(1), atol=1e-6
    )


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"normalize_first": True, "tie_embeddings": False}],
    ids=["post_norm_tied", "pre_norm_untied"],
)
def test_states_are_what_the_output_projection_sees(kwargs):
    model = small_translator(**kwargs)
    inputs = {"encoder_inputs": SOURCE, "decoder_inputs": TARGET}
    states, logits = model.call_with_states(inputs)
    assert tuple(states.shape) == (2, 5, 16)
    np.testing.assert_allclose(to_numpy(logits), to_numpy(model(inputs)), atol=1e-6)
    if model.tie_embeddings:
        projected = model.target_embedding(states, reverse=True)
    else:
        projected = model.logits_layer(states)
    np.testing.assert_allclose(to_numpy(projected), to_numpy(logits), atol=1e-5)


@pytest.mark.parametrize("network", ["transformer", "rnn"])
def test_decodes_and_survives_a_keras_round_trip(network, tmp_path):
    model = (
        small_translator()
        if network == "transformer"
        else RNNTranslator(30, 30, embedding_dim=8, units=12, dropout=0.0)
    )
    path = tmp_path / "translator.keras"
    model.save(path)
    restored = keras.saving.load_model(path)
    assert type(restored) is type(model)
    assert restored.get_config() == model.get_config()
    beams, scores = restored.translate_ids(SOURCE, 7, beam_width=3)
    assert tuple(beams.shape) == (2, 7) and tuple(scores.shape) == (2,)
    # The same weights: the same translations, and beam width 1 is greedy.
    np.testing.assert_array_equal(
        to_numpy(beams), to_numpy(model.translate_ids(SOURCE, 7, beam_width=3)[0])
    )
    width_one, _ = model.translate_ids(SOURCE, 7, beam_width=1)
    cache = model.encode(SOURCE, 8)
    token = np.full((2, 1), 2, "int32")
    for index in range(7):  # greedy by hand over the cache
        logits, cache = model.call_with_cache(token, cache, index)
        logits = to_numpy(logits).reshape(2, -1)
        logits[:, 0] = -np.inf  # the decodings never pick padding (id 0)
        token = logits.argmax(-1)[:, None].astype("int32")
        done = to_numpy(width_one)[:, :index]
        finished = (done == 3).any(-1)
        expected = np.where(finished, 0, token[:, 0])
        np.testing.assert_array_equal(to_numpy(width_one)[:, index], expected)


def test_a_frozen_source_embedding_does_not_train():
    model = small_translator(freeze_source_embedding=True)
    trainable = {id(weight) for weight in model.trainable_weights}
    assert not any(id(w) in trainable for w in model.source_embedding.weights)
    assert len(small_translator().trainable_weights) == len(trainable) + 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="shared vocabulary needs equal"):
        TransformerTranslator(10, 12, shared_vocabulary=True)
    with pytest.raises(ValueError, match="Received: encoder_layout='gpt'"):
        TransformerTranslator(10, 12, encoder_layout="gpt")
    with pytest.raises(ValueError, match="Received: num_decoder_layers=0"):
        TransformerTranslator(10, 12, num_decoder_layers=0)
    with pytest.raises(ValueError, match=r"Received: source_tokenizer='vocab\.txt'"):
        TransformerTranslator(10, 12, source_tokenizer="vocab.txt")
    with pytest.raises(ValueError, match="needs the model's `source_tokenizer`"):
        small_translator().translate(["Hello."])
