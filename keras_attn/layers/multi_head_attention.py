"""`MultiHeadAttention`: `keras.layers.MultiHeadAttention` with keras-attn's call."""

from __future__ import annotations

import keras
from keras import ops

# Keras's equation builders, for the projections of grouped-query attention
# (`_build_grouped`), built as Keras's `build` builds its own.
from keras.src.layers.attention.multi_head_attention import (
    _build_proj_equation,
    _get_output_shape,
)

from keras_attn import _validation as v
from keras_attn.layers._policies import with_quantized_policies
from keras_attn.layers.alibi_bias import AlibiBias, alibi_slopes
from keras_attn.layers.rotary_embedding import RotaryEmbedding
from keras_attn.ops.attention import (
    check_flash_attention,
    dot_product_attention,
    repeat_key_value_heads,
)
from keras_attn.ops.cache import update_cache
from keras_attn.ops.masks import (
    band_mask,
    combine_masks,
    padding_mask,
    rows_with_keys,
    split_attention_mask,
)

# The einsum equations of Keras's rank-3 projections: (B, T, d) -> (B, T, N, H)
# and (B, T, N, H) -> (B, T, d_out).
_HEAD_PROJECTION = "abc,cde->abde"
_OUTPUT_PROJECTION = "abcd,cde->abe"


def _project(dense, inputs, scale=None):
    """`dense(inputs)`, times `scale` if given; on TensorFlow a plain rank-3
    projection is one matmul.

    TensorFlow computes Keras's `abc,cde->abde` as a batched matmul that
    broadcasts the kernel over the batch, whose kernel gradient is a
    per-example product summed over the batch. Flattening the tokens gives one
    `(B*T, d) x (d, N*H)` matmul forward and backward, with the same weights.
    There `scale` multiplies the float kernel and bias, not the `(B, T, N, H)`
    outputs, and the bias is added in the head layout (TensorFlow's bfloat16
    add over the flat `(B*T, N*H)` rows is the slower kernel on CPU).
    Whatever is not a plain float projection (quantized, LoRA, an activity
    regularizer, another equation, another backend) goes through the
    sublayer's own `__call__`.
    """
    if (
        keras.backend.backend() != "tensorflow"
        or dense.equation not in (_HEAD_PROJECTION, _OUTPUT_PROJECTION)
        or dense.quantization_mode is not None
        or dense.lora_enabled
        or dense.activity_regularizer is not None
        or (scale is not None and dense.activation is not keras.activations.linear)
    ):
        outputs = dense(inputs)
        if scale is None:
            return outputs
        return ops.multiply(outputs, ops.cast(scale, outputs.dtype))
    dtype = dense.compute_dtype
    inputs = ops.cast(inputs, dtype)
    kernel, bias = dense.kernel, dense.bias
    if scale is not None:  # (x W + b) s = x (W s) + b s, scaled in float32
        kernel = ops.multiply(kernel, ops.cast(scale, kernel.dtype))
        bias = None if bias is None else ops.multiply(bias, ops.cast(scale, bias.dtype))
    kernel = ops.cast(kernel, dtype)
    batch, length = ops.shape(inputs)[0], ops.shape(inputs)[1]
    if dense.equation == _HEAD_PROJECTION:
        model_dim, heads, head_dim = kernel.shape
        outputs = ops.matmul(
            ops.reshape(inputs, (-1, model_dim)),  # (B*T, d)
            ops.reshape(kernel, (model_dim, heads * head_dim)),
        )  # (B*T, N*H)
        outputs = ops.reshape(outputs, (batch, length, heads, head_dim))  # (B,T,N,H)
        if bias is not None:
            outputs = outputs + ops.cast(bias, dtype)  # (N, H)
    else:
        heads, head_dim, output_dim = kernel.shape
        outputs = ops.matmul(
            ops.reshape(inputs, (-1, heads * head_dim)),  # (B*T, N*H)
            ops.reshape(kernel, (heads * head_dim, output_dim)),
        )  # (B*T, d_out)
        outputs = ops.reshape(outputs, (batch, length, output_dim))  # (B, T, d_out)
        if bias is not None:
            outputs = outputs + ops.cast(bias, dtype)
    return dense.activation(outputs)


def check_call_inputs(query, value, key, projections):
    """The inputs of an eager call against each other and the projections
    `(query, value, key)` they were built for (`build` checks them on the
    first call only; a later call would fail inside a matmul): key and value
    alike but for their last axis, one batch size, and each input's last axis
    the projection's (skipped for quantized or LoRA projections)."""
    key = value if key is None else key
    MultiHeadAttention._check_shapes(
        tuple(query.shape), tuple(value.shape), tuple(key.shape)
    )
    batches = {x.shape[0] for x in (query, value, key)} - {None}
    if len(batches) > 1:
        raise ValueError(
            "`query`, `value` and `key` must have the same batch size. "
            f"Received: query.shape={tuple(query.shape)}, "
            f"value.shape={tuple(value.shape)}, key.shape={tuple(key.shape)}"
        )
    for name, tensor, dense in zip(
        ("query", "value", "key"), (query, value, key), projections, strict=True
    ):
        if (
            dense is None
            or not dense.built
            or dense.quantization_mode is not None
            or dense.lora_enabled
        ):
            continue
        width = dense.kernel.shape[0]
        if tensor.shape[-1] is not None and tensor.shape[-1] != width:
            raise ValueError(
                f"The last dimension of `{name}` must be {width}, the size the "
                f"layer was built with. Received: {name}.shape={tuple(tensor.shape)}"
            )


def _product(dims):
    result = 1
    for dim in dims:
        result = result * dim
    return result


def check_cache(cache, heads: int, key_dim: int, value_dim: int) -> bool:
    """Validate a KV cache of `heads` key/value heads, either form: a tuple
    `(key_cache, value_cache)` of `(B, Tmax, heads, key_dim | value_dim)`, or
    keras-hub's stacked `(B, 2, Tmax, heads, head_dim)` (`key_dim ==
    value_dim`). Returns `True` for the stacked form."""
    if isinstance(cache, (tuple, list)):
        if len(cache) != 2:
            raise ValueError(
                "`cache` must be a tuple (key_cache, value_cache) or a "
                "stacked (batch, 2, Tmax, heads, head_dim) tensor. "
                f"Received: cache={cache!r}"
            )
        for name, tensor, dim in (
            ("key_cache", cache[0], key_dim),
            ("value_cache", cache[1], value_dim),
        ):
            v.check_mask_shape(name, tensor, (None, None, heads, dim))
        return False
    if not hasattr(cache, "shape") or len(cache.shape) != 5:
        raise ValueError(
            "`cache` must be a tuple (key_cache, value_cache) or a stacked "
            "(batch, 2, Tmax, heads, head_dim) tensor. Received: "
            f"cache={cache!r}"
        )
    if key_dim != value_dim:
        raise ValueError(
            "A stacked cache needs `value_dim == key_dim`; pass a tuple "
            f"(key_cache, value_cache). Received: key_dim={key_dim}, "
            f"value_dim={value_dim}"
        )
    v.check_mask_shape("cache", cache, (None, 2, None, heads, key_dim))
    return True


def updated_cache(cache, stacked: bool, new_keys, new_values, cache_update_index):
    """`(key_heads, value_heads, cache)`: the heads attended to and the cache
    returned, in its form. With `cache_update_index`, `new_keys` /
    `new_values` `(B, T, heads, dim)` are written into the cache there
    (`update_cache`); without it the cache is used as it is."""
    if stacked:  # (B, 2, Tmax, heads, dim)
        key_cache, value_cache = cache[:, 0, ...], cache[:, 1, ...]
    else:
        key_cache, value_cache = cache
    if cache_update_index is None:
        key_heads, value_heads = key_cache, value_cache  # (B, Tmax, heads, dim)
    else:
        key_heads = update_cache(key_cache, new_keys, cache_update_index)
        value_heads = update_cache(value_cache, new_values, cache_update_index)
    cache = (
        ops.stack((key_heads, value_heads), axis=1)  # (B, 2, Tmax, heads, dim)
        if stacked
        else (key_heads, value_heads)
    )
    return key_heads, value_heads, cache


def mask_components(
    query_heads,
    key_heads,
    query_mask,
    value_mask,
    key_mask,
    attention_mask,
    use_causal_mask,
    offset,
    sliding_window,
):
    """The masks of a rank-3 call as attention's components:
    `(explicit, key_padding, query_padding, has_keys)`.

    `attention_mask` is split as `split_attention_mask` does: a key padding
    mask in disguise (`(B, 1, Tk)`, `(B, 1, 1, Tk)`) joins the key padding
    `(B, Tk)` with `value_mask` and `key_mask`, a query one the query padding
    `(B, Tq)` with `query_mask`, and what remains stays an explicit mask
    `(B|1, N|1, Tq, Tk)` without its broadcast batch or heads axes, so the
    memory-efficient path builds no `(B, Tq, Tk)` tensor for them.
    `has_keys` is `(B|1, Tq)`, the query rows with a key to attend to under
    every mask (or `None`)."""
    batch = ops.shape(query_heads)[0]
    query_length, key_length = ops.shape(query_heads)[1], ops.shape(key_heads)[1]
    mask_keys, mask_queries, explicit = split_attention_mask(attention_mask)
    if explicit is not None:
        explicit_shape = ops.shape(explicit)
        explicit = ops.broadcast_to(
            explicit,
            (explicit_shape[0], explicit_shape[1], query_length, key_length),
        )  # (B|1, N|1, Tq, Tk): the batch and heads stay as given
    key_padding = combine_masks(
        value_mask,
        key_mask,
        None if mask_keys is None else ops.broadcast_to(mask_keys, (batch, key_length)),
    )  # (B, Tk)
    query_padding = combine_masks(
        query_mask,
        None
        if mask_queries is None
        else ops.broadcast_to(mask_queries, (batch, query_length)),
    )  # (B, Tq)
    has_keys = rows_with_keys(
        query_length,
        key_length,
        attention_mask=None if explicit is None else ops.any(explicit, axis=1),
        key_padding_mask=key_padding,
        query_padding_mask=query_padding,
        causal=bool(use_causal_mask),
        offset=offset,
        sliding_window=sliding_window,
    )  # (B|1, Tq) or None
    return explicit, key_padding, query_padding, has_keys


def _position_layer(name, value, cls):
    """`None`, a `cls` layer, or one made from its config (what `get_config`
    writes)."""
    if isinstance(value, dict):
        value = keras.saving.deserialize_keras_object(value)
    if value is None or isinstance(value, cls):
        return value
    raise ValueError(
        f"`{name}` must be None, a `keras_attn.layers.{cls.__name__}` or its "
        f"serialized config. Received: {name}={value!r}"
    )


def check_layer_options(use_gate, seed, weight_options: dict) -> None:
    """The checks of Keras's attention arguments that `MultiHeadAttention`
    and `GroupedQueryAttention` share: `use_gate` a bool, `seed` an int or
    None, and the weights' initializers, regularizers and constraints ones
    Keras takes, each refused with its name."""
    v.check_weight_options(**weight_options)
    if not isinstance(use_gate, bool):
        raise ValueError(f"`use_gate` must be a bool. Received: use_gate={use_gate!r}")
    if seed is not None and not v.is_int(seed):
        raise ValueError(f"`seed` must be an int or None. Received: seed={seed!r}")


@keras.saving.register_keras_serializable(package="keras_attn")
class MultiHeadAttention(keras.layers.MultiHeadAttention):
    """Multi-head attention of Vaswani et al. (2017), a drop-in for Keras's.

    From "Attention Is All You Need" (https://arxiv.org/abs/1706.03762):
    `MultiHead(Q, K, V) = Concat(head_1..head_h) W_o` with
    `head_i = softmax(Q W_q_i (K W_k_i)ᵀ / sqrt(d_k)) V W_v_i`.

    A subclass of `keras.layers.MultiHeadAttention`: the constructor, the
    sublayers (`query_dense`, `key_dense`, `value_dense`, `output_dense`, and
    the gate with `use_gate`), their names, weight order and config are
    Keras's, so weights copy between the two, `isinstance` checks, LoRA
    (`layer.query_dense.enable_lora(rank)`, keras-hub's `enable_lora`),
    `model.quantize(...)` and dtype-policy maps work as on Keras's layer.
    The call is keras-attn's. What it adds:

    - a KV cache (`cache`, `cache_update_index`) for decoding, as a
      `(key_cache, value_cache)` tuple or keras-hub's stacked tensor;
    - `flash_attention` with a definite meaning (see below), the choice of
      path being made by `keras_attn.ops.attention_path`;
    - numerics: the softmax runs in float32 under every dtype policy and on
      every path (Keras's runs in the compute dtype when it returns the
      scores or applies dropout), and a query whose keys are all masked gets
      zero weights and a zero output row (Keras averages the values for it);
    - an explicit `query_mask` is combined with the query's Keras mask (Keras
      replaces the argument by the Keras mask).

    Keras's override point is kept: `call` projects the heads and calls
    `self._compute_attention(query, key, value, attention_mask, training,
    return_attention_scores)` with Keras's meaning, keras-attn's path
    dispatch inside it; a subclass that overrides it (keras-hub's models do)
    gets every mask combined into `attention_mask`, as Keras gives it. The
    variables, their order and paths, and the one seed generator of the
    dropout (Keras's `_dropout_layer`, which every path draws from) are
    Keras's.

    Args:
        num_heads: number of heads.
        key_dim: size of each head for query and key.
        value_dim: size of each head for value; defaults to `key_dim`.
        dropout: dropout rate on the attention weights, in [0, 1).
        use_bias: whether the projections have biases.
        output_shape: the output's shape besides the batch and query axes
            (an int or a tuple); defaults to the query's last dimension.
        attention_axes: the axes attention runs over (an int or a tuple);
            defaults to every axis but the batch, the heads and the features.
        sliding_window: optional positive int: each query attends only to the
            keys within `sliding_window - 1` positions on either side (Keras's
            symmetric band; with `use_causal_mask`, the causal window).
        flash_attention: the attention path (chosen by
            `keras_attn.ops.attention_path`). `None` (default): the fastest
            path that can honour the call: the fused
            `keras.ops.dot_product_attention` where a fused kernel actually
            runs it (cuDNN on a GPU in half precision on JAX, PyTorch's CUDA
            kernels; not TensorFlow, nor JAX on a CPU) and no dropout is
            active; else the memory-efficient path
            (`keras_attn.ops.memory_efficient_attention`, no `(Tq, Tk)`
            tensor in either pass) from a key length of
            `keras_attn.ops.switch_over_length(compute dtype)` with more than
            one query; else the explicit path. `True`: the fused kernel where
            one runs, else the memory-efficient path at every length;
            `return_attention_scores=True` then raises a `ValueError`, and
            `dropout > 0` is refused here (as Keras refuses it). `False`: the
            explicit path, which materialises the weights. The paths give
            the same outputs and gradients, with every mask, the cache
            offset, `sliding_window`, `use_gate` and `attention_axes`; only
            `return_attention_scores=True` pins the explicit path. `None`
            follows `keras.config.enable_flash_attention()` /
            `disable_flash_attention()` when they were called.
        kernel_initializer, bias_initializer, kernel_regularizer,
        bias_regularizer, activity_regularizer, kernel_constraint,
        bias_constraint: of the projections.
        use_gate: a sigmoid gate on the attention output, computed from the
            query (Qiu et al. 2025, https://arxiv.org/abs/2505.06708), as in
            Keras.
        seed: seed of the dropout.
        num_key_value_heads: grouped-query attention (Ainslie et al. 2023):
            the number of key and value heads, dividing `num_heads` (1:
            multi-query attention); `None` (default): `num_heads`. Query head
            `n` attends with key/value head `n // (num_heads /
            num_key_value_heads)`, as in `keras.layers.GroupQueryAttention`;
            the key and value projections and the cache hold only those
            heads. Written to `get_config` only when set, so configs without
            it still load into Keras's class.
        output_dim: an alias of an integer `output_shape`; not written to
            `get_config`.
        rotary_embedding: optional `keras_attn.layers.RotaryEmbedding`
            (rotary positions, Su et al. 2021): it rotates the projected
            query and key heads, each at its position, before their product
            (as keras-hub's Llama and Gemma attention layers do). Query `i`
            and key `j` are at `i` and `j`, shifted by `cache_update_index`
            when decoding with a cache (the keys are rotated before they are
            written to it). For self-attention over rank-3 inputs.
        alibi_bias: optional `keras_attn.layers.AlibiBias` (ALiBi, Press et
            al. 2022): head `n` adds `slope_n * (j - i)` to the logit of
            query `i` and key `j` (positions shifted by `cache_update_index`
            when decoding), the slopes of `keras_attn.layers.alibi_slopes`
            for `num_heads` heads and the layer's `alibi_bias_max`. The
            memory-efficient path computes it block by block (no `(Tq, Tk)`
            tensor); the fused path is not taken with it. For rank-3 inputs.
            Both are written to `get_config` only when set.
        **kwargs: base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        query: `(batch, Tq, dq)`, or of higher rank with `attention_axes`.
        value: `(batch, Tv, dv)`; may be `None` when `cache` is given without
            `cache_update_index` (the cache already holds projected keys and
            values).
        key: `(batch, Tv, dk)`; defaults to `value`.
        query_mask: boolean `(batch, Tq)`, combined with the Keras mask of
            `query`.
        value_mask: boolean `(batch, Tv)`; filled from a Keras mask.
        key_mask: boolean `(batch, Tv)`; filled from a Keras mask.
        attention_mask: boolean, `True` for the query-key pairs that take
            part; combined with the padding masks, the causal mask and the
            window. Every form Keras takes, broadcast as Keras broadcasts it:
            `(Tq, Tv)` (rank 2: shared by the batch), `(batch, Tq, Tv)`
            (rank 3, shared by the heads) or `(batch, heads, Tq, Tv)`
            (rank 4), any axis of size 1 broadcasting, so a key padding mask
            `(batch, 1, Tv)` or `(batch, 1, 1, Tv)` works. A rank-2 mask is
            `(Tq, Tv)`, as in Keras: a `(batch, Tv)` padding mask goes in
            `value_mask` (a mask that does not broadcast is refused). Key
            and query padding masks in these forms reach the
            memory-efficient path as padding, and a shared mask without its
            batch axis. With higher-rank inputs: broadcastable to Keras's
            scores `(batch, <other axes>, heads, <query attention axes>,
            <key attention axes>)`, missing axes inserted before the query
            axes.
        return_attention_scores: also return the weights.
        training: whether dropout is active.
        use_causal_mask: mask future keys (`j > i`; `j > i + cache_update_index`
            when decoding with a cache). With higher-rank inputs it needs
            `attention_axes=(1,)` (Keras builds the mask over axis 1), as
            `sliding_window` does.
        cache: optional KV cache, `(batch, Tmax, heads, head_dim)` keys and
            values (`heads`: `num_key_value_heads` when set), either as a
            tuple `(key_cache, value_cache)` or stacked as keras-hub's
            `CachedMultiHeadAttention` takes it,
            `(batch, 2, Tmax, heads, head_dim)`. With `cache_update_index`,
            the projected keys and values of this call are written into the
            cache at that index (`keras_attn.ops.update_cache`) and the query
            attends to the whole cache; the masks then cover the `Tmax` cache
            positions. Without it the cache is used as it is (cross-attention
            keys and values computed once per source with
            `compute_key_value`).
        cache_update_index: int or scalar tensor.

    Returns:
        One structure per set of arguments: `outputs` `(batch, Tq, *output_shape)`;
        `(outputs, weights)` with `return_attention_scores`, weights
        `(batch, heads, Tq, Tv)` (with higher-rank inputs Keras's
        `(batch, <other axes>, heads, <query axes>, <key axes>)`);
        `(outputs, cache)` when a cache is given, the cache in the form it came
        in; `(outputs, weights, cache)` with both.

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
        v.check_size("num_heads", num_heads)
        v.check_size("num_key_value_heads", num_key_value_heads, allow_none=True)
        if num_key_value_heads is not None and num_heads % num_key_value_heads:
            raise ValueError(
                "`num_heads` must be divisible by `num_key_value_heads` (each "
                "key/value head serves the same number of query heads). "
                f"Received: num_heads={num_heads}, "
                f"num_key_value_heads={num_key_value_heads}"
            )
        v.check_size("key_dim", key_dim)
        v.check_size("value_dim", value_dim, allow_none=True)
        dropout = v.check_rate("dropout", dropout)
        output_shape = self._check_output_shape(output_shape, output_dim)
        if attention_axes is not None and not (
            v.is_int(attention_axes)
            or (
                isinstance(attention_axes, (list, tuple))
                and attention_axes
                and all(v.is_int(axis) for axis in attention_axes)
            )
        ):
            raise ValueError(
                "`attention_axes` must be None, an int or a tuple of ints. "
                f"Received: attention_axes={attention_axes!r}"
            )
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
        check_layer_options(use_gate, seed, weight_options)
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
        self.rotary_embedding = _position_layer(
            "rotary_embedding", rotary_embedding, RotaryEmbedding
        )
        self.alibi_bias = _position_layer("alibi_bias", alibi_bias, AlibiBias)
        if self.rotary_embedding is not None and self.alibi_bias is not None:
            raise ValueError(
                "Pass one of `rotary_embedding` and `alibi_bias`: each places "
                "the tokens by itself. Received: both"
            )
        # The dropout draws from Keras's `_dropout_layer` (its seed generator),
        # on every path: the layer owns Keras's one seed generator.

    @staticmethod
    def _check_output_shape(output_shape, output_dim):
        v.check_positive_int("output_dim", output_dim, allow_none=True)
        if output_dim is not None:
            if output_shape is not None and tuple(
                (output_shape,) if v.is_int(output_shape) else output_shape
            ) != (output_dim,):
                raise ValueError(
                    "`output_dim` is an alias of an integer `output_shape`: pass "
                    "one of them. Received: "
                    f"output_shape={output_shape!r}, output_dim={output_dim!r}"
                )
            output_shape = output_dim
        if output_shape is None:
            return None
        dims = (output_shape,) if v.is_int(output_shape) else output_shape
        if (
            not isinstance(dims, (list, tuple))
            or not dims
            or not all(v.is_int(dim) and dim > 0 for dim in dims)
        ):
            raise ValueError(
                "Invalid `output_shape`: it must be a positive int or a tuple "
                f"of positive ints. Received: output_shape={output_shape!r}"
            )
        return tuple(int(dim) for dim in dims)

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
        self._check_shapes(query_shape, value_shape, key_shape)
        if self.rotary_embedding is not None and self._key_dim % 2:
            raise ValueError(
                "`rotary_embedding` needs an even `key_dim` (the rotation pairs "
                "the first half of each head with the second). Received: "
                f"key_dim={self._key_dim}"
            )
        rank = len(query_shape)
        if self.attention_axes is not None:
            axes = (
                (self.attention_axes,)
                if v.is_int(self.attention_axes)
                else tuple(self.attention_axes)
            )
            normalized = [axis if axis >= 0 else rank + axis for axis in axes]
            if not all(1 <= axis <= rank - 2 for axis in normalized) or len(
                set(normalized)
            ) != len(normalized):
                raise ValueError(
                    "`attention_axes` must be distinct axes of the inputs other "
                    "than the batch (0) and the features (-1). Received: "
                    f"attention_axes={self.attention_axes!r}, "
                    f"query.shape={query_shape}"
                )
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
            equation, bias_axes, rank = _build_proj_equation(
                len(shape) - 1, bound_dims=1, output_dims=2
            )
            dense = keras.layers.EinsumDense(
                equation,
                output_shape=_get_output_shape(rank - 1, [heads, dim]),
                bias_axes=bias_axes if self._use_bias else None,
                activation=activation,
                name=name,
                **self._get_common_kwargs_for_sublayer(),
            )
            dense.build(shape)
            return dense, rank

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

    @staticmethod
    def _check_shapes(query_shape, value_shape, key_shape):
        # Keras compares value and key first (its error for any mismatch).
        if len(key_shape) != len(value_shape) or not all(
            v.same_dim(a, b)
            for a, b in zip(value_shape[1:-1], key_shape[1:-1], strict=True)
        ):
            raise ValueError(
                "All dimensions of `value` and `key`, except the last one, must "
                f"be equal. Received: value.shape={value_shape}, "
                f"key.shape={key_shape}"
            )
        for name, shape in (
            ("query", query_shape),
            ("value", value_shape),
            ("key", key_shape),
        ):
            if len(shape) < 3:
                raise ValueError(
                    f"`{name}` must have rank 3 or more (batch, positions..., "
                    f"features). Received: {name}.shape={shape}"
                )
            if shape[-1] is None:
                raise ValueError(
                    f"The last dimension of `{name}` must be known. "
                    f"Received: {name}.shape={shape}"
                )
        if len(value_shape) != len(query_shape):
            raise ValueError(
                "`query` and `value` must have the same rank. Received: "
                f"query.shape={query_shape}, value.shape={value_shape}"
            )

    # -- caches ------------------------------------------------------------------

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
        return ops.cast(
            self.rotary_embedding(heads, start_index=start_index), heads.dtype
        )

    def _key_value(self, value, key, start_index):
        """The projected key and value heads, the keys rotated from position
        `start_index` with `rotary_embedding`."""
        key = value if key is None else key
        keys = _project(self.key_dense, key)
        if self.rotary_embedding is not None:
            keys = self._rotate(keys, start_index)
        return keys, _project(self.value_dense, value)

    def _check_cache(self, cache) -> bool:
        """Validate either cache form; `True` for keras-hub's stacked tensor."""
        return check_cache(cache, self.key_value_heads, self.key_dim, self.value_dim)

    @staticmethod
    def _cache_length(cache):
        """The number of positions a cache (of either form) holds."""
        if isinstance(cache, (tuple, list)):
            return cache[0].shape[1]
        return cache.shape[2]

    # -- the forward pass ----------------------------------------------------------

    def _check_call(
        self,
        query,
        key_length,
        query_mask,
        value_mask,
        key_mask,
        attention_mask,
        use_causal_mask,
        cache,
        cache_update_index,
    ):
        rank = len(query.shape)
        if cache is None and cache_update_index is not None:
            raise ValueError(
                "`cache_update_index` needs a `cache`. Received: cache=None, "
                f"cache_update_index={cache_update_index!r}"
            )
        if rank > 3:
            for name, value in (
                ("query_mask", query_mask),
                ("value_mask", value_mask),
                ("key_mask", key_mask),
                ("cache", cache),
            ):
                if value is not None:
                    raise ValueError(
                        f"`{name}` needs rank-3 inputs (attention over axis 1); "
                        "mask inputs of higher rank with `attention_mask`. "
                        f"Received: {name} with query.shape={tuple(query.shape)}"
                    )
            axes = self._normalized_axes(rank)
            for name, value in (
                ("use_causal_mask", use_causal_mask),
                ("sliding_window", self.sliding_window),
            ):
                if value and axes != (1,):
                    raise ValueError(
                        f"`{name}` needs attention over axis 1 alone "
                        "(`attention_axes=(1,)`, or rank-3 inputs), as Keras "
                        "builds it over axis 1. Received: "
                        f"{name}={value!r}, attention_axes={self.attention_axes!r}, "
                        f"query.shape={tuple(query.shape)}"
                    )
            self._check_attention_mask(attention_mask, query, key_length)
            return
        batch, query_length = query.shape[0], query.shape[1]
        v.check_mask_shape("query_mask", query_mask, (batch, query_length))
        v.check_mask_shape("value_mask", value_mask, (batch, key_length))
        v.check_mask_shape("key_mask", key_mask, (batch, key_length))
        self._check_attention_mask(attention_mask, query, key_length)

    def _scores_shape(self, query_shape, key_length):
        """Keras's attention-scores shape for a query of `query_shape`:
        `(B, <other axes>, N, <query axes>, <key axes>)` and the number of
        attention axes. `key_length` is the key's axis-1 size (rank 3) or the
        key's whole shape (higher ranks)."""
        rank = len(query_shape)
        if rank == 3:
            return (query_shape[0], self.num_heads, query_shape[1], key_length), 1
        axes = self._normalized_axes(rank)
        other = [a for a in range(1, rank - 1) if a not in axes]
        key_shape = key_length if isinstance(key_length, tuple) else None
        return (
            query_shape[0],
            *(query_shape[a] for a in other),
            self.num_heads,
            *(query_shape[a] for a in axes),
            *(None if key_shape is None else key_shape[a] for a in axes),
        ), len(axes)

    def _check_attention_mask(self, attention_mask, query, key_length):
        """Keras's rule: `attention_mask` broadcasts to the scores
        `(B, <other axes>, N, <query axes>, <key axes>)`, missing axes being
        inserted before the query axes (a rank-2 mask is `(Tq, Tk)`, a rank-3
        one `(B, Tq, Tk)` with rank-3 inputs)."""
        if attention_mask is None:
            return
        target, num_axes = self._scores_shape(tuple(query.shape), key_length)
        shape = tuple(attention_mask.shape)
        if 2 * num_axes <= len(shape) <= len(target):
            expanded = (
                shape[: len(shape) - 2 * num_axes]
                + (1,) * (len(target) - len(shape))
                + shape[len(shape) - 2 * num_axes :]
            )
            if all(
                got is None or want is None or got in (1, want)
                for got, want in zip(expanded, target, strict=True)
            ):
                return
        hint = ""
        if len(query.shape) == 3 and len(shape) == 2:
            hint = (
                " A rank-2 mask is (Tq, Tk), as in Keras: pass a key padding "
                "mask (batch, Tk) as `value_mask`, or as (batch, 1, Tk)."
            )
        forms = (
            "(Tq, Tk), (batch, Tq, Tk) or (batch, heads, Tq, Tk), any axis of "
            "size 1 broadcasting"
            if len(query.shape) == 3
            else "(batch, <other axes>, heads, <query axes>, <key axes>) with "
            "axes left out before the query axes or of size 1"
        )
        raise ValueError(
            f"`attention_mask` must broadcast to the attention scores {target} "
            f"(None: any size) as in Keras: {forms}.{hint} "
            f"Received: attention_mask.shape={shape}"
        )

    def _layout(self, rank: int):
        """How a projected `(B, <axes>, N, H)` tensor of `rank` is laid out for
        `dot_product_attention`: `(permutation, batch_axes, attention_axes)`.

        The permutation moves the attention axes next to the heads:
        `(B, <other axes>, <attention axes>, N, H)`; it is `None` for rank-3
        inputs attending over axis 1 (nothing to move).
        """
        axes = self._normalized_axes(rank - 1)
        other = tuple(a for a in range(1, rank - 2) if a not in axes)
        if rank == 4 and axes == (1,):
            return None, (), axes
        return (0, *other, *axes, rank - 2, rank - 1), other, axes

    def _to_blocks(self, heads, layout):
        """`(B, <axes>, N, H)` -> `(B', T', N, H)`: the other axes joined to the
        batch, the attention axes joined into one."""
        permutation, other, axes = layout
        if permutation is None:
            return heads
        heads = ops.transpose(heads, permutation)
        shape = ops.shape(heads)
        length = _product(shape[1 + len(other) : 1 + len(other) + len(axes)])
        return ops.reshape(heads, (-1, length, shape[-2], shape[-1]))

    def _scores_mask(self, attention_mask, layout):
        """`attention_mask` in Keras's broadcasting, as a boolean mask of the
        scores' rank `(B|1, <other>|1, N|1, <query axes>, <key axes>)`."""
        _, other, axes = layout
        mask = padding_mask(attention_mask)
        scores_rank = 2 + len(other) + 2 * len(axes)
        while len(mask.shape) < scores_rank:
            mask = ops.expand_dims(mask, -2 * len(axes) - 1)  # before <query axes>
        return mask

    def _block_mask(self, attention_mask, query_heads, key_heads, layout):
        """An `attention_mask` in Keras's broadcasting as the mask of the
        blocks: `(B'|1, N|1, Tq', Tk')`."""
        permutation, other, axes = layout
        mask = self._scores_mask(attention_mask, layout)
        if permutation is None:  # (B|1, N|1, Tq|1, Tk|1)
            shape = ops.shape(mask)
            return ops.broadcast_to(
                mask,
                (
                    shape[0],
                    shape[1],
                    ops.shape(query_heads)[1],
                    ops.shape(key_heads)[1],
                ),
            )  # (B|1, N|1, Tq, Tk)
        query_shape = ops.shape(ops.transpose(query_heads, permutation))
        key_shape = ops.shape(ops.transpose(key_heads, permutation))
        heads = mask.shape[1 + len(other)]
        target = (
            *query_shape[: 1 + len(other)],
            self.num_heads if heads is None or heads != 1 else 1,
            *query_shape[1 + len(other) : 1 + len(other) + len(axes)],
            *key_shape[1 + len(other) : 1 + len(other) + len(axes)],
        )  # (B, <other>, N|1, <query axes>, <key axes>)
        mask = ops.broadcast_to(mask, target)
        return ops.reshape(
            mask,
            (
                -1,
                target[1 + len(other)],
                _product(target[2 + len(other) : 2 + len(other) + len(axes)]),
                _product(target[2 + len(other) + len(axes) :]),
            ),
        )  # (B', N|1, Tq', Tk')

    def _from_blocks(self, attended, weights, query_heads, key_heads, layout):
        """Undo `_to_blocks` on the outputs and the weights (to Keras's
        layout)."""
        permutation, other, axes = layout
        if permutation is None:
            return attended, weights
        query_shape = ops.shape(ops.transpose(query_heads, permutation))
        key_shape = ops.shape(ops.transpose(key_heads, permutation))
        positions = query_shape[:-2]  # (B, <other>, <query axes>)
        inverse = [permutation.index(axis) for axis in range(len(permutation))]
        attended = ops.reshape(attended, (*positions, *ops.shape(attended)[-2:]))
        attended = ops.transpose(attended, inverse)  # (B, <axes>, N, Hv)
        if weights is not None:
            weights = ops.reshape(
                weights,
                (
                    *positions[: 1 + len(other)],
                    self.num_heads,
                    *positions[1 + len(other) :],
                    *key_shape[1 + len(other) : 1 + len(other) + len(axes)],
                ),
            )  # (B, <other>, N, <query axes>, <key axes>)
        return attended, weights

    def _rows_with_keys_of_mask(self, mask, layout, query_heads):
        """`(B, <axes>)` bool for higher-rank inputs: whether each query
        position has a key in the scores-shaped `mask`, any head."""
        permutation, other, axes = layout
        has_keys = ops.any(mask, axis=tuple(range(-len(axes), 0)))
        has_keys = ops.any(has_keys, axis=1 + len(other))  # (B|1, <other>|1, <q>)
        query_shape = ops.shape(ops.transpose(query_heads, permutation))
        has_keys = ops.broadcast_to(has_keys, query_shape[:-2])  # (B, <other>, <q>)
        inverse = [permutation.index(axis) for axis in range(len(permutation))]
        return ops.transpose(has_keys, inverse[:-2])  # (B, <axes>)

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

        Keras's signature and meaning: `query` `(B, Tq, N, key_dim)` as the
        query projection gives it (scaled here by `1/sqrt(key_dim)`), `key`
        `(B, Tk, N, key_dim)`, `value` `(B, Tk, N, value_dim)` (with
        higher-rank inputs `(B, <axes>, N, dim)`), `attention_mask` in
        Keras's broadcasting (`(Tq, Tk)`, `(B, Tq, Tk)`,
        `(B, N, Tq, Tk)`, ...), `use_causal_mask` adds the causal mask.
        Returns `(attention_output, attention_scores)`, the scores `None`
        unless `return_attention_scores`. keras-attn's path dispatch
        (`keras_attn.ops.dot_product_attention`) runs inside.

        `call` hands the masks to it as components when the method is not
        overridden (keyword-only, so that an override with Keras's signature
        gets them combined into `attention_mask` instead): `key_padding_mask`
        `(B, Tk)`, `query_padding_mask` `(B, Tq)`, `causal_offset` (the
        cache position of the first query, for the causal mask and the
        window) and `sliding_window`; the memory-efficient path reads them
        without building a `(Tq, Tk)` mask. With `query_is_scaled` the query
        already carries the `1/sqrt(key_dim)` (`call` folds it into the query
        projection's weights on TensorFlow, one matmul instead of a multiply
        over the `(B, Tq, N, H)` heads). `alibi_slopes` `(N,)`: ALiBi's
        per-head slopes (`alibi_bias`), added to the logits as
        `slope * (j - (i + causal_offset))`.
        """
        rank = len(query.shape)
        layout = self._layout(rank)
        if rank > 4 and (use_causal_mask or sliding_window is not None):
            # Keras's causal mask of higher-rank inputs runs over axis 1.
            if layout[2] != (1,):
                raise ValueError(
                    "`use_causal_mask` and `sliding_window` need attention over "
                    "axis 1 alone (`attention_axes=(1,)`). Received: "
                    f"attention_axes={self.attention_axes!r}, "
                    f"query.shape={tuple(query.shape)}"
                )
            query_length, key_length = ops.shape(query)[1], ops.shape(key)[1]
            band = band_mask(
                query_length, key_length, use_causal_mask, sliding_window, causal_offset
            )
            attention_mask = combine_masks(
                None
                if attention_mask is None
                else self._scores_mask(attention_mask, layout),
                band,  # (Tq, Tk), broadcast as the last two axes
            )
            use_causal_mask, sliding_window, causal_offset = False, None, 0
        mask = (
            None
            if attention_mask is None
            else self._block_mask(attention_mask, query, key, layout)
        )  # (B'|1, N|1, Tq', Tk')
        attended = dot_product_attention(
            self._to_blocks(query, layout),
            ops.cast(self._to_blocks(key, layout), query.dtype),
            ops.cast(self._to_blocks(value, layout), query.dtype),
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
        return self._from_blocks(attended, weights, query, key, layout)

    def _check_positions(self, rank, cache, cache_update_index):
        """`rotary_embedding` and `alibi_bias` need rank-3 inputs, the
        query's position (`cache_update_index` with a cache), and (ALiBi)
        keras-attn's `_compute_attention`."""
        for name, layer in (
            ("rotary_embedding", self.rotary_embedding),
            ("alibi_bias", self.alibi_bias),
        ):
            if layer is None:
                continue
            if rank != 3:
                raise ValueError(
                    f"`{name}` needs rank-3 inputs `(batch, T, features)` "
                    f"(positions along axis 1). Received: query of rank {rank}"
                )
            if cache is not None and cache_update_index is None:
                raise ValueError(
                    f"`{name}` needs the position of the queries: with a "
                    "`cache`, pass `cache_update_index` (a cache used as it is, "
                    "without one, holds cross-attention keys, which have no "
                    "positions shared with the queries). Received: "
                    "cache_update_index=None"
                )
        if self.alibi_bias is not None and self._overrides_compute_attention():
            raise ValueError(
                "`alibi_bias` is applied inside keras-attn's `_compute_attention`"
                f", which {type(self).__name__} overrides. Received: "
                "alibi_bias with an overridden `_compute_attention`"
            )

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
            check_call_inputs(
                query, value, key, (self.query_dense, self.value_dense, self.key_dense)
            )
        stacked = cache is not None and self._check_cache(cache)
        if cache is not None:
            key_length = self._cache_length(cache)
        elif rank == 3:
            key_length = (value if key is None else key).shape[1]
        else:
            key_length = tuple(value.shape)
        self._check_call(
            query,
            key_length,
            query_mask,
            value_mask,
            key_mask,
            attention_mask,
            use_causal_mask,
            cache,
            cache_update_index,
        )
        self._check_positions(rank, cache, cache_update_index)
        gate = _project(self.gate_dense, query) if self.use_gate else None
        # Keras's `_compute_attention` takes the unscaled query; keras-attn's
        # own folds the scale into the projection (`query_is_scaled`).
        scaled = not self._overrides_compute_attention()
        query_heads = _project(
            self.query_dense,
            query,
            scale=self._inverse_sqrt_key_dim if scaled else None,
        )  # (B, Tq, N, H)
        offset = 0 if cache_update_index is None else cache_update_index
        if self.rotary_embedding is not None:
            query_heads = self._rotate(query_heads, offset)
        if cache is None or cache_update_index is not None:
            new_keys, new_values = self._key_value(value, key, offset)  # (B,Tv,K,H)
        if cache is None:
            key_heads, value_heads = new_keys, new_values
        else:
            key_heads, value_heads, cache = updated_cache(
                cache,
                stacked,
                None if cache_update_index is None else new_keys,
                None if cache_update_index is None else new_values,
                cache_update_index,
            )
        if rank == 3:
            arguments, has_keys = self._mask_components(
                query_heads,
                key_heads,
                query_mask,
                value_mask,
                key_mask,
                attention_mask,
                use_causal_mask,
                0 if cache_update_index is None else cache_update_index,
            )
        else:
            arguments, has_keys = self._higher_rank_masks(
                query_heads, key_heads, attention_mask, use_causal_mask
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
        outputs = _project(self.output_dense, attended)  # (B, <axes>, *output_shape)
        if has_keys is not None:
            while len(has_keys.shape) < len(outputs.shape):
                has_keys = ops.expand_dims(has_keys, -1)  # (B|1, <axes>|1, 1...)
            outputs = ops.where(has_keys, outputs, ops.zeros_like(outputs))
        result = (outputs,)
        if return_attention_scores:
            result += (weights,)
        if cache is not None:
            result += (cache,)
        return result[0] if len(result) == 1 else result

    def _mask_components(
        self,
        query_heads,
        key_heads,
        query_mask,
        value_mask,
        key_mask,
        attention_mask,
        use_causal_mask,
        offset,
    ):
        """The masks of a rank-3 call as `_compute_attention`'s arguments, and
        the `(B|1, Tq)` rows that have a key (or `None`): `mask_components`'s
        split, or for a subclass that overrides `_compute_attention` every
        mask combined into Keras's `attention_mask`."""
        explicit, key_padding, query_padding, has_keys = mask_components(
            query_heads,
            key_heads,
            query_mask,
            value_mask,
            key_mask,
            attention_mask,
            use_causal_mask,
            offset,
            self.sliding_window,
        )
        if self._overrides_compute_attention():
            # Keras's arguments only: every mask in one (B|1, N|1, Tq, Tk).
            query_length = ops.shape(query_heads)[1]
            key_length = ops.shape(key_heads)[1]
            band = band_mask(
                query_length, key_length, use_causal_mask, self.sliding_window, offset
            )
            combined = combine_masks(
                explicit,
                None if key_padding is None else key_padding[:, None, None, :],
                None if query_padding is None else query_padding[:, None, :, None],
                None if band is None else band[None, None],
            )
            if combined is not None and combined.shape[1] == 1:
                combined = combined[:, 0]  # (B|1, Tq, Tk), Keras's documented form
            return {"attention_mask": combined}, has_keys
        return {
            "attention_mask": explicit,
            "use_causal_mask": bool(use_causal_mask),
            "key_padding_mask": key_padding,
            "query_padding_mask": query_padding,
            "causal_offset": offset,
            "sliding_window": self.sliding_window,
        }, has_keys

    def _higher_rank_masks(self, query_heads, key_heads, attention_mask, use_causal):
        """The masks of a higher-rank call: Keras's `attention_mask` with the
        causal mask and the window over axis 1 folded in, and the
        `(B, <axes>)` query positions that have a key (or `None`)."""
        layout = self._layout(len(query_heads.shape))
        query_length, key_length = ops.shape(query_heads)[1], ops.shape(key_heads)[1]
        band = band_mask(
            query_length, key_length, use_causal, self.sliding_window
        )  # (Tq, Tk) over axis 1, or None
        mask = combine_masks(
            None
            if attention_mask is None
            else self._scores_mask(attention_mask, layout),
            band,
        )
        if mask is None:
            return {}, None
        while len(mask.shape) < 2 + len(layout[1]) + 2 * len(layout[2]):
            mask = mask[None]  # (1, ..., Tq, Tk): the band alone
        has_keys = self._rows_with_keys_of_mask(mask, layout, query_heads)
        return {"attention_mask": mask}, has_keys

    # -- Keras anatomy -------------------------------------------------------------

    def compute_output_shape(self, query_shape, value_shape=None, key_shape=None):
        query_shape = tuple(query_shape)
        if value_shape is not None:
            key_shape = value_shape if key_shape is None else key_shape
            self._check_shapes(query_shape, tuple(value_shape), tuple(key_shape))
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
        if cache is not None:
            self._check_cache(cache)
            key_length = self._cache_length(cache)
        else:
            key_shape = (value if key is None else key).shape
            self._check_shapes(tuple(query.shape), tuple(value.shape), tuple(key_shape))
            # The key's length (rank 3), or its shape (higher ranks).
            key_length = key_shape[1] if len(query.shape) == 3 else tuple(value.shape)
        self._check_call(
            query,
            key_length,
            query_mask,
            value_mask,
            key_mask,
            attention_mask,
            use_causal_mask,
            cache,
            cache_update_index,
        )
        result = (
            keras.KerasTensor(
                self._outputs_shape(query.shape), dtype=self.compute_dtype
            ),
        )
        if return_attention_scores:
            rank = len(query.shape)
            if rank == 3:
                shape = (query.shape[0], self.num_heads, query.shape[1], key_length)
            else:
                axes = self._normalized_axes(rank)
                other = [a for a in range(1, rank - 1) if a not in axes]
                key_source = value if key is None else key
                shape = (
                    query.shape[0],
                    *(query.shape[a] for a in other),
                    self.num_heads,
                    *(query.shape[a] for a in axes),
                    *(key_source.shape[a] for a in axes),
                )
            result += (keras.KerasTensor(shape, dtype=self.compute_dtype),)
        if cache is not None:
            result += (
                tuple(keras.KerasTensor(t.shape, dtype=t.dtype) for t in cache)
                if isinstance(cache, (tuple, list))
                else keras.KerasTensor(cache.shape, dtype=cache.dtype),
            )
        return result[0] if len(result) == 1 else result

    def _normalized_axes(self, rank: int) -> tuple:
        """The attention axes of inputs of `rank` (Keras's default: all but the
        batch and the features)."""
        if self.attention_axes is None:
            return tuple(range(1, rank - 1))
        axes = (
            (self.attention_axes,)
            if v.is_int(self.attention_axes)
            else self.attention_axes
        )
        return tuple(axis if axis >= 0 else rank + axis for axis in axes)

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
