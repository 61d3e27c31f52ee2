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
    there the update is a gather of the new rows and a `where` over the
    cache's positions, core ops everywhere.
    """
    update = ops.cast(update, cache.dtype)
    if len(getattr(index, "shape", ())) == 1:
        return _update_rows(cache, update, index)
    if keras.backend.backend() != "tensorflow":
        start = [0, index] + [0] * (len(cache.shape) - 2)
        return ops.slice_update(cache, start, update)
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
    takes `update[b, p - index[b]]` where that is inside the update (a
    gather and a `where`, core ops on every backend)."""
    index = ops.cast(index, "int32")
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
