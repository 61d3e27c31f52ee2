"""Attention given scores or projected heads: `dot_product_attention` on the
fused, memory-efficient or explicit path, and the explicit path itself.

Shapes follow `keras.ops.dot_product_attention`: heads are `(B, T, N, H)`
(batch, time, heads, head size) and masks broadcast to `(B, N, Tq, Tk)`.
Which path a call takes is decided in `keras_attn.ops.attention_paths`; the
memory-efficient path is `keras_attn.ops.memory_efficient_attention`.
"""

from __future__ import annotations

import math
import numbers

import keras
from keras import ops

from keras_attn.ops import _checks
from keras_attn.ops import pallas_attention as _pallas

# Imported from here by the layers.
from keras_attn.ops._checks import check_flash_attention as check_flash_attention
from keras_attn.ops.alibi import alibi_bias
from keras_attn.ops.attention_paths import (
    BY_LENGTH,
    FUSED,
    MEMORY_EFFICIENT,
    broadcast_mask_kernel,
    choose_path,
    fused_kernel_runs,
    lengths_kernel_implementation,
    switch_over_length,
)
from keras_attn.ops.masks import (
    band_mask,
    combine_masks,
    padding_mask,
    with_whole_sequence_axes,
)
from keras_attn.ops.memory_efficient_attention import memory_efficient_attention
from keras_attn.ops.sequence_lengths import (
    attention_with_lengths,
    concrete_right_padded,
    lengths_form,
    needs_lengths,
    right_padded,
)
from keras_attn.ops.serving import in_serving_mode, transpose
from keras_attn.ops.softmax import masked_softmax


def weighted_sum(weights, value):
    """Context vectors `Σ_k weights[q, k] · value[k]`.

    `(..., Tq, Tk), (..., Tk, dv) -> (..., Tq, dv)`; weights are cast to the
    value's dtype.
    """
    value = ops.convert_to_tensor(value)
    return ops.matmul(ops.cast(weights, value.dtype), value)


def _static_dim(dim):
    """`dim` as a Python int, `None` when unknown or symbolic."""
    return dim if isinstance(dim, int) else None


def _rows_with_keys(mask):
    """`(B|1, N|1, Tq|1, 1)` bool: whether each query row has a valid key."""
    return ops.any(mask, axis=-1, keepdims=True)


def _is_zero(offset) -> bool:
    """Whether `offset` is the static integer 0."""
    return isinstance(offset, numbers.Integral) and int(offset) == 0


def dot_product_attention(
    query,
    key,
    value,
    mask=None,
    scale=None,
    return_weights: bool = False,
    dropout_rate: float = 0.0,
    training: bool = False,
    seed_generator=None,
    is_causal: bool = False,
    flash_attention: bool | None = None,
    *,
    key_padding_mask=None,
    query_padding_mask=None,
    causal_offset=0,
    sliding_window: int | None = None,
    alibi_slopes=None,
):
    """Scaled dot-product attention over heads, on the path that suits the call.

    `softmax(q kᵀ · scale) v` (Vaswani et al. 2017), with the softmax in
    float32 and a finite mask value. A query row whose keys are all masked gets
    all-zero weights and a zero output on every path.

    `attention_path` chooses the path: the fused
    `keras.ops.dot_product_attention` where a fused kernel runs the call
    (`fused_kernel_runs`); the memory-efficient
    `keras_attn.ops.memory_efficient_attention` for long sequences (or when
    `flash_attention=True` and no fused kernel runs); otherwise the explicit
    path, which materialises the weights. The paths agree (tested).

    On JAX, where cuDNN runs the call (float16 / bfloat16 on a GPU), masks
    that are only padding, the causal mask and a causal sliding window (no
    explicit `mask`, no causal offset) reach it without a `(Tq, Tk)` tensor:
    `jax.nn.dot_product_attention` is called with right padding as sequence
    lengths, `is_causal` and `local_window_size`
    (`keras_attn.ops.sequence_lengths`). Whether the padding masks are
    right-padded is decided when the call runs (or when it is traced, for
    masks whose values are known); masks that are not take the
    memory-efficient path from the switch-over length, which builds no
    `(Tq, Tk)` tensor either, and the fused call with the masks combined
    below it.

    The masks may be given as components, combined with a logical AND:
    `mask`, `key_padding_mask`, `query_padding_mask`, `is_causal` (with
    `causal_offset`) and `sliding_window`. The memory-efficient path reads
    them block by block, so no `(Tq, Tk)` tensor is built on it beyond an
    explicit `mask` itself; the other paths combine them into one mask.

    ALiBi (Press et al. 2022) is a component as well: with `alibi_slopes`,
    the logit of query `i` and key `j` in query head `n` gets
    `alibi_slopes[n] * (j - (i + causal_offset))` after the scale (the
    query's position is the one the causal mask and the sliding window use),
    computed in float32 before the softmax; the explicit path adds the
    `(N, Tq, Tk)` bias to its logits (the weights it returns include it), the
    memory-efficient path computes it block by block. The fused
    `keras.ops.dot_product_attention` would need the bias as a whole
    `(B|1, N, Tq, Tk)` tensor, so a call with `alibi_slopes` never takes the
    fused path: it goes to the memory-efficient or the explicit path by the
    rule for calls that no fused kernel runs (`attention_path`).

    Grouped-query attention (Ainslie et al. 2023): `key` and `value` may have
    fewer heads `K` than `query`'s `N` (`N` a multiple of `K`; `K = 1` is
    multi-query attention). Query head `n` attends with key/value head
    `n // (N / K)`, as `keras.layers.GroupQueryAttention` pairs them after
    `ops.repeat(key, N // K, axis=2)`. No path repeats the keys and values:
    the explicit path multiplies each group of query heads with its key head,
    the memory-efficient path does the same block by block (its key and value
    gradients summed over each group), and the fused path passes the heads as
    they are (`keras.ops.dot_product_attention` takes `K < N`).

    Args:
        query: `(B, Tq, N, H)`.
        key: `(B, Tk, K, H)`, `K` dividing `N` (`K = N` by default).
        value: `(B, Tk, K, Hv)`.
        mask: optional boolean tensor broadcastable to `(B, N, Tq, Tk)`, `True`
            for query-key pairs that take part.
        scale: multiplier of the logits; `1/sqrt(H)` by default.
        return_weights: also return the weights `(B, N, Tq, Tk)`.
        dropout_rate: dropout on the weights when `training`.
        training: whether dropout is active.
        seed_generator: a `keras.random.SeedGenerator` for the dropout.
        is_causal: also mask future keys: query `i` sees key `j` when
            `j <= i + causal_offset`. With no other mask and a zero offset
            the fused path uses the backend's causal kernel.
        flash_attention: `None`, `True` or `False`, see `attention_path`.
        key_padding_mask: optional boolean `(B, Tk)`, `True` for keys that
            exist.
        query_padding_mask: optional boolean `(B, Tq)`, `True` for queries
            that exist (the others get zero outputs).
        causal_offset: the position of the first query among the keys (int
            or scalar tensor), as `cache_update_index` in cached decoding;
            for `is_causal`, `sliding_window` and `alibi_slopes`.
        sliding_window: optional positive int: query `i` sees key `j` only
            when `|i + causal_offset - j| < sliding_window`
            (`sliding_window_mask`).
        alibi_slopes: optional float tensor `(N,)`, ALiBi's slope of each
            query head (`keras_attn.layers.alibi_bias.alibi_slopes(N)`), see
            above. The slopes are fixed: the memory-efficient path gives them
            no gradient.

    Returns:
        `outputs` `(B, Tq, N, Hv)`, or `(outputs, weights)` with
        `return_weights=True`; both in the dtype of `value`.
    """
    query = ops.convert_to_tensor(query)
    key = ops.convert_to_tensor(key)
    value = ops.convert_to_tensor(value)
    groups = _checks.key_value_groups(query.shape, key.shape, value.shape)
    alibi_slopes = _checks.check_alibi_slopes(alibi_slopes, query.shape[2])
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    mask = padding_mask(mask)
    while mask is not None and len(mask.shape) < 4:
        mask = mask[None]  # broadcast as NumPy does: (B|1, N|1, Tq, Tk)
    key_padding_mask = padding_mask(key_padding_mask)
    query_padding_mask = padding_mask(query_padding_mask)
    dropout_active = bool(training) and dropout_rate > 0.0
    components = {
        "key_padding_mask": key_padding_mask,
        "query_padding_mask": query_padding_mask,
        "causal": bool(is_causal),
        "causal_offset": causal_offset,
        "sliding_window": sliding_window,
    }
    # Causal masking alone: the fused kernel's own, no (Tq, Tk) mask.
    causal_kernel = (
        is_causal
        and _is_zero(causal_offset)
        and mask is None
        and key_padding_mask is None
        and query_padding_mask is None
        and sliding_window is None
    )
    query_length, key_length = _static_dim(query.shape[1]), _static_dim(key.shape[1])
    # The masks as JAX's cuDNN attention takes them without a (Tq, Tk)
    # tensor (`keras_attn.ops.sequence_lengths`), and the implementation
    # that runs that call, once `fused_kernel` has found one.
    form = (
        lengths_form(*_whole_sequence_axes(mask, query, key, components), scale)
        if keras.backend.backend() == "jax" and None not in (query_length, key_length)
        else None
    )
    lengths_kernel = {}
    # A kernel that takes a mask broadcast along the query axis as it is
    # (PyTorch's CPU flash kernel) gets one wherever the masks allow: the
    # key padding alone, or a single query.
    broadcast_mask = broadcast_mask_kernel(query)
    query_axis = (
        1
        if broadcast_mask
        and (
            query_length == 1
            or (
                (mask is None or mask.shape[2] == 1)
                and query_padding_mask is None
                and sliding_window is None
                and not is_causal
            )
        )
        else query_length
    )

    def fused_kernel():
        if form is not None:
            implementation = lengths_kernel_implementation(
                query,
                key,
                value,
                lengths=needs_lengths(form, query_length, key_length),
                is_causal=form["causal"],
                window=form["sliding_window"],
            )
            if implementation is not None:
                lengths_kernel["implementation"] = implementation
                return True
        masked = mask is not None or (
            any(
                components[name] is not None
                for name in ("key_padding_mask", "query_padding_mask", "sliding_window")
            )
            or (is_causal and not causal_kernel)
        )
        return fused_kernel_runs(
            query,
            key,
            value,
            mask_shape=(
                (
                    query.shape[0],
                    1 if mask is None else mask.shape[1],  # heads
                    query_axis,
                    key_length,
                )
                if masked
                else None
            ),
            is_causal=causal_kernel,
        )

    path = choose_path(
        flash_attention,
        return_weights=return_weights,
        dropout_active=dropout_active,
        # jax.nn.dot_product_attention needs value heads as wide as key heads.
        same_head_dims=value.shape[-1] == key.shape[-1],
        # ALiBi would reach the fused kernel only as a whole (Tq, Tk) bias.
        alibi=alibi_slopes is not None,
        query_length=query_length,
        key_length=key_length,
        dtype=query.dtype,
        # JAX traces a layer with symbolic shapes when Keras infers the
        # output spec of a layer around it that has no `compute_output_spec`.
        symbolic=not all(
            isinstance(dim, (int, type(None))) for dim in (*query.shape, *key.shape)
        ),
        fused_kernel=fused_kernel,
    )

    def memory_efficient():
        # `K` key/value heads as they are: the blocks group the query heads.
        # The blocks read a mask with whole sequence axes (`_whole_sequence_axes`).
        blocked_mask, blocked_components = _whole_sequence_axes(
            mask, query, key, components
        )

        def blocked():
            return memory_efficient_attention(
                query,
                key,
                value,
                attention_mask=blocked_mask,
                scale=scale,
                dropout_rate=dropout_rate,
                training=training,
                seed_generator=seed_generator,
                alibi_slopes=alibi_slopes,
                **blocked_components,
            )

        # On a GPU in float32, Pallas's FlashAttention kernel computes the
        # calls it can take (`keras_attn.ops.pallas_attention`): no (Tq, Tk)
        # tensor either, in about half the time.
        mode = _pallas.pallas_runs()
        kernel_form = (
            None
            if mode is None
            else _pallas.pallas_form(
                query,
                key,
                value,
                mask=blocked_mask,
                components=blocked_components,
                scale=scale,
                alibi=alibi_slopes is not None,
                dropout_active=dropout_active,
            )
        )
        if kernel_form is None:
            return blocked()

        def kernel():
            return _pallas.pallas_attention(query, key, value, kernel_form, scale, mode)

        same = _pallas.same_padding(kernel_form)
        if same is True:
            return kernel()
        return ops.cond(same, kernel, blocked)

    def explicit():
        return _explicit_attention(
            query,
            key,
            value,
            _combined(query, key, mask, components),
            scale,
            dropout_rate if dropout_active else 0.0,
            seed_generator,
            groups,
            alibi=(None if alibi_slopes is None else (alibi_slopes, causal_offset)),
        )

    def fused():
        combined = None if causal_kernel else _combined(query, key, mask, components)
        if combined is not None and not broadcast_mask:
            # cuDNN takes a mask (its bias) only with both sequence axes
            # whole: a key padding mask `(B, 1, 1, Tk)` is refused ("Bias must
            # have same seq length as QKV"), and Keras then falls back to
            # XLA's attention with a logged traceback. The batch and heads
            # axes stay as they are.
            combined = with_whole_sequence_axes(
                combined, ops.shape(query)[1], ops.shape(key)[1]
            )  # (B|1, N|1, Tq, Tk)
        outputs = ops.dot_product_attention(
            query, key, value, mask=combined, scale=scale, is_causal=causal_kernel
        )  # (B, Tq, N, Hv)
        if combined is not None:
            has_keys = ops.transpose(_rows_with_keys(combined), (0, 2, 1, 3))
            # (B|1, Tq|1, N|1, 1): zero the rows that had nothing to attend to.
            outputs = ops.where(has_keys, outputs, ops.zeros_like(outputs))
        return outputs

    def with_lengths():
        return attention_with_lengths(
            query, key, value, form, scale, lengths_kernel["implementation"]
        )

    def without_lengths():
        # Padding that is not right-padding: from the switch-over length the
        # memory-efficient path, which builds no (Tq, Tk) tensor either; below
        # it the fused call with the masks as one.
        if key_length >= switch_over_length(query.dtype):
            return memory_efficient()
        return fused()

    if path == MEMORY_EFFICIENT:
        return memory_efficient()
    if path == BY_LENGTH:
        shape_q, shape_k = ops.shape(query), ops.shape(key)
        long = ops.logical_and(
            ops.greater_equal(shape_k[1], switch_over_length(query.dtype)),
            ops.greater(shape_q[1], 1),
        )
        # Two one-sided conditionals, not one with a branch per path: the
        # gradient of a TensorFlow conditional makes it output each branch's
        # intermediates as optionals paired by position, whatever their
        # dtypes, and TensorFlow's type inference then logs "Type inference
        # failed. This indicates an invalid graph that escaped type checking"
        # at the first training step (tensorflow/tensorflow#57052). Beside a
        # branch of zeros, which keeps none, no such pair forms; the sum adds
        # exact zeros to the outputs of the path taken.
        if in_serving_mode():  # no gradient: one conditional, no zeros to add
            return ops.cond(long, memory_efficient, lambda: explicit()[0])
        output_shape = (*ops.shape(query)[:-1], ops.shape(value)[-1])

        def zeros():
            return ops.zeros(output_shape, value.dtype)  # (B, Tq, N, Hv)

        return ops.add(
            ops.cond(long, memory_efficient, zeros),
            ops.cond(long, zeros, lambda: explicit()[0]),
        )
    if path == FUSED and lengths_kernel:
        return _if_right_padded(form, with_lengths, without_lengths)
    if path == FUSED:
        return fused()
    outputs, weights = explicit()
    if return_weights:
        return outputs, weights
    return outputs


def _if_right_padded(form, with_lengths, without_lengths):
    """`with_lengths()` when the padding masks of `form` are right-padded,
    else `without_lengths()`: decided now for masks whose values are known,
    by a conditional when the program runs for traced ones."""
    paddings = [
        form[name]
        for name in ("key_padding_mask", "query_padding_mask")
        if form[name] is not None
    ]
    known = [concrete_right_padded(padding) for padding in paddings]
    if False in known:
        return without_lengths()
    traced = [
        padding
        for padding, is_known in zip(paddings, known, strict=True)
        if is_known is None
    ]
    if not traced:
        return with_lengths()
    condition = right_padded(traced[0])
    for padding in traced[1:]:
        condition = ops.logical_and(condition, right_padded(padding))
    return ops.cond(condition, with_lengths, without_lengths)


def _whole_sequence_axes(mask, query, key, components):
    """`(mask, components)` for the memory-efficient path, whose blocks read an
    explicit mask `(B|1, N|1, Tq, Tk)` with both sequence axes whole: a
    `(B|1, 1, 1, Tk)` mask goes in as key padding, a `(B|1, 1, Tq, 1)` one as
    query padding (no `(Tq, Tk)` tensor), any other mask broadcast along a
    sequence axis of size 1 is broadcast to `(Tq, Tk)`."""
    if mask is None or (mask.shape[2] != 1 and mask.shape[3] != 1):
        return mask, components
    batch = ops.shape(query)[0]
    query_length, key_length = ops.shape(query)[1], ops.shape(key)[1]
    components = dict(components)
    if mask.shape[1] == 1 and mask.shape[2] == 1:
        keys = ops.broadcast_to(mask[:, 0, 0, :], (batch, key_length))  # (B, Tk)
        components["key_padding_mask"] = combine_masks(
            components["key_padding_mask"], keys
        )
        return None, components
    if mask.shape[1] == 1 and mask.shape[3] == 1:
        queries = ops.broadcast_to(mask[:, 0, :, 0], (batch, query_length))  # (B, Tq)
        components["query_padding_mask"] = combine_masks(
            components["query_padding_mask"], queries
        )
        return None, components
    shape = ops.shape(mask)
    return (
        ops.broadcast_to(mask, (shape[0], shape[1], query_length, key_length)),
        components,
    )


def _combined(query, key, mask, components):
    """The call's masks combined into one `(B|1, N|1, Tq, Tk)` mask, or `None`:
    the AND of `mask`, the key and query padding, the causal mask and the
    sliding window (with the offset)."""
    query_length, key_length = ops.shape(query)[1], ops.shape(key)[1]
    band = band_mask(
        query_length,
        key_length,
        components["causal"],
        components["sliding_window"],
        components["causal_offset"],
    )  # (Tq, Tk) or None
    key_padding = components["key_padding_mask"]
    query_padding = components["query_padding_mask"]
    return combine_masks(
        mask,
        None if key_padding is None else key_padding[:, None, None, :],
        None if query_padding is None else query_padding[:, None, :, None],
        None if band is None else band[None, None],
    )


def _explicit_attention(
    query,
    key,
    value,
    mask,
    scale,
    dropout_rate,
    seed_generator,
    groups=1,
    alibi=None,
):
    """The explicit path: `(outputs (B, Tq, N, Hv), weights (B, N, Tq, Tk))`.

    With `groups > 1` (keys and values of `K = N / groups` heads) each key
    head multiplies its group of query heads at once: the group's queries are
    stacked along the query axis, `(B, K, G·Tq, H) x (B, K, H, Tk)`.

    `alibi`: `None` or `(slopes, causal_offset)`, float32 slopes `(N,)` of
    the query heads; their bias is added to the logits in float32."""
    logits_dtype = (
        "float32"
        if keras.backend.standardize_dtype(query.dtype) == "float16"
        else query.dtype
    )
    # Batched matmuls over (B, N, T, H): the heads move next to the batch
    # once, and the backward pass transposes no (Tq, Tk) tensor.
    key_length = ops.shape(key)[1]
    query = _swap_axes_1_2(ops.cast(query, logits_dtype))  # (B, N, Tq, H)
    if not (isinstance(scale, numbers.Number) and scale == 1.0):
        query = ops.multiply(query, ops.cast(scale, logits_dtype))
    if query.shape[2] == 1:
        # A decoding step: the cached keys move as the values do and the
        # product reads them transposed (`_matmul_transposed`).
        key = _swap_axes_1_2(ops.cast(key, logits_dtype))  # (B, K, Tk, H)
        logits = _matmul_transposed(_group_heads(query, groups), key)
    else:
        key = transpose(ops.cast(key, logits_dtype), (0, 2, 3, 1))  # (B, K, H, Tk)
        logits = ops.matmul(_group_heads(query, groups), key)  # (B, K, G·Tq, Tk)
    logits = _ungroup_heads(logits, groups, ops.shape(query)[2])  # (B, N, Tq, Tk)
    if alibi is not None:
        slopes, offset = alibi
        query_positions = ops.arange(ops.shape(query)[2], dtype="int32") + ops.cast(
            offset, "int32"
        )  # (Tq,)
        key_positions = ops.arange(key_length, dtype="int32")  # (Tk,)
        # float32 (bfloat16 logits would round the bias of distant keys).
        logits = (
            ops.cast(logits, "float32")
            + alibi_bias(slopes, key_positions, query_positions)[None]
        )  # (B, N, Tq, Tk)
    weights = masked_softmax(logits, mask)  # float32 (B, N, Tq, Tk)
    weights = ops.cast(weights, value.dtype)
    attended = weights
    if dropout_rate > 0.0:
        attended = keras.random.dropout(weights, rate=dropout_rate, seed=seed_generator)
    value = transpose(value, (0, 2, 1, 3))  # (B, K, Tk, Hv)
    outputs = ops.matmul(_group_heads(attended, groups), value)  # (B, K, G·Tq, Hv)
    outputs = _ungroup_heads(outputs, groups, ops.shape(query)[2])  # (B, N, Tq, Hv)
    outputs = _swap_axes_1_2(outputs)  # (B, Tq, N, Hv)
    return outputs, weights


def _matmul_transposed(x, y):
    """`x @ swapaxes(y, -1, -2)`. On TensorFlow the product reads `y`
    transposed (`adjoint_b`): moving the cached keys' head width last,
    `(B, Tk, K, H)` to `(B, K, H, Tk)`, was the slowest transpose of a
    decoding step (a step with `(B, K, Tk, H)` and this product took about
    half the time with Eigen's kernels, as TF Serving's release builds run
    them; a training step's backward pass gained nothing, so longer queries
    keep the other layout)."""
    if keras.backend.backend() == "tensorflow" and not any(
        isinstance(t, keras.KerasTensor) for t in (x, y)
    ):
        import tensorflow as tf

        return tf.linalg.matmul(x, y, adjoint_b=True)
    return ops.matmul(x, ops.swapaxes(y, -1, -2))


def _swap_axes_1_2(x):
    """`x` `(B, A, C, H)` as `(B, C, A, H)`: a reshape, not a copy, when `A`
    or `C` is 1 (the query of one decoding step), which TensorFlow's
    transpose kernel would copy call after call."""
    a, c = x.shape[1], x.shape[2]
    if (a == 1 or c == 1) and None not in (a, c, x.shape[3]):
        return ops.reshape(x, (ops.shape(x)[0], c, a, x.shape[3]))
    return transpose(x, (0, 2, 1, 3))


def _group_heads(x, groups: int):
    """`(B, N, T, D)` -> `(B, K, G·T, D)`: the `G = groups` consecutive heads
    of each key head stacked along the time axis (nothing to do for G = 1)."""
    if groups == 1:
        return x
    shape = ops.shape(x)
    return ops.reshape(x, (shape[0], shape[1] // groups, groups * shape[2], shape[3]))


def _ungroup_heads(x, groups: int, length):
    """`(B, K, G·T, D)` -> `(B, N, T, D)`, the inverse of `_group_heads`."""
    if groups == 1:
        return x
    shape = ops.shape(x)
    return ops.reshape(x, (shape[0], shape[1] * groups, length, shape[3]))


def repeat_key_value_heads(x, groups: int):
    """`(B, T, K, H)` -> `(B, T, K·groups, H)`, each head repeated `groups`
    times in place (`keras.layers.GroupQueryAttention`'s pairing)."""
    return x if groups == 1 else ops.repeat(x, groups, axis=2)
