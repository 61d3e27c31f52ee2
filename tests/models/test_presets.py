"""Presets in keras-hub's layout: `save_to_preset` writes the files
keras-hub's tasks write, `from_preset` gives back the same task (in this
process and in a fresh one importing only keras and keras_attn), backbones
load alone, and text methods work on the loaded task."""

import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
from keras import tree

from keras_attn.models import (
    TextClassifier,
    TransformerDecoderBackbone,
    TransformerEncoderBackbone,
    TransformerLanguageModel,
    TransformerTranslator,
)
from keras_attn.models.presets import load_preprocessor
from tests.test_case import to_numpy

pytestmark = pytest.mark.tf_only  # the tokenizers run TensorFlow Text

SIZES = {"embedding_dim": 16, "num_heads": 2, "intermediate_dim": 32}
TEXTS = ["Where is the station?", "I am very tired today.", ""]


@pytest.fixture(scope="module")
def tasks(small_tokenizer):
    vocabulary = small_tokenizer.vocabulary_size
    return {
        "classifier": TextClassifier(
            vocabulary, 24, num_layers=1, pooling="attention",
            tokenizer=small_tokenizer, **SIZES,
        ),
        "language_model": TransformerLanguageModel(
            vocabulary, 32, num_layers=1, tokenizer=small_tokenizer, **SIZES
        ),
        "translator": TransformerTranslator(
            vocabulary, vocabulary, sequence_length=17, num_encoder_layers=1,
            num_decoder_layers=1, shared_vocabulary=True, tie_embeddings=False,
            source_tokenizer=small_tokenizer, target_tokenizer=small_tokenizer,
            **SIZES,
        ),
    }  # fmt: skip


def answer(name, task):
    if name == "classifier":
        return task.classify(TEXTS)["positive_probability"]
    if name == "language_model":
        return np.concatenate([np.ravel(v) for v in task.score(TEXTS[:2]).values()])
    return task.translate(TEXTS[:2], 2, max_length=6)


@pytest.mark.parametrize("name", ["classifier", "language_model", "translator"])
def test_a_task_saves_to_a_preset_and_loads_back(tasks, name, tmp_path):
    task = tasks[name]
    task.save_to_preset(tmp_path / "preset")
    files = {
        str(path.relative_to(tmp_path / "preset"))
        for path in (tmp_path / "preset").rglob("*")
        if path.is_file()
    }
    expected = {
        "config.json", "model.weights.h5", "task.json", "tokenizer.json",
        "assets/tokenizer/vocabulary.spm", "metadata.json", "preprocessor.json",
    }  # fmt: skip
    if name != "language_model":  # tied logits: no weights outside the backbone
        expected.add("task.weights.h5")
    if name == "translator":
        expected |= {"target_tokenizer.json", "assets/target_tokenizer/vocabulary.spm"}
    assert files == expected
    metadata = json.loads((tmp_path / "preset" / "metadata.json").read_text())
    assert metadata["parameter_count"] == task.backbone.count_params()  # keras-hub's
    task_config = json.loads((tmp_path / "preset" / "task.json").read_text())
    assert "build_config" not in json.dumps(task_config)
    loaded = type(task).from_preset(tmp_path / "preset")
    assert_same_task(task, loaded)
    got, want = answer(name, loaded), answer(name, task)
    if name == "translator":
        assert got == want
    else:
        np.testing.assert_allclose(got, want, atol=1e-5)
    # The preprocessor loads alone and answers as the task's.
    preprocessor = load_preprocessor(tmp_path / "preset")
    x = {"source": TEXTS, "target": TEXTS} if name == "translator" else TEXTS
    for got, want in zip(
        tree.flatten(preprocessor(x)), tree.flatten(task.preprocessor(x)), strict=True
    ):
        np.testing.assert_array_equal(to_numpy(got), to_numpy(want))
    # Without weights: the same structure, fresh values.
    fresh = type(task).from_preset(tmp_path / "preset", load_weights=False)
    assert [w.shape for w in fresh.weights] == [w.shape for w in task.weights]


def assert_same_task(task, loaded):
    assert type(loaded) is type(task)
    assert len(loaded.weights) == len(task.weights)
    for a, b in zip(task.weights, loaded.weights, strict=True):
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b))


def test_a_compiled_tasks_preset_holds_no_optimizer_state(tasks, tmp_path):
    import h5py

    task = TextClassifier.from_config(tasks["classifier"].get_config())
    task.compile("adam", "binary_crossentropy")
    task.fit(np.array([[5, 6, 7, 0]], "int32"), np.ones((1, 1)), verbose=0)
    task.save_to_preset(tmp_path)
    with h5py.File(tmp_path / "task.weights.h5") as weights:
        names = []
        weights.visit(names.append)
    assert names and not any("optimizer" in name for name in names)
    loaded = TextClassifier.from_preset(tmp_path)
    assert_same_task(task, loaded)


def test_a_backbone_loads_alone_from_a_task_preset(tasks, tmp_path):
    task = tasks["translator"]
    task.save_to_preset(tmp_path)
    encoder = TransformerEncoderBackbone.from_preset(tmp_path)
    for a, b in zip(task.backbone.weights, encoder.weights, strict=True):
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b))
    with pytest.raises(ValueError, match="not a TransformerDecoderBackbone"):
        TransformerDecoderBackbone.from_preset(tmp_path)
    # A backbone's own preset, and config overrides.
    encoder.save_to_preset(tmp_path / "encoder")
    again = TransformerEncoderBackbone.from_preset(tmp_path / "encoder", dropout=0.0)
    assert again.dropout == 0.0
    ids = np.array([[5, 6, 7, 0]], "int32")
    np.testing.assert_allclose(to_numpy(again(ids)), to_numpy(encoder(ids)), atol=1e-6)


def test_from_preset_refuses_other_classes_and_missing_directories(tasks, tmp_path):
    tasks["classifier"].save_to_preset(tmp_path)
    with pytest.raises(ValueError, match="holds a 'TextClassifier', not a Transf"):
        TransformerLanguageModel.from_preset(tmp_path)
    with pytest.raises(ValueError, match=r"Received: preset='.*nowhere'"):
        TextClassifier.from_preset(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"has no task\.json"):
        TextClassifier.from_preset(tmp_path / "empty")
    # Overrides reach the config.
    loaded = TextClassifier.from_preset(tmp_path, name="renamed")
    assert loaded.name == "renamed"


def test_a_preset_loads_in_a_fresh_process_with_only_keras_and_keras_attn(
    tasks, tmp_path
):
    tasks["classifier"].save_to_preset(tmp_path)
    want = tasks["classifier"].classify(TEXTS)["positive_probability"]
    code = (
        "import sys, json, keras, keras_attn\n"
        "task = keras_attn.models.TextClassifier.from_preset(sys.argv[1])\n"
        "print(json.dumps([float(p) for p in task.predict(sys.argv[2:])[:, 0]]))\n"
    )
    found = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path), *TEXTS],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""},
        cwd=Path(__file__).parents[2], check=False,
    )  # fmt: skip
    assert found.returncode == 0, found.stderr[-3000:]
    got = json.loads(found.stdout.strip().splitlines()[-1])
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_predict_takes_raw_strings_as_keras_hubs_classifiers(tasks):
    classifier = tasks["classifier"]
    found = classifier.predict(TEXTS, batch_size=2, verbose=0)
    assert found.shape == (3, 1) and found.dtype == np.float32
    np.testing.assert_allclose(
        found[:, 0], classifier.classify(TEXTS)["positive_probability"], atol=1e-6
    )
    np.testing.assert_allclose(
        classifier.predict(np.array(TEXTS), verbose=0), found, atol=1e-6
    )
    # Token ids still go to keras.Model.predict.
    ids = np.array([[5, 6, 7, 0]], "int32")
    np.testing.assert_allclose(
        classifier.predict(ids, verbose=0), to_numpy(classifier(ids)), atol=1e-6
    )
    with pytest.raises(ValueError, match="`steps` and `callbacks`"):
        classifier.predict(TEXTS, steps=1)
    for name, method in (("language_model", "score"), ("translator", "translate")):
        with pytest.raises(ValueError, match=rf"use `{method}\(.*Received: x of 3"):
            tasks[name].predict(TEXTS)
    assert keras.Model.predict is not type(classifier).predict
