"""Writing new keys/values into a fixed-size KV cache."""

from __future__ import annotations

import keras
from keras import ops


def update_cache(cache, update, index):
    """`cache` with `update` written at positions `index .. index + T - 1` of axis 1.

    Args:
        cache: `(batch, max_length, ...)`.
        update: `(batch, T, ...)`, the same trailing shape.
        index: int or scalar int tensor; may change from call to call without
            retracing. Or an int tensor `(batch,)`: each row written at its
            own position (speculative decoding advances rows unevenly).

    Returns:
        A tensor of the cache's shape and dtype.

    On JAX and PyTorch this is `ops.slice_update` (a native dynamic update).
    On TensorFlow that op lowers to `XlaDynamicUpdateSlice`, which has no
    plain CPU/GPU kernel and so may not run in a stock TF Serving build;
    there the new rows are scattered in with `tf.tensor_scatter_nd_update`,
    a core op everywhere. A per-row index is a scatter on JAX and (when
    every row fits) on TensorFlow, else a gather and a `where`. Rows that
    fall outside the cache are not written.
    """
    cache = ops.convert_to_tensor(cache)
    update = ops.cast(update, cache.dtype)
    if len(getattr(index, "shape", ())) == 1:
        return _update_rows(cache, update, index)
    if keras.backend.backend() != "tensorflow":
        start = [0, index] + [0] * (len(cache.shape) - 2)
        return ops.slice_update(cache, start, update)
    return _scatter_rows(cache, update, index)


def _scatter_rows(cache, update, index):
    """TensorFlow's `update_cache` with one index: the update's rows scattered
    into the cache with `tf.tensor_scatter_nd_update`, a core op that writes
    only those rows (into the cache's own buffer where TensorFlow can reuse
    it), where a gather and a `where` over every position read the whole
    cache twice. An update whose length is not static, or that would reach
    outside the cache (whose rows outside are not written), takes the
    gather and the `where`; both forms compile under XLA."""
    import tensorflow as tf

    length = update.shape[1]
    if length is None:
        return _select_rows(cache, update, index)
    index = tf.cast(index, tf.int32)
    size = tf.shape(cache)[1]

    def scatter():
        batch = tf.shape(update)[0]
        positions = index + tf.range(length)  # (T,), T static
        indices = tf.stack(
            [
                tf.broadcast_to(tf.range(batch)[:, None], [batch, length]),
                tf.broadcast_to(positions[None, :], [batch, length]),
            ],
            axis=-1,
        )  # (B, T, 2): (row, position)
        return tf.tensor_scatter_nd_update(cache, indices, update)

    inside = tf.logical_and(index >= 0, index + length <= size)
    return _scatter_if(inside, scatter, lambda: _select_rows(cache, update, index))


def _scatter_if(fits, scatter, select):
    """TensorFlow: `scatter()` where the update `fits` the cache, else
    `select()`; decided as the graph is built when `fits` is static, else
    by `tf.cond` (both branches compile under XLA)."""
    import tensorflow as tf

    static = tf.get_static_value(fits)
    if static is not None:
        return scatter() if static else select()
    return tf.cond(fits, scatter, select)


def _select_rows(cache, update, index):
    """`update_cache` with one index as a gather of the update's rows over
    every cache position and a `where` (rows outside the cache not
    written)."""
    index = ops.cast(index, "int32")
    length = ops.shape(update)[1]
    positions = ops.arange(ops.shape(cache)[1], dtype="int32")  # (Tmax,)
    offsets = positions - index  # position p takes update row p - index
    inside = ops.logical_and(offsets >= 0, offsets < length)  # (Tmax,)
    rows = ops.take(update, ops.clip(offsets, 0, length - 1), axis=1)  # (B, Tmax, ...)
    inside = ops.reshape(inside, (1, -1) + (1,) * (len(cache.shape) - 2))
    return ops.where(inside, rows, cache)


def _update_rows(cache, update, index):
    """`update_cache` with a position per row: position `p` of row `b`
    takes `update[b, p - index[b]]` where that is inside the cache. JAX
    scatters the rows (positions outside dropped); TensorFlow scatters them
    when every row's update fits (a core op) and otherwise gathers and
    selects, as PyTorch always does (a gather and a `where` over every
    position, core ops on every backend)."""
    index = ops.cast(index, "int32")
    backend = keras.backend.backend()
    if backend == "jax":
        return _scatter_rows_jax(cache, update, index)
    if backend == "tensorflow" and update.shape[1] is not None:
        import tensorflow as tf

        fits = tf.logical_and(
            tf.reduce_all(index >= 0),
            tf.reduce_all(index + update.shape[1] <= tf.shape(cache)[1]),
        )
        return _scatter_if(
            fits,
            lambda: _scatter_fitting_rows_tf(cache, update, index),
            lambda: _select_rows_per_row(cache, update, index),
        )
    return _select_rows_per_row(cache, update, index)


def _row_indices(update, index):
    """int32 `(B, T)` row numbers and positions of a per-row update."""
    batch, length = ops.shape(update)[0], update.shape[1]
    positions = index[:, None] + ops.arange(length, dtype="int32")[None, :]
    rows = ops.broadcast_to(
        ops.arange(batch, dtype="int32")[:, None], ops.shape(positions)
    )
    return rows, positions


def _scatter_rows_jax(cache, update, index):
    """The rows scattered into the cache; positions outside it (after the
    end, or before 0, which NumPy-style indexing would wrap) dropped."""
    rows, positions = _row_indices(update, index)
    size = cache.shape[1]
    positions = ops.where(
        ops.logical_and(positions >= 0, positions < size), positions, size
    )
    return cache.at[rows, positions].set(update, mode="drop")


def _scatter_fitting_rows_tf(cache, update, index):
    """`tf.tensor_scatter_nd_update` of rows that all fall inside the cache."""
    import tensorflow as tf

    rows, positions = _row_indices(update, index)
    return tf.tensor_scatter_nd_update(cache, tf.stack([rows, positions], -1), update)


def _select_rows_per_row(cache, update, index):
    """A gather of each row's update over every cache position and a
    `where` (rows outside the cache not written)."""
    length = ops.shape(update)[1]
    positions = ops.arange(ops.shape(cache)[1], dtype="int32")  # (Tmax,)
    offsets = positions[None, :] - index[:, None]  # (B, Tmax)
    inside = ops.logical_and(offsets >= 0, offsets < length)
    trailing = (1,) * (len(cache.shape) - 2)
    gather = ops.reshape(
        ops.clip(offsets, 0, length - 1), ops.shape(offsets) + trailing
    )
    rows = ops.take_along_axis(update, gather, axis=1)  # (B, Tmax, ...)
    inside = ops.reshape(inside, ops.shape(inside) + trailing)
    return ops.where(inside, rows, cache)
