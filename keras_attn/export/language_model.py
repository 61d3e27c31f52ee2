"""Export a language model: prompts in, completions out; texts in, scores out."""

from __future__ import annotations

from pathlib import Path

import keras
import tensorflow as tf

from keras_attn.export._common import (
    clean_text,
    next_version_dir,
    run_samples,
    valid_utf8,
    write_export,
)
from keras_attn.memory.continuous_cache import ContinuousCache
from keras_attn.text.tokenizer import SubwordTokenizer

PROMPT_SPEC = tf.TensorSpec([None], tf.string, name="prompt")
TEXT_SPEC = tf.TensorSpec([None], tf.string, name="text")
SAMPLE_PROMPTS = ("KING:\n", "", "To be, or not to be")


def language_model_serving_fns(
    model, context_length, max_new_tokens, max_chars, continuous_cache=None
):
    """The two signature functions and the tokenizer they need tracked.

    `score` is `model.score_ids` (the same sliding windows and continuous
    cache as the eager `model.score`), in the graph.
    """
    if model.tokenizer is None:
        raise ValueError(
            "Exporting for TF Serving needs the language model's `tokenizer`. "
            f"Received: tokenizer=None on {model.name!r}"
        )
    tokenizer = SubwordTokenizer(model.tokenizer.proto)

    def complete(prompt):
        prompt = clean_text(prompt, max_chars=max_chars)
        new_tokens = model.continue_ids(
            tokenizer.tokenize(prompt), max_new_tokens, context_length
        )
        return {"completion": valid_utf8(tokenizer.detokenize(new_tokens))}

    def score(text):
        text = clean_text(text, max_chars=max_chars)
        return model.score_strings(
            text,
            continuous_cache=continuous_cache,
            context_length=context_length,
            tokenizer=tokenizer,
        )

    return complete, score, tokenizer


def export_language_model(
    model,
    base_dir,
    model_name: str = "language_model",
    version: int | None = None,
    context_length: int | None = None,
    max_new_tokens: int | None = None,
    max_chars: int = 100_000,
    continuous_cache: ContinuousCache | None = None,
) -> Path:
    """Export a `keras_attn.models.TransformerLanguageModel` with its
    `tokenizer` for TF Serving (what `model.export(base_dir)` does).

    Signatures (`<base_dir>/<model_name>/<version>/`):

    - `serving_default`: `prompt` (string `[batch]`) -> `completion` (string
      `[batch]`, valid UTF-8: U+FFFD where the tokens decode to bytes that
      are not): greedy decoding after the start token and the prompt, over
      the KV cache, stopping at the end token; `max_new_tokens` and what
      long prompts keep are `model.generate`'s rule (None: until the
      context of `context_length` tokens is full).
    - `score`: `text` (string `[batch]`) -> `log_likelihood` (float32
      `[batch]`, the natural-log probability of all the text's tokens and the
      end token given the start token) and `num_tokens` (int32 `[batch]`, the
      tokens scored, end token included). A text longer than the context is
      scored whole with a sliding window of half-context stride, never
      truncated (inputs longer than `max_chars` characters are cut there).

    With `continuous_cache` (a `keras_attn.memory.ContinuousCache`), `score`
    scores each text with the model mixed with a continuous cache of the
    text's own earlier positions (Grave et al. 2017; what
    `keras_attn.memory.continuous_cache_log_probs` computes, each text one
    document): `log_likelihood` is the mixture's, and a third output,
    `model_log_likelihood` (float32 `[batch]`), the model's alone. The cache
    attends from every position to all the earlier ones of its text (`window`
    of them at most), 128 positions at a time. `serving_default` decodes with
    the model alone either way. `score` is the model's own `score_ids`, so
    the export answers what `model.score(texts)` gives.

    `context_length` defaults to the model's `sequence_length`.
    """
    if continuous_cache is not None and not isinstance(
        continuous_cache, ContinuousCache
    ):
        raise ValueError(
            "`continuous_cache` must be a keras_attn.memory.ContinuousCache or None. "
            f"Received: continuous_cache={continuous_cache!r}"
        )
    if context_length is None:
        context_length = model.sequence_length
    model._prompt_room(max_new_tokens, context_length)  # raises if it does not fit
    path = next_version_dir(base_dir, model_name, version)
    complete, score, serving_tokenizer = language_model_serving_fns(
        model, context_length, max_new_tokens, max_chars, continuous_cache
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
