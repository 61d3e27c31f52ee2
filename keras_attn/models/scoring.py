"""How `TransformerLanguageModel` scores text: the log-likelihood of token
ids in sliding windows (`score_ids`, with a continuous cache or not) and
the log-probabilities of a dataset stream (`stream_log_probs`). `keras.ops`
throughout: the windows run eagerly and inside the TF Serving export's
graph. Imports no TensorFlow."""

from __future__ import annotations

import numpy as np
from keras import ops

from keras_attn._loops import map_chunks
from keras_attn.models._task import PAD_ID, START_ID


def windowed_log_likelihood(model, token_ids, context: int, continuous_cache=None):
    """`model.score_ids` of checked arguments: the dict of `(B,)` tensors
    `log_likelihood`, `num_tokens` and, with a cache,
    `model_log_likelihood`, of rows `[START, ..., END]` scored in windows of
    `context` inputs (fewer when the rows are narrower) every
    `context // 2` positions, each target once."""
    sequence = ops.cast(ops.convert_to_tensor(token_ids), "int32")  # (B, L)
    batch, longest = ops.shape(sequence)[0], ops.shape(sequence)[1]
    # When one window holds every target, it is as wide as the batch, not
    # the whole context: the model is causal, so the targets' scores do
    # not change, and short texts cost their own length. At least 2: a
    # softmax over one key draws a warning from Keras.
    if isinstance(longest, int):  # a static length: Python arithmetic
        context = min(context, max(longest - 1, 2))
        stride = context // 2
        windows = 1 + max(0, longest - 1 - context + stride - 1) // stride
    else:  # a traced width (the export's signature): the same, as tensors
        context = ops.minimum(context, ops.maximum(longest - 1, 2))
        stride = context // 2
        windows = 1 + ops.maximum(0, longest - 1 - context + stride - 1) // stride
    num_tokens = ops.sum(ops.cast(sequence != PAD_ID, "int32"), axis=1) - 1
    padded_length = (windows - 1) * stride + context + 1
    sequence = ops.pad(sequence, [[0, 0], [0, padded_length - longest]])

    def window(index):
        begin = index * stride
        inputs = ops.slice(sequence, [0, begin], [batch, context])  # (B, C)
        targets = ops.slice(sequence, [0, begin + 1], [batch, context])
        states, logits = model.call_with_states(inputs)
        log_probs = ops.log_softmax(ops.cast(logits, "float32"), axis=-1)
        picked = ops.take_along_axis(log_probs, targets[..., None], axis=-1)
        return picked[..., 0], ops.cast(states, "float32")  # (B, C), (B, C, d)

    init = (
        ops.zeros((batch, context), "float32"),
        ops.zeros((batch, context, model.embedding_dim), "float32"),
    )
    picked, states = map_chunks(window, windows, init)  # (W, B, C[, d])

    def scored(chunks):
        # Window 0 scores all its targets, each later one its last `stride`.
        rest = ops.swapaxes(chunks[1:, :, context - stride :], 0, 1)
        # An explicit length: -1 would be 0 for an empty batch.
        rest = ops.reshape(rest, (batch, (windows - 1) * stride, *chunks.shape[3:]))
        return ops.concatenate([chunks[0], rest], axis=1)  # (B, T, ...)

    model_log_probs = scored(picked)  # (B, T): T = padded_length - 1
    targets = sequence[:, 1:]
    valid = targets != PAD_ID
    model_log_likelihood = ops.sum(ops.where(valid, model_log_probs, 0.0), axis=1)
    if continuous_cache is None:
        return {"log_likelihood": model_log_likelihood, "num_tokens": num_tokens}
    log_probs = continuous_cache.log_probs(
        scored(states), targets, model_log_probs, valid=valid, chunk_size=128
    )
    return {
        "log_likelihood": ops.sum(ops.where(valid, log_probs, 0.0), axis=1),
        "model_log_likelihood": model_log_likelihood,
        "num_tokens": num_tokens,
    }


def stream_log_probs(model, dataset, states: bool, verbose: int, title: str) -> dict:
    """`model.stream_log_probs`: the log-probability of every non-padding
    target of a dataset of `(inputs, targets)` windows, in stream order
    (NumPy: `log_probs`, `targets`, `inputs`, `document_ids`, with
    `states=True` `states`)."""
    from keras_attn._progress import progress_bar

    batches = int(dataset.cardinality()) if hasattr(dataset, "cardinality") else -1
    progress = progress_bar(title, batches if batches >= 0 else None, verbose)
    columns = {"log_probs": [], "targets": [], "inputs": [], "states": []}
    for step, (inputs, targets) in enumerate(dataset, start=1):
        hidden, logits = model.call_with_states(inputs, training=False)
        log_probs = ops.log_softmax(ops.cast(logits, "float32"), axis=-1)
        targets = np.asarray(targets)
        picked = ops.take_along_axis(
            log_probs, ops.convert_to_tensor(targets)[..., None], axis=-1
        )[..., 0]
        valid = targets != PAD_ID  # (B, L); padding is not scored
        columns["log_probs"].append(np.asarray(ops.convert_to_numpy(picked))[valid])
        columns["targets"].append(targets[valid])
        columns["inputs"].append(np.asarray(inputs)[valid])
        if states:
            columns["states"].append(
                np.asarray(ops.convert_to_numpy(ops.cast(hidden, "float32")))[valid]
            )
        progress.update(step)
    if not columns["targets"]:
        raise ValueError("`dataset` must yield at least one batch. Received: none")
    found = {name: np.concatenate(parts) for name, parts in columns.items() if parts}
    found["document_ids"] = np.cumsum(found["inputs"] == START_ID)
    return found
