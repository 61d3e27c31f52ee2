"""`--distribution` (JAX's `keras.distribution`) on the example scripts: a
smoke run on a 2 x 2 mesh of virtual CPU devices whose test figures cover
every example and whose `model.keras` loads in a fresh process; the option
refused where it cannot apply; `make_distribution`'s argument checks."""

import json
import os
import subprocess
import sys

import pytest

from keras_attn import training
from tests.examples.fresh_load import assert_run_loads_in_a_fresh_process
from tests.examples.test_scripts import REPO, write_reviews
from tests.test_case import xla_flags_with_devices


def run_script(name, *args, backend="jax"):
    return subprocess.run(
        [sys.executable, str(REPO / "examples" / name), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env={
            **os.environ,
            "KERAS_BACKEND": backend,
            "XLA_FLAGS": xla_flags_with_devices(8),
            "TF_CPP_MIN_LOG_LEVEL": "3",
        },
    )


@pytest.mark.parametrize(
    "spec, message",
    [
        ("model:x", "'none', 'data', 'data:D', 'model:M' or 'data:D,model:M'"),
        ("model:0", "positive integers"),
        ("data:2,data:2", "Received: distribution='data:2,data:2'"),
        ("tensor:2", "Received: distribution='tensor:2'"),
        ("data:3,model:4", "needs 12 devices and there are 8"),
    ],
)
def test_a_bad_specification_is_named(spec, message):
    with pytest.raises(ValueError, match="`distribution`") as error:
        training.make_distribution(spec, devices=[f"cpu:{i}" for i in range(8)])
    assert message in str(error.value)


def test_none_is_no_distribution():
    assert training.make_distribution("none") is None
    assert training.data_parallel_size(None) == 1


def test_the_option_needs_jax(tmp_path):
    reviews = write_reviews(tmp_path / "reviews.tsv", 6)
    result = run_script(
        "sentiment.py", "--smoke", "--pretrained", "none", "--data", reviews,
        "--out", tmp_path / "run", "--distribution", "data", backend="tensorflow",
    )  # fmt: skip
    assert result.returncode != 0
    assert "--distribution data needs KERAS_BACKEND=jax" in result.stderr
    assert "--strategy" in result.stderr


@pytest.mark.large
def test_sentiment_trains_on_a_mesh_and_scores_every_example(tmp_path):
    """A 2 x 2 mesh (data and model parallel) of 8 virtual devices: fit's
    batches drop a last partial batch, the test and validation accuracies
    count every example (9 test reviews in global batches of 6: the last
    one, of 3, cannot be split in two), and the run loads in a fresh
    process on TensorFlow."""
    reviews = write_reviews(tmp_path / "reviews.tsv", 500)
    out = tmp_path / "run"
    result = run_script(
        "sentiment.py", "--smoke", "--pretrained", "none", "--data", reviews,
        "--out", out, "--distribution", "data:2,model:2", "--no-export",
        "--batch-size", 3, "--ensemble", 1,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "CheckedModelParallel over a 2x2 mesh" in result.stderr
    report = json.loads((out / "metrics.json").read_text())
    assert report["config"]["distribution"] == "data:2,model:2"
    assert report["environment"]["distribution"] == {
        "type": "CheckedModelParallel",
        "mesh": [2, 2],
        "axes": ["batch", "model"],
    }
    metrics = report["metrics"]
    test_examples = metrics["test_examples"]
    assert test_examples % 6 % 2 == 1, test_examples  # a last batch of 3
    # Every example counted: accuracy is a multiple of 1 / test_examples.
    hits = metrics["test_accuracy"] * test_examples
    assert abs(hits - round(hits)) < 1e-4, metrics
    loaded = assert_run_loads_in_a_fresh_process(out, tmp_path)
    assert loaded["class"] == "TextClassifier"


def test_a_split_without_a_full_batch_is_named(tmp_path):
    reviews = write_reviews(tmp_path / "reviews.tsv", 20)
    result = run_script(
        "sentiment.py", "--smoke", "--pretrained", "none", "--data", reviews,
        "--out", tmp_path / "run", "--distribution", "data:2", "--batch-size", 64,
    )  # fmt: skip
    assert result.returncode != 0
    assert "split gives no full batch of --batch-size 64" in result.stderr
