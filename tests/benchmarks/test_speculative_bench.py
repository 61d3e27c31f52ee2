"""benchmarks/speculative_bench.py on small saved runs (a language model and
a translator, each with its own draft): every method gives plain greedy
decoding's text, at batch 1 and at the whole batch, with its speed, speed-up
and (language model) acceptance rate. Speed is not asserted. The text
methods need TensorFlow Text (`tf_only`)."""

import json
from types import SimpleNamespace

import pytest

from benchmarks import speculative_bench as bench
from tests.models.test_language_model_assistant import language_model
from tests.models.test_speculative_translation import translator
from tests.models.test_translator_assistant import TEXTS, with_draft

pytestmark = pytest.mark.tf_only

PROMPTS = ["where is the station", "i am very tired today", "the dog", "a"]


def save_run(model, path):
    path.mkdir()
    model.save(path / "model.keras")
    (path / "metrics.json").write_text(json.dumps({"config": {"alternatives": None}}))
    return path


@pytest.mark.slow  # about 45 s: each method compiles per batch size
def test_language_model_rows(small_tokenizer, tmp_path, monkeypatch):
    draft = language_model(small_tokenizer, 1, 8, seed=2)
    model = language_model(small_tokenizer, 2, 16, seed=1, assistant_model=draft)
    run = save_run(model, tmp_path / "lm")
    monkeypatch.setattr(bench, "lm_prompts", lambda count: PROMPTS[:count])
    rows = bench.language_model_rows(run, 4, 6, rounds=1, k=3)
    assert [(row["batch"], row["method"]) for row in rows] == [
        (batch, method)
        for batch in (1, 4)
        for method in ("plain", "draft", "prompt_lookup")
    ]
    for row in rows:
        # Greedy decoding's text whatever checks the guesses.
        assert row["same_as_plain"] is True
        assert row["seconds"] > 0 and row["tokens_per_second"] > 0
        assert row["new_tokens"] == rows[0]["new_tokens"] > 0
        assert row["speedup"] == pytest.approx(
            rows[0 if row["batch"] == 1 else 3]["seconds"] / row["seconds"]
        )
        if row["method"] == "plain":
            assert row["acceptance_rate"] is None
        else:
            assert 0.0 <= row["acceptance_rate"] <= 1.0


def test_a_perfect_draft_has_every_guess_kept(small_tokenizer):
    """A draft with the model's own weights keeps every guess: rows of one
    prompt (so that no row has more room than `new_tokens`, which greedy
    decoding fills here: no end token) take `new_tokens / (k + 1)` rounds
    each. An unrelated random draft keeps few."""
    model = language_model(small_tokenizer, 2, 16, seed=1)
    twin = language_model(small_tokenizer, 2, 16, seed=1)  # the same weights
    other = language_model(small_tokenizer, 1, 8, seed=2)
    prompts = [PROMPTS[0]] * 3
    assert bench.acceptance_rate(model, twin, prompts, 8, 3) == 1.0
    assert bench.acceptance_rate(model, other, prompts, 8, 3) < 0.5


# About 60 s on a 2-core AVX2 machine: `make test-large`;
# test_language_model_rows runs the bench's shared code in `make test-slow`, and
# tests/models/test_speculative_translation.py the translator's decoding.
@pytest.mark.large
def test_translator_rows(small_tokenizer, tmp_path, monkeypatch):
    draft = translator(1, 16, seed=4, tokenizer=small_tokenizer)
    run = save_run(with_draft(small_tokenizer, 3, draft), tmp_path / "translator")
    pairs = SimpleNamespace(test=[(text, "") for text in TEXTS])
    monkeypatch.setattr(
        "keras_attn.datasets.load_translation_pairs", lambda *a, **k: pairs
    )
    rows = bench.translator_rows(run, 4, rounds=1, k=3)
    assert [(row["batch"], row["method"]) for row in rows] == [
        (1, "plain"), (1, "draft"), (4, "plain"), (4, "draft")
    ]  # fmt: skip
    for row in rows:
        assert row["same_as_plain"] is True
        assert row["sentences_per_second"] == pytest.approx(4 / row["seconds"])


def test_a_run_without_a_draft_is_refused(small_tokenizer, tmp_path):
    run = save_run(language_model(small_tokenizer, 1, 8, seed=2), tmp_path / "lm")
    with pytest.raises(SystemExit, match="has no draft"):
        bench.load(run)


def test_jit_compile_sets_the_loaded_tasks_jit_compile(
    small_tokenizer, tmp_path, monkeypatch
):
    """`--jit-compile`: the runs load with `jit_compile = True`, so their
    decodings compile with XLA (tests/models/test_xla_decoding.py)."""
    draft = language_model(small_tokenizer, 1, 8, seed=2)
    run = save_run(language_model(small_tokenizer, 1, 8, seed=1, assistant_model=draft),
                   tmp_path / "lm")  # fmt: skip
    assert bench.load(run)[0].jit_compile is False
    monkeypatch.setattr(bench, "JIT_COMPILE", True)
    assert bench.load(run)[0].jit_compile is True
