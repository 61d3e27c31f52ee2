"""Attention given scores or projected heads: the explicit and the fused path.

Shapes follow `keras.ops.dot_product_attention`: heads are `(B, T, N, H)`
(batch, time, heads, head size) and masks broadcast to `(B, N, Tq, Tk)`.
"""

from __future__ import annotations

import math

import keras
from keras import ops

from keras_attn.ops.softmax import masked_softmax


def weighted_sum(weights, value):
    """Context vectors `Σ_k weights[q, k] · value[k]`.

    `(..., Tq, Tk), (..., Tk, dv) -> (..., Tq, dv)`; weights are cast to the
    value's dtype.
    """
    value = ops.convert_to_tensor(value)
    return ops.matmul(ops.cast(weights, value.dtype), value)


def _has_fused_kernel() -> bool:
    """Whether `keras.ops.dot_product_attention` is the better path here.

    On JAX and PyTorch it dispatches to XLA/cuDNN/flash kernels that compute
    the logits in float32. The TensorFlow backend has no fused kernel: it runs
    einsums over the `(B, T, N, H)` layout (and float16 logits in float16,
    which can overflow); the explicit path's two batched matmuls over
    `(B, N, T, H)` are faster, so TensorFlow always takes the explicit path.
    """
    return keras.backend.backend() != "tensorflow"


def _rows_with_keys(mask):
    """`(B|1, N|1, Tq|1, 1)` bool: whether each query row has a valid key."""
    return ops.any(mask, axis=-1, keepdims=True)


def dot_product_attention(
    query,
    key,
    value,
    mask=None,
    scale=None,
    return_weights: bool = False,
    dropout_rate: float = 0.0,
    training: bool = False,
    seed_generator=None,
):
    """Scaled dot-product attention over heads, fused when possible.

    `softmax(q kᵀ · scale) v` (Vaswani et al. 2017), with the softmax in
    float32 and a finite mask value. A query row whose keys are all masked gets
    all-zero weights and a zero output on both paths.

    The fused `keras.ops.dot_product_attention` path is taken when no weights
    are asked for and no dropout is active; otherwise the explicit path
    materialises the weights. The two paths agree (tested).

    Args:
        query: `(B, Tq, N, H)`.
        key: `(B, Tk, N, H)`.
        value: `(B, Tk, N, Hv)`.
        mask: optional boolean tensor broadcastable to `(B, N, Tq, Tk)`, `True`
            for query-key pairs that take part.
        scale: multiplier of the logits; `1/sqrt(H)` by default.
        return_weights: also return the weights `(B, N, Tq, Tk)`.
        dropout_rate: dropout on the weights when `training`.
        training: whether dropout is active.
        seed_generator: a `keras.random.SeedGenerator` for the dropout.

    Returns:
        `outputs` `(B, Tq, N, Hv)`, or `(outputs, weights)` with
        `return_weights=True`; both in the dtype of `value`.
    """
    query = ops.convert_to_tensor(query)
    key = ops.convert_to_tensor(key)
    value = ops.convert_to_tensor(value)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    if mask is not None:
        mask = ops.convert_to_tensor(mask)
        if mask.dtype != "bool":
            mask = ops.not_equal(mask, 0)
    dropout_active = bool(training) and dropout_rate > 0.0
    # jax.nn.dot_product_attention needs value heads as wide as key heads.
    same_head_dims = value.shape[-1] == key.shape[-1]
    if (
        not return_weights
        and not dropout_active
        and same_head_dims
        and _has_fused_kernel()
    ):
        outputs = ops.dot_product_attention(
            query, key, value, mask=mask, scale=scale
        )  # (B, Tq, N, Hv)
        if mask is not None:
            has_keys = ops.transpose(_rows_with_keys(mask), (0, 2, 1, 3))
            # (B|1, Tq|1, N|1, 1): zero the rows that had nothing to attend to.
            outputs = ops.where(has_keys, outputs, ops.zeros_like(outputs))
        return outputs

    logits_dtype = "float32" if query.dtype == "float16" else query.dtype
    # Batched matmuls over (B, N, T, H): the heads move next to the batch
    # once, and the backward pass transposes no (Tq, Tk) tensor.
    query = ops.transpose(ops.cast(query, logits_dtype), (0, 2, 1, 3))  # (B, N, Tq, H)
    key = ops.transpose(ops.cast(key, logits_dtype), (0, 2, 3, 1))  # (B, N, H, Tk)
    query = ops.multiply(query, ops.cast(scale, logits_dtype))
    logits = ops.matmul(query, key)  # (B, N, Tq, Tk)
    weights = masked_softmax(logits, mask)  # float32 (B, N, Tq, Tk)
    weights = ops.cast(weights, value.dtype)
    attended = weights
    if dropout_active:
        attended = keras.random.dropout(weights, rate=dropout_rate, seed=seed_generator)
    value = ops.transpose(value, (0, 2, 1, 3))  # (B, N, Tk, Hv)
    outputs = ops.matmul(attended, value)  # (B, N, Tq, Hv)
    outputs = ops.transpose(outputs, (0, 2, 1, 3))  # (B, Tq, N, Hv)
    if return_weights:
        return outputs, weights
    return outputs
