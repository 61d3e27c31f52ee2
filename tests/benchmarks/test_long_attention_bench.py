"""benchmarks/long_attention_bench.py end to end at a tiny length (64), op
level on TensorFlow and JAX, layer level on JAX: every row has its time, its
GFLOP/s of attention's useful work, its shares of the matmul peaks and its
peak memory, and the paths' outputs agree (the script's `max_difference`,
for PyTorch's `scaled_dot_product_attention` too when torch is installed).
Speed is not asserted. The fast tests check the figures' arithmetic."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import long_attention_bench as bench
from tests.test_case import REPO_ROOT

SCRIPT = os.path.join(REPO_ROOT, "benchmarks", "long_attention_bench.py")
LENGTH = 64
# The largest output difference from the first path's: float32 round-off, and
# for bfloat16 outputs two units in the last place at magnitudes below 8 (the
# values are below 5 at this length): 2 * 2**-7 * 4.
TOLERANCE = {"float32": 1e-5, "mixed_bfloat16": 2**-4}
TINY = ["--lengths", str(LENGTH), "--rounds", "1", "--peak-size", "256"]


def run_script(tmp_path, *arguments, env=None):
    out = tmp_path / "results.json"
    done = subprocess.run(
        [sys.executable, SCRIPT, *arguments, *TINY, "--json", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **(env or {})},
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout, json.loads(out.read_text())


def check_rows(rows, backend, level, causal, policies, paths):
    assert [(r["policy"], r["path"]) for r in rows] == [
        (policy, path) for policy in policies for path in paths
    ]
    for row in rows:
        assert (row["backend"], row["level"], row["causal"]) == (backend, level, causal)
        # Each point's own process ran the backend asked for; a torch point
        # imported neither Keras nor its backend.
        assert row["point_backend"] == (None if row["path"] == "torch" else backend)
        assert row["length"] == LENGTH
        assert isinstance(row["peak_bytes"], int) and row["peak_bytes"] >= 0
        assert math.isfinite(row["seconds"]) and row["seconds"] > 0
        assert math.isfinite(row["peak_gflops"]) and row["peak_gflops"] > 0
        assert row["gflops"] == pytest.approx(
            bench.useful_flops(LENGTH, causal) / row["seconds"] / 1e9
        )
        assert row["share"] == pytest.approx(row["gflops"] / row["peak_gflops"])
        if row["policy"] == "mixed_bfloat16":
            assert row["bfloat16_peak_gflops"] > 0
            assert row["bfloat16_share"] == pytest.approx(
                row["gflops"] / row["bfloat16_peak_gflops"]
            )
        else:
            assert "bfloat16_peak_gflops" not in row
        # The same inputs (and weights) on every path: the outputs agree.
        assert row["max_difference"] <= TOLERANCE[row["policy"]], row
    for policy in policies:
        first = next(r for r in rows if r["policy"] == policy)
        assert first["max_difference"] == 0.0


@pytest.mark.large  # about a minute: a benchmark run, a process per point
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("tensorflow", marks=pytest.mark.tf_only),
        pytest.param("jax", marks=pytest.mark.jax_only),
    ],
)
def test_op_level_rows(tmp_path, backend, causal):
    stdout, rows = run_script(
        tmp_path,
        "--backend",
        backend,
        "--level",
        "op",
        *(["--causal"] if causal else []),
        # The script's own process and its point processes take --backend,
        # whatever the environment says.
        env={"KERAS_BACKEND": "jax" if backend == "tensorflow" else "tensorflow"},
    )
    paths = ["keras", "memory_efficient"]
    if bench.torch_available() is None:
        paths.append("torch")
    else:
        assert "no torch path" in stdout
    check_rows(rows, backend, "op", causal, ["float32", "mixed_bfloat16"], paths)
    assert stdout.startswith(f"{backend}: the attention op")
    header = stdout.splitlines()[1]
    assert header.startswith("CPU: ") and "avx512_bf16" in header and "AMX" in header
    assert "| GFLOP/s | share of f32 peak | share of bf16 peak |" in stdout


@pytest.mark.torch_only  # make test-torch only: about 30 s
def test_op_level_rows_on_pytorch(tmp_path):
    """On the PyTorch backend the op level runs eagerly; `keras_attn` is
    `dot_product_attention`'s own choice (PyTorch's CPU flash kernel)."""
    paths = ["keras", "keras_attn", "memory_efficient", "torch"]
    stdout, rows = run_script(
        tmp_path,
        "--backend",
        "torch",
        "--level",
        "op",
        "--policies",
        "float32",
        "--paths",
        *paths,
    )
    check_rows(rows, "torch", "op", False, ["float32"], paths)
    assert stdout.startswith("torch: the attention op")


def test_pytorch_backend_is_for_the_op_level_only(tmp_path):
    done = subprocess.run(
        [sys.executable, SCRIPT, "--backend", "torch", "--level", "layer"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=300,
    )
    assert done.returncode == 2
    assert "--backend torch: the op level only" in done.stderr
    assert "Received: --level layer" in done.stderr


@pytest.mark.large
@pytest.mark.jax_only
def test_layer_level_on_jax(tmp_path):
    _, rows = run_script(
        tmp_path,
        "--backend",
        "jax",
        "--policies",
        "float32",
        "--paths",
        "keras",
        "memory_efficient",
        "--causal",
    )
    check_rows(rows, "jax", "layer", True, ["float32"], ["keras", "memory_efficient"])


@pytest.mark.large
@pytest.mark.tf_only  # the script's default backend
def test_without_torch_the_torch_path_is_a_note(tmp_path):
    blocked = tmp_path / "blocked"
    (blocked / "torch").mkdir(parents=True)
    (blocked / "torch" / "__init__.py").write_text(
        "raise ImportError('torch blocked by the test')\n"
    )
    python_path = os.pathsep.join([str(blocked), os.environ.get("PYTHONPATH", "")])
    stdout, rows = run_script(
        tmp_path,
        "--level",
        "op",
        "--policies",
        "float32",
        "--paths",
        "memory_efficient",
        "torch",
        env={"PYTHONPATH": python_path},
    )
    assert [r["path"] for r in rows] == ["memory_efficient"]
    assert "- no torch path: `import torch` failed (ImportError: torch blocked" in (
        stdout
    )


def test_useful_flops():
    # 4·T²·d_model forward, times 3.5 with the backward, halved when causal.
    assert bench.useful_flops(4096, causal=False) == 4 * 4096**2 * 256 * 3.5
    assert bench.useful_flops(4096, causal=True) == 2 * 4096**2 * 256 * 3.5


def test_rates_of_a_row():
    row = {
        "length": 1024,
        "policy": "mixed_bfloat16",
        "seconds": 0.5,
        "peak_gflops": 100.0,
        "bfloat16_peak_gflops": 25.0,
    }
    bench.add_rates(row, causal=True)
    gflops = 2 * 1024**2 * 256 * 3.5 / 0.5 / 1e9
    assert row["gflops"] == pytest.approx(gflops)
    assert row["share"] == pytest.approx(gflops / 100)
    assert row["bfloat16_share"] == pytest.approx(gflops / 25)


def test_bfloat16_inputs_are_exact_in_every_framework():
    import ml_dtypes

    float32 = bench.op_arrays(16, "float32")
    bfloat16 = bench.op_arrays(16, "mixed_bfloat16")
    assert bench.compute_dtype("mixed_bfloat16") == "bfloat16"
    for name in ("query", "key", "value"):
        assert bfloat16[name].shape == (1, 16, bench.HEADS, bench.HEAD_DIM)
        assert bfloat16[name].dtype == np.float32
        # Already bfloat16 values: every framework's cast keeps them as they are.
        np.testing.assert_array_equal(
            bfloat16[name].astype(ml_dtypes.bfloat16).astype("float32"),
            bfloat16[name],
        )
        assert np.max(np.abs(bfloat16[name] - float32[name])) > 0
    np.testing.assert_array_equal(bfloat16["cotangent"], float32["cotangent"])
