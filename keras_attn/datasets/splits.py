"""The one split rule every loader uses, and the structure loaders return.

Sentences and pairs are split by a hash of their *source text* (the sentence;
the English side of a pair), so the split of an example never depends on the
order of the file, on which other examples are present, or on the machine:

```
key = " ".join(source.lower().split())          # lower-cased, whitespace collapsed
bucket = int(md5(key.encode("utf-8")).hexdigest()[:8], 16) % 100
test if bucket < 10; validation if 10 <= bucket < 20; else train
```

Examples whose keys are equal (equal up to case and whitespace) are
duplicates: the first one is kept, the others are dropped and counted. Since
equal keys always fall in the same bucket, no source text can appear in two
splits. Whole documents (plays, files) are split by position instead; see
`split_documents`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Generic, NamedTuple, TypeVar

logger = logging.getLogger("keras_attn.datasets")

T = TypeVar("T")

SPLIT_NAMES = ("train", "validation", "test")
TEST_BUCKETS = range(0, 10)
VALIDATION_BUCKETS = range(10, 20)


@dataclasses.dataclass(frozen=True)
class Splits(Generic[T]):
    """Train, validation and test examples of one corpus.

    Attributes:
        train: tuple of examples.
        validation: tuple of examples.
        test: tuple of examples.
        stats: counts of what the loader read, kept and dropped (for example
            `{"rows": 10605, "dropped_neutral": 37, "dropped_duplicates": 2}`);
            every example a loader drops is counted here and in the log.

    What an example is depends on the loader: `(text, label)` for labelled
    sentences, `(source, target)` for translation pairs, a `Document` for
    running text.
    """

    train: tuple[T, ...]
    validation: tuple[T, ...]
    test: tuple[T, ...]
    stats: Mapping[str, int] = dataclasses.field(default_factory=dict, compare=False)

    def __getitem__(self, split: str) -> tuple[T, ...]:
        if split not in SPLIT_NAMES:
            raise KeyError(f"Unknown split {split!r}; expected one of {SPLIT_NAMES}.")
        return getattr(self, split)

    def counts(self) -> dict[str, int]:
        """Number of examples per split, e.g. `{"train": 8451, ...}`."""
        return {name: len(self[name]) for name in SPLIT_NAMES}


class Document(NamedTuple):
    """A named piece of running text (a play, a file)."""

    name: str
    text: str


def split_key(source: str) -> str:
    """The normalised text that decides an example's split and duplicates.

    Lower-cased, with every run of whitespace collapsed to one space and no
    leading or trailing whitespace.
    """
    return " ".join(source.lower().split())


def split_bucket(source: str) -> int:
    """The bucket (0..99) of a source text: md5 of its `split_key`."""
    digest = hashlib.md5(split_key(source).encode("utf-8")).hexdigest()
    return int(digest[:8], 16) % 100


def assign_split(source: str) -> str:
    """`"test"`, `"validation"` or `"train"` for a source text (see module doc)."""
    bucket = split_bucket(source)
    if bucket in TEST_BUCKETS:
        return "test"
    if bucket in VALIDATION_BUCKETS:
        return "validation"
    return "train"


def split_examples(
    examples: Iterable[T],
    source: Callable[[T], str],
    *,
    stats: Mapping[str, int] | None = None,
    name: str = "examples",
) -> Splits[T]:
    """Deduplicate examples by source key and split them by `assign_split`.

    Args:
        examples: examples in file order.
        source: function giving the source text of an example.
        stats: counts gathered while reading, copied into the result.
        name: what the examples are, for the log line.

    Returns:
        A `Splits` whose `stats` also hold `"dropped_duplicates"` and the
        number of examples kept per split. An empty split is allowed (a small
        user file may have no test bucket) and is logged as a warning.
    """
    seen: set[str] = set()
    parts: dict[str, list[T]] = {split: [] for split in SPLIT_NAMES}
    duplicates = 0
    for example in examples:
        text = source(example)
        key = split_key(text)
        if key in seen:
            duplicates += 1
            continue
        seen.add(key)
        parts[assign_split(text)].append(example)
    all_stats = dict(stats or {})
    all_stats["dropped_duplicates"] = duplicates
    for split in SPLIT_NAMES:
        all_stats[split] = len(parts[split])
    result = Splits(
        train=tuple(parts["train"]),
        validation=tuple(parts["validation"]),
        test=tuple(parts["test"]),
        stats=all_stats,
    )
    _log_splits(result, name)
    return result


def split_documents(documents: Sequence[Document], *, name: str = "documents"):
    """Split whole documents by their position in name order.

    Documents are sorted by name; those at indices 0, 10, 20, ... go to test,
    those at 5, 15, 25, ... to validation, the rest to train. With the 38
    Shakespeare plays this holds out 4 plays for test and 4 for validation.
    """
    ordered = sorted(documents, key=lambda document: document.name)
    parts: dict[str, list[Document]] = {split: [] for split in SPLIT_NAMES}
    for index, document in enumerate(ordered):
        if index % 10 == 0:
            parts["test"].append(document)
        elif index % 10 == 5:
            parts["validation"].append(document)
        else:
            parts["train"].append(document)
    stats = {"documents": len(ordered)}
    for split in SPLIT_NAMES:
        stats[split] = len(parts[split])
        stats[f"{split}_characters"] = sum(len(d.text) for d in parts[split])
    result = Splits(
        train=tuple(parts["train"]),
        validation=tuple(parts["validation"]),
        test=tuple(parts["test"]),
        stats=stats,
    )
    _log_splits(result, name)
    return result


def _log_splits(result: Splits, name: str) -> None:
    counts = result.counts()
    dropped = {k: v for k, v in result.stats.items() if k.startswith("dropped_") and v}
    logger.info(
        "%s: %d train / %d validation / %d test%s",
        name,
        counts["train"],
        counts["validation"],
        counts["test"],
        "; dropped " + ", ".join(f"{k[8:]}={v}" for k, v in dropped.items())
        if dropped
        else "",
    )
    for split, count in counts.items():
        if count == 0:
            logger.warning("%s: the %s split is empty.", name, split)
