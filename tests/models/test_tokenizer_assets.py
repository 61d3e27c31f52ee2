"""Tokenizers save their vocabularies as Keras assets: a task's `.keras` file
and preset carry `vocabulary.spm`/`vocabulary.txt` files, and no config
holds a vocabulary; both load (in this process and in a fresh one importing
only keras and keras_attn) and answer as the saved task; files saved before,
with the vocabulary inline in the config, still load."""

import base64
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import keras
import numpy as np
import pytest

from keras_attn.models import (
    TextClassifier,
    TextClassifierEnsemble,
    TransformerLanguageModel,
    TransformerTranslator,
)
from keras_attn.models.presets import load_preprocessor

pytestmark = pytest.mark.tf_only  # the tokenizers run TensorFlow Text

FIXTURES = Path(__file__).parents[1] / "fixtures"
SIZES = {"embedding_dim": 16, "num_heads": 2, "intermediate_dim": 32}
TEXTS = ["Where is the station?", "I am very tired today."]
# A BERT-style vocabulary for the WordPiece tokenizer.
WORD_PIECES = [
    "[PAD]", "[UNK]", "[CLS]", "[SEP]", "where", "is", "the", "station", "?",
    "i", "am", "very", "tired", "today", ".", "##s",
]  # fmt: skip


@pytest.fixture(scope="module")
def other_tokenizer(english_sentences, tmp_path_factory):
    """A second SentencePiece vocabulary (cased), for a translator whose two
    tokenizers differ."""
    from keras_attn.text import SubwordTokenizer, train_subword_vocabulary

    path = train_subword_vocabulary(
        english_sentences,
        tmp_path_factory.mktemp("vocab") / "cased.model",
        vocabulary_size=400,
    )
    return SubwordTokenizer(path)


@pytest.fixture(scope="module")
def tasks(small_tokenizer, other_tokenizer):
    from keras_attn.text import WordPieceTokenizer

    keras.utils.set_random_seed(0)
    vocabulary = small_tokenizer.vocabulary_size
    members = [
        TextClassifier(
            vocabulary,
            16,
            num_layers=1,
            tokenizer=small_tokenizer,
            name=f"member_{index}",
            **SIZES,
        )
        for index in range(2)
    ]
    return {
        "classifier": TextClassifier(
            vocabulary, 16, num_layers=1, tokenizer=small_tokenizer, **SIZES
        ),
        "wordpiece_classifier": TextClassifier(
            len(WORD_PIECES), 16, num_layers=1,
            tokenizer=WordPieceTokenizer(WORD_PIECES, max_length=16), **SIZES,
        ),
        "ensemble": TextClassifierEnsemble(members, tokenizer=small_tokenizer),
        "language_model": TransformerLanguageModel(
            vocabulary, 32, num_layers=1, tokenizer=small_tokenizer, **SIZES
        ),
        "translator": TransformerTranslator(
            other_tokenizer.vocabulary_size, vocabulary, sequence_length=17,
            num_encoder_layers=1, num_decoder_layers=1,
            source_tokenizer=other_tokenizer, target_tokenizer=small_tokenizer,
            **SIZES,
        ),
    }  # fmt: skip


def answer(task):
    """What a task answers on `TEXTS`, as JSON-able lists."""
    if isinstance(task, TransformerTranslator):
        return task.translate(TEXTS, 2, max_length=6)
    if isinstance(task, TransformerLanguageModel):
        return [float(p) for p in task.score(TEXTS)["log_likelihood"]]
    return [float(p) for p in task.classify(TEXTS)["positive_probability"]]


ANSWER = """
def answer(task):
    if isinstance(task, keras_attn.models.TransformerTranslator):
        return task.translate(texts, 2, max_length=6)
    if isinstance(task, keras_attn.models.TransformerLanguageModel):
        return [float(p) for p in task.score(texts)["log_likelihood"]]
    return [float(p) for p in task.classify(texts)["positive_probability"]]
"""


def assert_same_answer(got, want):
    if want and isinstance(want[0], str):
        assert got == want
    else:
        np.testing.assert_allclose(got, want, atol=1e-5)


def inline_vocabularies(config) -> list:
    """The `proto` and `vocabulary` entries of a config that hold a value."""
    found = []
    if isinstance(config, dict):
        for key, value in config.items():
            if key in ("proto", "vocabulary") and value is not None:
                found.append(key)
            found += inline_vocabularies(value)
    elif isinstance(config, list):
        for value in config:
            found += inline_vocabularies(value)
    return found


def answers_in_a_fresh_process(kind: str, paths: list) -> list:
    """`answer` of each saved task, loaded in a process that imports only
    keras and keras_attn (`kind`: "keras" files or "preset" directories)."""
    load = (
        "keras.saving.load_model(path)"
        if kind == "keras"
        else "getattr(keras_attn.models, name).from_preset(path)"
    )
    code = (
        "import sys, json, keras, keras_attn\n"
        f"{ANSWER}\n"
        "texts = json.loads(sys.argv[1])\n"
        "found = []\n"
        "for item in sys.argv[2:]:\n"
        "    name, path = item.split('=', 1)\n"
        f"    found.append(answer({load}))\n"
        "print(json.dumps(found))\n"
    )
    found = subprocess.run(
        [sys.executable, "-c", code, json.dumps(TEXTS), *paths],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""},
        cwd=Path(__file__).parents[2], check=False,
    )  # fmt: skip
    assert found.returncode == 0, found.stderr[-3000:]
    return json.loads(found.stdout.strip().splitlines()[-1])


# Slow: each task loads in a fresh process in test_tasks.py; the assets:
# test_presets_write_and_read_tokenizer_assets
@pytest.mark.slow
def test_keras_files_hold_vocabularies_as_assets_and_load_anywhere(tasks, tmp_path):
    paths, wants = [], []
    for name, task in tasks.items():
        path = tmp_path / f"{name}.keras"
        task.save(path)
        with zipfile.ZipFile(path) as archive:
            config = json.loads(archive.read("config.json"))
            assets = [n for n in archive.namelist() if n.startswith("assets/")]
        assert inline_vocabularies(config) == [], name
        assert len(json.dumps(config)) < 20_000, name
        # One file per distinct vocabulary, none for copies of a tokenizer.
        expected = {
            "wordpiece_classifier": ["vocabulary.txt"],
            "translator": ["vocabulary.spm", "vocabulary.spm"],
        }.get(name, ["vocabulary.spm"])
        assert sorted(n.rsplit("/", 1)[-1] for n in assets) == expected, assets
        loaded = keras.saving.load_model(path)
        want = answer(task)
        assert_same_answer(answer(loaded), want)
        paths.append(f"{name}={path}")
        wants.append(want)
    for got, want in zip(
        answers_in_a_fresh_process("keras", paths), wants, strict=True
    ):
        assert_same_answer(got, want)


def test_a_loaded_translator_keeps_one_tokenizer_for_both_sides(
    small_tokenizer, tmp_path
):
    vocabulary = small_tokenizer.vocabulary_size
    translator = TransformerTranslator(
        vocabulary, vocabulary, sequence_length=17, num_encoder_layers=1,
        num_decoder_layers=1, shared_vocabulary=True,
        source_tokenizer=small_tokenizer, target_tokenizer=small_tokenizer, **SIZES,
    )  # fmt: skip
    translator.save(tmp_path / "shared.keras")
    with zipfile.ZipFile(tmp_path / "shared.keras") as archive:
        assets = [n for n in archive.namelist() if n.startswith("assets/")]
    assert len(assets) == 1, assets
    loaded = keras.saving.load_model(tmp_path / "shared.keras")
    assert loaded.source_tokenizer is loaded.target_tokenizer
    assert loaded.target_tokenizer.proto == small_tokenizer.proto


# The translator's tokenizers:
# test_a_loaded_translator_keeps_one_tokenizer_for_both_sides; its preset runs
# with the slow tests.
@pytest.mark.parametrize(
    "name",
    [
        "classifier",
        "wordpiece_classifier",
        "language_model",
        pytest.param("translator", marks=pytest.mark.slow),
    ],
)
def test_presets_write_and_read_tokenizer_assets(tasks, name, tmp_path):
    task = tasks[name]
    task.save_to_preset(tmp_path)
    asset = "vocabulary.txt" if name == "wordpiece_classifier" else "vocabulary.spm"
    tokenizers = {"tokenizer.json": "tokenizer"}
    if name == "translator":
        tokenizers = {
            "tokenizer.json": "source_tokenizer",
            "target_tokenizer.json": "target_tokenizer",
        }
    for file_name, attribute in tokenizers.items():
        config = json.loads((tmp_path / file_name).read_text())
        assert inline_vocabularies(config) == []
        written = tmp_path / "assets" / file_name.split(".")[0] / asset
        tokenizer = getattr(task, attribute)
        if asset == "vocabulary.spm":
            assert written.read_bytes() == tokenizer.proto
        else:
            assert written.read_text("utf-8").split("\n")[:-1] == WORD_PIECES
    for file_name in ("task.json", "preprocessor.json"):
        assert inline_vocabularies(json.loads((tmp_path / file_name).read_text())) == []
    loaded = type(task).from_preset(tmp_path)
    want = answer(task)
    assert_same_answer(answer(loaded), want)
    preprocessor = load_preprocessor(tmp_path)
    x = {"source": TEXTS, "target": TEXTS} if name == "translator" else TEXTS
    for got, expected in zip(
        keras.tree.flatten(preprocessor(x)),
        keras.tree.flatten(task.preprocessor(x)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    [got] = answers_in_a_fresh_process("preset", [f"{type(task).__name__}={tmp_path}"])
    assert_same_answer(got, want)


def test_an_old_file_with_an_inline_wordpiece_vocabulary_loads(tmp_path):
    """tests/fixtures/tokenizers_inline_vocabulary_classifier.keras: a
    WordPiece classifier saved by keras-attn when configs held vocabularies."""
    path = FIXTURES / "tokenizers_inline_vocabulary_classifier.keras"
    with zipfile.ZipFile(path) as archive:
        assert inline_vocabularies(json.loads(archive.read("config.json")))
    expected = json.loads(
        (FIXTURES / "tokenizers_inline_vocabulary_outputs.json").read_text()
    )
    model = keras.saving.load_model(path)
    assert model.tokenizer.vocabulary == WORD_PIECES
    got = model.classify(expected["texts"])["positive_probability"]
    np.testing.assert_allclose(got, expected["positive_probability"], atol=1e-5)
    # Saved again, the vocabulary moves to the assets.
    model.save(tmp_path / "again.keras")
    with zipfile.ZipFile(tmp_path / "again.keras") as archive:
        assert inline_vocabularies(json.loads(archive.read("config.json"))) == []
    again = keras.saving.load_model(tmp_path / "again.keras")
    got = again.classify(expected["texts"])["positive_probability"]
    np.testing.assert_allclose(got, expected["positive_probability"], atol=1e-5)


def test_an_old_file_with_an_inline_sentencepiece_model_loads(tasks, tmp_path):
    """The translator's file as keras-attn wrote it before: each tokenizer's
    model inline in base64 (`proto`), no assets."""
    task = tasks["translator"]
    task.save(tmp_path / "new.keras")
    old = tmp_path / "old.keras"
    with (
        zipfile.ZipFile(tmp_path / "new.keras") as new,
        zipfile.ZipFile(old, "w") as archive,
    ):
        config = json.loads(new.read("config.json"))
        for key in ("source_tokenizer", "target_tokenizer"):
            proto = getattr(task, key).proto
            tokenizer = config["config"][key]["config"]
            tokenizer["proto"] = base64.b64encode(proto).decode("ascii")
        archive.writestr("config.json", json.dumps(config))
        for name in new.namelist():
            if name != "config.json" and not name.startswith("assets/"):
                archive.writestr(name, new.read(name))
    loaded = keras.saving.load_model(old)
    assert loaded.source_tokenizer.proto == task.source_tokenizer.proto
    assert_same_answer(answer(loaded), answer(task))


def test_a_task_from_its_config_alone_has_tokenizers_without_vocabulary(tasks):
    """As keras-hub's: the config records no vocabulary, so a task rebuilt
    from it in memory has tokenizers that say so when used, until they get
    one."""
    task = tasks["classifier"]
    rebuilt = TextClassifier.from_config(task.get_config())
    assert not rebuilt.tokenizer.has_vocabulary
    with pytest.raises(ValueError, match=r"has no vocabulary.*load_assets"):
        rebuilt.classify(TEXTS)
    rebuilt.tokenizer.set_proto(task.tokenizer.proto)
    rebuilt.set_weights(task.get_weights())
    assert_same_answer(answer(rebuilt), answer(task))
