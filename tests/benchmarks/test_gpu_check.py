"""benchmarks/gpu_check.py end to end at tiny sizes on a CPU, as it runs on a
GPU machine: the JAX backend, TensorFlow unimportable, the data folder that
benchmarks/gpu_check_bundle.py prepares (here from the small fixture pairs)."""

import json
import os
import subprocess
import sys

import pytest

from tests.test_case import BLOCK_TENSORFLOW, REPO_ROOT


@pytest.mark.large  # 80 s; run it before a session's GPU check
def test_tiny_run_on_jax_without_tensorflow(tmp_path):
    bundle = tmp_path / "bundle"
    subprocess.run(
        [
            sys.executable,
            os.path.join(REPO_ROOT, "benchmarks", "gpu_check_bundle.py"),
            "--out",
            str(bundle),
            "--skip-wheels",
            "--data-file",
            os.path.join(REPO_ROOT, "tests", "fixtures", "de_en_pairs.tsv"),
            "--vocabulary-size",
            "400",
        ],
        check=True,
        capture_output=True,
        cwd=REPO_ROOT,
    )
    manifest = json.loads((bundle / "MANIFEST.json").read_text())
    assert manifest["data"]["test"] > 0
    assert (bundle / "data" / "en_de.model").exists()

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCK_TENSORFLOW)
    out = tmp_path / "gpu_check.json"
    environment = dict(
        os.environ,
        KERAS_BACKEND="jax",
        PYTHONPATH=os.pathsep.join([str(site), REPO_ROOT]),
    )
    completed = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO_ROOT, "benchmarks", "gpu_check.py"),
            "--tiny",
            "--data",
            str(bundle / "data"),
            "--out",
            str(out),
        ],
        env=environment,
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    report = json.loads(out.read_text())
    assert completed.returncode == 0, (report.get("problems"), completed.stderr[-3000:])
    assert report["problems"] == []
    assert report["errors"] == {}
    assert report["versions"]["platform"] == "cpu"
    # Every JAX part ran; PyTorch is not installed here.
    for part in ("numerics", "paths", "speed", "training", "costs"):
        assert report[part], part
    assert report["skipped"] == ["torch: PyTorch is not installed"]

    numerics = [row for row in report["numerics"] if "asked" in row]
    assert {row["policy"] for row in numerics} == {
        "float32",
        "mixed_float16",
        "mixed_bfloat16",
    }
    # Without a GPU no cuDNN kernel runs; flash_attention=True takes the
    # memory-efficient op, False the explicit path.
    assert {row["took"] for row in numerics if row["asked"] == "explicit"} == {
        "explicit_or_xla"
    }
    assert {
        row["took"] for row in numerics if row["asked"] == "fused_or_memory_efficient"
    } == {"memory_efficient"}
    assert all(row["empty_rows_zero"] and row["finite"] for row in numerics)
    assert any(row["empty_rows"] for row in numerics)
    # float32 rows run at the reference's matmul precision (not TF32 on a GPU).
    assert all(
        row["matmul_precision"] == "highest"
        for row in numerics
        if row["policy"] == "float32"
    )
    # Gradient differences are reported per variable of the layer, as shares of
    # the largest gradient of any variable.
    gradient_rows = [row for row in report["numerics"] if "gradients" in row]
    assert {(row["case"], row["policy"]) for row in gradient_rows} == {
        (case, policy)
        for case in ("padding", "causal")
        for policy in ("float32", "mixed_float16", "mixed_bfloat16")
    }
    for row in gradient_rows:
        assert set(row["per_variable"]) == {
            f"{name}/{kind}"
            for name in ("query", "key", "value", "attention_output")
            for kind in ("kernel", "bias")
        }
        assert row["max_relative_difference"] == max(row["per_variable"].values())
        assert row["worst_variable"] in row["per_variable"]

    training = report["training"]
    assert training["policy"] == "mixed_float16"
    assert training["optimizer"] == "LossScaleOptimizer"
    assert training["loss_finite"]
    assert training["steps"] > 0 and training["target_tokens_per_second"] > 0
    assert training["test_sentences"] == manifest["data"]["test"]
    assert 0.0 <= training["test_bleu"] <= 100.0
    assert len(training["examples"]) > 0

    assert report["speed"][0]["keras_attn_ms"] > 0
    assert report["speed"][0]["keras_hub_ms"] > 0
