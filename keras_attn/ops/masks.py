"""Boolean attention masks: `True` means "attend", `False` means "masked".

The helpers here build the masks the attention layers combine: padding masks
from lengths or Keras masks, causal masks with an offset for cached decoding,
and the logical AND of any number of (broadcastable) masks.
"""

from __future__ import annotations

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
    if mask.dtype != "bool":
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
    if key_length is None:
        key_length = query_length
    query_positions = ops.arange(query_length, dtype="int32") + ops.cast(
        offset, "int32"
    )  # (Tq,)
    key_positions = ops.arange(key_length, dtype="int32")  # (Tk,)
    return ops.greater_equal(query_positions[:, None], key_positions[None, :])


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
    if key_length is None:
        key_length = query_length
    query_positions = ops.arange(query_length, dtype="int32") + ops.cast(
        offset, "int32"
    )  # (Tq,)
    key_positions = ops.arange(key_length, dtype="int32")  # (Tk,)
    distance = ops.abs(query_positions[:, None] - key_positions[None, :])  # (Tq, Tk)
    return ops.less(distance, window)


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
