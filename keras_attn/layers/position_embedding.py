"""`PositionEmbedding`: a learned embedding of each position."""

from __future__ import annotations

import keras
from keras import ops

from keras_attn import _validation as v


@keras.saving.register_keras_serializable(package="keras_attn")
class PositionEmbedding(keras.layers.Layer):
    """Learned position embedding (Gehring et al. 2017, Devlin et al. 2019).

    A trainable `(sequence_length, d)` table whose row `t` encodes position
    `t`; "Attention Is All You Need" (https://arxiv.org/abs/1706.03762)
    reports it works as well as the sinusoids, which extrapolate beyond the
    trained lengths and this table does not.

    Like `SinusoidalPositionEncoding` (and `keras_hub.layers.PositionEmbedding`,
    whose weight it shares in shape and name), the layer returns the position
    embedding shaped like its input; add it yourself.

    Args:
        sequence_length: the number of positions the table holds (the longest
            sequence, counting `start_index`).
        initializer: initializer of the table.
        **kwargs: base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        inputs: `(batch, T, d)`; only its shape is used.
        start_index: int or scalar int tensor, the position of the first step
            (cached decoding passes the index of the token being decoded).
            `start_index + T` must not pass `sequence_length` (checked when
            both are static; a tensor index past the end fails in TensorFlow
            and is clamped by JAX).
        positions: optional int tensor `(T,)` or `(batch, T)` of explicit
            positions; overrides `start_index`.

    Returns:
        The embedding of the positions, `(batch, T, d)` in the compute dtype.
        A Keras mask on `inputs` is passed on.

    Example:

    ```python
    tokens = keras.Input((None,), dtype="int32")
    x = keras.layers.Embedding(1000, 64)(tokens)
    x = x + keras_attn.layers.PositionEmbedding(sequence_length=128)(x)
    ```
    """

    def __init__(self, sequence_length: int, initializer="glorot_uniform", **kwargs):
        super().__init__(**kwargs)
        self.sequence_length = v.check_positive_int("sequence_length", sequence_length)
        self.initializer = keras.initializers.get(initializer)
        self.supports_masking = True

    def build(self, inputs_shape):
        v.check_rank("inputs", inputs_shape, 3)
        if inputs_shape[-1] is None:
            raise ValueError(
                "The last dimension of `inputs` must be known. "
                f"Received: inputs.shape={tuple(inputs_shape)}"
            )
        self.position_embeddings = self.add_weight(
            name="embeddings",
            shape=(self.sequence_length, inputs_shape[-1]),
            initializer=self.initializer,
            trainable=True,
        )
        self.built = True

    def call(self, inputs, start_index=0, positions=None):
        v.check_rank("inputs", inputs.shape, 3)
        shape = ops.shape(inputs)
        table = ops.cast(self.position_embeddings, self.compute_dtype)  # (L, d)
        if positions is not None:
            positions = ops.convert_to_tensor(positions)
            v.check_rank("positions", positions.shape, (1, 2))
            if len(positions.shape) == 1:
                positions = positions[None, :]  # (1, T)
            embedding = ops.take(table, ops.cast(positions, "int32"), axis=0)
        else:
            length = inputs.shape[1]
            if (
                length is not None
                and isinstance(start_index, int)
                and start_index + length > self.sequence_length
            ):
                raise ValueError(
                    "`start_index + T` must not exceed `sequence_length`. "
                    f"Received: start_index={start_index}, "
                    f"inputs.shape={tuple(inputs.shape)}, "
                    f"sequence_length={self.sequence_length}"
                )
            if not isinstance(start_index, int):
                start_index = ops.cast(start_index, "int32")
            embedding = ops.slice(table, (start_index, 0), (shape[1], table.shape[-1]))[
                None
            ]  # (1, T, d)
        return ops.broadcast_to(embedding, shape)  # (B, T, d)

    def compute_output_shape(self, inputs_shape):
        return tuple(inputs_shape)

    def compute_mask(self, inputs, mask=None):
        return mask

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "sequence_length": self.sequence_length,
                "initializer": keras.initializers.serialize(self.initializer),
            }
        )
        return config
