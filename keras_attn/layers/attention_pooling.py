"""`AttentionPooling`: a learned query attends over a sequence to summarise it."""

from __future__ import annotations

import keras
from keras import ops

from keras_attn import _validation as v
from keras_attn.ops.attention import weighted_sum
from keras_attn.ops.masks import padding_mask
from keras_attn.ops.softmax import masked_softmax


@keras.saving.register_keras_serializable(package="keras_attn")
class AttentionPooling(keras.layers.Layer):
    """Additive attention pooling with a learned context vector.

    From "Hierarchical Attention Networks for Document Classification" (Yang et
    al., 2016, https://aclanthology.org/N16-1174): `u_t = tanh(W h_t + b)`,
    `a_t = softmax_t(u_tᵀ u_w)`, `s = Σ_t a_t h_t`, where `u_w` is a learned
    query ("what makes a token informative"). It replaces average pooling in a
    classifier and says which tokens the decision rests on. Padded tokens get
    weight 0; a sequence with no valid token pools to zeros.

    Args:
        units: size of `W`, `b` and `u_w`.
        kernel_initializer: initializer of `W` and `u_w`.
        **kwargs: base layer arguments.

    Call arguments:
        inputs: `(batch, T, d)`.
        mask: boolean `(batch, T)`; filled from a Keras mask.
        return_attention_scores: also return the weights `(batch, T)`.

    Returns:
        `(batch, d)`, or `((batch, d), (batch, T))` with
        `return_attention_scores=True`.

    Example:

    ```python
    tokens = keras.Input((None,), dtype="int32")
    x = keras.layers.Embedding(1000, 64, mask_zero=True)(tokens)
    pooled = keras_attn.layers.AttentionPooling(units=64)(x)  # (batch, 64)
    ```
    """

    def __init__(self, units: int, kernel_initializer="glorot_uniform", **kwargs):
        super().__init__(**kwargs)
        self.units = v.check_positive_int("units", units)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.supports_masking = True

    def build(self, inputs_shape):
        v.check_rank("inputs", inputs_shape, 3)
        if inputs_shape[-1] is None:
            raise ValueError(
                "The last dimension of `inputs` must be known. "
                f"Received: inputs.shape={tuple(inputs_shape)}"
            )
        self.kernel = self.add_weight(
            name="kernel",
            shape=(inputs_shape[-1], self.units),
            initializer=self.kernel_initializer,
        )  # W
        self.bias = self.add_weight(
            name="bias", shape=(self.units,), initializer="zeros"
        )
        self.context = self.add_weight(
            name="context", shape=(self.units,), initializer="glorot_uniform"
        )  # u_w
        self.built = True

    def call(self, inputs, mask=None, return_attention_scores: bool = False):
        v.check_rank("inputs", inputs.shape, 3)
        v.check_mask_shape("mask", mask, tuple(inputs.shape[:2]))
        hidden = ops.tanh(
            ops.matmul(inputs, ops.cast(self.kernel, inputs.dtype))
            + ops.cast(self.bias, inputs.dtype)
        )  # (B, T, units)
        scores = ops.tensordot(hidden, ops.cast(self.context, inputs.dtype), axes=1)
        weights = masked_softmax(scores, padding_mask(mask))  # float32 (B, T)
        weights = ops.cast(weights, self.compute_dtype)
        pooled = weighted_sum(weights[:, None, :], inputs)[:, 0]  # (B, d)
        return (pooled, weights) if return_attention_scores else pooled

    def compute_output_shape(self, inputs_shape):
        return (inputs_shape[0], inputs_shape[-1])

    def compute_output_spec(self, inputs, mask=None, return_attention_scores=False):
        v.check_rank("inputs", inputs.shape, 3)
        v.check_mask_shape("mask", mask, tuple(inputs.shape[:2]))
        pooled = keras.KerasTensor(
            self.compute_output_shape(inputs.shape), dtype=self.compute_dtype
        )
        if not return_attention_scores:
            return pooled
        return pooled, keras.KerasTensor(
            tuple(inputs.shape[:2]), dtype=self.compute_dtype
        )

    def compute_mask(self, inputs, mask=None):
        return None

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "units": self.units,
                "kernel_initializer": keras.initializers.serialize(
                    self.kernel_initializer
                ),
            }
        )
        return config
