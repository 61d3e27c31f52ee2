"""The split rule: a hash of the normalised source text, and whole documents."""

import hashlib
import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from keras_attn.datasets import Document, Splits, assign_split
from keras_attn.datasets.splits import (
    split_bucket,
    split_documents,
    split_examples,
    split_key,
)


def data_md_bucket(text):
    """The rule exactly as docs/DATA.md writes it."""
    key = " ".join(text.lower().split())
    return int(hashlib.md5(key.encode("utf-8")).hexdigest()[:8], 16) % 100


@given(st.text(max_size=80))
def test_bucket_follows_the_data_md_formula(text):
    assert split_bucket(text) == data_md_bucket(text)


@given(st.text(max_size=60))
def test_split_ignores_whitespace(text):
    assert assign_split(text) == assign_split("  " + text.replace(" ", "\t \n") + " ")


# ASCII: Unicode case mapping is not always reversible ("µ".upper().lower()).
@given(st.text(alphabet=st.characters(max_codepoint=127), max_size=60))
def test_split_ignores_case(text):
    assert assign_split(text) == assign_split(text.upper())


@pytest.mark.parametrize(
    "text, bucket, split",
    [
        ("How are you today?", 12, "validation"),
        ("The house is old.", 24, "train"),
        ("He runs fast/quickly.", 97, "train"),
    ],
)
def test_known_buckets(text, bucket, split):
    assert split_bucket(text) == bucket
    assert assign_split(text) == split


def test_bucket_ranges():
    texts = [f"sentence number {i}" for i in range(3000)]
    for text in texts:
        bucket = split_bucket(text)
        expected = "test" if bucket < 10 else "validation" if bucket < 20 else "train"
        assert assign_split(text) == expected
    shares = {s: sum(assign_split(t) == s for t in texts) / 3000 for s in ("test",)}
    assert 0.08 < shares["test"] < 0.12


def test_split_key():
    assert split_key("  Hello,\tWORLD \n again ") == "hello, world again"


def test_split_examples_dedups_by_key_keeping_the_first(caplog):
    examples = [("A b c.", 1), ("a  B c.", 0), ("x y z", 1), ("A b c.", 1)]
    with caplog.at_level(logging.INFO, logger="keras_attn.datasets"):
        splits = split_examples(examples, lambda e: e[0], stats={"rows": 4})
    kept = splits.train + splits.validation + splits.test
    assert sorted(kept) == [("A b c.", 1), ("x y z", 1)]
    assert splits.stats["dropped_duplicates"] == 2
    assert splits.stats["rows"] == 4
    assert "duplicates=2" in caplog.text


def test_split_does_not_depend_on_order_or_neighbours():
    examples = [(f"example {i}", i % 2) for i in range(200)]
    forward = split_examples(examples, lambda e: e[0])
    backward = split_examples(examples[::-1][:150], lambda e: e[0])
    for split in ("train", "validation", "test"):
        assert set(backward[split]) <= set(forward[split])


def test_empty_split_is_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="keras_attn.datasets"):
        splits = split_examples([("The house is old.", 1)], lambda e: e[0])
    assert splits.counts() == {"train": 1, "validation": 0, "test": 0}
    assert "validation split is empty" in caplog.text


def test_split_documents_by_position_in_name_order():
    documents = [Document(f"play-{i:02d}", f"text {i}\n") for i in reversed(range(38))]
    splits = split_documents(documents)
    assert [d.name for d in splits.test] == ["play-00", "play-10", "play-20", "play-30"]
    assert [d.name for d in splits.validation] == [
        "play-05",
        "play-15",
        "play-25",
        "play-35",
    ]
    assert len(splits.train) == 30
    assert splits.stats["test_characters"] == sum(len(d.text) for d in splits.test)


def test_splits_structure():
    splits = Splits(train=(1, 2), validation=(3,), test=())
    assert splits["train"] == (1, 2)
    assert splits.counts() == {"train": 2, "validation": 1, "test": 0}
    with pytest.raises(KeyError, match="Unknown split"):
        splits["dev"]
    with pytest.raises(AttributeError):
        splits.train = ()
