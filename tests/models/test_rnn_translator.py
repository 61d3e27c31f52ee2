import keras
import numpy as np
import pytest

from keras_attn.models import RNNTranslator
from keras_attn.models.rnn_translator import ATTENTIONS
from tests.test_case import to_numpy

SOURCE = np.array([[5, 6, 7, 8, 0, 0], [9, 10, 11, 12, 13, 14]], "int32")
TARGET = np.array([[1, 4, 5, 6, 0], [1, 7, 8, 9, 10]], "int32")


def build(attention):
    return RNNTranslator(
        30, 20, embedding_dim=8, units=12, attention=attention, dropout=0.0
    )


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_step_by_step_decoding_equals_the_teacher_forced_pass(attention):
    model = build(attention)
    inputs = {"encoder_inputs": SOURCE, "decoder_inputs": TARGET}
    full = to_numpy(model(inputs))
    assert full.shape == (2, 5, 20) and full.dtype == np.float32
    cache = model.encode(SOURCE)
    for index in range(TARGET.shape[1]):
        logits, cache = model.call_with_cache(
            TARGET[:, index : index + 1], cache, index
        )
        # Padded target positions (loss-masked in training) may differ.
        valid = TARGET[:, index] != 0
        np.testing.assert_allclose(
            to_numpy(logits)[valid], full[valid, index], atol=1e-5
        )
    weights = to_numpy(model.attention_maps(SOURCE, TARGET)["alignment"])
    assert weights.shape == (2, 5, 6)
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(weights[0, :, 4:], 0.0)  # padded source


def test_bahdanau_decoder_projects_the_encoder_states_once_per_source():
    model = build("bahdanau")
    attention = model.decoder.attention
    inputs = {"encoder_inputs": SOURCE, "decoder_inputs": TARGET}
    full = to_numpy(model(inputs))
    next_fn = model.call_with_cache
    cache = model.encode(SOURCE)
    assert tuple(cache["projected_memory"].shape) == (2, 6, 12)

    def score_from_unprojected_keys(query, key):
        raise AssertionError("projected W_k h_j inside the decoder loop")

    # Neither the teacher-forced loop nor a decoding step projects the keys:
    # both score against the projection made once per source.
    attention.score = score_from_unprojected_keys
    np.testing.assert_allclose(to_numpy(model(inputs)), full, atol=1e-6)
    logits, _ = next_fn(TARGET[:, :1], cache, 0)
    np.testing.assert_allclose(to_numpy(logits), full[:, 0], atol=1e-5)
    # The step reads the cached projection.
    zeroed = dict(cache, projected_memory=cache["projected_memory"] * 0.0)
    assert not np.allclose(to_numpy(next_fn(TARGET[:, :1], zeroed, 0)[0]), full[:, 0])


@pytest.mark.parametrize("attention", ["bahdanau", "luong_general"])
def test_padding_of_the_source_does_not_change_the_logits(attention):
    model = build(attention)
    padded = model({"encoder_inputs": SOURCE[:1], "decoder_inputs": TARGET[:1]})
    trimmed = model({"encoder_inputs": SOURCE[:1, :4], "decoder_inputs": TARGET[:1]})
    np.testing.assert_allclose(to_numpy(padded), to_numpy(trimmed), atol=1e-5)


def test_trains_and_saves(tmp_path):
    model = build("bahdanau")
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x = {
        "encoder_inputs": np.tile(SOURCE, (4, 1)),
        "decoder_inputs": np.tile(TARGET, (4, 1)),
    }
    y = np.tile(np.concatenate([TARGET[:, 1:], np.zeros((2, 1), "int32")], 1), (4, 1))
    history = model.fit(x, y, epochs=3, batch_size=4, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded, RNNTranslator)
    assert isinstance(loaded.decoder.cell, keras.layers.GRUCell)
    np.testing.assert_allclose(to_numpy(loaded(x)), to_numpy(model(x)), atol=1e-6)


def test_bad_arguments():
    with pytest.raises(ValueError, match="Received: attention='luong'"):
        RNNTranslator(10, 10, attention="luong")
    with pytest.raises(ValueError, match="Received: units=7"):
        RNNTranslator(10, 10, units=7)
    with pytest.raises(ValueError, match="needs a Transformer translator"):
        build("bahdanau").call_with_cache(TARGET[:, :1], {}, 0, nearest_neighbors=1)
