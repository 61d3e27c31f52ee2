"""The backbones and tasks on whichever backend runs the tests.

This module runs on TensorFlow (`make test`), JAX and PyTorch (`make
test-backends`). On PyTorch a Keras layer is a
`torch.nn.Module`, which refuses a layer-valued attribute before
`Module.__init__`: the functional backbones and tasks set theirs before
`keras.Model.__init__` (keras_attn.models._setattr), and until they did,
none of them could be constructed there.
"""

import keras
import numpy as np
import pytest

from keras_attn.models import (
    RNNTranslator,
    TextClassifier,
    TextClassifierEnsemble,
    TransformerDecoderBackbone,
    TransformerEncoderBackbone,
    TransformerLanguageModel,
    TransformerTranslator,
)

SIZES = dict(embedding_dim=16, num_heads=2, intermediate_dim=32)


def _ids(rows, width, vocabulary, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocabulary, (rows, width)).astype("int32")
    ids[1, width // 2 :] = 0  # a padded row
    return ids


def _numpy(x):
    return keras.ops.convert_to_numpy(x)


def _saved_and_loaded(model, tmp_path):
    path = tmp_path / "model.keras"
    model.save(path)
    return keras.saving.load_model(path)


@pytest.mark.parametrize(
    "cls", [TransformerEncoderBackbone, TransformerDecoderBackbone]
)
def test_a_backbone_builds_answers_and_reloads(cls, tmp_path):
    backbone = cls(
        vocabulary_size=40, sequence_length=12, num_layers=2, dropout=0.0, **SIZES
    )
    ids = _ids(2, 12, 40)
    hidden = _numpy(backbone(ids))
    assert hidden.shape == (2, 12, 16) and np.all(np.isfinite(hidden))
    assert backbone.num_heads == 2  # the constructor arguments, read back
    assert isinstance(backbone.embedding, keras.layers.Layer)
    np.testing.assert_allclose(
        _numpy(_saved_and_loaded(backbone, tmp_path)(ids)), hidden, atol=1e-6
    )


def test_the_classifier_builds_fits_classifies_and_reloads(tmp_path):
    classifier = TextClassifier(
        vocabulary_size=40, sequence_length=12, num_layers=1, **SIZES
    )
    ids = _ids(4, 12, 40)
    labels = np.array([0, 1, 1, 0], "float32")
    classifier.compile(optimizer="adam", loss="binary_crossentropy")
    history = classifier.fit(ids, labels, epochs=2, batch_size=4, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    probabilities = _numpy(classifier(ids))
    assert probabilities.shape == (4, 1)
    assert np.all((probabilities > 0) & (probabilities < 1))
    np.testing.assert_allclose(
        _numpy(_saved_and_loaded(classifier, tmp_path)(ids)), probabilities, atol=1e-6
    )
    other = TextClassifier(
        vocabulary_size=40, sequence_length=12, num_layers=1, name="other", **SIZES
    )
    ensemble = TextClassifierEnsemble([classifier, other])
    np.testing.assert_allclose(
        _numpy(ensemble(ids)), (probabilities + _numpy(other(ids))) / 2, atol=1e-6
    )


def test_the_language_model_generates_greedily_as_its_forward_pass(tmp_path):
    """Greedy decoding over the KV cache takes the full pass's argmax at
    each step, among the ids other than padding (the cache and the full pass
    agree on this backend)."""
    model = TransformerLanguageModel(
        vocabulary_size=30, sequence_length=10, num_layers=2, **SIZES
    )
    prompt = np.array([[1, 7, 8, 9], [1, 5, 0, 0]], "int32")
    tokens = _numpy(
        model.generate_ids(
            prompt, max_length=10, prompt_lengths=np.array([4, 2]), end_token_id=None
        )
    )
    assert tokens.shape == (2, 10)
    for row, length in enumerate((4, 2)):
        np.testing.assert_array_equal(tokens[row, :length], prompt[row, :length])
        # One causal pass over the row: its logits at `position - 1` are
        # those of the prefix `tokens[row, :position]` (one call, not one
        # per prefix length: on JAX each new length compiles every op).
        logits = _numpy(model(tokens[row : row + 1]))
        for position in range(length, 10):
            assert tokens[row, position] == 1 + np.argmax(logits[0, position - 1, 1:])
    scores = _numpy(model.score_ids(tokens)["log_likelihood"])
    assert scores.shape == (2,) and np.all(np.isfinite(scores)) and np.all(scores < 0)
    reloaded = _saved_and_loaded(model, tmp_path).score_ids(tokens)
    np.testing.assert_allclose(_numpy(reloaded["log_likelihood"]), scores, rtol=1e-5)


@pytest.mark.parametrize("cls", [TransformerTranslator, RNNTranslator])
def test_a_translator_trains_decodes_and_reloads(cls, tmp_path):
    if cls is TransformerTranslator:
        model = cls(
            30, 30, sequence_length=9, num_encoder_layers=1, num_decoder_layers=1,
            shared_vocabulary=True, **SIZES,
        )  # fmt: skip
    else:
        model = cls(30, 30, embedding_dim=8, units=16)
    inputs = {"encoder_inputs": _ids(2, 8, 30), "decoder_inputs": _ids(2, 9, 30, 1)}
    targets = np.concatenate([inputs["decoder_inputs"][:, 1:], np.zeros((2, 1))], 1)
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    history = model.fit(inputs, targets, epochs=2, batch_size=2, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    tokens, scores = model.translate_ids(inputs["encoder_inputs"], 6, beam_width=2)
    tokens, scores = _numpy(tokens), _numpy(scores)
    assert tokens.shape[0] == 2 and tokens.shape[-1] <= 6
    assert np.all(np.isfinite(scores))
    loaded = _saved_and_loaded(model, tmp_path)
    np.testing.assert_allclose(_numpy(loaded(inputs)), _numpy(model(inputs)), atol=1e-6)
    reloaded_tokens, _ = loaded.translate_ids(inputs["encoder_inputs"], 6, beam_width=2)
    np.testing.assert_array_equal(_numpy(reloaded_tokens), tokens)
