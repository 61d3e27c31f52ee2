"""Reading the user's own text files, with one documented bad-input policy.

Every reader here decodes UTF-8 line by line (a UTF-8 byte-order mark is
ignored, `\\r\\n` and `\\n` endings are both accepted) and handles bad input
the same way:

- A missing file raises `FileNotFoundError`; an empty file, or one with no
  usable line, raises `ValueError` naming the file.
- A bad line (bytes that are not UTF-8, a line without the expected tab, a
  label that is not an integer, an empty field) raises `ValueError` naming the
  file, the line number and the problem when `errors="raise"` (the default).
  With `errors="skip"` the line is skipped; the number of skipped lines (and
  the first few line numbers) is logged as a warning and kept in the returned
  `Splits.stats` as `"skipped_lines"`.
- Blank lines are ignored (not counted as bad).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

from keras_attn.datasets.splits import Document, Splits, split_documents

logger = logging.getLogger("keras_attn.datasets")

ERRORS = ("raise", "skip")
TEXT_SUFFIXES = (".txt", ".md")


class BadLines:
    """Collects bad lines under `errors="skip"`, raises under `"raise"`."""

    def __init__(self, path: str | os.PathLike, errors: str):
        if errors not in ERRORS:
            raise ValueError(f"`errors` must be one of {ERRORS}. Received: {errors=}")
        self.path = str(path)
        self.errors = errors
        self.line_numbers: list[int] = []

    def report(self, line_number: int, problem: str) -> None:
        if self.errors == "raise":
            raise ValueError(
                f"{self.path}:{line_number}: {problem}. Fix the line, or pass "
                "errors='skip' to skip bad lines (they are counted in the log)."
            )
        self.line_numbers.append(line_number)

    def log(self) -> int:
        if self.line_numbers:
            shown = ", ".join(str(n) for n in self.line_numbers[:10])
            more = ", ..." if len(self.line_numbers) > 10 else ""
            logger.warning(
                "%s: skipped %d bad line(s) (line %s%s).",
                self.path,
                len(self.line_numbers),
                shown,
                more,
            )
        return len(self.line_numbers)


def read_bytes(path: str | os.PathLike) -> bytes:
    path = Path(path).expanduser()
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory; expected a text file.")
    data = path.read_bytes()  # FileNotFoundError names the path
    if not data.strip():
        raise ValueError(f"{path} is empty.")
    return data


def iter_lines(data: bytes, bad: BadLines) -> Iterator[tuple[int, str]]:
    """Yield `(line_number, text)` of the non-blank lines of UTF-8 `data`."""
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    for number, raw in enumerate(data.split(b"\n"), start=1):
        raw = raw.rstrip(b"\r")
        if not raw.strip():
            continue
        try:
            yield number, raw.decode("utf-8")
        except UnicodeDecodeError as error:
            bad.report(
                number,
                f"not valid UTF-8 (byte 0x{raw[error.start]:02x} at column "
                f"{error.start + 1})",
            )


def read_labelled_text(
    path: str | os.PathLike, *, errors: str = "raise"
) -> tuple[list[tuple[str, int]], dict[str, int]]:
    """Read `label<TAB>text` lines; the label is an integer >= 0.

    Returns:
        `(examples, stats)`: `(text, label)` tuples in file order, and counts.
    """
    data = read_bytes(path)
    bad = BadLines(path, errors)
    examples = []
    for number, line in iter_lines(data, bad):
        label, tab, text = line.partition("\t")
        text = text.strip()
        if not tab:
            bad.report(number, "no tab; expected 'label<TAB>text'")
        elif not label.strip().isdigit():
            bad.report(number, f"label {label!r} is not an integer >= 0")
        elif not text:
            bad.report(number, "empty text after the tab")
        else:
            examples.append((text, int(label)))
    stats = {"rows": len(examples) + len(bad.line_numbers), "skipped_lines": bad.log()}
    if not examples:
        raise ValueError(f"{path} has no 'label<TAB>text' lines.")
    return examples, stats


def read_pairs(
    path: str | os.PathLike, *, errors: str = "raise"
) -> tuple[list[tuple[str, str]], dict[str, int]]:
    """Read `source<TAB>target[<TAB>anything...]` lines.

    Columns after the second are ignored, so the Tatoeba/Anki files of
    manythings.org (`English<TAB>German<TAB>attribution`) load as they are.

    Returns:
        `(pairs, stats)`: `(source, target)` tuples in file order, and counts.
    """
    data = read_bytes(path)
    bad = BadLines(path, errors)
    pairs = []
    for number, line in iter_lines(data, bad):
        fields = line.split("\t")
        if len(fields) < 2:
            bad.report(number, "no tab; expected 'source<TAB>target'")
            continue
        source, target = fields[0].strip(), fields[1].strip()
        if not source or not target:
            bad.report(number, "empty source or target")
            continue
        pairs.append((source, target))
    stats = {"rows": len(pairs) + len(bad.line_numbers), "skipped_lines": bad.log()}
    if not pairs:
        raise ValueError(f"{path} has no 'source<TAB>target' lines.")
    return pairs, stats


def read_text(path: str | os.PathLike, *, errors: str = "raise") -> str:
    """Read running text, keeping line breaks (normalised to `\\n`) and blank lines.

    With `errors="skip"`, lines that are not UTF-8 are left out (and counted in
    the log).
    """
    data = read_bytes(path)
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        bad = BadLines(path, errors)
        kept = []
        for number, raw in enumerate(data.split(b"\n"), start=1):
            try:
                kept.append(raw.decode("utf-8"))
            except UnicodeDecodeError as error:
                bad.report(
                    number,
                    f"not valid UTF-8 (byte 0x{raw[error.start]:02x} at column "
                    f"{error.start + 1})",
                )
        bad.log()
        text = "\n".join(kept)
    return text.replace("\r\n", "\n").replace("\r", "\n")


def load_text(path: str | os.PathLike, *, errors: str = "raise") -> Splits[Document]:
    """Load running text for language modelling, split into train/validation/test.

    - A directory: every `*.txt` and `*.md` file under it is one `Document`
      (named by its path relative to the directory), and whole documents are
      split by position in name order: indices 0, 10, 20, ... test, 5, 15,
      25, ... validation, the rest train (the Shakespeare rule). With 2 to 5
      files validation is empty (logged); a directory of one file is split
      like a file.
    - A file: split into three contiguous parts at line breaks, the first 80%
      of the characters train, the next 10% validation, the last 10% test
      (each a `Document` named `"<file name>:<split>"`). A file too short to
      give each part a line leaves that part empty (logged as a warning).

    Text is returned as read, with line breaks normalised to `\\n`; see
    `read_text` for bad input.

    Args:
        path: a text file or a directory of text files.
        errors: `"raise"` or `"skip"` for lines that are not UTF-8.

    Returns:
        `Splits` of `Document(name, text)`.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        files = sorted(
            p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES
        )
        if not files:
            raise ValueError(f"{path} holds no {' or '.join(TEXT_SUFFIXES)} files.")
        if len(files) == 1:
            return load_text(files[0], errors=errors)
        documents = [
            Document(p.relative_to(path).as_posix(), read_text(p, errors=errors))
            for p in files
        ]
        return split_documents(documents, name=str(path))
    text = read_text(path, errors=errors)
    lines = text.splitlines(keepends=True)
    parts: dict[str, list[str]] = {"train": [], "validation": [], "test": []}
    position = 0
    for line in lines:
        fraction = position / len(text)
        if fraction < 0.8:
            parts["train"].append(line)
        elif fraction < 0.9:
            parts["validation"].append(line)
        else:
            parts["test"].append(line)
        position += len(line)
    documents = {
        split: (Document(f"{path.name}:{split}", "".join(part)),) if part else ()
        for split, part in parts.items()
    }
    result = Splits(
        train=documents["train"],
        validation=documents["validation"],
        test=documents["test"],
        stats={
            "documents": 1,
            **{f"{s}_characters": len("".join(parts[s])) for s in parts},
        },
    )
    for split, part in parts.items():
        if not part:
            logger.warning("%s: the %s split is empty (file too short).", path, split)
    return result
