"""Evaluation recipes: bits per character and perplexity of scored text,
a translation evaluation's figures, the beam's length penalty chosen on
held-out pairs."""

import math
import types

import numpy as np
import pytest

from keras_attn import training

LN2 = math.log(2)


def test_bits_per_character_and_perplexity_by_hand():
    # 10 bits of surprise over 5 characters; 3 tokens at 1/4 each.
    assert training.bits_per_character(10 * LN2, 5) == pytest.approx(2.0)
    assert training.perplexity(3 * math.log(4), 3) == pytest.approx(4.0)
    assert training.perplexity(0.0, 7) == 1.0  # a certain model


@pytest.mark.parametrize("call", [training.bits_per_character, training.perplexity])
@pytest.mark.parametrize("count", [0, -3, 2.5, True])
def test_counts_must_be_positive_ints(call, count):
    with pytest.raises(ValueError, match=r"must be a positive integer\. Received: "):
        call(1.0, count)


def test_the_figures_of_score_sum_over_the_texts():
    """`score`'s per-text log-likelihoods and token counts (end tokens
    included), over the texts' characters."""
    texts = ["abcd", "efghij"]  # 10 characters
    scores = {
        "log_likelihood": np.array([-4 * LN2, -6 * LN2], "float32"),
        "num_tokens": np.array([2, 3], "int32"),
    }
    figures = training.language_model_metrics(scores, texts)
    assert figures["characters"] == 10 and figures["tokens"] == 5
    assert figures["nats"] == pytest.approx(10 * LN2)
    assert figures["bits_per_character"] == pytest.approx(1.0)
    assert figures["perplexity"] == pytest.approx(4.0)  # 2 bits per token
    # A count of characters gives the same.
    assert training.language_model_metrics(scores, 10) == figures


def test_the_figures_of_a_stream_sum_its_targets():
    """`stream_log_probs`' one log-probability per target, as the language
    model script reports them."""
    scores = {"log_probs": np.full(5, -math.log(4), "float32")}
    figures = training.language_model_metrics(scores, 10)
    assert figures["tokens"] == 5
    assert figures["bits_per_character"] == pytest.approx(1.0)
    assert figures["perplexity"] == pytest.approx(4.0)


def test_a_continuous_cache_scores_the_stream_with_its_mixture():
    class Cache:
        def stream_nats(self, scores):
            self.seen = scores
            return 5 * LN2  # half the model's surprise

    cache = Cache()
    scores = {"log_probs": np.full(5, -math.log(4)), "states": np.zeros((5, 2))}
    figures = training.language_model_metrics(scores, 10, continuous_cache=cache)
    assert cache.seen is scores
    assert figures["bits_per_character"] == pytest.approx(0.5)
    assert figures["perplexity"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="needs the hidden states"):
        training.language_model_metrics({"log_probs": [-1.0]}, 1, cache)


@pytest.mark.parametrize(
    "scores, characters, message",
    [
        ({"loss": 1.0}, 1, "must be the result of `score`"),
        ({"log_probs": [-1.0]}, "abc", "a number of characters or a list of texts"),
        ({"log_probs": [-1.0]}, 0, "`characters` must be a positive int"),
    ],
)
def test_bad_language_model_metrics_arguments_are_named(scores, characters, message):
    with pytest.raises(ValueError, match=message):
        training.language_model_metrics(scores, characters)


def evaluation(bleu, chrf=50.0, sys_len=9, ref_len=10):
    """What `evaluate_translations` returns, as far as these read it."""
    return {
        "bleu": types.SimpleNamespace(score=bleu, sys_len=sys_len, ref_len=ref_len),
        "chrf": types.SimpleNamespace(score=chrf),
    }


def test_translation_scores_read_bleu_chrf_and_the_length_ratio():
    assert training.translation_scores(evaluation(31.5, 60.25)) == {
        "bleu": 31.5,
        "chrf": 60.25,
        "length_ratio": 0.9,
    }
    assert training.translation_scores(evaluation(0.0, ref_len=0))["length_ratio"] == 9


class FakeTranslator:
    """`evaluate_translations` with a BLEU per length penalty."""

    def __init__(self, bleu_of):
        self.bleu_of = bleu_of
        self.calls = []

    def evaluate_translations(self, pairs, **options):
        self.calls.append({"pairs": pairs, **options})
        return evaluation(self.bleu_of[options["length_penalty"]])


def test_the_length_penalty_with_the_highest_bleu_wins():
    translator = FakeTranslator({0.6: 20.0, 1.0: 25.0, 1.5: 22.0})
    pairs = [("a", "b"), ("c", "d")]
    best, results = training.choose_length_penalty(
        translator, iter(pairs), (0.6, 1.0, 1.5, 1.0), beam_width=2, verbose=0
    )
    assert best == 1.0
    assert list(results) == [0.6, 1.0, 1.5]  # each penalty decoded once, in order
    assert results[1.5]["bleu"].score == 22.0
    assert [call["length_penalty"] for call in translator.calls] == [0.6, 1.0, 1.5]
    for call in translator.calls:  # the options reach every decoding
        assert call["pairs"] == pairs and call["beam_width"] == 2
        assert call["verbose"] == 0


def test_equal_bleu_keeps_the_first_penalty_and_titles_are_formatted():
    translator = FakeTranslator({1.5: 30.0, 1.0: 30.0})
    knn = object()
    best, _ = training.choose_length_penalty(
        translator,
        [("a", "b")],
        (1.5, 1.0),
        nearest_neighbors=knn,
        title="validation (kNN-MT, length penalty {length_penalty:g})",
    )
    assert best == 1.5
    assert [call["title"] for call in translator.calls] == [
        "validation (kNN-MT, length penalty 1.5)",
        "validation (kNN-MT, length penalty 1)",
    ]
    assert all(call["nearest_neighbors"] is knn for call in translator.calls)


@pytest.mark.parametrize(
    "penalties, message",
    [((), "must hold at least one value"), ((1.0, -0.5), "must be 0 or more")],
)
def test_bad_length_penalties_are_refused_before_decoding(penalties, message):
    translator = FakeTranslator({})
    with pytest.raises(ValueError, match=message):
        training.choose_length_penalty(translator, [("a", "b")], penalties)
    assert translator.calls == []


@pytest.mark.tf_only
def test_the_figures_of_a_language_models_own_score_and_stream(tmp_path):
    """`score(texts)` and `stream_log_probs` of a real model: the figures
    are their sums, with the cache mixed in where one is given."""
    from pathlib import Path

    from keras_attn import memory
    from keras_attn.models import TransformerLanguageModel
    from keras_attn.text import (
        SubwordTokenizer,
        language_model_dataset,
        train_subword_vocabulary,
    )

    text = (Path(__file__).parents[1] / "fixtures" / "play_sample.txt").read_text()
    tokenizer = SubwordTokenizer(
        train_subword_vocabulary(
            [text], tmp_path / "v.model", vocabulary_size=400, lossless=True
        )
    )
    model = TransformerLanguageModel(
        tokenizer.vocabulary_size,
        32,
        embedding_dim=8,
        num_layers=1,
        num_heads=2,
        intermediate_dim=16,
        tokenizer=tokenizer,
    )
    texts = [text[:200], text[200:300]]
    scores = model.score(texts)
    figures = training.language_model_metrics(scores, texts)
    nats = -float(np.sum(scores["log_likelihood"], dtype="float64"))
    assert figures["tokens"] == int(np.sum(scores["num_tokens"]))
    assert figures["bits_per_character"] == pytest.approx(nats / LN2 / 300)
    assert figures["perplexity"] == pytest.approx(math.exp(nats / figures["tokens"]))

    stream = model.stream_log_probs(
        language_model_dataset(
            text, tokenizer, sequence_length=32, shuffle=False, document_tokens=True
        ),
        states=True,
    )
    cache = memory.ContinuousCache(theta=0.5, lam=0.3)
    alone = training.language_model_metrics(stream, len(text))
    mixed = training.language_model_metrics(stream, len(text), cache)
    assert alone["tokens"] == mixed["tokens"] == len(stream["targets"])
    assert mixed["nats"] == pytest.approx(cache.stream_nats(stream))
    assert alone["nats"] == pytest.approx(-np.sum(stream["log_probs"], dtype="float64"))
