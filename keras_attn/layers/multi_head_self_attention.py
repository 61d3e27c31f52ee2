"""`MultiHeadSelfAttention`: multi-head attention of a sequence to itself."""

from __future__ import annotations

import math

import keras

from keras_attn import _validation as v
from keras_attn.layers.multi_head_attention import MultiHeadAttention


@keras.saving.register_keras_serializable(package="keras_attn")
class MultiHeadSelfAttention(MultiHeadAttention):
    """Multi-head self-attention (Vaswani et al., 2017), optionally causal.

    `MultiHeadAttention` with query, key and value all the input sequence.
    `key_dim` defaults to `d_model // num_heads`, so the heads split the model
    dimension as in the paper; `num_heads` must then divide `d_model`.
    `causal=True` masks future positions (a decoder / language model layer).

    Args:
        num_heads: number of heads.
        key_dim: size of each head; defaults to `d_model // num_heads`.
        causal: apply a causal mask on every call (unless the call's
            `use_causal_mask` says otherwise).
        **kwargs: the other `MultiHeadAttention` arguments (`value_dim`,
            `dropout`, `use_bias`, `output_shape`, `attention_axes`,
            `sliding_window`, `flash_attention`, initializers, regularizers,
            constraints, `use_gate`, `seed`) and base layer arguments.

    Call arguments:
        inputs: `(batch, T, d_model)`.
        mask: boolean padding mask `(batch, T)`; filled from a Keras mask
            (Keras fills `inputs_mask` instead when other tensors are passed,
            e.g. `attention_mask`: both are honoured).
            Padded positions are ignored as keys and give zero output rows.
        attention_mask: boolean, combined with `mask` and the causal mask;
            every form `MultiHeadAttention` takes: `(T, T)`, `(batch, T, T)`,
            `(batch, heads, T, T)`, any axis of size 1 broadcasting (a key
            padding mask `(batch, 1, T)`); with a cache the key axis is
            `Tmax`.
        return_attention_scores: also return weights `(batch, heads, T, T)`.
        training: whether dropout is active.
        cache, cache_update_index: as in `MultiHeadAttention`; the padding
            `mask` then covers the new tokens only and is applied as a query
            mask, so pass the key padding through `attention_mask`.
        use_causal_mask: `None` (default) follows `causal`; a bool overrides
            it for this call.

    Returns:
        `outputs` `(batch, T, d_model)`; `(outputs, weights)` with
        `return_attention_scores`; `(outputs, cache)` with a cache;
        `(outputs, weights, cache)` with both.

    Example:

    ```python
    tokens = keras.Input((None,), dtype="int32")
    x = keras.layers.Embedding(1000, 64, mask_zero=True)(tokens)
    x = keras_attn.layers.MultiHeadSelfAttention(num_heads=4)(x)  # (batch, T, 64)
    model = keras.Model(tokens, x)
    ```
    """

    def __init__(
        self, num_heads: int, key_dim: int | None = None, causal: bool = False, **kwargs
    ):
        v.check_positive_int("num_heads", num_heads)
        self._key_dim_arg = v.check_positive_int("key_dim", key_dim, allow_none=True)
        self._value_dim_arg = v.check_positive_int(
            "value_dim", kwargs.get("value_dim"), allow_none=True
        )
        if not isinstance(causal, bool):
            raise ValueError(f"`causal` must be a bool. Received: causal={causal!r}")
        # key_dim is settled in build() when it derives from d_model; 1 is a
        # placeholder that passes the parent's validation.
        super().__init__(num_heads=num_heads, key_dim=key_dim or 1, **kwargs)
        self.causal = causal

    def build(self, inputs_shape):
        if inputs_shape is None or len(inputs_shape) < 3:
            raise ValueError(
                "`inputs` must have rank 3 or more (batch, positions..., "
                f"features). Received: inputs.shape={inputs_shape}"
            )
        model_dim = inputs_shape[-1]
        if self._key_dim_arg is None:
            if model_dim is None or model_dim % self.num_heads:
                raise ValueError(
                    "`num_heads` must divide the input's last dimension when "
                    f"`key_dim` is None. Received: num_heads={self.num_heads}, "
                    f"inputs.shape={tuple(inputs_shape)}"
                )
            # Keras's layer keeps the head sizes it projects to in private
            # attributes, set from `key_dim` at construction.
            self._key_dim = model_dim // self.num_heads
            self._value_dim = self._value_dim_arg or self._key_dim
            self._inverse_sqrt_key_dim = 1.0 / math.sqrt(self._key_dim)
        super().build(inputs_shape, inputs_shape)

    def call(
        self,
        inputs,
        mask=None,
        attention_mask=None,
        return_attention_scores: bool = False,
        training=None,
        cache=None,
        cache_update_index=None,
        inputs_mask=None,
        use_causal_mask: bool | None = None,
    ):
        # Keras fills `mask` when `inputs` is the only tensor argument and
        # `inputs_mask` when there are others (an attention mask, a cache).
        mask = inputs_mask if mask is None else mask
        key_mask = None if cache is not None else mask
        return super().call(
            inputs,
            inputs,
            query_mask=mask,
            value_mask=key_mask,
            attention_mask=attention_mask,
            return_attention_scores=return_attention_scores,
            training=training,
            use_causal_mask=self.causal if use_causal_mask is None else use_causal_mask,
            cache=cache,
            cache_update_index=cache_update_index,
        )

    def compute_output_shape(self, inputs_shape):
        return super().compute_output_shape(inputs_shape)

    def compute_output_spec(
        self,
        inputs,
        mask=None,
        attention_mask=None,
        return_attention_scores=False,
        training=None,
        cache=None,
        cache_update_index=None,
        inputs_mask=None,
        use_causal_mask=None,
    ):
        mask = inputs_mask if mask is None else mask
        return super().compute_output_spec(
            inputs,
            inputs,
            query_mask=mask,
            value_mask=None if cache is not None else mask,
            attention_mask=attention_mask,
            return_attention_scores=return_attention_scores,
            use_causal_mask=self.causal if use_causal_mask is None else use_causal_mask,
            cache=cache,
            cache_update_index=cache_update_index,
        )

    def compute_mask(self, inputs, mask=None):
        return mask

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "key_dim": self._key_dim_arg,
                "value_dim": self._value_dim_arg,
                "causal": self.causal,
            }
        )
        return config
