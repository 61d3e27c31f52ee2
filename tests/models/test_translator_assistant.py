"""A translator's own assistant (`TransformerTranslator.assistant_model`):
greedy decodings and the export use it unless told otherwise, beam search
and kNN-MT take none, it is not among the translator's weights, and a draft
is saved with the translator: `model.keras` (loaded in a fresh process that
imports only keras and keras_attn), presets, and the copies
`with_precision` makes. The text methods and files need TensorFlow Text
(`tf_only`)."""

import json

import keras
import numpy as np
import pytest

from keras_attn.models import RNNTranslator, TransformerTranslator
from keras_attn.models.precision import with_precision
from tests.models.test_speculative_translation import SOURCES, translator
from tests.test_case import fresh_json

pytestmark = pytest.mark.tf_only

TEXTS = ["where is the station", "", "i am very tired today", "the dog runs"]
GREEDY = {"beam_width": 1, "length_penalty": 0.0}


def with_draft(tokenizer, seed, draft, **kwargs):
    """`translator(2, 32, seed)` with `draft` as its own assistant (the same
    weights as `translator(2, 32, seed)` without one)."""
    model = translator(2, 32, seed=seed, tokenizer=tokenizer, end_bias=2.0)
    model.assistant_model = draft
    return model


@pytest.fixture(scope="module")
def models(small_tokenizer):
    draft = translator(1, 16, seed=4, tokenizer=small_tokenizer)
    model = with_draft(small_tokenizer, 3, draft)
    plain = translator(2, 32, seed=3, tokenizer=small_tokenizer, end_bias=2.0)
    return model, draft, plain


def numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x))


def test_greedy_decodings_use_the_translators_own_assistant(models, monkeypatch):
    model, draft, plain = models
    assert model.assistant_model is draft and plain.assistant_model is None
    assert model.count_params() == plain.count_params()
    assert {id(w) for w in draft.weights}.isdisjoint(id(w) for w in model.weights)
    want = plain.translate(TEXTS, **GREEDY)
    assert len(set(want)) > 1
    calls = []
    original = draft.call_with_cache
    monkeypatch.setattr(
        draft, "call_with_cache", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    assert model.translate(TEXTS, **GREEDY) == want
    assert calls  # the draft proposed the tokens
    del calls[:]
    assert model.translate(TEXTS, assistant_model=False, **GREEDY) == want
    # Beam search (translate's default) takes no assistant.
    assert model.translate(TEXTS) == plain.translate(TEXTS)
    assert not calls
    # Token ids: greedy search's tokens and scores.
    for fn in ("translate_ids",):
        got = getattr(model, fn)(SOURCES, max_length=10, **GREEDY)
        expected = getattr(plain, fn)(SOURCES, max_length=10, **GREEDY)
        np.testing.assert_array_equal(numpy(got[0]), numpy(expected[0]))
        np.testing.assert_allclose(numpy(got[1]), numpy(expected[1]), atol=1e-4)
    assert calls
    # The export's spec: the translator's own draft for greedy search only.
    spec = model.serving_spec(max_length=8, **GREEDY)
    assert spec.metadata["assistant"]["num_decoder_layers"] == 1
    assert any(resource is draft for resource in spec.resources)
    for options in ({"assistant_model": False, **GREEDY}, {"beam_width": 4}):
        spec = model.serving_spec(max_length=8, **options)
        assert spec.metadata["assistant"] is None
        assert not any(resource is draft for resource in spec.resources)


def test_the_assistant_is_checked(models, small_tokenizer):
    model, draft, _ = models
    other = translator(1, 16, seed=5)  # another vocabulary
    with pytest.raises(ValueError, match="must share the translator's vocabularies"):
        model.assistant_model = other
    with pytest.raises(ValueError, match="must share the translator's vocabularies"):
        TransformerTranslator(
            small_tokenizer.vocabulary_size, small_tokenizer.vocabulary_size,
            sequence_length=8, embedding_dim=8, num_encoder_layers=1,
            num_decoder_layers=1, num_heads=2, intermediate_dim=8,
            assistant_model=other,
        )  # fmt: skip
    assert model.assistant_model is draft
    with pytest.raises(ValueError, match="must be a TransformerTranslator"):
        model.assistant_model = "prompt_lookup"
    rnn = RNNTranslator(
        small_tokenizer.vocabulary_size, small_tokenizer.vocabulary_size,
        embedding_dim=8, units=8,
    )  # fmt: skip
    assert rnn.assistant_model is None
    with pytest.raises(ValueError, match="needs a TransformerTranslator"):
        rnn.assistant_model = draft


FRESH = """
    import json, sys
    import keras
    import keras_attn  # noqa: F401  (registers the classes)

    model = keras.saving.load_model(sys.argv[1])
    preset = keras_attn.models.TransformerTranslator.from_preset(sys.argv[2])
    texts = json.loads(sys.argv[3])
    greedy = {"beam_width": 1, "length_penalty": 0.0}
    print(json.dumps({
        "assistant": type(model.assistant_model).__name__,
        "draft_weights": [w.numpy().ravel()[:4].tolist()
                          for w in model.assistant_model.weights],
        "preset_draft_weights": [w.numpy().ravel()[:4].tolist()
                                 for w in preset.assistant_model.weights],
        "translate": model.translate(texts, **greedy),
        "preset": preset.translate(texts, **greedy),
    }))
"""


# Slow (a fresh process loading two artifacts): the language model's draft
# loads the same way by default (test_language_model_assistant.py).
@pytest.mark.slow
def test_model_keras_and_presets_load_with_the_draft_in_a_fresh_process(
    models, tmp_path
):
    model, draft, plain = models
    model.save(tmp_path / "model.keras")
    model.save_to_preset(tmp_path / "preset")
    got = fresh_json(
        FRESH, tmp_path / "model.keras", tmp_path / "preset", json.dumps(TEXTS)
    )
    assert got["assistant"] == "TransformerTranslator"
    want = [w.numpy().ravel()[:4].tolist() for w in draft.weights]
    for key in ("draft_weights", "preset_draft_weights"):
        np.testing.assert_allclose(
            np.concatenate(got[key]), np.concatenate(want), rtol=1e-6
        )
    assert got["translate"] == got["preset"] == plain.translate(TEXTS, **GREEDY)


def test_a_copy_in_another_precision_converts_the_draft(models):
    model, draft, _ = models
    copy = with_precision(model, "bfloat16")
    assert copy.assistant_model is not draft
    # As the draft's own copy: bfloat16 weights, the untied logits float32.
    alone = with_precision(draft, "bfloat16")
    dtypes = [w.dtype for w in copy.assistant_model.weights]
    assert dtypes == [w.dtype for w in alone.weights]
    assert "bfloat16" in dtypes
    for ours, theirs in zip(copy.assistant_model.weights, draft.weights, strict=True):
        np.testing.assert_array_equal(
            numpy(ours), numpy(keras.ops.cast(theirs, ours.dtype))
        )
