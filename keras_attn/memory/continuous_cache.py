"""A continuous cache over a language model's past hidden states.

Grave, Joulin and Usunier, "Improving Neural Language Models with a
Continuous Cache" (ICLR 2017). The cache remembers, for each earlier position
`i` of a text, the model's last hidden state `h_i` and the token `x_{i+1}`
that followed it. At position `t` it attends from `h_t` to those states and
puts the attention weights on the tokens that followed them:

    p_cache(w | h_t) = sum_{i < t, x_{i+1} = w} softmax_i(theta * h_t . h_i)
    p(w) = (1 - lambda) * p_model(w) + lambda * p_cache(w)

It is attention whose values are one-hot next tokens, so it copies what the
text so far makes likely (the names of a play's characters, its rare words)
from further back than the model's window. It uses only the text before `t`:
the mixture is a language model in its own right, and its log-likelihood of a
text is a proper score of that text. Nothing is trained: `theta`, `lambda` and
the window are chosen on held-out text (`choose_continuous_cache`).

One implementation serves every use: `continuous_cache_stream_probabilities`
runs in `keras.ops`, in chunks of queries, on any backend, eagerly (a whole
evaluation stream) and inside a traced function (the language model's
export scores a batch of texts with it in the graph).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from keras import ops

from keras_attn import _validation as v
from keras_attn._loops import map_chunks
from keras_attn.memory.search import grid_search
from keras_attn.ops.softmax import masked_softmax


def continuous_cache_probabilities(
    query_states,
    memory_states,
    memory_next_ids,
    target_ids,
    memory_mask,
    theta: float,
):
    """The cache's probability of each query's target token, for one chunk
    of queries and the memory they may see.

    Args:
        query_states: `(..., Q, d)` hidden states, each predicting
            `target_ids[..., q]`.
        memory_states: `(..., K, d)` earlier hidden states.
        memory_next_ids: `(..., K)` int, the token that followed each memory
            state.
        target_ids: `(..., Q)` int, the token each query predicts.
        memory_mask: `(..., Q, K)` bool, True where query `q` may use memory
            `k` (its past, in its own text, inside the window).
        theta: the flatness of the cache's softmax (a float > 0).

    Returns:
        `(probabilities, has_memory)`: `(..., Q)` float32 `p_cache(target_q)`,
        and `(..., Q)` bool, whether query `q` had any memory (where it had
        none its probability is 0 and the mixture uses the model alone).
    """
    query_states = ops.cast(query_states, "float32")
    memory_states = ops.cast(memory_states, "float32")
    scores = theta * ops.matmul(
        query_states, ops.swapaxes(memory_states, -1, -2)
    )  # (..., Q, K)
    weights = masked_softmax(scores, memory_mask)  # a row with no memory: 0
    same_token = ops.equal(
        ops.expand_dims(target_ids, -1), ops.expand_dims(memory_next_ids, -2)
    )  # (..., Q, K): the memory's next token is the query's target
    probabilities = ops.sum(weights * ops.cast(same_token, "float32"), axis=-1)
    has_memory = ops.any(memory_mask, axis=-1)
    return probabilities, has_memory


def continuous_cache_stream_probabilities(
    states,
    target_ids,
    document_ids=None,
    *,
    theta: float,
    window: int | None = None,
    valid=None,
    chunk_size: int = 512,
    max_document_length: int | None = None,
):
    """The cache's probability of every target of a token stream.

    Position `t` of a stream holds the model's hidden state `states[t]` and
    the token it predicts `target_ids[t]`. Its cache holds the positions
    `i < t` of the same document (`document_ids[i] == document_ids[t]`) that
    are `valid`, the last `window` of them (`None`: all of them).

    Backend tensors or arrays, eager or inside a traced function, on any
    backend: queries go `chunk_size` at a time (one `keras.ops.scan` over the
    chunks), each chunk against the `max_document_length` (or `window`)
    positions before it, so the cost is `O(T * reach * d)` and the memory of
    one chunk `O(chunk_size * reach)`, `reach` being `window`, else
    `max_document_length`, else the stream's length (about 120 MB of float32
    scores per chunk of 512 for a reach of 60k tokens). The probabilities do
    not depend on the mixture's weight, so one pass serves every `lam` tried
    (`continuous_cache_mixture`).

    Args:
        states: `(T, d)` or a batch `(B, T, d)` of hidden states (the
            model's last, after its final norm: what its output projection
            sees).
        target_ids: `(T,)` or `(B, T)` int.
        document_ids: `(T,)` or `(B, T)` int, the document of each position
            (the cache never crosses a change of document); None: one
            document per stream.
        theta: flatness of the cache's softmax, > 0.
        window: positions remembered, or None for the whole document so far.
        valid: `(T,)` or `(B, T)` bool, False at padding (never remembered;
            its own probability is 0); None: every position.
        chunk_size: queries per chunk.
        max_document_length: the longest document's length, when known
            (eagerly, from `document_ids`): bounds how far back a chunk
            looks. None: the stream's length.

    Returns:
        `(cache_probabilities, has_memory)`: float32 and bool tensors shaped
        like `target_ids` (a document's first position has no memory).
    """
    v.check_positive_float("theta", theta)
    v.check_positive_int("window", window, allow_none=True)
    v.check_positive_int("chunk_size", chunk_size)
    v.check_positive_int("max_document_length", max_document_length, allow_none=True)
    target_ids = ops.convert_to_tensor(target_ids)
    v.check_rank("target_ids", target_ids.shape, (1, 2))
    unbatched = len(target_ids.shape) == 1
    states = ops.convert_to_tensor(states)
    v.check_rank("states", states.shape, len(target_ids.shape) + 1)
    if document_ids is None:
        document_ids = ops.zeros_like(target_ids, dtype="int32")
    if valid is None:
        valid = ops.ones_like(target_ids, dtype="bool")
    document_ids = ops.convert_to_tensor(document_ids)
    valid = ops.cast(valid, "bool")
    for name, array in (("document_ids", document_ids), ("valid", valid)):
        if not _same_shape(array.shape, target_ids.shape):
            raise ValueError(
                f"`{name}` must have the shape of `target_ids` "
                f"{tuple(target_ids.shape)}. Received: {name}.shape="
                f"{tuple(array.shape)}"
            )
    if unbatched:
        states, target_ids = states[None], target_ids[None]
        document_ids, valid = document_ids[None], valid[None]
    states = ops.cast(states, "float32")
    target_ids = ops.cast(target_ids, "int32")
    document_ids = ops.cast(document_ids, "int32")
    batch, length = ops.shape(states)[0], ops.shape(states)[1]
    if not _same_shape(target_ids.shape, states.shape[:2]):
        raise ValueError(
            "`states` must have one row per target. Received: "
            f"states.shape={tuple(states.shape)}, "
            f"target_ids.shape={tuple(target_ids.shape)}"
        )
    if isinstance(length, int) and length == 0:
        empty = ops.zeros_like(target_ids, dtype="float32")
        empty = (empty, ops.cast(empty, "bool"))
        return (empty[0][0], empty[1][0]) if unbatched else empty
    # How far back a chunk's memory reaches: the window, else the longest
    # document, else the whole stream.
    reach = window if window is not None else max_document_length
    if reach is None:
        reach = length
    elif isinstance(length, int):
        reach = min(reach, length)
    chunks = (length + chunk_size - 1) // chunk_size
    tail = chunks * chunk_size - length  # padding after the stream
    # Padded: `reach` positions before the stream (never valid), `tail` after.
    pad = [[0, 0], [reach, tail]]
    states = ops.pad(states, [*pad, [0, 0]])
    target_ids = ops.pad(target_ids, pad)
    document_ids = ops.pad(document_ids, pad)
    valid = ops.cast(ops.pad(ops.cast(valid, "int32"), pad), "bool")
    offsets = ops.arange(chunk_size, dtype="int32")  # (C,)
    memory_offsets = ops.arange(reach + chunk_size, dtype="int32")  # (R + C,)

    def chunk(index):
        # Padded coordinates: queries at reach + start ..., memory from start.
        start = ops.cast(index, "int32") * chunk_size
        query_start = start + reach

        def take(x, begin, size):
            begin = [0, begin] + [0] * (len(x.shape) - 2)
            return ops.slice(x, begin, [batch, size, *x.shape[2:]])

        queries = take(states, query_start, chunk_size)  # (B, C, d)
        memory = take(states, start, reach + chunk_size)  # (B, R + C, d)
        query_positions = offsets[:, None] + reach  # (C, 1), relative to start
        memory_positions = memory_offsets[None, :]  # (1, R + C)
        visible = memory_positions < query_positions  # (C, R + C): the past
        if window is not None:
            visible = visible & (memory_positions >= query_positions - window)
        same_document = ops.equal(
            take(document_ids, query_start, chunk_size)[:, :, None],
            take(document_ids, start, reach + chunk_size)[:, None, :],
        )  # (B, C, R + C)
        memory_mask = (
            visible[None]
            & same_document
            & take(valid, start, reach + chunk_size)[:, None, :]
        )
        probabilities, has_memory = continuous_cache_probabilities(
            queries,
            memory,
            take(target_ids, start, reach + chunk_size),
            take(target_ids, query_start, chunk_size),
            memory_mask,
            theta,
        )  # (B, C) each
        query_valid = take(valid, query_start, chunk_size)
        return (
            ops.where(query_valid, probabilities, 0.0),
            has_memory & query_valid,
        )

    zeros = ops.zeros((batch, chunk_size), "float32")
    probabilities, has_memory = map_chunks(
        chunk, chunks, (zeros, ops.cast(zeros, "bool"))
    )  # (chunks, B, C) each

    def stream(chunked):  # (chunks, B, C) -> (B, T)
        # An explicit length: -1 would be 0 for an empty batch.
        flat = ops.reshape(
            ops.transpose(chunked, (1, 0, 2)), (batch, chunks * chunk_size)
        )
        return flat[:, :length]

    probabilities, has_memory = stream(probabilities), stream(has_memory)
    if unbatched:
        return probabilities[0], has_memory[0]
    return probabilities, has_memory


def _same_shape(a, b) -> bool:
    """Static shapes that agree wherever both are known."""
    a, b = tuple(a), tuple(b)
    return len(a) == len(b) and all(v.same_dim(x, y) for x, y in zip(a, b, strict=True))


def continuous_cache_mixture(model_log_probs, cache_probabilities, has_memory, lam):
    """`log((1 - lam) p_model + lam p_cache)`, the model alone where no memory.

    Backend tensors or arrays of any (matching) shape, eager or in a graph.

    Args:
        model_log_probs: `(...)` float, the model's log-probability of each
            target.
        cache_probabilities, has_memory: from `continuous_cache_probabilities`
            or `continuous_cache_stream_probabilities`.
        lam: the cache's weight, in [0, 1).

    Returns:
        `(...)` float32 tensor of log-probabilities (computed in log space: a
        target the model gives a vanishing probability and the cache none
        stays finite).
    """
    v.check_rate("lam", lam)
    model_log_probs = ops.cast(model_log_probs, "float32")
    has_memory = ops.cast(has_memory, "bool")
    model_part = model_log_probs + ops.cast(
        ops.where(has_memory, math.log1p(-lam), 0.0), "float32"
    )
    if lam == 0:
        return model_part
    cache_part = ops.where(
        has_memory,
        math.log(lam) + ops.log(ops.cast(cache_probabilities, "float32")),
        -math.inf,
    )  # log(0) = -inf: the model alone
    return ops.logaddexp(model_part, cache_part)


def continuous_cache_log_probs(
    states,
    target_ids,
    model_log_probs,
    document_ids=None,
    *,
    theta: float,
    lam: float,
    window: int | None = None,
    valid=None,
    chunk_size: int = 512,
    max_document_length: int | None = None,
):
    """Log-probabilities of a token stream's targets under model + cache:
    `continuous_cache_stream_probabilities` then `continuous_cache_mixture`
    (`model_log_probs[..., t]` is the model's `log p(target_ids[..., t])`).
    A float32 tensor shaped like `target_ids`."""
    model_log_probs = ops.convert_to_tensor(model_log_probs)
    target_ids = ops.convert_to_tensor(target_ids)
    if not _same_shape(model_log_probs.shape, target_ids.shape):
        raise ValueError(
            "`model_log_probs` must have one entry per target "
            f"{tuple(target_ids.shape)}. Received: model_log_probs.shape="
            f"{tuple(model_log_probs.shape)}"
        )
    cache_probabilities, has_memory = continuous_cache_stream_probabilities(
        states,
        target_ids,
        document_ids,
        theta=theta,
        window=window,
        valid=valid,
        chunk_size=chunk_size,
        max_document_length=max_document_length,
    )
    return continuous_cache_mixture(
        model_log_probs, cache_probabilities, has_memory, lam
    )


@dataclasses.dataclass(frozen=True)
class ContinuousCache:
    """A continuous cache's settings, checked once: what
    `TransformerLanguageModel.score(..., continuous_cache=)` and its export's
    `score` signature mix in.

    Attributes:
        theta: the flatness of the cache's softmax (> 0).
        lam: the cache's weight in the mixture, in [0, 1).
        window: positions remembered, or None for the whole text so far.
    """

    theta: float
    lam: float
    window: int | None = None

    def __post_init__(self):
        v.check_positive_float("theta", self.theta)
        v.check_rate("lam", self.lam)
        v.check_positive_int("window", self.window, allow_none=True)

    def stream_nats(self, scores, chunk_size: int = 512) -> float:
        """The total negative log-likelihood (nats) of a scored stream under
        the model mixed with this cache: `scores` is a dict of NumPy arrays
        as `TransformerLanguageModel.stream_log_probs(..., states=True)`
        gives (`states`, `targets`, `log_probs`, `document_ids`)."""
        probabilities = stream_cache_probabilities(
            scores, self.theta, self.window, chunk_size
        )
        return total_nats(scores, probabilities, self.lam)

    def log_probs(self, states, target_ids, model_log_probs, document_ids=None, **kw):
        """`continuous_cache_log_probs` with these settings (`kw`: `valid`,
        `chunk_size`, `max_document_length`)."""
        return continuous_cache_log_probs(
            states,
            target_ids,
            model_log_probs,
            document_ids,
            theta=self.theta,
            lam=self.lam,
            window=self.window,
            **kw,
        )


def document_ids_from_starts(input_ids, start_id: int):
    """`(T,)` document ids of a stream whose documents begin with `start_id`
    (as `language_model_dataset(..., document_tokens=True)` packs them):
    the count of start tokens up to each position, as a NumPy array."""
    return np.cumsum(np.asarray(input_ids) == start_id)


def choose_continuous_cache(
    validation,
    *,
    theta=(0.025, 0.05, 0.1),
    lam=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6),
    window: int | None = None,
    chunk_size: int = 512,
    verbose: int = 0,
):
    """The cache setting with the lowest total loss on a validation stream.

    Args:
        validation: a dict of NumPy arrays of a scored stream, as
            `TransformerLanguageModel.stream_log_probs(..., states=True)`
            returns: `states` `(T, d)`, `targets`, `log_probs` and
            `document_ids` `(T,)`.
        theta, lam: the values tried (every pair); the cache's probabilities
            are computed once per `theta` and reused for every `lam`.
        window: the cache's window (None: the whole document so far).
        chunk_size: queries per chunk.
        verbose: 1 or 2 print the progress over the `theta` values.

    Returns:
        `(cache, trials)`: the best `ContinuousCache`, and one dict per
        setting tried (`theta`, `lambda`, `nats`: the validation stream's
        total negative log-likelihood under the mixture).
    """
    from keras_attn._progress import progress_bar

    progress = progress_bar(
        "Choosing the continuous cache on the validation text", len(theta), verbose
    )
    probabilities = {}

    def nats(theta, lam):
        if theta not in probabilities:
            probabilities[theta] = stream_cache_probabilities(
                validation, theta, window, chunk_size
            )
            progress.update(len(probabilities))
        return total_nats(validation, probabilities[theta], lam)

    best, trials = grid_search(nats, theta=theta, lam=lam)
    trials = [
        {"theta": t["theta"], "lambda": t["lam"], "nats": t["loss"]} for t in trials
    ]
    return ContinuousCache(best["theta"], best["lam"], window), trials


def stream_cache_probabilities(scores, theta, window=None, chunk_size=512):
    """`continuous_cache_stream_probabilities` of a scored stream (a dict of
    `states`, `targets`, `document_ids` arrays; each document contiguous),
    with the reach bounded by its longest document."""
    documents = np.asarray(scores["document_ids"])
    if len(documents) and np.any(documents[1:] != documents[:-1]):
        starts = np.flatnonzero(documents[1:] != documents[:-1]) + 1
        if len(np.unique(documents[starts])) != len(starts) or documents[0] in set(
            documents[starts]
        ):
            raise ValueError(
                "Each document of `scores` must be one contiguous run of "
                "`document_ids`. Received: a document id that comes back"
            )
    _, counts = np.unique(documents, return_counts=True)
    return continuous_cache_stream_probabilities(
        scores["states"],
        scores["targets"],
        documents,
        theta=theta,
        window=window,
        chunk_size=chunk_size,
        max_document_length=int(counts.max()) if len(counts) else None,
    )


def total_nats(scores, cache_probabilities, lam) -> float:
    """The stream's total negative log-likelihood under the mixture."""
    log_probs = continuous_cache_mixture(scores["log_probs"], *cache_probabilities, lam)
    return -float(np.sum(ops.convert_to_numpy(log_probs), dtype="float64"))
