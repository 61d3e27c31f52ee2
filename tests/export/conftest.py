"""Small trained-from-scratch models and tokenizers for the export tests."""

from pathlib import Path

import pytest

from keras_attn.datasets import load_translation_pairs
from keras_attn.text import SubwordTokenizer, train_subword_vocabulary

FIXTURES = Path(__file__).parent.parent / "fixtures"

# Inputs a TF Serving client may send: each must give outputs of the right
# shapes, never an error.
NASTY_TEXTS = [
    "",
    "   \t  ",
    "word " * 2000,  # 10,000 characters
    "Grüße aus Köln!",
    "bad bytes \xff\xfe here",
]


def nasty_batch():
    """The texts above as bytes, with genuinely invalid UTF-8 in the last."""
    batch = [text.encode("utf-8") for text in NASTY_TEXTS[:-1]]
    batch.append(b"bad bytes \xff\xfe here")
    return batch


@pytest.fixture(scope="session")
def english_sentences():
    splits = load_translation_pairs(path=FIXTURES / "de_en_pairs.tsv")
    return [english for english, _ in splits.train + splits.validation + splits.test]


@pytest.fixture(scope="session")
def small_tokenizer(english_sentences, tmp_path_factory):
    path = train_subword_vocabulary(
        english_sentences,
        tmp_path_factory.mktemp("vocab") / "en.model",
        vocabulary_size=300,
        lowercase=True,
    )
    return SubwordTokenizer(path)
