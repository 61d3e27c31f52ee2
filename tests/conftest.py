"""Pytest configuration shared by every test."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from pathlib import Path

import keras
import pytest

FIXTURES = Path(__file__).parent / "fixtures"


def pytest_collection_modifyitems(config, items):
    """Tests marked `tf_only` / `jax_only` cannot run on the other backend:
    deselect them there (the other run covers them), rather than skipping
    inside the test."""
    backend = keras.backend.backend()
    wrong = {"tf_only": backend != "tensorflow", "jax_only": backend != "jax"}
    kept, deselected = [], []
    for item in items:
        other_backend = any(
            item.get_closest_marker(marker) and is_wrong
            for marker, is_wrong in wrong.items()
        )
        (deselected if other_backend else kept).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


@pytest.fixture(autouse=True)
def _float32_policy():
    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_dtype_policy("float32")


@pytest.fixture(scope="session")
def english_sentences():
    from keras_attn.datasets import load_translation_pairs

    splits = load_translation_pairs(path=FIXTURES / "de_en_pairs.tsv")
    return [english for english, _ in splits.train + splits.validation + splits.test]


@pytest.fixture(scope="session")
def small_tokenizer(english_sentences, tmp_path_factory):
    """A 300-piece SentencePiece tokenizer of the fixture's English side
    (TensorFlow Text: TensorFlow-only tests)."""
    from keras_attn.text import SubwordTokenizer, train_subword_vocabulary

    path = train_subword_vocabulary(
        english_sentences,
        tmp_path_factory.mktemp("vocab") / "en.model",
        vocabulary_size=300,
        lowercase=True,
    )
    return SubwordTokenizer(path)
