"""Public Keras layers of keras_attn."""

from keras_attn.layers.bahdanau_attention import BahdanauAttention
from keras_attn.layers.base_attention import BaseAttention
from keras_attn.layers.luong_attention import LuongAttention
from keras_attn.layers.multi_head_attention import MultiHeadAttention
from keras_attn.layers.multi_head_self_attention import MultiHeadSelfAttention

__all__ = [
    "BahdanauAttention",
    "BaseAttention",
    "LuongAttention",
    "MultiHeadAttention",
    "MultiHeadSelfAttention",
]
