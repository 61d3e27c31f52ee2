"""`RotaryEmbedding`: rotary position embedding (RoPE)."""

from __future__ import annotations

import math

import keras
import numpy as np
from keras import ops

from keras_attn import _validation as v

ROPE_TYPES = ("linear", "dynamic", "yarn")


@keras.saving.register_keras_serializable(package="keras_attn")
class RotaryEmbedding(keras.layers.Layer):
    """Rotary position embedding, RoPE (Su et al. 2021).

    From "RoFormer: Enhanced Transformer with Rotary Position Embedding"
    (https://arxiv.org/abs/2104.09864): the features of a query or key at
    position `t` are rotated in pairs by the angles `t * f_k`, with
    `f_k = max_wavelength^(-2k/d)` for `k = 0..d/2-1`, so that the dot product
    of a rotated query and key depends on their positions only through their
    distance. As in `keras_hub.layers.RotaryEmbedding`, feature `k` is paired
    with feature `k + d/2` (the first half of the feature axis with the
    second): `y_k = x_k cos(t f_k) - x_{k+d/2} sin(t f_k)` and
    `y_{k+d/2} = x_{k+d/2} cos(t f_k) + x_k sin(t f_k)`.

    The layer takes keras-hub's arguments, in keras-hub's order, with the same
    defaults and `get_config` keys (a config of either layer builds the other)
    and gives keras-hub's outputs up to float32 rounding. The frequency
    scalings are keras-hub's:

    - `"linear"` (position interpolation): `f_k / scaling_factor`.
    - `"dynamic"`: `f_k / scaling_factor^(d / (d - 2))`, a fixed scaling (it
      does not depend on the sequence length).
    - `"yarn"` (Peng et al. 2023, https://arxiv.org/abs/2309.00071): the
      pairs that turn more than `beta_fast` times over
      `original_max_position_embeddings` positions keep `f_k`, those that
      turn fewer than `beta_slow` times get `f_k / scaling_factor`, with a
      linear ramp over the pair index `k` between; cosines and sines are
      multiplied by `0.1 ln(scaling_factor) + 1`. `denominator_dim` is not
      used.

    The positions, frequencies, angles and sinusoids are computed in float32
    whatever the dtype policy (the frequencies in float64 by NumPy, rounded
    once); only the cosines and sines are cast to the compute dtype. Float
    `positions` and `start_index` are not cast to the compute dtype on the way
    in, so fractional or large float positions keep float32 precision under
    `mixed_bfloat16` too; YaRN's factor is applied in float32 before that
    cast. keras-attn adds checks of the arguments and shapes,
    with errors that name the argument and the value received.

    Args:
        max_wavelength: the `10000` of `f_k` (longest wavelength over 2π), a
            positive number; more than 1 for `"yarn"`.
        scaling_factor: positive number, the context extension factor of the
            scaling (1 keeps the frequencies for `"linear"` and `"dynamic"`).
        rope_type: `"linear"`, `"dynamic"` or `"yarn"`.
        beta_fast: positive number, YaRN's `beta`: pairs that turn more
            times over the original context keep their frequency. `"yarn"`
            only.
        beta_slow: positive number, YaRN's `alpha`: pairs that turn fewer
            times are interpolated. `"yarn"` only.
        original_max_position_embeddings: positive int, the context length
            the model was trained with. `"yarn"` only.
        truncate: bool, round the correction range out to whole feature pairs
            (as the reference YaRN code). `"yarn"` only.
        sequence_axis: int, the axis of `inputs` that holds the positions.
        feature_axis: int, the axis of `inputs` that holds the `d` features.
        denominator_dim: positive int or `None`, the `d` of the exponent
            `-2k/d` (`None`: the feature size), for a rotation of only part of
            the head dimension with the frequencies of the whole. Not used by
            `"yarn"`.
        **kwargs: base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        inputs: a tensor of rank 3 or more, e.g. `(batch, T, d)` or
            `(batch, T, heads, d)`, with an even, known feature size `d`. Its
            first axis that is neither `sequence_axis` nor `feature_axis` is
            the batch axis of rank-2 `positions`.
        start_index: int or scalar tensor, the position of the first step
            (cached decoding passes the index of the token being decoded).
        positions: optional tensor `(T,)` or `(batch, T)` of explicit
            positions (integers, or floats); overrides `start_index`.

    Returns:
        The rotated `inputs`, same shape, in the compute dtype. A Keras mask
        on `inputs` is passed on.

    Example:

    ```python
    rope = keras_attn.layers.RotaryEmbedding(max_wavelength=10000)
    query = keras.random.normal((2, 10, 4, 16))  # (batch, T, heads, head_dim)
    rotated = rope(query)  # (2, 10, 4, 16), positions 0..9
    next_query = keras.random.normal((2, 1, 4, 16))
    rotated_next = rope(next_query, start_index=10)  # position 10
    ```
    """

    def __init__(
        self,
        max_wavelength=10000,
        scaling_factor=1.0,
        rope_type="linear",
        beta_fast=32.0,
        beta_slow=1.0,
        original_max_position_embeddings=4096,
        truncate=True,
        sequence_axis=1,
        feature_axis=-1,
        denominator_dim=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        v.check_positive_float("max_wavelength", max_wavelength)
        v.check_positive_float("scaling_factor", scaling_factor)
        v.check_choice("rope_type", rope_type, ROPE_TYPES)
        v.check_positive_float("beta_fast", beta_fast)
        v.check_positive_float("beta_slow", beta_slow)
        v.check_positive_int(
            "original_max_position_embeddings", original_max_position_embeddings
        )
        if not isinstance(truncate, (bool, np.bool_)):
            raise ValueError(
                f"`truncate` must be a bool. Received: truncate={truncate!r}"
            )
        for name, axis in (
            ("sequence_axis", sequence_axis),
            ("feature_axis", feature_axis),
        ):
            if not v.is_int(axis):
                raise ValueError(
                    f"`{name}` must be an integer. Received: {name}={axis!r}"
                )
        v.check_positive_int("denominator_dim", denominator_dim, allow_none=True)
        if rope_type == "yarn" and not max_wavelength > 1:
            raise ValueError(
                "`max_wavelength` must be more than 1 for rope_type='yarn' (its "
                "correction range divides by log(max_wavelength)). "
                f"Received: max_wavelength={max_wavelength!r}"
            )
        # The values are kept as given, so that `get_config` returns what
        # keras-hub's layer would.
        self.max_wavelength = max_wavelength
        self.scaling_factor = scaling_factor
        self.rope_type = rope_type
        self.beta_fast = beta_fast
        self.beta_slow = beta_slow
        self.original_max_position_embeddings = original_max_position_embeddings
        self.truncate = bool(truncate)
        self.sequence_axis = int(sequence_axis)
        self.feature_axis = int(feature_axis)
        self.denominator_dim = denominator_dim
        # `call` casts `inputs` to the compute dtype itself: Keras' autocast
        # would also round float `positions` / `start_index` to it.
        self.autocast = False
        self.supports_masking = True
        self.built = True

    # -- frequencies ---------------------------------------------------------

    def _inverse_frequencies(self, dim: int) -> np.ndarray:
        """The `d/2` scaled inverse frequencies, in float64."""
        base = float(self.max_wavelength)
        scale = float(self.scaling_factor)
        exponents = np.arange(0, dim, 2, dtype="float64")  # 2k, (d/2,)
        if self.rope_type == "yarn":
            extrapolation = np.power(base, -exponents / dim)
            interpolation = extrapolation / scale

            def correction_dim(rotations):
                # The pair index whose wavelength fits `rotations` times into
                # the original context.
                context = float(self.original_max_position_embeddings)
                return (dim * math.log(context / (rotations * 2 * math.pi))) / (
                    2 * math.log(base)
                )

            low = correction_dim(float(self.beta_fast))
            high = correction_dim(float(self.beta_slow))
            if self.truncate:
                low, high = math.floor(low), math.ceil(high)
            low, high = max(low, 0.0), min(high, dim - 1.0)
            ramp = (np.arange(dim // 2, dtype="float64") - low) / max(high - low, 0.001)
            extrapolation_share = 1.0 - np.clip(ramp, 0.0, 1.0)
            return (
                interpolation * (1.0 - extrapolation_share)
                + extrapolation * extrapolation_share
            )
        denominator = float(self.denominator_dim or dim)
        inverse = np.power(base, -exponents / denominator)
        if self.rope_type == "linear":
            return inverse / scale
        return inverse / scale ** (dim / max(1, dim - 2))  # "dynamic"

    def _attention_factor(self) -> float:
        """YaRN's scale of the cosines and sines (1 for the other types)."""
        if self.rope_type == "yarn":
            return 0.1 * math.log(float(self.scaling_factor)) + 1.0
        return 1.0

    # -- call ------------------------------------------------------------------

    def _check_shapes(self, inputs_shape, positions_shape=None):
        """`(batch_axis, sequence_axis, feature_axis)` of `inputs`, non-negative,
        after checking the shapes of `inputs` and `positions`."""
        inputs_shape = tuple(inputs_shape)
        rank = len(inputs_shape)
        if rank < 3:
            raise ValueError(
                "`inputs` must have rank 3 or more (a batch, a sequence and a "
                f"feature axis). Received: inputs.shape={inputs_shape}"
            )
        axes = []
        for name, axis in (
            ("sequence_axis", self.sequence_axis),
            ("feature_axis", self.feature_axis),
        ):
            if not -rank <= axis < rank:
                raise ValueError(
                    f"`{name}` is out of range for `inputs` of rank {rank}. "
                    f"Received: {name}={axis}, inputs.shape={inputs_shape}"
                )
            axes.append(axis % rank)
        sequence_axis, feature_axis = axes
        if sequence_axis == feature_axis:
            raise ValueError(
                "`sequence_axis` and `feature_axis` must be different axes. "
                f"Received: sequence_axis={self.sequence_axis}, "
                f"feature_axis={self.feature_axis}, inputs.shape={inputs_shape}"
            )
        dim = inputs_shape[feature_axis]
        if dim is None or dim % 2:
            raise ValueError(
                "The feature axis of `inputs` must have a known, even size (the "
                "rotation pairs its first half with its second half). "
                f"Received: inputs.shape={inputs_shape}, "
                f"feature_axis={self.feature_axis}"
            )
        if positions_shape is not None:
            v.check_rank("positions", positions_shape, (1, 2))
            if not v.same_dim(positions_shape[-1], inputs_shape[sequence_axis]):
                raise ValueError(
                    "The last axis of `positions` must have the size of the "
                    "sequence axis of `inputs`. Received: positions.shape="
                    f"{tuple(positions_shape)}, inputs.shape={inputs_shape}, "
                    f"sequence_axis={self.sequence_axis}"
                )
        batch_axis = min(set(range(rank)) - {sequence_axis, feature_axis})
        return batch_axis, sequence_axis, feature_axis

    def call(self, inputs, start_index=0, positions=None):
        inputs = ops.cast(inputs, self.compute_dtype)
        static_shape = tuple(inputs.shape)
        if positions is not None:
            positions = ops.convert_to_tensor(positions)
        batch_axis, sequence_axis, feature_axis = self._check_shapes(
            static_shape, None if positions is None else positions.shape
        )
        dim = static_shape[feature_axis]
        if positions is None:
            length = static_shape[sequence_axis]
            if length is None:
                length = ops.shape(inputs)[sequence_axis]
            positions = ops.arange(length, dtype="float32") + ops.cast(
                start_index, "float32"
            )
        else:
            positions = ops.cast(positions, "float32")
        if len(positions.shape) == 1:
            positions = positions[None, :]  # (1, T)

        frequencies = ops.convert_to_tensor(
            self._inverse_frequencies(dim).astype("float32")
        )  # (d/2,)
        angles = positions[:, :, None] * frequencies  # (1|B, T, d/2), float32
        cos, sin = ops.cos(angles), ops.sin(angles)
        factor = self._attention_factor()
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor

        # (1|B, T, d/2) -> the axes of `inputs`, size 1 on the others.
        targets = (batch_axis, sequence_axis, feature_axis)
        order = sorted(range(3), key=targets.__getitem__)
        rank = len(static_shape)
        cos, sin = ops.transpose(cos, order), ops.transpose(sin, order)
        for axis in range(rank):
            if axis not in targets:
                cos, sin = ops.expand_dims(cos, axis), ops.expand_dims(sin, axis)
        cos = ops.cast(cos, self.compute_dtype)
        sin = ops.cast(sin, self.compute_dtype)

        first, second = ops.split(inputs, 2, axis=feature_axis)
        return ops.concatenate(
            [first * cos - second * sin, second * cos + first * sin],
            axis=feature_axis,
        )

    def compute_output_shape(self, inputs_shape, positions_shape=None):
        self._check_shapes(inputs_shape, positions_shape)
        return tuple(inputs_shape)

    def compute_mask(self, inputs, mask=None):
        return mask

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "max_wavelength": self.max_wavelength,
                "scaling_factor": self.scaling_factor,
                "rope_type": self.rope_type,
                "beta_fast": self.beta_fast,
                "beta_slow": self.beta_slow,
                "original_max_position_embeddings": (
                    self.original_max_position_embeddings
                ),
                "truncate": self.truncate,
                "sequence_axis": self.sequence_axis,
                "feature_axis": self.feature_axis,
                "denominator_dim": self.denominator_dim,
            }
        )
        return config
