"""benchmarks/task_bench.py end to end at tiny sizes (`--quick`: the test
fixture's sentences, one-block models): the results are complete and sane.
Speed is not asserted; the figures are in BENCHMARKS.md."""

import json
import math
import os
import subprocess
import sys

import pytest

from tests.test_case import REPO_ROOT

pytestmark = [
    pytest.mark.tf_only,  # WordPiece and SentencePiece: TensorFlow Text
    # 40 s of setup: the task methods themselves are tested in tests/models;
    # this checks that the benchmark still runs (make test-large).
    pytest.mark.large,
]


def numbers(tree):
    """Every int or float in a JSON tree (bools aside)."""
    if isinstance(tree, dict):
        return [n for value in tree.values() for n in numbers(value)]
    if isinstance(tree, (int, float)) and not isinstance(tree, bool):
        return [tree]
    return []


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("task_bench") / "results.json"
    script = os.path.join(REPO_ROOT, "benchmarks", "task_bench.py")
    done = subprocess.run(
        [sys.executable, script, "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3"},
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "| classify 130 texts, texts/s |" in done.stdout  # the printed table
    return json.loads(out.read_text())


def test_every_figure_is_finite_and_positive(results):
    found = numbers({k: v for k, v in results.items() if k != "machine"})
    assert len(found) > 30
    assert all(math.isfinite(n) and n > 0 for n in found)


def test_classify_side_by_side(results):
    classify = results["classify"]
    assert classify["texts"] == 130
    for name in ("keras_attn", "keras_hub", "eager", "compiled"):
        assert classify[f"{name}_texts_per_s"] > 0
    assert classify["ratio"] == pytest.approx(
        classify["keras_attn_texts_per_s"] / classify["keras_hub_texts_per_s"]
    )
    assert classify["keras_hub_width"] == 128
    assert 8 <= classify["mean_padded_width"] <= 128
    assert 0 < classify["mean_tokens"] <= classify["mean_padded_width"]
    single = results["single_text"]
    for name in ("classify", "forward", "predict_on_batch", "keras_hub_predict"):
        assert single[f"{name}_ms"] > 0
    assert single["tokens"] <= single["width"] <= 128


def test_memory_of_each_size_and_task_in_a_fresh_process(results):
    memory = results["classify_memory"]
    assert sorted(memory, key=int) == ["40", "130"]
    runs = [memory["40"], memory["130"], results["translate"], results["score"]]
    for run in runs:
        assert run["texts"] > 0 and run["chars"] > 0 and run["seconds"] > 0
        # A Python process with TensorFlow loaded holds hundreds of MiB.
        assert 100 < run["rss_before_mib"] <= run["run_peak_mib"] <= run["peak_mib"]
    assert results["classify_memory_ratio"] == pytest.approx(
        memory["130"]["peak_mib"] / memory["40"]["peak_mib"]
    )
    assert results["translate"]["texts"] == 8
    assert results["score"]["chars"] == 3000


def test_the_machine_is_named(results):
    machine = results["machine"]
    assert machine["cpus"] >= 1 and machine["cpu"]
    assert isinstance(machine["avx512_bf16"], bool)
    assert isinstance(machine["amx_bf16"], bool)
