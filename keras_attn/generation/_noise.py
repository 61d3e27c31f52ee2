"""Stateless, counter-based random draws for sampling inside a decoding loop.

`keras.random` takes a Python int or a `SeedGenerator` (a variable) as its
seed. Neither fits a loop that must compile once and be exported: an int is
frozen at trace time, and a variable is state that JAX needs threaded through
`jax.jit` by hand. Here the randomness is a pure function of a seed *tensor*,
the loop index and the element position, hashed with integer `keras.ops`:

- the same seed gives the same tokens, call after call, eager or compiled;
- the seed can be an input of a `tf.function` / SavedModel signature;
- TensorFlow, JAX and PyTorch draw the same bits (the hash is exact integer
  math, `keras_attn.ops._hash`).

Sampling uses the Gumbel-max trick: `argmax(log_probs + Gumbel noise)` is an
exact draw from `softmax(log_probs)`.
"""

from __future__ import annotations

import numbers
import random

from keras import ops

from keras_attn.ops._hash import GOLDEN, add, mix, u32


def seed_tensor(seed):
    """A scalar 32-bit seed tensor from an int, a scalar int tensor or `None`.

    `None` draws a Python-side random seed *when called*: under `tf.function`
    or `jax.jit` that freezes it into the trace, so pass a seed tensor there.
    """
    if seed is None:
        seed = random.SystemRandom().randrange(2**32)
    if isinstance(seed, numbers.Integral) and not isinstance(seed, bool):
        return u32(int(seed))
    seed = ops.convert_to_tensor(seed)
    if len(seed.shape) != 0 or "int" not in str(seed.dtype):
        raise ValueError(
            "`seed` must be an int, a scalar integer tensor or None. "
            f"Received: seed={seed!r}"
        )
    return u32(seed)


def step_seed(seed, step):
    """Fold a loop index into a 32-bit seed: a fresh stream for every step."""
    return mix(add(mix(ops.bitwise_xor(u32(seed), u32(GOLDEN))), u32(step)))


def uniform(seed, shape):
    """Uniform floats in the open interval (0, 1), shape `(rows, cols)`.

    `seed` is a scalar 32-bit seed tensor (see `step_seed`); the value at `(i, j)`
    depends only on the seed and on `i * cols + j`.
    """
    rows, cols = shape
    row_ids = ops.arange(rows, dtype="int32")[:, None] * cols  # (rows, 1)
    counters = u32(row_ids + ops.arange(cols, dtype="int32")[None, :])  # (r, c)
    bits = mix(add(mix(ops.bitwise_xor(counters, seed)), seed))
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
