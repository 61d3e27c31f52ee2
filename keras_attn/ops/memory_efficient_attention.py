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
other, `ops.custom_gradient`), it is tested on TensorFlow and JAX (the
PyTorch backend runs the same code, untested); on TensorFlow the graph holds no
`Xla*` op, so a SavedModel that uses it loads with TensorFlow alone.
"""

from __future__ import annotations

import math
import numbers

import keras
from keras import ops

from keras_attn import _validation as v
from keras_attn.ops import _hash
from keras_attn.ops.softmax import MASK_VALUE, masked_softmax

# Defaults chosen from indicative timings on a 2-core CPU with TensorFlow
# (docs/LONG_SEQUENCES.md): query blocks of 16 to 256 rows, as many as keep one
# (B, N, bq, bk) float32 block within BLOCK_BYTES; key blocks of
# CAUSAL_KEY_BLOCK_SIZE under a causal mask (whole blocks are skipped), else
# all the keys at once (a fused softmax per query block).
MAX_QUERY_BLOCK_SIZE = 256
MIN_QUERY_BLOCK_SIZE = 16
BLOCK_BYTES = 16 * 2**20
CAUSAL_KEY_BLOCK_SIZE = 512


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
      ordinary (fused) softmax and a single backward sweep; the fastest
      layout, with blocks of `B·N·bq·Tk` elements;
    - `key_block_size=bk`: key blocks with the online softmax; blocks of
      `B·N·bq·bk` elements whatever the lengths, blocks that the causal mask
      hides entirely are skipped, and the backward pass takes two sweeps
      (one for the queries' gradient, one for the keys' and values').

    With the default `key_block_size="auto"` the causal mask and the sliding
    window get key blocks of `CAUSAL_KEY_BLOCK_SIZE` (skipping the blocks
    they hide: about half of the work for the causal mask) and other masks
    all the keys at once; the default `query_block_size=None` takes the
    most queries (16 to 256) that keep one block within `BLOCK_BYTES`.

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
    groups = _check_inputs(query, key, value)
    alibi_slopes = check_alibi_slopes(alibi_slopes, query.shape[2])
    query_block_size = v.check_positive_int(
        "query_block_size", query_block_size, allow_none=True
    )
    if not isinstance(causal, bool):
        raise ValueError(f"`causal` must be a bool. Received: causal={causal!r}")
    sliding_window = v.check_positive_int(
        "sliding_window", sliding_window, allow_none=True
    )
    if isinstance(key_block_size, str):
        if key_block_size != "auto":
            raise ValueError(
                '`key_block_size` must be a positive int, None or "auto". '
                f"Received: key_block_size={key_block_size!r}"
            )
        key_block_size = (
            CAUSAL_KEY_BLOCK_SIZE if causal or sliding_window is not None else None
        )
    key_block_size = v.check_positive_int(
        "key_block_size", key_block_size, allow_none=True
    )
    dropout_rate = v.check_rate("dropout_rate", dropout_rate)
    if isinstance(causal_offset, bool) or (
        isinstance(causal_offset, numbers.Number)
        and not isinstance(causal_offset, numbers.Integral)
    ):
        raise ValueError(
            "`causal_offset` must be an int or a scalar int tensor. "
            f"Received: causal_offset={causal_offset!r}"
        )
    if scale is None and query.shape[-1] is not None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    elif scale is None:  # head size known only when run
        scale = ops.rsqrt(ops.cast(ops.shape(query)[-1], "float32"))
    elif isinstance(scale, bool) or (
        isinstance(scale, numbers.Real) and not math.isfinite(scale)
    ):
        raise ValueError(
            "`scale` must be a finite number or a scalar tensor. "
            f"Received: scale={scale!r}"
        )

    batch, query_length = _dim(query, 0), _dim(query, 1)
    key_length = _dim(key, 1)
    # Lengths may be tensors: compare only static ones (this code also runs
    # through AutoGraph, which would turn a tensor condition into a tf.cond).
    if 0 in [n for n in (query_length, key_length) if isinstance(n, int)]:
        return ops.zeros(
            (batch, query_length, _dim(query, 2), _dim(value, 3)), value.dtype
        )
    plan = _Plan(
        query_length,
        key_length,
        query_block_size,
        key_block_size,
        batch_heads=batch * query.shape[2],
        groups=groups,
    )
    masks = _Masks(
        plan,
        key_padding_mask=_boolean_mask(
            "key_padding_mask", key_padding_mask, (key.shape[0], key.shape[1])
        ),
        query_padding_mask=_boolean_mask(
            "query_padding_mask", query_padding_mask, (query.shape[0], query.shape[1])
        ),
        attention_mask=_explicit_mask(attention_mask, query, key),
        causal=causal,
        causal_offset=(
            ops.cast(causal_offset, "int32")
            if causal or sliding_window is not None or alibi_slopes is not None
            else None
        ),
        sliding_window=sliding_window,
        alibi_slopes=alibi_slopes,
    )
    dropout = None
    if training and dropout_rate > 0.0:
        dropout = _Dropout(dropout_rate, seed_generator, plan)

    @ops.custom_gradient
    def attend(query, key, value):
        # float32 blocks, kept for the backward pass: O(T·H) each.
        query_blocks = _to_blocks(
            ops.multiply(ops.cast(query, "float32"), ops.cast(scale, "float32")),
            plan.query_length,
            plan.query_block,
            plan.num_query_blocks,
        )  # (nq, B, N, bq, H), scaled
        key_blocks = _to_blocks(
            ops.cast(key, "float32"),
            plan.key_length,
            plan.key_block,
            plan.num_key_blocks,
        )  # (nk, B, K, bk, H)
        value_blocks = _to_blocks(
            ops.cast(value, "float32"),
            plan.key_length,
            plan.key_block,
            plan.num_key_blocks,
        )  # (nk, B, K, bk, Hv)
        if plan.single_key_block:
            output_blocks = _forward_single(
                query_blocks, key_blocks[0], value_blocks[0], plan, masks, dropout
            )  # (nq, B, N, bq, Hv)
        else:
            output_blocks, log_normaliser = _forward(
                query_blocks, key_blocks, value_blocks, plan, masks, dropout
            )  # (nq, B, N, bq, Hv), (nq, B, N, bq, 1)
        outputs = ops.cast(
            _from_blocks(output_blocks, plan.query_length), value.dtype
        )  # (B, Tq, N, Hv)

        def grad(*args, upstream=None):
            if upstream is None:
                (upstream,) = args
            upstream_blocks = _to_blocks(
                ops.cast(upstream, "float32"),
                plan.query_length,
                plan.query_block,
                plan.num_query_blocks,
            )  # (nq, B, N, bq, Hv)
            # Δ_i = Σ_d dO_id · O_id, the softmax-gradient correction per row.
            delta = ops.sum(
                ops.multiply(upstream_blocks, output_blocks), axis=-1, keepdims=True
            )  # (nq, B, N, bq, 1)
            if plan.single_key_block:
                d_query, d_key, d_value = _backward_single(
                    (query_blocks, upstream_blocks, delta),
                    key_blocks[0],
                    value_blocks[0],
                    plan,
                    masks,
                    dropout,
                )  # (nq, B, N, bq, H), (B, K, Tk, H), (B, K, Tk, Hv)
                d_key, d_value = d_key[None], d_value[None]
            else:
                saved = (query_blocks, upstream_blocks, log_normaliser, delta)
                d_query = _backward_query(
                    saved, key_blocks, value_blocks, plan, masks, dropout
                )
                d_key, d_value = _backward_key_value(
                    saved, key_blocks, value_blocks, plan, masks, dropout
                )
            d_query = ops.multiply(
                _from_blocks(d_query, plan.query_length), ops.cast(scale, "float32")
            )  # (B, Tq, N, H)
            return (
                ops.cast(d_query, query.dtype),
                ops.cast(_from_blocks(d_key, plan.key_length), key.dtype),
                ops.cast(_from_blocks(d_value, plan.key_length), value.dtype),
            )

        return outputs, grad

    return attend(query, key, value)


# -- arguments ----------------------------------------------------------------


def _check_inputs(query, key, value):
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
        if size is not None and other_size is not None and size != other_size:
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
    if value_shape is not None and not (
        value_shape[2] is None or key_heads is None or value_shape[2] == key_heads
    ):
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
    if len(shape) != 1 or (
        shape[0] is not None and num_heads is not None and shape[0] != num_heads
    ):
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


def alibi_bias(slopes, key_positions, query_positions):
    """ALiBi's bias `slope * (key - query)`: `(N, Tq, Tk)` float32.

    What `keras_attn.layers.alibi_bias.alibi_bias(slopes, key_positions,
    query_positions)` computes for float32 slopes, without its argument
    checks (it runs once per block pair) and without importing the layers
    (which import these ops).

    Args:
        slopes: float32 `(N,)`.
        key_positions: int32 `(Tk,)`.
        query_positions: int32 `(Tq,)`.
    """
    distance = key_positions[None, :] - query_positions[:, None]  # (Tq, Tk)
    return slopes[:, None, None] * ops.cast(distance, "float32")[None]


def _boolean_mask(name, mask, expected_shape):
    """A `(B, T)` padding mask as bool, its static shape checked."""
    if mask is None:
        return None
    mask = ops.convert_to_tensor(mask)
    shape = tuple(mask.shape)
    if len(shape) != 2 or any(
        got is not None and want is not None and got != want
        for got, want in zip(shape, expected_shape, strict=True)
    ):
        raise ValueError(
            f"`{name}` must have shape {tuple(expected_shape)} (batch, length). "
            f"Received: {name}.shape={shape}"
        )
    return mask if _is_bool(mask) else ops.not_equal(mask, 0)


def _explicit_mask(mask, query, key):
    """The explicit mask as `(B|1, N|1, Tq, Tk)` bool."""
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
        got is None or want is None or got == want or (axis < 2 and got == 1)
        for axis, (got, want) in enumerate(zip(shape4, expected, strict=True))
    )
    if not valid:
        raise ValueError(
            "`attention_mask` must have shape (Tq, Tk), (batch|1, Tq, Tk) or "
            f"(batch|1, heads|1, Tq, Tk) with Tq={query.shape[1]} and "
            f"Tk={key.shape[1]}. Received: attention_mask.shape={shape}"
        )
    return mask if _is_bool(mask) else ops.not_equal(mask, 0)


# -- block layout ---------------------------------------------------------------


def _is_bool(mask) -> bool:
    return keras.backend.standardize_dtype(mask.dtype) == "bool"


def _dim(x, axis):
    """Static size of `x`'s axis when known, else a scalar tensor."""
    size = x.shape[axis]
    return size if size is not None else ops.shape(x)[axis]


def _ceil_div(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return -(-a // b)
    return ops.floor_divide(a + b - 1, b)


class _Plan:
    """Block sizes and counts; ints when the lengths are static, else tensors."""

    def __init__(
        self,
        query_length,
        key_length,
        query_block_size,
        key_block_size,
        batch_heads,
        groups=1,
    ):
        self.query_length, self.key_length = query_length, key_length
        # Query heads per key/value head (grouped-query attention).
        self.groups = groups
        if key_block_size is None:
            self.key_block, self.num_key_blocks = key_length, 1
            self.padded_key_length = key_length
        else:
            self.key_block = _block_size(key_length, key_block_size)
            self.num_key_blocks = _ceil_div(key_length, self.key_block)
            self.padded_key_length = self.num_key_blocks * self.key_block
        if query_block_size is None:
            query_block_size = _default_query_block_size(batch_heads, self.key_block)
        self.query_block = _block_size(query_length, query_block_size)
        self.num_query_blocks = _ceil_div(query_length, self.query_block)
        # One block of all the keys: a plain softmax per query block, and a
        # backward pass that needs no second sweep.
        self.single_key_block = (
            isinstance(self.num_key_blocks, int) and self.num_key_blocks == 1
        )
        self.padded_query_length = self.num_query_blocks * self.query_block
        # Keys past key_length exist only as padding: they must be masked.
        self.keys_padded = self.padded_key_length is not key_length and not (
            isinstance(self.padded_key_length, int)
            and isinstance(key_length, int)
            and self.padded_key_length == key_length
        )


def _default_query_block_size(batch_heads, key_block):
    """The most query rows, a multiple of 16 in [16, 256], that keep a
    `(B, N, bq, bk)` float32 block within BLOCK_BYTES."""
    per_row = batch_heads * key_block * 4  # bytes of one query row of a block
    if isinstance(per_row, int):
        rows = BLOCK_BYTES // max(per_row, 1) // 16 * 16
        return min(max(rows, MIN_QUERY_BLOCK_SIZE), MAX_QUERY_BLOCK_SIZE)
    rows = ops.floor_divide(BLOCK_BYTES, ops.maximum(ops.cast(per_row, "int32"), 1))
    rows = ops.floor_divide(rows, 16) * 16
    return ops.clip(rows, MIN_QUERY_BLOCK_SIZE, MAX_QUERY_BLOCK_SIZE)


def _block_size(length, block_size):
    """`min(length, block_size)`, at least 1 (no padding past a short length)."""
    if isinstance(length, int) and isinstance(block_size, int):
        return max(1, min(length, block_size))
    return ops.maximum(
        ops.minimum(ops.cast(length, "int32"), ops.cast(block_size, "int32")), 1
    )


def _to_blocks(x, length, block, num_blocks):
    """`(B, T, N, H) -> (n, B, N, b, H)`, zero-padded to `n·b` positions."""
    batch, heads, width = _dim(x, 0), _dim(x, 2), _dim(x, 3)
    x = ops.pad(x, [[0, 0], [0, num_blocks * block - length], [0, 0], [0, 0]])
    x = ops.reshape(x, (batch, num_blocks, block, heads, width))  # (B, n, b, N, H)
    return ops.transpose(x, (1, 0, 3, 2, 4))  # (n, B, N, b, H)


def _from_blocks(x, length):
    """`(n, B, N, b, H) -> (B, T, N, H)`, the padding cut off."""
    num_blocks, batch, heads, block, width = (_dim(x, axis) for axis in range(5))
    x = ops.transpose(x, (1, 0, 3, 2, 4))  # (B, n, b, N, H)
    x = ops.reshape(x, (batch, num_blocks * block, heads, width))  # (B, n·b, N, H)
    return x[:, :length]


def _flags_to_blocks(mask, padded_length, block, num_blocks):
    """`(B, T)` bool -> `(n, B, b)`, padded with `False`."""
    batch = _dim(mask, 0)
    mask = ops.pad(mask, [[0, 0], [0, padded_length - _dim(mask, 1)]])
    mask = ops.reshape(mask, (batch, num_blocks, block))  # (B, n, b)
    return ops.transpose(mask, (1, 0, 2))  # (n, B, b)


class _Masks:
    """The mask components, laid out for reading one block pair at a time."""

    def __init__(
        self,
        plan,
        key_padding_mask,
        query_padding_mask,
        attention_mask,
        causal,
        causal_offset,
        sliding_window,
        alibi_slopes=None,
    ):
        self.plan = plan
        self.causal, self.causal_offset = causal, causal_offset
        self.window = sliding_window
        # Not a mask but also a function of the block pair's positions. A
        # copy, made where this call is traced: the backward pass reads the
        # slopes, and on TensorFlow a gradient function that reads an eager
        # tensor (slopes made outside a `tf.function`) breaks the gradient of
        # a `tf.cond` around this call ("Tensor.graph is undefined when eager
        # execution is enabled"), as in `dot_product_attention`'s by-length
        # branch.
        self.alibi = None if alibi_slopes is None else ops.copy(alibi_slopes)
        key_valid = key_padding_mask
        if key_valid is None and plan.keys_padded:
            key_valid = ops.ones((1, plan.key_length), "bool")  # (1, Tk)
        self.key_blocks = (
            None
            if key_valid is None
            else _flags_to_blocks(
                key_valid, plan.padded_key_length, plan.key_block, plan.num_key_blocks
            )
        )  # (nk, B|1, bk)
        self.query_blocks = (
            None
            if query_padding_mask is None
            else _flags_to_blocks(
                query_padding_mask,
                plan.padded_query_length,
                plan.query_block,
                plan.num_query_blocks,
            )
        )  # (nq, B, bq)
        self.explicit = None
        if attention_mask is not None:
            self.explicit = ops.pad(
                attention_mask,
                [
                    [0, 0],
                    [0, 0],
                    [0, plan.padded_query_length - _dim(attention_mask, 2)],
                    [0, plan.padded_key_length - _dim(attention_mask, 3)],
                ],
            )  # (B|1, N|1, Tq', Tk'), False in the padding
            self.explicit_batch = _dim(attention_mask, 0)
            self.explicit_heads = _dim(attention_mask, 1)

    @property
    def any(self):
        return (
            self.causal
            or self.window is not None
            or self.key_blocks is not None
            or self.query_blocks is not None
            or self.explicit is not None
        )

    def block(self, i, j, query_flags, key_flags):
        """Boolean mask of block pair `(i, j)`, `(B|1, N|1, bq|1, bk|1)`, or None.

        `query_flags` `(B, bq)` and `key_flags` `(B|1, bk)` are the padding
        flags of the two blocks (or None).
        """
        plan = self.plan
        mask = None
        if key_flags is not None:
            mask = key_flags[:, None, None, :]  # (B|1, 1, 1, bk)
        if query_flags is not None:
            rows = query_flags[:, None, :, None]  # (B, 1, bq, 1)
            mask = rows if mask is None else ops.logical_and(mask, rows)
        if self.causal or self.window is not None:
            query_positions, key_positions = self.positions(i, j)
            distance = query_positions[:, None] - key_positions[None, :]  # (bq, bk)
            visible = None
            if self.causal:
                visible = ops.greater_equal(distance, 0)
            if self.window is not None:
                band = ops.less(distance, self.window)
                if not self.causal:
                    band = ops.logical_and(band, ops.greater(distance, -self.window))
                visible = band if visible is None else ops.logical_and(visible, band)
            visible = visible[None, None]  # (1, 1, bq, bk)
            mask = visible if mask is None else ops.logical_and(mask, visible)
        if self.explicit is not None:
            explicit = ops.slice(
                self.explicit,
                [0, 0, i * plan.query_block, j * plan.key_block],
                [
                    self.explicit_batch,
                    self.explicit_heads,
                    plan.query_block,
                    plan.key_block,
                ],
            )  # (B|1, N|1, bq, bk)
            mask = explicit if mask is None else ops.logical_and(mask, explicit)
        return mask

    def positions(self, i, j):
        """Positions among the keys of block pair `(i, j)`'s queries `(bq,)`
        (their index plus the offset) and keys `(bk,)`, int32."""
        plan = self.plan
        query_positions = (
            i * plan.query_block
            + ops.arange(plan.query_block, dtype="int32")
            + self.causal_offset
        )  # (bq,)
        key_positions = j * plan.key_block + ops.arange(
            plan.key_block, dtype="int32"
        )  # (bk,)
        return query_positions, key_positions

    def add_bias(self, logits, i, j):
        """`logits` `(B, N, bq, bk)` of block pair `(i, j)` plus its ALiBi
        bias `(1, N, bq, bk)`, when there is one."""
        if self.alibi is None:
            return logits
        query_positions, key_positions = self.positions(i, j)
        return logits + alibi_bias(self.alibi, key_positions, query_positions)[None]

    def key_block_range(self, i):
        """Key blocks `[start, end)` that query block `i` can see."""
        plan = self.plan
        if not self.causal and self.window is None:
            return 0, plan.num_key_blocks
        # Positions among the keys of the block's first and last query.
        first = i * plan.query_block + self.causal_offset
        last = first + plan.query_block - 1
        start, end = 0, plan.num_key_blocks
        if self.causal:  # keys j <= last
            end = ops.floor_divide(last, plan.key_block) + 1
        if self.window is not None:  # keys j > first - window
            start = ops.floor_divide(first - self.window + 1, plan.key_block)
            if not self.causal:  # keys j < last + window
                end = ops.floor_divide(last + self.window - 1, plan.key_block) + 1
        return _range(start, end, plan.num_key_blocks)

    def query_block_range(self, j):
        """Query blocks `[start, end)` that can see key block `j`."""
        plan = self.plan
        if not self.causal and self.window is None:
            return 0, plan.num_query_blocks
        # Query indices q whose position q + offset sees a key of block j.
        first_key = j * plan.key_block
        last_key = first_key + plan.key_block - 1
        start, end = 0, plan.num_query_blocks
        if self.causal:  # q + offset >= first_key
            start = ops.floor_divide(first_key - self.causal_offset, plan.query_block)
        if self.window is not None:  # q + offset < last_key + window
            last_query = last_key + self.window - 1 - self.causal_offset
            end = ops.floor_divide(last_query, plan.query_block) + 1
            if not self.causal:  # q + offset > first_key - window
                start = ops.floor_divide(
                    first_key - self.window + 1 - self.causal_offset, plan.query_block
                )
        return _range(start, end, plan.num_query_blocks)


def _range(start, end, num_blocks):
    """`[start, end)` clipped to `[0, num_blocks]`, empty rather than reversed."""
    if not isinstance(start, int):  # else 0: the bounds left as they are
        start = ops.clip(start, 0, num_blocks)
    if not isinstance(end, int):
        end = ops.maximum(ops.clip(end, 0, num_blocks), start)
    return start, end


# -- dropout --------------------------------------------------------------------


class _Dropout:
    """Keep masks that any pass can regenerate for any block pair.

    The keep decision of weight `(b, n, q, k)` is a hash of a seed drawn once
    per call, the row `(b, n, q)` and the key `k`: uniform 32-bit values
    compared with `rate · 2³²`.
    """

    def __init__(self, rate, seed_generator, plan):
        self.rate, self.plan = rate, plan
        seed = keras.random.randint(
            (), 0, 2**31 - 1, dtype="int32", seed=seed_generator
        )
        self.seed = _hash.mix(_hash.u32(seed))
        self.threshold = _hash.u32(min(round(rate * 2**32), 2**32 - 1))

    def scale(self, i, j, batch, heads):
        """Dropout factors of block pair `(i, j)`: `(B, N, bq, bk)` float32 of
        0 or `1 / (1 - rate)`."""
        plan = self.plan
        rows = _hash.add(
            _hash.multiply(
                _hash.u32(
                    ops.reshape(
                        ops.arange(batch * heads, dtype="int32"), (batch, heads, 1, 1)
                    )
                ),
                _hash.u32(plan.padded_query_length),
            ),
            _hash.u32(
                i * plan.query_block
                + ops.reshape(
                    ops.arange(plan.query_block, dtype="int32"), (1, 1, -1, 1)
                )
            ),
        )  # (B, N, bq, 1): the row's index among all rows
        row_hash = _hash.mix(ops.bitwise_xor(rows, self.seed))
        keys = _hash.u32(
            j * plan.key_block + ops.arange(plan.key_block, dtype="int32")
        )  # (bk,)
        bits = _hash.mix(
            _hash.add(row_hash, _hash.multiply(keys, _hash.u32(_hash.GOLDEN)))
        )
        keep = ops.greater_equal(bits, self.threshold)  # (B, N, bq, bk)
        return ops.multiply(ops.cast(keep, "float32"), 1.0 / (1.0 - self.rate))


# -- the passes -------------------------------------------------------------------
#
# Layouts: `query_blocks` (nq, B, N, bq, H) holds the queries times the scale;
# `key_blocks` (nk, B, K, bk, H), `value_blocks` (nk, B, K, bk, Hv), with
# `K = N / G` key/value heads (`G = plan.groups`, 1 for multi-head attention:
# the matmuls group the query heads, see `_group`); per-row
# statistics are (…, bq, 1). Masked logits are set to MASK_VALUE, far enough
# below any real logit that their exponentials underflow to exactly 0 once a
# row has met a valid key; rows that never do are zeroed at the end.


def _group(x, groups):
    """`(B, N, b, D)` -> `(B, K, G·b, D)`: the `G = groups` consecutive query
    heads of each key/value head stacked along the rows (a reshape, no copy),
    so that one batched matmul pairs query head `n` with key/value head
    `n // G` and no key or value is repeated."""
    if groups == 1:
        return x
    batch, heads, width = _dim(x, 0), _dim(x, 1), _dim(x, 3)
    return ops.reshape(x, (batch, heads // groups, -1, width))


def _ungroup(x, groups):
    """`(B, K, G·b, D)` -> `(B, N, b, D)`, the inverse of `_group`."""
    if groups == 1:
        return x
    batch, key_heads, width = _dim(x, 0), _dim(x, 1), _dim(x, 3)
    return ops.reshape(x, (batch, key_heads * groups, -1, width))


def _scores(rows, keys, groups):
    """`rows @ keysᵀ`: `(B, N, b, D) x (B, K, bk, D) -> (B, N, b, bk)` (the
    logits from the queries, or the weights' gradient from the upstream
    gradient and the values)."""
    return _ungroup(
        ops.matmul(_group(rows, groups), ops.transpose(keys, (0, 1, 3, 2))), groups
    )


def _weighted(weights, keys, groups):
    """`weights @ keys`: `(B, N, b, bk) x (B, K, bk, D) -> (B, N, b, D)` (the
    outputs from the values, or the queries' gradient from the keys)."""
    return _ungroup(ops.matmul(_group(weights, groups), keys), groups)


def _key_side(weights, rows, groups):
    """`weightsᵀ @ rows`: `(B, N, b, bk), (B, N, b, D) -> (B, K, bk, D)`, a
    key or value gradient, summed over the query heads of each group (the
    matmul over the stacked rows of the group sums them)."""
    return ops.matmul(
        ops.transpose(_group(weights, groups), (0, 1, 3, 2)), _group(rows, groups)
    )


def _masked_logits(query, key, i, j, masks, query_flags, key_flags):
    """Logits `(B, N, bq, bk)` float32 of block pair `(i, j)`, masked entries
    at MASK_VALUE, and the block's mask (or None)."""
    logits = _scores(query, key, masks.plan.groups)
    logits = masks.add_bias(logits, i, j)
    mask = masks.block(i, j, query_flags, key_flags) if masks.any else None
    if mask is not None:
        logits = ops.where(mask, logits, MASK_VALUE)
    return logits, mask


def _fori_loop(lower, upper, body, init):
    """`ops.fori_loop` that runs one iteration at a time on every backend.

    On TensorFlow, `keras.ops.fori_loop` is a `tf.while_loop` with its default
    `parallel_iterations=10`: the block products of later iterations depend
    only on the counter, so up to ten blocks' temporaries would be alive at
    once (and ten times that with a loop inside a loop). There is no public
    Keras argument for it, hence the TensorFlow call here.
    """
    if keras.backend.backend() != "tensorflow":
        return ops.fori_loop(lower, upper, body, init)
    import tensorflow as tf

    return tf.while_loop(
        lambda i, _: i < upper,
        lambda i, carry: (i + 1, body(i, carry)),
        (lower, init),
        parallel_iterations=1,
    )[1]


def _map(f, xs, num_outputs: int = 1):
    """`ops.map` that runs one element at a time on every backend.

    On TensorFlow, `keras.ops.map` is a `tf.map_fn` with up to ten elements in
    flight (and it calls `f` once more to learn the output signature): see
    `_fori_loop`. `f` returns `num_outputs` float32 tensors (one tensor, or a
    tuple of them).
    """
    if keras.backend.backend() != "tensorflow":
        return ops.map(f, xs)
    import tensorflow as tf

    spec = tf.TensorSpec(None, "float32")
    signature = spec if num_outputs == 1 else (spec,) * num_outputs
    return tf.map_fn(f, xs, fn_output_signature=signature, parallel_iterations=1)


def _take(blocks, index):
    return None if blocks is None else ops.take(blocks, index, axis=0)


def _flags_or_dummy(flags, num_blocks):
    """`ops.map` needs tensors: a `(n,)` stand-in when there are no flags."""
    return ops.zeros((num_blocks,), "bool") if flags is None else flags


def _real_flags(flags, masks_flags):
    return None if masks_flags is None else flags


def _block_index_mask(num_blocks, i):
    """`(n, 1, 1, 1, 1)` bool, True at block `i`."""
    return ops.reshape(
        ops.equal(ops.arange(num_blocks, dtype="int32"), i), (-1, 1, 1, 1, 1)
    )


# One block of all the keys: each query block is an ordinary masked softmax.


def _single_block_weights(query, key, i, masks, query_flags, key_flags):
    """Weights `(B, N, bq, Tk)` float32 of query block `i` against all keys."""
    logits = _scores(query, key, masks.plan.groups)  # (B, N, bq, Tk)
    logits = masks.add_bias(logits, i, 0)
    mask = masks.block(i, 0, query_flags, key_flags) if masks.any else None
    return masked_softmax(logits, mask)


def _forward_single(query_blocks, key, value, plan, masks, dropout):
    """Outputs `(nq, B, N, bq, Hv)`; `key` `(B, K, Tk, H)`, `value` `(B, K, Tk, Hv)`."""
    batch, heads = _dim(query_blocks, 1), _dim(query_blocks, 2)
    key_flags = _take(masks.key_blocks, 0)  # (B|1, Tk) or None

    def query_block(elements):
        query, query_flags, i = elements  # (B, N, bq, H), (B, bq), ()
        query_flags = _real_flags(query_flags, masks.query_blocks)
        weights = _single_block_weights(query, key, i, masks, query_flags, key_flags)
        if dropout is not None:
            weights = weights * dropout.scale(i, 0, batch, heads)
        return _weighted(weights, value, plan.groups)  # (B, N, bq, Hv)

    return _map(
        query_block,
        (
            query_blocks,
            _flags_or_dummy(masks.query_blocks, plan.num_query_blocks),
            ops.arange(plan.num_query_blocks, dtype="int32"),
        ),
    )


def _backward_single(saved, key, value, plan, masks, dropout):
    """Gradients of the scaled query blocks, of the keys and of the values in
    one sweep over the query blocks."""
    query_blocks, upstream_blocks, delta = saved
    batch, heads = _dim(query_blocks, 1), _dim(query_blocks, 2)
    key_flags = _take(masks.key_blocks, 0)

    def query_step(i, carry):
        d_query, d_key, d_value = carry
        query = ops.take(query_blocks, i, axis=0)  # (B, N, bq, H)
        upstream = ops.take(upstream_blocks, i, axis=0)  # (B, N, bq, Hv)
        weights = _single_block_weights(
            query, key, i, masks, _take(masks.query_blocks, i), key_flags
        )  # (B, N, bq, Tk)
        d_weights = _scores(upstream, value, plan.groups)  # (B, N, bq, Tk)
        dropped = weights
        if dropout is not None:
            factors = dropout.scale(i, 0, batch, heads)
            dropped, d_weights = weights * factors, d_weights * factors
        d_value = d_value + _key_side(dropped, upstream, plan.groups)  # (B, K, Tk, Hv)
        d_logits = weights * (d_weights - ops.take(delta, i, axis=0))
        d_key = d_key + _key_side(d_logits, query, plan.groups)  # (B, K, Tk, H)
        block_d_query = _weighted(d_logits, key, plan.groups)  # (B, N, bq, H)
        d_query = ops.where(
            _block_index_mask(plan.num_query_blocks, i), block_d_query[None], d_query
        )  # (nq, B, N, bq, H)
        return d_query, d_key, d_value

    return _fori_loop(
        0,
        plan.num_query_blocks,
        query_step,
        (ops.zeros_like(query_blocks), ops.zeros_like(key), ops.zeros_like(value)),
    )


# Key blocks: an online softmax over them, and two backward sweeps.


def _forward(query_blocks, key_blocks, value_blocks, plan, masks, dropout):
    """Outputs `(nq, B, N, bq, Hv)` and log-normalisers `(nq, B, N, bq, 1)`.

    Each block pair contributes its block-normalised output `softmax(s) v`
    and its log-normaliser; the running output is the mixture of the blocks'
    outputs weighted by their share of the row's total normaliser.
    """
    batch, heads = _dim(query_blocks, 1), _dim(query_blocks, 2)

    def query_block(elements):
        query, query_flags, i = elements  # (B, N, bq, H), (B, bq), ()
        query_flags = _real_flags(query_flags, masks.query_blocks)
        rows = (batch, heads, plan.query_block, 1)

        def key_step(j, carry):
            log_normaliser, outputs = carry  # (B, N, bq, 1), (B, N, bq, Hv)
            logits, _ = _masked_logits(
                query,
                ops.take(key_blocks, j, axis=0),
                i,
                j,
                masks,
                query_flags,
                _take(masks.key_blocks, j),
            )  # (B, N, bq, bk)
            weights = ops.softmax(logits, axis=-1)  # block-normalised
            # The largest block weight is exp(0) / Σ exp(s - max s).
            block_log_normaliser = ops.max(logits, axis=-1, keepdims=True) - ops.log(
                ops.max(weights, axis=-1, keepdims=True)
            )  # (B, N, bq, 1)
            if dropout is not None:
                weights = weights * dropout.scale(i, j, batch, heads)
            block_outputs = _weighted(
                weights, ops.take(value_blocks, j, axis=0), plan.groups
            )  # (B, N, bq, Hv)
            new_log_normaliser = ops.logaddexp(log_normaliser, block_log_normaliser)
            outputs = outputs * ops.exp(
                log_normaliser - new_log_normaliser
            ) + block_outputs * ops.exp(block_log_normaliser - new_log_normaliser)
            return new_log_normaliser, outputs

        start, end = masks.key_block_range(i)
        log_normaliser, outputs = _fori_loop(
            start,
            end,
            key_step,
            (
                ops.full(rows, 2.0 * MASK_VALUE, "float32"),
                ops.zeros(
                    (batch, heads, plan.query_block, _dim(value_blocks, 4)), "float32"
                ),
            ),
        )
        # A row that met no valid key has a log-normaliser near MASK_VALUE.
        has_keys = ops.greater(log_normaliser, 0.5 * MASK_VALUE)  # (B, N, bq, 1)
        outputs = ops.where(has_keys, outputs, 0.0)
        # 0 for those rows, so that exp(MASK_VALUE - 0) = 0 when recomputing.
        log_normaliser = ops.where(has_keys, log_normaliser, 0.0)
        return outputs, log_normaliser

    return _map(
        query_block,
        (
            query_blocks,
            _flags_or_dummy(masks.query_blocks, plan.num_query_blocks),
            ops.arange(plan.num_query_blocks, dtype="int32"),
        ),
        num_outputs=2,
    )


def _block_weights(query, log_normaliser, key, i, j, masks, query_flags, key_flags):
    """Recomputed normalised weights `(B, N, bq, bk)` float32 of block `(i, j)`."""
    logits, _ = _masked_logits(query, key, i, j, masks, query_flags, key_flags)
    return ops.exp(logits - log_normaliser)


def _backward_query(saved, key_blocks, value_blocks, plan, masks, dropout):
    """Gradients of the scaled query blocks: `(nq, B, N, bq, H)`."""
    query_blocks, upstream_blocks, log_normaliser, delta = saved
    batch, heads = _dim(query_blocks, 1), _dim(query_blocks, 2)

    def query_block(elements):
        query, upstream, row_log_normaliser, row_delta, query_flags, i = elements
        query_flags = _real_flags(query_flags, masks.query_blocks)

        def key_step(j, d_query):
            key = ops.take(key_blocks, j, axis=0)  # (B, K, bk, H)
            value = ops.take(value_blocks, j, axis=0)  # (B, K, bk, Hv)
            weights = _block_weights(
                query,
                row_log_normaliser,
                key,
                i,
                j,
                masks,
                query_flags,
                _take(masks.key_blocks, j),
            )  # (B, N, bq, bk)
            d_weights = _scores(upstream, value, plan.groups)  # (B, N, bq, bk)
            if dropout is not None:
                d_weights = d_weights * dropout.scale(i, j, batch, heads)
            d_logits = weights * (d_weights - row_delta)  # (B, N, bq, bk)
            return d_query + _weighted(d_logits, key, plan.groups)

        start, end = masks.key_block_range(i)
        return _fori_loop(start, end, key_step, ops.zeros_like(query))

    return _map(
        query_block,
        (
            query_blocks,
            upstream_blocks,
            log_normaliser,
            delta,
            _flags_or_dummy(masks.query_blocks, plan.num_query_blocks),
            ops.arange(plan.num_query_blocks, dtype="int32"),
        ),
    )


def _backward_key_value(saved, key_blocks, value_blocks, plan, masks, dropout):
    """Gradients of the key and value blocks: `(nk, B, K, bk, H|Hv)` each."""
    query_blocks, upstream_blocks, log_normaliser, delta = saved
    batch, heads = _dim(query_blocks, 1), _dim(query_blocks, 2)

    def key_block(elements):
        key, value, key_flags, j = elements
        key_flags = _real_flags(key_flags, masks.key_blocks)

        def query_step(i, carry):
            d_key, d_value = carry
            query = ops.take(query_blocks, i, axis=0)  # (B, N, bq, H)
            upstream = ops.take(upstream_blocks, i, axis=0)  # (B, N, bq, Hv)
            weights = _block_weights(
                query,
                ops.take(log_normaliser, i, axis=0),
                key,
                i,
                j,
                masks,
                _take(masks.query_blocks, i),
                key_flags,
            )  # (B, N, bq, bk)
            d_weights = _scores(upstream, value, plan.groups)  # (B, N, bq, bk)
            dropped = weights
            if dropout is not None:
                factors = dropout.scale(i, j, batch, heads)
                dropped, d_weights = weights * factors, d_weights * factors
            d_value = d_value + _key_side(
                dropped, upstream, plan.groups
            )  # (B, K, bk, Hv)
            d_logits = weights * (d_weights - ops.take(delta, i, axis=0))
            d_key = d_key + _key_side(d_logits, query, plan.groups)  # (B, K, bk, H)
            return d_key, d_value

        start, end = masks.query_block_range(j)
        return _fori_loop(
            start, end, query_step, (ops.zeros_like(key), ops.zeros_like(value))
        )

    return _map(
        key_block,
        (
            key_blocks,
            value_blocks,
            _flags_or_dummy(masks.key_blocks, plan.num_key_blocks),
            ops.arange(plan.num_key_blocks, dtype="int32"),
        ),
        num_outputs=2,
    )
