"""The passes of memory-efficient attention over blocks of queries and keys:
the blocked forward and the backward pass of its custom gradient.

`keras_attn.ops.memory_efficient_attention` cuts its inputs into blocks
(`keras_attn.ops.blocked_attention`) and calls these:

- forward, one block of all the keys (`plan.single_key_block`):
  `forward_single`, an ordinary softmax per query block;
- forward, key blocks: `forward`, an online softmax over the key blocks;
- backward, either way: `backward`, one sweep in FlashAttention-2's order
  (key blocks outside, query blocks inside) that recomputes each block's
  weights from the rows' log-normalisers, which both forwards return. The
  one-block layout's backward pass takes key blocks of its own
  (`blocked_attention.backward_plan`).

`ops.map`, `ops.fori_loop` and `ops.scan` run over the blocks one block at
a time on every backend (`_map`, `_fori_loop`, `_scan`, `_scan_range_add`); on
PyTorch, which runs each op as it comes, they are plain Python loops
(`_python_loops`).
"""

from __future__ import annotations

import keras
from keras import ops

from keras_attn.ops.blocked_attention import dim
from keras_attn.ops.softmax import MASK_VALUE

# -- layouts and block products -------------------------------------------------
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
    batch, heads, width = dim(x, 0), dim(x, 1), dim(x, 3)
    return ops.reshape(x, (batch, heads // groups, -1, width))


def _ungroup(x, groups):
    """`(B, K, G·b, D)` -> `(B, N, b, D)`, the inverse of `_group`."""
    if groups == 1:
        return x
    batch, key_heads, width = dim(x, 0), dim(x, 1), dim(x, 3)
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
    matmul over the stacked rows of the group sums them).

    On TensorFlow the transpose is the matmul's `transpose_a`: a separate
    transpose would copy the `(B, N, b, bk)` block once more.
    """
    weights, rows = _group(weights, groups), _group(rows, groups)
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.linalg.matmul(weights, rows, transpose_a=True)
    return ops.matmul(ops.transpose(weights, (0, 1, 3, 2)), rows)


def _masked_logits(query, key, i, j, masks, query_flags, key_flags):
    """Logits `(B, N, bq, bk)` float32 of block pair `(i, j)`, masked entries
    at MASK_VALUE.

    A causal mask or a window is applied only to the pairs it hides keys of
    (a `cond`): the others, most of the visible pairs, skip building and
    applying it, a pass over the block.
    """
    logits = _scores(query, key, masks.plan.groups)
    logits = masks.add_bias(logits, i, j)
    if not masks.any:
        return logits

    def masked(band):
        mask = masks.block(i, j, query_flags, key_flags, band=band)
        return logits if mask is None else ops.where(mask, logits, MASK_VALUE)

    if not masks.band:
        return masked(band=False)
    return ops.cond(
        masks.band_hides_keys(i, j),
        lambda: masked(band=True),
        lambda: masked(band=False),
    )


def _python_loops() -> bool:
    """Whether the loops below are Python loops: on PyTorch, eager.

    Keras's PyTorch `ops.scan` (and `ops.map`, a scan) packs every step's
    elements with `keras.tree`, and PyTorch's `tree_flatten` leaves a
    reference cycle (a recursive closure holding Keras's `is_leaf`, which
    holds the structure) per call: each step's blocks then live until
    Python's garbage collector runs, gigabytes at 8k tokens. Keras's
    `ops.slice_update` copies the whole tensor on PyTorch, so `_scan_range_add`'s
    in-place update would copy the full query gradient once per block.
    """
    return keras.backend.backend() == "torch"


def _tensorflow_eagerly() -> bool:
    """Whether this runs on TensorFlow outside a graph."""
    if keras.backend.backend() != "tensorflow":
        return False
    import tensorflow as tf

    return tf.executing_eagerly()


def _stacked(ys: list, num_outputs: int):
    """The steps' outputs `ys` (tensors, or tuples of `num_outputs`) stacked
    on a new first axis."""
    if num_outputs == 1:
        return ops.stack(ys)
    return tuple(ops.stack([y[k] for y in ys]) for k in range(num_outputs))


def _fori_loop(lower, upper, body, init):
    """`ops.fori_loop` that runs one iteration at a time on every backend.

    On TensorFlow, `keras.ops.fori_loop` is a `tf.while_loop` with its default
    `parallel_iterations=10`: the block products of later iterations depend
    only on the counter, so up to ten blocks' temporaries would be alive at
    once (and ten times that with a loop inside a loop). There is no public
    Keras argument for it, hence the TensorFlow call here.
    """
    if _python_loops():
        state = init
        for i in range(int(lower), int(upper)):
            state = body(i, state)
        return state
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
    if _python_loops():
        return _stacked(
            [f(tuple(x[i] for x in xs)) for i in range(dim(xs[0], 0))], num_outputs
        )
    if keras.backend.backend() != "tensorflow":
        return ops.map(f, xs)
    import tensorflow as tf

    spec = tf.TensorSpec(None, "float32")
    signature = spec if num_outputs == 1 else (spec,) * num_outputs
    return tf.map_fn(f, xs, fn_output_signature=signature, parallel_iterations=1)


def _scan(f, init, xs, num_outputs: int = 1):
    """`ops.scan` that runs one element at a time on every backend:
    `f(carry, x) -> (carry, y)` over the first axis of `xs` (a tuple of
    tensors), returning the last carry and the `y`s stacked (`y` a float32
    tensor, or a tuple of `num_outputs` of them, the `k`-th of the shape of
    an element of `xs[k]`).

    On TensorFlow, `keras.ops.scan` stacks outputs only of the carry's shape
    and runs `parallel_iterations` of them at once: a `tf.while_loop` with
    one iteration in flight writes each `y` to a `TensorArray` instead, so no
    step copies what the others wrote.
    """
    if _python_loops():
        carry, ys = init, []
        for i in range(dim(xs[0], 0)):
            carry, y = f(carry, tuple(x[i] for x in xs))
            ys.append(y)
        return carry, _stacked(ys, num_outputs)
    if keras.backend.backend() != "tensorflow":
        return ops.scan(f, init, xs)
    import tensorflow as tf

    length = tf.shape(xs[0])[0]

    def body(i, carry, ys):
        carry, y = f(carry, tuple(tf.gather(x, i) for x in xs))
        y = (y,) if num_outputs == 1 else y
        return i + 1, carry, tuple(a.write(i, b) for a, b in zip(ys, y, strict=True))

    arrays = tuple(
        tf.TensorArray("float32", size=length, infer_shape=False)
        for _ in range(num_outputs)
    )
    _, carry, ys = tf.while_loop(
        lambda i, *_: i < length, body, (0, init, arrays), parallel_iterations=1
    )
    ys = tuple(a.stack() for a in ys)
    for y, x in zip(ys, xs, strict=False):
        y.set_shape(x.shape)
    return carry, ys[0] if num_outputs == 1 else ys


def _scan_range_add(f, init, xs, start, end, total):
    """`f(carry, x_i, i) -> (carry, y_i)` for `i` in `[start, end)`, one at a
    time, over the first axis of `xs` (a tuple of tensors); returns the last
    carry and `total` with each `y_i` added to its element `i`. Each `y` has
    the shape and dtype (float32) of an element of `total`.

    The sum is written into `total` step by step, one element at a time:
    on TensorFlow `total` is taken apart into a `TensorArray` of its
    elements for the loop, whose steps each replace one element, and
    stacked again after it (two copies of `total` a call, where a
    scatter-add into the dense tensor copied all of it at every step:
    TensorFlow's scatter kernels did not reuse their input's buffer); on
    the other compiled backends `ops.slice_update` in a `fori_loop` (which
    XLA does not copy). No step's outputs are stacked, padded to the whole
    length and added: at 128k tokens each of those is a copy of the query
    gradient (128 MiB). Eagerly (PyTorch, or TensorFlow outside a graph, where a
    scatter-add would copy the whole sum at every step) the steps' outputs
    are stacked and added once. An empty range returns `total` as it is.
    """
    if _python_loops() or _tensorflow_eagerly():
        start, end, carry, ys = int(start), int(end), init, []
        for i in range(start, end):
            carry, y = f(carry, tuple(x[i] for x in xs), i)
            ys.append(y)
        if not ys:
            return carry, total
        rest = tuple(total.shape[1:])
        return carry, total + ops.concatenate(
            [
                ops.zeros((start, *rest), "float32"),
                ops.stack(ys),
                ops.zeros((dim(total, 0) - end, *rest), "float32"),
            ]
        )
    if keras.backend.backend() != "tensorflow":

        def body(i, state):
            carry, total = state
            carry, y = f(carry, tuple(ops.take(x, i, axis=0) for x in xs), i)
            index = (i,) + (0,) * len(y.shape)
            return carry, ops.slice_update(
                total, index, (ops.take(total, i, axis=0) + y)[None]
            )

        return ops.fori_loop(start, end, body, (init, total))
    import tensorflow as tf

    # In a graph a `TensorArray` is a `TensorList`: replacing an element
    # leaves the others' buffers as they are.
    elements = tf.TensorArray(
        "float32",
        size=tf.shape(total)[0],
        element_shape=total.shape[1:],
        clear_after_read=False,
    ).unstack(total)

    def body(i, carry, elements):
        carry, y = f(carry, tuple(tf.gather(x, i) for x in xs), i)
        return i + 1, carry, elements.write(i, elements.read(i) + y)

    _, carry, elements = tf.while_loop(
        lambda i, *_: i < end, body, (start, init, elements), parallel_iterations=1
    )
    summed = elements.stack()
    summed.set_shape(total.shape)
    return carry, summed


def _take(blocks, index):
    return None if blocks is None else ops.take(blocks, index, axis=0)


def _flags_or_dummy(flags, num_blocks):
    """`ops.map` needs tensors: a `(n,)` stand-in when there are no flags."""
    return ops.zeros((num_blocks,), "bool") if flags is None else flags


def _real_flags(flags, masks_flags):
    return None if masks_flags is None else flags


# One block of all the keys: each query block is an ordinary masked softmax.


def forward_single(query_blocks, key, value, plan, masks, dropout):
    """Outputs `(nq, B, N, bq, Hv)` and log-normalisers `(nq, B, N, bq, 1)`
    (0 for rows that see no key); `key` `(B, K, Tk, H)`, `value`
    `(B, K, Tk, Hv)`: an ordinary softmax of each query block against all
    the keys."""
    batch, heads = dim(query_blocks, 1), dim(query_blocks, 2)
    key_flags = _take(masks.key_blocks, 0)  # (B|1, Tk) or None

    def query_block(elements):
        query, query_flags, i = elements  # (B, N, bq, H), (B, bq), ()
        query_flags = _real_flags(query_flags, masks.query_blocks)
        logits = _masked_logits(
            query, key, i, 0, masks, query_flags, key_flags
        )  # (B, N, bq, Tk)
        weights = ops.softmax(logits, axis=-1)
        largest = ops.max(logits, axis=-1, keepdims=True)  # (B, N, bq, 1)
        # The largest weight is exp(0) / Σ exp(s - max s).
        log_normaliser = largest - ops.log(ops.max(weights, axis=-1, keepdims=True))
        if dropout is not None:
            weights = weights * dropout.scale(i, 0, batch, heads)
        outputs = _weighted(weights, value, plan.groups)  # (B, N, bq, Hv)
        return _without_keyless_rows(outputs, log_normaliser)

    return _map(
        query_block,
        (
            query_blocks,
            _flags_or_dummy(masks.query_blocks, plan.num_query_blocks),
            ops.arange(plan.num_query_blocks, dtype="int32"),
        ),
        num_outputs=2,
    )


def _without_keyless_rows(outputs, log_normaliser):
    """Zero outputs for the rows that met no valid key (their
    log-normaliser is near MASK_VALUE; their softmax came out uniform over
    masked keys), and a log-normaliser of 0 for them, so that
    `exp(MASK_VALUE - 0) = 0` when the backward pass recomputes weights."""
    has_keys = ops.greater(log_normaliser, 0.5 * MASK_VALUE)  # (B, N, bq, 1)
    return (
        ops.where(has_keys, outputs, 0.0),
        ops.where(has_keys, log_normaliser, 0.0),
    )


# Key blocks: an online softmax over them.


def forward(query_blocks, key_blocks, value_blocks, plan, masks, dropout):
    """Outputs `(nq, B, N, bq, Hv)` and log-normalisers `(nq, B, N, bq, 1)`.

    Each block pair contributes its block-normalised output `softmax(s) v`
    and its log-normaliser; the running output is the mixture of the blocks'
    outputs weighted by their share of the row's total normaliser.
    """
    batch, heads = dim(query_blocks, 1), dim(query_blocks, 2)

    def query_block(elements):
        query, query_flags, i = elements  # (B, N, bq, H), (B, bq), ()
        query_flags = _real_flags(query_flags, masks.query_blocks)
        rows = (batch, heads, plan.query_block, 1)

        def key_step(j, carry):
            log_normaliser, outputs = carry  # (B, N, bq, 1), (B, N, bq, Hv)
            logits = _masked_logits(
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
                    (batch, heads, plan.query_block, dim(value_blocks, 4)), "float32"
                ),
            ),
        )
        return _without_keyless_rows(outputs, log_normaliser)

    return _map(
        query_block,
        (
            query_blocks,
            _flags_or_dummy(masks.query_blocks, plan.num_query_blocks),
            ops.arange(plan.num_query_blocks, dtype="int32"),
        ),
        num_outputs=2,
    )


def _with_column(x, column):
    """`x` `(B, N|K, b, D)` with `column` `(B, N|K, b, 1)` appended: `(…, D + 1)`."""
    return ops.concatenate([x, ops.cast(column, x.dtype)], axis=-1)


def backward(saved, key_blocks, value_blocks, plan, masks, dropout):
    """Gradients of the scaled query blocks `(nq, B, N, bq, H)` and of the
    key and value blocks `(nk, B, K, bk, H|Hv)`, in one sweep.

    FlashAttention-2's order (Dao 2023): the key blocks outside, the query
    blocks that can see each (`masks.query_block_range`) inside. Each pair's
    weights are recomputed from the rows' log-normalisers once, and give all
    three gradients: the key block's in the inner carry (a block, not a
    full-length accumulator), the query blocks' added to their rows of the
    query gradient as each step makes them (`_scan_range_add`).

    Each row's subtracted terms ride in the block products as one more
    column: `s - l` is `[q, -l] · [k, 1]` and, without dropout, `dP - D`
    is `[dO, -D] · [v, 1]` (1/H more arithmetic in two of the five
    products instead of two elementwise passes over every `(B, N, bq, bk)`
    block pair, each a read and a write of the whole block). Dropout scales
    `dP` before `D` is subtracted, so there `D` is subtracted after.
    """
    query_blocks, upstream_blocks, log_normaliser, delta = saved
    batch, heads = dim(query_blocks, 1), dim(query_blocks, 2)
    query_flags = _flags_or_dummy(masks.query_blocks, plan.num_query_blocks)

    def key_block(d_query, elements):
        key, value, key_flags, j = elements  # (B, K, bk, H), (B, K, bk, Hv)
        key_flags = _real_flags(key_flags, masks.key_blocks)
        ones = ops.ones((dim(key, 0), dim(key, 1), dim(key, 2), 1), key.dtype)
        key_rows, value_rows = _with_column(key, ones), _with_column(value, ones)

        def query_step(carry, elements, i):
            d_key, d_value = carry
            query, upstream, row_log_normaliser, row_delta, row_flags = elements
            # (B, N, bq, H), (B, N, bq, Hv), (B, N, bq, 1) twice, (B, bq)
            logits = _masked_logits(
                _with_column(query, -row_log_normaliser),
                key_rows,
                i,
                j,
                masks,
                _real_flags(row_flags, masks.query_blocks),
                key_flags,
            )  # s - l
            weights = ops.exp(logits)  # (B, N, bq, bk)
            if dropout is None:
                dropped = weights
                d_shifted = _scores(  # dP - D
                    _with_column(upstream, -row_delta), value_rows, plan.groups
                )
            else:
                factors = dropout.scale(i, j, batch, heads)
                dropped = weights * factors
                d_shifted = _scores(upstream, value, plan.groups) * factors - row_delta
            d_value = d_value + _key_side(dropped, upstream, plan.groups)
            d_logits = weights * d_shifted  # (B, N, bq, bk)
            d_key = d_key + _key_side(d_logits, query, plan.groups)
            return (d_key, d_value), _weighted(d_logits, key, plan.groups)

        start, end = masks.query_block_range(j)
        (d_key, d_value), d_query = _scan_range_add(
            query_step,
            (ops.zeros_like(key), ops.zeros_like(value)),
            (query_blocks, upstream_blocks, log_normaliser, delta, query_flags),
            start,
            end,
            d_query,
        )  # (B, K, bk, H), (B, K, bk, Hv), (nq, B, N, bq, H)
        return d_query, (d_key, d_value)

    d_query, (d_key, d_value) = _scan(
        key_block,
        ops.zeros_like(query_blocks),
        (
            key_blocks,
            value_blocks,
            _flags_or_dummy(masks.key_blocks, plan.num_key_blocks),
            ops.arange(plan.num_key_blocks, dtype="int32"),
        ),
        num_outputs=2,
    )
    return d_query, d_key, d_value
