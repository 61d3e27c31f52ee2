"""benchmarks/streaming_bench.py end to end at tiny sizes (`--quick`: a
one-block model, three rounds): every figure is there, finite and positive,
and the script's own check (every stream joins to `generate`'s text) held.
Speed is not asserted; the figures are in docs/GENERATION.md."""

import json
import math
import os
import subprocess
import sys

import pytest

from tests.test_case import REPO_ROOT

pytestmark = [
    pytest.mark.tf_only,  # SentencePiece: TensorFlow Text (the script's default)
    pytest.mark.large,  # a benchmark run: make test-large
]


def test_the_quick_run_reports_every_figure(tmp_path):
    out = tmp_path / "results.json"
    script = os.path.join(REPO_ROOT, "benchmarks", "streaming_bench.py")
    done = subprocess.run(
        [sys.executable, script, "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3"},
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "| time to the first streamed piece |" in done.stdout
    results = json.loads(out.read_text())
    figures = [
        results["prompt_pass_ms"],
        results["first_piece_ms"],
        results["generate_ms"],
        results["first_piece_over_prompt_pass"],
        *results["stream_ms"].values(),
    ]
    assert len(figures) == 7
    assert all(math.isfinite(x) and x > 0 for x in figures)
    assert sorted(results["stream_ms"]) == ["1", "32", "8"]
    assert results["first_piece_over_prompt_pass"] == pytest.approx(
        results["first_piece_ms"] / results["prompt_pass_ms"]
    )
