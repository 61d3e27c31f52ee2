"""`MultiHeadAttention`: scaled dot-product attention over several heads."""

from __future__ import annotations

import math

import keras
from keras import ops

from keras_attn import _validation as v
from keras_attn.ops.attention import dot_product_attention
from keras_attn.ops.cache import update_cache
from keras_attn.ops.masks import (
    attention_mask_from_padding,
    causal_mask,
    combine_masks,
    padding_mask,
)


class _ProjectionDense(keras.layers.EinsumDense):
    """`EinsumDense` whose head projections run as one 2-D matmul.

    On TensorFlow, Keras computes `abc,cde->abde` as a batched matmul that
    broadcasts the kernel over the batch, whose kernel gradient is a
    per-example product summed over the batch. Flattening the tokens first
    gives one `(B*T, d) x (d, N*H)` matmul forward and backward. Same
    weights, same config as `EinsumDense`.
    """

    def call(self, inputs, training=None):
        if (
            self.equation not in ("abc,cde->abde", "abcd,cde->abe")
            or getattr(self, "quantization_mode", None)
            or getattr(self, "lora_enabled", False)
        ):
            return super().call(inputs, training=training)
        kernel = ops.cast(self.kernel, self.compute_dtype)
        batch, length = ops.shape(inputs)[0], ops.shape(inputs)[1]
        if self.equation == "abc,cde->abde":
            model_dim, heads, head_dim = kernel.shape
            flat = ops.reshape(inputs, (-1, model_dim))  # (B*T, d)
            outputs = ops.matmul(
                flat, ops.reshape(kernel, (model_dim, heads * head_dim))
            )
            if self.bias is not None:
                outputs = outputs + ops.reshape(
                    ops.cast(self.bias, outputs.dtype), (heads * head_dim,)
                )
            return ops.reshape(
                outputs, (batch, length, heads, head_dim)
            )  # (B, T, N, H)
        heads, head_dim, output_dim = kernel.shape
        flat = ops.reshape(inputs, (-1, heads * head_dim))  # (B*T, N*H)
        outputs = ops.matmul(flat, ops.reshape(kernel, (heads * head_dim, output_dim)))
        if self.bias is not None:
            outputs = outputs + ops.cast(self.bias, outputs.dtype)
        return ops.reshape(outputs, (batch, length, output_dim))  # (B, T, d_out)


@keras.saving.register_keras_serializable(package="keras_attn")
class MultiHeadAttention(keras.layers.Layer):
    """Multi-head attention of Vaswani et al. (2017), with a KV cache.

    From "Attention Is All You Need" (https://arxiv.org/abs/1706.03762):
    `MultiHead(Q, K, V) = Concat(head_1..head_h) W_o` with
    `head_i = softmax(Q W_q_i (K W_k_i)ᵀ / sqrt(d_k)) V W_v_i`.

    Weights have the shapes of `keras.layers.MultiHeadAttention` (query, key,
    value kernels `(d, heads, key_dim)`, output kernel
    `(heads, value_dim, output_dim)`), so weights copy between the two.

    The softmax runs in float32 under every dtype policy. Without
    `return_attention_scores` (and without active dropout) the fused
    `keras.ops.dot_product_attention` path is used; with it, the explicit path
    materialises the weights; both give the same outputs. A query whose keys
    are all masked gets zero weights and a zero output row (no bias added).

    Args:
        num_heads: number of heads.
        key_dim: size of each head for query and key.
        value_dim: size of each head for value; defaults to `key_dim`.
        dropout: dropout rate on the attention weights, in [0, 1).
        use_bias: whether the projections have biases.
        output_dim: size of the output; defaults to the query's last dim.
        kernel_initializer, bias_initializer, kernel_regularizer,
        bias_regularizer: for the four projections.
        seed: seed of the dropout.
        **kwargs: base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        query: `(batch, Tq, dq)`.
        value: `(batch, Tv, dv)`; may be `None` when `cache` is given without
            `cache_update_index` (the cache already holds projected keys and
            values).
        key: `(batch, Tv, dk)`; defaults to `value`.
        query_mask: boolean `(batch, Tq)`; filled from a Keras mask.
        value_mask: boolean `(batch, Tv)`; filled from a Keras mask.
        key_mask: boolean `(batch, Tv)`; filled from a Keras mask.
        attention_mask: boolean `(batch, Tq, Tv)`, `True` for pairs that take
            part; combined with the padding masks.
        use_causal_mask: mask future keys (`j > i`; `j > i + cache_update_index`
            when decoding with a cache).
        return_attention_scores: also return the weights
            `(batch, heads, Tq, Tv)`.
        training: whether dropout is active.
        cache: optional tuple `(key_cache, value_cache)`, each
            `(batch, Tmax, heads, head_dim)`. With `cache_update_index`, the
            projected keys and values of this call are written into the cache
            at that index (`keras_attn.ops.update_cache`) and the query attends to the
            whole cache; the masks then cover the `Tmax` cache positions.
            Without it the cache is used as it is (cross-attention keys and
            values computed once per source with `compute_key_value`).
        cache_update_index: int or scalar tensor.

    Returns:
        One structure per set of arguments: `outputs` `(batch, Tq, output_dim)`;
        `(outputs, weights)` with `return_attention_scores`; `(outputs, cache)`
        when a cache is given; `(outputs, weights, cache)` with both.

    Example:

    ```python
    target = keras.Input((None, 64))
    source = keras.Input((None, 64))
    outputs = keras_attn.layers.MultiHeadAttention(num_heads=4, key_dim=16)(
        target, source
    )  # (batch, Tt, 64)
    model = keras.Model([target, source], outputs)
    ```
    """

    def __init__(
        self,
        num_heads: int,
        key_dim: int,
        value_dim: int | None = None,
        dropout: float = 0.0,
        use_bias: bool = True,
        output_dim: int | None = None,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        kernel_regularizer=None,
        bias_regularizer=None,
        seed: int | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.supports_masking = True
        self.num_heads = v.check_positive_int("num_heads", num_heads)
        self.key_dim = v.check_positive_int("key_dim", key_dim)
        self.value_dim = v.check_positive_int("value_dim", value_dim, allow_none=True)
        self.dropout = v.check_rate("dropout", dropout)
        self.use_bias = bool(use_bias)
        self.output_dim = v.check_positive_int(
            "output_dim", output_dim, allow_none=True
        )
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.bias_regularizer = keras.regularizers.get(bias_regularizer)
        self.seed = seed
        self.seed_generator = (
            keras.random.SeedGenerator(seed) if self.dropout > 0 else None
        )

    @property
    def head_value_dim(self) -> int:
        return self.value_dim or self.key_dim

    def _dense(self, name, equation, output_shape, bias_axes):
        dense = _ProjectionDense(
            equation,
            output_shape=output_shape,
            bias_axes=bias_axes if self.use_bias else None,
            kernel_initializer=self.kernel_initializer,
            bias_initializer=self.bias_initializer,
            kernel_regularizer=self.kernel_regularizer,
            bias_regularizer=self.bias_regularizer,
            dtype=self.dtype_policy,
            name=name,
        )
        # Masks are handled by this layer; let a Keras mask on the input pass
        # the projection instead of warning that it is dropped.
        dense.supports_masking = True
        return dense

    def build(self, query_shape, value_shape=None, key_shape=None):
        v.check_rank("query", query_shape, 3)
        if value_shape is None:
            raise ValueError(
                "`value` is needed to build the layer (it may be None only on "
                "later calls with a precomputed cache). Received: value=None"
            )
        v.check_rank("value", value_shape, 3)
        key_shape = value_shape if key_shape is None else key_shape
        v.check_rank("key", key_shape, 3)
        for name, shape in (
            ("query", query_shape),
            ("value", value_shape),
            ("key", key_shape),
        ):
            if shape[-1] is None:
                raise ValueError(
                    f"The last dimension of `{name}` must be known. "
                    f"Received: {name}.shape={tuple(shape)}"
                )
        heads, key_dim, value_dim = self.num_heads, self.key_dim, self.head_value_dim
        output_dim = self.output_dim or query_shape[-1]
        # (B, T, d) -> (B, T, N, H)
        self.query_dense = self._dense(
            "query", "abc,cde->abde", (None, heads, key_dim), "de"
        )
        self.query_dense.build(query_shape)
        self.key_dense = self._dense(
            "key", "abc,cde->abde", (None, heads, key_dim), "de"
        )
        self.key_dense.build(key_shape)
        self.value_dense = self._dense(
            "value", "abc,cde->abde", (None, heads, value_dim), "de"
        )
        self.value_dense.build(value_shape)
        # (B, T, N, Hv) -> (B, T, d_out)
        self.output_dense = self._dense(
            "attention_output", "abcd,cde->abe", (None, output_dim), "e"
        )
        self.output_dense.build((query_shape[0], query_shape[1], heads, value_dim))
        self.built = True

    def compute_key_value(self, value, key=None):
        """Projected `(key_heads, value_heads)`, each `(batch, Tv, heads, dim)`.

        Use it to compute cross-attention keys and values once per source and
        pass them as `cache` (without `cache_update_index`) at every step.
        """
        key = value if key is None else key
        return self.key_dense(key), self.value_dense(value)

    def _check_masks(
        self, query, key_length, query_mask, value_mask, key_mask, attention_mask
    ):
        batch, query_length = query.shape[0], query.shape[1]
        v.check_mask_shape("query_mask", query_mask, (batch, query_length))
        v.check_mask_shape("value_mask", value_mask, (batch, key_length))
        v.check_mask_shape("key_mask", key_mask, (batch, key_length))
        v.check_mask_shape(
            "attention_mask", attention_mask, (batch, query_length, key_length)
        )

    def _check_cache(self, cache):
        if not isinstance(cache, (tuple, list)) or len(cache) != 2:
            raise ValueError(
                "`cache` must be a tuple (key_cache, value_cache). "
                f"Received: cache={cache!r}"
            )
        for name, tensor, dim in (
            ("key_cache", cache[0], self.key_dim),
            ("value_cache", cache[1], self.head_value_dim),
        ):
            v.check_mask_shape(name, tensor, (None, None, self.num_heads, dim))

    def call(
        self,
        query,
        value,
        key=None,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        attention_mask=None,
        use_causal_mask: bool = False,
        return_attention_scores: bool = False,
        training=None,
        cache=None,
        cache_update_index=None,
    ):
        v.check_rank("query", query.shape, 3)
        if cache is None and cache_update_index is not None:
            raise ValueError(
                "`cache_update_index` needs a `cache`. Received: cache=None, "
                f"cache_update_index={cache_update_index!r}"
            )
        query_heads = self.query_dense(query)  # (B, Tq, N, H)
        if cache is None or cache_update_index is not None:
            new_keys, new_values = self.compute_key_value(value, key)
        if cache is None:
            key_heads, value_heads = new_keys, new_values
        else:
            self._check_cache(cache)
            key_cache, value_cache = cache  # (B, Tmax, N, H) each
            if cache_update_index is None:
                key_heads, value_heads = key_cache, value_cache
            else:
                key_heads = update_cache(key_cache, new_keys, cache_update_index)
                value_heads = update_cache(value_cache, new_values, cache_update_index)
            cache = (key_heads, value_heads)
        key_length = key_heads.shape[1]
        self._check_masks(
            query, key_length, query_mask, value_mask, key_mask, attention_mask
        )

        mask = combine_masks(
            attention_mask_from_padding(
                query_mask, combine_masks(value_mask, key_mask)
            ),  # (B, Tq|1, Tk|1)
            padding_mask(attention_mask),  # (B, Tq, Tk)
        )
        if use_causal_mask:
            offset = 0 if cache_update_index is None else cache_update_index
            causal = causal_mask(ops.shape(query)[1], ops.shape(key_heads)[1], offset)[
                None
            ]  # (1, Tq, Tk)
            mask = causal if mask is None else ops.logical_and(mask, causal)
        head_mask = None if mask is None else ops.expand_dims(mask, 1)  # (B, 1, Tq, Tk)

        attended = dot_product_attention(
            query_heads,
            ops.cast(key_heads, query_heads.dtype),
            ops.cast(value_heads, query_heads.dtype),
            mask=head_mask,
            scale=1.0 / math.sqrt(self.key_dim),
            return_weights=return_attention_scores,
            dropout_rate=self.dropout,
            training=training,
            seed_generator=self.seed_generator,
        )  # (B, Tq, N, Hv) [, (B, N, Tq, Tk)]
        if return_attention_scores:
            attended, weights = attended
        outputs = self.output_dense(attended)  # (B, Tq, d_out)
        if mask is not None:
            has_keys = ops.any(mask, axis=-1)[..., None]  # (B|1, Tq|1, 1)
            outputs = ops.where(has_keys, outputs, ops.zeros_like(outputs))
        result = (outputs,)
        if return_attention_scores:
            result += (weights,)
        if cache is not None:
            result += (cache,)
        return result[0] if len(result) == 1 else result

    def compute_output_shape(self, query_shape, value_shape=None, key_shape=None):
        return (*tuple(query_shape)[:-1], self.output_dim or query_shape[-1])

    def compute_output_spec(
        self,
        query,
        value,
        key=None,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        attention_mask=None,
        use_causal_mask=False,
        return_attention_scores=False,
        training=None,
        cache=None,
        cache_update_index=None,
    ):
        v.check_rank("query", query.shape, 3)
        if cache is not None:
            self._check_cache(cache)
            key_length = cache[0].shape[1]
        else:
            key_length = (value if key is None else key).shape[1]
        self._check_masks(
            query, key_length, query_mask, value_mask, key_mask, attention_mask
        )
        result = (
            keras.KerasTensor(
                self.compute_output_shape(query.shape), dtype=self.compute_dtype
            ),
        )
        if return_attention_scores:
            result += (
                keras.KerasTensor(
                    (query.shape[0], self.num_heads, query.shape[1], key_length),
                    dtype=self.compute_dtype,
                ),
            )
        if cache is not None:
            result += (tuple(keras.KerasTensor(t.shape, dtype=t.dtype) for t in cache),)
        return result[0] if len(result) == 1 else result

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_heads": self.num_heads,
                "key_dim": self.key_dim,
                "value_dim": self.value_dim,
                "dropout": self.dropout,
                "use_bias": self.use_bias,
                "output_dim": self.output_dim,
                "kernel_initializer": keras.initializers.serialize(
                    self.kernel_initializer
                ),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer),
                "kernel_regularizer": keras.regularizers.serialize(
                    self.kernel_regularizer
                ),
                "bias_regularizer": keras.regularizers.serialize(self.bias_regularizer),
                "seed": self.seed,
            }
        )
        return config
