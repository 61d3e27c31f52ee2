"""keras_attn: attention layers for Keras 3.

Bahdanau and Luong attention, multi-head (self-)attention, position encodings
and Transformer blocks that compose into functional-API models, train with
mixed precision and export as SavedModels for TF Serving.
"""

from keras_attn import generation, layers, ops
from keras_attn.layers import (
    AttentionPooling,
    BahdanauAttention,
    LuongAttention,
    MultiHeadAttention,
    MultiHeadSelfAttention,
    PositionEmbedding,
    SinusoidalPositionEncoding,
    TokenAndPositionEmbedding,
    TransformerDecoderBlock,
    TransformerEncoderBlock,
)

__version__ = "0.1.0"

__all__ = [
    "AttentionPooling",
    "BahdanauAttention",
    "LuongAttention",
    "MultiHeadAttention",
    "MultiHeadSelfAttention",
    "PositionEmbedding",
    "SinusoidalPositionEncoding",
    "TokenAndPositionEmbedding",
    "TransformerDecoderBlock",
    "TransformerEncoderBlock",
    "__version__",
    "generation",
    "layers",
    "ops",
]
