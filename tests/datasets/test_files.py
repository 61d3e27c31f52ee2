"""The user's own files: formats, and the documented bad-input behaviour."""

import logging
from pathlib import Path

import pytest

from keras_attn.datasets import load_movie_reviews, load_text, load_translation_pairs
from keras_attn.datasets.files import read_labelled_text, read_pairs, read_text
from tests.datasets.test_splits import data_md_bucket

FIXTURES = Path(__file__).parent.parent / "fixtures"


def write(tmp_path, data: bytes, name="data.tsv"):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_pairs_file_loads_and_splits_by_the_source():
    splits = load_translation_pairs(path=FIXTURES / "de_en_pairs.tsv")
    everything = splits.train + splits.validation + splits.test
    assert len(everything) == 50
    assert ("Where is the nearest pharmacy?", "Wo ist die nächste Apotheke?") in (
        everything
    )
    # The split of each pair is the docs/DATA.md rule applied to its English side.
    for split in ("train", "validation", "test"):
        for english, _ in splits[split]:
            bucket = data_md_bucket(english)
            assert split == (
                "test" if bucket < 10 else "validation" if bucket < 20 else "train"
            )
    assert splits.counts() == {"train": 45, "validation": 2, "test": 3}
    # Slashes of user files are kept unless asked otherwise.
    assert splits.stats["dropped_alternatives"] == 0


def test_pairs_file_extra_columns_crlf_and_bom(tmp_path):
    data = "\ufeffGo.\tGeh.\tCC-BY 2.0 (France)\r\nHi.\tHallo!\r\n\r\n".encode()
    pairs, stats = read_pairs(write(tmp_path, data))
    assert pairs == [("Go.", "Geh."), ("Hi.", "Hallo!")]
    assert stats == {"rows": 2, "skipped_lines": 0}


@pytest.mark.parametrize(
    "line, problem",
    [
        (b"no tab here", "no tab"),
        (b"\tonly a target", "empty source or target"),
        (b"caf\xe9\tCaf\xc3\xa9", r"not valid UTF-8 \(byte 0xe9 at column 4\)"),
    ],
)
def test_bad_pair_line_raises_with_line_number(tmp_path, line, problem):
    path = write(tmp_path, b"Good.\tGut.\n" + line + b"\nFine.\tSchon.\n")
    with pytest.raises(ValueError, match=rf"data.tsv:2: .*{problem}.*errors='skip'"):
        read_pairs(path)


def test_bad_lines_skipped_and_counted(tmp_path, caplog):
    path = write(
        tmp_path,
        b"Good.\tGut.\nno tab\ncaf\xe9\tx\nFine.\tSchon.\n\tx\n \t \nLast.\tLetzte.\n",
    )
    with caplog.at_level(logging.WARNING, logger="keras_attn.datasets"):
        splits = load_translation_pairs(path=path, errors="skip")
    assert sum(splits.counts().values()) == 3
    assert splits.stats["skipped_lines"] == 3
    assert splits.stats["rows"] == 6  # the blank line 6 is not a row
    assert "skipped 3 bad line(s) (line 2, 3, 5)" in caplog.text


def test_empty_file_is_an_error(tmp_path):
    for data in (b"", b"\n  \n\t\n"):
        with pytest.raises(ValueError, match="is empty"):
            read_pairs(write(tmp_path, data))


def test_file_of_only_bad_lines_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no 'source<TAB>target' lines"):
        read_pairs(write(tmp_path, b"one\ntwo\n"), errors="skip")


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_movie_reviews(path=tmp_path / "missing.tsv")
    with pytest.raises(IsADirectoryError):
        read_pairs(tmp_path)


def test_unknown_errors_policy(tmp_path):
    with pytest.raises(ValueError, match="errors"):
        read_pairs(write(tmp_path, b"a\tb\n"), errors="ignore")


def test_labelled_file(tmp_path):
    path = write(tmp_path, b"1\tGreat film!\n0\tDull.\n2\tThird class\n")
    examples, _ = read_labelled_text(path)
    assert examples == [("Great film!", 1), ("Dull.", 0), ("Third class", 2)]
    splits = load_movie_reviews(path=path)
    assert sorted(splits.train + splits.validation + splits.test) == sorted(examples)


@pytest.mark.parametrize(
    "line, problem",
    [
        (b"positive\tGreat", "label 'positive' is not an integer"),
        (b"-1\tBad", "label '-1' is not an integer"),
        (b"1\t   ", "empty text"),
        (b"1 Great", "no tab"),
    ],
)
def test_bad_labelled_line(tmp_path, line, problem):
    with pytest.raises(ValueError, match=f"data.tsv:1: {problem}"):
        read_labelled_text(write(tmp_path, line + b"\n0\tok\n"))


def test_read_text_keeps_lines_and_normalises_endings(tmp_path):
    path = write(tmp_path, b"\xef\xbb\xbfOne\r\n\r\n  two  \rthree\n", "t.txt")
    assert read_text(path) == "One\n\n  two  \nthree\n"


def test_read_text_non_utf8(tmp_path, caplog):
    path = write(tmp_path, b"fine\nbad \xff byte\nfine again\n", "t.txt")
    with pytest.raises(ValueError, match=r"t.txt:2: not valid UTF-8 \(byte 0xff"):
        read_text(path)
    with caplog.at_level(logging.WARNING, logger="keras_attn.datasets"):
        assert read_text(path, errors="skip") == "fine\nfine again\n"
    assert "skipped 1 bad line(s) (line 2)" in caplog.text


def test_load_text_single_file_contiguous_parts(tmp_path):
    lines = [f"line {i:03d}\n" for i in range(100)]
    splits = load_text(write(tmp_path, "".join(lines).encode(), "book.txt"))
    assert [d.name for d in splits.train] == ["book.txt:train"]
    assert splits.train[0].text == "".join(lines[:80])
    assert splits.validation[0].text == "".join(lines[80:90])
    assert splits.test[0].text == "".join(lines[90:])


def test_load_text_short_file_leaves_splits_empty(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="keras_attn.datasets"):
        splits = load_text(write(tmp_path, b"just one line\n", "short.txt"))
    assert splits.counts() == {"train": 1, "validation": 0, "test": 0}
    assert "validation split is empty" in caplog.text


def test_load_text_directory_of_documents(tmp_path):
    for i in range(12):
        write(tmp_path, f"document {i}\n".encode(), f"doc{i:02d}.txt")
    write(tmp_path, b"ignored", "notes.csv")
    splits = load_text(tmp_path)
    assert [d.name for d in splits.test] == ["doc00.txt", "doc10.txt"]
    assert [d.name for d in splits.validation] == ["doc05.txt"]
    assert len(splits.train) == 9
    assert splits.test[0].text == "document 0\n"


def test_load_text_directory_of_one_file_splits_it(tmp_path):
    write(tmp_path, "".join(f"line {i}\n" for i in range(50)).encode(), "one.txt")
    splits = load_text(tmp_path)
    assert [d.name for d in splits.train + splits.validation + splits.test] == [
        "one.txt:train",
        "one.txt:validation",
        "one.txt:test",
    ]


def test_load_text_empty_directory(tmp_path):
    with pytest.raises(ValueError, match="holds no"):
        load_text(tmp_path)
