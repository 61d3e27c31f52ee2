"""Tokenizers trained on the real training splits round-trip the real test splits.

Run with `pytest -m large tests/text` (fetches the corpora on first use).
"""

import unicodedata

import numpy as np
import pytest

from keras_attn.datasets import (
    load_movie_reviews,
    load_shakespeare,
    load_translation_pairs,
)
from keras_attn.text import UNK_ID, SubwordTokenizer, train_subword_vocabulary
from keras_attn.text.pipelines import language_model_dataset, translation_dataset

pytestmark = pytest.mark.large


def normalised(text):
    return " ".join(unicodedata.normalize("NFKC", text).split())


@pytest.fixture(scope="module")
def pairs():
    return load_translation_pairs()


@pytest.mark.parametrize("side", [0, 1], ids=["english", "german"])
def test_translation_round_trip(pairs, side, tmp_path):
    tokenizer = SubwordTokenizer(
        train_subword_vocabulary(
            [pair[side] for pair in pairs.train], tmp_path / "v.model"
        )
    )
    assert tokenizer.vocabulary_size == 8000
    sentences = [pair[side] for pair in pairs.test]
    ids = tokenizer.tokenize(sentences)
    assert UNK_ID not in ids.flat_values.numpy()
    back = [t.decode("utf-8") for t in tokenizer.detokenize(ids).numpy()]
    assert back == [normalised(s) for s in sentences]
    if side == 1:
        umlauts = [s for s in sentences if set(s) & set("äöüßÄÖÜ")]
        assert len(umlauts) > 500
    tokens_per_word = len(ids.flat_values) / sum(len(s.split()) for s in sentences)
    assert 1.0 < tokens_per_word < 2.0


def test_translation_pipeline_on_real_pairs(pairs, tmp_path):
    english = SubwordTokenizer(
        train_subword_vocabulary([e for e, _ in pairs.train], tmp_path / "en.model")
    )
    german = SubwordTokenizer(
        train_subword_vocabulary([g for _, g in pairs.train], tmp_path / "de.model")
    )
    dataset = translation_dataset(pairs.test, english, german, batch_size=64)
    examples = tokens = padded = 0
    for _, targets in dataset.as_numpy_iterator():
        examples += len(targets)
        tokens += (targets != 0).sum()
        padded += targets.size
    assert examples == len(pairs.test)
    assert tokens / padded > 0.6  # bucketing keeps padding low


def test_movie_reviews_round_trip(tmp_path):
    splits = load_movie_reviews()
    tokenizer = SubwordTokenizer(
        train_subword_vocabulary([t for t, _ in splits.train], tmp_path / "mr.model")
    )
    sentences = [t for t, _ in splits.test]
    back = tokenizer.detokenize(tokenizer.tokenize(sentences)).numpy()
    assert [t.decode("utf-8") for t in back] == [normalised(s) for s in sentences]


def test_shakespeare_lossless_round_trip(tmp_path):
    splits = load_shakespeare()
    tokenizer = SubwordTokenizer(
        train_subword_vocabulary(
            [d.text for d in splits.train], tmp_path / "shk.model", lossless=True
        )
    )
    total_characters = total_tokens = 0
    for play in splits.test:
        ids = tokenizer.tokenize(play.text).numpy()
        assert tokenizer.detokenize(ids).numpy().decode("utf-8") == play.text
        total_characters += len(play.text)
        total_tokens += len(ids)
    assert 2.5 < total_characters / total_tokens < 4.0
    # The windows of the test split cover its tokens exactly once as targets.
    dataset = language_model_dataset(
        splits.test, tokenizer, sequence_length=256, batch_size=64, shuffle=False
    )
    targets = np.concatenate([t for _, t in dataset.as_numpy_iterator()])
    assert (targets != 0).sum() == total_tokens - 1
