"""Public Keras layers of keras_attn."""

from keras_attn.layers.alibi_bias import AlibiBias
from keras_attn.layers.attention_pooling import AttentionPooling
from keras_attn.layers.bahdanau_attention import BahdanauAttention
from keras_attn.layers.bahdanau_decoder import BahdanauDecoder
from keras_attn.layers.base_attention import BaseAttention
from keras_attn.layers.grouped_query_attention import GroupedQueryAttention
from keras_attn.layers.luong_attention import LuongAttention
from keras_attn.layers.multi_head_attention import MultiHeadAttention
from keras_attn.layers.multi_head_self_attention import MultiHeadSelfAttention
from keras_attn.layers.position_embedding import PositionEmbedding
from keras_attn.layers.rotary_embedding import RotaryEmbedding
from keras_attn.layers.sinusoidal_position_encoding import SinusoidalPositionEncoding
from keras_attn.layers.token_and_position_embedding import TokenAndPositionEmbedding
from keras_attn.layers.transformer_decoder_block import (
    TransformerDecoder,
    TransformerDecoderBlock,
)
from keras_attn.layers.transformer_encoder_block import (
    TransformerEncoder,
    TransformerEncoderBlock,
)
from keras_attn.ops.serving import serving_mode

# Registers the classes that read the blocks of files saved by keras-attn 0.2.
from keras_attn import _compat_0_2  # noqa: F401  isort: skip

__all__ = [
    "AlibiBias",
    "AttentionPooling",
    "BahdanauAttention",
    "BahdanauDecoder",
    "BaseAttention",
    "GroupedQueryAttention",
    "LuongAttention",
    "MultiHeadAttention",
    "MultiHeadSelfAttention",
    "PositionEmbedding",
    "RotaryEmbedding",
    "SinusoidalPositionEncoding",
    "TokenAndPositionEmbedding",
    "TransformerDecoder",
    "TransformerDecoderBlock",
    "TransformerEncoder",
    "TransformerEncoderBlock",
    "serving_mode",
]
