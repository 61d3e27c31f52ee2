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
the window are chosen on held-out text.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from keras import ops

from keras_attn import _validation as v
from keras_attn.ops.softmax import masked_softmax


def continuous_cache_probabilities(
    query_states,
    memory_states,
    memory_next_ids,
    target_ids,
    memory_mask,
    theta: float,
):
    """The cache's probability of each query's target token.

    Backend tensors, eager or in a graph; leading batch dimensions `...` are
    optional (a TF Serving export scores a batch of texts at once).

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
    document_ids,
    *,
    theta: float,
    window: int | None = None,
    chunk_size: int = 512,
):
    """The cache's probability of every target of a token stream.

    Position `t` of the stream holds the model's hidden state `states[t]` and
    the token it predicts `target_ids[t]`. Its cache holds the positions
    `i < t` of the same document (`document_ids[i] == document_ids[t]`), the
    last `window` of them (`None`: all of them).

    The stream is processed in chunks of `chunk_size` queries, each against
    the memory it can see: the cost is `O(T * window * d)`, the memory
    `O(chunk_size * (window + chunk_size))`, where `window=None` counts as the
    longest document (a play of 60k tokens: about 120 MB of float32 scores per
    chunk of 512; give a window, or a smaller chunk, for book-length
    documents). The probabilities do not depend
    on the mixture's weight, so one pass serves every `lam` tried
    (`continuous_cache_mixture`).

    Args:
        states: `(T, d)` float hidden states (the model's last, after its final
            norm: what its output projection sees).
        target_ids: `(T,)` int.
        document_ids: `(T,)` int, non-decreasing: the cache never crosses a
            change of document.
        theta: flatness of the cache's softmax, > 0.
        window: positions remembered, or None for the whole document so far.
        chunk_size: queries per chunk.

    Returns:
        `(cache_probabilities, has_memory)`: `(T,)` float32 and `(T,)` bool
        numpy arrays (a document's first position has no memory).
    """
    v.check_positive_float("theta", theta)
    v.check_positive_int("window", window, allow_none=True)
    v.check_positive_int("chunk_size", chunk_size)
    states = np.asarray(states)
    target_ids = np.asarray(target_ids)
    document_ids = np.asarray(document_ids)
    length = len(target_ids)
    for name, array in (("states", states), ("document_ids", document_ids)):
        if len(array) != length:
            raise ValueError(
                f"`{name}` must have one row per target ({length}). "
                f"Received: {name}.shape={array.shape}"
            )
    if length and np.any(np.diff(document_ids) < 0):
        raise ValueError("`document_ids` must be non-decreasing along the stream.")
    # The first position of each position's document.
    is_start = np.concatenate([[True], document_ids[1:] != document_ids[:-1]])
    document_start = np.maximum.accumulate(np.where(is_start, np.arange(length), 0))
    probabilities, memory = [], []
    for start in range(0, length, chunk_size):
        stop = min(length, start + chunk_size)
        first = int(document_start[start])
        if window is not None:
            first = max(first, start - window)
        query_positions = np.arange(start, stop)[:, None]  # (C, 1)
        memory_positions = np.arange(first, stop)[None, :]  # (1, K)
        same_document = (
            document_ids[first:stop][None, :] == document_ids[start:stop][:, None]
        )
        memory_mask = (memory_positions < query_positions) & same_document  # (C, K)
        if window is not None:
            memory_mask &= memory_positions >= query_positions - window
        chunk_probabilities, has_memory = continuous_cache_probabilities(
            states[start:stop],
            states[first:stop],
            target_ids[first:stop],
            target_ids[start:stop],
            memory_mask,
            theta,
        )
        probabilities.append(ops.convert_to_numpy(chunk_probabilities))
        memory.append(ops.convert_to_numpy(has_memory))
    if not probabilities:
        return np.zeros((0,), "float32"), np.zeros((0,), bool)
    return np.concatenate(probabilities), np.concatenate(memory)


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
    document_ids,
    *,
    theta: float,
    lam: float,
    window: int | None = None,
    chunk_size: int = 512,
):
    """Log-probabilities of a token stream's targets under model + cache.

    `continuous_cache_stream_probabilities` then `continuous_cache_mixture`;
    `model_log_probs[t]` is the model's `log p(target_ids[t])`. Returns a
    `(T,)` float32 numpy array.
    """
    if len(np.asarray(model_log_probs)) != len(np.asarray(target_ids)):
        raise ValueError(
            f"`model_log_probs` must have one row per target ({len(target_ids)}). "
            f"Received: model_log_probs.shape={np.shape(model_log_probs)}"
        )
    cache_probabilities, has_memory = continuous_cache_stream_probabilities(
        states,
        target_ids,
        document_ids,
        theta=theta,
        window=window,
        chunk_size=chunk_size,
    )
    return ops.convert_to_numpy(
        continuous_cache_mixture(model_log_probs, cache_probabilities, has_memory, lam)
    )


@dataclasses.dataclass(frozen=True)
class ContinuousCache:
    """A continuous cache's settings, checked once: what
    `keras_attn.export.export_language_model(..., continuous_cache=)` puts in
    an export's `score` signature.

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

    def log_probs(self, states, target_ids, model_log_probs, document_ids):
        """`continuous_cache_log_probs` with these settings."""
        return continuous_cache_log_probs(
            states,
            target_ids,
            model_log_probs,
            document_ids,
            theta=self.theta,
            lam=self.lam,
            window=self.window,
        )
