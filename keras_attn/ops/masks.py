"""Boolean attention masks: `True` means "attend", `False` means "masked".

The helpers here build the masks the attention layers combine: padding masks
from lengths or Keras masks, causal masks with an offset for cached decoding,
and the logical AND of any number of (broadcastable) masks.
"""

from __future__ import annotations

import keras
from keras import ops


def padding_mask_from_lengths(lengths, max_length: int):
    """Padding mask from sequence lengths.

    Args:
        lengths: int tensor of shape `(batch,)`, the number of valid tokens in
            each sequence.
        max_length: the padded sequence length.

    Returns:
        Boolean tensor of shape `(batch, max_length)`, `True` at positions
        `t < lengths[b]`.

    Example:

    >>> padding_mask_from_lengths([2, 0], 3)  # [[T, T, F], [F, F, F]]
    """
    lengths = ops.convert_to_tensor(lengths, dtype="int32")
    if len(lengths.shape) != 1:
        raise ValueError(
            "`lengths` must have shape (batch,). "
            f"Received: lengths.shape={tuple(lengths.shape)}"
        )
    positions = ops.arange(max_length, dtype="int32")  # (T,)
    return ops.less(positions[None, :], lengths[:, None])  # (B, T)


def padding_mask(mask):
    """Normalise a Keras mask (or any 0/1 tensor) to a boolean padding mask.

    `None` stays `None`, so that callers can pass an optional mask through.
    """
    if mask is None:
        return None
    mask = ops.convert_to_tensor(mask)
    if keras.backend.standardize_dtype(mask.dtype) != "bool":
        mask = ops.not_equal(mask, 0)
    return mask


def causal_mask(query_length, key_length=None, offset=0):
    """Causal mask with an offset, for full passes and cached decoding.

    Query position `i` may attend to key position `j` when `j <= i + offset`.
    With `offset=0` and equal lengths this is the usual lower-triangular mask;
    in cached decoding the queries are the new tokens written at
    `cache_update_index`, so `offset=cache_update_index` lets them see the
    whole cached prefix and themselves, and nothing after.

    Args:
        query_length: number of query positions `Tq` (int or scalar tensor).
        key_length: number of key positions `Tk`; defaults to `query_length`.
        offset: position of the first query in the key sequence (int or scalar
            tensor; may change from call to call without retracing).

    Returns:
        Boolean tensor of shape `(Tq, Tk)`.
    """
    return band_mask(query_length, key_length, causal=True, offset=offset)


def sliding_window_mask(query_length, key_length=None, window: int = 1, offset=0):
    """Symmetric band mask: query `i` sees key `j` when `|i + offset - j| < window`.

    The band of `keras.layers.MultiHeadAttention(sliding_window=window)`:
    each query attends to the keys within `window - 1` positions on either
    side of its own; AND it with `causal_mask` for the causal sliding window
    (Mistral, Longformer's local attention). `offset` places the queries in a
    cache, as in `causal_mask`.

    Args:
        query_length: number of query positions `Tq` (int or scalar tensor).
        key_length: number of key positions `Tk`; defaults to `query_length`.
        window: positive int, the band's half-width plus one.
        offset: position of the first query in the key sequence.

    Returns:
        Boolean tensor of shape `(Tq, Tk)`.
    """
    return band_mask(query_length, key_length, window=window, offset=offset)


def band_mask(query_length, key_length=None, causal=False, window=None, offset=0):
    """The causal mask and the sliding window together, or `None`.

    `causal_mask` when `causal`, AND `sliding_window_mask` when `window` is
    set, both at `offset` (a cache's write index); `None` when neither is
    asked (no band).

    Returns:
        Boolean tensor of shape `(Tq, Tk)`, or `None`.
    """
    if not causal and window is None:
        return None
    if key_length is None:
        key_length = query_length
    query_positions = ops.arange(query_length, dtype="int32") + ops.cast(
        offset, "int32"
    )  # (Tq,)
    key_positions = ops.arange(key_length, dtype="int32")  # (Tk,)
    return band_from_positions(query_positions, key_positions, causal, window)


def band_from_positions(query_positions, key_positions, causal=False, window=None):
    """The band of `band_mask` between queries and keys at given positions.

    Query `i` sees key `j` when `key_positions[j] <= query_positions[i]`
    (`causal`) and, with a `window`, when they are less than `window` apart
    (`key_positions[j] > query_positions[i] - window`, and with no `causal`
    `key_positions[j] < query_positions[i] + window`). The one builder of
    the causal mask and the sliding window, for whole sequences
    (`band_mask`) and for the blocks of the memory-efficient path.

    Args:
        query_positions: int32 `(Tq,)`, the queries' positions among the keys,
            or `(B, Tq)`, each row's own (the mask is then `(B, Tq, Tk)`).
        key_positions: int32 `(Tk,)`.
        causal: whether to mask the keys after each query.
        window: optional positive int (or scalar int tensor).

    Returns:
        Boolean tensor of shape `(Tq, Tk)`, or `None` with neither `causal`
        nor `window`.
    """
    distance = query_positions[..., None] - key_positions  # ([B,] Tq, Tk)
    visible = None
    if causal:
        visible = ops.greater_equal(distance, 0)
    if window is not None:
        band = ops.less(distance, window)
        if not causal:
            band = ops.logical_and(band, ops.greater(distance, -window))
        visible = band if visible is None else ops.logical_and(visible, band)
    return visible


def with_whole_sequence_axes(mask, query_length, key_length):
    """`(B|1, N|1, Tq|1, Tk|1)` -> `(B|1, N|1, Tq, Tk)`: the mask broadcast
    along its two sequence axes, its batch and heads axes left as they are."""
    shape = ops.shape(mask)
    return ops.broadcast_to(mask, (shape[0], shape[1], query_length, key_length))


def combine_masks(*masks):
    """Logical AND of boolean masks that broadcast together; `None`s are skipped.

    Returns `None` when every mask is `None`.
    """
    result = None
    for mask in masks:
        if mask is None:
            continue
        mask = padding_mask(mask)
        result = mask if result is None else ops.logical_and(result, mask)
    return result


def attention_mask_from_padding(query_mask=None, key_mask=None):
    """Combine per-token padding masks into a `(batch, Tq, Tk)` attention mask.

    Either argument may be `None`. Returns a mask broadcastable to
    `(batch, Tq, Tk)`: `(batch, Tq, 1)`, `(batch, 1, Tk)` or `(batch, Tq, Tk)`,
    or `None` when both are `None`.
    """
    query_mask = padding_mask(query_mask)
    key_mask = padding_mask(key_mask)
    return combine_masks(
        None if query_mask is None else query_mask[:, :, None],  # (B, Tq, 1)
        None if key_mask is None else key_mask[:, None, :],  # (B, 1, Tk)
    )


def split_attention_mask(attention_mask):
    """An attention mask split into the components attention reads cheapest.

    `attention_mask` broadcasts to `(B, N, Tq, Tk)` as Keras broadcasts it:
    a rank-2 mask is `(Tq, Tk)`, a rank-3 mask `(B, Tq, Tk)` (the heads axis
    inserted), a rank-4 mask `(B, N, Tq, Tk)`; any axis may be 1. Where the
    static shape shows what the mask really is, it is returned as such:

    - a key padding mask, `(B|1, 1, Tk)` or `(B|1, 1, 1, Tk)` (keras.io's
      Transformers pass one): `(B|1, Tk)`;
    - a query mask, `(B|1, Tq, 1)` or `(B|1, 1, Tq, 1)`: `(B|1, Tq)`;
    - anything else stays a mask, as `(B|1, N|1, Tq|1, Tk|1)` (no axis
      broadcast: a shared `(Tq, Tk)` mask stays `(1, 1, Tq, Tk)`).

    Args:
        attention_mask: boolean (or 0/1) tensor of rank 2 to 4, or `None`.

    Returns:
        `(key_padding_mask, query_padding_mask, mask)`, each `None` where
        absent; the padding masks may have a batch (and length) of 1.

    Example:

    >>> keys, queries, mask = split_attention_mask(np.ones((2, 1, 5), bool))
    >>> keys.shape, queries, mask  # ((2, 5), None, None)
    """
    mask = padding_mask(attention_mask)
    if mask is None:
        return None, None, None
    rank = len(mask.shape)
    if not 2 <= rank <= 4:
        raise ValueError(
            "`attention_mask` must have rank 2 (Tq, Tk), 3 (batch, Tq, Tk) or "
            f"4 (batch, heads, Tq, Tk). Received: attention_mask.shape="
            f"{tuple(mask.shape)}"
        )
    if rank == 2:
        mask = mask[None, None]  # (1, 1, Tq, Tk)
    elif rank == 3:
        mask = mask[:, None]  # (B, 1, Tq, Tk)
    heads, queries, keys = mask.shape[1:]
    if heads == 1 and queries == 1:
        return mask[:, 0, 0, :], None, None  # (B|1, Tk)
    if heads == 1 and keys == 1:
        return None, mask[:, 0, :, 0], None  # (B|1, Tq)
    return None, None, mask  # (B|1, N|1, Tq, Tk)


def rows_with_keys(
    query_length,
    key_length,
    *,
    attention_mask=None,
    key_padding_mask=None,
    query_padding_mask=None,
    causal: bool = False,
    offset=0,
    sliding_window: int | None = None,
):
    """Which query rows have at least one key to attend to, from mask components.

    The rows of the combined mask (the AND of the components) that hold a
    `True`, computed without a `(Tq, Tk)` mask when there is no
    `attention_mask`: the keys that the causal mask and the sliding window
    leave to query `i` are one range, `[i + offset - window + 1, i + offset]`
    (causal) or `[.., i + offset + window - 1]`, and the valid keys in it
    are counted from a running sum of the key padding.

    Args:
        query_length, key_length: `Tq` and `Tk` (ints or scalar tensors).
        attention_mask: optional boolean `(B|1, Tq, Tk)`.
        key_padding_mask: optional boolean `(B, Tk)`.
        query_padding_mask: optional boolean `(B, Tq)`.
        causal: query `i` sees key `j` only when `j <= i + offset`.
        offset: the position of the first query among the keys.
        sliding_window: optional positive int, as in `sliding_window_mask`.

    Returns:
        Boolean `(B|1, Tq)`, or `None` when no component is given (every row
        has all the keys).
    """
    key_padding_mask = padding_mask(key_padding_mask)
    query_padding_mask = padding_mask(query_padding_mask)
    if attention_mask is not None:
        band = band_mask(query_length, key_length, causal, sliding_window, offset)
        combined = combine_masks(
            attention_mask, None if band is None else band[None]
        )  # (B|1, Tq, Tk)
        if key_padding_mask is None:
            rows = ops.any(combined, axis=-1)  # (B|1, Tq)
        else:
            # The keys each row keeps, counted by a matmul: a shared mask
            # meets the (B, Tk) padding without a (B, Tq, Tk) tensor.
            counts = ops.matmul(
                ops.cast(combined, "float32"),  # (B|1, Tq, Tk)
                ops.cast(key_padding_mask, "float32")[:, :, None],  # (B, Tk, 1)
            )  # (B, Tq, 1)
            rows = ops.greater(counts[..., 0], 0.0)  # (B, Tq)
        return combine_masks(rows, query_padding_mask)
    if not causal and sliding_window is None and key_padding_mask is None:
        return query_padding_mask
    positions = ops.arange(query_length, dtype="int32") + ops.cast(
        offset, "int32"
    )  # (Tq,): each query's position among the keys
    last_key = ops.cast(key_length, "int32") - 1
    first = ops.zeros_like(positions)  # (Tq,): the first and last key visible
    last = ops.full_like(positions, last_key)
    if causal:
        last = ops.minimum(last, positions)
    if sliding_window is not None:
        first = ops.maximum(first, positions - sliding_window + 1)
        if not causal:
            last = ops.minimum(last, positions + sliding_window - 1)
    rows = ops.greater_equal(last, first)[None]  # (1, Tq)
    if key_padding_mask is not None:
        valid = ops.cumsum(ops.cast(key_padding_mask, "int32"), axis=1)  # (B, Tk)
        valid = ops.pad(valid, [[0, 0], [1, 0]])  # (B, Tk + 1): keys before j
        upper = ops.take(valid, ops.clip(last + 1, 0, last_key + 1), axis=1)
        lower = ops.take(valid, ops.clip(first, 0, last_key + 1), axis=1)
        rows = ops.logical_and(rows, ops.greater(upper - lower, 0))  # (B, Tq)
    return combine_masks(rows, query_padding_mask)
