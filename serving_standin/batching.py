"""A stand-in for what TF Serving's request batching does to requests that
arrive together: the project's imitation of `BatchingSession` and
`SharedBatchScheduler` (TF Serving 2.20.0), not the server itself.

`run_batched` splits a request larger than the room left in the open batch,
concatenates the requests' inputs along the batch axis, pads the merged batch
to the next allowed batch size with copies of the first row of its last
request, runs it once, splits the outputs back and drops the padding rows,
as `BatchingSession` and `SharedBatchScheduler` do. The parameters it
follows are the exports' own (`keras_attn.export.batching.BatchingConfig`).
"""

from __future__ import annotations

import numpy as np

from keras_attn.export.batching import BatchingConfig


class BatchingError(RuntimeError):
    """A request the server's batching refuses, with the server's message."""


def run_batched(run, requests: list, config: BatchingConfig) -> list:
    """Answer `requests` that arrive together as TF Serving's batching does.

    Args:
        run: `run(feeds) -> outputs`, one call of the graph on a merged batch
            (`{input name: array}` in, `{output name: array}` out).
        requests: `{input name: array}` each, batch axis first, in arrival
            order (all for one signature).
        config: the `BatchingConfig`.

    Returns:
        One `{output name: array}` per request: the rows of the merged
        batches that are the request's.

    Raises:
        BatchingError: a request the server refuses (larger than
            `max_batch_size`; 0 rows, see below), or outputs the server could
            not split back: an output without a batch axis, or the parts of a
            split request with different shapes past the batch axis (TF
            Serving's `tensor::Concat` does not check those: the server would
            return garbled arrays or abort).

    A request of 0 rows is refused: the server pads a batch with the first row
    of its last request, which such a request does not have (send it
    unbatched, or not at all).
    """
    tasks = []  # (request index, feeds)
    for index, feeds in enumerate(requests):
        size = _batch_size(feeds)
        if size > config.max_batch_size:
            raise BatchingError(
                f"Task size {size} is larger than maximum input batch size "
                f"{config.max_batch_size}"
            )
        if size == 0:
            raise BatchingError(
                "a request of 0 rows in a batching queue (the server pads "
                "with the first row of the last request of a batch)"
            )
        tasks.append((index, feeds, size))

    # SharedBatchScheduler: fill batches of max_execution_batch_size in
    # arrival order, splitting a task that does not fit the open batch.
    limit = config.max_execution_batch_size
    batches = [[]]
    for index, feeds, size in tasks:
        start = 0
        while start < size:
            room = limit - sum(part[2] for part in batches[-1])
            if room == 0:
                batches.append([])
                room = limit
            take = min(room, size - start)
            batches[-1].append((index, _rows(feeds, start, start + take), take))
            start += take
    parts = {index: [] for index, _, _ in tasks}
    for batch in batches:
        if not batch:
            continue
        for index, outputs in _run_merged(run, batch, config):
            parts[index].append(outputs)
    answers = []
    for index, _, _ in tasks:
        pieces = parts[index]
        merged = {}
        for name in pieces[0]:
            shapes = {piece[name].shape[1:] for piece in pieces}
            if len(shapes) > 1:
                raise BatchingError(
                    f"output {name!r} of a split request has parts of shapes "
                    f"{sorted(shapes)} past the batch axis: TF Serving's "
                    "tensor::Concat would garble or abort"
                )
            merged[name] = np.concatenate([piece[name] for piece in pieces])
        answers.append(merged)
    return answers


def _run_merged(run, batch, config):
    """BatchingSession::MergeInputTensors, Run, SplitOutputTensors."""
    size = sum(take for _, _, take in batch)
    padded = next(s for s in config.allowed_batch_sizes if s >= size)
    names = list(batch[0][1])
    merged = {}
    for name in names:
        pieces = [feeds[name] for _, feeds, _ in batch]
        shapes = {piece.shape[1:] for piece in pieces}
        if len(shapes) > 1:
            raise BatchingError(
                f"Tensors with name '{name}' from different tasks have different "
                "shapes and padding is turned off."
            )
        if padded > size:  # the first row of the last task, repeated
            pieces.append(np.repeat(pieces[-1][:1], padded - size, axis=0))
        merged[name] = np.concatenate(pieces)
    outputs = run(merged)
    split = []
    offset = 0
    for index, _, take in batch:
        rows = {}
        for name, value in outputs.items():
            value = np.asarray(value)
            if value.ndim == 0:
                raise BatchingError("Batched output tensor has 0 dimensions")
            if value.shape[0] != padded:
                raise BatchingError(
                    "Batched output tensor's 0th dimension does not equal the "
                    "sum of the 0th dimension sizes of the input tensors"
                )
            rows[name] = value[offset : offset + take]
        split.append((index, rows))
        offset += take
    return split


def _batch_size(feeds: dict) -> int:
    sizes = {np.asarray(value).shape[0] for value in feeds.values()}
    if len(sizes) != 1:
        raise BatchingError(
            "Batching Run() input tensors must have equal 0th-dimension size"
        )
    return sizes.pop()


def _rows(feeds: dict, start: int, stop: int) -> dict:
    return {name: np.asarray(value)[start:stop] for name, value in feeds.items()}
