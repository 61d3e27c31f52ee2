"""Padding as sequence lengths: JAX's cuDNN attention without a `(Tq, Tk)` mask.

`keras.ops.dot_product_attention` hands cuDNN every mask as a whole
`(B|1, N|1, Tq, Tk)` bias, materialised in memory (at 16k tokens, 512 MiB
per batch row in bfloat16). `jax.nn.dot_product_attention` takes what the
common masks are without one: right padding as sequence lengths
(`query_seq_lengths`, `key_value_seq_lengths`), the causal mask as
`is_causal`, a causal sliding window as `local_window_size`. This module
turns `keras_attn.ops.dot_product_attention`'s mask components into those
arguments (`lengths_form`, `kernel_arguments`), decides whether padding
masks are right-padded (`right_padded`), and makes the call
(`attention_with_lengths`). Which calls take it is decided in
`keras_attn.ops.attention` (JAX only, where
`keras_attn.ops.attention_paths.lengths_kernel_implementation` finds that a
cuDNN kernel runs it).

A padding mask is right-padded when each row is `True` up to its length and
`False` after it, as `padding_mask_from_lengths` builds it. Only such a mask
can be given as a length: a left-padded mask or one with holes (a padding
token id inside a sentence) cannot, and is never taken as one. Inside
`jax.jit` a mask's values are unknown when the call is traced, so the
decision is made when it runs (`right_padded`, a `(B, T)` comparison) and
the call chooses between the lengths and another path with a conditional;
a concrete mask (an eager call) is checked when traced.
"""

from __future__ import annotations

import numbers

import numpy as np
from keras import ops

from keras_attn.ops.masks import padding_mask_from_lengths


def lengths_form(mask, components, scale):
    """The mask components as `jax.nn.dot_product_attention` can take them
    without a `(Tq, Tk)` tensor, or `None` when they cannot be.

    They can be when there is no explicit `mask` (after a key or query
    padding mask in disguise has been made a component), no causal offset
    (the kernel's causal mask is query `i` sees keys `j <= i`), a sliding
    window only with `causal` (cuDNN refuses a symmetric one) and a static
    int, and a static `scale` (cuDNN takes it as a constant). Only calls that
    need more than the kernel's causal mask alone qualify: a padding mask or
    a window.

    Args:
        mask: the explicit mask, or `None`.
        components: `dot_product_attention`'s dict of `key_padding_mask`,
            `query_padding_mask`, `causal`, `causal_offset`, `sliding_window`.
        scale: the logits' multiplier.

    Returns:
        `{"key_padding_mask", "query_padding_mask", "causal",
        "sliding_window"}` or `None`.
    """
    window = components["sliding_window"]
    causal = components["causal"]
    key_padding = components["key_padding_mask"]
    query_padding = components["query_padding_mask"]
    offset = components["causal_offset"]
    if mask is not None or not isinstance(scale, numbers.Real):
        return None
    if key_padding is None and query_padding is None and window is None:
        return None
    if (causal or window is not None) and not (
        isinstance(offset, numbers.Integral) and int(offset) == 0
    ):
        return None
    if window is not None and not (
        causal and isinstance(window, numbers.Integral) and not isinstance(window, bool)
    ):
        return None
    return {
        "key_padding_mask": key_padding,
        "query_padding_mask": query_padding,
        "causal": bool(causal),
        "sliding_window": None if window is None else int(window),
    }


def needs_lengths(form, query_length: int, key_length: int) -> bool:
    """Whether the call passes sequence lengths: with a padding mask, or when
    a causal window leaves the last queries without keys (`Tq > Tk + w - 1`),
    whose rows the lengths cut off."""
    window = form["sliding_window"]
    return (
        form["key_padding_mask"] is not None
        or form["query_padding_mask"] is not None
        or (window is not None and query_length > key_length + window - 1)
    )


def right_padded(padding):
    """Scalar boolean tensor: whether every row of the `(B, T)` padding mask
    is `True` for its first `sum(row)` positions and `False` after them."""
    lengths = ops.sum(ops.cast(padding, "int32"), axis=1)  # (B,)
    as_lengths = padding_mask_from_lengths(lengths, ops.shape(padding)[1])
    return ops.all(ops.equal(padding, as_lengths))


def concrete_right_padded(padding):
    """`right_padded` decided now when the mask's values are known (a NumPy
    array or a concrete tensor): `True` or `False`; `None` for a traced
    tensor, whose values are known only when the program runs."""
    try:
        import jax

        if isinstance(padding, jax.core.Tracer):
            return None
    except ImportError:
        pass
    values = np.asarray(ops.convert_to_numpy(padding)).astype(bool)
    lengths = values.sum(axis=1)
    return bool(
        (values == (np.arange(values.shape[1])[None, :] < lengths[:, None])).all()
    )


def kernel_arguments(form, batch, query_length: int, key_length: int):
    """`jax.nn.dot_product_attention`'s mask arguments for `form` (right-padded
    masks), and the `(B, Tq)` rows that have a key, or `None` when all do.

    - a padding mask becomes its row's length, `sum(mask)` (the lengths are
      passed as a pair, the other one full, when either is needed);
    - `causal`: `is_causal=True` (query `i` sees keys `j <= i`);
    - a causal window `w` (query `i` sees `i - w < j <= i`):
      `local_window_size=(w - 1, 0)`, the keys `i - (w - 1) <= j <= i`.

    A query row has a key when its query exists, its batch row has one key
    at least, and, with a window `w`, `i < Tk' + w - 1` for the `Tk'` keys
    that exist. The lengths given to the kernel are those rows (at least 1)
    and the keys (at least 1): the kernel computes no row that has nothing
    to attend to, and the caller zeroes the rows that have no key.

    Returns:
        `(arguments, rows)`: a dict of `is_causal`, `local_window_size`,
        `query_seq_lengths`, `key_value_seq_lengths`; `rows` boolean
        `(B, Tq)` or `None`.
    """
    window = form["sliding_window"]
    arguments = {
        "is_causal": form["causal"],
        "local_window_size": None if window is None else (window - 1, 0),
    }
    if not needs_lengths(form, query_length, key_length):
        return arguments, None
    query_lengths = _lengths(form["query_padding_mask"], batch, query_length)
    key_lengths = _lengths(form["key_padding_mask"], batch, key_length)
    rows = ops.where(ops.greater(key_lengths, 0), query_lengths, 0)  # (B,)
    if window is not None:
        rows = ops.minimum(rows, key_lengths + (window - 1))
    arguments["query_seq_lengths"] = ops.maximum(rows, 1)
    arguments["key_value_seq_lengths"] = ops.maximum(key_lengths, 1)
    return arguments, padding_mask_from_lengths(rows, query_length)


def _lengths(padding, batch, length):
    """int32 `(B,)`: the `True`s of each row of a `(B|1, T)` padding mask,
    or `length` for every row without one."""
    if padding is None:
        return ops.full((batch,), length, dtype="int32")
    counts = ops.sum(ops.cast(padding, "int32"), axis=1)  # (B|1,)
    return ops.broadcast_to(counts, (batch,))


def attention_with_lengths(query, key, value, form, scale, implementation):
    """`jax.nn.dot_product_attention` with `form`'s masks as lengths and a
    window (`kernel_arguments`; its padding masks must be right-padded), the
    rows without keys zeroed.

    Args:
        query: `(B, Tq, N, H)`; key, value: `(B, Tk, K, H)`.
        form: `lengths_form`'s dict.
        scale: the logits' multiplier (a number).
        implementation: `jax.nn.dot_product_attention`'s: `"cudnn"`, or
            `"xla"` (its reference semantics, which the CPU tests run).

    Returns:
        `(B, Tq, N, H)` in the dtype of `query`.
    """
    import jax

    batch, query_length = query.shape[0], query.shape[1]
    arguments, rows = kernel_arguments(form, batch, query_length, key.shape[1])
    outputs = jax.nn.dot_product_attention(
        query,
        key,
        value,
        scale=float(scale),
        implementation=implementation,
        **arguments,
    )  # (B, Tq, N, H)
    if rows is None:
        return outputs
    return ops.where(rows[:, :, None, None], outputs, ops.zeros_like(outputs))
