"""Export a language model: prompts in, completions out; texts in, scores out."""

from __future__ import annotations

from pathlib import Path

import keras
import tensorflow as tf

from keras_attn import generation
from keras_attn.export._common import (
    clean_text,
    next_version_dir,
    run_samples,
    write_export,
)
from keras_attn.models.transformer import transformer_language_model_decoding
from keras_attn.text.tokenizer import SubwordTokenizer
from keras_attn.text.vocabulary import END_ID, PAD_ID, START_ID

PROMPT_SPEC = tf.TensorSpec([None], tf.string, name="prompt")
TEXT_SPEC = tf.TensorSpec([None], tf.string, name="text")
SAMPLE_PROMPTS = ("KING:\n", "", "To be, or not to be")


def language_model_serving_fns(
    model, tokenizer, context_length, max_new_tokens, max_chars
):
    initial_cache, next_fn = transformer_language_model_decoding(model)
    tokenizer = SubwordTokenizer(tokenizer.proto)
    prompt_budget = (
        context_length - max_new_tokens
    )  # prompt tokens kept, START included

    def complete(prompt):
        prompt = clean_text(prompt, max_chars=max_chars)
        ids = tokenizer.tokenize(prompt)[:, -(prompt_budget - 1) :]  # keep the end
        start = tf.fill([ids.nrows(), 1], START_ID)
        ids = tf.concat([start, ids], axis=1)  # ragged (B, <= prompt_budget)
        lengths = tf.cast(ids.row_lengths(), tf.int32)
        padded = ids.to_tensor(default_value=PAD_ID, shape=[None, prompt_budget])
        total = prompt_budget + max_new_tokens
        cache = initial_cache(tf.shape(padded)[0], total)
        tokens = generation.greedy_search(
            next_fn,
            padded,
            cache,
            total,
            prompt_lengths=lengths,
            end_token_id=END_ID,
            pad_token_id=PAD_ID,
            output_length=total,
        )  # (B, total): prompt, new tokens, padding
        positions = tf.range(total)[None, :]
        new_tokens = tf.ragged.boolean_mask(tokens, positions >= lengths[:, None])
        return {"completion": tokenizer.detokenize(new_tokens)}

    stride = context_length // 2

    def score(text):
        text = clean_text(text, max_chars=max_chars)
        ids = tokenizer.tokenize(text)
        rows = ids.nrows()
        ids = tf.concat(
            [tf.fill([rows, 1], START_ID), ids, tf.fill([rows, 1], END_ID)], axis=1
        )
        num_tokens = tf.cast(ids.row_lengths(), tf.int32) - 1  # targets, END included
        sequence = ids.to_tensor(default_value=PAD_ID)  # (B, L)
        longest = tf.shape(sequence)[1]
        # Windows of `context_length` inputs every `stride` positions; a window
        # scores only the targets the previous one did not (each with at least
        # `stride` tokens of context), so every target is scored exactly once.
        windows = 1 + tf.maximum(0, longest - 1 - context_length + stride - 1) // stride
        padded_length = (windows - 1) * stride + context_length + 1
        sequence = tf.pad(sequence, [[0, 0], [0, padded_length - longest]])

        def body(window, total):
            begin = window * stride
            inputs = sequence[:, begin : begin + context_length]  # (B, C)
            targets = sequence[:, begin + 1 : begin + context_length + 1]  # (B, C)
            logits = tf.cast(model(inputs, training=False), tf.float32)
            log_probs = tf.nn.log_softmax(logits, axis=-1)
            picked = tf.gather(log_probs, targets, batch_dims=2)  # (B, C)
            first_new = tf.where(window == 0, 0, context_length - stride)
            scored = (tf.range(context_length) >= first_new)[None, :] & (
                targets != PAD_ID
            )
            return window + 1, total + tf.reduce_sum(
                tf.where(scored, picked, 0.0), axis=1
            )

        _, log_likelihood = tf.while_loop(
            lambda window, total: window < windows,
            body,
            (tf.constant(0), tf.zeros([rows], tf.float32)),
        )
        return {"log_likelihood": log_likelihood, "num_tokens": num_tokens}

    return complete, score, tokenizer


def export_language_model(
    model: keras.Model,
    tokenizer: SubwordTokenizer,
    base_dir,
    model_name: str = "language_model",
    version: int | None = None,
    context_length: int | None = None,
    max_new_tokens: int = 64,
    max_chars: int = 100_000,
) -> Path:
    """Export a `transformer_language_model` with its tokenizer for TF Serving.

    Signatures (`<base_dir>/<model_name>/<version>/`):

    - `serving_default`: `prompt` (string `[batch]`) -> `completion` (string
      `[batch]`): greedy decoding of at most `max_new_tokens` tokens after the
      start token and the prompt (long prompts keep their last tokens), over
      the KV cache, stopping at the end token.
    - `score`: `text` (string `[batch]`) -> `log_likelihood` (float32
      `[batch]`, the natural-log probability of all the text's tokens and the
      end token given the start token) and `num_tokens` (int32 `[batch]`, the
      tokens scored, end token included). A text longer than the context is
      scored whole with a sliding window of half-context stride, never
      truncated (inputs longer than `max_chars` characters are cut there).

    `context_length` defaults to the model's learned position table size.
    """
    if context_length is None:
        context_length = model.get_layer("embedding").sequence_length
    if max_new_tokens >= context_length:
        raise ValueError(
            "`max_new_tokens` must leave room for the prompt in the context. "
            f"Received: max_new_tokens={max_new_tokens}, "
            f"context_length={context_length}"
        )
    path = next_version_dir(base_dir, model_name, version)
    complete, score, serving_tokenizer = language_model_serving_fns(
        model, tokenizer, context_length, max_new_tokens, max_chars
    )
    archive = keras.export.ExportArchive()
    archive.track(model)
    archive.track(serving_tokenizer)
    signatures = {
        "serving_default": archive.add_endpoint(
            "serving_default", complete, input_signature=[PROMPT_SPEC]
        ),
        "score": archive.add_endpoint("score", score, input_signature=[TEXT_SPEC]),
    }
    samples = {
        "serving_default": {"prompt": list(SAMPLE_PROMPTS)},
        "score": {"text": list(SAMPLE_PROMPTS)},
    }
    metadata = {
        "task": "language_model",
        "model_name": model_name,
        "version": int(path.name),
        "context_length": context_length,
        "max_new_tokens": max_new_tokens,
        "decoding": "greedy",
        "score": "natural-log probability of the text's tokens and the end token "
        "given the start token; sliding window of stride context_length // 2",
        "signatures": {
            "serving_default": {
                "inputs": {"prompt": "string [batch]"},
                "outputs": {"completion": "string [batch]"},
            },
            "score": {
                "inputs": {"text": "string [batch]"},
                "outputs": {
                    "log_likelihood": "float32 [batch]",
                    "num_tokens": "int32 [batch]",
                },
            },
        },
        "samples": samples,
        "sample_outputs": run_samples(signatures, samples),
    }
    return write_export(archive, path, metadata)
