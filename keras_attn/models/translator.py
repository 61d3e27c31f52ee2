"""One decoding interface over both translators (RNN and Transformer)."""

from __future__ import annotations

import keras
from keras import ops

from keras_attn import generation
from keras_attn.models._structure import translator_config
from keras_attn.models.rnn_translator import (
    rnn_translator_alignment,
    rnn_translator_decoding,
)
from keras_attn.models.transformer import (
    transformer_translator_alignment,
    transformer_translator_decoding,
)
from keras_attn.text.vocabulary import END_ID, PAD_ID, START_ID


class TranslatorAdapter:
    """Encode, decode and align with an `rnn_translator` or `transformer_translator`.

    Attributes:
        kind: `"rnn"` or `"transformer"`.
        alignment: `align(encoder_inputs, decoder_inputs) -> (B, T, S)` float32
            attention weights (Bahdanau/Luong weights for the RNN; the last
            decoder block's cross-attention averaged over heads for the
            Transformer).
    """

    def __init__(self, model: keras.Model, nearest_neighbors=None):
        config = translator_config(model)
        self.model = model
        self.kind = config["kind"]
        self.nearest_neighbors = nearest_neighbors
        if self.kind == "rnn":
            if nearest_neighbors is not None:
                raise ValueError(
                    "`nearest_neighbors` (kNN-MT) needs a Transformer translator. "
                    f"Received: the RNN translator {model.name!r}"
                )
            self._encode, self.next_fn = rnn_translator_decoding(model)
            self.alignment = rnn_translator_alignment(model)
        else:
            self._encode, self.next_fn = transformer_translator_decoding(
                model, nearest_neighbors
            )
            self.alignment = transformer_translator_alignment(model)

    def encode(self, encoder_inputs, max_length):
        """The decoding cache of a batch of sources (`max_length` target steps)."""
        if self.kind == "rnn":
            return self._encode(encoder_inputs)
        return self._encode(encoder_inputs, max_length)

    def _start(self, encoder_inputs):
        batch = ops.shape(encoder_inputs)[0]
        return ops.full((batch, 1), START_ID, dtype="int32")

    def beam_search_fn(
        self, max_length: int, beam_width: int = 4, length_penalty: float = 0.6
    ):
        """`fn(encoder_inputs) -> (tokens (B, max_length), scores (B,))`.

        Tokens exclude the start token; they end with `END_ID` then padding
        (the tokenizer's `detokenize` stops at the end token).
        """

        def decode(encoder_inputs):
            encoder_inputs = ops.convert_to_tensor(encoder_inputs, "int32")
            cache = self.encode(encoder_inputs, max_length + 1)
            tokens, scores = generation.beam_search(
                self.next_fn,
                self._start(encoder_inputs),
                cache,
                max_length + 1,
                beam_width=beam_width,
                length_penalty=length_penalty,
                end_token_id=END_ID,
                pad_token_id=PAD_ID,
            )
            return tokens[:, 1:], scores

        return decode

    def greedy_fn(self, max_length: int):
        """`fn(encoder_inputs) -> tokens (B, max_length)` (no start token)."""

        def decode(encoder_inputs):
            encoder_inputs = ops.convert_to_tensor(encoder_inputs, "int32")
            cache = self.encode(encoder_inputs, max_length + 1)
            tokens = generation.greedy_search(
                self.next_fn,
                self._start(encoder_inputs),
                cache,
                max_length + 1,
                end_token_id=END_ID,
                pad_token_id=PAD_ID,
            )
            return tokens[:, 1:]

        return decode


def translator_adapter(model: keras.Model, nearest_neighbors=None) -> TranslatorAdapter:
    """A `TranslatorAdapter` for a model built by either translator builder.

    `nearest_neighbors`: a `NearestNeighborDecoding` (Transformer only): its
    searches and decoding mix the model with a datastore's neighbours (kNN-MT).
    """
    return TranslatorAdapter(model, nearest_neighbors)
