"""What the Transformer encoder and decoder blocks share.

`TransformerBlockBase` validates the common arguments, creates the residual
sublayers (layer norms, dropouts, the position-wise feed-forward network) and
writes the residual equations once:

    post-norm (Vaswani et al.):  x = LayerNorm(x + Dropout(Sublayer(x)))
    pre-norm (normalize_first):  x = x + Dropout(Sublayer(LayerNorm(x)))

Sublayer names and creation order follow `keras_hub.layers.TransformerEncoder`
and `TransformerDecoder`, so weights copy between the two by
`set_weights(get_weights())`.
"""

from __future__ import annotations

import numbers

import keras
from keras import ops

from keras_attn import _validation as v
from keras_attn.layers._policies import with_quantized_policies
from keras_attn.ops.attention import check_flash_attention


def clone_initializer(initializer):
    """A fresh initializer with the same config, so that seeded initializers do
    not give every sublayer the same weights."""
    initializer = keras.initializers.get(initializer)
    return initializer.__class__.from_config(initializer.get_config())


class TransformerBlockBase(keras.layers.Layer):
    """Base of `TransformerEncoderBlock` and `TransformerDecoderBlock`."""

    def __init__(
        self,
        intermediate_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        activation="relu",
        layer_norm_epsilon: float = 1e-5,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        normalize_first: bool = False,
        *,
        key_dim: int | None = None,
        attention_dropout: float | None = None,
        flash_attention: bool | None = None,
        seed: int | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.intermediate_dim = v.check_positive_int(
            "intermediate_dim", intermediate_dim
        )
        self.num_heads = v.check_positive_int("num_heads", num_heads)
        self.dropout = v.check_rate("dropout", dropout)
        self.attention_dropout = (
            None
            if attention_dropout is None
            else v.check_rate("attention_dropout", attention_dropout)
        )
        self.flash_attention = check_flash_attention(
            flash_attention, self.attention_dropout_rate
        )
        try:
            self.activation = keras.activations.get(activation)
        except (ValueError, TypeError) as error:
            raise ValueError(
                "`activation` must be a Keras activation (name, function or "
                f"config). Received: activation={activation!r}"
            ) from error
        if not isinstance(normalize_first, bool):
            raise ValueError(
                "`normalize_first` must be a bool. "
                f"Received: normalize_first={normalize_first!r}"
            )
        self.normalize_first = normalize_first
        if (
            isinstance(layer_norm_epsilon, bool)
            or not isinstance(layer_norm_epsilon, numbers.Real)
            or not layer_norm_epsilon > 0
        ):
            raise ValueError(
                "`layer_norm_epsilon` must be a positive number. "
                f"Received: layer_norm_epsilon={layer_norm_epsilon!r}"
            )
        self.layer_norm_epsilon = float(layer_norm_epsilon)
        self.key_dim = v.check_positive_int("key_dim", key_dim, allow_none=True)
        self.kernel_initializer = v.get_keras_object(
            "kernel_initializer", kernel_initializer, "initializer"
        )
        self.bias_initializer = v.get_keras_object(
            "bias_initializer", bias_initializer, "initializer"
        )
        if seed is not None and not v.is_int(seed):
            raise ValueError(f"`seed` must be an int or None. Received: seed={seed!r}")
        self.seed = seed
        self._seed_offset = 0
        self.supports_masking = True

    # -- sublayer factories (used in build) ------------------------------------

    @property
    def attention_dropout_rate(self) -> float:
        return (
            self.dropout if self.attention_dropout is None else self.attention_dropout
        )

    def _next_seed(self):
        if self.seed is None:
            return None
        self._seed_offset += 1
        return self.seed + self._seed_offset

    def _check_model_dim(self, name, shape):
        v.check_rank(name, shape, 3)
        model_dim = shape[-1]
        if model_dim is None:
            raise ValueError(
                f"The last dimension of `{name}` must be known. "
                f"Received: {name}.shape={tuple(shape)}"
            )
        if self.key_dim is None and model_dim % self.num_heads:
            raise ValueError(
                "`num_heads` must divide the model dimension when `key_dim` is "
                f"None. Received: num_heads={self.num_heads}, "
                f"{name}.shape={tuple(shape)}"
            )
        return model_dim

    def _head_dim(self, model_dim: int) -> int:
        return self.key_dim or model_dim // self.num_heads

    def _attention_kwargs(self) -> dict:
        return {
            "num_heads": self.num_heads,
            "dropout": self.attention_dropout_rate,
            "flash_attention": self.flash_attention,
            "kernel_initializer": clone_initializer(self.kernel_initializer),
            "bias_initializer": clone_initializer(self.bias_initializer),
            "seed": self._next_seed(),
            "dtype": self.dtype_policy,
        }

    def _layer_norm(self, name: str, shape):
        layer = keras.layers.LayerNormalization(
            epsilon=self.layer_norm_epsilon, dtype=self.dtype_policy, name=name
        )
        layer.build(shape)
        return layer

    def _dropout(self, name: str):
        return keras.layers.Dropout(
            rate=self.dropout,
            seed=self._next_seed(),
            dtype=self.dtype_policy,
            name=name,
        )

    def _build_feed_forward(self, shape):
        """The two position-wise dense layers `max(0, x W1 + b1) W2 + b2`."""
        model_dim = shape[-1]
        self.feedforward_intermediate_dense = keras.layers.Dense(
            self.intermediate_dim,
            activation=self.activation,
            kernel_initializer=clone_initializer(self.kernel_initializer),
            bias_initializer=clone_initializer(self.bias_initializer),
            dtype=self.dtype_policy,
            name="feedforward_intermediate_dense",
        )
        self.feedforward_intermediate_dense.build(shape)
        self.feedforward_output_dense = keras.layers.Dense(
            model_dim,
            kernel_initializer=clone_initializer(self.kernel_initializer),
            bias_initializer=clone_initializer(self.bias_initializer),
            dtype=self.dtype_policy,
            name="feedforward_output_dense",
        )
        self.feedforward_output_dense.build((*tuple(shape)[:-1], self.intermediate_dim))
        self.feedforward_dropout = self._dropout("feedforward_dropout")

    # -- the residual equations ------------------------------------------------

    def _pre(self, x, norm):
        """The sublayer's input: `x`, or `LayerNorm(x)` with `normalize_first`."""
        return norm(x) if self.normalize_first else x

    def _post(self, residual, sublayer_output, norm, dropout, training):
        """`residual + Dropout(sublayer_output)`, normalized in post-norm."""
        x = ops.add(residual, dropout(sublayer_output, training=training))
        return x if self.normalize_first else norm(x)

    def _feed_forward_block(self, x, training):
        hidden = self.feedforward_intermediate_dense(
            self._pre(x, self.feedforward_layer_norm)
        )  # (B, T, intermediate_dim)
        return self._post(
            x,
            self.feedforward_output_dense(hidden),
            self.feedforward_layer_norm,
            self.feedforward_dropout,
            training,
        )

    # -- Keras anatomy ---------------------------------------------------------

    def compute_mask(self, inputs, mask=None):
        return mask

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "intermediate_dim": self.intermediate_dim,
                "num_heads": self.num_heads,
                "dropout": self.dropout,
                "activation": keras.activations.serialize(self.activation),
                "layer_norm_epsilon": self.layer_norm_epsilon,
                "kernel_initializer": keras.initializers.serialize(
                    self.kernel_initializer
                ),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer),
                "normalize_first": self.normalize_first,
                "key_dim": self.key_dim,
                "attention_dropout": self.attention_dropout,
                "flash_attention": self.flash_attention,
                "seed": self.seed,
            }
        )
        # Quantized sublayers keep their policies through save/load.
        return with_quantized_policies(self, config)
