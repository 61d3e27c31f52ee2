"""The example scripts end to end, in seconds-long `--smoke` configurations on
small fixture files (the real corpora are fetched only by `large` tests)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.examples.fresh_load import assert_run_loads_in_a_fresh_process

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"

pytestmark = pytest.mark.tf_only

POSITIVE = [
    "a warm, funny and moving film",
    "great acting and a clever script",
    "beautiful, gripping and smart",
    "the best comedy of the year",
    "a delight from start to finish",
    "wonderful performances all round",
]
NEGATIVE = [
    "a dull and lifeless mess",
    "the plot is thin and the jokes fall flat",
    "boring, long and pointless",
    "the worst film of the year",
    "a tedious waste of time",
    "awful dialogue and wooden acting",
]


def run_script(name, *args, timeout=600):
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / name), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout


def write_reviews(path, takes):
    """`label<TAB>text` lines: each sentence above, numbered `takes` times."""
    lines = []
    for index in range(takes):
        for label, texts in ((1, POSITIVE), (0, NEGATIVE)):
            lines.append(f"{label}\t{texts[index % 6]}, take {index}")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def sentiment_file(tmp_path):
    return write_reviews(tmp_path / "reviews.tsv", 12)


# The three scripts build their parsers alike; two run with the slow tests.
@pytest.mark.parametrize(
    "script",
    [
        "sentiment.py",
        pytest.param("translate.py", marks=pytest.mark.slow),
        pytest.param("language_model.py", marks=pytest.mark.slow),
    ],
)
def test_help(script):
    text = run_script(script, "--help")
    assert "--mixed-precision" in text
    assert "(default: auto)" in text  # defaults are shown,
    assert "(default: None)" not in text  # except where there is none to show


def assert_a_rerun_rescores(script, out, evaluation_flags, figure):
    """A finished run is refused as --out (the message says how to re-score
    or retrain it) and re-scored by --evaluate-only, its training figures and
    configuration kept."""
    before = json.loads((out / "metrics.json").read_text())
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / script), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert result.returncode != 0
    assert f"--evaluate-only {out}" in result.stderr and "--overwrite" in result.stderr
    stdout = run_script(script, "--evaluate-only", out, *evaluation_flags)
    after = json.loads((out / "metrics.json").read_text())
    assert "training minutes" in stdout
    assert after["config"] == before["config"]  # the run's own configuration
    assert after["metrics"]["train_seconds"] == before["metrics"]["train_seconds"]
    assert figure in after["metrics"]
    assert after["evaluated_only"]["evaluate_only"] == str(out)


@pytest.mark.slow  # the script's parts: test_ema, test_mixed_precision, tests/models
def test_sentiment_smoke(sentiment_file, tmp_path):
    out = tmp_path / "run"
    stdout = run_script(
        "sentiment.py",
        "--smoke",
        "--pretrained",
        "none",
        "--data",
        sentiment_file,
        "--out",
        out,
        "--ensemble",
        2,
        "--export-precision",
        "int8",
    )
    metrics = json.loads((out / "metrics.json").read_text())
    assert 0.0 <= metrics["metrics"]["test_accuracy"] <= 1.0
    # The int8 copy: its own test figure and export, beside the float one.
    int8 = metrics["metrics"]["export_precisions"]["int8"]
    assert 0.0 <= int8["test_accuracy"] <= 1.0
    assert int8["export"] == str(out / "export" / "sentiment_int8" / "1")
    served = json.loads(
        (Path(int8["export"]) / "assets.extra" / "keras_attn.json").read_text()
    )
    assert served["precision"] == "int8" and served["model_name"] == "sentiment_int8"
    assert metrics["config"]["ensemble"] == 2
    assert (out / "export" / "sentiment" / "1" / "saved_model.pb").is_file()
    assert sorted(p.name for p in (out / "plots").iterdir())[0] == "review_0.png"
    assert (out / "members" / "1" / "logs").is_dir()  # TensorBoard
    assert "test accuracy" in stdout
    # Not a terminal: --verbose auto prints one line per epoch and per
    # evaluation, no redrawn progress bars.
    assert re.search(r"^\d+/\d+ - \d+s - .* - val_accuracy: ", stdout, re.M)
    for split in ("test", "validation"):
        heading = f"Evaluating the ensemble on the {split} split:\n"
        assert re.search(heading + r"\d+/\d+ - \d+s - .*accuracy", stdout), split
    assert "\r" not in stdout and "\u2501" not in stdout  # the bar's glyph
    assert_a_rerun_rescores("sentiment.py", out, ["--no-export"], "test_accuracy")
    loaded = assert_run_loads_in_a_fresh_process(out, tmp_path)
    assert loaded["class"] == "TextClassifierEnsemble"
    assert loaded["weights"] == [
        "members/0/checkpoints/best.weights.h5",
        "members/1/checkpoints/best.weights.h5",
    ]


# The translation script end to end (training, decoding, the kNN-MT grid,
# the export). The default run covers its parts: the sentiment smoke above
# runs the scripts' shared training and export path,
# tests/models/test_transformer_translator.py the translator,
# tests/memory/test_knn_mt.py `choose_knn_decoding` and
# tests/export/test_translator_export.py the kNN export.
@pytest.mark.slow
def test_translate_smoke(tmp_path):
    out = tmp_path / "run"
    stdout = run_script(
        "translate.py",
        "--smoke",
        "--pretrained",
        "none",
        "--data",
        FIXTURES / "de_en_pairs.tsv",
        "--knn",
        "--export-knn",
        # A small grid (the default is 3 x 3 x 5): the choice and its
        # wiring are what is tested here.
        "--knn-k",
        "2,4",
        "--knn-temperature",
        "10",
        "--knn-lambda",
        "0.2,0.4",
        "--export-precision",
        "bfloat16",
        "--out",
        out,
    )
    run = json.loads((out / "metrics.json").read_text())
    metrics = run["metrics"]
    cheaper = metrics["export_precisions"]["bfloat16"]
    assert {"test_bleu", "test_chrf", "decode_ms_per_sentence"} <= set(cheaper)
    assert (out / "export" / "translator_bfloat16" / "1" / "saved_model.pb").is_file()
    for split in ("validation", "test"):  # one line each when not on a terminal
        heading = f"Translating the {split} split:\n"
        assert re.search(heading + r"\d+/\d+ - \d+s - ", stdout), split
    assert {"test_bleu", "test_chrf", "decode_ms_per_sentence"} <= set(metrics)
    assert {"validation_bleu", "validation_chrf"} <= set(metrics)
    assert metrics["validation_sentences"] > 0
    rows = (out / "translations.tsv").read_text().splitlines()
    assert len(rows) == metrics["test_sentences"] and rows[0].count("\t") == 2
    assert (out / "export" / "translator" / "1" / "saved_model.pb").is_file()
    assert (out / "plots" / "alignment_0.png").is_file()
    # kNN-MT: every setting scored on the validation references, the best
    # (lowest loss) chosen, both splits decoded with it.
    trials = metrics["knn_validation_trials"]
    assert len(trials) == 2 * 1 * 2  # --knn-k x --knn-temperature x --knn-lambda
    assert {(t["k"], t["temperature"], t["lambda"]) for t in trials} == {
        (k, 10.0, weight) for k in (2, 4) for weight in (0.2, 0.4)
    }
    chosen = metrics["knn"]
    assert chosen["validation_nats_per_token"] == min(
        trial["validation_nats_per_token"] for trial in trials
    )
    assert chosen["datastore_entries"] > metrics["test_sentences"]
    for name in ("test_bleu", "test_chrf", "validation_bleu", "validation_chrf"):
        assert 0.0 <= metrics[f"{name}_with_knn"] <= 100.0
    assert "test BLEU with kNN" in stdout
    knn_rows = (out / "translations_knn.tsv").read_text().splitlines()
    assert len(knn_rows) == metrics["test_sentences"]
    assert [row.split("\t")[:2] for row in knn_rows] == [
        row.split("\t")[:2] for row in rows
    ]
    export = out / "export" / "translator" / "1"
    metadata = json.loads((export / "assets.extra" / "keras_attn.json").read_text())
    served = metadata["nearest_neighbors"]  # --export-knn: the chosen setting
    assert (served["k"], served["temperature"], served["lambda"]) == (
        chosen["k"],
        chosen["temperature"],
        chosen["lambda"],
    )
    assert served["datastore_entries"] == chosen["datastore_entries"]
    # --knn-key-dtype auto: the keys in the policy's compute dtype.
    policy = run["environment"]["dtype_policy"]
    compute_dtype = {"mixed_bfloat16": "bfloat16", "mixed_float16": "float16"}
    assert chosen["key_dtype"] == compute_dtype.get(policy, "float32")
    assert served["key_dtype"] == chosen["key_dtype"]
    # The length penalty: each of --knn-length-penalty (1.0, 1.5) decodes the
    # validation split; the highest BLEU decodes the test split and is served.
    penalties = metrics["knn_length_penalty_trials"]
    assert [trial["length_penalty"] for trial in penalties] == [1.0, 1.5]
    best = max(penalties, key=lambda trial: trial["validation_bleu"])
    assert chosen["length_penalty"] == best["length_penalty"]
    assert metrics["validation_bleu_with_knn"] == best["validation_bleu"]
    assert metadata["length_penalty"] == chosen["length_penalty"]
    for alpha in ("1", "1.5"):
        assert f"Translating the validation split (kNN-MT, length penalty {alpha})" in (
            stdout
        )
    assert_a_rerun_rescores(
        "translate.py", out, ["--beam-width", "2", "--no-export"], "test_bleu"
    )
    loaded = assert_run_loads_in_a_fresh_process(out, tmp_path)
    assert (loaded["class"], loaded["loss"]) == (
        "TransformerTranslator",
        "SmoothedSparseCrossentropy",
    )
    assert loaded["weights"] == ["checkpoints/best.weights.h5"]


@pytest.mark.large  # the Transformer's run above loads the same way
def test_translate_smoke_with_the_rnn_loads_in_a_fresh_process(tmp_path):
    out = tmp_path / "run"
    run_script(
        "translate.py",
        "--smoke",
        "--model",
        "rnn",
        "--data",
        FIXTURES / "de_en_pairs.tsv",
        "--no-export",
        "--out",
        out,
    )
    loaded = assert_run_loads_in_a_fresh_process(out, tmp_path)
    assert (loaded["class"], loaded["loss"]) == (
        "RNNTranslator",
        "SmoothedSparseCrossentropy",
    )
    assert loaded["weights"] == ["checkpoints/best.weights.h5"]


@pytest.mark.large  # the sampling is tested in tests/text, the flag's wiring here
def test_translate_smoke_with_subword_sampling(tmp_path):
    out = tmp_path / "run"
    run_script(
        "translate.py",
        "--smoke",
        "--pretrained",
        "none",
        "--data",
        FIXTURES / "de_en_pairs.tsv",
        "--subword-sampling",
        "0.5",
        "--no-export",
        "--out",
        out,
    )
    run = json.loads((out / "metrics.json").read_text())
    assert run["config"]["subword_sampling"] == 0.5
    metrics = run["metrics"]
    # The sampled training set keeps its stated number of batches.
    assert metrics["optimizer_steps"] == metrics["steps_per_epoch"] > 0
    assert metrics["test_sentences"] > 0 and "test_bleu" in metrics
    assert "knn" not in metrics and "test_bleu_with_knn" not in metrics
    assert not (out / "translations_knn.tsv").exists()


@pytest.mark.large  # from_bert and its export are tested in tests/models, tests/export
def test_translate_smoke_with_a_pretrained_encoder(tmp_path):
    from tests.test_case import write_bert_checkpoint

    checkpoint = write_bert_checkpoint(tmp_path / "bert")
    out = tmp_path / "run"
    run_script(
        "translate.py",
        "--smoke",
        "--pretrained",
        checkpoint,
        "--data",
        FIXTURES / "de_en_pairs.tsv",
        "--out",
        out,
    )
    run = json.loads((out / "metrics.json").read_text())
    config, metrics = run["config"], run["metrics"]
    assert (config["learning_rate"], config["lr_hold"], config["dropout"]) == (
        3e-4,
        0.5,
        0.1,
    )
    assert config["size"] is None
    assert metrics["optimizer_steps"] == metrics["steps_per_epoch"] > 0
    # A German-only target vocabulary; the source is the encoder's WordPiece.
    assert (out / "vocab" / "de.model").is_file()
    assert not (out / "vocab" / "en_de.model").exists()
    export = out / "export" / "translator" / "1"
    metadata = json.loads((export / "assets.extra" / "keras_attn.json").read_text())
    assert metadata["source_tokenizer"] == "WordPieceTokenizer"
    assert (out / "plots" / "alignment_0.png").is_file()


# resuming is tested in tests/training; this kills the script's process
@pytest.mark.slow
def test_language_model_resumes_after_a_kill(tmp_path):
    data = tmp_path / "play.txt"  # long enough for three non-empty splits
    data.write_text((FIXTURES / "play_sample.txt").read_text() * 20)
    common = [
        "--smoke",
        "--data",
        data,
        "--epochs",
        4,
        "--no-export",
        "--batch-size",
        1,
        "--sequence-length",
        8,
    ]
    reference = tmp_path / "reference"
    run_script("language_model.py", *common, "--out", reference)
    want = json.loads((reference / "metrics.json").read_text())["metrics"]

    out = tmp_path / "interrupted"
    process = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "examples" / "language_model.py"),
            *map(str, common),
            "--out",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
    )
    metadata = out / "backup" / "training_metadata.json"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        if (
            metadata.exists()
            and json.loads(metadata.read_text() or "{}").get("epoch", 0) >= 2
        ):
            break
        time.sleep(0.05)
    assert process.poll() is None, "the run ended before it could be interrupted"
    process.send_signal(signal.SIGKILL)  # mid-epoch 3 at the latest
    process.wait()
    assert not (out / "metrics.json").exists()
    run_script("language_model.py", *common, "--out", out)
    got = json.loads((out / "metrics.json").read_text())["metrics"]
    assert want["optimizer_steps"] >= 4 * want["steps_per_epoch"] > 0
    assert got["optimizer_steps"] == want["optimizer_steps"]


# from_bert and its export are tested in tests/models and tests/export; a
# script's run from a pretrained checkpoint (about 60-75 s on a 2-core AVX2
# machine) is `large` with the translation script's: CI ran past its 90
# minutes with it.
@pytest.mark.slow
@pytest.mark.large
def test_sentiment_smoke_fine_tunes_a_pretrained_checkpoint(sentiment_file, tmp_path):
    from tests.test_case import write_bert_checkpoint

    checkpoint = write_bert_checkpoint(tmp_path / "bert", max_position_embeddings=40)
    out = tmp_path / "run"
    stdout = run_script(
        "sentiment.py",
        "--smoke",
        "--pretrained",
        checkpoint,
        "--data",
        sentiment_file,
        "--epochs",
        3,
        "--out",
        out,
    )
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["config"]["pretrained"] == str(checkpoint)
    assert metrics["config"]["learning_rate"] == 5e-5
    assert 0.0 <= metrics["metrics"]["test_accuracy"] <= 1.0
    vocabulary = (checkpoint / "vocab.txt").read_text()
    assert (out / "vocab" / "vocab.txt").read_text() == vocabulary
    export = out / "export" / "sentiment" / "1"
    assert (export / "assets" / "vocab.txt").read_text() == vocabulary
    # Warm-up, then the cosine decay: the rate of the last epoch is the lowest.
    rates = [float(r) for r in re.findall(r"learning_rate: (\S+)", stdout)]
    assert len(rates) == 3 and rates[-1] < min(rates[:-1])
    # Mean pooling: the plots show the last block's self-attention.
    assert sorted(p.name for p in (out / "plots").iterdir())[0] == "review_0.png"
    # The WordPiece tokenizer and AdamW load with the model.
    loaded = assert_run_loads_in_a_fresh_process(out, tmp_path)
    assert (loaded["class"], loaded["optimizer"]) == ("TextClassifier", "AdamW")


def test_sentiment_refuses_inputs_longer_than_the_encoders_positions(
    sentiment_file, tmp_path
):
    from tests.test_case import write_bert_checkpoint

    checkpoint = write_bert_checkpoint(tmp_path / "bert", max_position_embeddings=24)
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "examples" / "sentiment.py"),
            "--smoke",
            "--pretrained",
            str(checkpoint),
            "--data",
            str(sentiment_file),
            "--out",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert result.returncode != 0
    assert (
        "--max-length must be at most the pretrained encoder's 24 positions. "
        "Received: --max-length 32"
    ) in result.stderr
