"""`tf.data` input pipelines for translation, classification and language modelling.

All three tokenize in the graph (`SubwordTokenizer.tokenize` inside
`Dataset.map`, on batches of 256 texts), pad with `PAD_ID` (0) and never
return Python objects, so they feed `model.fit` on any Keras backend.

Padding masks: id 0 is padding and nothing else, so a model gets its masks
from `keras.layers.Embedding(..., mask_zero=True)` or from `ids != 0`; the
loss should ignore padded targets, e.g.
`keras.losses.SparseCategoricalCrossentropy(ignore_class=0)`, or pass
`sample_weight=True` to get `(inputs, targets, weights)` with weight 0.0 on
padding.

Length bucketing (`bucket_boundaries`, translation and classification):
examples are grouped by length with `Dataset.bucket_by_sequence_length` and
each batch is padded to its bucket's length, a small fixed set of shapes
(XLA and JAX compile each shape once) with far less padding than padding
everything to `max_length`. Bucketing changes the order of examples; pass
`bucket_boundaries=None` to keep the order (batches padded to `max_length`).

Order of the stages: tokenize -> `cache()` (the tokenized examples, once,
in memory) -> `shuffle` (every epoch anew) -> batch -> `prefetch`, with
`tf.data` autotuning off (see `keras_attn.text.dataset_stages.prefetch_untuned`).

Epoch length: bucketing and the language model's windows leave `tf.data`
unable to tell how many batches a pipeline yields (`cardinality()` is
`UNKNOWN`), and Keras 3's `fit` then ends the first epoch with the warning
"Your input ran out of data; interrupting training ... use the `.repeat()`
function", although nothing is wrong. `with_cardinality(dataset)` counts the
batches once and states the count, so `fit` knows the epoch's length.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from keras_attn import _validation as v
from keras_attn.datasets.splits import Document
from keras_attn.text.dataset_stages import (
    AUTOTUNE,
    TOKENIZE_BATCH,
    auto_bucket_boundaries,
    batch_examples,
    cache_and_shuffle,
    map_in_batches,
    prefetch_untuned,
    with_cardinality,
)
from keras_attn.text.preprocessors import pack_target
from keras_attn.text.tokenizer import SubwordTokenizer
from keras_attn.text.vocabulary import END_ID, PAD_ID, START_ID

__all__ = [
    "auto_bucket_boundaries",
    "classification_dataset",
    "language_model_dataset",
    "translation_dataset",
    "with_cardinality",
]


def translation_dataset(
    pairs: Sequence[tuple[str, str]],
    source_tokenizer: SubwordTokenizer,
    target_tokenizer: SubwordTokenizer,
    *,
    batch_size: int = 64,
    max_length: int = 64,
    target_length: int | None = None,
    shuffle: bool = True,
    seed: int | None = None,
    bucket_boundaries: Sequence[int] | str | None = "auto",
    cache: bool = True,
    sample_weight: bool = False,
    drop_remainder: bool = False,
    subword_sampling: float | None = None,
) -> tf.data.Dataset:
    """Batches of `({"encoder_inputs", "decoder_inputs"}, decoder_targets)`.

    - `encoder_inputs`: the source tokens, truncated to `max_length`, no
      special tokens.
    - `decoder_inputs`: `START_ID` then the target tokens.
    - `decoder_targets`: the target tokens then `END_ID` (the decoder inputs
      shifted left by one).

    Both decoder sequences hold at most `target_length` tokens: the sequence
    `[START] target [END]` is cut to `target_length + 1` tokens before
    shifting, so a target that is too long loses its end (and `END_ID`, since
    the sentence did not end there); nothing is dropped.

    Args:
        pairs: `(source, target)` strings, e.g. a split of
            `load_translation_pairs()`.
        source_tokenizer: tokenizer of the source language.
        target_tokenizer: tokenizer of the target language (may be the same).
        batch_size: examples per batch.
        max_length: maximum source length in tokens.
        target_length: maximum decoder length, default `max_length`.
        shuffle: reshuffle the examples every epoch.
        seed: shuffle seed.
        bucket_boundaries: `"auto"` (8, 16, 32, ... up to the maximum length),
            a list of padded lengths, or `None` (no bucketing, batches padded
            to the maximum lengths, order kept).
        cache: keep the tokenized examples in memory after the first epoch.
        sample_weight: also yield `float32` weights, 0.0 on padded targets.
        drop_remainder: drop batches smaller than `batch_size`.
        subword_sampling: `None` (default), or a positive `alpha`: tokenize
            both sides with `SubwordTokenizer.sample(texts, alpha)`, a new
            random segmentation of every pair at every epoch (subword
            regularization, for training data). The texts are cached and
            tokenized after the shuffle; each pair's bucket is chosen by the
            length of its most likely segmentation, so the number of batches
            stays the same every epoch (`with_cardinality` holds), and each
            batch is padded to its longest sequence.

    Returns:
        A `tf.data.Dataset` of `int32` tensors `[batch, length]`.
    """
    sources, targets = _unzip_pairs(pairs)
    target_length = target_length or max_length
    _check_lengths(
        batch_size=batch_size, max_length=max_length, target_length=target_length
    )
    if subword_sampling is not None and (
        isinstance(subword_sampling, bool)
        or not isinstance(subword_sampling, (int, float))
        or subword_sampling <= 0
    ):
        raise ValueError(
            "`subword_sampling` must be None or a positive float (the sampling "
            f"alpha). Received: {subword_sampling=}"
        )

    def tokenizing(tokenize_source, tokenize_target):
        def tokenize(source, target):
            encoder = tokenize_source(source)[:, :max_length]  # (B, None)
            target_ids = tokenize_target(target)  # (B, None)
            return (encoder, *pack_target(target_ids, target_length))

        return tokenize

    tokenize = tokenizing(source_tokenizer.tokenize, target_tokenizer.tokenize)
    dataset = tf.data.Dataset.from_tensor_slices((sources, targets))
    if subword_sampling is None:
        dataset = map_in_batches(dataset, tokenize)
        dataset = cache_and_shuffle(dataset, len(sources), cache, shuffle, seed)
        dataset = batch_examples(
            dataset,
            batch_size=batch_size,
            max_lengths=(max_length, target_length, target_length),
            length=lambda encoder, decoder_in, decoder_out: tf.maximum(
                tf.shape(encoder)[0], tf.shape(decoder_in)[0]
            ),
            bucket_boundaries=bucket_boundaries,
            drop_remainder=drop_remainder,
        )
    else:
        # Cache the texts with the length of their most likely segmentation
        # (the bucket key), then sample a segmentation after each shuffle.
        def with_length(source, target):
            encoder, decoder_in, _ = tokenize(source, target)
            lengths = tf.maximum(encoder.row_lengths(), decoder_in.row_lengths())
            return source, target, tf.cast(lengths, tf.int32)

        sampled = tokenizing(
            lambda texts: source_tokenizer.sample(texts, subword_sampling),
            lambda texts: target_tokenizer.sample(texts, subword_sampling),
        )

        def sample(source, target, length):
            return (*sampled(source, target), length)

        dataset = map_in_batches(dataset, with_length)
        dataset = cache_and_shuffle(dataset, len(sources), cache, shuffle, seed)
        dataset = batch_examples(
            map_in_batches(dataset, sample),
            batch_size=batch_size,
            max_lengths=(max_length, target_length, target_length, None),
            length=lambda encoder, decoder_in, decoder_out, length: length,
            bucket_boundaries=bucket_boundaries,
            drop_remainder=drop_remainder,
            pad_to_bucket_boundary=False,
        )

    def to_model_inputs(encoder, decoder_in, decoder_out, *bucket_key):
        # With subword sampling, each batch also carries its bucket key.
        inputs = {"encoder_inputs": encoder, "decoder_inputs": decoder_in}
        if sample_weight:
            return inputs, decoder_out, tf.cast(decoder_out != PAD_ID, tf.float32)
        return inputs, decoder_out

    return prefetch_untuned(dataset.map(to_model_inputs, num_parallel_calls=AUTOTUNE))


def classification_dataset(
    examples: Sequence[tuple[str, int]],
    tokenizer: SubwordTokenizer,
    *,
    batch_size: int = 32,
    max_length: int = 128,
    shuffle: bool = True,
    seed: int | None = None,
    bucket_boundaries: Sequence[int] | str | None = "auto",
    cache: bool = True,
    drop_remainder: bool = False,
) -> tf.data.Dataset:
    """Batches of `(token_ids, labels)` for text classification.

    Args:
        examples: `(text, label)` with integer labels, e.g. a split of
            `load_movie_reviews()`.
        tokenizer: the tokenizer.
        batch_size: examples per batch.
        max_length: texts longer than this many tokens are truncated.
        shuffle, seed, bucket_boundaries, cache, drop_remainder: as in
            `translation_dataset`.

    Returns:
        A `tf.data.Dataset` of `(int32 [batch, length], int32 [batch])`.
    """
    if not examples:
        raise ValueError("`examples` is empty: there is nothing to batch.")
    try:
        texts = [text for text, _ in examples]
        labels = [int(label) for _, label in examples]
        if not all(isinstance(text, str) for text in texts):
            raise TypeError("texts must be strings")
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"`examples` must hold (text, integer label) pairs: {error}"
        ) from error
    _check_lengths(batch_size=batch_size, max_length=max_length)

    def tokenize(text, label):
        return tokenizer.tokenize(text)[:, :max_length], label

    dataset = tf.data.Dataset.from_tensor_slices(
        (tf.constant(texts, tf.string), tf.constant(labels, tf.int32))
    )
    dataset = map_in_batches(dataset, tokenize)
    dataset = cache_and_shuffle(dataset, len(texts), cache, shuffle, seed)
    dataset = batch_examples(
        dataset,
        batch_size=batch_size,
        max_lengths=(max_length, None),
        length=lambda ids, label: tf.shape(ids)[0],
        bucket_boundaries=bucket_boundaries,
        drop_remainder=drop_remainder,
    )
    return prefetch_untuned(dataset)


def language_model_dataset(
    texts: str | Document | Sequence[str | Document],
    tokenizer: SubwordTokenizer,
    *,
    sequence_length: int = 256,
    batch_size: int = 32,
    shuffle: bool = True,
    seed: int | None = None,
    cache: bool = True,
    sample_weight: bool = False,
    drop_remainder: bool = False,
    document_tokens: bool = False,
    stride: int | None = None,
) -> tf.data.Dataset:
    """Batches of `(inputs, targets)` windows of a token stream.

    The texts are concatenated as they are (give them a lossless tokenizer,
    `train_subword_vocabulary(..., lossless=True)`, so that newlines are
    tokens) and tokenized in the graph line by line. The token stream
    `t[0], t[1], ..., t[n-1]` is cut into windows of `sequence_length + 1`
    tokens overlapping by one, `inputs = t[kL : kL+L]` and
    `targets = t[kL+1 : kL+L+1]`, so every token after the first is a target
    exactly once and the targets cover every character of the text once,
    which is what bits per character needs: `sum(loss over targets) / ln 2 /
    sum(len(text))`. The last window is padded with `PAD_ID` (0) inputs and
    targets; the loss must ignore target 0 (see the module doc).

    In these windows the first target of a window is predicted from one
    token, the last from `L`: about `L / 2` tokens of context on average.
    For evaluation, `stride=S` gives every target more: windows of `L`
    tokens start every `S` tokens, `inputs = t[kS : kS+L]`,
    `targets = t[kS+1 : kS+L+1]`, and every window after the first scores
    only its last `S` targets (its first `L - S` targets, already scored by
    the window before, are set to `PAD_ID`). So every target is still scored
    exactly once (bits per character as above) and every target after the
    first window sees at least `L - S` tokens of context; the windows stop
    at the first one that reaches the end of the stream, which is padded
    like the last window above. That is about `L / S` times the windows (and
    the compute) of `stride=None`; `stride=L` gives exactly the windows of
    `stride=None`. With a stride, the whole token stream is tokenized once
    when the dataset is built, and the dataset's `cardinality()` is known.

    Args:
        texts: a string, a `Document`, or a sequence of them (e.g. a split of
            `load_shakespeare()`).
        tokenizer: the tokenizer (lossless).
        sequence_length: tokens per window, `L`.
        batch_size: windows per batch.
        shuffle: reshuffle the windows every epoch.
        seed: shuffle seed.
        cache: keep the windows in memory after the first epoch.
        sample_weight: also yield `float32` weights, 0.0 on padded targets.
        drop_remainder: drop a last batch smaller than `batch_size`.
        document_tokens: put `START_ID` before and `END_ID` after each text /
            `Document` in the stream, so that a model learns how texts begin
            and end (what a `score` of "the text given the start token, end
            token included" needs).
        stride: `None` (default): windows that do not overlap. Or an int `S`
            from 1 to `sequence_length`: a window every `S` tokens, scoring
            its last `S` targets (strided evaluation, see above).

    Returns:
        A `tf.data.Dataset` of `int32` `([batch, L], [batch, L])`.
    """
    lines, starts, ends = _lines_with_boundaries(texts)
    _check_lengths(batch_size=batch_size, sequence_length=sequence_length)
    if stride is not None and (
        isinstance(stride, bool)
        or not isinstance(stride, int)
        or not 1 <= stride <= sequence_length
    ):
        raise ValueError(
            "`stride` must be None or an int from 1 to `sequence_length` "
            f"({sequence_length}). Received: {stride=}"
        )
    length = sequence_length

    def tokenize(line_batch, starts, ends):
        ids = tokenizer.tokenize(line_batch)  # (lines, None)
        if document_tokens:
            # START before each document's first line, END after its last.
            before = tf.RaggedTensor.from_row_lengths(
                tf.fill([tf.reduce_sum(tf.cast(starts, tf.int32))], START_ID),
                tf.cast(starts, tf.int64),
            )
            after = tf.RaggedTensor.from_row_lengths(
                tf.fill([tf.reduce_sum(tf.cast(ends, tf.int32))], END_ID),
                tf.cast(ends, tf.int64),
            )
            ids = tf.concat([before, ids, after], axis=1)
        return ids.flat_values  # (tokens,)

    chunks = (
        tf.data.Dataset.from_tensor_slices(
            (tf.constant(lines, tf.string), tf.constant(starts), tf.constant(ends))
        )
        .batch(TOKENIZE_BATCH)
        .map(tokenize, num_parallel_calls=AUTOTUNE, deterministic=True)
    )
    if stride is not None:
        dataset = _strided_windows(chunks, length, stride)
    else:
        dataset = _cut_windows(chunks, length)
    dataset = dataset.map(
        lambda inputs, targets: (
            tf.ensure_shape(inputs, [length]),
            tf.ensure_shape(targets, [length]),
        )
    )
    if cache:
        dataset = dataset.cache()
    if shuffle:
        # Windows are small: the buffer holds up to 100k (about 100 MB at L=256).
        dataset = dataset.shuffle(100_000, seed=seed, reshuffle_each_iteration=True)
    dataset = dataset.batch(batch_size, drop_remainder=drop_remainder)
    if sample_weight:
        dataset = dataset.map(
            lambda inputs, targets: (
                inputs,
                targets,
                tf.cast(targets != PAD_ID, tf.float32),
            )
        )
    return prefetch_untuned(dataset)


def _cut_windows(chunks, length):
    """Non-overlapping `(inputs, targets)` windows of the token chunks, cut
    as the chunks stream by (`language_model_dataset` with `stride=None`)."""
    # A last, empty chunk flagged `True` flushes the final partial window.
    chunks = chunks.map(lambda tokens: (tokens, False)).concatenate(
        tf.data.Dataset.from_tensors((tf.zeros([0], tf.int32), True))
    )
    empty = tf.zeros([0], tf.int32)

    def cut_windows(state, chunk):
        carried, inputs_rest, targets_rest = state
        tokens, last = chunk
        # Pair each token with the next one, across chunk boundaries.
        stream = tf.concat([carried, tokens], axis=0)
        inputs = tf.concat([inputs_rest, stream[:-1]], axis=0)
        targets = tf.concat([targets_rest, stream[1:]], axis=0)
        carried = tf.cond(tf.size(stream) > 0, lambda: stream[-1:], lambda: carried)
        count = tf.size(inputs)
        full = count // length
        # On the last chunk, pad the remainder up to one more window.
        padding = tf.where(last & (count % length > 0), length - count % length, 0)
        inputs = tf.pad(inputs, [[0, padding]])
        targets = tf.pad(targets, [[0, padding]])
        windows = full + tf.cast(padding > 0, tf.int32)
        cut = windows * length
        emitted = (
            tf.reshape(inputs[:cut], [-1, length]),  # (windows, L)
            tf.reshape(targets[:cut], [-1, length]),  # (windows, L)
        )
        return (carried, inputs[cut:], targets[cut:]), emitted

    return chunks.scan((empty, empty, empty), cut_windows).unbatch()


def _strided_windows(chunks, length, stride):
    """Windows of `length` tokens every `stride` tokens, each after the first
    scoring only its last `stride` targets (`language_model_dataset` with a
    stride). The token stream is tokenized once, here."""
    tokens = np.concatenate([np.zeros([0], np.int32), *chunks.as_numpy_iterator()])
    pairs = max(tokens.size - 1, 0)  # (input, target) pairs: t[j], t[j+1]
    # The fewest windows whose last one reaches the last pair,
    # (windows - 1) * stride + length >= pairs (`-(-a // b)`: a / b rounded up).
    windows = 0 if pairs == 0 else 1 + max(0, -(-(pairs - length) // stride))
    padded = (windows - 1) * stride + length if windows else 0  # >= pairs
    inputs = np.full([padded], PAD_ID, np.int32)  # (padded,)
    targets = np.full([padded], PAD_ID, np.int32)  # (padded,)
    inputs[:pairs], targets[:pairs] = tokens[:-1], tokens[1:]
    inputs, targets = tf.constant(inputs), tf.constant(targets)
    positions = tf.range(length)

    def window(index):
        start = tf.cast(index, tf.int32) * stride
        # The first `length - stride` targets of every window but the first
        # were the last targets of the window before: not scored again.
        scored = positions >= tf.where(index > 0, length - stride, 0)  # (L,)
        return (
            inputs[start : start + length],  # (L,)
            tf.where(scored, targets[start : start + length], PAD_ID),  # (L,)
        )

    return tf.data.Dataset.range(windows).map(window)


def _unzip_pairs(pairs):
    if not pairs:
        raise ValueError("`pairs` is empty: there is nothing to batch.")
    try:
        sources = [source for source, _ in pairs]
        targets = [target for _, target in pairs]
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"`pairs` must hold (source, target) strings: {error}"
        ) from error
    if not all(isinstance(text, str) for text in sources + targets):
        raise ValueError("`pairs` must hold (source, target) strings.")
    return tf.constant(sources, tf.string), tf.constant(targets, tf.string)


def _lines_with_boundaries(texts):
    """`_lines(texts)`, and whether each line opens / closes its text."""
    lines = _lines(texts)  # validates, and raises on all-empty input
    if isinstance(texts, (str, Document)):
        texts = [texts]
    starts, ends = [], []
    for text in texts:
        text = text.text if isinstance(text, Document) else text
        count = sum(1 for line in re.split(r"(?<=\n)", text) if line)
        starts += [index == 0 for index in range(count)]
        ends += [index == count - 1 for index in range(count)]
    return lines, starts, ends


def _lines(texts) -> list[str]:
    if isinstance(texts, (str, Document)):
        texts = [texts]
    lines = []
    for text in texts:
        if isinstance(text, Document):
            text = text.text
        if not isinstance(text, str):
            raise TypeError(
                f"`texts` must hold strings or Documents. Received: {type(text)}"
            )
        # Each line keeps its "\n"; joining them gives the text back exactly.
        lines.extend(line for line in re.split(r"(?<=\n)", text) if line)
    if not "".join(lines).strip():
        raise ValueError("`texts` is empty: there is no text to model.")
    return lines


def _check_lengths(**values):
    for name, value in values.items():
        v.check_positive_int(name, value)
