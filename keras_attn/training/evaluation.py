"""Evaluation recipes: bits per character and perplexity of scored text, the
figures of a translation evaluation, and the beam's length penalty and
kNN-MT's setting chosen on held-out data."""

from __future__ import annotations

import math
from collections.abc import Sequence

import keras
import numpy as np

from keras_attn import _validation as v


def bits_per_character(nats: float, characters: int) -> float:
    """`nats` (a negative log-likelihood in natural log) per character, in
    bits: comparable across tokenizers, unlike perplexity per token."""
    _check_count("characters", characters)
    return float(nats) / math.log(2) / characters


def perplexity(nats: float, tokens: int) -> float:
    """`exp(nats / tokens)`: the perplexity per token."""
    _check_count("tokens", tokens)
    return math.exp(float(nats) / tokens)


def language_model_metrics(scores: dict, characters, continuous_cache=None) -> dict:
    """Bits per character and perplexity per token of a scored text.

    Args:
        scores: what a `TransformerLanguageModel` gives: `score(texts)`
            (`log_likelihood` and `num_tokens` per text, summed here; with
            a continuous cache, the mixture's) or
            `stream_log_probs(dataset)` (`log_probs`, one per target).
        characters: the number of characters of the text scored, or the
            texts themselves (their lengths are summed).
        continuous_cache: a `keras_attn.memory.ContinuousCache` to mix into
            a `stream_log_probs(dataset, states=True)` result (its
            `stream_nats`), or None: the scores as they are.

    Returns:
        A dict: `nats` (the negative log-likelihood, natural log),
        `tokens`, `characters`, `bits_per_character`, `perplexity`.

    Example:

    ```python
    texts = ["KING: Where is the house?"]
    metrics = language_model_metrics(model.score(texts), texts)
    print(metrics["bits_per_character"], metrics["perplexity"])
    ```
    """
    if continuous_cache is not None:
        if "states" not in scores:
            raise ValueError(
                "`continuous_cache` needs the hidden states of "
                "`stream_log_probs(dataset, states=True)`. Received: keys "
                f"{sorted(scores)}"
            )
        nats = float(continuous_cache.stream_nats(scores))
        tokens = int(np.size(scores["log_probs"]))
    elif "log_likelihood" in scores and "num_tokens" in scores:
        nats = -float(np.sum(scores["log_likelihood"], dtype="float64"))
        tokens = int(np.sum(scores["num_tokens"]))
    elif "log_probs" in scores:
        nats = -float(np.sum(scores["log_probs"], dtype="float64"))
        tokens = int(np.size(scores["log_probs"]))
    else:
        raise ValueError(
            "`scores` must be the result of `score` (log_likelihood, num_tokens) "
            "or of `stream_log_probs` (log_probs). Received: keys "
            f"{sorted(scores)}"
        )
    if not isinstance(characters, int | np.integer):
        if isinstance(characters, str) or not isinstance(characters, Sequence):
            raise ValueError(
                "`characters` must be a number of characters or a list of "
                f"texts. Received: characters={characters!r:.80}"
            )
        characters = sum(len(text) for text in characters)
    return {
        "nats": nats,
        "tokens": tokens,
        "characters": int(characters),
        "bits_per_character": bits_per_character(nats, characters),
        "perplexity": perplexity(nats, tokens),
    }


def translation_scores(result: dict) -> dict:
    """BLEU, chrF and the length ratio (the hypotheses' length over the
    references', sacrebleu's) of an `evaluate_translations` result:
    `{"bleu", "chrf", "length_ratio"}` floats."""
    bleu = result["bleu"]
    return {
        "bleu": float(bleu.score),
        "chrf": float(result["chrf"].score),
        "length_ratio": bleu.sys_len / max(1, bleu.ref_len),
    }


def choose_length_penalty(
    translator,
    pairs,
    length_penalty=(0.6, 1.0, 1.5),
    *,
    title: str = "Translating (length penalty {length_penalty:g})",
    **options,
):
    """The beam's length penalty with the highest BLEU on held-out pairs.

    Each penalty decodes `pairs` once (`translator.evaluate_translations`);
    of equal BLEU the first penalty given wins. With `nearest_neighbors=`
    (kNN-MT), the penalty of the mixture's beam search: neighbours shift
    the length of what the beam prefers.

    Args:
        translator: a `keras_attn.models` translator with its tokenizers.
        pairs: held-out `(source, reference)` pairs (validation, not test).
        length_penalty: the GNMT length penalties tried (repeats are
            tried once).
        title: the progress heading of each decoding, formatted with
            `length_penalty`.
        **options: the other arguments of `evaluate_translations`
            (`beam_width`, `max_length`, `nearest_neighbors`, `verbose`).

    Returns:
        `(best, results)`: the chosen penalty, and each penalty tried with its
        `evaluate_translations` result (a dict, in the order tried).

    Example:

    ```python
    alpha, results = choose_length_penalty(
        translator, validation_pairs, (1.0, 1.5), nearest_neighbors=knn
    )
    print(alpha, translation_scores(results[alpha]))
    ```
    """
    penalties = tuple(dict.fromkeys(length_penalty))
    if not penalties:
        raise ValueError("`length_penalty` must hold at least one value. Received: ()")
    if any(not penalty >= 0 for penalty in penalties):
        raise ValueError(
            "Each `length_penalty` must be 0 or more. "
            f"Received: length_penalty={length_penalty!r}"
        )
    pairs = list(pairs)
    results = {}
    for penalty in penalties:
        results[penalty] = translator.evaluate_translations(
            pairs,
            length_penalty=penalty,
            title=title.format(length_penalty=penalty),
            **options,
        )
    best = max(penalties, key=lambda penalty: results[penalty]["bleu"].score)
    return best, results


def choose_knn_decoding(
    translator,
    datastore_data,
    validation_data,
    validation_pairs,
    *,
    k=(32, 64, 128),
    temperature=(10.0, 30.0, 100.0),
    lam=(0.1, 0.2, 0.3, 0.4, 0.5),
    length_penalty=(0.6, 1.0, 1.5),
    key_dtype: str = "auto",
    title: str = "Translating the validation split (kNN-MT, length penalty "
    "{length_penalty:g})",
    **options,
):
    """kNN-MT for a trained Transformer translator, its setting chosen on
    held-out data: the recipe of `examples/translate.py --knn`.

    Builds the datastore of `datastore_data`'s decoder states
    (`keras_attn.memory.translation_datastore`), chooses `k`, `temperature`
    and `lam` by the mixture's loss on `validation_data`
    (`keras_attn.memory.choose_knn`), then the beam's length penalty by BLEU
    on `validation_pairs` with those neighbours (`choose_length_penalty`).

    Args:
        translator: a `TransformerTranslator` with its tokenizers.
        datastore_data: batches of the pairs whose states fill the
            datastore (the training pairs, as `text.translation_dataset`
            gives them).
        validation_data: held-out batches in the same form.
        validation_pairs: held-out `(source, reference)` pairs to decode.
        k, temperature, lam: the kNN-MT settings tried (every combination).
        length_penalty: the beam's length penalties tried.
        key_dtype: the dtype of the datastore's keys at decoding time;
            "auto" is the global dtype policy's compute dtype.
        title: the progress heading of each decoding.
        **options: the other arguments of `evaluate_translations`
            (`beam_width`, `max_length`, `verbose`).

    Returns:
        `(decoding, length_penalty, report)`: the chosen
        `NearestNeighborDecoding` and penalty, and `choose_knn`'s report
        with `length_penalty_results` added (each penalty tried with its
        `evaluate_translations` result).
    """
    from keras_attn import memory

    if key_dtype == "auto":
        key_dtype = keras.config.dtype_policy().compute_dtype
    datastore = memory.translation_datastore(translator, datastore_data)
    decoding, report = memory.choose_knn(
        translator,
        datastore,
        validation_data,
        k=k,
        temperature=temperature,
        lam=lam,
        key_dtype=key_dtype,
    )
    penalty, results = choose_length_penalty(
        translator,
        validation_pairs,
        length_penalty,
        nearest_neighbors=decoding,
        title=title,
        **options,
    )
    return decoding, penalty, {**report, "length_penalty_results": results}


def _check_count(name: str, value) -> None:
    v.check_positive_int(name, value)
