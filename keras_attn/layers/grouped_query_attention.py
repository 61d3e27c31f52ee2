"""`GroupedQueryAttention`: `keras.layers.GroupQueryAttention` with
keras-attn's attention paths and a key/value cache."""

from __future__ import annotations

import keras
from keras import ops

from keras_attn import _validation as v
from keras_attn.layers import attention_checks as checks
from keras_attn.layers import kv_cache
from keras_attn.layers.attention_masks import mask_components, zero_rows_without_keys
from keras_attn.ops.attention import check_flash_attention, dot_product_attention
from keras_attn.ops.masks import combine_masks


@keras.saving.register_keras_serializable(package="keras_attn")
class GroupedQueryAttention(keras.layers.GroupQueryAttention):
    """Grouped-query attention (Ainslie et al. 2023), a drop-in for Keras's.

    From "GQA: Training Generalized Multi-Query Transformer Models from
    Multi-Head Checkpoints" (https://arxiv.org/abs/2305.13245): the
    `num_query_heads` query heads share `num_key_value_heads` key and value
    heads, `num_query_heads / num_key_value_heads` query heads per key/value
    head (query head `n` uses key/value head `n // groups`). One key/value
    head is multi-query attention (Shazeer 2019), as many as the query heads
    multi-head attention. The keys and values, and a decoding cache of them,
    take `num_key_value_heads / num_query_heads` of multi-head attention's
    memory.

    A subclass of `keras.layers.GroupQueryAttention` (Keras's class
    `GroupedQueryAttention`, exported under that name): the constructor,
    config, sublayers (`_query_dense`, `_key_dense`, `_value_dense`,
    `_output_dense`, `_gate_dense`; one seed generator, the dropout's),
    variables and call are Keras's, so configs and weight files move between
    the two classes both ways. What keras-attn adds:

    - the attention runs on keras-attn's paths
      (`keras_attn.ops.dot_product_attention`): the key/value heads are not
      repeated for the explicit and fused paths, and long sequences take the
      memory-efficient path, whose memory is linear in the lengths;
    - `cache` / `cache_update_index` for cached decoding, as
      `keras_attn.layers.MultiHeadAttention` takes them, with a cache of
      the `num_key_value_heads` heads only;
    - a query row with no key to attend to gets a zero output (Keras's
      spreads it uniformly over the masked keys);
    - bad arguments get errors that name them and the value received.

    A subclass that overrides `_compute_attention` gets Keras's arguments
    (the repeated heads, every mask combined into `attention_mask`), as
    with Keras's class.

    Args:
        head_dim: size of each attention head.
        num_query_heads: number of query heads.
        num_key_value_heads: number of key and value heads; divides
            `num_query_heads`.
        dropout: dropout rate on the attention weights.
        use_bias: whether the projections have biases.
        sliding_window: `None` or a positive int: query `i` sees key `j` only
            when `|i - j| < sliding_window` (with a cache, `i` counts from the
            cache's start), as in Keras.
        flash_attention: `None`, `True` or `False`: the path choice of
            `keras_attn.ops.attention_path`.
        kernel_initializer, bias_initializer, kernel_regularizer,
        bias_regularizer, activity_regularizer, kernel_constraint,
        bias_constraint: as in Keras's layer.
        use_gate: multiply the attended heads by a sigmoid gate of the query.
        seed: seed of the dropout.
        **kwargs: base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        query: `(batch, Tq, d)`.
        value: `(batch, Tv, d)`; `None` only with a `cache` and no
            `cache_update_index` (attending to the cache as it is).
        key: optional `(batch, Tv, d)`; `value` by default.
        query_mask, value_mask, key_mask: optional boolean `(batch, T)`
            (Keras masks of the inputs are read too).
        attention_mask: optional boolean `(batch, Tq, Tv)` (or `(Tq, Tv)`,
            `(batch, heads, Tq, Tv)`), `True` where a query attends to a key.
        return_attention_scores: also return the attention weights
            `(batch, num_query_heads, Tq, Tv)`.
        training: whether dropout is active.
        use_causal_mask: mask the keys after each query.
        cache: optional `(batch, 2, Tmax, num_key_value_heads, head_dim)`
            (keras-hub's stacked form) or a tuple `(key_cache, value_cache)`
            of `(batch, Tmax, num_key_value_heads, head_dim)`.
        cache_update_index: where the projected `key`/`value` of this call go
            in the cache (an int or a scalar tensor); the causal mask and the
            window count the queries from there.

    Returns:
        The outputs `(batch, Tq, d)`; then the weights with
        `return_attention_scores`; then the updated cache with a `cache`.

    Example:

    ```python
    layer = keras_attn.layers.GroupedQueryAttention(
        head_dim=16, num_query_heads=8, num_key_value_heads=2
    )
    x = keras.random.normal((2, 10, 64))
    outputs = layer(x, x, use_causal_mask=True)  # (2, 10, 64)
    ```
    """

    def __init__(
        self,
        head_dim,
        num_query_heads,
        num_key_value_heads,
        dropout=0.0,
        use_bias=True,
        sliding_window=None,
        flash_attention=None,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        kernel_regularizer=None,
        bias_regularizer=None,
        activity_regularizer=None,
        kernel_constraint=None,
        bias_constraint=None,
        use_gate=False,
        seed=None,
        **kwargs,
    ):
        v.check_size("head_dim", head_dim)
        v.check_size("num_query_heads", num_query_heads)
        v.check_size("num_key_value_heads", num_key_value_heads)
        if num_query_heads % num_key_value_heads:
            raise ValueError(
                "`num_query_heads` must be divisible by `num_key_value_heads`. "
                f"Received: num_query_heads={num_query_heads}, "
                f"num_key_value_heads={num_key_value_heads}"
            )
        dropout = v.check_rate("dropout", dropout)
        v.check_positive_int("sliding_window", sliding_window, allow_none=True)
        check_flash_attention(flash_attention, dropout)
        weight_options = dict(
            kernel_initializer=kernel_initializer,
            bias_initializer=bias_initializer,
            kernel_regularizer=kernel_regularizer,
            bias_regularizer=bias_regularizer,
            activity_regularizer=activity_regularizer,
            kernel_constraint=kernel_constraint,
            bias_constraint=bias_constraint,
        )
        checks.check_layer_options(use_gate, seed, weight_options)
        super().__init__(
            head_dim=int(head_dim),
            num_query_heads=int(num_query_heads),
            num_key_value_heads=int(num_key_value_heads),
            dropout=dropout,
            use_bias=use_bias,
            sliding_window=sliding_window,
            flash_attention=flash_attention,
            **weight_options,
            use_gate=use_gate,
            seed=seed,
            **kwargs,
        )
        # keras-attn's path choice reads the argument as given (Keras keeps
        # `flash_attention or is_flash_attention_enabled()`).
        self.flash_attention = flash_attention

    def build(self, query_shape, value_shape, key_shape=None):
        super().build(query_shape, value_shape, key_shape)
        for dense in (self._query_dense, self._key_dense, self._value_dense):
            # Masks are handled by this layer; let a Keras mask on the input
            # pass the projection instead of warning that it is dropped.
            dense.supports_masking = True
        if self.use_gate:
            self._gate_dense.supports_masking = True

    def _overrides_compute_attention(self) -> bool:
        return (
            type(self)._compute_attention
            is not GroupedQueryAttention._compute_attention
        )

    # -- the forward pass ----------------------------------------------------------

    def _check_cache(self, cache) -> bool:
        """Validate either cache form; `True` for keras-hub's stacked tensor."""
        return kv_cache.check_cache(
            cache, self.num_key_value_heads, self.head_dim, self.head_dim
        )

    def call(
        self,
        query,
        value,
        key=None,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        attention_mask=None,
        return_attention_scores=False,
        training=None,
        use_causal_mask=False,
        cache=None,
        cache_update_index=None,
    ):
        kv_cache.check_cache_update_index(cache, cache_update_index)
        kv_cache.check_per_row_index(cache_update_index, query.shape[0])
        if self._overrides_compute_attention():
            if cache is not None:
                raise ValueError(
                    "`cache` needs keras-attn's `_compute_attention`; a subclass "
                    f"that overrides it gets Keras's call. Received: {type(self)}"
                )
            return super().call(
                query,
                value,
                key=key,
                query_mask=query_mask,
                value_mask=value_mask,
                key_mask=key_mask,
                attention_mask=attention_mask,
                return_attention_scores=return_attention_scores,
                training=training,
                use_causal_mask=use_causal_mask,
            )
        if len(query.shape) != 3:
            raise ValueError(
                "`query` must have rank 3 (batch, positions, features). "
                f"Received: query.shape={tuple(query.shape)}"
            )
        self._return_attention_scores = return_attention_scores
        query_mask = combine_masks(query_mask, getattr(query, "_keras_mask", None))
        if value is not None:
            checks.check_call_inputs(
                query,
                value,
                key,
                (self._query_dense, self._value_dense, self._key_dense),
            )
        stacked = cache is not None and self._check_cache(cache)
        if cache is not None:
            key_length = kv_cache.cache_length(cache)
        else:
            key_length = (value if key is None else key).shape[1]
        checks.check_padding_masks(
            query_mask, value_mask, key_mask, query.shape[0], query.shape[1], key_length
        )
        # Keras's rule for a rank-3 call, worded without MultiHeadAttention's
        # hint on rank-2 masks.
        checks.check_attention_mask(
            attention_mask,
            query.shape,
            key_length,
            self.num_query_heads,
            None,
            hint=False,
        )
        gate = self._gate_dense(query) if self.use_gate else None
        query_heads = self._query_dense(query)  # (B, Tq, N, H)
        new_keys = new_values = None  # a cache used as it is
        if cache is None or cache_update_index is not None:
            key = value if key is None else key
            new_keys = self._key_dense(key)  # (B, Tv, K, H)
            new_values = self._value_dense(value)
        if cache is None:
            key_heads, value_heads = new_keys, new_values
        else:
            key_heads, value_heads, cache = kv_cache.updated_cache(
                cache, stacked, new_keys, new_values, cache_update_index
            )
        offset = kv_cache.cache_offset(cache_update_index)
        attention_mask, use_causal_mask, window, offset = kv_cache.per_row_band(
            attention_mask, use_causal_mask, self.sliding_window, offset,
            query_heads, key_heads,
        )  # fmt: skip
        explicit, key_padding, query_padding, has_keys = mask_components(
            query_heads,
            key_heads,
            query_mask,
            value_mask,
            key_mask,
            attention_mask,
            use_causal_mask,
            offset,
            window,
        )
        attended = dot_product_attention(
            query_heads,
            ops.cast(key_heads, query_heads.dtype),
            ops.cast(value_heads, query_heads.dtype),
            mask=explicit,
            scale=self._inverse_sqrt_head_dim,
            return_weights=return_attention_scores,
            dropout_rate=self.dropout,
            training=training,
            seed_generator=self._dropout_layer.seed_generator if self.dropout else None,
            is_causal=bool(use_causal_mask),
            flash_attention=self.flash_attention,
            key_padding_mask=key_padding,
            query_padding_mask=query_padding,
            causal_offset=offset,
            sliding_window=window,
        )  # (B, Tq, N, H) [, (B, N, Tq, Tk)]
        weights = None
        if return_attention_scores:
            attended, weights = attended
        if gate is not None:
            attended = ops.multiply(attended, ops.cast(gate, attended.dtype))
        outputs = self._output_dense(attended)  # (B, Tq, d)
        outputs = zero_rows_without_keys(outputs, has_keys)
        result = (outputs,)
        if return_attention_scores:
            result += (weights,)
        if cache is not None:
            result += (cache,)
        return result[0] if len(result) == 1 else result

    def compute_output_spec(
        self,
        query,
        value,
        key=None,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        attention_mask=None,
        return_attention_scores=False,
        training=None,
        use_causal_mask=False,
        cache=None,
        cache_update_index=None,
    ):
        if value is None:
            value = key = query  # attending to a cache: the output is the query's
        spec = super().compute_output_spec(
            query,
            value,
            key,
            return_attention_scores=return_attention_scores,
        )
        if cache is None:
            return spec
        spec = spec if isinstance(spec, tuple) else (spec,)
        return (*spec, kv_cache.cache_spec(cache))
