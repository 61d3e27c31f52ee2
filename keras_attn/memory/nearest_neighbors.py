"""Nearest-neighbour next-token distributions (kNN-LM / kNN-MT).

Khandelwal et al., "Generalization through Memorization: Nearest Neighbor
Language Models" (ICLR 2020) and "Nearest Neighbor Machine Translation"
(ICLR 2021). A datastore holds, for every target position of a training
corpus, the model's last hidden state (the key) and the token that came next
(the value). At decoding time the current hidden state looks up its `k`
nearest keys by squared Euclidean distance, and their values get
`softmax(-distance / temperature)`:

    p_knn(w | h) = sum_{i in kNN(h), v_i = w} softmax_i(-||h - k_i||^2 / T)
    p(w) = (1 - lambda) * p_model(w) + lambda * p_knn(w)

The search is exact (a matrix product against every key), in chunks of keys so
that the memory stays bounded: fine for datastores of a few hundred thousand
keys, which is what a corpus of sentence pairs gives.
"""

from __future__ import annotations

import math

from keras import ops

from keras_attn import _validation as v


def nearest_neighbors(
    queries, keys, k: int, key_chunk_size: int = 65536, key_norms=None
):
    """The `k` keys nearest to each query, by squared Euclidean distance.

    Exact. Each chunk of keys is scored with one matrix product and a
    `top_k`; the chunks' nearest are merged as the search goes.

    Args:
        queries: `(Q, d)` float.
        keys: `(K, d)` float. float32 keys (or float64) are searched exactly,
            in float32. bfloat16 or float16 keys are multiplied with the
            queries in that dtype: half the memory and bandwidth, about
            twice as fast on CPUs with bfloat16 instructions (bfloat16) and on
            GPUs, with distances rounded to that dtype's precision (the rest,
            norms and selection, stays in float32).
        k: neighbours per query, `1 <= k <= K`.
        key_chunk_size: keys scored at once (memory `Q * key_chunk_size`).
        key_norms: optional `(K,)` float32 squared norms of `keys`
            (`sum(keys**2, -1)`), when they are kept with a datastore that is
            searched many times; computed here otherwise.

    Returns:
        `(distances, indices)`: `(Q, k)` float32 squared distances, nearest
        first, and `(Q, k)` int32 rows of `keys`.
    """
    v.check_positive_int("k", k)
    v.check_positive_int("key_chunk_size", key_chunk_size)
    v.check_rank("queries", queries.shape, 2)
    v.check_rank("keys", keys.shape, 2)
    if not v.same_dim(queries.shape[-1], keys.shape[-1]):
        raise ValueError(
            "`queries` and `keys` must have the same last dimension. Received: "
            f"queries.shape={tuple(queries.shape)}, keys.shape={tuple(keys.shape)}"
        )
    num_keys = keys.shape[0]
    if num_keys is not None and k > num_keys:
        raise ValueError(
            f"`k` must be at most the number of keys ({num_keys}). Received: k={k}"
        )
    if key_norms is not None and tuple(key_norms.shape) != (num_keys,):
        raise ValueError(
            f"`key_norms` must have one entry per key ({num_keys}). "
            f"Received: key_norms.shape={tuple(key_norms.shape)}"
        )
    queries = ops.cast(queries, "float32")
    query_norms = ops.sum(ops.square(queries), axis=-1, keepdims=True)  # (Q, 1)
    product_dtype = _product_dtype(keys.dtype)
    product_queries = ops.cast(queries, product_dtype)
    best_distances, best_indices = None, None
    for start in range(0, num_keys, key_chunk_size):
        chunk = ops.cast(keys[start : start + key_chunk_size], product_dtype)  # (C, d)
        chunk_norms = (
            ops.sum(ops.square(ops.cast(chunk, "float32")), axis=-1)
            if key_norms is None
            else ops.cast(key_norms[start : start + key_chunk_size], "float32")
        )
        products = ops.matmul(product_queries, ops.transpose(chunk))
        distances = (
            query_norms - 2.0 * ops.cast(products, "float32") + chunk_norms[None, :]
        )  # (Q, C)
        chunk_k = min(k, chunk.shape[0])
        negative, indices = ops.top_k(-distances, k=chunk_k, sorted=True)
        indices = ops.cast(indices, "int32") + start
        if best_distances is None:
            best_distances, best_indices = -negative, indices
            continue
        merged_distances = ops.concatenate([best_distances, -negative], axis=1)
        merged_indices = ops.concatenate([best_indices, indices], axis=1)
        keep = min(k, merged_distances.shape[1])
        negative, pick = ops.top_k(-merged_distances, k=keep, sorted=True)
        best_distances = -negative
        best_indices = ops.take_along_axis(merged_indices, pick, axis=1)
    # Rounding can leave a tiny negative distance for a query equal to a key.
    return ops.maximum(best_distances, 0.0), best_indices


def _product_dtype(dtype) -> str:
    """The dtype of the query-key products for keys of `dtype`."""
    name = str(getattr(dtype, "name", dtype))
    return name if name in ("bfloat16", "float16") else "float32"


def knn_weights(distances, temperature: float):
    """`softmax(-distances / temperature)` over each query's neighbours."""
    v.check_positive_float("temperature", temperature)
    return ops.softmax(-ops.cast(distances, "float32") / temperature, axis=-1)


def knn_probabilities(neighbor_values, weights, vocabulary_size: int):
    """Scatter neighbour weights onto their values: `(Q, vocabulary_size)`.

    Args:
        neighbor_values: `(Q, k)` int, the value (next token) of each
            neighbour.
        weights: `(Q, k)` float, each neighbour's weight (rows sum to 1).
        vocabulary_size: the number of tokens.

    Returns:
        `(Q, vocabulary_size)` float32 probabilities (a token several
        neighbours share gets the sum of their weights).
    """
    v.check_positive_int("vocabulary_size", vocabulary_size)
    neighbor_values = ops.cast(neighbor_values, "int32")
    rows = ops.shape(neighbor_values)[0]
    segments = (
        ops.arange(rows, dtype="int32")[:, None] * vocabulary_size + neighbor_values
    )
    flat = ops.segment_sum(
        ops.reshape(ops.cast(weights, "float32"), (-1,)),
        ops.reshape(segments, (-1,)),
        num_segments=rows * vocabulary_size,
    )
    return ops.reshape(flat, (rows, vocabulary_size))


def knn_mixture_log_probs(model_log_probs, knn_probs, lam: float):
    """`log((1 - lam) p_model + lam p_knn)`, computed in log space.

    Args:
        model_log_probs: `(..., V)` float, the model's log-probabilities.
        knn_probs: `(..., V)` float, the neighbours' distribution.
        lam: the neighbours' weight in [0, 1).

    Returns:
        float32 log-probabilities of the mixture, of the same shape (a token
        the neighbours do not name keeps `log(1 - lam) + log p_model`).
    """
    lam = v.check_rate("lam", lam)
    model_part = ops.cast(model_log_probs, "float32") + math.log1p(-lam)
    if lam == 0:
        return model_part
    knn_part = math.log(lam) + ops.log(ops.cast(knn_probs, "float32"))
    return ops.logaddexp(model_part, knn_part)
