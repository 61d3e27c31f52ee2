"""Fine-tuning throughput of the pretrained sentiment classifier vs keras-hub's BERT.

`examples/sentiment.py`'s default model, `TextClassifier.from_bert` over
all-MiniLM-L6-v2 (6 post-norm blocks, d_model 384, 12 heads, intermediate
1536, 30,522-piece vocabulary, mean pooling, sigmoid), against the same
architecture built by keras-hub: `keras_hub.models.BertBackbone` with these
sizes under `keras_hub.models.BertTextClassifier` (its standard fine-tuning
head: the `[CLS]` pooler, dropout, 2-way logits), keras-hub's own BERT
implementation (`TransformerEncoder`, `keras.layers.MultiHeadAttention`).
The weights do not change the work of a step, so keras-hub's model keeps
its random initialisation.

Each model is compiled as it would be fine-tuned (AdamW 5e-5; binary
cross-entropy on our probability, sparse categorical cross-entropy on
keras-hub's logits) and timed on the same batches of real movie-review
sentences, tokenized with the checkpoint's WordPiece tokenizer and padded
to the longest in the batch (batch 32, as the script): a full training step
(`train_on_batch`: forward, backward, optimizer update), in float32 and
mixed_bfloat16, alternately in this one process, medians of `--rounds`.
Tokens = non-padding tokens of the batch.

    .venv/bin/python benchmarks/pretrained_bench.py [--rounds 10] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras
import keras_hub
import numpy as np
from _timing import alternate

from keras_attn.checkpoints import load_minilm
from keras_attn.datasets import load_movie_reviews
from keras_attn.models import TextClassifier

BATCH = 32
MAX_LENGTH = 64


def ours(checkpoint):
    model = TextClassifier.from_bert(checkpoint)
    model.compile(optimizer=keras.optimizers.AdamW(5e-5), loss="binary_crossentropy")
    return model


def keras_hub_bert(checkpoint):
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=len(checkpoint.vocabulary),
        num_layers=checkpoint.num_layers,
        num_heads=checkpoint.num_heads,
        hidden_dim=checkpoint.hidden_size,
        intermediate_dim=checkpoint.intermediate_size,
        max_sequence_length=checkpoint.max_positions,
    )
    model = keras_hub.models.BertTextClassifier(backbone, num_classes=2)
    model.compile(
        optimizer=keras.optimizers.AdamW(5e-5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def batches(checkpoint, count, seed=0):
    """`count` batches of shuffled training sentences: (ids, labels, tokens)."""
    examples = load_movie_reviews(verbose=False).train
    order = np.random.default_rng(seed).permutation(len(examples))
    tokenizer = checkpoint.tokenizer(max_length=MAX_LENGTH)
    result = []
    for index in range(count):
        chosen = [examples[i] for i in order[index * BATCH : (index + 1) * BATCH]]
        ids = np.asarray(tokenizer.tokenize([text for text, _ in chosen]).to_tensor())
        labels = np.asarray([label for _, label in chosen], "int32")
        result.append((ids, labels, int((ids != 0).sum())))
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--batches", type=int, default=4, help="distinct batches")
    parser.add_argument("--smoke", action="store_true", help="2 rounds, float32")
    args = parser.parse_args(argv)
    rounds = 2 if args.smoke else args.rounds
    policies = ["float32"] if args.smoke else ["float32", "mixed_bfloat16"]
    checkpoint = load_minilm()
    data = batches(checkpoint, args.batches)
    tokens = sum(count for _, _, count in data)
    padded = np.mean([ids.shape[1] for ids, _, _ in data])
    print(
        f"{len(data)} batches of {BATCH} sentences, {tokens / len(data):.0f} "
        f"tokens each on average (padded to {padded:.0f})"
    )
    rows = []
    for policy in policies:
        keras.config.set_dtype_policy(policy)
        models = {
            "keras_attn": ours(checkpoint),
            "keras_hub": keras_hub_bert(checkpoint),
        }

        def step(name, models=models):
            model = models[name]

            def run():
                for ids, labels, _ in data:
                    if name == "keras_attn":
                        model.train_on_batch(ids, labels[:, None])
                    else:
                        inputs = {
                            "token_ids": ids,
                            "segment_ids": np.zeros_like(ids),
                            "padding_mask": ids != 0,
                        }
                        model.train_on_batch(inputs, labels)

            return run

        seconds = alternate(
            {name: step(name) for name in models}, rounds=rounds, warmup=2, inner=1
        )
        for name, value in seconds.items():
            rows.append((policy, name, tokens / value, value / len(data)))
        ratio = seconds["keras_hub"] / seconds["keras_attn"]
        print(f"{policy}: keras_attn / keras_hub tokens per second = {ratio:.2f}")
    keras.config.set_dtype_policy("float32")
    print("\n| policy | model | tokens/s | ms per step |\n|---|---|---:|---:|")
    for policy, name, rate, step_seconds in rows:
        print(f"| {policy} | {name} | {rate:,.0f} | {1000 * step_seconds:.0f} |")


if __name__ == "__main__":
    main()
