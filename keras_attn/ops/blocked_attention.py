"""The block layout of memory-efficient attention: block sizes, the tensors
cut into blocks, and the masks, ALiBi bias and dropout of one block pair.

`keras_attn.ops.memory_efficient_attention` lays its inputs out with these and
runs the passes of `keras_attn.ops.blocked_passes` over them. Queries and keys
are cut into blocks of `plan.query_block` and `plan.key_block` positions
(zero-padded at the end); the masks are kept as their components (padding
flags cut into blocks, the causal mask and the sliding window as positions,
an explicit mask sliced per block), so that no `(Tq, Tk)` tensor is built.
"""

from __future__ import annotations

from typing import NamedTuple

from keras import ops

from keras_attn.ops import _hash, counter_random
from keras_attn.ops.alibi import alibi_bias
from keras_attn.ops.masks import band_from_positions

# Defaults chosen from indicative timings on 2-core CPUs (docs/LONG_SEQUENCES.md):
# query blocks of 16 to 256 rows, as many as keep one (B, N, bq, bk) float32
# block within BLOCK_BYTES; key blocks of CAUSAL_KEY_BLOCK_SIZE under a causal
# mask or a window (whole blocks are skipped); otherwise all the keys at once (a
# fused softmax per query block), or key blocks of at most
# LONG_KEY_BLOCK_SIZE[backend] where that layout's query blocks would be at most
# THIN_QUERY_ROWS (64 rows at 8k keys of 8 heads, 16 at 32k): there its speed
# per FLOP falls with the length (`default_key_block_size`). On TensorFlow a
# causal mask without a window takes bigger blocks (`CAUSAL_BLOCKS`).
MAX_QUERY_BLOCK_SIZE = 256
MIN_QUERY_BLOCK_SIZE = 16
BLOCK_BYTES = 16 * 2**20
CAUSAL_KEY_BLOCK_SIZE = 512
# Causal attention without a window, per backend: up to `max_query_rows`
# query rows (within BLOCK_BYTES), and key blocks of at most `max_key_block`
# that still cut the keys into at least `min_key_blocks` blocks (never fewer
# than CAUSAL_KEY_BLOCK_SIZE keys a block): bigger blocks cost less per
# FLOP, and the many blocks keep the diagonal blocks' masked half small.
CAUSAL_BLOCKS = {
    "tensorflow": {"max_query_rows": 512, "max_key_block": 1024, "min_key_blocks": 16}
}
LONG_KEY_BLOCK_SIZE = {"tensorflow": 2048, "jax": 1024}
THIN_QUERY_ROWS = 64
# The long layout's blocks on TensorFlow: LONG_QUERY_ROWS query rows, key
# blocks of at most LONG_KEY_BLOCK_SIZE within LONG_BLOCK_BYTES (at least
# CAUSAL_KEY_BLOCK_SIZE keys), the query rows then within LONG_BLOCK_BYTES
# too: at batch 2 and 4 a few 32 MiB blocks of 256 rows beat 16 MiB ones of
# 64-128 rows (docs/experiments/2026-12-06-causal-blocks.md).
LONG_BLOCK_BYTES = {"tensorflow": 32 * 2**20}
LONG_QUERY_ROWS = 256
# The backward pass of the one-block layout takes key blocks of
# BACKWARD_KEY_BLOCK_SIZE and at most BACKWARD_QUERY_BLOCK_SIZE query rows
# (FlashAttention-2's order, `blocked_passes.backward`; the sizes that did
# best on TensorFlow and JAX at 8k tokens, docs/LONG_SEQUENCES.md).
BACKWARD_KEY_BLOCK_SIZE = 2048
BACKWARD_QUERY_BLOCK_SIZE = 128


def dim(x, axis):
    """Static size of `x`'s axis when known, else a scalar tensor."""
    size = x.shape[axis]
    return size if size is not None else ops.shape(x)[axis]


def _ceil_div(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return -(-a // b)
    return ops.floor_divide(a + b - 1, b)


class Plan:
    """Block sizes and counts; ints when the lengths are static, else tensors."""

    def __init__(
        self,
        query_length,
        key_length,
        query_block_size,
        key_block_size,
        batch_heads,
        groups=1,
        max_query_block_size=MAX_QUERY_BLOCK_SIZE,
        block_bytes=BLOCK_BYTES,
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
            query_block_size = _default_query_block_size(
                batch_heads, self.key_block, max_query_block_size, block_bytes
            )
        self.query_block = _block_size(query_length, query_block_size)
        self.num_query_blocks = _ceil_div(query_length, self.query_block)
        # One block of all the keys: a plain softmax per query block (the
        # backward pass takes key blocks of its own, `backward_plan`).
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


def default_key_block_size(
    key_length, batch_heads, masked_blocks: bool, backend: str, windowed=False
):
    """The key block of `key_block_size="auto"`.

    Blocks of at most CAUSAL_KEY_BLOCK_SIZE when a causal mask or a window
    hides blocks (`masked_blocks`; `windowed` for a window), the fewest of
    equal size for a static length (`_even_block_size`); for a causal mask
    without a window on a backend of CAUSAL_BLOCKS and a static length, the
    fewest equal blocks of at most its `max_key_block` that still make
    `min_key_blocks` blocks, at least CAUSAL_KEY_BLOCK_SIZE.
    Else key blocks of at most LONG_KEY_BLOCK_SIZE for
    `backend` when the one-block layout would be thin and long: its query
    blocks at most THIN_QUERY_ROWS rows (counting a batch size unknown when
    traced as 1, so any real batch is thinner still) and more than two key
    blocks' worth of keys; the fewest such blocks, of equal size rounded up
    to a multiple of 16, so that the padded last block wastes little. Else
    `None`, all the keys at once (a length known only when run, a short
    one, or a backend without a measured size).
    """
    if masked_blocks:
        causal = CAUSAL_BLOCKS.get(backend)
        if windowed or causal is None or not isinstance(key_length, int):
            return _even_block_size(key_length, CAUSAL_KEY_BLOCK_SIZE)
        block = _ceil_div(_ceil_div(key_length, causal["min_key_blocks"]), 16) * 16
        block = min(max(block, CAUSAL_KEY_BLOCK_SIZE), causal["max_key_block"])
        return _even_block_size(key_length, block)
    long_block = LONG_KEY_BLOCK_SIZE.get(backend)
    if long_block is None or not isinstance(key_length, int):
        return None
    if key_length <= 2 * long_block:
        return None
    rows = _default_query_block_size(batch_heads, key_length)
    if rows > THIN_QUERY_ROWS:
        return None
    block_bytes = LONG_BLOCK_BYTES.get(backend)
    if block_bytes is not None:
        fitting = block_bytes // (max(batch_heads, 1) * LONG_QUERY_ROWS * 4)
        long_block = min(long_block, max(fitting // 16 * 16, CAUSAL_KEY_BLOCK_SIZE))
    return _even_block_size(key_length, long_block)


def _even_block_size(length, limit):
    """The size of the fewest blocks of at most `limit` that cover a static
    `length`, of equal size rounded up to a multiple of 16 (the padding of the
    last block then stays under 16 positions a block); `limit` itself for a
    length known only when run."""
    if not isinstance(length, int) or length <= limit:
        return limit
    block = _ceil_div(length, _ceil_div(length, limit))
    return min(_ceil_div(block, 16) * 16, limit)


def backward_plan(plan, query_block_size, batch_heads):
    """The plan of the backward pass: `plan` itself when it has key blocks,
    else key blocks of at most BACKWARD_KEY_BLOCK_SIZE, of equal size
    (`_even_block_size`) when the length is static (`query_block_size` rows, or
    the default rows up to BACKWARD_QUERY_BLOCK_SIZE), so that the backward
    sweep carries a key block's gradients, not the whole length's."""
    if not plan.single_key_block:
        return plan
    key_block_size = _even_block_size(plan.key_length, BACKWARD_KEY_BLOCK_SIZE)
    if query_block_size is None:
        key_block = _block_size(plan.key_length, key_block_size)
        query_block_size = _default_query_block_size(batch_heads, key_block)
        if isinstance(query_block_size, int):
            query_block_size = min(query_block_size, BACKWARD_QUERY_BLOCK_SIZE)
        else:
            query_block_size = ops.minimum(query_block_size, BACKWARD_QUERY_BLOCK_SIZE)
    return Plan(
        plan.query_length,
        plan.key_length,
        query_block_size,
        key_block_size,
        batch_heads=batch_heads,
        groups=plan.groups,
    )


class Layout(NamedTuple):
    """The block sizes of a call before its lengths are cut (`Plan`)."""

    # Keys a block: a positive int, or None for all the keys at once.
    key_block_size: object
    # The most rows of a default query block.
    max_query_block_size: int
    # The bytes of one (B, N, bq, bk) float32 block that default query
    # blocks keep within.
    block_bytes: int


def default_layout(
    key_block_size, key_length, batch_heads, causal: bool, windowed: bool, backend: str
) -> Layout:
    """The layout of a call on `backend` with `key_block_size` (a positive
    int, None, or `"auto"`):

    - key blocks: `key_block_size`, or for `"auto"` those of
      `default_key_block_size`;
    - query rows: at most CAUSAL_BLOCKS's `max_query_rows` for a causal
      mask without a window on its backends (whatever the key blocks), else
      MAX_QUERY_BLOCK_SIZE;
    - block bytes: LONG_BLOCK_BYTES of the backend for the long layout (key
      blocks that `"auto"` took for attention without a causal mask or a
      window), else BLOCK_BYTES.

    `batch_heads` is the batch size times the query heads, a batch size
    known only when run counted as 1.
    """
    masked_blocks = causal or windowed
    auto = isinstance(key_block_size, str)
    if auto:
        key_block_size = default_key_block_size(
            key_length, batch_heads, masked_blocks, backend, windowed=windowed
        )
    causal_blocks = CAUSAL_BLOCKS.get(backend)
    max_rows = MAX_QUERY_BLOCK_SIZE
    if causal and not windowed and causal_blocks is not None:
        max_rows = causal_blocks["max_query_rows"]
    long_layout = auto and not masked_blocks and key_block_size is not None
    return Layout(
        key_block_size,
        max_rows,
        LONG_BLOCK_BYTES.get(backend, BLOCK_BYTES) if long_layout else BLOCK_BYTES,
    )


def _default_query_block_size(
    batch_heads, key_block, max_rows=MAX_QUERY_BLOCK_SIZE, block_bytes=BLOCK_BYTES
):
    """The most query rows, a multiple of 16 in [16, `max_rows`], that keep a
    `(B, N, bq, bk)` float32 block within `block_bytes`."""
    per_row = batch_heads * key_block * 4  # bytes of one query row of a block
    if isinstance(per_row, int):
        rows = block_bytes // max(per_row, 1) // 16 * 16
        return min(max(rows, MIN_QUERY_BLOCK_SIZE), max_rows)
    rows = ops.floor_divide(block_bytes, ops.maximum(ops.cast(per_row, "int32"), 1))
    rows = ops.floor_divide(rows, 16) * 16
    return ops.clip(rows, MIN_QUERY_BLOCK_SIZE, max_rows)


def _block_size(length, block_size):
    """`min(length, block_size)`, at least 1 (no padding past a short length)."""
    if isinstance(length, int) and isinstance(block_size, int):
        return max(1, min(length, block_size))
    return ops.maximum(
        ops.minimum(ops.cast(length, "int32"), ops.cast(block_size, "int32")), 1
    )


def to_blocks(x, length, block, num_blocks):
    """`(B, T, N, H) -> (n, B, N, b, H)`, zero-padded to `n·b` positions."""
    batch, heads, width = dim(x, 0), dim(x, 2), dim(x, 3)
    x = ops.pad(x, [[0, 0], [0, num_blocks * block - length], [0, 0], [0, 0]])
    x = ops.reshape(x, (batch, num_blocks, block, heads, width))  # (B, n, b, N, H)
    return ops.transpose(x, (1, 0, 3, 2, 4))  # (n, B, N, b, H)


def from_blocks(x, length):
    """`(n, B, N, b, H) -> (B, T, N, H)`, the padding cut off."""
    num_blocks, batch, heads, block, width = (dim(x, axis) for axis in range(5))
    x = ops.transpose(x, (1, 0, 3, 2, 4))  # (B, n, b, N, H)
    x = ops.reshape(x, (batch, num_blocks * block, heads, width))  # (B, n·b, N, H)
    return x[:, :length]


def _flags_to_blocks(mask, padded_length, block, num_blocks):
    """`(B, T)` bool -> `(n, B, b)`, padded with `False`."""
    batch = dim(mask, 0)
    mask = ops.pad(mask, [[0, 0], [0, padded_length - dim(mask, 1)]])
    mask = ops.reshape(mask, (batch, num_blocks, block))  # (B, n, b)
    return ops.transpose(mask, (1, 0, 2))  # (n, B, b)


class BlockMasks:
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
                    [0, plan.padded_query_length - dim(attention_mask, 2)],
                    [0, plan.padded_key_length - dim(attention_mask, 3)],
                ],
            )  # (B|1, N|1, Tq', Tk'), False in the padding
            self.explicit_batch = dim(attention_mask, 0)
            self.explicit_heads = dim(attention_mask, 1)

    @property
    def any(self):
        return (
            self.causal
            or self.window is not None
            or self.key_blocks is not None
            or self.query_blocks is not None
            or self.explicit is not None
        )

    @property
    def band(self):
        """Whether a causal mask or a window hides keys by position."""
        return self.causal or self.window is not None

    def block(self, i, j, query_flags, key_flags, band=True):
        """Boolean mask of block pair `(i, j)`, `(B|1, N|1, bq|1, bk|1)`, or None.

        `query_flags` `(B, bq)` and `key_flags` `(B|1, bk)` are the padding
        flags of the two blocks (or None). `band=False` leaves out the causal
        mask and the window (for a pair they hide nothing of,
        `band_hides_keys`).
        """
        plan = self.plan
        mask = None
        if key_flags is not None:
            mask = key_flags[:, None, None, :]  # (B|1, 1, 1, bk)
        if query_flags is not None:
            rows = query_flags[:, None, :, None]  # (B, 1, bq, 1)
            mask = rows if mask is None else ops.logical_and(mask, rows)
        if band and self.band:
            query_positions, key_positions = self.positions(i, j)
            visible = band_from_positions(
                query_positions, key_positions, self.causal, self.window
            )[None, None]  # (1, 1, bq, bk)
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

    def band_hides_keys(self, i, j):
        """Whether the causal mask or the window hides any key of block pair
        `(i, j)` from any of its queries: a bool scalar. Most pairs that a
        causal mask or a window leaves visible at all are visible whole; only
        the pairs across the band's edges need its mask."""
        plan = self.plan
        first_query = i * plan.query_block + self.causal_offset
        last_query = first_query + plan.query_block - 1
        first_key = j * plan.key_block
        last_key = first_key + plan.key_block - 1
        hidden = []
        if self.causal:  # a key after the first query
            hidden.append(ops.greater(last_key, first_query))
        if self.window is not None:  # a key a window or more before the last query
            hidden.append(ops.less_equal(first_key, last_query - self.window))
            if not self.causal:  # or a window or more after the first query
                hidden.append(ops.greater_equal(last_key, first_query + self.window))
        hides = hidden[0]
        for condition in hidden[1:]:
            hides = ops.logical_or(hides, condition)
        return hides

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


class BlockDropout:
    """Keep masks that any pass can regenerate for any block pair.

    The keep decision of weight `(b, n, q, k)` is
    `keras_attn.ops.counter_random.dropout_factors` of a seed drawn once per
    call, the row's index `(b, n, q)` among all the rows and the key `k`:
    positions, not blocks, so that passes with different block layouts
    (the forward and the backward) draw the same mask.
    """

    def __init__(self, rate, seed, plan):
        self.rate, self.plan = rate, plan
        self.seed = seed  # `counter_random.dropout_seed`'s

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
                _hash.u32(plan.query_length),
            ),
            _hash.u32(
                i * plan.query_block
                + ops.reshape(
                    ops.arange(plan.query_block, dtype="int32"), (1, 1, -1, 1)
                )
            ),
        )  # (B, N, bq, 1): the row's index among all rows
        keys = _hash.u32(
            j * plan.key_block + ops.arange(plan.key_block, dtype="int32")
        )  # (bk,)
        return counter_random.dropout_factors(self.seed, rows, keys, self.rate)
