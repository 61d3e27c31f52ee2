"""`LuongAttention`: multiplicative attention (Luong et al., 2015)."""

from __future__ import annotations

import math

import keras
from keras import ops

from keras_attn import _validation as v
from keras_attn.layers.base_attention import BaseAttention
from keras_attn.ops.scores import (
    additive_score_from_projections,
    concat_score,
    dot_score,
    general_score,
)

SCORES = ("dot", "general", "concat")
SCALES = (None, "sqrt_dim", "learned")


@keras.saving.register_keras_serializable(package="keras_attn")
class LuongAttention(BaseAttention):
    """Luong et al.'s global attention with the dot, general or concat score.

    From "Effective Approaches to Attention-based Neural Machine Translation"
    (Luong, Pham and Manning, 2015, https://arxiv.org/abs/1508.04025). For a
    decoder state `q` (the paper's `h_t`) and encoder states `k` (`h̄_s`):

    - `score="dot"`: `qᵀ k` (needs `dq == dk`);
    - `score="general"`: `qᵀ W k`, `W` of shape `(dq, dk)`;
    - `score="concat"`: `vᵀ tanh(W [q; k])`, `W` of shape `(dq + dk, units)`.

    `scale="sqrt_dim"` divides the score by `sqrt(dk)` (Vaswani et al.'s
    scaling); `scale="learned"` multiplies it by a learned scalar initialised
    to 1 (as `keras.layers.Attention(use_scale=True)`).

    Args:
        score: `"dot"`, `"general"` or `"concat"`.
        units: size of the concat score's hidden layer (required for
            `"concat"`, not used by the others).
        scale: `None`, `"sqrt_dim"` or `"learned"`.
        dropout: dropout rate on the attention weights, in [0, 1).
        kernel_initializer: initializer of `W` (and `v`).
        kernel_regularizer: regularizer of `W` (and `v`).
        seed: seed of the dropout.
        **kwargs: base layer arguments (`name`, `dtype`, ...).

    Call arguments and returns: see `BaseAttention`. The query is one decoder
    state `(batch, dq)` or a sequence `(batch, Tq, dq)`; `projected_key` is
    `project_key(key)`, the key's part of the score.

    Example:

    ```python
    encoder_states = keras.Input((None, 64))  # (batch, Ts, 64)
    decoder_states = keras.Input((None, 64))  # (batch, Tt, 64)
    context = keras_attn.layers.LuongAttention(score="general")(
        decoder_states, encoder_states
    )  # (batch, Tt, 64)
    model = keras.Model([decoder_states, encoder_states], context)
    ```
    """

    def __init__(
        self,
        score: str = "dot",
        units: int | None = None,
        scale: str | None = None,
        dropout: float = 0.0,
        kernel_initializer="glorot_uniform",
        kernel_regularizer=None,
        seed: int | None = None,
        **kwargs,
    ):
        super().__init__(dropout=dropout, seed=seed, **kwargs)
        self.score_mode = v.check_choice("score", score, SCORES)
        self.scale = v.check_choice("scale", scale, SCALES)
        if score == "concat":
            if units is None:
                raise ValueError(
                    "`units` is required with score='concat'. Received: units=None"
                )
            self.units = v.check_positive_int("units", units)
        else:
            if units is not None:
                raise ValueError(
                    "`units` is only used by score='concat'. "
                    f"Received: units={units!r} with score={score!r}"
                )
            self.units = None
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)

    def build_score(self, query_dim: int, key_dim: int) -> None:
        if self.score_mode == "dot" and query_dim != key_dim:
            raise ValueError(
                "score='dot' needs query and key of the same last dimension; "
                "use score='general' to score different sizes. "
                f"Received: query_dim={query_dim}, key_dim={key_dim}"
            )
        if self.score_mode == "general":
            self.kernel = self.add_weight(
                name="kernel",
                shape=(query_dim, key_dim),
                initializer=self.kernel_initializer,
                regularizer=self.kernel_regularizer,
            )  # W
        elif self.score_mode == "concat":
            self.kernel = self.add_weight(
                name="kernel",
                shape=(query_dim + key_dim, self.units),
                initializer=self.kernel_initializer,
                regularizer=self.kernel_regularizer,
            )  # W
            self.score_vector = self.add_weight(
                name="score_vector",
                shape=(self.units,),
                initializer="glorot_uniform",
                regularizer=self.kernel_regularizer,
            )  # v
        if self.scale == "learned":
            self.scale_factor = self.add_weight(
                name="scale_factor", shape=(), initializer="ones"
            )

    def score(self, query, key):
        if self.score_mode == "dot":
            scores = dot_score(query, key)
        elif self.score_mode == "general":
            scores = general_score(query, key, self.kernel)
        else:
            scores = concat_score(query, key, self.kernel, self.score_vector)
        return self._scale_scores(scores)  # (B, Tq, Tk)

    def project_key(self, key):
        """The key's part of the score, `(batch, Tk, dk) -> (batch, Tk, p)`:
        the key itself for `"dot"` (`p = dk`), `k Wᵀ` for `"general"`
        (`p = dq`: `qᵀ W k = q · (W k)`), `W_k k` for `"concat"` (`p = units`,
        `W [q; k] = W_q q + W_k k`); on a built layer.

        In a step-by-step decoder loop compute it once per source and pass it
        to every step's call as `projected_key`.
        """
        key = ops.convert_to_tensor(key)
        if self.score_mode == "dot":
            return key
        # float16 products can pass 65504: project in float32 as the scores do.
        dtype = (
            "float32"
            if keras.backend.standardize_dtype(key.dtype) == "float16"
            else key.dtype
        )
        key = ops.cast(key, dtype)
        if self.score_mode == "general":
            return ops.matmul(
                key, ops.transpose(ops.cast(self.kernel, dtype))
            )  # (B, Tk, dq)
        key_kernel = self.kernel[self.query_dim :]  # W_k (dk, units)
        return ops.matmul(key, ops.cast(key_kernel, dtype))  # (B, Tk, units)

    @property
    def projected_key_dim(self) -> int:
        return {"dot": self.key_dim, "general": self.query_dim}.get(
            self.score_mode, self.units
        )

    def score_from_projected_key(self, query, projected_key):
        """Scores `(batch, Tq, Tk)` of a query and `project_key(key)`."""
        if self.score_mode in ("dot", "general"):
            scores = dot_score(query, projected_key)  # qᵀ k or q · (W k)
        else:
            query_kernel = self.kernel[: self.query_dim]  # W_q (dq, units)
            projected_query = ops.matmul(
                query, ops.cast(query_kernel, query.dtype)
            )  # (B, Tq, units)
            scores = additive_score_from_projections(
                projected_query,
                ops.cast(projected_key, projected_query.dtype),
                self.score_vector,
            )
        return self._scale_scores(scores)  # (B, Tq, Tk)

    def _scale_scores(self, scores):
        if self.scale == "sqrt_dim":
            scores = scores / ops.cast(math.sqrt(self.key_dim), scores.dtype)
        elif self.scale == "learned":
            scores = scores * ops.cast(self.scale_factor, scores.dtype)
        return scores

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "score": self.score_mode,
                "units": self.units,
                "scale": self.scale,
                "kernel_initializer": keras.initializers.serialize(
                    self.kernel_initializer
                ),
                "kernel_regularizer": keras.regularizers.serialize(
                    self.kernel_regularizer
                ),
            }
        )
        return config
