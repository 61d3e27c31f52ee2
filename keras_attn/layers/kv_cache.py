"""The key/value cache of the attention layers, in its two forms.

A cache holds the projected keys and values of `heads` key/value heads for
`Tmax` positions, either as keras-attn's tuple `(key_cache, value_cache)` of
`(B, Tmax, heads, key_dim | value_dim)` tensors or as keras-hub's stacked
`(B, 2, Tmax, heads, head_dim)` tensor (keys at `[:, 0]`, values at
`[:, 1]`; `key_dim == value_dim`). A call returns the cache in the form it
came in. `MultiHeadAttention`, `GroupedQueryAttention` and the decoder block
read and write it through these functions; the write itself is
`keras_attn.ops.update_cache`.
"""

from __future__ import annotations

import keras
from keras import ops

from keras_attn import _validation as v
from keras_attn.ops.cache import update_cache
from keras_attn.ops.masks import band_from_positions


def is_stacked(cache) -> bool:
    """Whether `cache` is keras-hub's stacked form (a tensor, not a tuple)."""
    return cache is not None and not isinstance(cache, (tuple, list))


def check_cache(cache, heads: int, key_dim: int, value_dim: int) -> bool:
    """Validate a KV cache of `heads` key/value heads, either form: a tuple
    `(key_cache, value_cache)` of `(B, Tmax, heads, key_dim | value_dim)`, or
    keras-hub's stacked `(B, 2, Tmax, heads, head_dim)` (`key_dim ==
    value_dim`). Returns `True` for the stacked form."""
    if isinstance(cache, (tuple, list)):
        if len(cache) != 2:
            raise ValueError(
                "`cache` must be a tuple (key_cache, value_cache) or a "
                "stacked (batch, 2, Tmax, heads, head_dim) tensor. "
                f"Received: cache={cache!r}"
            )
        for name, tensor, dim in (
            ("key_cache", cache[0], key_dim),
            ("value_cache", cache[1], value_dim),
        ):
            v.check_mask_shape(name, tensor, (None, None, heads, dim))
        return False
    if not hasattr(cache, "shape") or len(cache.shape) != 5:
        raise ValueError(
            "`cache` must be a tuple (key_cache, value_cache) or a stacked "
            "(batch, 2, Tmax, heads, head_dim) tensor. Received: "
            f"cache={cache!r}"
        )
    if key_dim != value_dim:
        raise ValueError(
            "A stacked cache needs `value_dim == key_dim`; pass a tuple "
            f"(key_cache, value_cache). Received: key_dim={key_dim}, "
            f"value_dim={value_dim}"
        )
    v.check_mask_shape("cache", cache, (None, 2, None, heads, key_dim))
    return True


def check_cache_update_index(cache, cache_update_index) -> None:
    """`cache_update_index` is given only with a `cache`."""
    if cache is None and cache_update_index is not None:
        raise ValueError(
            "`cache_update_index` needs a `cache`. Received: cache=None, "
            f"cache_update_index={cache_update_index!r}"
        )


def is_per_row(cache_update_index) -> bool:
    """Whether `cache_update_index` places each row of the batch at its own
    position: an int tensor `(batch,)` rather than an int or a scalar."""
    shape = getattr(cache_update_index, "shape", None)
    return shape is not None and len(shape) == 1


def check_per_row_index(cache_update_index, batch_size) -> None:
    """`cache_update_index` is an int, a scalar or a `(batch,)` tensor."""
    shape = getattr(cache_update_index, "shape", None)
    if shape is None or len(shape) == 0:
        return
    if len(shape) > 1 or (
        shape[0] is not None and batch_size is not None and shape[0] != batch_size
    ):
        raise ValueError(
            "`cache_update_index` must be an int, a scalar int tensor or an "
            f"int tensor (batch,) = ({batch_size},), one position per row. "
            f"Received: cache_update_index.shape={tuple(shape)}"
        )


def row_positions(cache_update_index, length):
    """int32 `(batch, length)`: the positions of a call's `length` new
    tokens in each row, from a per-row `cache_update_index` `(batch,)`."""
    index = ops.cast(cache_update_index, "int32")
    return index[:, None] + ops.arange(length, dtype="int32")[None, :]


def per_row_band(
    attention_mask, use_causal_mask, sliding_window, cache_update_index, query_heads,
    key_heads,
):  # fmt: skip
    """The mask and band arguments the attention op takes for a call's
    heads (`(batch, Tq, ...)` queries, `(batch, Tk, ...)` keys): as given
    for a scalar (or no) `cache_update_index`; with a per-row one, the
    causal mask and the sliding window as an explicit `(batch, Tq, Tk)` mask
    ANDed into `attention_mask` (each row's queries sit at their own
    positions; the band of the attention op takes one offset for the
    batch), returned as `(mask, use_causal_mask=False, sliding_window=None,
    offset=0)`. A cached call has few queries, so the mask is small."""
    if not is_per_row(cache_update_index):
        return attention_mask, use_causal_mask, sliding_window, cache_update_index
    query_length, key_length = ops.shape(query_heads)[1], ops.shape(key_heads)[1]
    band = band_from_positions(
        row_positions(cache_update_index, query_length),
        ops.arange(key_length, dtype="int32"),
        causal=bool(use_causal_mask),
        window=sliding_window,
    )  # (B, Tq, Tk) or None
    if band is not None and attention_mask is not None:
        band = ops.logical_and(band, ops.cast(attention_mask, "bool"))
    elif band is None:
        band = attention_mask
    return band, False, None, 0


def cache_length(cache):
    """The number of positions `Tmax` a cache (of either form) holds."""
    if isinstance(cache, (tuple, list)):
        return cache[0].shape[1]
    return cache.shape[2]


def cache_offset(cache_update_index):
    """The position of a call's first query: `cache_update_index`, or 0
    without one (the causal mask, the window and the positions count from
    there)."""
    return 0 if cache_update_index is None else cache_update_index


def updated_cache(cache, stacked: bool, new_keys, new_values, cache_update_index):
    """`(key_heads, value_heads, cache)`: the heads attended to and the cache
    returned, in its form. With `cache_update_index`, `new_keys` /
    `new_values` `(B, T, heads, dim)` are written into the cache there
    (`update_cache`); without it the cache is used as it is."""
    if stacked:  # (B, 2, Tmax, heads, dim)
        key_cache, value_cache = cache[:, 0, ...], cache[:, 1, ...]
    else:
        key_cache, value_cache = cache
    if cache_update_index is None:
        key_heads, value_heads = key_cache, value_cache  # (B, Tmax, heads, dim)
    else:
        key_heads = update_cache(key_cache, new_keys, cache_update_index)
        value_heads = update_cache(value_cache, new_values, cache_update_index)
    cache = (
        ops.stack((key_heads, value_heads), axis=1)  # (B, 2, Tmax, heads, dim)
        if stacked
        else (key_heads, value_heads)
    )
    return key_heads, value_heads, cache


def initial_cache(
    batch_size, max_length, heads: int, key_dim: int, value_dim: int, dtype, stacked
):
    """An all-zero cache of `max_length` positions: the stacked
    `(batch_size, 2, max_length, heads, key_dim)` tensor, or the tuple of
    `(batch_size, max_length, heads, key_dim | value_dim)` tensors."""
    if stacked:
        return ops.zeros((batch_size, 2, max_length, heads, key_dim), dtype=dtype)
    return (
        ops.zeros((batch_size, max_length, heads, key_dim), dtype=dtype),
        ops.zeros((batch_size, max_length, heads, value_dim), dtype=dtype),
    )


def cache_spec(cache):
    """The symbolic `keras.KerasTensor` structure of a cache, in its form."""
    if isinstance(cache, (tuple, list)):
        return tuple(keras.KerasTensor(tuple(t.shape), dtype=t.dtype) for t in cache)
    return keras.KerasTensor(tuple(cache.shape), dtype=cache.dtype)
