"""The model classes as tasks: raw strings in, text or scores out, saved with
their vocabularies in one `.keras` file that a fresh process loads."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from keras_attn.models import (
    RNNTranslator,
    TextClassifier,
    TextClassifierEnsemble,
    TransformerLanguageModel,
    TransformerTranslator,
)
from tests.test_case import REPO_ROOT

pytestmark = pytest.mark.tf_only  # the tokenizers run TensorFlow Text

TEXTS = ["Where is the station?", "I am very tired today.", ""]


@pytest.fixture(scope="module")
def tasks(small_tokenizer, tmp_path_factory):
    """One small model of each task with its tokenizer, saved."""
    vocabulary = small_tokenizer.vocabulary_size
    tokenizers = {
        "source_tokenizer": small_tokenizer,
        "target_tokenizer": small_tokenizer,
    }
    models = {
        "transformer": TransformerTranslator(
            vocabulary, vocabulary, sequence_length=12, embedding_dim=16,
            num_encoder_layers=1, num_decoder_layers=1, num_heads=2,
            intermediate_dim=32, shared_vocabulary=True, **tokenizers,
        ),
        "rnn": RNNTranslator(vocabulary, vocabulary, embedding_dim=8, units=12,
                             attention="luong_general", **tokenizers),
        "classifier": TextClassifier(
            vocabulary, 16, embedding_dim=8, num_layers=1, num_heads=2,
            intermediate_dim=16, pooling="attention", tokenizer=small_tokenizer,
        ),
        "ensemble": TextClassifierEnsemble(
            [
                TextClassifier(vocabulary, 16, embedding_dim=8, num_layers=1,
                               num_heads=2, intermediate_dim=16, name=f"member_{i}")
                for i in range(2)
            ],
            tokenizer=small_tokenizer,
        ),
        "language_model": TransformerLanguageModel(
            vocabulary, 16, embedding_dim=16, num_layers=1, num_heads=2,
            intermediate_dim=32, tokenizer=small_tokenizer,
        ),
    }  # fmt: skip
    directory = tmp_path_factory.mktemp("tasks")
    paths = {}
    for name, model in models.items():
        paths[name] = directory / f"{name}.keras"
        model.save(paths[name])
    return models, paths


def answers(models):
    """What each task answers on TEXTS, as plain JSON."""
    found = {}
    for name in ("transformer", "rnn"):
        found[name] = models[name].translate(TEXTS, beam_width=2, max_length=8)
    for name in ("classifier", "ensemble"):
        result = models[name].classify(TEXTS)
        found[name] = [result["positive_probability"].tolist(), result["label"]]
    model = models["language_model"]
    found["generate"] = model.generate(TEXTS, max_new_tokens=5)
    found["score"] = {k: v.tolist() for k, v in model.score(TEXTS).items()}
    return found


FRESH = textwrap.dedent(
    """
    import json, sys
    import keras
    sys.path.insert(0, sys.argv[1])
    from tests.models.test_tasks import answers
    paths = json.loads(sys.argv[2])
    models = {name: keras.saving.load_model(path) for name, path in paths.items()}
    print(json.dumps(answers(models)))
    """
)


def test_a_fresh_process_loads_each_task_and_answers_the_same(tasks, tmp_path):
    models, paths = tasks
    expected = answers(models)
    assert len(expected["transformer"]) == len(TEXTS)
    assert set(expected["classifier"][1]) <= {"negative", "positive"}
    assert expected["score"]["num_tokens"][2] == 1  # the end token alone
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            FRESH,
            REPO_ROOT,
            json.dumps({name: str(path) for name, path in paths.items()}),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,  # no vocabulary file anywhere near: it is in the .keras
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    for name in ("transformer", "rnn", "generate"):
        assert got[name] == expected[name], name
    for name in ("classifier", "ensemble"):
        np.testing.assert_allclose(got[name][0], expected[name][0], atol=1e-6)
        assert got[name][1] == expected[name][1]
    for name, value in expected["score"].items():
        np.testing.assert_allclose(got["score"][name], value, rtol=1e-5)


def test_translate_is_the_beam_search_of_the_tokenized_text(tasks, small_tokenizer):
    models, _ = tasks
    model = models["transformer"]
    ids = small_tokenizer.tokenize(TEXTS)[:, :8].to_tensor(shape=[None, 8])
    tokens, _ = model.translate_ids(np.asarray(ids), max_length=8, beam_width=2)
    expected = [
        text.decode("utf-8")
        for text in small_tokenizer.detokenize(np.asarray(tokens)).numpy()
    ]
    assert model.translate(TEXTS, beam_width=2, max_length=8) == expected
    # Batches of any size give the same translations.
    assert model.translate(TEXTS, beam_width=2, max_length=8, batch_size=1) == expected
    assert model.translate("Where is the station?", 2, max_length=8) == expected[:1]


def test_classify_and_alignment_and_bad_text(tasks):
    models, _ = tasks
    classifier = models["classifier"]
    result = classifier.classify(TEXTS, threshold=0.0)
    assert result["label"] == ["positive"] * 3
    ids = classifier.tokenizer.tokenize(TEXTS)[:, :16].to_tensor()
    np.testing.assert_allclose(
        result["positive_probability"], np.asarray(classifier(ids))[:, 0], atol=1e-6
    )
    weights, source, target = models["rnn"].alignment(TEXTS[0], "Wo ist es?")
    assert weights.shape == (len(target), len(source)) and target[-1] == "</s>"
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
    with pytest.raises(ValueError, match="Received: texts of type int"):
        classifier.classify(3)


def test_the_models_special_ids_are_the_tokenizers():
    from keras_attn import text
    from keras_attn.models import _task

    assert (_task.PAD_ID, _task.START_ID, _task.END_ID) == (
        text.PAD_ID,
        text.START_ID,
        text.END_ID,
    )
