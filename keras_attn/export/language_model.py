"""Export a language model: prompts in, completions out; texts in, scores out."""

from __future__ import annotations

from pathlib import Path

import tensorflow as tf

from keras_attn.export._common import clean_text, valid_utf8
from keras_attn.export.task import Endpoint, ServingSpec, export_with_options
from keras_attn.memory.continuous_cache import ContinuousCache
from keras_attn.text.preprocessors import LanguageModelPreprocessor
from keras_attn.text.tokenizer import SubwordTokenizer

PROMPT_SPEC = tf.TensorSpec([None], tf.string, name="prompt")
TEXT_SPEC = tf.TensorSpec([None], tf.string, name="text")
SAMPLE_PROMPTS = ("KING:\n", "", "To be, or not to be")


def language_model_serving_fns(
    model, context_length, max_new_tokens, max_chars, continuous_cache=None
):
    """The two signature functions and the tokenizer they need tracked (what
    `TransformerLanguageModel.serving_spec` serves).

    `score` is `model.score_ids` of the preprocessor's `score_preprocess`
    (`model.score_strings` with the serving tokenizer: the same sliding
    windows and continuous cache as the eager `model.score`), in the graph.
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

    preprocessor = LanguageModelPreprocessor(tokenizer, model.sequence_length)

    def score(text):
        text = clean_text(text, max_chars=max_chars)
        return model.score_ids(
            preprocessor.score_preprocess(text),
            continuous_cache=continuous_cache,
            context_length=context_length,
        )

    return complete, score, tokenizer


def language_model_serving_spec(
    model,
    context_length: int | None = None,
    max_new_tokens: int | None = None,
    max_chars: int = 100_000,
    continuous_cache=None,
) -> ServingSpec:
    """`TransformerLanguageModel.serving_spec`: the `ServingSpec` of
    `serving_default` (`prompt` -> `completion`) and `score` (`text` ->
    `log_likelihood`, `num_tokens`), with `export_language_model`'s
    options."""
    check_continuous_cache(continuous_cache)
    if context_length is None:
        context_length = model.sequence_length
    model.prompt_room(max_new_tokens, context_length)  # raises if it does not fit
    complete, score, serving_tokenizer = language_model_serving_fns(
        model, context_length, max_new_tokens, max_chars, continuous_cache
    )
    with_cache = continuous_cache is not None
    score_outputs = {"log_likelihood": "float32 [batch]"}
    if with_cache:
        score_outputs["model_log_likelihood"] = "float32 [batch]"
    score_outputs["num_tokens"] = "int32 [batch]"
    endpoints = {
        "serving_default": Endpoint(
            complete,
            [PROMPT_SPEC],
            {"prompt": "string [batch]"},
            {"completion": "string [batch]"},
            {"prompt": list(SAMPLE_PROMPTS)},
        ),
        "score": Endpoint(
            score,
            [TEXT_SPEC],
            {"text": "string [batch]"},
            score_outputs,
            {"text": list(SAMPLE_PROMPTS)},
        ),
    }
    metadata = {
        "context_length": context_length,
        "max_new_tokens": max_new_tokens,
        "decoding": "greedy",
        "score": "natural-log probability of the text's tokens and the end "
        "token given the start token; sliding window of stride "
        "context_length // 2"
        + (
            "; the model mixed with a continuous cache of the text's earlier "
            "positions (model_log_likelihood: the model alone)"
            if with_cache
            else ""
        ),
        "continuous_cache": None
        if not with_cache
        else {
            "theta": continuous_cache.theta,
            "lambda": continuous_cache.lam,
            "window": continuous_cache.window,
        },
    }
    return ServingSpec(
        task="language_model",
        model_name="language_model",
        endpoints=endpoints,
        resources=(serving_tokenizer,),
        metadata=metadata,
    )


def export_language_model(
    model,
    base_dir,
    model_name: str = "language_model",
    version: int | None = None,
    context_length: int | None = None,
    max_new_tokens: int | None = None,
    max_chars: int = 100_000,
    continuous_cache: ContinuousCache | None = None,
    precision: str | None = None,
) -> Path:
    """Export a `keras_attn.models.TransformerLanguageModel` with its
    `tokenizer` for TF Serving (what `model.export(base_dir)` does:
    `export_task(model, ...)` with the model's options).

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
    `precision` (`"float32"`, `"bfloat16"`, `"int8"`, `"int4"`) exports a
    copy of the model with its weights so (see `export_task`); None exports
    it as it is.
    """
    return export_with_options(
        model,
        base_dir,
        model_name,
        version,
        {
            "context_length": context_length,
            "max_new_tokens": max_new_tokens,
            "max_chars": max_chars,
            "continuous_cache": continuous_cache,
            "precision": precision,
        },
        argument="model",
        expected_task="language_model",
    )


def check_continuous_cache(continuous_cache):
    """`continuous_cache` if it is a `ContinuousCache` or None, else a
    `ValueError`."""
    if continuous_cache is not None and not isinstance(
        continuous_cache, ContinuousCache
    ):
        raise ValueError(
            "`continuous_cache` must be a keras_attn.memory.ContinuousCache or None. "
            f"Received: continuous_cache={continuous_cache!r}"
        )
    return continuous_cache
