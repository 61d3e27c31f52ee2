import json
import math
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_attn.export import check_servable, export_language_model
from keras_attn.memory import ContinuousCache
from keras_attn.models import TransformerLanguageModel
from keras_attn.text import END_ID, START_ID
from tests.export.conftest import assert_bad_requests_leave_no_trace, nasty_batch

pytestmark = pytest.mark.tf_only

CONTEXT = 16


def small_language_model(tokenizer, embedding_dim=16, **kwargs):
    return TransformerLanguageModel(
        tokenizer.vocabulary_size,
        sequence_length=CONTEXT,
        embedding_dim=embedding_dim,
        num_layers=1,
        num_heads=2,
        intermediate_dim=2 * embedding_dim,
        tokenizer=tokenizer,
        **kwargs,
    )


@pytest.fixture(scope="module")
def exported(small_tokenizer, tmp_path_factory):
    # Weights fixed whatever ran before in the process: the cache tests
    # below need the cache's mixture to move the scores measurably.
    keras.utils.set_random_seed(0)
    model = small_language_model(small_tokenizer)
    base = tmp_path_factory.mktemp("export")
    path = model.export(base, max_new_tokens=6)
    return model, small_tokenizer, path


def reference_log_likelihood(model, tokenizer, text):
    """Token by token, each target with the left context of the window that
    scores it in `score_ids`: windows of CONTEXT inputs every CONTEXT // 2
    positions, the first scoring its CONTEXT targets and each later one its
    last CONTEXT // 2 (the model is causal, so the window's logits at a
    target are those of the window cut after it). Up to CONTEXT + 1 tokens
    that is the whole growing left context."""
    ids = [START_ID, *tokenizer.tokenize(text).numpy().tolist(), END_ID]
    stride = CONTEXT // 2
    total = 0.0
    for position in range(1, len(ids)):
        later = max(0, position - CONTEXT)  # targets past the first window
        begin = -(-later // stride) * stride  # that of the window scoring it
        context = ids[begin:position]
        logits = np.asarray(model(np.array([context], "int32")), "float64")[0, -1]
        log_probs = logits - logits.max()
        log_probs -= np.log(np.exp(log_probs).sum())
        total += log_probs[ids[position]]
    return total, len(ids) - 1


def test_servable(exported):
    _, _, path = exported
    report = check_servable(path, verbose=False)
    assert report.ok, str(report)
    assert report.signatures == ["score", "serving_default"]


def test_score_of_short_and_long_texts(exported):
    model, tokenizer, path = exported
    score = tf.saved_model.load(str(path)).signatures["score"]
    short = "where is the house"
    long_text = " ".join(["the station is near the house"] * 8)  # > CONTEXT tokens
    outputs = score(text=tf.constant([short, long_text]))
    want_short, count_short = reference_log_likelihood(model, tokenizer, short)
    assert outputs["num_tokens"].numpy()[0] == count_short
    np.testing.assert_allclose(
        outputs["log_likelihood"].numpy()[0], want_short, rtol=1e-5
    )
    # The long text is scored whole: every token counted, none truncated.
    count_long = len(tokenizer.tokenize(long_text).numpy()) + 1
    assert count_long > CONTEXT
    assert outputs["num_tokens"].numpy()[1] == count_long
    log_likelihood = outputs["log_likelihood"].numpy()[1]
    assert math.isfinite(log_likelihood) and log_likelihood < 0
    # Each token scored with its window's context: the same figure up to
    # float32 rounding (1.7e-7 per token measured). On this untrained model
    # windows one token too far apart (stride 9, not 8) moved it by 1.1e-3
    # per token, and the growing context of a plain token-by-token scorer by
    # 1.4e-2.
    want_long, _ = reference_log_likelihood(model, tokenizer, long_text)
    np.testing.assert_allclose(
        log_likelihood / count_long, want_long / count_long, rtol=0, atol=1e-5
    )


def test_bad_input_on_the_export(exported):
    _, _, path = exported
    loaded = tf.saved_model.load(str(path))
    batch = tf.constant(nasty_batch())
    completion = loaded.signatures["serving_default"](prompt=batch)["completion"]
    assert completion.shape == (len(nasty_batch()),)
    scores = loaded.signatures["score"](text=batch)
    assert np.isfinite(scores["log_likelihood"].numpy()).all()
    assert (scores["num_tokens"].numpy() >= 1).all()  # the end token at least
    empty = loaded.signatures["serving_default"](prompt=tf.zeros([0], tf.string))
    assert empty["completion"].shape == (0,)
    assert loaded.signatures["score"](text=tf.zeros([0], tf.string))[
        "log_likelihood"
    ].shape == (0,)
    big = loaded.signatures["serving_default"](prompt=tf.constant(["the"] * 256))
    assert big["completion"].shape == (256,)


@pytest.mark.parametrize(
    ("signature", "input_name"), [("serving_default", "prompt"), ("score", "text")]
)
def test_bad_requests_through_the_serve_tag_loader_leave_no_trace(
    exported, signature, input_name
):
    from serving_standin import StandInServer

    _, _, path = exported
    with StandInServer(path) as server:
        assert_bad_requests_leave_no_trace(
            server, signature, input_name, ["To be, or not", "where is the house"]
        )


CACHE = ContinuousCache(theta=0.5, lam=0.3)


@pytest.fixture(scope="module")
def exported_with_cache(exported, tmp_path_factory):
    model, _, _ = exported
    base = tmp_path_factory.mktemp("export_cache")
    windowed = ContinuousCache(theta=0.5, lam=0.3, window=5)
    return {
        cache: export_language_model(
            model, base, max_new_tokens=6, continuous_cache=cache
        )
        for cache in (CACHE, windowed)
    }


def reference_cache_scores(model, tokenizer, text, cache):
    """The export's windows (CONTEXT inputs every CONTEXT // 2 positions, each
    scoring the targets the previous one did not) computed one by one, then
    the cache of keras_attn.memory over the text's states."""
    ids = [START_ID, *tokenizer.tokenize(text).numpy().tolist(), END_ID]
    scorer = model.call_with_states
    stride = CONTEXT // 2
    states, log_probs = [], []
    begin, first_new = 0, 0
    while begin + first_new < len(ids) - 1:
        window = ids[begin : begin + CONTEXT + 1]
        window_states, logits = scorer(np.array([window[:-1]], "int32"))
        logits = np.asarray(logits, "float64")[0]
        window_log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        for position in range(first_new, len(window) - 1):
            states.append(np.asarray(window_states)[0, position])
            log_probs.append(window_log_probs[position, window[position + 1]])
        begin, first_new = begin + stride, CONTEXT - stride
    targets = np.array(ids[1:])
    assert len(states) == len(targets)  # every target once, in order
    mixed = np.asarray(
        cache.log_probs(
            np.stack(states),
            targets,
            np.array(log_probs, "float32"),
            np.zeros_like(targets),
        )
    )
    return float(np.sum(mixed)), float(np.sum(log_probs)), len(targets)


def test_the_cache_export_scores_as_the_cache_of_keras_attn_memory(
    exported, exported_with_cache
):
    model, tokenizer, plain_path = exported
    texts = [
        "where is the house",  # one window
        " ".join(["the station is near the house"] * 8),  # several windows
        "the house the house the house the house",  # repeats: the cache helps
    ]
    plain = tf.saved_model.load(str(plain_path)).signatures["score"](
        text=tf.constant(texts)
    )
    for cache, path in exported_with_cache.items():
        outputs = tf.saved_model.load(str(path)).signatures["score"](
            text=tf.constant(texts)
        )
        assert sorted(outputs) == [
            "log_likelihood",
            "model_log_likelihood",
            "num_tokens",
        ]
        # The model's own figure is the export without the cache's.
        np.testing.assert_allclose(
            outputs["model_log_likelihood"].numpy(),
            plain["log_likelihood"].numpy(),
            rtol=1e-5,
        )
        np.testing.assert_array_equal(
            outputs["num_tokens"].numpy(), plain["num_tokens"].numpy()
        )
        for row, text in enumerate(texts):
            want, want_model, count = reference_cache_scores(
                model, tokenizer, text, cache
            )
            assert outputs["num_tokens"].numpy()[row] == count
            np.testing.assert_allclose(
                outputs["model_log_likelihood"].numpy()[row], want_model, rtol=1e-4
            )
            np.testing.assert_allclose(
                outputs["log_likelihood"].numpy()[row], want, rtol=1e-4
            )
            assert outputs["log_likelihood"].numpy()[row] != pytest.approx(
                want_model, rel=1e-3
            )  # the cache took part
    # The window changed what the cache saw in the long texts.
    whole, windowed = (
        tf.saved_model.load(str(path)).signatures["score"](text=tf.constant(texts))[
            "log_likelihood"
        ]
        for path in exported_with_cache.values()
    )
    assert whole.numpy()[1] != pytest.approx(windowed.numpy()[1], rel=1e-4)


# Slow: the cache export's answers:
# test_the_cache_export_scores_as_the_cache_of_keras_attn_memory; the export's
# servability: test_servable
@pytest.mark.slow
def test_the_cache_export_is_servable_and_takes_any_input(exported_with_cache):
    path = exported_with_cache[CACHE]
    report = check_servable(path, verbose=False)
    assert report.ok, str(report)
    metadata = json.loads((path / "assets.extra" / "keras_attn.json").read_text())
    assert metadata["continuous_cache"] == {"theta": 0.5, "lambda": 0.3, "window": None}
    assert list(metadata["signatures"]["score"]["outputs"]) == [
        "log_likelihood",
        "model_log_likelihood",
        "num_tokens",
    ]
    score = tf.saved_model.load(str(path)).signatures["score"]
    outputs = score(text=tf.constant(nasty_batch()))
    for name in ("log_likelihood", "model_log_likelihood"):
        assert np.isfinite(outputs[name].numpy()).all(), name
    assert score(text=tf.zeros([0], tf.string))["log_likelihood"].shape == (0,)


def test_the_continuous_cache_argument_is_checked(exported, tmp_path):
    model, _, _ = exported
    with pytest.raises(
        ValueError,
        match=re.escape(
            "`continuous_cache` must be a keras_attn.memory.ContinuousCache or None. "
            "Received: continuous_cache={'theta': 0.5}"
        ),
    ):
        export_language_model(model, tmp_path, continuous_cache={"theta": 0.5})


def test_the_export_answers_what_generate_and_score_give(exported, exported_with_cache):
    model, _, path = exported
    texts = ["where is the house", " ".join(["the station is near the house"] * 8)]
    loaded = tf.saved_model.load(str(path))
    served = loaded.signatures["serving_default"](prompt=tf.constant(texts))
    completions = [c.decode("utf-8") for c in served["completion"].numpy()]
    assert completions == model.generate(texts, max_new_tokens=6)
    for cache, cache_path in [(None, path), *exported_with_cache.items()]:
        outputs = tf.saved_model.load(str(cache_path)).signatures["score"](
            text=tf.constant(texts)
        )
        eager = model.score(texts, continuous_cache=cache)
        assert sorted(eager) == sorted(outputs)
        for name, value in eager.items():
            np.testing.assert_allclose(outputs[name].numpy(), value, rtol=1e-5)


def test_completions_are_valid_utf8(small_tokenizer, tmp_path, monkeypatch):
    """Tokens that decode to bytes that are no UTF-8 text (a byte-level
    vocabulary can emit them) are served with U+FFFD in their place, as the
    eager `generate` gives them: forced here by a tokenizer whose text ends
    with the lone lead byte 0xC3."""
    from keras_attn.export import language_model as module
    from keras_attn.text import SubwordTokenizer

    class BadBytes(SubwordTokenizer):
        def detokenize(self, ids):
            return tf.strings.join([super().detokenize(ids), b"\xc3("])

    monkeypatch.setattr(module, "SubwordTokenizer", BadBytes)
    model = small_language_model(small_tokenizer)
    path = model.export(tmp_path, max_new_tokens=3)
    served = tf.saved_model.load(str(path)).signatures["serving_default"]
    prompts = ["KING:", "", "\xff\xfe"]
    completions = served(prompt=tf.constant(prompts))["completion"].numpy()
    expected = model.generate(prompts, max_new_tokens=3)
    for completion, eager in zip(completions, expected, strict=True):
        text = completion.decode("utf-8")  # strict: raises if not UTF-8
        assert text == eager + "\ufffd("


@pytest.fixture(scope="module")
def exported_with_a_draft(small_tokenizer, tmp_path_factory):
    model = small_language_model(small_tokenizer)
    draft = small_language_model(small_tokenizer, embedding_dim=8, name="draft")
    path = model.export(
        tmp_path_factory.mktemp("export"),
        max_new_tokens=6,
        assistant_model=draft,
        num_speculative_tokens=3,
    )
    return model, draft, path


def test_an_export_with_a_draft_completes_as_greedy_decoding(exported_with_a_draft):
    """Speculative decoding in the served graph: the draft's weights in the
    SavedModel, the completions those of plain greedy decoding in process."""
    model, draft, path = exported_with_a_draft
    metadata = json.loads((path / "assets.extra" / "keras_attn.json").read_text())
    assert metadata["assistant"] == {
        "kind": "draft_model",
        "num_speculative_tokens": 3,
        "num_layers": 1,
        "embedding_dim": 8,
        "parameters": draft.count_params(),
    }
    loaded = tf.saved_model.load(str(path))
    saved = {v.numpy().tobytes() for v in loaded.variables}
    assert all(w.numpy().tobytes() in saved for w in draft.weights)
    prompts = ["where is the house", "", "the station is near the"]
    completions = loaded.signatures["serving_default"](prompt=tf.constant(prompts))
    got = [c.decode("utf-8") for c in completions["completion"].numpy()]
    assert got == model.generate(prompts, max_new_tokens=6)


# Slow (a TensorFlow process of its own): the export's answers in
# test_an_export_with_a_draft_completes_as_greedy_decoding, a plain export's
# servability in test_servable.
@pytest.mark.slow
def test_an_export_with_a_draft_is_servable(exported_with_a_draft):
    _, _, path = exported_with_a_draft
    report = check_servable(path, verbose=False)
    assert report.ok, str(report)
    assert report.signatures == ["score", "serving_default"]


# Slow: test_an_export_with_a_draft_completes_as_greedy_decoding serves the
# speculative loop, and tests/generation/test_speculative.py checks prompt
# lookup's tokens in process.
@pytest.mark.slow
def test_an_export_with_prompt_lookup_completes_as_greedy_decoding(
    small_tokenizer, tmp_path
):
    model = small_language_model(small_tokenizer)
    path = model.export(tmp_path, max_new_tokens=6, assistant_model="prompt_lookup")
    metadata = json.loads((path / "assets.extra" / "keras_attn.json").read_text())
    assert metadata["assistant"] == {
        "kind": "prompt_lookup",
        "num_speculative_tokens": 4,
    }
    prompts = ["the house the house the", "where"]
    serve = tf.saved_model.load(str(path)).signatures["serving_default"]
    got = [
        c.decode("utf-8")
        for c in serve(prompt=tf.constant(prompts))["completion"].numpy()
    ]
    assert got == model.generate(prompts, max_new_tokens=6)


def test_a_bad_assistant_is_refused_before_exporting(small_tokenizer, tmp_path):
    model = small_language_model(small_tokenizer)
    with pytest.raises(ValueError, match="`assistant_model` must be a Transformer"):
        model.export(tmp_path, assistant_model="ngrams")
    with pytest.raises(ValueError, match="`num_speculative_tokens` must be a positive"):
        model.export(
            tmp_path, assistant_model="prompt_lookup", num_speculative_tokens=0
        )
    assert not any(tmp_path.iterdir())
