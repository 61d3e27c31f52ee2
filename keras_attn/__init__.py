"""keras_attn: attention layers for Keras 3, and the models built from them.

Bahdanau and Luong attention, multi-head (self-)attention, position encodings,
Transformer blocks and an attention RNN decoder (`keras_attn.layers`); model
classes for translation, classification and language modelling that decode,
save and export for TF Serving (`keras_attn.models`); decoding over a KV cache
(`keras_attn.generation`); pure attention functions (`keras_attn.ops`).
Importing keras_attn imports no TensorFlow.
"""

from keras_attn import generation, layers, models, ops
from keras_attn.layers import (
    AlibiBias,
    AttentionPooling,
    BahdanauAttention,
    BahdanauDecoder,
    GroupedQueryAttention,
    LuongAttention,
    MultiHeadAttention,
    MultiHeadSelfAttention,
    PositionEmbedding,
    RotaryEmbedding,
    SinusoidalPositionEncoding,
    TokenAndPositionEmbedding,
    TransformerDecoder,
    TransformerDecoderBlock,
    TransformerEncoder,
    TransformerEncoderBlock,
)
from keras_attn.models import (
    RNNTranslator,
    TextClassifier,
    TextClassifierEnsemble,
    TransformerLanguageModel,
    TransformerTranslator,
)

# What a saved model's config or compile config can name, registered here so
# that `keras.saving.load_model` resolves it after `import keras_attn` alone
# (the loss of the example scripts; the tokenizers, which need TensorFlow,
# are deserialized by the models' `from_config`). Imports no TensorFlow.
from keras_attn.training import losses as _losses  # noqa: F401

__version__ = "0.2.0"

__all__ = [
    "AlibiBias",
    "AttentionPooling",
    "BahdanauAttention",
    "BahdanauDecoder",
    "GroupedQueryAttention",
    "LuongAttention",
    "MultiHeadAttention",
    "MultiHeadSelfAttention",
    "PositionEmbedding",
    "RNNTranslator",
    "RotaryEmbedding",
    "SinusoidalPositionEncoding",
    "TextClassifier",
    "TextClassifierEnsemble",
    "TokenAndPositionEmbedding",
    "TransformerDecoder",
    "TransformerDecoderBlock",
    "TransformerEncoder",
    "TransformerEncoderBlock",
    "TransformerLanguageModel",
    "TransformerTranslator",
    "__version__",
    "generation",
    "layers",
    "models",
    "ops",
]
