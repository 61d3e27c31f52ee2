"""English-German sentence pairs from the Ding dictionary (Debian `trans-de-en`)."""

from __future__ import annotations

import glob
import logging
import os
import re
import shutil
from pathlib import Path

from keras_attn.datasets.files import BadLines, iter_lines, read_bytes, read_pairs
from keras_attn.datasets.splits import Splits, split_examples, split_key
from keras_attn.downloads import (
    DatasetUnavailableError,
    fetch_into_cache,
    run_command,
    sha256_file,
)

logger = logging.getLogger("keras_attn.datasets")

DEB_PACKAGE = "trans-de-en"
DING_FILE = "usr/share/trans/de-en"
COPYRIGHT_FILE = "usr/share/doc/trans-de-en/copyright"
# trans-de-en 1.9-6 (Debian 12 "bookworm"): 206,238 lines.
DING_SHA256 = "34052c6021d09eadfee7a893a789204265954df70fe9c36d38fa00058d79d326"
CACHE_NAME = "ding_de_en"
ALTERNATIVES = ("drop", "first", "keep")
HINT = (
    "To use your own data instead, pass a tab-separated file of "
    "'english<TAB>german' lines: load_translation_pairs(path=...)."
)

_ANNOTATION = re.compile(r"\{[^}]*\}|\[[^\]]*\]")
_SENTENCE_END = (".", "?", "!")
# A word of letters, with inner apostrophes or hyphens ("don't", "well-known").
_WORD = r"[^\W\d_]+(?:['\u2019-][^\W\d_]+)*"
# Single-word alternatives written without spaces: "comes/arrives", "a/b/c".
_WORD_ALTERNATIVES = re.compile(rf"(?<![\w/])({_WORD})(?:/{_WORD})+(?![\w/])")
# Slashes that are not alternatives: "24/7", "2009/10", "km/h".
_NOT_ALTERNATIVE = re.compile(r"\d/\d|\bkm/h\b")
# Words that start or end multi-word alternatives ("pretence/a charade").
_FUNCTION_WORDS = frozenset(
    (
        "a an the all not no to in on at of for with by up off out over from into "
        "der die das den dem des ein eine einen einem einer kein keine nicht zu "
        "in im an am auf aus bei mit von vom zum zur sich"
    ).split()
)
# Dictionary placeholders ("somebody", "something", "jemandem", "etwas"):
# entries holding them are phrases ("a rejection of sth."), not sentences.
_PLACEHOLDER = re.compile(r"\b(?:sb|sth|jdm|jdn|jds|etw)\.|\bsb['\u2019]s\b")
_EMPTY_PARENTHESES = re.compile(r"\(\s*\)")
_SPACE_BEFORE_PUNCTUATION = re.compile(r"\s+([.,!?;:)])")


def load_translation_pairs(
    language_pair: str = "de-en",
    *,
    path: str | os.PathLike | None = None,
    include_phrases: bool = False,
    alternatives: str | None = None,
    errors: str = "raise",
    verbose: bool = True,
) -> Splits[tuple[str, str]]:
    """Load English-German sentence pairs, cleaned and split.

    The default data: the example sentences of the Ding German-English
    dictionary (Frank Richter, TU Chemnitz; GPL-2+), from Debian's
    `trans-de-en` package, fetched on first use with `apt-get download
    trans-de-en` and unpacked with `dpkg -x` (no root needed; the package
    lists must be present: `apt-get update`). Only the dictionary file is kept
    in the cache; the extracted text is never part of this repository.

    Extraction (`extract_ding_pairs`): each entry is `German | sub-entries ::
    English | sub-entries`, the `|`-separated sub-entries aligned one to one.
    From each aligned sub-entry the first `;`-separated alternative of each
    side is taken, `{...}` and `[...]` annotations (`{adv}`, `[ugs.]`,
    `[Br.]`) are removed and whitespace is collapsed; the pair is kept if both
    sides have at least 3 words and end in `.`, `?` or `!` (with
    `include_phrases=True`, 3+ words on both sides is enough). Repeated pairs
    are kept once: 19,762 unique sentence pairs from trans-de-en 1.9-6.

    Split: by a hash of the English side as extracted
    (`keras_attn.datasets.assign_split`); pairs whose English side repeats an
    earlier one (up to case and whitespace) are dropped: 19,692 pairs,
    15,790 train / 1,938 validation / 1,964 test, the figures of docs/DATA.md.

    Cleaning, `alternatives=` (`a/b` alternatives are in 2,585 of the
    19,692 pairs):

    - `"drop"` (default for the packaged data): drop every pair with a slash that marks
      alternatives (a slash between digits, `24/7`, and `km/h` do not).
    - `"first"`: first resolve single-word alternatives written without
      spaces (`comes/arrives` -> `comes`, `kann/könnte` -> `kann`; see
      `resolve_alternatives`), then drop as `"drop"` does. Keeps about 1,150
      more pairs, but about one resolved sentence in ten reads wrong where an
      alternative was really a phrase (`shows/has shown`).
    - `"keep"` (default for `path=` files): the pairs exactly as read, for
      the packaged data alternatives and all: the split of docs/DATA.md's
      counts, on which its peer figures were measured.

    `"drop"` and `"first"` also tidy the spaces removed annotations leave
    (`affray .` -> `affray.`) and, unless `include_phrases`, drop the phrases
    with `sb.`/`sth.`/`jdm.`/`etw.` placeholders that end in a `.`
    (`a rejection of sth.`); a cleaned pair whose English side repeats an
    earlier one is dropped. Cleaning never moves a pair between splits: the
    split of every pair is that of its extracted English side, so each
    cleaned split is a subset of the `"keep"` split. Counts (train /
    validation / test), trans-de-en 1.9-6:

    | alternatives | sentences              | include_phrases=True   |
    |--------------|------------------------|------------------------|
    | `"keep"`     | 15,790 / 1,938 / 1,964 | 57,717 / 7,110 / 7,241 |
    | `"drop"`     | 13,599 / 1,671 / 1,671 | 47,786 / 5,889 / 5,992 |
    | `"first"`    | 14,529 / 1,776 / 1,792 | 51,631 / 6,352 / 6,467 |

    Every dropped pair is counted in `Splits.stats` and in the log.

    Args:
        language_pair: `"de-en"` (the only one packaged).
        path: optional `english<TAB>german[<TAB>...]` file to load instead;
            it is split by the same rule with the first column as the source.
            Its pairs are kept as they are unless `alternatives` is given.
        include_phrases: also keep sub-entries that are not sentences.
        alternatives: `"drop"`, `"first"` or `"keep"`, see above; default
            `"drop"` for the packaged data, `"keep"` for `path=`.
        errors: `"raise"` (default) or `"skip"` for bad lines of `path`.
        verbose: print a progress line while fetching.

    Returns:
        `Splits` of `(english, german)` pairs.

    Raises:
        DatasetUnavailableError: the package could not be fetched (no
            `apt-get` on this machine, no package lists, no network); the
            message says how to pass `path=` instead.
    """
    if language_pair != "de-en":
        raise ValueError(
            "Only the 'de-en' pairs of Debian's trans-de-en are packaged; pass "
            f"path= for other languages. Received: {language_pair=}"
        )
    if alternatives is None:
        alternatives = "keep" if path is not None else "drop"
    if alternatives not in ALTERNATIVES:
        raise ValueError(
            f"`alternatives` must be one of {ALTERNATIVES}. Received: {alternatives=}"
        )
    if path is not None:
        pairs, stats = read_pairs(path, errors=errors)
        name = str(path)
    else:
        directory = fetch_into_cache(
            CACHE_NAME,
            _fetch,
            description=f"English-German pairs (Debian package {DEB_PACKAGE})",
            hint=HINT,
            verbose=verbose,
        )
        ding = directory / "de-en"
        if sha256_file(ding) != DING_SHA256:
            logger.warning(
                "%s is not the trans-de-en 1.9-6 file the documented counts were "
                "measured on; counts will differ.",
                ding,
            )
        pairs, stats = extract_ding_pairs(
            read_bytes(ding), include_phrases=include_phrases
        )
        name = "Ding de-en pairs"
    splits = split_examples(pairs, lambda pair: pair[0], stats=stats, name=name)
    return _clean_pairs(splits, alternatives, include_phrases, name)


def extract_ding_pairs(
    data: bytes, *, include_phrases: bool = False
) -> tuple[list[tuple[str, str]], dict[str, int]]:
    """Extract unique `(english, german)` pairs from Ding dictionary bytes.

    See `load_translation_pairs` for the rule. Returns the pairs in file
    order and counts: `"entries"` (dictionary lines), `"dropped_misaligned"`
    (entries whose sides have different numbers of sub-entries),
    `"dropped_repeated_pairs"`.
    """
    bad = BadLines("trans-de-en", "skip")
    pairs: dict[tuple[str, str], None] = {}
    entries = misaligned = candidates = 0
    for _, line in iter_lines(data, bad):
        if line.startswith("#") or "::" not in line:
            continue
        entries += 1
        german, english = line.split("::", 1)
        german_parts, english_parts = german.split("|"), english.split("|")
        if len(german_parts) != len(english_parts):
            misaligned += 1
            continue
        for german_part, english_part in zip(german_parts, english_parts, strict=True):
            pair = _clean_sub_entry(english_part), _clean_sub_entry(german_part)
            if _keep(pair, include_phrases):
                candidates += 1
                pairs[pair] = None
    stats = {
        "entries": entries,
        "dropped_misaligned": misaligned,
        "dropped_not_utf8": bad.log(),
        "dropped_repeated_pairs": candidates - len(pairs),
        "unique_pairs": len(pairs),
    }
    if misaligned:
        logger.info("trans-de-en: %d misaligned entries skipped.", misaligned)
    return list(pairs), stats


def resolve_alternatives(text: str) -> str:
    """Replace single-word alternatives `a/b[/c]` by their first word.

    Only alternatives of letters written without spaces are resolved, and
    only when none of them is an article, negation or similar short function
    word: in Ding those mark multi-word alternatives (`pretence/a charade`,
    `on/all over`) whose first word would leave a broken sentence, so they are
    left in place (and the pair is then dropped by `alternatives="first"`).
    """

    def first_word(match: re.Match) -> str:
        words = match.group(0).split("/")
        if _NOT_ALTERNATIVE.fullmatch(match.group(0)) or any(
            word.lower() in _FUNCTION_WORDS for word in words
        ):
            return match.group(0)
        return words[0]

    return _WORD_ALTERNATIVES.sub(first_word, text)


def has_alternatives(text: str) -> bool:
    """True if a slash is left that is not between digits nor in `km/h`."""
    return "/" in _NOT_ALTERNATIVE.sub("", text)


def tidy_spacing(text: str) -> str:
    """Remove the spaces removed annotations leave before punctuation.

    `for affray [Br.].` is extracted as `for affray .`; this gives
    `for affray.` (and drops empty parentheses).
    """
    text = _EMPTY_PARENTHESES.sub("", text)
    text = _SPACE_BEFORE_PUNCTUATION.sub(r"\1", text)
    return " ".join(text.split())


def _clean_sub_entry(text: str) -> str:
    first = text.split(";")[0]
    return " ".join(_ANNOTATION.sub("", first).split())


def _keep(pair: tuple[str, str], include_phrases: bool) -> bool:
    return all(
        len(side.split()) >= 3 and (include_phrases or side.endswith(_SENTENCE_END))
        for side in pair
    )


def _clean_pairs(
    splits: Splits[tuple[str, str]], mode: str, include_phrases: bool, name: str
) -> Splits[tuple[str, str]]:
    """Tidy spacing and clean alternatives; never moves a pair between splits."""
    seen: set[str] = set()
    with_alternatives = repeated = placeholders = 0
    parts = {}
    # Train first, so that a cleaned pair repeating another is dropped from the
    # evaluation splits rather than from train.
    for split in ("train", "validation", "test"):
        kept = []
        for english, german in splits[split]:
            if mode != "keep":
                english, german = tidy_spacing(english), tidy_spacing(german)
            if mode == "first":
                english = resolve_alternatives(english)
                german = resolve_alternatives(german)
            if mode != "keep" and (
                has_alternatives(english) or has_alternatives(german)
            ):
                with_alternatives += 1
                continue
            if (
                mode != "keep"
                and not include_phrases
                and (_PLACEHOLDER.search(english) or _PLACEHOLDER.search(german))
            ):
                placeholders += 1
                continue
            key = split_key(english)
            if key in seen:
                repeated += 1
                continue
            seen.add(key)
            kept.append((english, german))
        parts[split] = tuple(kept)
    stats = dict(splits.stats)
    stats["dropped_alternatives"] = with_alternatives
    stats["dropped_placeholders"] = placeholders
    stats["dropped_duplicates_after_cleaning"] = repeated
    stats.update({split: len(parts[split]) for split in parts})
    logger.info(
        "%s: alternatives=%r: dropped %d pairs with alternatives, %d with "
        "sb./sth. placeholders and %d repeated after cleaning: %d train / %d "
        "validation / %d test",
        name,
        mode,
        with_alternatives,
        placeholders,
        repeated,
        *(len(parts[split]) for split in ("train", "validation", "test")),
    )
    return Splits(stats=stats, **parts)


def _fetch(work_dir: Path, output_dir: Path) -> None:
    if shutil.which("apt-get") is None:
        raise DatasetUnavailableError(
            "Cannot fetch the English-German pairs: this machine has no `apt-get` "
            f"(the default data comes from the Debian package {DEB_PACKAGE}). " + HINT
        )
    download = ["apt-get", "download", DEB_PACKAGE]
    try:
        run_command(download, cwd=work_dir, what=f"download {DEB_PACKAGE}", hint=HINT)
    except DatasetUnavailableError as error:
        # Missing package lists (a fresh container): only root can refresh them.
        if os.geteuid() != 0:
            raise DatasetUnavailableError(
                f"{error}\nIf the package lists are missing, run `sudo apt-get "
                "update` once and try again."
            ) from error
        run_command(
            ["apt-get", "update"],
            cwd=work_dir,
            what="refresh the package lists",
            hint=HINT,
        )
        run_command(download, cwd=work_dir, what=f"download {DEB_PACKAGE}", hint=HINT)
    debs = sorted(glob.glob(str(work_dir / f"{DEB_PACKAGE}_*.deb")))
    if not debs:
        raise DatasetUnavailableError(
            f"apt-get download produced no {DEB_PACKAGE}_*.deb. {HINT}"
        )
    unpacked = work_dir / "unpacked"
    run_command(
        ["dpkg", "-x", debs[-1], unpacked],
        cwd=work_dir,
        what=f"unpack {Path(debs[-1]).name}",
        hint=HINT,
    )
    ding = unpacked / DING_FILE
    if not ding.is_file():
        raise DatasetUnavailableError(f"{debs[-1]} holds no {DING_FILE}. {HINT}")
    shutil.copyfile(ding, output_dir / "de-en")
    copyright_file = unpacked / COPYRIGHT_FILE
    if copyright_file.is_file():
        shutil.copyfile(copyright_file, output_dir / "copyright")


def load_training_phrases(
    splits: Splits[tuple[str, str]], alternatives: str | None = None
) -> tuple[tuple[str, str], ...]:
    """The Ding phrase pairs of the training split that `splits.train` lacks.

    Phrases (3+ words per side, not sentences) split by the same rule as the
    sentences (the hash of their English side), so none of them comes from
    the validation or test buckets: extra training data, or extra kNN-MT
    neighbours, that leaves the documented validation and test splits as
    they are.

    Args:
        splits: the sentence pairs of `load_translation_pairs("de-en")`.
        alternatives: as in `load_translation_pairs`.
    """
    everything = load_translation_pairs(
        "de-en", alternatives=alternatives, include_phrases=True, verbose=False
    )
    seen = {source for source, _ in splits.train}
    return tuple(pair for pair in everything.train if pair[0] not in seen)
