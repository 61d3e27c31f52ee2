"""Export a translator: raw source strings in, translations (and alignments) out."""

from __future__ import annotations

from pathlib import Path

import keras
import tensorflow as tf

from keras_attn.export._common import TEXT_SPEC, clean_text
from keras_attn.export.task import Endpoint, ServingSpec, export_with_options
from keras_attn.models._task import ReadingWeightsOnce, without_padding_columns
from keras_attn.text.tokenizer import SubwordTokenizer
from keras_attn.text.vocabulary import PAD_ID, START_ID
from keras_attn.text.wordpiece import WordPieceTokenizer

SAMPLE_SOURCES = ("Where is the station?", "", "   ", "I am very tired today.")


def translator_serving_fns(
    translator,
    max_length,
    beam_width,
    length_penalty,
    nearest_neighbors=None,
    assistant_model=None,
    num_speculative_tokens=4,
):
    """The two signature functions and the objects they need tracked (what
    `Translator.serving_spec` serves)."""
    source_tokenizer = _tokenizer(translator, "source_tokenizer")
    target_tokenizer = _tokenizer(translator, "target_tokenizer")
    # Fresh copies, tracked by the export (their vocabularies become its
    # assets or constants).
    source, target = (
        tokenizer.copy() for tokenizer in (source_tokenizer, target_tokenizer)
    )
    decode = translator.decoding_fn(
        max_length, beam_width, length_penalty, nearest_neighbors,
        assistant_model, num_speculative_tokens,
    )  # fmt: skip
    # Weights read (and cast to a mixed policy's compute dtype) once per
    # request, not at every step of the decoding loop.
    assistant = translator._assistant(
        assistant_model, beam_width, length_penalty, nearest_neighbors
    )
    decode = ReadingWeightsOnce(
        (translator,) if assistant is None else (translator, assistant), decode
    )
    source_pieces = tf.constant(_pieces(source_tokenizer))
    target_pieces = tf.constant(_pieces(target_tokenizer))

    def source_ids(text):
        text = clean_text(text, max_chars=16 * max_length)
        return translator.source_ids(text, max_length, tokenizer=source)

    def translate(text):
        # The sources padded to the longest of the batch, not to max_length:
        # the encoder and every step's cross-attention cost what the
        # sources hold (the padding is masked: the same translations up to
        # float rounding). The alignment keeps its fixed source width.
        ids = without_padding_columns(source_ids(text))  # (B, longest)
        tokens, _ = decode(ids)  # (B, max_length), END then padding
        return {"translation": target.detokenize(tokens)}

    def translate_with_alignment(text):
        ids = source_ids(text)
        tokens, _ = decode(ids)  # (B, T)
        start = tf.fill([tf.shape(tokens)[0], 1], START_ID)
        decoder_inputs = tf.concat([start, tokens], axis=1)[:, :-1]  # (B, T)
        alignment = tf.cast(
            translator.attention_maps(ids, decoder_inputs)["alignment"], tf.float32
        )
        keep = tf.cast(tokens != PAD_ID, tf.float32)[:, :, None]  # (B, T, 1)
        return {
            "translation": target.detokenize(tokens),
            "source_tokens": tf.where(ids != PAD_ID, tf.gather(source_pieces, ids), ""),
            "translation_tokens": tf.where(
                tokens != PAD_ID, tf.gather(target_pieces, tokens), ""
            ),
            "alignment": alignment * keep,  # (B, T, S), rows past the end zeroed
        }

    tracked = (source, target)
    if nearest_neighbors is not None:
        tracked += (nearest_neighbors.weights_layer(),)
    if isinstance(assistant_model, keras.Model):
        tracked += (assistant_model,)
    return translate, translate_with_alignment, tracked


def translator_serving_spec(
    translator,
    max_length: int | None = None,
    beam_width: int = 4,
    length_penalty: float = 1.0,
    nearest_neighbors=None,
    assistant_model=None,
    num_speculative_tokens: int = 4,
) -> ServingSpec:
    """`Translator.serving_spec`: the `ServingSpec` of `serving_default`
    (`text` -> `translation`) and `translate_with_alignment`, with
    `export_translator`'s options; the metadata's `model_kind` and
    `alignment` are the translator class's."""
    if translator.model_kind is None:
        raise ValueError(
            f"{type(translator).__name__} must name its kind for the export: set "
            "the class attribute `model_kind`. Received: model_kind=None"
        )
    max_length = translator.translation_length(max_length)
    # None: the translator's own, when the options are greedy search's.
    assistant_model = translator._assistant(
        assistant_model, beam_width, length_penalty, nearest_neighbors
    )
    if assistant_model is not None:
        translator.check_assistant(
            assistant_model, max_length, beam_width, length_penalty,
            nearest_neighbors, num_speculative_tokens,
        )  # fmt: skip
    translate, translate_with_alignment, tracked = translator_serving_fns(
        translator, max_length, beam_width, length_penalty, nearest_neighbors,
        False if assistant_model is None else assistant_model,  # resolved
        num_speculative_tokens,
    )  # fmt: skip
    text = {"text": "string [batch]"}
    samples = {"text": list(SAMPLE_SOURCES)}
    translation = {"translation": "string [batch]"}
    endpoints = {
        "serving_default": Endpoint(translate, [TEXT_SPEC], text, translation, samples),
        "translate_with_alignment": Endpoint(
            translate_with_alignment,
            [TEXT_SPEC],
            text,
            {
                **translation,
                "source_tokens": "string [batch, S]",
                "translation_tokens": "string [batch, T]",
                "alignment": "float32 [batch, T, S]",
            },
            samples,
        ),
    }
    knn = nearest_neighbors
    metadata = {
        "model_kind": translator.model_kind,
        "source_tokenizer": type(translator.source_tokenizer).__name__,
        "max_length": max_length,
        "beam_width": beam_width,
        "length_penalty": length_penalty,
        "length_penalty_formula": "log P / ((5 + length) / 6) ** length_penalty",
        "nearest_neighbors": None
        if knn is None
        else {
            "k": knn.k,
            "temperature": knn.temperature,
            "lambda": knn.lam,
            "datastore_entries": len(knn.datastore),
            "key_dtype": knn.key_dtype,
            "formula": "(1 - lambda) p_model + lambda softmax(-d / temperature) "
            "over the k nearest datastore keys' tokens",
        },
        "alignment": translator.alignment_description(),
        "assistant": None
        if assistant_model is None
        else {
            "kind": "draft_model",
            "num_speculative_tokens": num_speculative_tokens,
            "num_encoder_layers": len(assistant_model.encoder_blocks),
            "num_decoder_layers": len(assistant_model.decoder_blocks),
            "embedding_dim": assistant_model.embedding_dim,
            "parameters": int(assistant_model.count_params()),
        },
    }
    return ServingSpec(
        task="translation",
        model_name="translator",
        endpoints=endpoints,
        resources=tracked,
        metadata=metadata,
    )


def export_translator(
    translator,
    base_dir,
    model_name: str = "translator",
    version: int | None = None,
    max_length: int | None = None,
    beam_width: int = 4,
    length_penalty: float = 1.0,
    nearest_neighbors=None,
    precision: str | None = None,
    assistant_model=None,
    num_speculative_tokens: int = 4,
) -> Path:
    """Export a translator with its tokenizers and beam search for TF Serving
    (what `translator.export(base_dir)` does: `export_task(translator, ...)`
    with the translator's options).

    `translator` is a `keras_attn.models.RNNTranslator` or
    `TransformerTranslator` with its `source_tokenizer` (SentencePiece, or a
    pretrained encoder's `WordPieceTokenizer`) and `target_tokenizer`.

    Signatures (`<base_dir>/<model_name>/<version>/`):

    - `serving_default`: `text` (string `[batch]`) -> `translation` (string
      `[batch]`), beam search with `beam_width` and the GNMT `length_penalty`
      fixed here (recorded in `assets.extra/keras_attn.json`).
    - `translate_with_alignment`: `text` -> `translation`, `source_tokens`
      (string `[batch, S]`), `translation_tokens` (string `[batch, T]`),
      `alignment` (float32 `[batch, T, S]`): for the RNN translator the
      weights of its Bahdanau/Luong layer, for the Transformer the
      cross-attention of the last decoder block averaged over heads. Padding
      positions hold `""` and zero rows.

    Sources are cleaned (invalid UTF-8 replaced) and truncated to
    `max_length` tokens; translations stop at `max_length` tokens. `None`
    (default) is `translate()`'s default: 40, at most what the model's
    positions allow (`translator.max_length_limit()`); a larger value raises
    a `ValueError` naming `max_length`.

    With `nearest_neighbors` (a `keras_attn.memory.NearestNeighborDecoding`,
    Transformer only) both signatures decode with kNN-MT: the datastore's
    keys and values are saved as variables of the export (about `4 * d`
    bytes per entry) and its settings are recorded in the metadata.
    With `assistant_model` (a smaller `TransformerTranslator` on the same
    vocabularies; it takes `beam_width=1, length_penalty=0.0`) both
    signatures decode by speculative greedy search
    (`Translator.decoding_fn`): greedy search's translations in fewer
    passes of the translator. None (default) is the translator's own
    `assistant_model` when the options are greedy search's, False none. The
    draft's weights are in the same SavedModel; the metadata's `assistant`
    describes it.
    `precision` (`"float32"`, `"bfloat16"`, `"int8"`, `"int4"`) exports a
    copy of the translator (and of a draft) with its weights so (see
    `export_task`); None exports it as it is.
    """
    return export_with_options(
        translator,
        base_dir,
        model_name,
        version,
        {
            "max_length": max_length,
            "beam_width": beam_width,
            "length_penalty": length_penalty,
            "nearest_neighbors": nearest_neighbors,
            "precision": precision,
            "assistant_model": assistant_model,
            "num_speculative_tokens": num_speculative_tokens,
        },
        argument="translator",
        expected_task="translation",
    )


def _pieces(tokenizer: SubwordTokenizer | WordPieceTokenizer) -> list[str]:
    return tokenizer.get_vocabulary()


def _tokenizer(task, name: str):
    tokenizer = getattr(task, name, None)
    if tokenizer is None:
        raise ValueError(
            f"Exporting for TF Serving needs the model's `{name}`. Received: "
            f"{name}=None on {type(task).__name__} {task.name!r}"
        )
    return tokenizer
