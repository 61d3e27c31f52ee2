"""Self-attention by Pallas's Triton kernel on JAX: float32 on NVIDIA GPUs.

In float32 no cuDNN kernel runs attention, and the memory-efficient path's
blocks, sized for a CPU's caches, cost about twice the explicit path's time
on a GPU. Pallas's FlashAttention kernel
(`jax.experimental.pallas.ops.gpu.attention.mha`, forward and backward in
Triton) is within 1.1 times the explicit path's time from 4,096 tokens at a
few MiB of memory (BENCHMARKS, "GPU", third run: an H200). This module
decides which calls it can take (`pallas_form`) and makes the call
(`pallas_attention`); `keras_attn.ops.dot_product_attention` takes it where
the memory-efficient path would run otherwise, on a GPU (`pallas_runs`).

The kernel computes self-attention-shaped calls: as many keys as queries,
one head size for queries, keys and values, query and key heads paired one
to one (grouped key/value heads are repeated), its own causal mask (query
`i` sees keys `j <= i`), and one `(B, T)` array of segment ids for queries
and keys alike, a query seeing the keys of its own segment. Padding reaches
it as segment ids where the key and query padding masks are the same mask
(self-attention's): the padded queries see the padded keys and are zeroed
afterwards, as every path zeroes them. The lengths are padded to its block
(128) with a segment of their own. Other masks, windows, ALiBi, dropout and
causal offsets stay on the memory-efficient path.
"""

from __future__ import annotations

import numbers

from keras import ops

# The kernel's blocks: 128 queries by 128 keys forward, 64 by 64 backward
# (the faster of the two sizes measured, BENCHMARKS "GPU").
BLOCK = 128
BACKWARD_BLOCK = 64
# The key length from which `dot_product_attention` takes the kernel on a
# GPU in float32 (measured faster than the memory-efficient path at 4,096
# and 8,192 tokens; shorter calls were not measured and stay where they are).
MIN_KEY_LENGTH = 4096
# The dtypes it is taken in: float16 and bfloat16 have cuDNN's kernel.
DTYPES = ("float32",)


def pallas_runs() -> str | None:
    """How the kernel runs here: `"gpu"` on JAX with a GPU as default
    device (Triton) and no `keras.distribution` set (XLA cannot split a
    Triton call across devices), else `None`. (The tests run it with
    `"interpret"`.)"""
    import keras

    if keras.backend.backend() != "jax" or keras.distribution.distribution():
        return None
    import jax

    if jax.default_backend() != "gpu":
        return None
    try:
        from jax.experimental.pallas.ops.gpu import attention  # noqa: F401
    except ImportError:
        return None
    return "gpu"


def pallas_form(
    query,
    key,
    value,
    *,
    mask,
    components,
    scale,
    alibi: bool,
    dropout_active: bool,
):
    """The call as the kernel takes it, or `None` where it cannot.

    Args:
        query: `(B, Tq, N, H)`; key, value: `(B, Tk, K, H)`.
        mask: the explicit mask after `_whole_sequence_axes` (a padding mask
            in disguise already a component), or `None`.
        components: `dot_product_attention`'s mask components.
        scale: the logits' multiplier.
        alibi, dropout_active: whether the call has ALiBi / active dropout.

    Returns:
        `{"key_padding_mask", "query_padding_mask", "causal"}` or `None`.
    """
    import keras

    query_length, key_length = query.shape[1], key.shape[1]
    head_dims = {query.shape[-1], key.shape[-1], value.shape[-1]}
    offset = components["causal_offset"]
    key_padding = components["key_padding_mask"]
    query_padding = components["query_padding_mask"]
    if (
        alibi
        or dropout_active
        or mask is not None
        or components["sliding_window"] is not None
        or keras.backend.standardize_dtype(query.dtype) not in DTYPES
        or not isinstance(query_length, int)
        or query_length != key_length
        or key_length < MIN_KEY_LENGTH
        or len(head_dims) != 1
        or min(head_dims) < 16  # Triton's smallest matrix product
        or not isinstance(scale, numbers.Number)
        or (components["causal"] and not _is_static_zero(offset))
        # One array of segment ids serves queries and keys alike.
        or ((key_padding is None) != (query_padding is None))
    ):
        return None
    return {
        "key_padding_mask": key_padding,
        "query_padding_mask": query_padding,
        "causal": bool(components["causal"]),
    }


def _is_static_zero(offset) -> bool:
    return isinstance(offset, numbers.Integral) and int(offset) == 0


def same_padding(form):
    """Whether `form`'s key and query padding masks are the same mask: a
    Python bool when there are none, else a scalar boolean tensor (the masks'
    values are known when the program runs)."""
    if form["key_padding_mask"] is None:
        return True
    return ops.all(
        ops.equal(
            ops.cast(form["key_padding_mask"], "bool"),
            ops.cast(form["query_padding_mask"], "bool"),
        )
    )


def pallas_attention(query, key, value, form, scale, mode="gpu"):
    """Attention by `jax.experimental.pallas.ops.gpu.attention.mha`.

    Args:
        query: `(B, T, N, H)`; key, value: `(B, T, K, H)`, `K` dividing `N`.
        form: `pallas_form`'s dict; its padding masks must be the same mask
            (`same_padding`).
        scale: the logits' multiplier (a number).
        mode: `"gpu"` (Triton), or `"interpret"` (Pallas's interpreter, which
            the CPU tests run).

    Returns:
        `(B, T, N, H)` in the dtype of `query`; the padded queries' rows zero.
    """
    from jax.experimental.pallas.ops.gpu import attention

    batch, length, heads = query.shape[0], query.shape[1], query.shape[2]
    groups = heads // key.shape[2]
    if groups > 1:  # (B, T, K, H) -> (B, T, N, H), query head n with n // groups
        key = ops.repeat(key, groups, axis=2)
        value = ops.repeat(value, groups, axis=2)
    padded_length = -(-length // BLOCK) * BLOCK
    padding = form["key_padding_mask"]
    segments = None
    if padding is not None or padded_length != length:
        keep = (
            ops.ones((batch, length), "bool")
            if padding is None
            else ops.cast(padding, "bool")
        )
        if padded_length != length:
            extra = padded_length - length
            keep = ops.pad(keep, ((0, 0), (0, extra)), constant_values=False)
            widths = ((0, 0), (0, extra), (0, 0), (0, 0))
            query, key, value = (ops.pad(x, widths) for x in (query, key, value))
        segments = ops.cast(ops.where(keep, 0, 1), "int32")  # (B, T'): 0 kept
    outputs = attention.mha(
        query,
        key,
        value,
        segments,
        sm_scale=float(scale),
        causal=form["causal"],
        block_sizes=attention.BlockSizes(
            block_q=BLOCK,
            block_k=BLOCK,
            block_q_dkv=BACKWARD_BLOCK,
            block_kv_dkv=BACKWARD_BLOCK,
            block_q_dq=BACKWARD_BLOCK,
            block_kv_dq=BACKWARD_BLOCK,
        ),
        interpret=mode == "interpret",
    )[:, :length]  # (B, T, N, H)
    if padding is None:
        return outputs
    rows = ops.cast(padding, "bool")[:, :, None, None]
    return ops.where(rows, outputs, ops.zeros_like(outputs))
