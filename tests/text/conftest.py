"""Tokenizers trained once per test session on the small fixtures."""

from pathlib import Path

import pytest

from keras_attn.datasets import load_translation_pairs
from keras_attn.text import SubwordTokenizer, train_subword_vocabulary

FIXTURES = Path(__file__).parent.parent / "fixtures"

# Running text with what a lossless tokenizer must keep: blank lines, runs of
# spaces, tabs, leading and trailing spaces, characters never seen in training.
TRICKY_TEXT = (
    "KING:\n  Two  spaces,\ta tab; trailing space \n\n\nÆrø, ½ and 😀 — “quoted”.\n"
    "No newline at the end"
)


@pytest.fixture(scope="session")
def pairs():
    splits = load_translation_pairs(path=FIXTURES / "de_en_pairs.tsv")
    return splits.train + splits.validation + splits.test


@pytest.fixture(scope="session")
def vocab_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("vocab")


@pytest.fixture(scope="session")
def german_tokenizer(pairs, vocab_dir):
    path = train_subword_vocabulary(
        [german for _, german in pairs], vocab_dir / "de.model", vocabulary_size=400
    )
    return SubwordTokenizer(path)


@pytest.fixture(scope="session")
def german_model(german_tokenizer, vocab_dir):
    """The German SentencePiece model file that `german_tokenizer` trains
    (a test reading the file asks for this, not for `vocab_dir`, so that
    it does not depend on another test having trained it first)."""
    return vocab_dir / "de.model"


@pytest.fixture(scope="session")
def english_tokenizer(pairs, vocab_dir):
    path = train_subword_vocabulary(
        [english for english, _ in pairs], vocab_dir / "en.model", vocabulary_size=400
    )
    return SubwordTokenizer(path)


@pytest.fixture(scope="session")
def play_text():
    return (FIXTURES / "play_sample.txt").read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def lossless_tokenizer(play_text, vocab_dir):
    path = train_subword_vocabulary(
        [play_text], vocab_dir / "play.model", vocabulary_size=400, lossless=True
    )
    return SubwordTokenizer(path)
