"""`SinusoidalPositionEncoding`: the fixed sine/cosine position encoding."""

from __future__ import annotations

import numbers

import keras
import numpy as np
from keras import ops

from keras_attn import _validation as v


def _inverse_frequencies(dim: int, max_wavelength: float) -> np.ndarray:
    """`1 / max_wavelength^(2k/dim)` for `k = 0..ceil(dim/2)-1`, float32.

    Computed in float64 by NumPy and rounded once, so the frequencies carry no
    error from the dtype policy.
    """
    pairs = np.arange((dim + 1) // 2, dtype="float64")  # (K,)
    return np.power(float(max_wavelength), -2.0 * pairs / dim).astype("float32")


def sinusoidal_encoding(positions, dim: int, max_wavelength: float = 10000.0):
    """The sinusoidal encoding of `positions`, in float32.

    `p(t, 2k) = sin(t / max_wavelength^(2k/dim))` and
    `p(t, 2k+1) = cos(t / max_wavelength^(2k/dim))`.

    Args:
        positions: integer tensor `(..., T)` of positions.
        dim: the encoding size (odd sizes end with a sine column).
        max_wavelength: the longest wavelength (divided by 2π), 10000 in the
            paper.

    Returns:
        float32 tensor `(..., T, dim)`.
    """
    positions = ops.cast(ops.convert_to_tensor(positions), "int32")
    frequencies = ops.convert_to_tensor(_inverse_frequencies(dim, max_wavelength))
    # Integer positions are exact in float32 up to 2**24; the float32 product
    # then errs by at most half an ulp of the angle (2.4e-4 at t = 4096).
    angles = ops.multiply(
        ops.cast(positions, "float32")[..., None], frequencies
    )  # (..., T, K)
    pairs = ops.stack([ops.sin(angles), ops.cos(angles)], axis=-1)  # (..., T, K, 2)
    shape = ops.shape(angles)
    encoding = ops.reshape(pairs, (*shape[:-1], 2 * shape[-1]))  # (..., T, 2K)
    if dim % 2:
        encoding = encoding[..., :dim]  # (..., T, dim): drop the last cosine
    return encoding


@keras.saving.register_keras_serializable(package="keras_attn")
class SinusoidalPositionEncoding(keras.layers.Layer):
    """Sinusoidal position encoding of Vaswani et al. (2017).

    From "Attention Is All You Need" (https://arxiv.org/abs/1706.03762):
    `p(t, 2k) = sin(t / 10000^(2k/d))`, `p(t, 2k+1) = cos(t / 10000^(2k/d))`
    for position `t` and feature `2k`/`2k+1` of a `d`-dimensional model.

    The layer returns the encoding (it does not add it), shaped like its input,
    as `keras_hub.layers.SinePositionEncoding` does: write
    `x + SinusoidalPositionEncoding()(x)`. Unlike keras-hub's layer, the
    positions, frequencies and sinusoids are computed in float32 whatever the
    dtype policy and only the result is cast to the compute dtype, so the
    encoding stays within float32 rounding of the formula at every position
    (keras-hub computes the angles in float16 under `mixed_float16` and is off
    by up to 1.8 at position 4096). An odd `d` is allowed: the last feature is
    then a sine.

    Args:
        max_wavelength: the `10000` of the formula (longest wavelength over
            2π), a positive number.
        **kwargs: base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        inputs: `(batch, T, d)`; only its shape is used.
        start_index: int or scalar int tensor, the position of the first step
            (cached decoding passes the index of the token being decoded).
        positions: optional int tensor `(T,)` or `(batch, T)` of explicit
            positions (e.g. for left-padded prompts); overrides `start_index`.

    Returns:
        The encoding, `(batch, T, d)` in the compute dtype. A Keras mask on
        `inputs` is passed on.

    Example:

    ```python
    tokens = keras.Input((None,), dtype="int32")
    x = keras.layers.Embedding(1000, 64)(tokens)
    x = x + keras_attn.layers.SinusoidalPositionEncoding()(x)  # (batch, T, 64)
    ```
    """

    def __init__(self, max_wavelength: float = 10000, **kwargs):
        super().__init__(**kwargs)
        if (
            isinstance(max_wavelength, bool)
            or not isinstance(max_wavelength, numbers.Real)
            or not max_wavelength > 0
        ):
            raise ValueError(
                "`max_wavelength` must be a positive number. "
                f"Received: max_wavelength={max_wavelength!r}"
            )
        self.max_wavelength = max_wavelength
        self.supports_masking = True
        self.built = True

    def call(self, inputs, start_index=0, positions=None):
        v.check_rank("inputs", inputs.shape, 3)
        dim = inputs.shape[-1]
        if dim is None:
            raise ValueError(
                "The last dimension of `inputs` must be known. "
                f"Received: inputs.shape={tuple(inputs.shape)}"
            )
        shape = ops.shape(inputs)
        if positions is None:
            positions = ops.arange(shape[1], dtype="int32") + ops.cast(
                start_index, "int32"
            )  # (T,)
        positions = ops.convert_to_tensor(positions)
        v.check_rank("positions", positions.shape, (1, 2))
        if len(positions.shape) == 1:
            positions = positions[None, :]  # (1, T)
        encoding = sinusoidal_encoding(positions, dim, self.max_wavelength)
        encoding = ops.cast(encoding, self.compute_dtype)  # (B|1, T, d)
        return ops.broadcast_to(encoding, shape)  # (B, T, d)

    def compute_output_shape(self, inputs_shape):
        return tuple(inputs_shape)

    def compute_mask(self, inputs, mask=None):
        return mask

    def get_config(self):
        config = super().get_config()
        config.update({"max_wavelength": self.max_wavelength})
        return config
