"""Model builders returning `keras.Model`s built from keras_attn's layers."""

from keras_attn.models.rnn_translator import (
    BahdanauDecoder,
    rnn_translator,
    rnn_translator_decoding,
)

__all__ = ["BahdanauDecoder", "rnn_translator", "rnn_translator_decoding"]
