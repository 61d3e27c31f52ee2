"""`AlibiBias`: ALiBi's linear bias on attention scores, and the slope and
bias functions it is built from (also used on key blocks, where no
`(Tq, Tk)` tensor may be built)."""

from __future__ import annotations

import math
import numbers

import keras
from keras import ops

from keras_attn import _validation as v


def _check_alibi_bias_max(value):
    """A finite number > 0, kept an int when given one (as in the config)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not 0 < value < math.inf
    ):
        raise ValueError(
            "`alibi_bias_max` must be a positive number. "
            f"Received: alibi_bias_max={value!r}"
        )
    return int(value) if v.is_int(value) else float(value)


def _slopes(num_heads: int, alibi_bias_max) -> list[float]:
    """The slopes as Python floats, with keras-hub's float64 arithmetic step
    for step (so that they round to the same values in every dtype)."""

    def power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - math.log2(alibi_bias_max))))
        ratio = start
        return [start * ratio**i for i in range(n)]

    if num_heads & (num_heads - 1) == 0:
        return power_of_2(num_heads)
    closest = 1 << (num_heads.bit_length() - 1)  # the power of 2 below
    return power_of_2(closest) + power_of_2(2 * closest)[0::2][: num_heads - closest]


def alibi_slopes(num_heads: int, alibi_bias_max=8, dtype="float32"):
    """The per-head slopes of ALiBi (Press et al. 2022), as keras-hub's
    `AlibiBias` computes them.

    For `H` a power of two, the geometric sequence
    `2^(-alibi_bias_max * h / H)` for `h = 1..H` (8 heads: 1/2, 1/4, ...,
    1/256). For other `H`, the paper's recipe: the `P` slopes of the power of
    two `P` below `H`, then every other slope of `2P` heads (the 1st, 3rd,
    ...), the first `H - P` of them.

    Args:
        num_heads: positive int, the number of heads.
        alibi_bias_max: positive number, 8 in the paper; the smallest slope
            is `2^-alibi_bias_max` (for `H` a power of two).
        dtype: dtype of the result. The slopes are computed as Python
            floats (float64), then converted to it, as keras-hub does.

    Returns:
        Tensor `(num_heads,)`.
    """
    num_heads = v.check_positive_int("num_heads", num_heads)
    alibi_bias_max = _check_alibi_bias_max(alibi_bias_max)
    return ops.convert_to_tensor(_slopes(num_heads, alibi_bias_max), dtype=dtype)


def _integer_positions(name: str, positions, ranks):
    positions = ops.convert_to_tensor(positions)
    v.check_rank(name, positions.shape, ranks)
    dtype = keras.backend.standardize_dtype(positions.dtype)
    if "int" not in dtype:
        raise ValueError(f"`{name}` must hold integers. Received: {name}.dtype={dtype}")
    return ops.cast(positions, "int32")


def alibi_bias(slopes, key_positions, query_positions=None):
    """ALiBi's bias for one block of keys: `slope * (key - query)`.

    Without `query_positions`, the key-only form `slope * key`, one row
    broadcast over the queries. Both give the same attention weights: the
    softmax over keys does not change when a constant is added to a row, and
    `slope * (key - query)` differs from `slope * key` by `-slope * query`,
    constant along the row of query `query`. keras-hub's layer adds
    `slope * (key - (Tk - 1))` (the key-only form, zero at the last key),
    which `AlibiBias` computes as `query_positions=Tk - 1`; the paper's
    causal bias `-slope * (query - key)` is the full `(Tq, Tk)` form.

    Far from position 0 the key-only bias is large, and the scores it is
    added to lose their low bits (positions are cast to the dtype of
    `slopes`, exact to 2^24 in float32, to 256 in bfloat16); with
    `query_positions` the bias stays near zero for the keys near the query.

    Args:
        slopes: float tensor `(num_heads,)`, e.g. from `alibi_slopes`. The
            bias is computed in its dtype.
        key_positions: int tensor `(Tk_block,)`, the positions of the block's
            keys.
        query_positions: optional int tensor `(Tq,)` or scalar, the positions
            of the queries.

    Returns:
        Tensor `(num_heads, 1, Tk_block)` without `query_positions`, else
        `(num_heads, Tq, Tk_block)` (`Tq = 1` for a scalar), in the dtype of
        `slopes`; add it to scores `(batch, num_heads, Tq, Tk_block)`.
    """
    slopes = ops.convert_to_tensor(slopes)
    v.check_rank("slopes", slopes.shape, 1)
    keys = _integer_positions("key_positions", key_positions, 1)
    if query_positions is None:
        offsets = keys[None, :]  # (1, Tk)
    else:
        queries = _integer_positions("query_positions", query_positions, (0, 1))
        queries = ops.reshape(queries, (-1,))  # (Tq,)
        offsets = keys[None, :] - queries[:, None]  # (Tq, Tk)
    offsets = ops.cast(offsets, slopes.dtype)
    return slopes[:, None, None] * offsets[None]  # (H, 1 or Tq, Tk)


def _check_scores_shape(shape) -> int:
    """The number of heads of scores `(batch, num_heads, Tq, Tk)`."""
    v.check_rank("attention_scores", shape, 4)
    if shape[1] is None:
        raise ValueError(
            "The number of heads (axis 1) of `attention_scores` must be known. "
            f"Received: attention_scores.shape={tuple(shape)}"
        )
    return shape[1]


@keras.saving.register_keras_serializable(package="keras_attn")
class AlibiBias(keras.layers.Layer):
    """Attention with Linear Biases, ALiBi (Press et al. 2022).

    https://arxiv.org/abs/2108.12409. Instead of position embeddings, each
    head adds to its attention scores a fixed penalty linear in the distance
    between query and key, with a slope per head from `alibi_slopes` (a
    geometric sequence, 1/2 to 1/256 for 8 heads), which lets a model trained
    on short sequences extrapolate to longer ones.

    A drop-in for `keras_hub.layers.AlibiBias`, with the same argument,
    config and outputs: the bias added to the score of key `j` is
    `slope * (j - (key_length - 1))`, zero at the last key and the same for
    every query. It differs from the paper's `slope * (j - i)` for query `i`
    by a constant along each row, which the softmax ignores: the attention
    weights are the paper's, a penalty on the distance for the keys `j <= i`
    a causal mask leaves. Without a causal mask, keys after the query get a
    bonus rather than a penalty (it is not a symmetric `-slope * |i - j|`).

    Args:
        alibi_bias_max: positive number, 8 in the paper; the smallest slope
            is `2^-alibi_bias_max` when the number of heads is a power of two.
        **kwargs: base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        attention_scores: float tensor
            `(batch, num_heads, query_length, key_length)`, the scores before
            the softmax; `num_heads` must be known.

    Returns:
        `attention_scores` plus the bias, same shape, in the compute dtype
        (the bias is computed in it, as keras-hub does).

    Example:

    ```python
    query = keras.random.normal((2, 4, 10, 8))  # (batch, heads, Tq, head_dim)
    key = keras.random.normal((2, 4, 10, 8))
    scores = keras.ops.einsum("bhqd,bhkd->bhqk", query, key) / 8**0.5
    weights = keras.ops.softmax(keras_attn.layers.AlibiBias()(scores), axis=-1)
    ```
    """

    def __init__(self, alibi_bias_max=8, **kwargs):
        super().__init__(**kwargs)
        self.alibi_bias_max = _check_alibi_bias_max(alibi_bias_max)

    def call(self, attention_scores):
        num_heads = _check_scores_shape(attention_scores.shape)
        key_length = ops.shape(attention_scores)[-1]
        slopes = alibi_slopes(num_heads, self.alibi_bias_max, self.compute_dtype)
        bias = alibi_bias(
            slopes,
            ops.arange(key_length, dtype="int32"),
            query_positions=key_length - 1,
        )  # (H, 1, Tk)
        return ops.add(attention_scores, bias[None])

    def compute_output_shape(self, attention_scores_shape):
        _check_scores_shape(attention_scores_shape)
        return tuple(attention_scores_shape)

    def get_config(self):
        config = super().get_config()
        config.update({"alibi_bias_max": self.alibi_bias_max})
        return config
