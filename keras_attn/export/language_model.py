"""Export a language model: prompts in, completions out; texts in, scores out."""

from __future__ import annotations

import functools
from pathlib import Path

import keras
import tensorflow as tf

from keras_attn.export._common import clean_text, valid_utf8
from keras_attn.export.task import Endpoint, ServingSpec, export_with_options
from keras_attn.memory.continuous_cache import ContinuousCache
from keras_attn.models._task import ReadingWeightsOnce
from keras_attn.text.preprocessors import LanguageModelPreprocessor
from keras_attn.text.tokenizer import SubwordTokenizer

PROMPT_SPEC = tf.TensorSpec([None], tf.string, name="prompt")
TEXT_SPEC = tf.TensorSpec([None], tf.string, name="text")
SEED_SPEC = tf.TensorSpec([None], tf.int64, name="seed")
SAMPLE_PROMPTS = ("KING:\n", "", "To be, or not to be")
SAMPLE_SEEDS = (1, 2, 3)


def language_model_serving_fns(
    model,
    context_length,
    max_new_tokens,
    max_chars,
    continuous_cache=None,
    assistant_model=None,
    num_speculative_tokens=4,
    sampler=None,
):
    """The signature functions (`complete`, `score`, and `sample` with a
    `sampler`, else None) and the tokenizer they need tracked (what
    `TransformerLanguageModel.serving_spec` serves).

    `score` is `model.score_ids` of the preprocessor's `score_preprocess`
    (`model.score_strings` with the serving tokenizer: the same sliding
    windows and continuous cache as the eager `model.score`), in the graph.
    `sample` is `model.continue_ids` with `sampler` and one seed per prompt,
    what `model.generate(prompts, sampler=sampler, seed=seeds)` answers.
    """
    if model.tokenizer is None:
        raise ValueError(
            "Exporting for TF Serving needs the language model's `tokenizer`. "
            f"Received: tokenizer=None on {model.name!r}"
        )
    tokenizer = SubwordTokenizer(model.tokenizer.proto)

    # None is no assistant here: the spec resolved the model's own (a
    # draft model, or "prompt_lookup", which has no weights).
    drafts = [assistant_model] if isinstance(assistant_model, keras.Model) else []

    def continuing(with_sampler):
        """`model.continue_ids` with the export's options and `with_sampler`,
        the weights read (and cast) once per request, not at every step."""
        return ReadingWeightsOnce(
            (model, *drafts),
            functools.partial(
                model.continue_ids,
                max_new_tokens=max_new_tokens,
                context_length=context_length,
                sampler=with_sampler,
                assistant_model=False if assistant_model is None else assistant_model,
                num_speculative_tokens=num_speculative_tokens,
            ),
        )

    continue_ids = continuing("greedy")

    def complete(prompt):
        prompt = clean_text(prompt, max_chars=max_chars)
        new_tokens = continue_ids(tokenizer.tokenize(prompt))
        return {"completion": valid_utf8(tokenizer.detokenize(new_tokens))}

    sample = None
    if sampler is not None:
        continue_sampled = continuing(sampler)

        def sample(prompt, seed):
            # One seed per prompt (a shorter vector would broadcast).
            tf.debugging.assert_equal(
                tf.shape(seed)[0],
                tf.shape(prompt)[0],
                message="`seed` must hold one seed per prompt",
            )
            prompt = clean_text(prompt, max_chars=max_chars)
            new_tokens = continue_sampled(tokenizer.tokenize(prompt), seed=seed)
            return {"completion": valid_utf8(tokenizer.detokenize(new_tokens))}

    preprocessor = LanguageModelPreprocessor(tokenizer, model.sequence_length)

    def score(text):
        text = clean_text(text, max_chars=max_chars)
        return model.score_ids(
            preprocessor.score_preprocess(text),
            continuous_cache=continuous_cache,
            context_length=context_length,
        )

    return complete, score, sample, tokenizer


def check_export_sampler(sampler):
    """`sampler` if it is None or a keras_attn.generation sampler that
    draws at random (what the `sample` signature decodes with; a name, a
    config or a class: `generation.get`'s sampler, as the language model's
    decodings take them), else a `ValueError`."""
    from keras_attn import generation

    if sampler is None:
        return None
    if not isinstance(sampler, generation.Sampler):  # a name, config or class
        sampler = generation.get(sampler)
    if not isinstance(sampler, generation.Sampler) or isinstance(
        sampler, (generation.GreedySampler, generation.BeamSampler)
    ):
        raise ValueError(
            "`sampler` must be a keras_attn.generation sampler that draws at "
            "random (RandomSampler, TopKSampler, TopPSampler or a subclass of "
            "Sampler; greedy decoding is `serving_default`). Received: "
            f"sampler={sampler!r}"
        )
    return sampler


def sampler_from_text(value):
    """The checked sampler (`check_export_sampler`) of a command-line
    option's `value`: a sampler's name (`"top_k"`) or a JSON config
    (`'{"class_name": "TopKSampler", "config": {"k": 5}}'`); None for None.
    A `ValueError` names what was received."""
    import json

    if value is None:
        return None
    if value.lstrip().startswith("{"):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"not a JSON config ({error}): {value!r}") from None
    return check_export_sampler(value)


def _describe_sampler(sampler):
    """The metadata's `sampler` entry: None, or the sampler's class and
    config."""
    if sampler is None:
        return None
    config = {k: v for k, v in sampler.get_config().items() if k != "seed"}
    return {"class": type(sampler).__name__, "config": config}


def language_model_serving_spec(
    model,
    context_length: int | None = None,
    max_new_tokens: int | None = None,
    max_chars: int = 100_000,
    continuous_cache=None,
    assistant_model=None,
    num_speculative_tokens: int = 4,
    sampler=None,
) -> ServingSpec:
    """`TransformerLanguageModel.serving_spec`: the `ServingSpec` of
    `serving_default` (`prompt` -> `completion`), `score` (`text` ->
    `log_likelihood`, `num_tokens`) and, with a `sampler`, `sample`
    (`prompt`, `seed` -> `completion`), with `export_language_model`'s
    options."""
    from keras_attn import _validation as v

    check_continuous_cache(continuous_cache)
    sampler = check_export_sampler(sampler)
    assistant_model = model._assistant(assistant_model)  # None: the model's own
    if context_length is None:
        context_length = model.sequence_length
    model.prompt_room(max_new_tokens, context_length)  # raises if it does not fit
    if assistant_model is not None:
        model.check_assistant(assistant_model, "greedy", context_length)
        if sampler is not None:
            model.check_assistant(assistant_model, sampler, context_length)
        v.check_positive_int("num_speculative_tokens", num_speculative_tokens)
    complete, score, sample, serving_tokenizer = language_model_serving_fns(
        model, context_length, max_new_tokens, max_chars, continuous_cache,
        assistant_model, num_speculative_tokens, sampler,
    )  # fmt: skip
    draft = assistant_model if isinstance(assistant_model, keras.Model) else None
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
    if sample is not None:
        endpoints["sample"] = Endpoint(
            sample,
            [PROMPT_SPEC, SEED_SPEC],
            {"prompt": "string [batch]", "seed": "int64 [batch]"},
            {"completion": "string [batch]"},
            {"prompt": list(SAMPLE_PROMPTS), "seed": list(SAMPLE_SEEDS)},
        )
    metadata = {
        "context_length": context_length,
        "max_new_tokens": max_new_tokens,
        "decoding": "greedy"
        if assistant_model is None
        else "greedy, speculative: the same tokens, guesses checked "
        f"{num_speculative_tokens} at a time",
        "assistant": _describe_assistant(assistant_model, num_speculative_tokens),
        "sampler": _describe_sampler(sampler),
        "sample": None
        if sampler is None
        else "a draw from the sampler's distribution, each prompt's from its "
        "own seed (modulo 2**32) whatever it is batched with"
        + (
            ""
            if assistant_model is None
            else f", speculative: guesses checked {num_speculative_tokens} at a time"
        ),
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
        resources=(serving_tokenizer,) + (() if draft is None else (draft,)),
        metadata=metadata,
    )


def _describe_assistant(assistant_model, num_speculative_tokens):
    """The metadata's `assistant` entry: None, or what checks the guesses."""
    if assistant_model is None:
        return None
    entry = {"num_speculative_tokens": num_speculative_tokens}
    if isinstance(assistant_model, str):
        return {"kind": assistant_model, **entry}
    return {
        "kind": "draft_model",
        **entry,
        "num_layers": assistant_model.num_layers,
        "embedding_dim": assistant_model.embedding_dim,
        "parameters": int(assistant_model.count_params()),
    }


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
    assistant_model=None,
    num_speculative_tokens: int = 4,
    sampler=None,
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

    With `assistant_model` (a draft `TransformerLanguageModel` on the same
    vocabulary, or `"prompt_lookup"`; None, the default, is the model's own
    `assistant_model`, and False none), `serving_default` decodes by
    speculative greedy decoding (`model.generate_ids`'s `assistant_model`,
    `num_speculative_tokens` guesses checked per forward pass of the
    model): the same completions in fewer passes of the model. A draft's
    weights are in the same SavedModel; the metadata's `assistant` says
    which.

    With `sampler` (a `keras_attn.generation` sampler that draws at random:
    `RandomSampler`, `TopKSampler`, `TopPSampler`), a third signature:

    - `sample`: `prompt` (string `[batch]`) and `seed` (int64 `[batch]`, one
      per prompt) -> `completion` (string `[batch]`): the prompt continued
      by `sampler` (its temperature and cut; its own `seed` is not used),
      each row drawing from its own seed, so a request's completion does
      not depend on the requests TF Serving batches it with and the same
      prompt and seed give the same completion. What `model.generate(
      prompts, max_new_tokens, sampler=sampler, seed=seeds)` answers. With
      an `assistant_model` it decodes by speculative sampling (the same
      distribution, other draws).

    `context_length` defaults to the model's `sequence_length`.
    `precision` (`"float32"`, `"bfloat16"`, `"int8"`, `"int4"`) exports a
    copy of the model with its weights so (see `export_task`), and of a
    draft `assistant_model`; None exports them as they are.
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
            "assistant_model": assistant_model,
            "num_speculative_tokens": num_speculative_tokens,
            "sampler": sampler,
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
