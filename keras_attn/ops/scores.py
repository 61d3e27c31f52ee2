"""Attention score functions as pure functions of tensors and weights.

Every function maps a query `(..., Tq, dq)` and keys `(..., Tk, dk)` to scores
`(..., Tq, Tk)`; the leading (batch) dimensions must match. Weights are plain
tensors passed in, so the layers around these functions stay thin and the
functions can be tested against the papers' formulas directly.

| name        | formula                                | paper            |
|-------------|----------------------------------------|------------------|
| dot         | `qᵀ k`                                 | Luong et al. 2015 |
| scaled dot  | `qᵀ k / sqrt(d)`                       | Vaswani et al. 2017 |
| general     | `qᵀ W k`                               | Luong et al. 2015 |
| concat      | `vᵀ tanh(W [q; k])`                    | Luong et al. 2015 |
| additive    | `vᵀ tanh(W_q q + W_k k + b)`           | Bahdanau et al. 2015 |

Dot-product scores of float16 inputs are computed in float32: float16 tops out
at 65504, which a product of two large activations can pass. bfloat16 shares
float32's range and stays in bfloat16 (the fast path on CPUs with AMX-BF16).
"""

from __future__ import annotations

import math

import keras
from keras import ops


def _dot_dtype(*tensors):
    """float32 when any input is float16 (overflow-prone), else `None`."""
    for tensor in tensors:
        if tensor is None:
            continue
        dtype = ops.convert_to_tensor(tensor).dtype
        if keras.backend.standardize_dtype(dtype) == "float16":
            return "float32"
    return None


def _check_last_dims(query, key, what):
    dq, dk = query.shape[-1], key.shape[-1]
    if dq is not None and dk is not None and dq != dk:
        raise ValueError(
            f"The {what} score needs query and key of the same last dimension. "
            f"Received: query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)}"
        )


def dot_score(query, key):
    """Luong's dot score `qᵀ k`: `(..., Tq, d), (..., Tk, d) -> (..., Tq, Tk)`."""
    query = ops.convert_to_tensor(query)
    key = ops.convert_to_tensor(key)
    _check_last_dims(query, key, "dot")
    dtype = _dot_dtype(query, key)
    if dtype is not None:
        query, key = ops.cast(query, dtype), ops.cast(key, dtype)
    return ops.matmul(query, ops.swapaxes(key, -1, -2))  # (..., Tq, Tk)


def scaled_dot_score(query, key, scale=None):
    """Vaswani's scaled dot score `qᵀ k · scale`, `scale = 1/sqrt(d)` by default.

    The query is scaled before the product, which keeps the intermediate
    values small in low precision.
    """
    query = ops.convert_to_tensor(query)
    key = ops.convert_to_tensor(key)
    _check_last_dims(query, key, "scaled dot")
    if scale is None:
        depth = query.shape[-1]
        if depth is None:
            raise ValueError(
                "`scale` must be given when the query's last dimension is "
                f"unknown. Received: query.shape={tuple(query.shape)}"
            )
        scale = 1.0 / math.sqrt(depth)
    dtype = _dot_dtype(query, key)
    if dtype is not None:
        query, key = ops.cast(query, dtype), ops.cast(key, dtype)
    query = ops.multiply(query, ops.cast(scale, query.dtype))
    return ops.matmul(query, ops.swapaxes(key, -1, -2))  # (..., Tq, Tk)


def general_score(query, key, kernel):
    """Luong's general (bilinear) score `qᵀ W k`, `W` of shape `(dq, dk)`."""
    query = ops.convert_to_tensor(query)
    key = ops.convert_to_tensor(key)
    kernel = ops.convert_to_tensor(kernel)
    dtype = _dot_dtype(query, key, kernel)
    if dtype is not None:
        query, key, kernel = (ops.cast(t, dtype) for t in (query, key, kernel))
    projected_query = ops.matmul(query, ops.cast(kernel, query.dtype))  # (..., Tq, dk)
    return dot_score(projected_query, key)


def additive_score_from_projections(projected_query, projected_key, v, bias=None):
    """`vᵀ tanh(pq + pk + b)` for already projected queries and keys.

    Args:
        projected_query: `(..., Tq, units)`, e.g. `W_q q`.
        projected_key: `(..., Tk, units)`, e.g. `W_k k`; in a decoder loop this
            is computed once per source sentence.
        v: `(units,)`.
        bias: optional `(units,)`.

    Returns:
        `(..., Tq, Tk)` scores.
    """
    hidden = ops.expand_dims(projected_query, -2) + ops.expand_dims(
        projected_key, -3
    )  # (..., Tq, Tk, units)
    if bias is not None:
        hidden = hidden + ops.cast(bias, hidden.dtype)
    return ops.tensordot(ops.tanh(hidden), ops.cast(v, hidden.dtype), axes=1)


def additive_score(query, key, query_kernel, key_kernel, v, bias=None):
    """Bahdanau's additive score `vᵀ tanh(W_q q + W_k k + b)`.

    Args:
        query: `(..., Tq, dq)`.
        key: `(..., Tk, dk)`.
        query_kernel: `W_q`, `(dq, units)`.
        key_kernel: `W_k`, `(dk, units)`.
        v: `(units,)`.
        bias: optional `b`, `(units,)`.
    """
    query = ops.convert_to_tensor(query)
    key = ops.convert_to_tensor(key)
    projected_query = ops.matmul(query, ops.cast(query_kernel, query.dtype))
    projected_key = ops.matmul(key, ops.cast(key_kernel, key.dtype))
    return additive_score_from_projections(projected_query, projected_key, v, bias)


def concat_score(query, key, kernel, v):
    """Luong's concat score `vᵀ tanh(W [q; k])`, `W` of shape `(dq + dk, units)`.

    `W [q; k]` equals `W_q q + W_k k` with `W` split row-wise, which avoids
    materialising the `(Tq, Tk, dq + dk)` concatenation.
    """
    query = ops.convert_to_tensor(query)
    key = ops.convert_to_tensor(key)
    dq, dk = query.shape[-1], key.shape[-1]
    rows = kernel.shape[0]
    if dq is not None and dk is not None and rows is not None and rows != dq + dk:
        raise ValueError(
            "The concat score's kernel must have dq + dk rows. Received: "
            f"kernel.shape={tuple(kernel.shape)}, query.shape={tuple(query.shape)}, "
            f"key.shape={tuple(key.shape)}"
        )
    return additive_score(query, key, kernel[:dq], kernel[dq:], v)
