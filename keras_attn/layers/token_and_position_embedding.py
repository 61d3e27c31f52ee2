"""`TokenAndPositionEmbedding`: token embedding plus a position encoding."""

from __future__ import annotations

import math
import numbers

import keras
from keras import ops

from keras_attn import _validation as v
from keras_attn.layers.position_embedding import PositionEmbedding
from keras_attn.layers.sinusoidal_position_encoding import SinusoidalPositionEncoding

POSITION_KINDS = ("learned", "sinusoidal", None)


def _clone_initializer(initializer):
    """A fresh copy of a Keras initializer object (as keras-hub does): an
    unseeded initializer draws its seed once, when made, so the token and
    position tables would otherwise start from the same random numbers."""
    if not isinstance(initializer, keras.initializers.Initializer):
        return initializer
    return initializer.__class__.from_config(initializer.get_config())


def _weight_only_int4_reverse(embedding):
    """Make a `ReversibleEmbedding` built int4 from its dtype policy (a
    saved quantized model loading) project `reverse=True` as the one
    `quantize("int4")` made: weight-only, its inputs not quantized.

    Keras 3.15's `quantize("int4")` resolves its config to
    `Int4QuantizationConfig()`, whose activation quantizer is None, so the
    reverse projection (the tied output logits) multiplies float inputs by
    the dequantized table. Built from an int4 policy instead (no config: the
    layer's `DTypePolicyMap` entry is all a saved model records),
    `ReversibleEmbedding._int4_build` falls back to quantizing the inputs
    with `AbsMaxQuantizer(axis=-1)` (Dense and EinsumDense fall back to
    None, as the config does), so a saved and loaded int4 language model's
    logits moved by up to 0.7% of the largest logit in a small model.
    Setting `inputs_quantizer` as the default config sets it makes the two
    the same (the loaded model answers exactly as the quantized one). A
    layer given a `quantization_config` keeps what that config says. See
    docs/KERAS_PRIVATE_API.md."""
    if (
        embedding.quantization_mode == "int4"
        and embedding.quantization_config is None
        and getattr(embedding, "inputs_quantizer", None) is not None
    ):
        embedding.inputs_quantizer = None


def reverse_table(embedding):
    """The `(d, V)` table of a tied `keras.layers.ReversibleEmbedding`
    transposed once by the innermost stateless scope, when that scope lays
    it out (a decoding's `keras_attn.generation.WeightsReadOnce` on
    TensorFlow: its `reverse_table`), else None."""
    from keras.src.backend.common import global_state

    scope = global_state.get_global_attribute("stateless_scope")
    lookup = getattr(scope, "reverse_table", None)
    return None if lookup is None else lookup(embedding)


@keras.saving.register_keras_serializable(package="keras_attn")
class TokenAndPositionEmbedding(keras.layers.Layer):
    """Token embedding plus position embedding, the input of a Transformer.

    A drop-in for `keras_hub.layers.TokenAndPositionEmbedding`: the same
    arguments in the same order with the same defaults, the same call, the
    same sublayers (`token_embedding`, a `keras.layers.ReversibleEmbedding`,
    and `position_embedding`, a learned `PositionEmbedding`) and variables,
    so keras-hub's weight files load into it and the other way round.

    What keras-attn adds, all keyword-only: the sinusoidal encoding of
    "Attention Is All You Need" (https://arxiv.org/abs/1706.03762, section
    3.5) instead of the learned table (`position="sinusoidal"`);
    `scale_embeddings=True`, which multiplies the token embeddings by
    `sqrt(embedding_dim)` as the paper does (section 3.4); a separate
    `position_initializer`; and `reverse=True` on the layer itself.

    With `mask_zero=True` token id 0 is padding: the layer's Keras mask
    `(batch, T)` (`True` for real tokens) flows on to the attention layers and
    blocks downstream, in the functional API too.

    Args:
        vocabulary_size: number of token ids (id 0 included).
        sequence_length: the longest sequence (counting `start_index`); the
            size of the learned table, and a bound checked on static shapes
            for the sinusoids (`None` allowed there: no bound).
        embedding_dim: size of the embeddings.
        tie_weights: whether the `reverse` projection onto the vocabulary uses
            the token embedding matrix (`True`) or a separate
            `(embedding_dim, vocabulary_size)` matrix.
        embeddings_initializer: initializer of the token embeddings (and of
            the learned position table unless `position_initializer` is
            given).
        mask_zero: whether token id 0 is padding.
        position: keyword-only, `"learned"` (keras-hub's), `"sinusoidal"`
            (the paper's fixed encoding, no weights) or `None`: token
            embeddings alone, for blocks whose attention places the tokens
            (rotary positions or ALiBi, `position="rotary"` / `"alibi"` on
            the blocks); `start_index` and `positions` are then ignored.
        scale_embeddings: keyword-only, multiply the token embeddings by
            `sqrt(embedding_dim)`; suits an initializer of standard deviation
            `embedding_dim ** -0.5`.
        position_initializer: keyword-only, initializer of the learned
            position table; `None` uses a copy of `embeddings_initializer`.
        max_wavelength: keyword-only, the `10000` of the sinusoids.
        **kwargs: base layer arguments (`name`, `dtype`, `trainable`, ...).

    Call arguments:
        inputs: int tensor `(batch, T)` of token ids; with `reverse=True`,
            hidden states `(batch, T, embedding_dim)`.
        start_index: int or scalar int tensor, the position of the first token
            (cached decoding passes the index of the token being decoded).
        positions: optional int tensor `(T,)` or `(batch, T)` of explicit
            positions; overrides `start_index`.
        reverse: keyword, project hidden states onto the vocabulary instead,
            the same as `layer.token_embedding(hidden, reverse=True)`
            (`logits = hidden · Eᵀ` with tied weights, the pre-softmax
            projection of the paper, section 3.4).

    Returns:
        `(batch, T, embedding_dim)` in the compute dtype, with the padding
        mask attached as its Keras mask when `mask_zero=True`; with
        `reverse=True`, logits `(batch, T, vocabulary_size)` in the compute
        dtype (cast them to float32 for the loss), with the hidden states'
        Keras mask.

    Example:

    ```python
    tokens = keras.Input((None,), dtype="int32")
    embedding = keras_attn.layers.TokenAndPositionEmbedding(
        vocabulary_size=8000, sequence_length=256, embedding_dim=128
    )  # keras-hub's layer: learned positions, no padding mask
    x = embedding(tokens)  # (batch, T, 128)
    logits = embedding.token_embedding(x, reverse=True)  # (batch, T, 8000)

    # The paper's sinusoids, id 0 as padding (masked downstream).
    x = keras_attn.layers.TokenAndPositionEmbedding(
        8000, 256, 128, mask_zero=True, position="sinusoidal"
    )(tokens)
    ```
    """

    def __init__(
        self,
        vocabulary_size: int,
        sequence_length: int | None,
        embedding_dim: int,
        tie_weights: bool = True,
        embeddings_initializer="uniform",
        mask_zero: bool = False,
        *,
        position: str = "learned",
        scale_embeddings: bool = False,
        position_initializer=None,
        max_wavelength: float = 10000,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.vocabulary_size = v.check_positive_int("vocabulary_size", vocabulary_size)
        self.position = v.check_choice("position", position, POSITION_KINDS)
        self.sequence_length = v.check_positive_int(
            "sequence_length", sequence_length, allow_none=position != "learned"
        )
        self.embedding_dim = v.check_positive_int("embedding_dim", embedding_dim)
        for name, value in (
            ("tie_weights", tie_weights),
            ("mask_zero", mask_zero),
            ("scale_embeddings", scale_embeddings),
        ):
            if not isinstance(value, bool):
                raise ValueError(f"`{name}` must be a bool. Received: {name}={value!r}")
        if (
            isinstance(max_wavelength, bool)
            or not isinstance(max_wavelength, numbers.Real)
            or not max_wavelength > 0
        ):
            raise ValueError(
                "`max_wavelength` must be a positive number. "
                f"Received: max_wavelength={max_wavelength!r}"
            )
        self.tie_weights = tie_weights
        self.mask_zero = mask_zero
        self.scale_embeddings = scale_embeddings
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.position_initializer = (
            None
            if position_initializer is None
            else keras.initializers.get(position_initializer)
        )
        self.max_wavelength = max_wavelength
        self.supports_masking = True

        self.token_embedding = keras.layers.ReversibleEmbedding(
            self.vocabulary_size,
            self.embedding_dim,
            tie_weights=tie_weights,
            embeddings_initializer=self.embeddings_initializer,
            mask_zero=mask_zero,
            dtype=self.dtype_policy,
            # A layer built frozen (`trainable=False`) freezes its tables.
            trainable=self.trainable,
            name="token_embedding",
        )
        if position == "learned":
            self.position_embedding = PositionEmbedding(
                self.sequence_length,
                initializer=(
                    _clone_initializer(self.embeddings_initializer)
                    if self.position_initializer is None
                    else self.position_initializer
                ),
                dtype=self.dtype_policy,
                trainable=self.trainable,
                name="position_embedding",
            )
        elif position is None:
            self.position_embedding = None
        else:
            self.position_embedding = SinusoidalPositionEncoding(
                max_wavelength=max_wavelength,
                dtype=self.dtype_policy,
                name="position_embedding",
            )

    def build(self, inputs_shape):
        v.check_rank("inputs", inputs_shape, (2, 3))
        ids_shape = tuple(inputs_shape)[:2]  # a rank-3 first call is `reverse`
        self.token_embedding.build(ids_shape)
        _weight_only_int4_reverse(self.token_embedding)
        if self.position_embedding is not None:
            self.position_embedding.build((*ids_shape, self.embedding_dim))
        self.built = True

    def call(self, inputs, start_index=0, positions=None, reverse=False):
        if reverse:
            self._check_hidden(inputs.shape)
            # Inside a decoding's `WeightsReadOnce` on TensorFlow: the table
            # transposed once per call, not folded into every step's product.
            table = reverse_table(self.token_embedding)
            if table is not None:
                return ops.matmul(inputs, table)
            # `(B, T, d) -> (B, T, V)`; a copy without the Keras mask, which
            # the embedding would drop with a warning (`compute_mask` passes
            # it on instead).
            return self.token_embedding(ops.copy(inputs), reverse=True)
        v.check_rank("inputs", inputs.shape, 2)
        length = inputs.shape[1]
        if (
            self.sequence_length is not None
            and self.position_embedding is not None
            and positions is None
            and length is not None
            and isinstance(start_index, int)
            and start_index + length > self.sequence_length
        ):
            raise ValueError(
                "`start_index + T` must not exceed `sequence_length`. "
                f"Received: start_index={start_index}, "
                f"inputs.shape={tuple(inputs.shape)}, "
                f"sequence_length={self.sequence_length}"
            )
        embedded = self.token_embedding(inputs)  # (B, T, d)
        if self.scale_embeddings:
            embedded = ops.multiply(
                embedded,
                ops.cast(math.sqrt(self.embedding_dim), embedded.dtype),
            )
        if self.position_embedding is None:
            return embedded
        encoded = self.position_embedding(
            embedded, start_index=start_index, positions=positions
        )  # (B, T, d)
        return ops.add(embedded, encoded)

    def _check_hidden(self, shape):
        v.check_rank("inputs", shape, 3)
        if not v.same_dim(shape[-1], self.embedding_dim):
            raise ValueError(
                "With `reverse=True`, `inputs` must be hidden states of size "
                f"`embedding_dim={self.embedding_dim}`. "
                f"Received: inputs.shape={tuple(shape)}"
            )

    def compute_mask(self, inputs, mask=None):
        if not self.mask_zero or keras.backend.is_float_dtype(inputs.dtype):
            return mask  # `reverse`: the hidden states' mask goes on
        return ops.not_equal(inputs, 0)  # (B, T)

    def compute_output_shape(self, inputs_shape, reverse=False):
        if reverse:
            self._check_hidden(inputs_shape)
            return (*tuple(inputs_shape)[:-1], self.vocabulary_size)
        return (*tuple(inputs_shape), self.embedding_dim)

    def compute_output_spec(self, inputs, start_index=0, positions=None, reverse=False):
        if not reverse:
            v.check_rank("inputs", inputs.shape, 2)
        return keras.KerasTensor(
            self.compute_output_shape(inputs.shape, reverse=reverse),
            dtype=self.compute_dtype,
        )

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "vocabulary_size": self.vocabulary_size,
                "sequence_length": self.sequence_length,
                "embedding_dim": self.embedding_dim,
                "tie_weights": self.tie_weights,
                "embeddings_initializer": keras.initializers.serialize(
                    self.embeddings_initializer
                ),
                "mask_zero": self.mask_zero,
                "position": self.position,
                "scale_embeddings": self.scale_embeddings,
                "position_initializer": (
                    None
                    if self.position_initializer is None
                    else keras.initializers.serialize(self.position_initializer)
                ),
                "max_wavelength": self.max_wavelength,
            }
        )
        return config
