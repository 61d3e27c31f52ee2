"""The encoder blocks' real-token rows in serving mode
(`keras_attn.ops.serving_mode`): which calls take them, the moves between a
`(B, T, d)` batch and its `(R, d)` real tokens, and the layer norm of those
rows.

Both directions are row gathers (TensorFlow's `GatherV2`, a copy per row):
`gather_rows` takes the real tokens' rows, `scatter_rows` puts rows back on
the `(B, T)` grid by gathering each position's row from the rows with one
zero row appended. On the CPU this is cheaper than `gather_nd` and
`scatter_nd` (docs/experiments/2026-12-06-serving-rows.md)."""

from __future__ import annotations

from typing import NamedTuple

import keras

from keras_attn.ops.serving import in_serving_mode


def skips_padding(padding, training) -> bool:
    """Whether a block called with `padding` (a `(B, T)` mask or None) and
    `training` runs its per-token sublayers on the real tokens' rows: in
    serving mode, in inference, with a mask."""
    return (
        in_serving_mode()
        and padding is not None
        and not isinstance(padding, keras.KerasTensor)  # a functional model's build
        and not training
    )


class RealRows(NamedTuple):
    """Where the real tokens of a `(B, T)` mask are: `index` `(R,)`, their
    flat positions in `B * T`, and `inverse` `(B, T)`, each position's row
    in the `R` rows (`R` at padded positions: the appended zero row)."""

    index: object
    inverse: object

    @property
    def count(self):
        """`R`, static when known (an eager call)."""
        return self.index.shape[0]


def real_rows(padding) -> RealRows:
    """The `RealRows` of a `(B, T)` mask."""
    import tensorflow as tf

    with tf.name_scope("real_rows"):  # the serving graph's mark (tests read it)
        flat = tf.reshape(tf.cast(padding, tf.bool), [-1])  # (B*T,)
        index = tf.reshape(tf.where(flat), [-1])  # (R,)
        row = tf.cumsum(tf.cast(flat, tf.int64), exclusive=True)  # (B*T,)
        inverse = tf.where(flat, row, tf.shape(index, out_type=tf.int64)[0])
        return RealRows(index, tf.reshape(inverse, tf.shape(padding)))


def gather_rows(x, rows: RealRows):
    """The rows of `x` `(B, T, d)` at the real tokens: `(R, d)`."""
    import tensorflow as tf

    return tf.gather(tf.reshape(x, [-1, x.shape[-1]]), rows.index)


def scatter_rows(values, rows: RealRows):
    """`values` `(R, d)`, one per real token, on the `(B, T, d)` grid, zeros
    at padded positions."""
    import tensorflow as tf

    zero = tf.zeros([1, values.shape[-1]], values.dtype)
    return tf.gather(tf.concat([values, zero], 0), rows.inverse)


def layer_norm(layer, rows):
    """`layer(rows)` for a `keras.layers.LayerNormalization` of the real
    tokens' rows `(R, d)` in serving mode, in the fewest element-wise passes
    (Keras 3 computes `x * inv + (beta - mean * inv)`, one pass more). In
    float32 for half-precision rows, as Keras's; other layer norms (RMS
    scaling, no `gamma` or `beta`, another axis than the last, float64) are
    the layer's own call.

    Not the graph oneDNN fuses into one layer-norm kernel: TF Serving's
    release builds run without oneDNN, and there that graph is slower than
    Keras's (docs/experiments/2026-12-06-serving-rows.md)."""
    import tensorflow as tf

    axis = layer.axis if isinstance(layer.axis, int) else tuple(layer.axis)
    if (
        axis not in (-1, (-1,))
        or layer.rms_scaling
        or layer.gamma is None
        or layer.beta is None
        or rows.dtype not in (tf.float32, tf.bfloat16, tf.float16)
    ):
        return layer(rows)
    x = tf.cast(rows, tf.float32)
    mean = tf.reduce_mean(x, -1, keepdims=True)
    centered = x - mean
    variance = tf.reduce_mean(tf.square(centered), -1, keepdims=True)
    scale = tf.math.rsqrt(variance + layer.epsilon) * tf.cast(layer.gamma, tf.float32)
    outputs = tf.cast(layer.beta, tf.float32) + centered * scale
    return tf.cast(tf.cast(outputs, rows.dtype), layer.compute_dtype)
