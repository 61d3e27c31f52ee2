"""What the servability check adds around the loaders: the warmup file
(written with every export, replayed by the check as TF Serving replays it),
the export's size and load time, model directories, non-finite outputs, and
the CLI's exit status. These exercise the export itself, through the
serve-tag loader."""

import json
import shutil
import subprocess
import sys

import keras
import pytest
import tensorflow as tf

from keras_attn.export import check_servable, export_sentiment
from keras_attn.export.batching import task_batching
from keras_attn.export.check import resolve_version_dir
from keras_attn.export.warmup import (
    MAX_WARMUP_RECORDS,
    WARMUP_FILE,
    read_warmup,
    warmup_logs,
    write_warmup,
)
from keras_attn.models import TextClassifierEnsemble

pytestmark = pytest.mark.tf_only


@pytest.mark.parametrize(
    ("fixture", "inputs"),
    [
        ("small_sentiment_export", {"serving_default": ["text"]}),
        (
            "small_translator_export",
            {"serving_default": ["text"], "translate_with_alignment": ["text"]},
        ),
        (
            "small_language_model_export",
            {"serving_default": ["prompt"], "score": ["text"]},
        ),
    ],
)
def test_every_export_has_warmup_requests_for_each_signature_and_batch_size(
    request, fixture, inputs
):
    path = request.getfixturevalue(fixture)
    metadata = json.loads((path / "assets.extra" / "keras_attn.json").read_text())
    sizes = task_batching(metadata["task"]).execution_batch_sizes
    logs = read_warmup(path / "assets.extra" / WARMUP_FILE)
    seen = []
    for log in logs:
        request_ = log.predict_log.request
        assert request_.model_spec.name == metadata["model_name"]
        names = sorted(request_.inputs)
        signature = request_.model_spec.signature_name
        assert names == inputs[signature]
        (proto,) = request_.inputs.values()
        assert proto.dtype == tf.string.as_datatype_enum
        seen.append((signature, tf.make_ndarray(proto).shape[0]))
    assert sorted(seen) == sorted((s, n) for s in inputs for n in sizes)
    assert metadata["serving"]["warmup_requests"] == {
        "file": f"assets.extra/{WARMUP_FILE}",
        "records": len(logs),
        "batch_sizes": list(sizes),
    }
    assert metadata["serving"]["tensorflow"] == tf.__version__
    assert metadata["serving"]["docker_image"] == "tensorflow/serving:2.20.0"


def test_the_check_replays_the_warmup_and_reports_size_and_load_time(
    small_translator_export, monkeypatch
):
    from keras_attn.export import check

    summaries = []
    cli = check.saved_model_cli_summary

    def counted(path):
        summaries.append(path)
        return cli(path)

    monkeypatch.setattr(check, "saved_model_cli_summary", counted)
    report = check_servable(small_translator_export.parent, verbose=False)
    # saved_model_cli (another TensorFlow process) runs when its summary is
    # first read, and once.
    assert summaries == []
    assert "signature_def['translate_with_alignment']" in report.cli_summary
    assert report.cli_summary and summaries == [str(small_translator_export)]
    assert report.path == str(small_translator_export)  # the highest version
    assert report.ok, str(report)
    assert report.warmup["records"] == 6 and not report.warmup["errors"]
    assert report.warmup["signatures"] == {
        "serving_default": [1, 8, 32],
        "translate_with_alignment": [1, 8, 32],
    }
    files = [f for f in small_translator_export.rglob("*") if f.is_file()]
    assert report.size_bytes == sum(f.stat().st_size for f in files)
    assert 0 < report.load_seconds < 60
    assert "warmup: 6 requests replayed" in str(report)


def test_a_warmup_request_the_server_would_fail_on_fails_the_check(
    small_sentiment_export, tmp_path
):
    copy = tmp_path / "sentiment" / "1"
    shutil.copytree(small_sentiment_export, copy)
    logs = read_warmup(copy / "assets.extra" / WARMUP_FILE)
    bad = logs[0].predict_log.request
    bad.inputs["txt"].CopyFrom(bad.inputs.pop("text"))  # a wrong input name
    write_warmup(copy / "assets.extra" / WARMUP_FILE, logs)
    report = check_servable(copy, verbose=False)
    assert not report.ok
    (problem,) = report.problems
    assert problem.startswith(
        "warmup: record 1 (serving_default): INVALID_ARGUMENT: Signature input "
        "alias: text(feed name: serving_default_text:0) not found in request"
    )
    # No warmup file (an export written before keras_attn wrote them): TF
    # Serving serves it, the report says what is missing.
    (copy / "assets.extra" / WARMUP_FILE).unlink()
    report = check_servable(copy, verbose=False)
    assert report.ok, str(report)
    assert report.notes[0].startswith("no warmup requests")


def test_warmup_files_hold_at_most_what_the_server_reads(tmp_path):
    samples = {"serving_default": {"text": ["a", "b"]}}
    with pytest.raises(ValueError, match="at most 1000 warmup records"):
        warmup_logs("m", samples, range(1, MAX_WARMUP_RECORDS + 2))
    logs = warmup_logs("m", samples, [1] * MAX_WARMUP_RECORDS)
    write_warmup(tmp_path / "w", logs + logs[:1])
    with pytest.raises(ValueError, match=r"exceeds the maximum \(1000\)"):
        read_warmup(tmp_path / "w")


def test_non_finite_outputs_are_reported(small_tokenizer, tmp_path):
    ids = keras.Input((None,), dtype="int32")
    first = keras.ops.cast(ids[:, :1], "float32")  # (B, 1); padding id 0
    probability = keras.layers.Lambda(lambda t: keras.ops.log(t - 1.0))(first)
    model = keras.Model(ids, probability)
    # A one-member ensemble: the export's classifier interface over any model.
    classifier = TextClassifierEnsemble([model], tokenizer=small_tokenizer)
    path = export_sentiment(classifier, tmp_path, max_length=8)
    report = check_servable(path, verbose=False)
    assert not report.ok
    assert report.problems == [
        "signature 'serving_default' returns NaN or infinite 'positive_probability' "
        "for the sample inputs ['', '   ']"
    ]


def test_model_directories_resolve_to_their_highest_version(tmp_path):
    for version in ("1", "10", "9", "tmp"):
        (tmp_path / "m" / version).mkdir(parents=True)
    for version in ("1", "10", "9"):
        (tmp_path / "m" / version / "saved_model.pb").write_bytes(b"")
    assert resolve_version_dir(tmp_path / "m") == tmp_path / "m" / "10"
    assert resolve_version_dir(tmp_path / "m" / "9") == tmp_path / "m" / "9"
    with pytest.raises(ValueError, match="Received: path="):
        resolve_version_dir(tmp_path)


# Slow: a process per case; the path rule:
# test_model_directories_resolve_to_their_highest_version
@pytest.mark.slow
def test_cli_usage_errors(small_sentiment_export):
    """(A servable export exits with 0: test_sentiment_export.py's CLI test.)"""

    def check(*args):
        return subprocess.run(
            [sys.executable, "-m", "keras_attn.export", "check", *map(str, args)],
            capture_output=True,
            text=True,
            timeout=600,
        )

    # Usage errors: argparse's status 2, with a message rather than a traceback.
    result = check(small_sentiment_export, "--serving-release", "2.17.0")
    assert result.returncode == 2 and "invalid choice: '2.17.0'" in result.stderr
    result = check(small_sentiment_export / "missing")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "must be an export's version directory" in result.stderr
