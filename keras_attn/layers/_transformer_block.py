"""What the Transformer encoder and decoder blocks share.

`TransformerBlockBase` validates the common arguments, creates the residual
sublayers (layer norms, dropouts, the position-wise feed-forward network) and
writes the residual equations once:

    post-norm (Vaswani et al.):  x = LayerNorm(x + Dropout(Sublayer(x)))
    pre-norm (normalize_first):  x = x + Dropout(Sublayer(LayerNorm(x)))

The structure is keras-hub's: the sublayers have the names, the creation
order and the (private) attribute names of `keras_hub.layers.TransformerEncoder`
and `TransformerDecoder`, and the block classes are named as keras-hub's, so
that weights copy by `set_weights(get_weights())` and `.weights.h5` files load
both ways (Keras's saver names a sublayer's group after the attribute that
holds it, and a layer inside a functional model after its class name). A
block has no public attribute that holds a sublayer: the saver would name the
group after it.

The classes that read `.keras` files saved before that structure are in
`keras_attn._compat_0_2`.
"""

from __future__ import annotations

import numbers

import keras
from keras import ops

from keras_attn import _validation as v
from keras_attn.layers import padding_rows
from keras_attn.layers._policies import with_quantized_policies
from keras_attn.layers.alibi_bias import AlibiBias
from keras_attn.layers.rotary_embedding import RotaryEmbedding
from keras_attn.ops.attention import check_flash_attention
from keras_attn.ops.serving import in_serving_mode

# The blocks' `position`: "rotary" and "alibi" act inside the self-attention;
# "sinusoidal" and "learned" name absolute positions added to the embeddings
# before the first block (the block itself adds nothing), as `None` does.
POSITIONS = (None, "rotary", "alibi", "sinusoidal", "learned")


def clone_initializer(initializer):
    """A fresh initializer with the same config, so that seeded initializers do
    not give every sublayer the same weights."""
    initializer = keras.initializers.get(initializer)
    return initializer.__class__.from_config(initializer.get_config())


class TransformerBlockBase(keras.layers.Layer):
    """Base of `TransformerEncoder` and `TransformerDecoder`."""

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
        num_key_value_heads: int | None = None,
        position: str | None = None,
        sliding_window: int | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.position = v.check_choice("position", position, POSITIONS)
        self.sliding_window = v.check_positive_int(
            "sliding_window", sliding_window, allow_none=True
        )
        self.intermediate_dim = v.check_positive_int(
            "intermediate_dim", intermediate_dim
        )
        self.num_heads = v.check_positive_int("num_heads", num_heads)
        self.num_key_value_heads = v.check_positive_int(
            "num_key_value_heads", num_key_value_heads, allow_none=True
        )
        if self.num_key_value_heads and num_heads % self.num_key_value_heads:
            raise ValueError(
                "`num_heads` must be divisible by `num_key_value_heads`. "
                f"Received: num_heads={num_heads}, "
                f"num_key_value_heads={num_key_value_heads}"
            )
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

    def _attention_kwargs(self, self_attention: bool = False) -> dict:
        """The attention layers' arguments; the positions inside the
        attention (`position="rotary"` / `"alibi"`) and `sliding_window` go
        to the self-attention only."""
        positions = {}
        if self_attention:
            if self.position == "rotary":
                positions["rotary_embedding"] = RotaryEmbedding(
                    dtype=self.dtype_policy, name="rotary_embedding"
                )
            elif self.position == "alibi":
                positions["alibi_bias"] = AlibiBias(
                    dtype=self.dtype_policy, name="alibi_bias"
                )
            if self.sliding_window is not None:
                positions["sliding_window"] = self.sliding_window
        return (
            positions
            | {
                "num_heads": self.num_heads,
                "dropout": self.attention_dropout_rate,
                "flash_attention": self.flash_attention,
                "kernel_initializer": clone_initializer(self.kernel_initializer),
                "bias_initializer": clone_initializer(self.bias_initializer),
                "seed": self._next_seed(),
                "dtype": self.dtype_policy,
            }
            | (
                {}
                if self.num_key_value_heads is None
                else {"num_key_value_heads": self.num_key_value_heads}
            )
        )

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
        """The two position-wise dense layers `max(0, x W1 + b1) W2 + b2`.

        The block creates the feed-forward layer norm and dropout itself, in
        keras-hub's order (the encoder's norm before the dense layers, the
        decoder's after them).
        """
        model_dim = shape[-1]
        self._feedforward_intermediate_dense = keras.layers.Dense(
            self.intermediate_dim,
            activation=self.activation,
            kernel_initializer=clone_initializer(self.kernel_initializer),
            bias_initializer=clone_initializer(self.bias_initializer),
            dtype=self.dtype_policy,
            name="feedforward_intermediate_dense",
        )
        self._feedforward_intermediate_dense.build(shape)
        self._feedforward_output_dense = keras.layers.Dense(
            model_dim,
            kernel_initializer=clone_initializer(self.kernel_initializer),
            bias_initializer=clone_initializer(self.bias_initializer),
            dtype=self.dtype_policy,
            name="feedforward_output_dense",
        )
        self._feedforward_output_dense.build(
            (*tuple(shape)[:-1], self.intermediate_dim)
        )

    # -- the residual equations ------------------------------------------------

    def _pre(self, x, norm):
        """The sublayer's input: `x`, or `LayerNorm(x)` with `normalize_first`."""
        return _normalize(norm, x) if self.normalize_first else x

    def _post(self, residual, sublayer_output, norm, dropout, training):
        """`residual + Dropout(sublayer_output)`, normalized in post-norm."""
        x = ops.add(residual, dropout(sublayer_output, training=training))
        return x if self.normalize_first else _normalize(norm, x)

    def _feed_forward_block(self, x, training):
        hidden = self._feedforward_intermediate_dense(
            self._pre(x, self._feedforward_layer_norm)
        )  # (B, T, intermediate_dim)
        return self._post(
            x,
            self._feedforward_output_dense(hidden),
            self._feedforward_layer_norm,
            self._feedforward_dropout,
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
        # Only when set (keras-hub's blocks take `num_key_value_heads`, and
        # none of the three: their configs stay loadable there).
        for name in ("num_key_value_heads", "position", "sliding_window"):
            if getattr(self, name) is not None:
                config[name] = getattr(self, name)
        # Quantized sublayers keep their policies through save/load.
        return with_quantized_policies(self, config)


def _normalize(norm, x):
    """`norm(x)`; in serving mode, real tokens' rows `(R, d)` (the only
    rank-2 inputs a block's sublayers get) take `padding_rows.layer_norm`."""
    if len(x.shape) == 2 and in_serving_mode():
        return padding_rows.layer_norm(norm, x)
    return norm(x)
