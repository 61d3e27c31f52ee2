"""Input pipeline throughput against the training step rate it has to feed.

For each task (translation, sentiment, language modelling) on its real
training split, in one process:

1. The `tf.data` pipeline of `keras_attn.text`, as training uses it (shuffled,
   bucketed, prefetched), iterated alone: examples per second, median over
   `--rounds` full epochs,
   - *cold*: `cache=False`, so every epoch tokenizes every text again (what
     the first epoch costs, and a pipeline that cannot cache);
   - *warm*: the default `cache=True`, epochs after the first.
2. A stand-in model of the intended size (8k-token embeddings of width 256,
   two Transformer blocks built from `keras.layers.MultiHeadAttention` and
   `Dense`, per side for translation), trained with `model.fit` on batches
   taken from that same pipeline and cached in memory, so that only the
   training steps are timed: examples per second, median over `--rounds`
   epochs of `--steps` steps after a warm-up epoch.

The ratio pipeline / training must be at least 10 (the pipeline never starves
training). Tokenizers (SentencePiece, 8,000 pieces) are trained on the
training splits first; their training time is printed but not part of the
figures.

    .venv/bin/python benchmarks/pipeline_bench.py [--rounds 5] [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

from keras_attn.datasets import (
    load_movie_reviews,
    load_shakespeare,
    load_translation_pairs,
)
from keras_attn.text import SubwordTokenizer, train_subword_vocabulary
from keras_attn.text.pipelines import (
    classification_dataset,
    language_model_dataset,
    translation_dataset,
)

VOCABULARY, MODEL_DIM, HEADS, FEED_FORWARD = 8000, 256, 8, 1024
BATCH = {"translation": 64, "sentiment": 32, "language model": 32}
MAX_LENGTH = {"translation": 64, "sentiment": 128, "language model": 256}


# -- stand-in models ---------------------------------------------------------


def block(x, context=None, causal=False, name=""):
    """Pre-norm Transformer block: self-attention, cross-attention, FFN."""
    h = keras.layers.LayerNormalization(name=f"{name}_ln1")(x)
    h = keras.layers.MultiHeadAttention(HEADS, MODEL_DIM // HEADS, name=f"{name}_self")(
        h, h, use_causal_mask=causal
    )
    x = x + h
    if context is not None:
        h = keras.layers.LayerNormalization(name=f"{name}_ln2")(x)
        h = keras.layers.MultiHeadAttention(
            HEADS, MODEL_DIM // HEADS, name=f"{name}_cross"
        )(h, context)
        x = x + h
    h = keras.layers.LayerNormalization(name=f"{name}_ln3")(x)
    h = keras.layers.Dense(FEED_FORWARD, activation="gelu", name=f"{name}_ff1")(h)
    return x + keras.layers.Dense(MODEL_DIM, name=f"{name}_ff2")(h)


def embed(ids, name):
    return keras.layers.Embedding(VOCABULARY, MODEL_DIM, mask_zero=True, name=name)(ids)


def translation_model():
    source = keras.Input((None,), dtype="int32", name="encoder_inputs")
    target = keras.Input((None,), dtype="int32", name="decoder_inputs")
    context = embed(source, "source_embedding")
    for i in range(2):
        context = block(context, name=f"encoder{i}")
    x = embed(target, "target_embedding")
    for i in range(2):
        x = block(x, context=context, causal=True, name=f"decoder{i}")
    logits = keras.layers.Dense(VOCABULARY, name="logits")(x)
    return keras.Model(
        {"encoder_inputs": source, "decoder_inputs": target}, logits
    ), keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0)


def sentiment_model():
    ids = keras.Input((None,), dtype="int32")
    x = embed(ids, "embedding")
    for i in range(2):
        x = block(x, name=f"encoder{i}")
    x = keras.layers.GlobalAveragePooling1D()(x)
    logits = keras.layers.Dense(1)(x)
    return keras.Model(ids, logits), keras.losses.BinaryCrossentropy(from_logits=True)


def language_model():
    ids = keras.Input((None,), dtype="int32")
    x = embed(ids, "embedding")
    for i in range(2):
        x = block(x, causal=True, name=f"decoder{i}")
    logits = keras.layers.Dense(VOCABULARY)(x)
    return keras.Model(ids, logits), keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, ignore_class=0
    )


# -- measurements ------------------------------------------------------------


def batch_size_of(element) -> int:
    return int(tf.nest.flatten(element)[-1].shape[0])


def pipeline_rate(make_dataset, rounds: int) -> float:
    """Median examples/s over `rounds` full epochs (after one warm-up epoch)."""
    dataset = make_dataset()
    for _ in dataset:  # warm-up: traces the functions (and fills the cache)
        pass
    rates = []
    for _ in range(rounds):
        start = time.perf_counter()
        examples = sum(batch_size_of(element) for element in dataset)
        rates.append(examples / (time.perf_counter() - start))
    return statistics.median(rates)


def training_rate(build, dataset, steps: int, rounds: int) -> float:
    """Median training examples/s of `build()` on `steps` cached batches."""
    keras.utils.set_random_seed(0)
    model, loss = build()
    model.compile(keras.optimizers.Adam(1e-4), loss)
    batches = dataset.take(steps).cache()
    examples = sum(batch_size_of(element) for element in batches)
    model.fit(batches, epochs=2, verbose=0)  # warm-up: traces every shape
    rates = []
    for _ in range(rounds):
        start = time.perf_counter()
        model.fit(batches, epochs=1, verbose=0)
        rates.append(examples / (time.perf_counter() - start))
    return statistics.median(rates)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()

    vocab_dir = tempfile.mkdtemp(prefix="pipeline_bench_")
    started = time.perf_counter()
    pairs = load_translation_pairs()
    reviews = load_movie_reviews()
    plays = load_shakespeare()

    def tokenizer(name, texts, **options):
        path = os.path.join(vocab_dir, f"{name}.model")
        return SubwordTokenizer(
            train_subword_vocabulary(texts, path, vocabulary_size=VOCABULARY, **options)
        )

    english = tokenizer("en", [e for e, _ in pairs.train])
    german = tokenizer("de", [g for _, g in pairs.train])
    movie = tokenizer("movie", [t for t, _ in reviews.train])
    shakespeare = tokenizer("shk", [d.text for d in plays.train], lossless=True)
    print(
        f"data and tokenizers ready in {time.perf_counter() - started:.0f} s",
        file=sys.stderr,
    )

    tasks = {
        "translation": (
            lambda cache: translation_dataset(
                pairs.train,
                english,
                german,
                batch_size=BATCH["translation"],
                max_length=MAX_LENGTH["translation"],
                cache=cache,
                seed=0,
            ),
            translation_model,
        ),
        "sentiment": (
            lambda cache: classification_dataset(
                reviews.train,
                movie,
                batch_size=BATCH["sentiment"],
                max_length=MAX_LENGTH["sentiment"],
                cache=cache,
                seed=0,
            ),
            sentiment_model,
        ),
        "language model": (
            lambda cache: language_model_dataset(
                plays.train,
                shakespeare,
                sequence_length=MAX_LENGTH["language model"],
                batch_size=BATCH["language model"],
                cache=cache,
                seed=0,
            ),
            language_model,
        ),
    }
    results = {}
    for task, (make_dataset, build) in tasks.items():
        cold = pipeline_rate(lambda make=make_dataset: make(False), args.rounds)
        warm = pipeline_rate(lambda make=make_dataset: make(True), args.rounds)
        train = training_rate(build, make_dataset(True), args.steps, args.rounds)
        results[task] = {
            "batch_size": BATCH[task],
            "max_length": MAX_LENGTH[task],
            "pipeline_cold_examples_per_s": cold,
            "pipeline_warm_examples_per_s": warm,
            "training_examples_per_s": train,
            "ratio_cold": cold / train,
            "ratio_warm": warm / train,
        }
        print(f"{task}: done", file=sys.stderr)

    devices = [d.device_type for d in tf.config.list_physical_devices()]
    print(
        f"\nkeras {keras.__version__}, tensorflow {tf.__version__}, devices "
        f"{sorted(set(devices))}, {os.cpu_count()} CPU cores; medians of "
        f"{args.rounds} rounds\n"
    )
    print(
        "| task | batch x length | pipeline, cold (ex/s) | pipeline, warm (ex/s) "
        "| training (ex/s) | ratio cold | ratio warm |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for task, r in results.items():
        print(
            f"| {task} | {r['batch_size']} x {r['max_length']} "
            f"| {r['pipeline_cold_examples_per_s']:,.0f} "
            f"| {r['pipeline_warm_examples_per_s']:,.0f} "
            f"| {r['training_examples_per_s']:,.1f} "
            f"| {r['ratio_cold']:,.0f}x | {r['ratio_warm']:,.0f}x |"
        )
    slowest = min(r["ratio_cold"] for r in results.values())
    print(f"\nlowest ratio: {slowest:,.0f}x (required: 10x)")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=1)
    return 0 if slowest >= 10 else 1


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    sys.exit(main())
