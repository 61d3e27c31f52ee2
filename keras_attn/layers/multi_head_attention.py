"""`MultiHeadAttention`: `keras.layers.MultiHeadAttention` with keras-attn's call.

Its parts are in modules named for them: `kv_cache`, `attention_masks`,
`attention_axes`, `projection` and `attention_checks` (docs/LAYERS.md).
"""

from __future__ import annotations

import keras
from keras import ops

from keras_attn import _validation as v
from keras_attn.layers import attention_axes as axes
from keras_attn.layers import attention_checks as checks
from keras_attn.layers import kv_cache
from keras_attn.layers._policies import with_quantized_policies
from keras_attn.layers.alibi_bias import alibi_slopes
from keras_attn.layers.attention_masks import (
    attention_arguments,
    zero_rows_without_keys,
)
from keras_attn.layers.projection import grouped_projection, project
from keras_attn.ops.attention import (
    check_flash_attention,
    dot_product_attention,
    repeat_key_value_heads,
)
from keras_attn.ops.masks import combine_masks


@keras.saving.register_keras_serializable(package="keras_attn")
class MultiHeadAttention(keras.layers.MultiHeadAttention):
    """Multi-head attention of Vaswani et al. (2017), a drop-in for Keras's.

    From "Attention Is All You Need" (https://arxiv.org/abs/1706.03762):
    `MultiHead(Q, K, V) = Concat(head_1..head_h) W_o` with
    `head_i = softmax(Q W_q_i (K W_k_i)ᵀ / sqrt(d_k)) V W_v_i`.

    A subclass of `keras.layers.MultiHeadAttention`: its constructor,
    sublayers, weights and config are Keras's (weights copy between the two;
    LoRA, `model.quantize` and dtype-policy maps work as on Keras's layer),
    and a subclass overriding `_compute_attention` gets Keras's arguments.
    The call is keras-attn's: a KV cache for decoding, a float32 softmax on
    every path, zero outputs for queries with no key, and the choice of
    attention path of `keras_attn.ops.attention_path`. docs/LAYERS.md
    ("Multi-head attention") gives each argument's full meaning: the paths,
    the mask forms, the cache and higher-rank inputs.

    Args:
        num_heads, key_dim, value_dim, dropout, use_bias, output_shape,
        attention_axes, sliding_window, kernel_initializer,
        bias_initializer, kernel_regularizer, bias_regularizer,
        activity_regularizer, kernel_constraint, bias_constraint, use_gate,
        seed: as in `keras.layers.MultiHeadAttention`.
        flash_attention: `None` (the fastest path that can honour the
            call), `True` (the fused kernel where one runs, else the
            memory-efficient path) or `False` (the explicit path).
        num_key_value_heads: grouped-query attention: the key/value heads,
            dividing `num_heads` (`None`: `num_heads`).
        output_dim: an alias of an integer `output_shape`.
        rotary_embedding: optional `keras_attn.layers.RotaryEmbedding`
            rotating the projected query and key heads (rank-3 inputs).
        alibi_bias: optional `keras_attn.layers.AlibiBias` (rank-3 inputs).
        **kwargs: base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        query, value, key, attention_mask, return_attention_scores, training,
        use_causal_mask: as in Keras (`value` may be `None` with a `cache`
            and no `cache_update_index`).
        query_mask, value_mask, key_mask: boolean `(batch, T)` padding masks,
            combined with the inputs' Keras masks.
        cache: optional KV cache, a tuple `(key_cache, value_cache)` of
            `(batch, Tmax, heads, head_dim)` or keras-hub's stacked
            `(batch, 2, Tmax, heads, head_dim)`.
        cache_update_index: where this call's keys and values are written
            in the cache (int or scalar tensor).

    Returns:
        `outputs` `(batch, Tq, *output_shape)`, followed by the weights with
        `return_attention_scores`, then the cache (in its form) with a
        `cache`.

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
        output_shape=None,
        attention_axes=None,
        sliding_window: int | None = None,
        flash_attention: bool | None = None,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        kernel_regularizer=None,
        bias_regularizer=None,
        activity_regularizer=None,
        kernel_constraint=None,
        bias_constraint=None,
        use_gate: bool = False,
        seed: int | None = None,
        *,
        num_key_value_heads: int | None = None,
        output_dim: int | None = None,
        rotary_embedding=None,
        alibi_bias=None,
        **kwargs,
    ):
        checks.check_head_sizes(num_heads, num_key_value_heads, key_dim, value_dim)
        dropout = v.check_rate("dropout", dropout)
        output_shape = checks.check_output_shape(output_shape, output_dim)
        checks.check_attention_axes(attention_axes)
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
            num_heads=int(num_heads),
            key_dim=int(key_dim),
            value_dim=None if value_dim is None else int(value_dim),
            dropout=dropout,
            use_bias=use_bias,
            output_shape=output_shape,
            attention_axes=attention_axes,
            sliding_window=sliding_window,
            flash_attention=flash_attention,
            **weight_options,
            use_gate=use_gate,
            seed=seed,
            **kwargs,
        )
        # keras-attn's own copies of what its call reads (Keras keeps them in
        # private attributes).
        self.flash_attention = flash_attention
        self.sliding_window = sliding_window
        self.use_gate = use_gate
        self._projection_shape = output_shape  # None or a tuple
        self.num_key_value_heads = (
            None if num_key_value_heads is None else int(num_key_value_heads)
        )
        # Positions inside the attention (no weights): a tracked sublayer each.
        self.rotary_embedding, self.alibi_bias = checks.position_layers(
            rotary_embedding, alibi_bias
        )
        # The dropout draws from Keras's `_dropout_layer` (its seed generator),
        # on every path: the layer owns Keras's one seed generator.

    # -- properties -------------------------------------------------------------

    @property
    def output_dim(self) -> int | None:
        """The output size when `output_shape` is one int (else `None`)."""
        shape = self._projection_shape
        return shape[0] if shape is not None and len(shape) == 1 else None

    @property
    def key_value_heads(self) -> int:
        """The heads of the keys, values and cache: `num_key_value_heads`, or
        `num_heads` when it is not set."""
        return self.num_key_value_heads or self.num_heads

    @property
    def gate_dense(self):
        """The gate's projection with `use_gate=True` (Keras names it `gate`)."""
        # Keras creates it in `build` under a private name only.
        return self._gate_dense if self.use_gate else None

    # -- build -----------------------------------------------------------------

    def build(self, query_shape, value_shape=None, key_shape=None):
        if value_shape is None:
            raise ValueError(
                "`value` is needed to build the layer (it may be None only on "
                "later calls with a precomputed cache). Received: value=None"
            )
        key_shape = value_shape if key_shape is None else key_shape
        query_shape, value_shape, key_shape = (
            tuple(query_shape),
            tuple(value_shape),
            tuple(key_shape),
        )
        checks.check_shapes(query_shape, value_shape, key_shape)
        if self.rotary_embedding is not None and self._key_dim % 2:
            raise ValueError(
                "`rotary_embedding` needs an even `key_dim` (the rotation pairs "
                "the first half of each head with the second). Received: "
                f"key_dim={self._key_dim}"
            )
        checks.check_attention_axes_of(self.attention_axes, query_shape)
        # Keras compares the non-last dimensions of key and value exactly;
        # they were checked above allowing unknown sizes.
        key_shape = (*value_shape[:-1], key_shape[-1])
        if self.key_value_heads == self.num_heads:
            super().build(query_shape, value_shape, key_shape)
        else:
            self._build_grouped(query_shape, value_shape, key_shape)
        for dense in self._projections():
            # Masks are handled by this layer; let a Keras mask on the input
            # pass the projection instead of warning that it is dropped.
            dense.supports_masking = True

    def _build_grouped(self, query_shape, value_shape, key_shape):
        """Keras's `build` (the same sublayers, names, equations and order)
        with key and value projections of `num_key_value_heads` heads."""

        def projection(shape, heads, dim, name, activation=None):
            return grouped_projection(
                shape,
                heads,
                dim,
                name,
                self._use_bias,
                self._get_common_kwargs_for_sublayer(),
                activation,
            )

        heads = self.num_key_value_heads
        self._query_dense, _ = projection(
            query_shape, self._num_heads, self._key_dim, "query"
        )
        self._key_dense, _ = projection(key_shape, heads, self._key_dim, "key")
        if self._use_gate:
            self._gate_dense, _ = projection(
                query_shape, self._num_heads, self._value_dim, "gate", "sigmoid"
            )
        self._value_dense, rank = projection(
            value_shape, heads, self._value_dim, "value"
        )
        self._build_attention(rank)
        self._output_dense = self._make_output_dense(
            query_shape, self._get_common_kwargs_for_sublayer(), "attention_output"
        )
        shape = list(self._query_dense.compute_output_shape(query_shape))
        shape[-1] = self._value_dim
        self._output_dense.build(tuple(shape))

    def _projections(self):
        dense = [self.query_dense, self.key_dense, self.value_dense, self.output_dense]
        return dense + ([self.gate_dense] if self.use_gate else [])

    # -- keys and values -----------------------------------------------------------

    def compute_key_value(self, value, key=None):
        """Projected `(key_heads, value_heads)`, each `(batch, Tv, heads, dim)`.

        Use it to compute cross-attention keys and values once per source and
        pass them as `cache` (without `cache_update_index`) at every step.
        With `rotary_embedding`, the keys are rotated at positions `0..Tv-1`.
        """
        return self._key_value(value, key, 0)

    def _rotate(self, heads, start_index):
        """`rotary_embedding` on `(B, T, heads, dim)` from position
        `start_index`, in the dtype of `heads` (a `RotaryEmbedding` made
        without the layer's dtype policy computes in its own)."""
        if kv_cache.is_per_row(start_index):  # (B,): each row's own position
            positions = kv_cache.row_positions(start_index, ops.shape(heads)[1])
            return ops.cast(
                self.rotary_embedding(heads, positions=positions), heads.dtype
            )
        return ops.cast(
            self.rotary_embedding(heads, start_index=start_index), heads.dtype
        )

    def _key_value(self, value, key, start_index):
        """The projected key and value heads, the keys rotated from position
        `start_index` with `rotary_embedding`."""
        key = value if key is None else key
        keys = project(self.key_dense, key)
        if self.rotary_embedding is not None:
            keys = self._rotate(keys, start_index)
        return keys, project(self.value_dense, value)

    def _check_cache(self, cache) -> bool:
        """Validate either cache form; `True` for keras-hub's stacked tensor."""
        return kv_cache.check_cache(
            cache, self.key_value_heads, self.key_dim, self.value_dim
        )

    def _check_call(self, query, value, key, *masks, cache, cache_update_index):
        """`attention_checks.check_call` with the layer's heads, axes and
        window, the cache validated first: `(stacked, key_length)`, whether
        the cache is keras-hub's stacked tensor and the key length checked."""
        stacked = cache is not None and self._check_cache(cache)
        if cache is not None:
            key_length = kv_cache.cache_length(cache)
        elif len(query.shape) == 3:
            key_length = (value if key is None else key).shape[1]
        else:
            key_length = tuple(value.shape)  # the scores' key axes
        checks.check_call(
            query,
            key_length,
            *masks,
            cache,
            cache_update_index,
            num_heads=self.num_heads,
            attention_axes=self.attention_axes,
            sliding_window=self.sliding_window,
        )
        return stacked, key_length

    # -- the forward pass ----------------------------------------------------------

    def _dropout_seed_generator(self):
        """The seed generator of Keras's `_dropout_layer` (the layer's one),
        `None` without dropout."""
        if not self._dropout:
            return None
        return self._dropout_layer.seed_generator

    def _compute_attention(
        self,
        query,
        key,
        value,
        attention_mask=None,
        training=None,
        return_attention_scores=False,
        use_causal_mask=False,
        *,
        key_padding_mask=None,
        query_padding_mask=None,
        causal_offset=0,
        sliding_window=None,
        query_is_scaled=False,
        alibi_slopes=None,
    ):
        """Attention over projected heads, Keras's override point.

        Keras's signature and meaning (`query` unscaled, `attention_mask` in
        Keras's broadcasting); returns `(attention_output,
        attention_scores)`. keras-attn's path dispatch
        (`keras_attn.ops.dot_product_attention`) runs inside. The
        keyword-only arguments are the masks as components (and ALiBi's
        slopes), which `call` passes when the method is not overridden
        (docs/LAYERS.md, "Overriding `_compute_attention`").
        """
        rank = len(query.shape)
        layout = axes.layout(self.attention_axes, rank)
        if rank > 4 and (use_causal_mask or sliding_window is not None):
            # Keras's causal mask of higher-rank inputs runs over axis 1.
            checks.check_band_axes(layout[2], self.attention_axes, query.shape)
            attention_mask = axes.with_band(
                attention_mask,
                layout,
                ops.shape(query)[1],
                ops.shape(key)[1],
                use_causal_mask,
                sliding_window,
                causal_offset,
            )
            use_causal_mask, sliding_window, causal_offset = False, None, 0
        mask = (
            None
            if attention_mask is None
            else axes.block_mask(attention_mask, query, key, layout, self.num_heads)
        )  # (B'|1, N|1, Tq', Tk')
        attended = dot_product_attention(
            axes.to_blocks(query, layout),
            ops.cast(axes.to_blocks(key, layout), query.dtype),
            ops.cast(axes.to_blocks(value, layout), query.dtype),
            mask=mask,
            scale=1.0 if query_is_scaled else self._inverse_sqrt_key_dim,
            return_weights=return_attention_scores,
            dropout_rate=self._dropout,
            training=training,
            seed_generator=self._dropout_seed_generator(),
            is_causal=bool(use_causal_mask),
            flash_attention=self.flash_attention,
            key_padding_mask=key_padding_mask,
            query_padding_mask=query_padding_mask,
            causal_offset=causal_offset,
            sliding_window=sliding_window,
            **({} if alibi_slopes is None else {"alibi_slopes": alibi_slopes}),
        )  # (B', Tq', N, Hv) [, (B', N, Tq', Tk')]
        weights = None
        if return_attention_scores:
            attended, weights = attended
        return axes.from_blocks(attended, weights, query, key, layout, self.num_heads)

    def _overrides_compute_attention(self) -> bool:
        """Whether a subclass replaced `_compute_attention` (then it gets
        Keras's arguments only, every mask combined into `attention_mask`)."""
        return (
            type(self)._compute_attention is not MultiHeadAttention._compute_attention
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
        return_attention_scores: bool = False,
        training=None,
        use_causal_mask: bool = False,
        cache=None,
        cache_update_index=None,
    ):
        # Keras fills `query_mask` from the query's Keras mask only when it is
        # not given; combine the two instead of dropping one. (There is no
        # public reader of a tensor's Keras mask: this is what Keras reads.)
        query_mask = combine_masks(
            query_mask, getattr(query, "_keras_mask", None)
        )  # (B, Tq)
        rank = len(query.shape)
        if rank < 3:
            raise ValueError(
                "`query` must have rank 3 or more (batch, positions..., "
                f"features). Received: query.shape={tuple(query.shape)}"
            )
        if value is not None:
            checks.check_call_inputs(
                query, value, key, (self.query_dense, self.value_dense, self.key_dense)
            )
        stacked, _ = self._check_call(
            query,
            value,
            key,
            query_mask,
            value_mask,
            key_mask,
            attention_mask,
            use_causal_mask,
            cache=cache,
            cache_update_index=cache_update_index,
        )
        checks.check_positions(
            self.rotary_embedding,
            self.alibi_bias,
            rank,
            cache,
            cache_update_index,
            self._overrides_compute_attention(),
            type(self).__name__,
        )
        gate = project(self.gate_dense, query) if self.use_gate else None
        # Keras's `_compute_attention` takes the unscaled query; keras-attn's
        # own folds the scale into the projection (`query_is_scaled`).
        scaled = not self._overrides_compute_attention()
        query_heads = project(
            self.query_dense,
            query,
            scale=self._inverse_sqrt_key_dim if scaled else None,
        )  # (B, Tq, N, H)
        offset = kv_cache.cache_offset(cache_update_index)
        if self.rotary_embedding is not None:
            query_heads = self._rotate(query_heads, offset)
        new_keys = new_values = None  # a cache used as it is
        if cache is None or cache_update_index is not None:
            new_keys, new_values = self._key_value(value, key, offset)  # (B,Tv,K,H)
        if cache is None:
            key_heads, value_heads = new_keys, new_values
        else:
            key_heads, value_heads, cache = kv_cache.updated_cache(
                cache, stacked, new_keys, new_values, cache_update_index
            )
        attention_mask, use_causal_mask, window, offset = kv_cache.per_row_band(
            attention_mask, use_causal_mask, self.sliding_window, offset,
            query_heads, key_heads,
        )  # fmt: skip
        if rank == 3:
            arguments, has_keys = attention_arguments(
                query_heads,
                key_heads,
                query_mask,
                value_mask,
                key_mask,
                attention_mask,
                use_causal_mask,
                offset,
                window,
                keras_form=self._overrides_compute_attention(),
            )
        else:
            arguments, has_keys = axes.higher_rank_masks(
                query_heads,
                key_heads,
                attention_mask,
                use_causal_mask,
                self.sliding_window,
                self.attention_axes,
            )
        if scaled:
            arguments["query_is_scaled"] = True
        if self.alibi_bias is not None:
            arguments["alibi_slopes"] = alibi_slopes(
                self.num_heads, self.alibi_bias.alibi_bias_max, "float32"
            )
        groups = self.num_heads // self.key_value_heads
        attended, weights = self._compute_attention(
            query_heads,
            # Keras's `_compute_attention` pairs heads one to one; keras-attn's
            # reads the key/value heads as they are.
            key_heads if scaled else repeat_key_value_heads(key_heads, groups),
            value_heads if scaled else repeat_key_value_heads(value_heads, groups),
            training=training,
            return_attention_scores=return_attention_scores,
            **arguments,
        )  # (B, <axes>, N, Hv)
        if gate is not None:
            attended = ops.multiply(attended, ops.cast(gate, attended.dtype))
        outputs = project(self.output_dense, attended)  # (B, <axes>, *output_shape)
        outputs = zero_rows_without_keys(outputs, has_keys)
        result = (outputs,)
        if return_attention_scores:
            result += (weights,)
        if cache is not None:
            result += (cache,)
        return result[0] if len(result) == 1 else result

    # -- Keras anatomy -------------------------------------------------------------

    def compute_output_shape(self, query_shape, value_shape=None, key_shape=None):
        query_shape = tuple(query_shape)
        if value_shape is not None:
            key_shape = value_shape if key_shape is None else key_shape
            checks.check_shapes(query_shape, tuple(value_shape), tuple(key_shape))
        return self._outputs_shape(query_shape)

    def _outputs_shape(self, query_shape) -> tuple:
        query_shape = tuple(query_shape)
        return query_shape[:-1] + (self._projection_shape or query_shape[-1:])

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
        if cache is None:
            key_shape = (value if key is None else key).shape
            checks.check_shapes(
                tuple(query.shape), tuple(value.shape), tuple(key_shape)
            )
        _, key_length = self._check_call(
            query,
            value,
            key,
            query_mask,
            value_mask,
            key_mask,
            attention_mask,
            use_causal_mask,
            cache=cache,
            cache_update_index=cache_update_index,
        )
        result = (
            keras.KerasTensor(
                self._outputs_shape(query.shape), dtype=self.compute_dtype
            ),
        )
        if return_attention_scores:
            key_source = value if key is None else key
            shape, _ = axes.scores_shape(
                self.attention_axes,
                self.num_heads,
                tuple(query.shape),
                key_length if len(query.shape) == 3 else tuple(key_source.shape),
            )
            result += (keras.KerasTensor(shape, dtype=self.compute_dtype),)
        if cache is not None:
            result += (kv_cache.cache_spec(cache),)
        return result[0] if len(result) == 1 else result

    def get_config(self):
        config = super().get_config()
        config["flash_attention"] = self.flash_attention
        if self.num_key_value_heads is not None:
            # Only when set: configs without it still load into Keras's class.
            config["num_key_value_heads"] = self.num_key_value_heads
        for name in ("rotary_embedding", "alibi_bias"):
            layer = getattr(self, name)
            if layer is not None:  # only when set, as num_key_value_heads
                config[name] = keras.saving.serialize_keras_object(layer)
        # Quantized projections keep their policies through save/load.
        return with_quantized_policies(self, config)
