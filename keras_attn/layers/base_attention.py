"""`BaseAttention`: single-head attention with a pluggable score.

`BahdanauAttention` and `LuongAttention` subclass it and define only how the
scores are computed; masking, the float32 softmax, dropout and the weighted sum
are written once here (as Keras's `AdditiveAttention` subclasses `Attention`).
"""

from __future__ import annotations

import keras
from keras import ops

from keras_attn import _validation as v
from keras_attn.ops.attention import weighted_sum
from keras_attn.ops.masks import attention_mask_from_padding, combine_masks
from keras_attn.ops.softmax import masked_softmax


@keras.saving.register_keras_serializable(package="keras_attn")
class BaseAttention(keras.layers.Layer):
    """Base class of single-head attention layers with a pluggable score.

    Subclasses implement `build_score(query_dim, key_dim)` to create their
    weights and `score(query, key)` returning `(batch, Tq, Tk)` scores; a
    score with a part that depends on the key alone also splits it out as
    `project_key(key)` and `score_from_projected_key(query, projected_key)`
    (the default projection is the key itself).

    Args:
        dropout: dropout rate on the attention weights, in [0, 1).
        seed: seed of the dropout.
        **kwargs: base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        query: one decoder state `(batch, dq)` or a sequence `(batch, Tq, dq)`.
        value: `(batch, Tv, dv)`.
        key: `(batch, Tv, dk)`; defaults to `value`.
        query_mask: boolean `(batch, Tq)` (or `(batch,)` for a single state):
            `False` rows get a zero context. Filled from a Keras mask.
        value_mask: boolean `(batch, Tv)`: `False` keys are ignored. Filled
            from a Keras mask (e.g. `Embedding(mask_zero=True)` upstream).
        key_mask: boolean `(batch, Tv)`, combined with `value_mask`.
        return_attention_scores: also return the attention weights (after the
            softmax).
        training: whether dropout is active.
        projected_key: `project_key(key)`, computed once per source. A
            step-by-step decoder passes it at every step; the layer then
            scores against it and skips the key's part of the score (the key
            itself only fixes the shapes and masks).

    Returns:
        The context `(batch, dv)` for a single state or `(batch, Tq, dv)` for a
        sequence; with `return_attention_scores=True`, the tuple
        `(context, weights)` with weights `(batch, Tv)` or `(batch, Tq, Tv)`.
        A query whose keys are all masked gets zero weights and a zero context.
    """

    def __init__(self, dropout: float = 0.0, seed: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.dropout = v.check_rate("dropout", dropout)
        self.seed = seed
        self.supports_masking = True
        self.seed_generator = (
            keras.random.SeedGenerator(seed) if self.dropout > 0 else None
        )

    # -- what subclasses define ------------------------------------------------

    def build_score(self, query_dim: int, key_dim: int) -> None:
        """Create the score's weights."""

    def score(self, query, key):
        """`(batch, Tq, dq), (batch, Tk, dk) -> (batch, Tq, Tk)` scores."""
        raise NotImplementedError

    def project_key(self, key):
        """The part of the score that depends on the key alone,
        `(batch, Tk, dk) -> (batch, Tk, projected_key_dim)`: the key itself
        here; subclasses with a key projection return it (`W_k k`).

        A step-by-step decoder (or a beam search's cache) computes it once per
        source and passes it to every step's call as `projected_key`. Every
        attention of this family has one, so a decoding recipe need not ask
        which kind it holds.
        """
        return ops.convert_to_tensor(key)

    @property
    def projected_key_dim(self) -> int:
        """The last dimension of `project_key(key)` (on a built layer)."""
        return self.key_dim

    def score_from_projected_key(self, query, projected_key):
        """Scores `(batch, Tq, Tk)` of a query and `project_key(key)`."""
        return self.score(query, projected_key)

    # -- Keras anatomy ---------------------------------------------------------

    def build(self, query_shape, value_shape, key_shape=None):
        key_shape = value_shape if key_shape is None else key_shape
        v.check_rank("query", query_shape, (2, 3))
        v.check_rank("value", value_shape, 3)
        v.check_rank("key", key_shape, 3)
        if not v.same_dim(key_shape[1], value_shape[1]):
            raise ValueError(
                "`key` and `value` must have the same number of time steps. "
                f"Received: key.shape={tuple(key_shape)}, "
                f"value.shape={tuple(value_shape)}"
            )
        query_dim, key_dim = query_shape[-1], key_shape[-1]
        if query_dim is None or key_dim is None:
            raise ValueError(
                "The last dimension of `query` and `key` must be known. "
                f"Received: query.shape={tuple(query_shape)}, "
                f"key.shape={tuple(key_shape)}"
            )
        self.query_dim, self.key_dim = int(query_dim), int(key_dim)
        self.build_score(self.query_dim, self.key_dim)
        self.built = True

    def _check_call_inputs(self, query, value, key, query_mask, value_mask, key_mask):
        v.check_rank("query", query.shape, (2, 3))
        v.check_rank("value", value.shape, 3)
        v.check_rank("key", key.shape, 3)
        batch, time = value.shape[0], value.shape[1]
        query_mask_shape = (
            (query.shape[0],) if len(query.shape) == 2 else tuple(query.shape[:2])
        )
        v.check_mask_shape("query_mask", query_mask, query_mask_shape)
        v.check_mask_shape("value_mask", value_mask, (batch, time))
        v.check_mask_shape("key_mask", key_mask, (batch, key.shape[1]))

    def call(
        self,
        query,
        value,
        key=None,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        return_attention_scores: bool = False,
        training=None,
        projected_key=None,
    ):
        score_fn = self.score
        if projected_key is not None:
            self._check_projected_key(projected_key, value if key is None else key)

            def score_fn(query, key):
                del key  # already projected
                return self.score_from_projected_key(query, projected_key)

        return self._attend(
            score_fn,
            query,
            value,
            key,
            query_mask,
            value_mask,
            key_mask,
            return_attention_scores,
            training,
        )

    def _check_projected_key(self, projected_key, key):
        shape = tuple(projected_key.shape)
        expected = (key.shape[0], key.shape[1], self.projected_key_dim)
        if len(shape) != 3 or any(
            not v.same_dim(got, want) for got, want in zip(shape, expected, strict=True)
        ):
            raise ValueError(
                "`projected_key` must be `project_key(key)`, of shape "
                f"(batch, Tk, projected_key_dim) = {expected}. "
                f"Received: projected_key.shape={shape}"
            )

    def _attend(
        self,
        score_fn,
        query,
        value,
        key,
        query_mask,
        value_mask,
        key_mask,
        return_attention_scores,
        training,
    ):
        """The attention of `call`, with the scores from `score_fn(query, key)`."""
        key = value if key is None else key
        self._check_call_inputs(query, value, key, query_mask, value_mask, key_mask)
        single_state = len(query.shape) == 2
        if single_state:
            query = ops.expand_dims(query, 1)  # (B, 1, dq)
            if query_mask is not None:
                query_mask = ops.expand_dims(query_mask, 1)  # (B, 1)
        scores = score_fn(query, key)  # (B, Tq, Tk)
        mask = attention_mask_from_padding(
            query_mask, combine_masks(value_mask, key_mask)
        )  # (B, Tq|1, Tk|1) or None
        weights = masked_softmax(scores, mask)  # float32 (B, Tq, Tk)
        weights = ops.cast(weights, self.compute_dtype)
        attended = weights
        if training and self.dropout > 0:
            attended = keras.random.dropout(
                weights, rate=self.dropout, seed=self.seed_generator
            )
        context = weighted_sum(attended, value)  # (B, Tq, dv)
        if single_state:
            context = ops.squeeze(context, 1)  # (B, dv)
            weights = ops.squeeze(weights, 1)  # (B, Tk)
        if return_attention_scores:
            return context, weights
        return context

    def compute_output_shape(self, query_shape, value_shape, key_shape=None):
        return (*tuple(query_shape)[:-1], value_shape[-1])

    def compute_output_spec(
        self,
        query,
        value,
        key=None,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        return_attention_scores: bool = False,
        training=None,
        projected_key=None,
    ):
        key = value if key is None else key
        self._check_call_inputs(query, value, key, query_mask, value_mask, key_mask)
        if projected_key is not None:
            self._check_projected_key(projected_key, key)
        context = keras.KerasTensor(
            self.compute_output_shape(query.shape, value.shape, key.shape),
            dtype=self.compute_dtype,
        )
        if not return_attention_scores:
            return context
        weights = keras.KerasTensor(
            (*tuple(query.shape)[:-1], value.shape[1]), dtype=self.compute_dtype
        )
        return context, weights

    def get_config(self):
        config = super().get_config()
        config.update({"dropout": self.dropout, "seed": self.seed})
        return config
