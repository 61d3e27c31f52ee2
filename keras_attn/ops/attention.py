"""Attention given scores or projected heads: the explicit and the fused path.

Shapes follow `keras.ops.dot_product_attention`: heads are `(B, T, N, H)`
(batch, time, heads, head size) and masks broadcast to `(B, N, Tq, Tk)`.
"""

from __future__ import annotations

import math

import keras
from keras import ops

from keras_attn.ops.masks import causal_mask
from keras_attn.ops.softmax import masked_softmax


def weighted_sum(weights, value):
    """Context vectors `Σ_k weights[q, k] · value[k]`.

    `(..., Tq, Tk), (..., Tk, dv) -> (..., Tq, dv)`; weights are cast to the
    value's dtype.
    """
    value = ops.convert_to_tensor(value)
    return ops.matmul(ops.cast(weights, value.dtype), value)


# The paths `dot_product_attention` can take (see `attention_path`).
FUSED = "fused"
EXPLICIT = "explicit"


def attention_path(
    flash_attention: bool | None = None,
    *,
    return_weights: bool = False,
    dropout_active: bool = False,
    same_head_dims: bool = True,
    query_length: int | None = None,
    key_length: int | None = None,
    backend: str | None = None,
) -> str:
    """The attention path a call takes: `"fused"` or `"explicit"`.

    The one place where keras-attn chooses how attention is computed, from
    what the call needs. `flash_attention` is the layers' argument:

    - `None`: the fastest path that can honour the call. Follows
      `keras.config.enable_flash_attention()` / `disable_flash_attention()`
      when one of them was called (then as `True` / `False`).
    - `True`: a fused (or memory-efficient) path is required; a call that none
      can run (attention weights requested, dropout active on the weights, a
      backend without a fused kernel) raises a `ValueError`.
    - `False`: the explicit path, which materialises the weights.

    The fused path is `keras.ops.dot_product_attention` (XLA / cuDNN / flash
    kernels on JAX and PyTorch). The TensorFlow backend has no fused kernel:
    its `dot_product_attention` runs einsums over the `(B, T, N, H)` layout
    (with float16 logits in float16), slower than the explicit path's two
    batched matmuls, so TensorFlow takes the explicit path.

    Args:
        flash_attention: `None`, `True` or `False`, as above.
        return_weights: the call returns the attention weights.
        dropout_active: dropout on the weights is active (training, rate > 0).
        same_head_dims: key and value heads have the same size (JAX's fused
            kernel needs it).
        query_length, key_length: static lengths when known (`None`
            otherwise), for the choice of a blockwise path on long sequences.
        backend: defaults to `keras.backend.backend()`.

    Returns:
        `"fused"` or `"explicit"`.
    """
    if flash_attention is None:
        flash_attention = keras.config.is_flash_attention_enabled()
    if flash_attention is not None and not flash_attention:
        return EXPLICIT
    backend = backend or keras.backend.backend()
    blockers = []
    if return_weights:
        blockers.append("the attention weights are requested")
    if dropout_active:
        blockers.append("dropout on the attention weights is active")
    if not same_head_dims:
        blockers.append("the value heads differ in size from the key heads")
    if backend == "tensorflow":
        blockers.append("the TensorFlow backend has no fused attention kernel")
    if not blockers:
        return FUSED
    if flash_attention:
        raise ValueError(
            "`flash_attention=True` needs a fused or memory-efficient attention "
            f"path, and none can run this call: {'; '.join(blockers)}. Pass "
            "`flash_attention=None` (the fastest path that can) or `False` (the "
            "explicit path). Received: flash_attention=True, "
            f"return_attention_scores={return_weights}, "
            f"dropout_active={dropout_active}, backend={backend!r}"
        )
    return EXPLICIT


def check_flash_attention(flash_attention, dropout: float = 0.0):
    """Validate a layer's `flash_attention` argument (`None` or a bool).

    `True` with `dropout > 0` is refused at construction, as
    `keras.layers.MultiHeadAttention` does: no fused path applies dropout to
    the attention weights. `None` counts as `True` after
    `keras.config.enable_flash_attention()`.
    """
    if flash_attention is not None and not isinstance(flash_attention, bool):
        raise ValueError(
            "`flash_attention` must be None, True or False. "
            f"Received: flash_attention={flash_attention!r}"
        )
    required = (
        keras.config.is_flash_attention_enabled()
        if flash_attention is None
        else flash_attention
    )
    if required and dropout > 0:
        raise ValueError(
            "A fused attention path (`flash_attention=True`, or `None` after "
            "`keras.config.enable_flash_attention()`) cannot apply dropout to "
            "the attention weights: set `dropout=0` or `flash_attention=False`. "
            f"Received: flash_attention={flash_attention}, dropout={dropout}"
        )
    return flash_attention


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
    is_causal: bool = False,
    flash_attention: bool | None = None,
):
    """Scaled dot-product attention over heads, fused when possible.

    `softmax(q kᵀ · scale) v` (Vaswani et al. 2017), with the softmax in
    float32 and a finite mask value. A query row whose keys are all masked gets
    all-zero weights and a zero output on both paths.

    `attention_path` chooses the path: the fused
    `keras.ops.dot_product_attention` when no weights are asked for and no
    dropout is active (on the backends that have a fused kernel); otherwise
    the explicit path, which materialises the weights. The two paths agree
    (tested).

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
        is_causal: also mask future keys (`j > i`, aligned at the first
            position); with no other `mask` the fused path uses the
            backend's causal kernel and builds no `(Tq, Tk)` mask.
        flash_attention: `None`, `True` or `False`, see `attention_path`.

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
    if is_causal and mask is not None:
        # One mask: the rows without keys are found from it.
        mask = ops.logical_and(
            mask, causal_mask(ops.shape(query)[1], ops.shape(key)[1])
        )  # (B|1, N|1, Tq, Tk)
        is_causal = False
    path = attention_path(
        flash_attention,
        return_weights=return_weights,
        dropout_active=dropout_active,
        # jax.nn.dot_product_attention needs value heads as wide as key heads.
        same_head_dims=value.shape[-1] == key.shape[-1],
        query_length=query.shape[1],
        key_length=key.shape[1],
    )
    if path == FUSED:
        outputs = ops.dot_product_attention(
            query, key, value, mask=mask, scale=scale, is_causal=is_causal
        )  # (B, Tq, N, Hv)
        if mask is not None:
            has_keys = ops.transpose(_rows_with_keys(mask), (0, 2, 1, 3))
            # (B|1, Tq|1, N|1, 1): zero the rows that had nothing to attend to.
            outputs = ops.where(has_keys, outputs, ops.zeros_like(outputs))
        return outputs

    if is_causal:
        mask = causal_mask(ops.shape(query)[1], ops.shape(key)[1])[None, None]
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
