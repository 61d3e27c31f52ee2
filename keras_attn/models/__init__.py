"""Model builders returning `keras.Model`s built from keras_attn's layers."""

from keras_attn.models.nearest_neighbors import (
    NearestNeighborDecoding,
    TranslationDatastore,
    knn_target_log_probs,
    translation_datastore,
    translation_states,
)
from keras_attn.models.pretrained import (
    BertCheckpoint,
    bert_sentiment_classifier,
    bert_transformer_translator,
    fetch_minilm,
    load_bert_checkpoint,
    load_bert_weights,
    load_minilm,
    load_pretrained,
)
from keras_attn.models.rnn_translator import (
    BahdanauDecoder,
    rnn_translator,
    rnn_translator_alignment,
    rnn_translator_decoding,
)
from keras_attn.models.sentiment_classifier import (
    sentiment_classifier,
    sentiment_self_attention,
    sentiment_token_weights,
)
from keras_attn.models.transformer import (
    transformer_language_model,
    transformer_language_model_decoding,
    transformer_language_model_states,
    transformer_translator,
    transformer_translator_alignment,
    transformer_translator_decoding,
    transformer_translator_states,
)
from keras_attn.models.translator import TranslatorAdapter, translator_adapter

__all__ = [
    "BahdanauDecoder",
    "BertCheckpoint",
    "NearestNeighborDecoding",
    "TranslationDatastore",
    "TranslatorAdapter",
    "bert_sentiment_classifier",
    "bert_transformer_translator",
    "fetch_minilm",
    "knn_target_log_probs",
    "load_bert_checkpoint",
    "load_bert_weights",
    "load_minilm",
    "load_pretrained",
    "rnn_translator",
    "rnn_translator_alignment",
    "rnn_translator_decoding",
    "sentiment_classifier",
    "sentiment_self_attention",
    "sentiment_token_weights",
    "transformer_language_model",
    "transformer_language_model_decoding",
    "transformer_language_model_states",
    "transformer_translator",
    "transformer_translator_alignment",
    "transformer_translator_decoding",
    "transformer_translator_states",
    "translation_datastore",
    "translation_states",
    "translator_adapter",
]
