"""examples/language_model.py's strided evaluation (`--eval-stride`)."""

import json
import math

import pytest

from tests.examples.test_data_options import load_script
from tests.examples.test_scripts import FIXTURES, run_script

pytestmark = pytest.mark.tf_only


def test_eval_stride_defaults_to_windows_that_do_not_overlap():
    script = load_script("language_model")
    assert script.parse_args([]).eval_stride == 128
    assert script.parse_args(["--smoke"]).eval_stride == 32
    # 0 and the window's length both mean windows that do not overlap.
    for stride in ("0", "64"):
        args = script.parse_args(["--sequence-length", "64", "--eval-stride", stride])
        assert args.eval_stride == 64
    assert script.parse_args(["--eval-stride", "1"]).eval_stride == 1
    assert script.parse_args(["--eval-stride", "32"]).eval_stride == 32


@pytest.mark.parametrize("stride", ["-1", "129"])
def test_eval_stride_out_of_range_is_refused(stride, capsys):
    script = load_script("language_model")
    with pytest.raises(SystemExit):
        script.parse_args(["--eval-stride", stride])
    assert (
        f"--eval-stride must be from 0 to --sequence-length (128). Received: {stride}"
        in capsys.readouterr().err
    )


def test_smoke_run_records_strided_and_nonoverlapping_figures(tmp_path):
    data = tmp_path / "play.txt"  # long enough for three non-empty splits
    data.write_text((FIXTURES / "play_sample.txt").read_text() * 20)
    out = tmp_path / "run"
    stdout = run_script(
        "language_model.py",
        "--smoke",
        "--data",
        data,
        "--batch-size",
        8,
        "--no-export",
        "--eval-stride",
        8,
        "--verbose",
        1,
        "--out",
        out,
    )
    run = json.loads((out / "metrics.json").read_text())
    metrics = run["metrics"]
    # --smoke: windows of 32 tokens, evaluated every 8 tokens.
    assert metrics["eval_stride"] == run["config"]["eval_stride"] == 8
    for name in (
        "test_bits_per_character",
        "test_bits_per_character_nonoverlapping",
        "validation_bits_per_character",
        "validation_bits_per_character_nonoverlapping",
    ):
        assert math.isfinite(metrics[name]) and metrics[name] > 0, name
    # Every test target is scored once in both evaluations.
    assert metrics["test_tokens"] == metrics["test_tokens_nonoverlapping"] > 0
    # --verbose 1: progress bars (the bar's glyph), for training and for
    # each scoring pass.
    assert "\u2501" in stdout
    for heading in (
        "Scoring the test text (windows that do not overlap):",
        "Scoring the test text (windows every 8 tokens):",
        "Scoring the validation text (windows every 8 tokens):",
    ):
        assert heading in stdout
    assert "test bits per character (stride 8)" in stdout
    assert "test bits per character (non-overlapping)" in stdout
