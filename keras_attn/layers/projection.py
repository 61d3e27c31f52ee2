"""The attention layers' projections: `project`, the TensorFlow fast path of
Keras's rank-3 head and output projections, and `grouped_projection`, a
projection to fewer key/value heads built as Keras's
`MultiHeadAttention.build` builds its own."""

from __future__ import annotations

import keras
from keras import ops

# Keras's equation builders (no public form), so that the grouped-query
# projections have Keras's equations, shapes and weights.
from keras.src.layers.attention.multi_head_attention import (
    _build_proj_equation,
    _get_output_shape,
)

# The einsum equations of Keras's rank-3 projections: (B, T, d) -> (B, T, N, H)
# and (B, T, N, H) -> (B, T, d_out).
HEAD_PROJECTION = "abc,cde->abde"
OUTPUT_PROJECTION = "abcd,cde->abe"


def project(dense, inputs, scale=None):
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
        or dense.equation not in (HEAD_PROJECTION, OUTPUT_PROJECTION)
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
    batch, length = ops.shape(inputs)[0], ops.shape(inputs)[1]
    if scale is not None:
        # (x W + b) s = x (W s) + b s: scaling the kernel (in float32) costs
        # one product per weight, scaling the outputs one per output; a
        # training batch has more outputs than the kernel has weights, one
        # served sentence far fewer (MiniLM: 6k outputs against 147k
        # weights). Each call scales the smaller.
        def scaled_kernel():
            kernel_s = ops.multiply(kernel, ops.cast(scale, kernel.dtype))
            bias_s = bias
            if bias is not None:
                bias_s = ops.multiply(bias, ops.cast(scale, bias.dtype))
            return _flat_projection(dense, inputs, kernel_s, bias_s, batch, length)

        def scaled_outputs():
            outputs = _flat_projection(dense, inputs, kernel, bias, batch, length)
            return ops.multiply(outputs, ops.cast(scale, outputs.dtype))

        rows, model_dim = batch * length, int(kernel.shape[0])
        if isinstance(rows, int):  # static shapes: decided at trace time
            return scaled_kernel() if rows >= model_dim else scaled_outputs()
        return ops.cond(rows >= model_dim, scaled_kernel, scaled_outputs)
    return _flat_projection(dense, inputs, kernel, bias, batch, length)


def _flat_projection(dense, inputs, kernel, bias, batch, length):
    """`project`'s TensorFlow fast path: one `(B*T, d) x (d, N*H)` matmul."""
    dtype = dense.compute_dtype
    kernel = ops.cast(kernel, dtype)
    if dense.equation == HEAD_PROJECTION:
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


def grouped_projection(
    shape,
    heads: int,
    dim: int,
    name: str,
    use_bias: bool,
    common_kwargs,
    activation=None,
):
    """A built `EinsumDense` from inputs of `shape` to `heads` heads of size
    `dim` with Keras's equation, bias axes and output shape (as Keras's
    `MultiHeadAttention.build` makes its projections), and the rank of its
    outputs. `common_kwargs`: the layer's `_get_common_kwargs_for_sublayer()`."""
    equation, bias_axes, rank = _build_proj_equation(
        len(shape) - 1, bound_dims=1, output_dims=2
    )
    dense = keras.layers.EinsumDense(
        equation,
        output_shape=_get_output_shape(rank - 1, [heads, dim]),
        bias_axes=bias_axes if use_bias else None,
        activation=activation,
        name=name,
        **common_kwargs,
    )
    dense.build(shape)
    return dense, rank
