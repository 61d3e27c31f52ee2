"""32-bit integer hashing with `keras.ops`: the same bits on every backend.

The memory-efficient path's dropout and the decoding loop's sampling noise
are pure functions of a seed tensor and a counter, hashed with Wellons'
"lowbias32" (a bijection of 32-bit integers). TensorFlow and JAX compute it
in `uint32`, whose products and sums wrap modulo 2**32. PyTorch has no
`uint32` arithmetic: Keras's torch backend computes those ops in `int64`,
where nothing wraps. There the hash runs in `int64` and each product and sum
is reduced to its low 32 bits (two's-complement wrapping of an `int64`
product keeps those bits exact), so every backend draws the same values.
"""

from __future__ import annotations

import keras
from keras import ops

GOLDEN = 0x9E3779B9  # 2**32 / golden ratio, a Weyl-sequence increment
_LOW_32_BITS = 0xFFFFFFFF


def _native_uint32() -> bool:
    return keras.backend.backend() != "torch"


def hash_dtype() -> str:
    """The integer dtype the hash computes in: `uint32`, or `int64` on torch."""
    return "uint32" if _native_uint32() else "int64"


def u32(value):
    """`value` (a Python int, array or integer tensor) as a tensor of the
    hash's dtype, taken modulo 2**32."""
    if isinstance(value, int):
        value &= _LOW_32_BITS
        return ops.convert_to_tensor(value, hash_dtype())
    value = ops.cast(value, hash_dtype())
    return value if _native_uint32() else ops.bitwise_and(value, _LOW_32_BITS)


def _wrap(x):
    return x if _native_uint32() else ops.bitwise_and(x, u32(_LOW_32_BITS))


def add(x, y):
    """`(x + y) mod 2**32`."""
    return _wrap(ops.add(x, y))


def multiply(x, y):
    """`(x * y) mod 2**32`."""
    return _wrap(ops.multiply(x, y))


def mix(x):
    """The "lowbias32" integer hash (C. Wellons): 32-bit values -> 32-bit values."""

    def shift_xor(x, bits):
        return ops.bitwise_xor(x, ops.right_shift(x, u32(bits)))

    x = shift_xor(x, 16)
    x = multiply(x, u32(0x7FEB352D))
    x = shift_xor(x, 15)
    x = multiply(x, u32(0x846CA68B))
    return shift_xor(x, 16)
