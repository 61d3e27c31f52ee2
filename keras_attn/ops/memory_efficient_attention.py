"""Memory-efficient attention: blocks of queries and keys, no `(Tq, Tk)` tensor.

`softmax(q kᵀ · scale) v` computed a block of queries against a block of keys
at a time, with a running float32 maximum and normaliser per query row
(Rabe & Staats 2021, "Self-attention does not need O(n²) memory"; Dao et al.
2022, FlashAttention). The backward pass is a custom gradient that recomputes
each block's weights from the saved per-row log-normaliser instead of keeping
them, so memory grows linearly with the sequence lengths in both passes.

The masks arrive as their components (key padding, query padding, causal with
an offset, a sliding window, and an optional explicit mask that is read block
by block), so no `(B, N, Tq, Tk)` mask is materialised either; ALiBi's bias is
computed block by block from the same positions. Written with
`keras.ops` only (`ops.map` over one axis of blocks, `ops.fori_loop` over the
other, `ops.custom_gradient`; Python loops on PyTorch), it is tested on
TensorFlow, JAX and PyTorch; on TensorFlow the graph holds no `Xla*` op, so
a SavedModel that uses it loads with TensorFlow alone.

This module holds the function and its custom gradient; the block layout
(block sizes, blocks, per-block masks and dropout) is
`keras_attn.ops.blocked_attention`, the forward and backward passes over the
blocks `keras_attn.ops.blocked_passes`, the argument checks
`keras_attn.ops._checks`.
"""

from __future__ import annotations

import numbers

import keras
from keras import ops

from keras_attn import _validation as v
from keras_attn.ops import _checks, blocked_attention, blocked_passes, counter_random
from keras_attn.ops.blocked_attention import (
    BlockDropout,
    BlockMasks,
    Plan,
    dim,
    from_blocks,
    to_blocks,
)


def memory_efficient_attention(
    query,
    key,
    value,
    *,
    key_padding_mask=None,
    query_padding_mask=None,
    attention_mask=None,
    causal: bool = False,
    causal_offset=0,
    sliding_window: int | None = None,
    alibi_slopes=None,
    scale=None,
    query_block_size: int | None = None,
    key_block_size: int | str | None = "auto",
    dropout_rate: float = 0.0,
    training: bool = False,
    seed_generator=None,
):
    """Scaled dot-product attention in blocks, in memory linear in the lengths.

    Computes what `keras_attn.ops.dot_product_attention` computes with the
    combined mask (outputs and gradients agree to float32 round-off), without
    ever building a `(Tq, Tk)` tensor: queries are taken `query_block_size`
    at a time against `key_block_size` keys at a time, with a running float32
    maximum and normaliser per query row (Rabe & Staats 2021; Dao et al.
    2022). The gradient is a custom one (on every backend) that recomputes
    each block's weights instead of keeping them, so training needs no
    `(Tq, Tk)` memory either.

    Two block layouts:

    - `key_block_size=None`: each query block against all the keys, with an
      ordinary (fused) softmax; blocks of `B·N·bq·Tk` elements;
    - `key_block_size=bk`: key blocks with the online softmax; blocks of
      `B·N·bq·bk` elements whatever the lengths, and blocks that the causal
      mask hides entirely are skipped.

    The backward pass is one sweep in FlashAttention-2's order (Dao 2023)
    either way: key blocks outside, the query blocks that see each inside,
    five block products per block pair. The first layout's backward pass
    takes key blocks of its own (at most `BACKWARD_KEY_BLOCK_SIZE`, of
    equal size for a static length, with at most `BACKWARD_QUERY_BLOCK_SIZE`
    query rows unless `query_block_size` is given), so that it never carries
    a whole length's gradients per step.

    With the default `key_block_size="auto"` the causal mask and the sliding
    window get key blocks of at most `CAUSAL_KEY_BLOCK_SIZE`, of equal size
    for a static length, and skip the blocks they hide (about half of the
    work for the causal mask). On TensorFlow a causal mask without a window
    takes up to 1024 keys and 512 query rows a block (`CAUSAL_BLOCKS`)
    while the keys still make 16 blocks. Either way the causal mask and the
    window are applied only to the block pairs they hide keys of (the
    diagonal's, the window's edges). Other masks get
    all the keys at once, or, where that layout's query blocks would be
    thin (at most `THIN_QUERY_ROWS`, 64, rows: from about 6.6k keys of 8
    heads at batch 1) and the key length is known and more than twice
    `LONG_KEY_BLOCK_SIZE` of the backend (2048 on TensorFlow, 1024 on JAX),
    the fewest key blocks of at most that size, of equal size (on
    TensorFlow also within `LONG_BLOCK_BYTES` with `LONG_QUERY_ROWS` query
    rows). The default `query_block_size=None` takes the most queries (16
    to 256; to 512 in TensorFlow's causal blocks) that keep one block within
    `BLOCK_BYTES` (`LONG_BLOCK_BYTES` in TensorFlow's long layout).
    `blocked_attention.default_layout` decides the key blocks, the query
    rows' bound and the block bytes.

    Grouped-query attention (Ainslie et al. 2023): `key` and `value` may have
    `K` heads for the `N` of `query` (`N` a multiple of `K`; `K = 1` is
    multi-query attention). Query head `n` attends with key/value head
    `n // (N / K)`, the pairing of `keras.layers.GroupQueryAttention` after
    `ops.repeat(key, N // K, axis=2)`, and the result is that of the repeated
    heads; but no key or value is repeated, not even a block: each block
    product stacks the `N / K` query heads of a key head along the rows (a
    reshape), and the key and value gradients, `(B, Tk, K, H|Hv)`, sum over
    them in the same products.

    The logits, the softmax and the accumulation are float32 whatever the
    input dtype; the output is cast to the dtype of `value`. A query row whose
    keys are all masked gets a zero output (and zero gradients).

    Masks are given as components and combined with a logical AND; `True`
    means "attend":

    - `key_padding_mask` `(B, Tk)`: keys that exist;
    - `query_padding_mask` `(B, Tq)`: queries that exist (the others get
      zero outputs);
    - `attention_mask` `(Tq, Tk)`, `(B|1, Tq, Tk)` or `(B|1, N|1, Tq, Tk)`: an
      explicit mask, read block by block (it is `O(Tq·Tk)` itself, so pass the
      components above where they suffice);
    - `causal=True`: query `i` sees key `j` when `j <= i + causal_offset`
      (`causal_offset` is the position of the first query among the keys, as
      in cached decoding; an int or a scalar tensor);
    - `sliding_window=w`: query `i` sees key `j` when
      `|i + causal_offset - j| < w`, the band of
      `keras_attn.ops.sliding_window_mask` (with `causal`, the causal
      window: `0 <= i + causal_offset - j < w`).

    ALiBi (Press et al. 2022) is a component too: with `alibi_slopes`, the
    logit of query `i` and key `j` in head `n` gets
    `alibi_slopes[n] * (j - (i + causal_offset))` after the scale, in
    float32, computed for each block pair from its positions (no `(Tq, Tk)`
    bias either). The bias is a constant of the logits, so the backward pass
    recomputes it with the weights and the gradients of `query`, `key` and
    `value` follow; the slopes themselves get no gradient (ALiBi's are
    fixed).

    Dropout on the weights is applied when `training` and `dropout_rate > 0`:
    each weight is kept with probability `1 - dropout_rate` and scaled by
    `1 / (1 - dropout_rate)`, as `keras.random.dropout` does, from a
    counter-based hash of the seed drawn from `seed_generator` and the
    weight's position, so the backward pass regenerates the same keep mask
    block by block. The draw is not the one the explicit path makes with the
    same seed; its distribution is.

    Args:
        query: `(B, Tq, N, H)`.
        key: `(B, Tk, K, H)`, `K` dividing `N` (`K = N` for multi-head
            attention).
        value: `(B, Tk, K, Hv)`.
        key_padding_mask: optional boolean (or 0/1) `(B, Tk)`.
        query_padding_mask: optional boolean (or 0/1) `(B, Tq)`.
        attention_mask: optional boolean (or 0/1) mask, shapes above.
        causal: whether to apply the causal mask.
        causal_offset: int or scalar int tensor; only used with `causal`,
            `sliding_window` or `alibi_slopes`.
        sliding_window: positive int or `None`, see above.
        alibi_slopes: optional float tensor `(N,)`, one slope per query head
            (`keras_attn.layers.alibi_bias.alibi_slopes`), see above.
        scale: multiplier of the logits; `1/sqrt(H)` by default.
        query_block_size: queries per block (positive int), or `None` for
            the default above.
        key_block_size: keys per block (positive int), `None` for all the
            keys at once, or `"auto"` (see above).
        dropout_rate: float in [0, 1).
        training: whether dropout is active.
        seed_generator: a `keras.random.SeedGenerator` for the dropout; the
            global one when `None` (which JAX does not allow in `jax.jit`).

    Returns:
        `(B, Tq, N, Hv)` in the dtype of `value`.

    Example:

    ```python
    import numpy as np
    from keras_attn.ops import memory_efficient_attention

    x = np.random.default_rng(0).normal(size=(1, 1000, 4, 16)).astype("float32")
    out = memory_efficient_attention(x, x, x, causal=True)
    out.shape  # (1, 1000, 4, 16)
    ```
    """
    query = ops.convert_to_tensor(query)
    key = ops.convert_to_tensor(key)
    value = ops.convert_to_tensor(value)
    groups = _checks.check_heads(query, key, value)
    alibi_slopes = _checks.check_alibi_slopes(alibi_slopes, query.shape[2])
    query_block_size = v.check_positive_int(
        "query_block_size", query_block_size, allow_none=True
    )
    causal = _checks.check_causal(causal)
    sliding_window = v.check_positive_int(
        "sliding_window", sliding_window, allow_none=True
    )
    layout = blocked_attention.default_layout(
        _checks.check_key_block_size(key_block_size),
        dim(key, 1),
        # A batch size known only when run counts as 1.
        batch_heads=(query.shape[0] or 1) * query.shape[2],
        causal=causal,
        windowed=sliding_window is not None,
        backend=keras.backend.backend(),
    )
    dropout_rate = v.check_rate("dropout_rate", dropout_rate)
    causal_offset = _checks.check_causal_offset(causal_offset)
    scale = _checks.check_scale(scale, query)

    batch, query_length = dim(query, 0), dim(query, 1)
    key_length = dim(key, 1)
    # Lengths may be tensors: compare only static ones (this code also runs
    # through AutoGraph, which would turn a tensor condition into a tf.cond).
    if 0 in [n for n in (query_length, key_length) if isinstance(n, int)]:
        return ops.zeros(
            (batch, query_length, dim(query, 2), dim(value, 3)), value.dtype
        )
    plan = Plan(
        query_length,
        key_length,
        query_block_size,
        layout.key_block_size,
        batch_heads=batch * query.shape[2],
        groups=groups,
        max_query_block_size=layout.max_query_block_size,
        block_bytes=layout.block_bytes,
    )
    # The tensors the passes read besides the heads enter `attend` as its
    # arguments, not from its closure: on JAX a custom gradient that closes
    # over tensors made outside it fails under `jax.lax.cond`, `jax.lax.scan`
    # and `jax.checkpoint` ("No constant handler" / "unexpected tracer").
    inputs = {
        "key_padding_mask": _checks.padding_flags(
            "key_padding_mask", key_padding_mask, (key.shape[0], key.shape[1])
        ),
        "query_padding_mask": _checks.padding_flags(
            "query_padding_mask", query_padding_mask, (query.shape[0], query.shape[1])
        ),
        "attention_mask": _checks.explicit_mask(attention_mask, query, key),
        "causal_offset": (
            ops.cast(causal_offset, "int32")
            if causal or sliding_window is not None or alibi_slopes is not None
            else None
        ),
        "alibi_slopes": alibi_slopes,
        "dropout_seed": (
            counter_random.dropout_seed(seed_generator)
            if training and dropout_rate > 0.0
            else None
        ),
        "scale": None if isinstance(scale, numbers.Number) else scale,
    }
    names = tuple(name for name, tensor in inputs.items() if tensor is not None)

    def _masks_and_dropout(plan, given):
        masks = BlockMasks(
            plan,
            key_padding_mask=given["key_padding_mask"],
            query_padding_mask=given["query_padding_mask"],
            attention_mask=given["attention_mask"],
            causal=causal,
            causal_offset=given["causal_offset"],
            sliding_window=sliding_window,
            alibi_slopes=given["alibi_slopes"],
        )
        dropout = (
            None
            if given["dropout_seed"] is None
            else BlockDropout(dropout_rate, given["dropout_seed"], plan)
        )
        return masks, dropout

    @ops.custom_gradient
    def attend(query, key, value, *tensors):
        given = {**dict.fromkeys(inputs), **dict(zip(names, tensors, strict=True))}
        masks, dropout = _masks_and_dropout(plan, given)
        logits_scale = scale if given["scale"] is None else given["scale"]
        # float32 blocks, kept for the backward pass: O(T·H) each.
        scaled_query = ops.multiply(
            ops.cast(query, "float32"), ops.cast(logits_scale, "float32")
        )  # (B, Tq, N, H)
        query_blocks, key_blocks, value_blocks = _blocks(
            plan, scaled_query, ops.cast(key, "float32"), ops.cast(value, "float32")
        )  # (nq, B, N, bq, H), (nk, B, K, bk, H), (nk, B, K, bk, Hv)
        forward = (
            blocked_passes.forward_single
            if plan.single_key_block
            else blocked_passes.forward
        )
        output_blocks, log_normaliser = forward(
            query_blocks,
            key_blocks[0] if plan.single_key_block else key_blocks,
            value_blocks[0] if plan.single_key_block else value_blocks,
            plan,
            masks,
            dropout,
        )  # (nq, B, N, bq, Hv), (nq, B, N, bq, 1)
        output_rows = from_blocks(output_blocks, plan.query_length)  # (B, Tq, N, Hv)
        outputs = ops.cast(output_rows, value.dtype)
        if outputs is output_rows and keras.backend.backend() == "torch":
            # PyTorch makes the returned tensor the autograd node's output,
            # and Keras keeps `grad` on the node: `grad` holding that same
            # tensor would be a cycle (node → grad → tensor → node) that
            # keeps every step's saved blocks until Python's cyclic garbage
            # collector runs. A copy breaks it.
            outputs = ops.copy(output_rows)

        def grad(*args, upstream=None):
            if upstream is None:
                (upstream,) = args
            # Δ_i = Σ_d dO_id · O_id, the softmax-gradient correction per row.
            upstream = ops.cast(upstream, "float32")  # (B, Tq, N, Hv)
            delta = ops.sum(upstream * output_rows, axis=-1, keepdims=True)
            # The one-block layout's backward pass takes key blocks too.
            backward_plan = blocked_attention.backward_plan(
                plan, query_block_size, batch * query.shape[2]
            )
            if backward_plan is plan:
                backward_masks, backward_dropout = masks, dropout
                saved = (query_blocks, key_blocks, value_blocks)
                row_log_normaliser = log_normaliser
            else:
                backward_masks, backward_dropout = _masks_and_dropout(
                    backward_plan, given
                )
                saved = _blocks(
                    backward_plan,
                    scaled_query,
                    ops.cast(key, "float32"),
                    ops.cast(value, "float32"),
                )
                row_log_normaliser = to_blocks(
                    from_blocks(log_normaliser, plan.query_length),
                    backward_plan.query_length,
                    backward_plan.query_block,
                    backward_plan.num_query_blocks,
                )
            rows = (
                backward_plan.query_length,
                backward_plan.query_block,
                backward_plan.num_query_blocks,
            )
            d_query, d_key, d_value = blocked_passes.backward(
                (
                    saved[0],
                    to_blocks(upstream, *rows),
                    row_log_normaliser,
                    to_blocks(delta, *rows),
                ),
                saved[1],
                saved[2],
                backward_plan,
                backward_masks,
                backward_dropout,
            )  # (nq, B, N, bq, H), (nk, B, K, bk, H), (nk, B, K, bk, Hv)
            d_query = ops.multiply(
                from_blocks(d_query, plan.query_length),
                ops.cast(logits_scale, "float32"),
            )  # (B, Tq, N, H)
            return (
                ops.cast(d_query, query.dtype),
                ops.cast(from_blocks(d_key, plan.key_length), key.dtype),
                ops.cast(from_blocks(d_value, plan.key_length), value.dtype),
                *([None] * len(tensors)),  # masks, offset, slopes, seed: fixed
            )

        return outputs, grad

    return attend(query, key, value, *(inputs[name] for name in names))


def _blocks(plan, query, key, value):
    """`query` `(B, Tq, N, H)`, `key` and `value` `(B, Tk, K, H|Hv)` cut into
    the plan's blocks: `(nq, B, N, bq, H)`, `(nk, B, K, bk, H|Hv)`."""
    return (
        to_blocks(query, plan.query_length, plan.query_block, plan.num_query_blocks),
        to_blocks(key, plan.key_length, plan.key_block, plan.num_key_blocks),
        to_blocks(value, plan.key_length, plan.key_block, plan.num_key_blocks),
    )
