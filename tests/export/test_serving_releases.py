"""Each example's `--smoke` export, checked in the runtime of the newest TF
Serving release and the one before (large: builds each runtime on first use,
a TensorFlow installation each, from PyPI).

This checks the exports themselves in the TensorFlow and TensorFlow Text of
those releases (`keras_attn.export.releases`): their ops, both loaders, every
signature against the in-process outputs, and the warmup requests; each
script's bfloat16, int8 and int4 exports (`--export-precision`) too.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from keras_attn.export import check_servable
from keras_attn.export.releases import newest_releases

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
RELEASES = [release.version for release in newest_releases(2)]
PRECISIONS = ("float32", "bfloat16", "int8", "int4")

pytestmark = [pytest.mark.large, pytest.mark.tf_only]


def run_script(name, *args):
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / name), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=REPO,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


@pytest.fixture(scope="module")
def smoke_exports(tmp_path_factory):
    """`{task: model directory}` of the three example scripts' smoke runs."""
    from tests.examples.test_scripts import write_reviews

    root = tmp_path_factory.mktemp("smoke")
    reviews = write_reviews(root / "reviews.tsv", 12)
    play = root / "play.txt"
    play.write_text((FIXTURES / "play_sample.txt").read_text() * 20)
    runs = {
        "sentiment": ("sentiment.py", "--pretrained", "none", "--data", reviews),
        "translator": (
            "translate.py",
            "--pretrained",
            "none",
            "--data",
            FIXTURES / "de_en_pairs.tsv",
        ),
        "language_model": ("language_model.py", "--data", play),
    }
    exports = {}
    for task, (script, *args) in runs.items():
        out = root / task
        cheaper = ("--export-precision", *PRECISIONS[1:])
        run_script(script, "--smoke", *args, *cheaper, "--out", out)
        exports[task, "float32"] = out / "export" / task
        for precision in PRECISIONS[1:]:
            exports[task, precision] = out / "export" / f"{task}_{precision}"
    return exports


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("task", ["sentiment", "translator", "language_model"])
def test_smoke_exports_are_servable_in_the_newest_releases(
    smoke_exports, task, precision, release
):
    path = smoke_exports[task, precision]
    report = check_servable(path, verbose=False, serving_release=release)
    assert report.ok, str(report)  # an Xla* op would be a problem
    assert report.serving_release == release
    assert report.tensorflow == release  # the release's own TensorFlow
    assert report.warmup["records"] > 0 and not report.warmup["errors"]


def test_a_wordpiece_export_in_each_release(tmp_path):
    """The pretrained encoder's WordPiece ops: servable in 2.20.0, which
    links the TensorFlow Text its wheel has; in 2.19.1 the server has them
    (TensorFlow Text 2.12.1's libraries name them) but no wheel loads their
    kernels into TensorFlow 2.19: not verified, not failed."""
    from keras_attn.checkpoints import load_bert_checkpoint
    from keras_attn.models import TextClassifier
    from tests.test_case import write_bert_checkpoint

    checkpoint = load_bert_checkpoint(write_bert_checkpoint(tmp_path / "bert"))
    model = TextClassifier.from_bert(
        checkpoint, tokenizer=checkpoint.tokenizer(max_length=12)
    )
    path = model.export(tmp_path / "export", max_length=12)
    newest, before = RELEASES
    report = check_servable(path, verbose=False, serving_release=newest)
    assert report.ok, str(report)
    assert report.text_ops == ["FastBertNormalize", "FastWordpieceTokenizeWithOffsets"]
    report = check_servable(path, verbose=False, serving_release=before)
    assert report.status == "NOT VERIFIED" and not report.problems, str(report)
    assert report.text_ops == ["FastBertNormalize", "FastWordpieceTokenizeWithOffsets"]
    assert (
        "FastBertNormalize, FastWordpieceTokenizeWithOffsets (the server has them)"
        in (report.unverified[0])
    )
