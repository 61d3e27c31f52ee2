"""A language model's own assistant (`assistant_model`): the decoding
methods and the export use it unless told otherwise, it is not among the
model's weights (training and `count_params` leave it out), and a draft is
saved with the model: `model.keras` (loaded in a fresh process that imports
only keras and keras_attn), presets, and the copies `with_precision` makes.
The text methods and files need TensorFlow Text (`tf_only`)."""

import json

import keras
import numpy as np
import pytest

from keras_attn.models import TransformerLanguageModel
from keras_attn.models.precision import with_precision
from tests.test_case import fresh_json

pytestmark = pytest.mark.tf_only

PROMPTS = ["where is the station", "", "i am very tired today"]


def language_model(tokenizer, num_layers, width, seed, **kwargs):
    """Weights drawn normal (standard deviation 0.5): the greedy tokens
    vary."""
    model = TransformerLanguageModel(
        tokenizer.vocabulary_size, sequence_length=24, embedding_dim=width,
        num_layers=num_layers, num_heads=2, intermediate_dim=2 * width,
        tokenizer=tokenizer, **kwargs,
    )  # fmt: skip
    rng = np.random.default_rng(seed)
    model.set_weights(
        [rng.normal(0, 0.5, w.shape).astype(w.dtype) for w in model.get_weights()]
    )
    return model


@pytest.fixture(scope="module")
def models(small_tokenizer):
    draft = language_model(small_tokenizer, 1, 8, seed=2)
    model = language_model(small_tokenizer, 2, 16, seed=1, assistant_model=draft)
    plain = language_model(small_tokenizer, 2, 16, seed=1)
    return model, draft, plain


def test_the_decodings_use_the_models_own_assistant(models, monkeypatch):
    model, draft, plain = models
    assert model.assistant_model is draft and plain.assistant_model is None
    assert model.count_params() == plain.count_params()
    assert {id(w) for w in draft.weights}.isdisjoint(id(w) for w in model.weights)
    want = plain.generate(PROMPTS, max_new_tokens=8)
    assert len(set(want)) > 1
    calls = []
    original = draft.call_with_cache
    monkeypatch.setattr(
        draft, "call_with_cache", lambda *a: calls.append(1) or original(*a)
    )
    assert model.generate(PROMPTS, max_new_tokens=8) == want  # traced anew
    assert calls  # the draft proposed the tokens
    del calls[:]
    # False: none.
    assert model.generate(PROMPTS, max_new_tokens=8, assistant_model=False) == want
    assert not calls
    # Token ids: greedy search's tokens; beam search takes no assistant.
    from keras_attn.generation import BeamSampler

    ids = np.array([[2, 40, 41, 0], [2, 50, 0, 0]], "int32")
    lengths = np.array([3, 2], "int32")
    for sampler in ("greedy", BeamSampler(beam_width=2)):
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(
                model.generate_ids(ids, 10, sampler=sampler, prompt_lengths=lengths)
            ),
            keras.ops.convert_to_numpy(
                plain.generate_ids(ids, 10, sampler=sampler, prompt_lengths=lengths)
            ),
        )
    # The export's spec: the model's own draft unless told otherwise.
    spec = model.serving_spec(max_new_tokens=6)
    assert spec.metadata["assistant"]["kind"] == "draft_model"
    assert any(resource is draft for resource in spec.resources)
    spec = model.serving_spec(max_new_tokens=6, assistant_model=False)
    assert spec.metadata["assistant"] is None


def test_training_leaves_the_draft_as_it_is(small_tokenizer):
    draft = language_model(small_tokenizer, 1, 8, seed=2)
    model = language_model(small_tokenizer, 1, 16, seed=1, assistant_model=draft)
    before = [w.numpy().copy() for w in draft.weights]
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    ids = np.random.default_rng(0).integers(4, 100, (8, 12)).astype("int32")
    model.fit(ids[:, :-1], ids[:, 1:], epochs=1, verbose=0)
    for old, new in zip(before, draft.weights, strict=True):
        np.testing.assert_array_equal(old, new.numpy())


def test_the_assistant_is_checked(models, small_tokenizer):
    model, _, _ = models
    other = TransformerLanguageModel(
        small_tokenizer.vocabulary_size + 1, sequence_length=8, embedding_dim=8,
        num_layers=1, num_heads=2, intermediate_dim=8,
    )  # fmt: skip
    with pytest.raises(ValueError, match="must share the model's vocabulary"):
        TransformerLanguageModel(
            small_tokenizer.vocabulary_size, sequence_length=8, embedding_dim=8,
            num_layers=1, num_heads=2, intermediate_dim=8, assistant_model=other,
        )  # fmt: skip
    with pytest.raises(ValueError, match="Received: assistant_model='lookup'"):
        model.generate(PROMPTS, max_new_tokens=2, assistant_model="lookup")
    lookup = language_model(
        small_tokenizer, 1, 8, seed=3, assistant_model="prompt_lookup"
    )
    assert lookup.get_config()["assistant_model"] == "prompt_lookup"
    assert lookup.generate(PROMPTS, max_new_tokens=6) == lookup.generate(
        PROMPTS, max_new_tokens=6, assistant_model=False
    )


FRESH = """
    import json, sys
    import keras
    import keras_attn  # noqa: F401  (registers the classes)

    model = keras.saving.load_model(sys.argv[1])
    preset = keras_attn.models.TransformerLanguageModel.from_preset(sys.argv[2])
    prompts = json.loads(sys.argv[3])
    print(json.dumps({
        "assistant": type(model.assistant_model).__name__,
        "draft_weights": [w.numpy().ravel()[:4].tolist()
                          for w in model.assistant_model.weights],
        "preset_draft_weights": [w.numpy().ravel()[:4].tolist()
                                 for w in preset.assistant_model.weights],
        "generate": model.generate(prompts, max_new_tokens=8),
        "preset": preset.generate(prompts, max_new_tokens=8),
    }))
"""


def test_model_keras_and_presets_load_with_the_draft_in_a_fresh_process(
    models, tmp_path
):
    model, draft, plain = models
    model.save(tmp_path / "model.keras")
    model.save_to_preset(tmp_path / "preset")
    got = fresh_json(
        FRESH, tmp_path / "model.keras", tmp_path / "preset", json.dumps(PROMPTS)
    )
    assert got["assistant"] == "TransformerLanguageModel"
    want = [w.numpy().ravel()[:4].tolist() for w in draft.weights]
    np.testing.assert_allclose(
        np.concatenate(got["draft_weights"]), np.concatenate(want), rtol=1e-6
    )
    np.testing.assert_allclose(
        np.concatenate(got["preset_draft_weights"]), np.concatenate(want), rtol=1e-6
    )
    want_text = plain.generate(PROMPTS, max_new_tokens=8)
    assert got["generate"] == got["preset"] == want_text


def test_a_copy_in_another_precision_converts_the_draft(models):
    model, draft, _ = models
    copy = with_precision(model, "bfloat16")
    assert copy.assistant_model is not draft
    assert {w.dtype for w in copy.assistant_model.weights} == {"bfloat16"}
    for ours, theirs in zip(copy.assistant_model.weights, draft.weights, strict=True):
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(ours),
            keras.ops.convert_to_numpy(keras.ops.cast(theirs, "bfloat16")),
        )
