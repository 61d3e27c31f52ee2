"""The encoder blocks' real-token rows in serving mode
(`keras_attn.ops.serving_mode`): which calls take them, and the gather and
scatter between a `(B, T, d)` batch and its `(R, d)` real tokens."""

from __future__ import annotations

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


def real_rows(padding):
    """The flat indices `(R, 1)` of the real tokens of a `(B, T)` mask."""
    import tensorflow as tf

    return tf.where(tf.reshape(padding, [-1]))


def gather_rows(x, index):
    """The rows of `x` `(B, T, d)` at `index` `(R, 1)`: `(R, d)`."""
    import tensorflow as tf

    return tf.gather_nd(tf.reshape(x, [-1, x.shape[-1]]), index)


def scatter_rows(rows, index, like):
    """`rows` `(R, d)` put back at `index` in a `(B, T, d)` tensor shaped as
    `like`, zeros elsewhere."""
    import tensorflow as tf

    shape = tf.shape(like, out_type=tf.int64)
    flat = tf.scatter_nd(index, rows, [shape[0] * shape[1], shape[2]])
    return tf.reshape(flat, shape)
