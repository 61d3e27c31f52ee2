"""Serving latency of exported SavedModels, through their loaded signatures.

Exports the trained translator of a `examples/translate.py` run (beam search
width 4, and width 1 = greedy) and the classifier of a
`examples/sentiment.py` run, loads each export with `tf.saved_model.load` as
a server process would, and times the `serving_default` signature on batches
of 1 and 16 test sentences: p50 and p99 latency, sentences per second.

    .venv/bin/python benchmarks/serving_bench.py \
        --translator-run runs/transformer --sentiment-run runs/sentiment
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

from keras_attn.datasets import load_movie_reviews, load_translation_pairs
from keras_attn.export import export_sentiment, export_translator


def latencies(signature, texts, batch_size, calls, warmup=3):
    batches = [
        texts[(i * batch_size) % len(texts) :][:batch_size] for i in range(calls)
    ]
    batches = [b if len(b) == batch_size else texts[:batch_size] for b in batches]
    for batch in batches[:warmup]:
        signature(text=tf.constant(batch))
    times = []
    for batch in batches:
        start = time.perf_counter()
        outputs = signature(text=tf.constant(batch))
        for value in outputs.values():
            value.numpy()
        times.append(time.perf_counter() - start)
    times = np.array(times)
    p50, p99 = np.percentile(times, 50), np.percentile(times, 99)
    return p50 * 1000, p99 * 1000, batch_size / np.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--translator-run", default="runs/transformer")
    parser.add_argument("--sentiment-run", default="runs/sentiment")
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--max-length", type=int, default=40)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(args.translator_run)
        model = keras.saving.load_model(run / "model.keras", compile=False)
        sources = [
            en for en, _ in load_translation_pairs("de-en", alternatives="keep").test
        ]
        for name, width in (("beam 4", 4), ("greedy (beam 1)", 1)):
            path = export_translator(
                model,
                tmp,
                model_name=f"translator_{width}",
                max_length=args.max_length,
                beam_width=width,
            )
            signature = tf.saved_model.load(str(path)).signatures["serving_default"]
            for batch_size in (1, 16):
                rows.append(
                    (
                        f"translator, {name}",
                        batch_size,
                        *latencies(signature, sources, batch_size, args.calls),
                    )
                )
        run = Path(args.sentiment_run)
        model = keras.saving.load_model(run / "model.keras", compile=False)
        texts = [text for text, _ in load_movie_reviews().test]
        path = export_sentiment(model, tmp, max_length=64)
        signature = tf.saved_model.load(str(path)).signatures["serving_default"]
        for batch_size in (1, 16):
            rows.append(
                (
                    "sentiment",
                    batch_size,
                    *latencies(signature, texts, batch_size, args.calls),
                )
            )
    print(
        f"{'export':<28} {'batch':>5} {'p50 ms':>8} {'p99 ms':>8} {'sentences/s':>12}"
    )
    for name, batch_size, p50, p99, rate in rows:
        print(f"{name:<28} {batch_size:>5} {p50:8.1f} {p99:8.1f} {rate:12.1f}")


if __name__ == "__main__":
    main()
