"""examples/language_model.py's evaluation: strided windows (`--eval-stride`)
and the continuous cache (`--cache-*`)."""

import json
import math

import pytest

from tests.examples.fresh_load import assert_run_loads_in_a_fresh_process
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


def test_assistant_options(capsys):
    script = load_script("language_model")
    assert script.parse_args([]).assistant_layers == 0  # no draft by default
    assert script.parse_args([]).assistant_training == "distill"
    args = script.parse_args(["--assistant-layers", "1"])
    # The default model: 4 heads, 2 key/value heads, width 128.
    assert script.assistant_sizes(args) == {
        "num_layers": 1,
        "embedding_dim": 64,
        "num_heads": 2,
        "num_key_value_heads": 2,
        "intermediate_dim": 256,
        "name": "assistant",
    }
    args = script.parse_args(["--assistant-layers", "2", "--assistant-dim", "24"])
    assert script.assistant_sizes(args)["embedding_dim"] == 24
    for option, value, message in (
        ("--assistant-layers", "-1", "--assistant-layers must be 0 or more"),
        ("--assistant-dim", "0", "--assistant-dim must be positive"),
    ):
        with pytest.raises(SystemExit):
            script.parse_args([option, value])
        assert f"{message}. Received: {value}" in capsys.readouterr().err


# the scoring and the cache export are tested in tests/models and tests/export
@pytest.mark.slow
def test_smoke_run_records_strided_and_nonoverlapping_figures_and_exports_the_cache(
    tmp_path,
):
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
        "--eval-stride",
        8,
        "--cache-theta",
        "0.5,1",
        "--cache-lambda",
        "0.1,0.3",
        "--verbose",
        1,
        "--export-sampler",
        '{"class_name": "top_k", "config": {"k": 10, "temperature": 0.8}}',
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
    # The continuous cache: theta and lambda chosen on the validation text
    # among the four pairs given, then used once on the test text.
    trials = metrics["cache_validation_trials"]
    assert [(t["theta"], t["lambda"]) for t in trials] == [
        (0.5, 0.1),
        (0.5, 0.3),
        (1.0, 0.1),
        (1.0, 0.3),
    ]
    best = min(trials, key=lambda t: t["validation_bits_per_character"])
    assert metrics["cache"] == {
        "theta": best["theta"],
        "lambda": best["lambda"],
        "window": 0,
    }
    assert (
        metrics["validation_bits_per_character_with_cache"]
        == best["validation_bits_per_character"]
    )
    assert math.isfinite(metrics["test_bits_per_character_with_cache"])
    assert metrics["test_bits_per_character_with_cache"] > 0
    assert "test bits per character with the cache (non-overlapping)" in stdout
    assert "Choosing the continuous cache on the validation text:" in stdout
    # The export's score signature mixes in the cache chosen here.
    export = out / "export" / "language_model" / "1"
    metadata = json.loads((export / "assets.extra" / "keras_attn.json").read_text())
    assert metadata["continuous_cache"] == {
        "theta": best["theta"],
        "lambda": best["lambda"],
        "window": None,
    }
    assert "model_log_likelihood" in metadata["signatures"]["score"]["outputs"]
    # --export-sampler: a `sample` signature with that sampler (the script
    # checked the export with it, warmup records included).
    assert metadata["sampler"] == {
        "class": "TopKSampler",
        "config": {"temperature": 0.8, "k": 10},
    }
    assert set(metadata["signatures"]["sample"]["inputs"]) == {"prompt", "seed"}
    import tensorflow as tf
    import tensorflow_text  # noqa: F401  (the export's tokenizer ops)

    sample = tf.saved_model.load(str(export)).signatures["sample"]
    prompts = tf.constant(["KING:", "KING:", "ROMEO:"])
    first = sample(prompt=prompts, seed=tf.constant([7, 7, 8], tf.int64))["completion"]
    again = sample(prompt=prompts, seed=tf.constant([7, 7, 8], tf.int64))["completion"]
    assert first.numpy().tolist() == again.numpy().tolist()
    assert first[0] == first[1]  # the same prompt and seed in two rows
    # model.keras loads with its compile config where only keras_attn is
    # imported, and generates (its context of 32 tokens: the default
    # max_new_tokens fits it) and scores.
    loaded = assert_run_loads_in_a_fresh_process(out, tmp_path)
    assert loaded["class"] == "TransformerLanguageModel"
    assert loaded["weights"] == ["checkpoints/best.weights.h5"]


def test_cache_options_parse_and_bad_values_are_refused(capsys):
    script = load_script("language_model")
    args = script.parse_args([])
    assert args.cache_theta == (0.025, 0.05, 0.1)
    assert args.cache_lambda == (0.1, 0.2, 0.3, 0.4, 0.5, 0.6)
    assert args.cache_window == 0 and not args.no_cache
    args = script.parse_args(["--cache-theta", "0.2", "--cache-window", "500"])
    assert args.cache_theta == (0.2,) and args.cache_window == 500
    for argv, message in [
        (["--cache-theta", "0,1"], "--cache-theta values must be > 0"),
        (["--cache-lambda", "0.5,1"], "--cache-lambda values must be in [0, 1)"),
        (["--cache-window", "-1"], "--cache-window must be >= 0. Received: -1"),
        (["--cache-theta", "a"], "expected comma-separated floats. Received: 'a'"),
    ]:
        with pytest.raises(SystemExit):
            script.parse_args(argv)
        assert message in capsys.readouterr().err, argv


def test_export_sampler_option(capsys):
    script = load_script("language_model")
    assert script.parse_args([]).export_sampler is None
    for value, kind in [
        ("top_k", "TopKSampler"),
        ("top_p", "TopPSampler"),
        ('{"class_name": "top_k", "config": {"k": 10}}', "TopKSampler"),
    ]:
        args = script.parse_args(["--export-sampler", value])
        assert type(script._options.export_sampler(args)).__name__ == kind
    assert script._options.export_sampler(script.parse_args([])) is None
    for argv, message in [
        (["--export-sampler", "top_kk"], "one of ['beam', 'greedy', 'random'"),
        (["--export-sampler", "greedy"], "greedy decoding is `serving_default`"),
        (["--export-sampler", "{'k': 1}"], "not a JSON config"),
        (
            ["--export-sampler", '{"class_name": "top_k", "config": {"k": 0}}'],
            "`k` must be a positive int",
        ),
        (
            ["--export-sampler", "top_k", "--no-export"],
            "--export-sampler with --no-export",
        ),
    ]:
        with pytest.raises(SystemExit):
            script.parse_args(argv)
        assert message in capsys.readouterr().err, argv


# Slow: a training end to end. The model's own draft (generate, export,
# model.keras, presets, fresh process) is tested in
# tests/models/test_language_model_assistant.py. `make test-slow` trains
# each kind of draft once across the two scripts: distilled here, on the
# data in tests/examples/test_translate_assistant.py; the other runs are
# `large`.
@pytest.mark.slow
@pytest.mark.parametrize(
    "training", ["distill", pytest.param("data", marks=pytest.mark.large)]
)
def test_a_draft_trained_beside_the_model_is_saved_and_used(tmp_path, training):
    from tests.test_case import fresh_json

    data = tmp_path / "play.txt"
    data.write_text((FIXTURES / "play_sample.txt").read_text() * 20)
    out = tmp_path / "run"
    run_script(
        "language_model.py", "--smoke", "--data", data, "--batch-size", 8,
        "--no-cache", "--assistant-layers", 1, "--assistant-training", training,
        "--out", out,
    )  # fmt: skip
    metrics = json.loads((out / "metrics.json").read_text())["metrics"]
    assert metrics["assistant_same_text"] is True
    assert metrics["assistant"]["num_layers"] == 1
    assert metrics["assistant"]["embedding_dim"] == 16  # half of --smoke's 32
    assert metrics["assistant"]["training"] == training
    assert 0 <= metrics["assistant"]["validation_agreement"] <= 1
    assert metrics["assistant_speedup"] > 0
    export = out / "export" / "language_model" / "1"
    served = json.loads((export / "assets.extra" / "keras_attn.json").read_text())
    assert served["assistant"]["kind"] == "draft_model"
    fresh = """
import json, sys
import keras
import keras_attn

model = keras.saving.load_model(sys.argv[1] + "/model.keras")
preset = keras_attn.models.TransformerLanguageModel.from_preset(sys.argv[1] + "/preset")
print(json.dumps([model.assistant_model.num_layers,
                  preset.assistant_model.num_layers, model.trainable]))
"""
    # The distiller froze the model (its teacher) while the draft learned.
    assert fresh_json(fresh, out) == [1, 1, True]
