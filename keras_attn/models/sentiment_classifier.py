"""Attention-based sentence classifier (Transformer encoder + pooling)."""

from __future__ import annotations

import keras

from keras_attn import _validation as v
from keras_attn.layers.attention_pooling import AttentionPooling
from keras_attn.layers.token_and_position_embedding import TokenAndPositionEmbedding
from keras_attn.layers.transformer_encoder_block import TransformerEncoderBlock
from keras_attn.models._structure import stack_blocks

POOLINGS = ("mean", "attention")


def sentiment_classifier(
    vocabulary_size: int,
    sequence_length: int,
    embedding_dim: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_dim: int = 256,
    dropout: float = 0.1,
    pooling: str = "mean",
    position: str = "sinusoidal",
    normalize_first: bool = False,
    activation="relu",
    layer_norm_epsilon: float = 1e-5,
    embedding_norm: bool = False,
    name: str = "sentiment_classifier",
) -> keras.Model:
    """The attention-based sequence encoder of the lectures, with a sigmoid output.

    Token ids `(batch, T)` (0 = padding) -> token + position embedding ->
    `num_layers` `TransformerEncoderBlock`s (padding masked through the Keras
    mask) -> pooling over the unmasked positions (`"mean"`, or `"attention"`:
    `AttentionPooling`'s learned query) -> dropout -> `Dense(1, sigmoid)`.

    Output: `positive_probability` `(batch, 1)` in float32 (also under mixed
    precision). With `pooling="attention"`, `sentiment_token_weights(model)`
    gives the pooling weights of every token, for plots.

    Args:
        vocabulary_size: token ids are in `[0, vocabulary_size)`.
        sequence_length: the longest input (size of learned positions).
        embedding_dim, num_layers, num_heads, intermediate_dim, dropout:
            encoder sizes.
        pooling: `"mean"` or `"attention"`.
        position: `"sinusoidal"` or `"learned"`.
        normalize_first: pre-norm encoder blocks.
        activation: activation of the blocks' feed-forward networks.
        layer_norm_epsilon: epsilon of the layer norms.
        embedding_norm: normalize the embeddings (`LayerNormalization` named
            `embedding_norm`, before the embedding dropout), as BERT does.
            With `position="learned"`, `activation="gelu"` and
            `layer_norm_epsilon=1e-12` the model has BERT's layout, and
            `keras_attn.models.bert_sentiment_classifier` loads a pretrained
            BERT-style encoder into it.
        name: model name.
    """
    v.check_choice("pooling", pooling, POOLINGS)
    v.check_positive_int("num_layers", num_layers)
    v.check_rate("dropout", dropout)
    token_ids = keras.Input((None,), dtype="int32", name="token_ids")
    x = TokenAndPositionEmbedding(
        vocabulary_size,
        sequence_length,
        embedding_dim,
        position=position,
        mask_zero=True,
        name="embedding",
    )(token_ids)  # (B, T, d), Keras mask token_ids != 0
    if embedding_norm:
        x = keras.layers.LayerNormalization(
            epsilon=layer_norm_epsilon, name="embedding_norm"
        )(x)
    x = keras.layers.Dropout(dropout, name="embedding_dropout")(x)
    x = stack_blocks(
        x,
        TransformerEncoderBlock,
        num_layers,
        "encoder",
        num_heads=num_heads,
        intermediate_dim=intermediate_dim,
        dropout=dropout,
        normalize_first=normalize_first,
        final_norm_name="final_norm",
        activation=activation,
        layer_norm_epsilon=layer_norm_epsilon,
    )
    if pooling == "mean":
        pooled = keras.layers.GlobalAveragePooling1D(name="pooling")(x)  # masked mean
    else:
        pooled = AttentionPooling(embedding_dim, name="pooling")(x)
    pooled = keras.layers.Dropout(dropout, name="pooled_dropout")(pooled)
    probability = keras.layers.Dense(
        1, activation="sigmoid", dtype="float32", name="positive_probability"
    )(pooled)
    return keras.Model(token_ids, probability, name=name)


def sentiment_token_weights(model: keras.Model):
    """`token_weights(token_ids) -> (batch, T)` float32 attention-pooling weights.

    Uses the layers (and weights) of a `sentiment_classifier` built with
    `pooling="attention"`; shows which tokens a decision rests on. Padding
    tokens (id 0) get weight 0.
    """
    pooling = model.get_layer("pooling")
    if not isinstance(pooling, AttentionPooling):
        raise ValueError(
            "Token weights need a classifier built with pooling='attention'. "
            f"Received: a model whose pooling layer is {type(pooling).__name__}"
        )
    encoder = _model_up_to(model, pooling)  # the encoder output

    def token_weights(token_ids):
        token_ids = keras.ops.convert_to_tensor(token_ids, "int32")
        _, weights = pooling(
            encoder(token_ids),
            mask=keras.ops.not_equal(token_ids, 0),
            return_attention_scores=True,
        )
        return keras.ops.cast(weights, "float32")

    return token_weights


def sentiment_self_attention(model: keras.Model, layer: int = -1):
    """`self_attention(token_ids) -> (batch, heads, T, T)` float32 weights of
    one encoder block of a `sentiment_classifier` (`layer`: its index, the
    last by default), for plots of models without attention pooling.

    Row `i` holds how query token `i` spreads its attention over the tokens;
    padding tokens (id 0) get no attention, and their own rows are zeros.
    """
    count = sum(1 for item in model.layers if item.name.startswith("encoder_"))
    index = layer + count if layer < 0 else layer
    if not 0 <= index < count:
        raise ValueError(
            f"`layer` must index one of the model's {count} encoder blocks. "
            f"Received: layer={layer}"
        )
    block = model.get_layer(f"encoder_{index}")
    below = _model_up_to(model, block)

    def self_attention(token_ids):
        token_ids = keras.ops.convert_to_tensor(token_ids, "int32")
        _, weights = block(
            below(token_ids),
            padding_mask=keras.ops.not_equal(token_ids, 0),
            return_attention_scores=True,
        )
        return keras.ops.cast(weights, "float32")

    return self_attention


def _model_up_to(model: keras.Model, layer) -> keras.Model:
    """The part of `model` that computes `layer`'s (first) input."""
    sequence = layer.input  # with its mask too, if Keras filled one in
    if isinstance(sequence, (list, tuple)):
        sequence = sequence[0]
    return keras.Model(model.input, sequence)
