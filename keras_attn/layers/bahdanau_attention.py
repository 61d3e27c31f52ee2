"""`BahdanauAttention`: additive attention (Bahdanau et al., 2015)."""

from __future__ import annotations

import math

import keras
from keras import ops

from keras_attn import _validation as v
from keras_attn.layers.base_attention import BaseAttention
from keras_attn.ops.scores import additive_score_from_projections


@keras.saving.register_keras_serializable(package="keras_attn")
class BahdanauAttention(BaseAttention):
    """Additive attention of Bahdanau et al., `e = vᵀ tanh(W_q q + W_k k)`.

    From "Neural Machine Translation by Jointly Learning to Align and
    Translate" (Bahdanau, Cho and Bengio, 2015,
    https://arxiv.org/abs/1409.0473). The decoder state `q` (the paper's
    `s_{i-1}`) and each encoder state `k` (`h_j`) are projected to `units`,
    added, squashed with `tanh` and scored with the vector `v`; the softmax of
    the scores weighs the values (by default the encoder states themselves).

    With `normalize=True` the score is the weight-normalised variant of
    Salimans and Kingma (2016) as in TF Addons: `v` is replaced by
    `g · v / ||v||` with a learned scalar `g`, and a bias `b` is added inside
    the `tanh`.

    With `use_bias=True` the plain score has that bias too,
    `e = vᵀ tanh(W_q q + W_k k + b)`: the form of TensorFlow's NMT tutorial,
    whose `Dense` layers `W1` and `W2` each carry a bias inside the `tanh`
    (`b` is their sum; copy `W1.bias + W2.bias` into `score_bias`) and whose
    `V` carries one outside it, which adds the same number to every score
    and cancels in the softmax (drop it).

    Args:
        units: size of the projections `W_q`, `W_k` and of `v`.
        normalize: use the weight-normalised score (it has a bias `b` inside
            the `tanh`).
        dropout: dropout rate on the attention weights, in [0, 1).
        kernel_initializer: initializer of `W_q`, `W_k` and `v`.
        kernel_regularizer: regularizer of `W_q`, `W_k` and `v`.
        seed: seed of the dropout.
        use_bias: add a learned bias `b` of size `units` inside the `tanh` of
            the plain score (the weight `score_bias`, zeros at first, created
            after `W_q`, `W_k` and `v`). The default `False` is Bahdanau's
            paper, without biases. `normalize=True` has the bias already:
            the two cannot be combined.
        **kwargs: base layer arguments (`name`, `dtype`, ...).

    Call arguments and returns: see `BaseAttention`. The query is one decoder
    state `(batch, dq)` or a sequence `(batch, Tq, dq)`; `projected_key` is
    the key's projection `W_k k` `(batch, Tk, units)` from `project_key(key)`.

    Example:

    ```python
    encoder_states = keras.Input((None, 64))  # (batch, Ts, 64)
    decoder_state = keras.Input((32,))  # (batch, 32)
    context, weights = keras_attn.layers.BahdanauAttention(units=48)(
        decoder_state, encoder_states, return_attention_scores=True
    )  # (batch, 64), (batch, Ts)
    model = keras.Model([decoder_state, encoder_states], [context, weights])
    ```
    """

    def __init__(
        self,
        units: int,
        normalize: bool = False,
        dropout: float = 0.0,
        kernel_initializer="glorot_uniform",
        kernel_regularizer=None,
        seed: int | None = None,
        use_bias: bool = False,
        **kwargs,
    ):
        super().__init__(dropout=dropout, seed=seed, **kwargs)
        self.units = v.check_positive_int("units", units)
        if not isinstance(normalize, bool):
            raise ValueError(
                f"`normalize` must be a bool. Received: normalize={normalize!r}"
            )
        if not isinstance(use_bias, bool):
            raise ValueError(
                f"`use_bias` must be a bool. Received: use_bias={use_bias!r}"
            )
        if use_bias and normalize:
            raise ValueError(
                "`use_bias=True` adds the bias inside the `tanh` that "
                "`normalize=True` already has; pass one of them. Received: "
                f"use_bias={use_bias!r}, normalize={normalize!r}"
            )
        self.normalize = normalize
        self.use_bias = use_bias
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)

    def build_score(self, query_dim: int, key_dim: int) -> None:
        def weight(name, shape, initializer=None):
            return self.add_weight(
                name=name,
                shape=shape,
                initializer=initializer or self.kernel_initializer,
                regularizer=self.kernel_regularizer,
            )

        self.query_kernel = weight("query_kernel", (query_dim, self.units))  # W_q
        self.key_kernel = weight("key_kernel", (key_dim, self.units))  # W_k
        # v is a (units,) vector; glorot on a 1-D shape would treat it as
        # (units, units) fans, so initialise it as the column it is.
        self.score_vector = weight("score_vector", (self.units,), "glorot_uniform")
        if self.use_bias:
            self.score_bias = self.add_weight(
                name="score_bias", shape=(self.units,), initializer="zeros"
            )  # b
        if self.normalize:
            self.score_scale = self.add_weight(
                name="score_scale",
                shape=(),
                initializer=keras.initializers.Constant(math.sqrt(1.0 / self.units)),
            )  # g
            self.score_bias = self.add_weight(
                name="score_bias", shape=(self.units,), initializer="zeros"
            )  # b

    def project_key(self, key):
        """`W_k k`, `(batch, Tk, dk) -> (batch, Tk, units)`.

        In a step-by-step decoder loop compute it once per source and pass it
        to every step's call as `projected_key`.
        """
        key = ops.convert_to_tensor(key)
        return ops.matmul(key, ops.cast(self.key_kernel, key.dtype))

    @property
    def projected_key_dim(self) -> int:
        return self.units

    def score(self, query, key):
        return self.score_from_projected_key(query, self.project_key(key))

    def score_from_projected_key(self, query, projected_key):
        """Scores `(batch, Tq, Tk)` of a query and keys already projected."""
        projected_query = ops.matmul(
            query, ops.cast(self.query_kernel, query.dtype)
        )  # (B, Tq, units)
        projected_key = ops.cast(projected_key, projected_query.dtype)
        score_vector = self.score_vector
        bias = self.score_bias if self.use_bias else None
        if self.normalize:
            score_vector = (
                self.score_scale
                * score_vector
                * ops.rsqrt(ops.sum(ops.square(score_vector)))
            )
            bias = self.score_bias
        return additive_score_from_projections(
            projected_query, projected_key, score_vector, bias
        )  # (B, Tq, Tk)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "units": self.units,
                "normalize": self.normalize,
                "use_bias": self.use_bias,
                "kernel_initializer": keras.initializers.serialize(
                    self.kernel_initializer
                ),
                "kernel_regularizer": keras.regularizers.serialize(
                    self.kernel_regularizer
                ),
            }
        )
        return config
