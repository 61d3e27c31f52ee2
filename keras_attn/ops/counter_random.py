"""Stateless, counter-based random draws: the same bits on every backend.

`keras.random` takes a Python int or a `SeedGenerator` (a variable) as its
seed. Neither fits a loop that must compile once and be exported (an int is
frozen at trace time, and a variable is state that JAX needs threaded through
`jax.jit` by hand), nor a backward pass that must redraw the forward pass's
dropout block by block. Here a random value is a pure function of a seed
*tensor* and a counter (the element's position), hashed with integer
`keras.ops` (`counter_bits`, on `keras_attn.ops._hash`):

- the same seed gives the same values, call after call, eager or compiled;
- the seed can be an input of a `tf.function` / SavedModel signature;
- TensorFlow, JAX and PyTorch draw the same bits (the hash is exact integer
  math).

Two users: the memory-efficient attention's dropout (`dropout_factors`,
regenerated for any block pair by either pass), and sampling inside a
decoding loop (`keras_attn.generation`: `seed_tensor`, `step_seed`,
`categorical`), which uses the Gumbel-max trick: `argmax(log_probs + Gumbel
noise)` is an exact draw from `softmax(log_probs)`.
"""

from __future__ import annotations

import numbers
import random

import keras
import numpy as np
from keras import ops

from keras_attn.ops._hash import GOLDEN, add, hash_dtype, mix, multiply, u32


def counter_bits(counters, seed, salt):
    """Uniform 32-bit values of `counters` under `seed`.

    `mix(mix(counters ^ seed) + salt)`, two rounds of the "lowbias32" hash
    (`keras_attn.ops._hash.mix`) with `salt` added between them. The three
    arguments are 32-bit tensors of the hash's dtype (`_hash.u32`) that
    broadcast together; the result has their broadcast shape.
    """
    return mix(add(mix(ops.bitwise_xor(counters, seed)), salt))


# -- sampling in a decoding loop ----------------------------------------------


def seed_tensor(seed):
    """A 32-bit seed tensor from an int, an integer tensor or array of rank 0
    (one seed for the batch) or 1 (one seed per row, `(B,)`), or `None`.

    With one seed per row, the draws of row `b` depend on `seed[b]` alone,
    not on the row's place in the batch nor on the other rows (`uniform`):
    a request decoded alone or batched with others draws the same tokens.
    Seeds are taken modulo 2**32.

    `None` draws a Python-side random seed *when called*: under `tf.function`
    or `jax.jit` that freezes it into the trace, so pass a seed tensor there.
    """
    if seed is None:
        seed = random.SystemRandom().randrange(2**32)
    if isinstance(seed, numbers.Integral) and not isinstance(seed, bool):
        return u32(int(seed))
    if isinstance(seed, (list, tuple)):
        if not all(
            isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in seed
        ):
            raise ValueError(
                f"`seed` must be an int, integers or None. Received: seed={seed!r}"
            )
        seed = np.asarray([int(s) for s in seed], "int64")
    if isinstance(seed, np.ndarray) and seed.dtype.kind in "iu":
        # Modulo 2**32 here: JAX without 64-bit types refuses (a list) or
        # truncates (an array) what does not fit its int32.
        seed = seed_bits(seed)
    seed = ops.convert_to_tensor(seed)
    if len(seed.shape) > 1 or "int" not in str(seed.dtype):
        raise ValueError(
            "`seed` must be an int, an integer tensor of rank 0 or 1 (one seed "
            f"per row) or None. Received: seed={seed!r}"
        )
    return u32(seed)


def seed_bits(values: np.ndarray) -> np.ndarray:
    """Integer seeds (a NumPy array) modulo 2**32, as NumPy values of the
    hash's dtype."""
    return (values.astype("int64") & 0xFFFFFFFF).astype(hash_dtype())


def row_seeds(seed) -> bool:
    """Whether `seed` (a `seed_tensor`) holds one seed per row."""
    return len(ops.shape(seed)) == 1


def check_row_seeds(seed, batch) -> None:
    """Raises where `seed` (a `seed_tensor`) has one seed per row but not
    `batch` of them (both known when traced)."""
    if not row_seeds(seed):
        return
    count = ops.shape(seed)[0]
    if isinstance(count, int) and isinstance(batch, int) and count != batch:
        raise ValueError(
            "`seed` must be one int or one per row of the batch. Received: "
            f"{count} seeds for a batch of {batch}"
        )


def step_seed(seed, step):
    """Fold a loop index into a 32-bit seed: a fresh stream for every step
    (elementwise: a seed per row gives a seed per row)."""
    return counter_bits(u32(seed), u32(GOLDEN), u32(step))


def uniform(seed, shape):
    """Uniform floats in the open interval (0, 1), shape `(rows, cols)`.

    `seed` is a 32-bit seed tensor (see `step_seed`): scalar, the value at
    `(i, j)` depends only on the seed and on `i * cols + j`; one per row
    `(rows,)`, only on `seed[i]` and `j`.
    """
    rows, cols = shape
    columns = ops.arange(cols, dtype="int32")[None, :]  # (1, c)
    if row_seeds(seed):
        seed = seed[:, None]  # (rows, 1): a row's stream is its own seed's
        counters = u32(columns)
    else:
        row_ids = ops.arange(rows, dtype="int32")[:, None] * cols  # (rows, 1)
        counters = u32(row_ids + columns)  # (r, c)
    bits = counter_bits(counters, seed, seed)
    mantissa = ops.cast(ops.right_shift(bits, u32(8)), "float32")  # [0, 2^24)
    return mantissa * (2.0**-24) + 2.0**-25


def gumbel(seed, shape):
    """Standard Gumbel noise `-log(-log(u))`, float32, shape `(rows, cols)`."""
    return -ops.log(-ops.log(uniform(seed, shape)))


def categorical(log_probs, seed):
    """One draw per row from `softmax(log_probs)`: `(B, n)` -> int32 `(B,)`.

    Entries at a large negative value (or `-inf`) are never drawn.
    """
    log_probs = ops.cast(log_probs, "float32")
    shape = ops.shape(log_probs)
    noise = gumbel(seed, (shape[0], shape[1]))  # (B, n)
    return ops.cast(ops.argmax(log_probs + noise, axis=-1), "int32")


# -- dropout --------------------------------------------------------------------


def dropout_seed(seed_generator):
    """A scalar 32-bit seed tensor for `dropout_factors`, drawn once per call
    from `seed_generator` (a `keras.random.SeedGenerator`; the global one when
    `None`)."""
    seed = keras.random.randint((), 0, 2**31 - 1, dtype="int32", seed=seed_generator)
    return mix(u32(seed))


def dropout_factors(seed, rows, columns, rate):
    """Dropout factors, 0 or `1 / (1 - rate)` (float32), of the elements
    `(row, column)` of a grid.

    The keep decision of an element is a hash of `seed` (`dropout_seed`), its
    row counter and its column counter: uniform 32-bit values compared with
    `rate · 2³²`, so each element is kept with probability `1 - rate` and any
    part of the grid can be regenerated from its counters alone.

    Args:
        seed: scalar 32-bit seed tensor.
        rows: 32-bit counters `(..., 1)` of the rows (`_hash.u32`).
        columns: 32-bit counters `(n,)` of the columns.
        rate: float in [0, 1).

    Returns:
        `(..., n)` float32.
    """
    bits = counter_bits(rows, seed, multiply(columns, u32(GOLDEN)))
    threshold = u32(min(round(rate * 2**32), 2**32 - 1))
    keep = ops.greater_equal(bits, threshold)
    return ops.multiply(ops.cast(keep, "float32"), 1.0 / (1.0 - rate))
