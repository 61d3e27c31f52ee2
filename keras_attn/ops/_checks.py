"""Argument checks of the attention ops (`keras_attn.ops.attention`,
`keras_attn.ops.memory_efficient_attention`) and of the layers' attention
arguments.

Every error names the argument and what was received, in the Keras style
"... Received: name=value"; the generic checks are `keras_attn._validation`'s.
"""

from __future__ import annotations

import math
import numbers

import keras
from keras import ops

from keras_attn import _validation as v
from keras_attn.ops.masks import padding_mask


def check_flash_attention(flash_attention, dropout: float = 0.0):
    """Validate a layer's `flash_attention` argument (`None` or a bool).

    `True` with `dropout > 0` is refused at construction, as
    `keras.layers.MultiHeadAttention` refuses it (no fused kernel applies
    dropout to the attention weights; the memory-efficient path could, and
    `flash_attention=None` takes it with dropout on long sequences). `None`
    counts as `keras.config.is_flash_attention_enabled()` (`False` after
    `disable_flash_attention()`; Keras 3.15's `enable_flash_attention()`
    sets `None`, not `True`).
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
            "Dropout is not supported when flash attention is enabled. "
            "A fused attention path (`flash_attention=True`, or `None` while "
            "`keras.config.is_flash_attention_enabled()` is True) cannot "
            "apply dropout to the attention weights: set `dropout=0` or "
            "`flash_attention=False`. "
            f"Received: flash_attention={flash_attention}, dropout={dropout}"
        )
    return flash_attention


def check_heads(query, key, value) -> int:
    """Check `(B, T, N, H)` query, key and value tensors; return `N / K`.

    Each must be a rank-4 float tensor; batch sizes, key and value heads, key
    and query head sizes and key and value lengths must agree where known;
    `K` key/value heads must divide the `N` query heads (`key_value_groups`).
    """
    tensors = {"query": query, "key": key, "value": value}
    for name, tensor in tensors.items():
        if len(tensor.shape) != 4:
            raise ValueError(
                f"`{name}` must have shape (batch, length, heads, head_dim). "
                f"Received: {name}.shape={tuple(tensor.shape)}"
            )
        if not keras.backend.is_float_dtype(tensor.dtype):
            raise ValueError(
                f"`{name}` must be a float tensor. "
                f"Received: {name}.dtype={tensor.dtype}"
            )
    # (name, other, axis, what): sizes that must agree where both are known.
    checks = (
        ("key", "query", 0, "batch size"),
        ("value", "query", 0, "batch size"),
        ("value", "key", 2, "number of heads"),
        ("key", "query", 3, "head size"),
        ("value", "key", 1, "length"),
    )
    for name, other, axis, what in checks:
        size, other_size = tensors[name].shape[axis], tensors[other].shape[axis]
        if not v.same_dim(size, other_size):
            raise ValueError(
                f"`{name}` and `{other}` must have the same {what}. Received: "
                f"{name}.shape={tuple(tensors[name].shape)}, "
                f"{other}.shape={tuple(tensors[other].shape)}"
            )
    return key_value_groups(query.shape, key.shape)


def key_value_groups(query_shape, key_shape, value_shape=None) -> int:
    """`N / K`: how many query heads share each key/value head of
    `(B, T, K, H)` keys (and values) for `(B, T, N, H)` queries; 1 for
    multi-head attention. Raises a `ValueError` naming the shapes when `K`
    does not divide `N` or the values' heads differ from the keys'."""
    num_heads, key_heads = query_shape[2], key_shape[2]
    if value_shape is not None and not v.same_dim(value_shape[2], key_heads):
        raise ValueError(
            "`key` and `value` must have the same number of heads (axis 2). "
            f"Received: key.shape={tuple(key_shape)}, "
            f"value.shape={tuple(value_shape)}"
        )
    if num_heads is None or key_heads is None or num_heads == key_heads:
        return 1
    if not isinstance(num_heads, int) or not isinstance(key_heads, int):
        return 1  # symbolic: only the shapes are traced
    if num_heads % key_heads:
        raise ValueError(
            "The number of query heads must be a multiple of the number of "
            "key/value heads (axis 2), as in grouped-query attention. "
            f"Received: query.shape={tuple(query_shape)}, "
            f"key.shape={tuple(key_shape)}"
        )
    return num_heads // key_heads


def check_alibi_slopes(alibi_slopes, num_heads):
    """`alibi_slopes` as a float32 `(N,)` tensor, or `None`.

    Raises a `ValueError` naming the argument when it is not a rank-1 float
    tensor of `num_heads` slopes (the number of query heads, when known).
    """
    if alibi_slopes is None:
        return None
    slopes = ops.convert_to_tensor(alibi_slopes)
    shape = tuple(slopes.shape)
    if len(shape) != 1 or not v.same_dim(shape[0], num_heads):
        raise ValueError(
            f"`alibi_slopes` must have shape ({num_heads},), one slope per "
            f"query head. Received: alibi_slopes.shape={shape}"
        )
    if not keras.backend.is_float_dtype(slopes.dtype):
        raise ValueError(
            "`alibi_slopes` must be a float tensor. "
            "Received: alibi_slopes.dtype="
            f"{keras.backend.standardize_dtype(slopes.dtype)}"
        )
    # The bias is computed in float32 whatever the slopes' dtype, as the
    # logits it is added to.
    return ops.cast(slopes, "float32")


def check_causal(causal) -> bool:
    """`causal` must be a bool."""
    if not isinstance(causal, bool):
        raise ValueError(f"`causal` must be a bool. Received: causal={causal!r}")
    return causal


def check_key_block_size(key_block_size):
    """A positive int, `None` or `"auto"`."""
    if isinstance(key_block_size, str):
        if key_block_size != "auto":
            raise ValueError(
                '`key_block_size` must be a positive int, None or "auto". '
                f"Received: key_block_size={key_block_size!r}"
            )
        return key_block_size
    return v.check_positive_int("key_block_size", key_block_size, allow_none=True)


def check_causal_offset(causal_offset):
    """An int or a scalar int tensor (a float or a bool is refused)."""
    if isinstance(causal_offset, bool) or (
        isinstance(causal_offset, numbers.Number)
        and not isinstance(causal_offset, numbers.Integral)
    ):
        raise ValueError(
            "`causal_offset` must be an int or a scalar int tensor. "
            f"Received: causal_offset={causal_offset!r}"
        )
    return causal_offset


def check_scale(scale, query):
    """The logits' multiplier: a finite number or a scalar tensor, or for
    `None` `1/sqrt(H)` of the `(B, T, N, H)` query (a tensor when the head
    size is known only when run)."""
    if scale is None and query.shape[-1] is not None:
        return 1.0 / math.sqrt(query.shape[-1])
    if scale is None:  # head size known only when run
        return ops.rsqrt(ops.cast(ops.shape(query)[-1], "float32"))
    if isinstance(scale, bool) or (
        isinstance(scale, numbers.Real) and not math.isfinite(scale)
    ):
        raise ValueError(
            "`scale` must be a finite number or a scalar tensor. "
            f"Received: scale={scale!r}"
        )
    return scale


def padding_flags(name, mask, expected_shape):
    """A `(B, T)` padding mask as bool, its static shape checked."""
    if mask is None:
        return None
    mask = ops.convert_to_tensor(mask)
    shape = tuple(mask.shape)
    if len(shape) != 2 or not all(
        v.same_dim(got, want) for got, want in zip(shape, expected_shape, strict=True)
    ):
        raise ValueError(
            f"`{name}` must have shape {tuple(expected_shape)} (batch, length). "
            f"Received: {name}.shape={shape}"
        )
    return padding_mask(mask)


def explicit_mask(mask, query, key):
    """The explicit `attention_mask` as `(B|1, N|1, Tq, Tk)` bool, its static
    shape checked against the `(B, Tq, N, H)` query and `(B, Tk, K, H)` key."""
    if mask is None:
        return None
    mask = ops.convert_to_tensor(mask)
    shape = tuple(mask.shape)
    if len(shape) == 2:
        mask = mask[None, None]
    elif len(shape) == 3:
        mask = mask[:, None]
    shape4 = tuple(mask.shape)
    expected = (query.shape[0], query.shape[2], query.shape[1], key.shape[1])
    valid = len(shape) in (2, 3, 4) and all(
        v.same_dim(got, want) or (axis < 2 and got == 1)
        for axis, (got, want) in enumerate(zip(shape4, expected, strict=True))
    )
    if not valid:
        raise ValueError(
            "`attention_mask` must have shape (Tq, Tk), (batch|1, Tq, Tk) or "
            f"(batch|1, heads|1, Tq, Tk) with Tq={query.shape[1]} and "
            f"Tk={key.shape[1]}. Received: attention_mask.shape={shape}"
        )
    return padding_mask(mask)
