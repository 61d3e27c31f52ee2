"""Keras's higher-rank `attention_axes` for `MultiHeadAttention`.

Inputs of rank 4 or more, `(B, <axes>, features)`, attend over the
`attention_axes` (Keras's default: every axis but the batch and the
features). The projected heads `(B, <axes>, N, H)` are laid out as blocks
`(B', T', N, H)` for `keras_attn.ops.dot_product_attention`: the other axes
joined to the batch (`B'`), the attention axes joined into one (`T'`); the
outputs and the weights are put back in Keras's layout afterwards, the
weights as Keras's scores `(B, <other axes>, N, <query axes>, <key axes>)`.
A `layout` is what `layout()` returns: `(permutation, other_axes,
attention_axes)`.
"""

from __future__ import annotations

from keras import ops

from keras_attn import _validation as v
from keras_attn.ops.masks import (
    band_mask,
    combine_masks,
    padding_mask,
    with_whole_sequence_axes,
)


def _product(dims):
    result = 1
    for dim in dims:
        result = result * dim
    return result


def normalized_axes(attention_axes, rank: int) -> tuple:
    """The attention axes of inputs of `rank`, non-negative (Keras's default
    for `None`: all but the batch and the features)."""
    if attention_axes is None:
        return tuple(range(1, rank - 1))
    axes = (attention_axes,) if v.is_int(attention_axes) else attention_axes
    return tuple(axis if axis >= 0 else rank + axis for axis in axes)


def scores_shape(attention_axes, num_heads: int, query_shape, key_length):
    """Keras's attention-scores shape for a query of `query_shape`:
    `(B, <other axes>, N, <query axes>, <key axes>)`, and the number of
    attention axes. `key_length` is the key's axis-1 size (rank 3) or the
    key's whole shape (higher ranks)."""
    rank = len(query_shape)
    if rank == 3:
        return (query_shape[0], num_heads, query_shape[1], key_length), 1
    axes = normalized_axes(attention_axes, rank)
    other = [a for a in range(1, rank - 1) if a not in axes]
    key_shape = key_length if isinstance(key_length, tuple) else None
    return (
        query_shape[0],
        *(query_shape[a] for a in other),
        num_heads,
        *(query_shape[a] for a in axes),
        *(None if key_shape is None else key_shape[a] for a in axes),
    ), len(axes)


def layout(attention_axes, rank: int):
    """How a projected `(B, <axes>, N, H)` tensor of `rank` is laid out for
    `dot_product_attention`: `(permutation, other_axes, attention_axes)`.

    The permutation moves the attention axes next to the heads:
    `(B, <other axes>, <attention axes>, N, H)`; it is `None` for rank-3
    inputs attending over axis 1 (nothing to move).
    """
    axes = normalized_axes(attention_axes, rank - 1)
    other = tuple(a for a in range(1, rank - 2) if a not in axes)
    if rank == 4 and axes == (1,):
        return None, (), axes
    return (0, *other, *axes, rank - 2, rank - 1), other, axes


def to_blocks(heads, layout):
    """`(B, <axes>, N, H)` -> `(B', T', N, H)`: the other axes joined to the
    batch, the attention axes joined into one."""
    permutation, other, axes = layout
    if permutation is None:
        return heads
    heads = ops.transpose(heads, permutation)
    shape = ops.shape(heads)
    length = _product(shape[1 + len(other) : 1 + len(other) + len(axes)])
    return ops.reshape(heads, (-1, length, shape[-2], shape[-1]))


def scores_mask(attention_mask, layout):
    """`attention_mask` in Keras's broadcasting, as a boolean mask of the
    scores' rank `(B|1, <other>|1, N|1, <query axes>, <key axes>)`."""
    _, other, axes = layout
    mask = padding_mask(attention_mask)
    scores_rank = 2 + len(other) + 2 * len(axes)
    while len(mask.shape) < scores_rank:
        mask = ops.expand_dims(mask, -2 * len(axes) - 1)  # before <query axes>
    return mask


def with_band(
    attention_mask, layout, query_length, key_length, causal, window, offset=0
):
    """`attention_mask` as a scores-rank mask (`scores_mask`) combined with
    the causal mask and the window over axis 1 (`band_mask` `(Tq, Tk)`,
    broadcast as the last two axes); `None` without either."""
    band = band_mask(query_length, key_length, causal, window, offset)
    return combine_masks(
        None if attention_mask is None else scores_mask(attention_mask, layout),
        band,  # (Tq, Tk) over axis 1, or None
    )


def block_mask(attention_mask, query_heads, key_heads, layout, num_heads: int):
    """An `attention_mask` in Keras's broadcasting as the mask of the
    blocks: `(B'|1, N|1, Tq', Tk')`."""
    permutation, other, axes = layout
    mask = scores_mask(attention_mask, layout)
    if permutation is None:  # (B|1, N|1, Tq|1, Tk|1)
        return with_whole_sequence_axes(
            mask, ops.shape(query_heads)[1], ops.shape(key_heads)[1]
        )  # (B|1, N|1, Tq, Tk)
    query_shape = ops.shape(ops.transpose(query_heads, permutation))
    key_shape = ops.shape(ops.transpose(key_heads, permutation))
    heads = mask.shape[1 + len(other)]
    target = (
        *query_shape[: 1 + len(other)],
        num_heads if heads is None or heads != 1 else 1,
        *query_shape[1 + len(other) : 1 + len(other) + len(axes)],
        *key_shape[1 + len(other) : 1 + len(other) + len(axes)],
    )  # (B, <other>, N|1, <query axes>, <key axes>)
    mask = ops.broadcast_to(mask, target)
    return ops.reshape(
        mask,
        (
            -1,
            target[1 + len(other)],
            _product(target[2 + len(other) : 2 + len(other) + len(axes)]),
            _product(target[2 + len(other) + len(axes) :]),
        ),
    )  # (B', N|1, Tq', Tk')


def from_blocks(attended, weights, query_heads, key_heads, layout, num_heads: int):
    """Undo `to_blocks` on the outputs and the weights (to Keras's layout)."""
    permutation, other, axes = layout
    if permutation is None:
        return attended, weights
    query_shape = ops.shape(ops.transpose(query_heads, permutation))
    key_shape = ops.shape(ops.transpose(key_heads, permutation))
    positions = query_shape[:-2]  # (B, <other>, <query axes>)
    inverse = [permutation.index(axis) for axis in range(len(permutation))]
    attended = ops.reshape(attended, (*positions, *ops.shape(attended)[-2:]))
    attended = ops.transpose(attended, inverse)  # (B, <axes>, N, Hv)
    if weights is not None:
        weights = ops.reshape(
            weights,
            (
                *positions[: 1 + len(other)],
                num_heads,
                *positions[1 + len(other) :],
                *key_shape[1 + len(other) : 1 + len(other) + len(axes)],
            ),
        )  # (B, <other>, N, <query axes>, <key axes>)
    return attended, weights


def rows_with_keys_of_mask(mask, layout, query_heads):
    """`(B, <axes>)` bool for higher-rank inputs: whether each query
    position has a key in the scores-shaped `mask`, any head."""
    permutation, other, axes = layout
    has_keys = ops.any(mask, axis=tuple(range(-len(axes), 0)))
    has_keys = ops.any(has_keys, axis=1 + len(other))  # (B|1, <other>|1, <q>)
    query_shape = ops.shape(ops.transpose(query_heads, permutation))
    has_keys = ops.broadcast_to(has_keys, query_shape[:-2])  # (B, <other>, <q>)
    inverse = [permutation.index(axis) for axis in range(len(permutation))]
    return ops.transpose(has_keys, inverse[:-2])  # (B, <axes>)


def higher_rank_masks(
    query_heads, key_heads, attention_mask, use_causal, sliding_window, attention_axes
):
    """The masks of a higher-rank call: Keras's `attention_mask` with the
    causal mask and the window over axis 1 folded in, and the
    `(B, <axes>)` query positions that have a key (or `None`)."""
    heads_layout = layout(attention_axes, len(query_heads.shape))
    query_length, key_length = ops.shape(query_heads)[1], ops.shape(key_heads)[1]
    mask = with_band(
        attention_mask,
        heads_layout,
        query_length,
        key_length,
        use_causal,
        sliding_window,
    )
    if mask is None:
        return {}, None
    while len(mask.shape) < 2 + len(heads_layout[1]) + 2 * len(heads_layout[2]):
        mask = mask[None]  # (1, ..., Tq, Tk): the band alone
    has_keys = rows_with_keys_of_mask(mask, heads_layout, query_heads)
    return {"attention_mask": mask}, has_keys
