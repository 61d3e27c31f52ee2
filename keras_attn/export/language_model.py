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
from keras_attn.models.transformer import (
    transformer_language_model_decoding,
    transformer_language_model_states,
)
from keras_attn.ops.continuous_cache import (
    ContinuousCache,
    continuous_cache_mixture,
    continuous_cache_probabilities,
)
from keras_attn.text.tokenizer import SubwordTokenizer
from keras_attn.text.vocabulary import END_ID, PAD_ID, START_ID

PROMPT_SPEC = tf.TensorSpec([None], tf.string, name="prompt")
TEXT_SPEC = tf.TensorSpec([None], tf.string, name="text")
SAMPLE_PROMPTS = ("KING:\n", "", "To be, or not to be")
QUERY_CHUNK = 128  # positions whose continuous cache is computed at once


def language_model_serving_fns(
    model, tokenizer, context_length, max_new_tokens, max_chars, continuous_cache=None
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
    scorer = (
        model if continuous_cache is None else transformer_language_model_states(model)
    )

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
        # `stride` tokens of context), so every target is scored exactly once,
        # and the scored positions of the windows, in order, are the text's.
        windows = 1 + tf.maximum(0, longest - 1 - context_length + stride - 1) // stride
        padded_length = (windows - 1) * stride + context_length + 1
        sequence = tf.pad(sequence, [[0, 0], [0, padded_length - longest]])

        def body(window, scored_log_probs, scored_states):
            begin = window * stride
            inputs = sequence[:, begin : begin + context_length]  # (B, C)
            targets = sequence[:, begin + 1 : begin + context_length + 1]  # (B, C)
            outputs = scorer(inputs, training=False)
            states, logits = (None, outputs) if continuous_cache is None else outputs
            log_probs = tf.nn.log_softmax(tf.cast(logits, tf.float32), axis=-1)
            picked = tf.gather(log_probs, targets, batch_dims=2)  # (B, C)
            first_new = tf.where(window == 0, 0, context_length - stride)
            # Time-major, for TensorArray.concat: (new positions, B[, d]).
            scored_log_probs = scored_log_probs.write(
                window, tf.transpose(picked[:, first_new:])
            )
            if states is not None:
                scored_states = scored_states.write(
                    window,
                    tf.transpose(tf.cast(states[:, first_new:], tf.float32), [1, 0, 2]),
                )
            return window + 1, scored_log_probs, scored_states

        def stream(dtype):
            return tf.TensorArray(dtype, size=windows, infer_shape=False)

        _, scored_log_probs, scored_states = tf.while_loop(
            lambda window, *_: window < windows,
            body,
            (tf.constant(0), stream(tf.float32), stream(tf.float32)),
        )
        model_log_probs = tf.transpose(scored_log_probs.concat())  # (B, T)
        targets = sequence[:, 1:]  # (B, T), T = padded_length - 1
        valid = targets != PAD_ID
        model_log_likelihood = tf.reduce_sum(
            tf.where(valid, model_log_probs, 0.0), axis=1
        )
        if continuous_cache is None:
            return {"log_likelihood": model_log_likelihood, "num_tokens": num_tokens}
        log_probs = _continuous_cache_log_probs(
            tf.transpose(scored_states.concat(), [1, 0, 2]),  # (B, T, d)
            targets,
            model_log_probs,
            valid,
            continuous_cache,
        )
        return {
            "log_likelihood": tf.reduce_sum(tf.where(valid, log_probs, 0.0), axis=1),
            "model_log_likelihood": model_log_likelihood,
            "num_tokens": num_tokens,
        }

    return complete, score, tokenizer


def _continuous_cache_log_probs(states, targets, model_log_probs, valid, cache):
    """`keras_attn.ops.continuous_cache_log_probs` over a batch of texts, in
    the graph (its `continuous_cache_probabilities` and
    `continuous_cache_mixture` on each chunk of queries): `(B, T)`
    log-probabilities of `targets` under the mixture of the model and a cache
    of each text's own earlier positions (one text, one document). Queries go
    `QUERY_CHUNK` positions at a time against every earlier position they may
    see, so the scores take `B * QUERY_CHUNK * T` floats at once."""
    length = tf.shape(targets)[1]
    chunks = (length + QUERY_CHUNK - 1) // QUERY_CHUNK

    def body(chunk, mixed):
        start = chunk * QUERY_CHUNK
        stop = tf.minimum(length, start + QUERY_CHUNK)
        first = 0 if cache.window is None else tf.maximum(0, start - cache.window)
        queries = tf.range(start, stop)[:, None]  # (Q, 1)
        memories = tf.range(first, stop)[None, :]  # (1, K)
        visible = memories < queries  # (Q, K): the text before each query
        if cache.window is not None:
            visible &= memories >= queries - cache.window
        visible = visible[None] & valid[:, None, first:stop]  # (B, Q, K)
        cache_probabilities, has_memory = continuous_cache_probabilities(
            states[:, start:stop],
            states[:, first:stop],
            targets[:, first:stop],
            targets[:, start:stop],
            visible,
            cache.theta,
        )  # (B, Q) each
        mixture = continuous_cache_mixture(
            model_log_probs[:, start:stop], cache_probabilities, has_memory, cache.lam
        )
        return chunk + 1, mixed.write(chunk, tf.transpose(mixture))

    _, mixed = tf.while_loop(
        lambda chunk, _: chunk < chunks,
        body,
        (tf.constant(0), tf.TensorArray(tf.float32, size=chunks, infer_shape=False)),
    )
    return tf.reshape(tf.transpose(mixed.concat()), tf.shape(targets))


def export_language_model(
    model: keras.Model,
    tokenizer: SubwordTokenizer,
    base_dir,
    model_name: str = "language_model",
    version: int | None = None,
    context_length: int | None = None,
    max_new_tokens: int = 64,
    max_chars: int = 100_000,
    continuous_cache: ContinuousCache | None = None,
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

    With `continuous_cache` (a `keras_attn.ops.ContinuousCache`), `score`
    scores each text with the model mixed with a continuous cache of the
    text's own earlier positions (Grave et al. 2017; what
    `keras_attn.ops.continuous_cache_log_probs` computes, each text one
    document): `log_likelihood` is the mixture's, and a third output,
    `model_log_likelihood` (float32 `[batch]`), the model's alone. The cache
    attends from every position to all the earlier ones of its text (`window`
    of them at most), `QUERY_CHUNK` positions at a time. `serving_default`
    decodes with the model alone either way.

    `context_length` defaults to the model's learned position table size.
    """
    if continuous_cache is not None and not isinstance(
        continuous_cache, ContinuousCache
    ):
        raise ValueError(
            "`continuous_cache` must be a keras_attn.ops.ContinuousCache or None. "
            f"Received: continuous_cache={continuous_cache!r}"
        )
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
        model, tokenizer, context_length, max_new_tokens, max_chars, continuous_cache
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
    score_outputs = {"log_likelihood": "float32 [batch]"}
    if continuous_cache is not None:
        score_outputs["model_log_likelihood"] = "float32 [batch]"
    score_outputs["num_tokens"] = "int32 [batch]"
    metadata = {
        "task": "language_model",
        "model_name": model_name,
        "version": int(path.name),
        "context_length": context_length,
        "max_new_tokens": max_new_tokens,
        "decoding": "greedy",
        "score": "natural-log probability of the text's tokens and the end token "
        "given the start token; sliding window of stride context_length // 2"
        + (
            "; the model mixed with a continuous cache of the text's earlier "
            "positions (model_log_likelihood: the model alone)"
            if continuous_cache
            else ""
        ),
        "continuous_cache": None
        if continuous_cache is None
        else {
            "theta": continuous_cache.theta,
            "lambda": continuous_cache.lam,
            "window": continuous_cache.window,
        },
        "signatures": {
            "serving_default": {
                "inputs": {"prompt": "string [batch]"},
                "outputs": {"completion": "string [batch]"},
            },
            "score": {
                "inputs": {"text": "string [batch]"},
                "outputs": score_outputs,
            },
        },
        "samples": samples,
        "sample_outputs": run_samples(signatures, samples),
    }
    return write_export(archive, path, metadata)
