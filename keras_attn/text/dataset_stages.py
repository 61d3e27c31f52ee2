"""The stages the `tf.data` pipelines of `keras_attn.text.pipelines` share:
tokenizing in batches, caching and shuffling, batching (padded to
`max_length` or to length buckets), prefetching without `tf.data`'s
autotuner, and `with_cardinality`."""

from __future__ import annotations

import tensorflow as tf

from keras_attn.text.vocabulary import PAD_ID

TOKENIZE_BATCH = 256
AUTOTUNE = tf.data.AUTOTUNE


def with_cardinality(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """`dataset` with its number of batches counted and stated.

    One pass over `dataset` counts its elements (with `cache=True`, that pass
    also fills the cache of the pipelines above, so the first epoch reads the
    cache), then `tf.data.experimental.assert_cardinality` states the count:
    `dataset.cardinality()` is then that number, `fit` shows it in the
    progress bar and no longer warns that the input "ran out of data" at the
    end of the first epoch. The count of the pipelines of this module is
    the same every epoch (it depends on the examples' lengths, not on the
    shuffled order); for a dataset whose count changes between passes, the
    assertion fails the pass with a `tf.errors.FailedPreconditionError`
    naming both counts.

    Args:
        dataset: a finite `tf.data.Dataset`.

    Returns:
        The same elements, with a known `cardinality()`. A dataset whose
        cardinality is already known is returned as it is.

    Raises:
        ValueError: `dataset` is infinite (e.g. `.repeat()`ed): there is
            nothing to count, pass `steps_per_epoch` to `fit` instead.
    """
    known = int(dataset.cardinality())
    if known == tf.data.INFINITE_CARDINALITY:
        raise ValueError(
            "`dataset` is infinite (a `.repeat()`ed dataset has no end to "
            "count to); pass `steps_per_epoch` to `fit` instead. "
            f"Received: {dataset=}"
        )
    if known >= 0:
        return dataset

    def add_one(count, *_):
        return count + 1

    count = int(dataset.reduce(tf.constant(0, tf.int64), add_one))
    return dataset.apply(tf.data.experimental.assert_cardinality(count))


def auto_bucket_boundaries(max_length: int) -> list[int]:
    """Padded lengths 8, 16, 32, ... below `max_length`, then `max_length`."""
    lengths = []
    length = 8
    while length < max_length:
        lengths.append(length)
        length *= 2
    return [*lengths, max_length]


def batch_examples(
    dataset,
    *,
    batch_size,
    max_lengths,
    length,
    bucket_boundaries,
    drop_remainder,
    pad_to_bucket_boundary=True,
):
    """`dataset`'s examples (tuples, one entry per `max_lengths`; None: not
    padded) in batches of `batch_size`: padded to `max_lengths` with
    `bucket_boundaries=None`, else grouped by `length(*example)` into
    buckets (`"auto"`: `auto_bucket_boundaries`, or the given lengths) and
    padded to each bucket's length."""
    longest = max(m for m in max_lengths if m is not None)
    if bucket_boundaries is None:
        shapes = tuple([m] if m is not None else [] for m in max_lengths)
        return dataset.padded_batch(
            batch_size,
            padded_shapes=shapes,
            padding_values=PAD_ID,
            drop_remainder=drop_remainder,
        )
    if isinstance(bucket_boundaries, str):
        if bucket_boundaries != "auto":
            raise ValueError(
                "`bucket_boundaries` must be 'auto', a list of lengths or None. "
                f"Received: {bucket_boundaries=}"
            )
        padded_lengths = auto_bucket_boundaries(longest)
    else:
        padded_lengths = sorted({int(b) for b in bucket_boundaries})
        if not padded_lengths or padded_lengths[0] < 1:
            raise ValueError(
                f"`bucket_boundaries` must be positive lengths. Received: "
                f"{bucket_boundaries=}"
            )
        if padded_lengths[-1] < longest:
            padded_lengths.append(longest)
    # A bucket with boundary b holds lengths < b and is padded to b - 1.
    boundaries = [padded + 1 for padded in padded_lengths]
    return dataset.bucket_by_sequence_length(
        element_length_func=length,
        bucket_boundaries=boundaries,
        bucket_batch_sizes=[batch_size] * (len(boundaries) + 1),
        padding_values=tuple(PAD_ID if m is not None else None for m in max_lengths),
        pad_to_bucket_boundary=pad_to_bucket_boundary,
        drop_remainder=drop_remainder,
    )


def prefetch_untuned(dataset):
    """Prefetch, and turn off `tf.data`'s autotuning thread.

    The autotuner's thread sleeps between its optimization passes and, in
    TensorFlow 2.21, deleting an iterator waits for that thread to wake (a
    gdb dump showed `~Iterator` blocked on `Model::OptimizeLoop`). Keras
    makes a new iterator every epoch, so epochs of translate.py started 0 to
    33 s late with the processors idle. These pipelines cache what they
    tokenize, so there is little left to tune.
    """
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.prefetch(AUTOTUNE).with_options(options)


def map_in_batches(dataset, fn):
    """`fn` over batches of `TOKENIZE_BATCH` examples (tokenizers are far
    faster on batches), then back to dense examples."""
    return (
        dataset.batch(TOKENIZE_BATCH)
        .map(fn, num_parallel_calls=AUTOTUNE, deterministic=True)
        .unbatch()
        .map(_dense, num_parallel_calls=AUTOTUNE)
    )


def _dense(*elements):
    """Unbatched rows of a RaggedTensor come as 1-D ragged specs: make them dense."""
    return tuple(
        e.flat_values if isinstance(e, tf.RaggedTensor) else e for e in elements
    )


def cache_and_shuffle(dataset, size, cache, shuffle, seed):
    """`dataset` cached in memory (`cache`) and shuffled anew every epoch
    (`shuffle`, with `seed`; a buffer of `size` examples, at most 100,000)."""
    if cache:
        dataset = dataset.cache()
    if shuffle:
        dataset = dataset.shuffle(
            min(size, 100_000), seed=seed, reshuffle_each_iteration=True
        )
    return dataset
