"""The argument and shape checks of the attention layers
(`MultiHeadAttention`, `GroupedQueryAttention`), one copy of each.

Every error names the argument and what was received, in Keras's words where
Keras refuses the same argument; the generic checks are
`keras_attn._validation`'s.
"""

from __future__ import annotations

import keras

from keras_attn import _validation as v
from keras_attn.layers.alibi_bias import AlibiBias
from keras_attn.layers.attention_axes import normalized_axes, scores_shape
from keras_attn.layers.kv_cache import (
    check_cache_update_index,
    check_per_row_index,
    is_per_row,
)
from keras_attn.layers.rotary_embedding import RotaryEmbedding

# -- constructor arguments ------------------------------------------------------


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


def check_head_sizes(num_heads, num_key_value_heads, key_dim, value_dim) -> None:
    """`MultiHeadAttention`'s head counts and sizes: positive ints (in
    Keras's words), `num_key_value_heads` dividing `num_heads`."""
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


def check_output_shape(output_shape, output_dim):
    """`output_shape` (or its alias `output_dim`, an int) as a tuple of
    positive ints, or `None`."""
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


def check_attention_axes(attention_axes) -> None:
    """`attention_axes` is `None`, an int or a non-empty tuple of ints."""
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


def position_layer(name, value, cls):
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


def position_layers(rotary_embedding, alibi_bias):
    """`(rotary_embedding, alibi_bias)` as layers (`position_layer`), at
    most one of them set."""
    rotary_embedding = position_layer(
        "rotary_embedding", rotary_embedding, RotaryEmbedding
    )
    alibi_bias = position_layer("alibi_bias", alibi_bias, AlibiBias)
    if rotary_embedding is not None and alibi_bias is not None:
        raise ValueError(
            "Pass one of `rotary_embedding` and `alibi_bias`: each places "
            "the tokens by itself. Received: both"
        )
    return rotary_embedding, alibi_bias


# -- shapes -----------------------------------------------------------------------


def check_shapes(query_shape, value_shape, key_shape) -> None:
    """The static shapes of `query`, `value` and `key`: key and value alike
    but for their last axis, each of rank 3 or more with a known last axis,
    query and value of one rank."""
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


def check_attention_axes_of(attention_axes, query_shape) -> None:
    """`attention_axes` are distinct axes of inputs of `query_shape`, none
    the batch or the features."""
    if attention_axes is None:
        return
    rank = len(query_shape)
    normalized = normalized_axes(attention_axes, rank)
    if not all(1 <= axis <= rank - 2 for axis in normalized) or len(
        set(normalized)
    ) != len(normalized):
        raise ValueError(
            "`attention_axes` must be distinct axes of the inputs other "
            "than the batch (0) and the features (-1). Received: "
            f"attention_axes={attention_axes!r}, "
            f"query.shape={query_shape}"
        )


def check_call_inputs(query, value, key, projections):
    """The inputs of an eager call against each other and the projections
    `(query, value, key)` they were built for (`build` checks them on the
    first call only; a later call would fail inside a matmul): key and value
    alike but for their last axis, one batch size, and each input's last axis
    the projection's (skipped for quantized or LoRA projections)."""
    key = value if key is None else key
    check_shapes(tuple(query.shape), tuple(value.shape), tuple(key.shape))
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


# -- masks --------------------------------------------------------------------------


def check_padding_masks(
    query_mask, value_mask, key_mask, batch, query_length, key_length
):
    """`query_mask` `(batch, Tq)`, `value_mask` and `key_mask` `(batch, Tk)`."""
    v.check_mask_shape("query_mask", query_mask, (batch, query_length))
    v.check_mask_shape("value_mask", value_mask, (batch, key_length))
    v.check_mask_shape("key_mask", key_mask, (batch, key_length))


def check_attention_mask(
    attention_mask, query_shape, key_length, num_heads, attention_axes, hint=True
):
    """Keras's rule: `attention_mask` broadcasts to the scores
    `(B, <other axes>, N, <query axes>, <key axes>)`, missing axes being
    inserted before the query axes (a rank-2 mask is `(Tq, Tk)`, a rank-3
    one `(B, Tq, Tk)` with rank-3 inputs). `key_length` as `scores_shape`
    takes it. With `hint`, the error for a rank-2 mask of rank-3 inputs
    says where a key padding mask goes (`GroupedQueryAttention`'s error
    leaves it out)."""
    if attention_mask is None:
        return
    query_shape = tuple(query_shape)
    target, num_axes = scores_shape(attention_axes, num_heads, query_shape, key_length)
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
    message = ""
    if hint and len(query_shape) == 3 and len(shape) == 2:
        message = (
            " A rank-2 mask is (Tq, Tk), as in Keras: pass a key padding "
            "mask (batch, Tk) as `value_mask`, or as (batch, 1, Tk)."
        )
    forms = (
        "(Tq, Tk), (batch, Tq, Tk) or (batch, heads, Tq, Tk), any axis of "
        "size 1 broadcasting"
        if len(query_shape) == 3
        else "(batch, <other axes>, heads, <query axes>, <key axes>) with "
        "axes left out before the query axes or of size 1"
    )
    raise ValueError(
        f"`attention_mask` must broadcast to the attention scores {target} "
        f"(None: any size) as in Keras: {forms}.{message} "
        f"Received: attention_mask.shape={shape}"
    )


# -- a call ---------------------------------------------------------------------------


def check_call(
    query,
    key_length,
    query_mask,
    value_mask,
    key_mask,
    attention_mask,
    use_causal_mask,
    cache,
    cache_update_index,
    *,
    num_heads,
    attention_axes,
    sliding_window,
):
    """The masks and cache arguments of a `MultiHeadAttention` call against
    the query and the key length (`scores_shape`'s `key_length`): padding
    masks, the cache and the causal mask and window over axis 1 only with
    rank-3 inputs (or `attention_axes=(1,)`), `attention_mask` Keras's
    broadcasting."""
    rank = len(query.shape)
    check_cache_update_index(cache, cache_update_index)
    check_per_row_index(cache_update_index, query.shape[0])
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
        axes = normalized_axes(attention_axes, rank)
        for name, value in (
            ("use_causal_mask", use_causal_mask),
            ("sliding_window", sliding_window),
        ):
            if value and axes != (1,):
                raise ValueError(
                    f"`{name}` needs attention over axis 1 alone "
                    "(`attention_axes=(1,)`, or rank-3 inputs), as Keras "
                    "builds it over axis 1. Received: "
                    f"{name}={value!r}, attention_axes={attention_axes!r}, "
                    f"query.shape={tuple(query.shape)}"
                )
    else:
        check_padding_masks(
            query_mask, value_mask, key_mask, query.shape[0], query.shape[1], key_length
        )
    check_attention_mask(
        attention_mask, query.shape, key_length, num_heads, attention_axes
    )


def check_band_axes(axes, attention_axes, query_shape) -> None:
    """The causal mask and the window of a higher-rank `_compute_attention`
    call need attention over axis 1 alone (`axes`: the normalized axes)."""
    if axes != (1,):
        raise ValueError(
            "`use_causal_mask` and `sliding_window` need attention over "
            "axis 1 alone (`attention_axes=(1,)`). Received: "
            f"attention_axes={attention_axes!r}, "
            f"query.shape={tuple(query_shape)}"
        )


def check_positions(
    rotary_embedding,
    alibi_bias,
    rank,
    cache,
    cache_update_index,
    overrides_compute_attention,
    class_name,
):
    """`rotary_embedding` and `alibi_bias` need rank-3 inputs, the
    query's position (`cache_update_index` with a cache), and (ALiBi)
    keras-attn's `_compute_attention` (not overridden by `class_name`)."""
    for name, layer in (
        ("rotary_embedding", rotary_embedding),
        ("alibi_bias", alibi_bias),
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
    if alibi_bias is not None and is_per_row(cache_update_index):
        raise ValueError(
            "`alibi_bias` takes one position for the batch: pass "
            "`cache_update_index` as an int or a scalar. Received: a per-row "
            f"cache_update_index of shape {tuple(cache_update_index.shape)}"
        )
    if alibi_bias is not None and overrides_compute_attention:
        raise ValueError(
            "`alibi_bias` is applied inside keras-attn's `_compute_attention`"
            f", which {class_name} overrides. Received: "
            "alibi_bias with an overridden `_compute_attention`"
        )
