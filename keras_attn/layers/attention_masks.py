"""The masks of the attention layers' rank-3 calls, as attention takes them.

A call's masks (`query_mask`, `value_mask`, `key_mask`, `attention_mask`,
`use_causal_mask`, `sliding_window`, the cache offset) reach
`keras_attn.ops.dot_product_attention` as components, so the
memory-efficient path builds no `(Tq, Tk)` mask (`mask_components`), or,
for a subclass that overrides Keras's `_compute_attention`, combined into
one Keras `attention_mask` (`combined_attention_mask`). The masks themselves
are built by `keras_attn.ops.masks`.
"""

from __future__ import annotations

from keras import ops

from keras_attn.ops.masks import (
    band_mask,
    combine_masks,
    rows_with_keys,
    split_attention_mask,
)


def mask_components(
    query_heads,
    key_heads,
    query_mask,
    value_mask,
    key_mask,
    attention_mask,
    use_causal_mask,
    offset,
    sliding_window,
):
    """The masks of a rank-3 call as attention's components:
    `(explicit, key_padding, query_padding, has_keys)`.

    `attention_mask` is split as `split_attention_mask` does: a key padding
    mask in disguise (`(B, 1, Tk)`, `(B, 1, 1, Tk)`) joins the key padding
    `(B, Tk)` with `value_mask` and `key_mask`, a query one the query padding
    `(B, Tq)` with `query_mask`, and what remains stays an explicit mask
    `(B|1, N|1, Tq, Tk)` without its broadcast batch or heads axes, so the
    memory-efficient path builds no `(B, Tq, Tk)` tensor for them.
    `has_keys` is `(B|1, Tq)`, the query rows with a key to attend to under
    every mask (or `None`)."""
    batch = ops.shape(query_heads)[0]
    query_length, key_length = ops.shape(query_heads)[1], ops.shape(key_heads)[1]
    mask_keys, mask_queries, explicit = split_attention_mask(attention_mask)
    if explicit is not None:
        explicit_shape = ops.shape(explicit)
        explicit = ops.broadcast_to(
            explicit,
            (explicit_shape[0], explicit_shape[1], query_length, key_length),
        )  # (B|1, N|1, Tq, Tk): the batch and heads stay as given
    key_padding = combine_masks(
        value_mask,
        key_mask,
        None if mask_keys is None else ops.broadcast_to(mask_keys, (batch, key_length)),
    )  # (B, Tk)
    query_padding = combine_masks(
        query_mask,
        None
        if mask_queries is None
        else ops.broadcast_to(mask_queries, (batch, query_length)),
    )  # (B, Tq)
    has_keys = rows_with_keys(
        query_length,
        key_length,
        attention_mask=None if explicit is None else ops.any(explicit, axis=1),
        key_padding_mask=key_padding,
        query_padding_mask=query_padding,
        causal=bool(use_causal_mask),
        offset=offset,
        sliding_window=sliding_window,
    )  # (B|1, Tq) or None
    return explicit, key_padding, query_padding, has_keys


def combined_attention_mask(
    explicit,
    key_padding,
    query_padding,
    query_length,
    key_length,
    use_causal_mask,
    sliding_window,
    offset,
):
    """`mask_components`'s masks, the causal mask and the window combined
    into one Keras `attention_mask`: `(B|1, Tq, Tk)` (Keras's documented
    form) when the heads broadcast, else `(B|1, N, Tq, Tk)`; `None` without
    any mask. What a subclass that overrides `_compute_attention` gets."""
    band = band_mask(query_length, key_length, use_causal_mask, sliding_window, offset)
    combined = combine_masks(
        explicit,
        None if key_padding is None else key_padding[:, None, None, :],
        None if query_padding is None else query_padding[:, None, :, None],
        None if band is None else band[None, None],
    )
    if combined is not None and combined.shape[1] == 1:
        combined = combined[:, 0]  # (B|1, Tq, Tk), Keras's documented form
    return combined


def attention_arguments(
    query_heads,
    key_heads,
    query_mask,
    value_mask,
    key_mask,
    attention_mask,
    use_causal_mask,
    offset,
    sliding_window,
    keras_form=False,
):
    """The masks of a rank-3 call as `MultiHeadAttention._compute_attention`'s
    keyword arguments, and the `(B|1, Tq)` rows that have a key (or `None`):
    `mask_components`'s split, or with `keras_form` (a subclass overrides
    `_compute_attention`) every mask combined into Keras's
    `attention_mask` (`combined_attention_mask`)."""
    explicit, key_padding, query_padding, has_keys = mask_components(
        query_heads,
        key_heads,
        query_mask,
        value_mask,
        key_mask,
        attention_mask,
        use_causal_mask,
        offset,
        sliding_window,
    )
    if keras_form:
        # Keras's arguments only: every mask in one (B|1, N|1, Tq, Tk).
        combined = combined_attention_mask(
            explicit,
            key_padding,
            query_padding,
            ops.shape(query_heads)[1],
            ops.shape(key_heads)[1],
            use_causal_mask,
            sliding_window,
            offset,
        )
        return {"attention_mask": combined}, has_keys
    return {
        "attention_mask": explicit,
        "use_causal_mask": bool(use_causal_mask),
        "key_padding_mask": key_padding,
        "query_padding_mask": query_padding,
        "causal_offset": offset,
        "sliding_window": sliding_window,
    }, has_keys


def zero_rows_without_keys(outputs, has_keys):
    """`outputs` `(B, <axes>, ...)` with zeros at the query positions that
    have no key to attend to (`has_keys` `(B|1, <axes>)` false), so no
    output bias reaches them; `outputs` itself when `has_keys` is `None`."""
    if has_keys is None:
        return outputs
    while len(has_keys.shape) < len(outputs.shape):
        has_keys = ops.expand_dims(has_keys, -1)  # (B|1, <axes>|1, 1...)
    return ops.where(has_keys, outputs, ops.zeros_like(outputs))
