"""`map_chunks`: `keras.ops.map` without its extra call."""

from __future__ import annotations

from keras import ops


def map_chunks(fn, count, init):
    """`[fn(i) for i in range(count)]` stacked on a new first axis, in
    `keras.ops`, eagerly or in a traced graph (`count` may be a tensor).

    `keras.ops.map` on TensorFlow calls `fn` once more on the first element
    to learn its output's structure, which costs a whole chunk (a model call
    per window) and stays in an exported graph; `ops.scan` does not, given
    `init`, zeros of `fn`'s output structure (its shapes may have unknown
    batch dimensions).
    """

    def step(carry, index):
        outputs = fn(index)
        return outputs, outputs

    _, stacked = ops.scan(step, init, ops.arange(count, dtype="int32"))
    return stacked
