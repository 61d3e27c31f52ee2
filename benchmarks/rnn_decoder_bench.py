"""The RNN translator's training step: Bahdanau keys projected once vs per step.

`BahdanauDecoder` projects the encoder states for the additive score
(`W_k h_j`) once per source and passes the projection to every step of its
loop. The alternative, projecting at every step (what it did before), is
timed against it on the same model and batches: one `train_on_batch` of
`RNNTranslator` at the example script's base size (embedding 256, units
512, attention units 512, 8k vocabulary), batch 64, source and target
lengths `--length`. Both run in this one process, alternately (medians of
`--rounds` rounds after warm-up).

    .venv/bin/python benchmarks/rnn_decoder_bench.py [--rounds 10] [--length 20]
        [--policy mixed_bfloat16]
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
import numpy as np
from _timing import alternate

from keras_attn.models import RNNTranslator

BATCH, VOCABULARY = 64, 8000


def build(per_step_projection: bool) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = RNNTranslator(VOCABULARY, VOCABULARY, dropout=0.0)
    if per_step_projection:
        # Without a projection made before the loop, each step projects the
        # encoder states itself.
        model.decoder.project_memory = lambda memory: None
    model.compile(
        optimizer=keras.optimizers.AdamW(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--length", type=int, default=20)
    parser.add_argument(
        "--policy", choices=["float32", "mixed_bfloat16"], default="mixed_bfloat16"
    )
    args = parser.parse_args(argv)
    keras.mixed_precision.set_dtype_policy(args.policy)
    rng = np.random.default_rng(0)
    shape = (BATCH, args.length)
    x = {
        "encoder_inputs": rng.integers(1, VOCABULARY, shape).astype("int32"),
        "decoder_inputs": rng.integers(1, VOCABULARY, shape).astype("int32"),
    }
    y = rng.integers(1, VOCABULARY, shape).astype("int32")
    models = {"once per source": build(False), "every step": build(True)}
    seconds = alternate(
        {name: lambda m=m: m.train_on_batch(x, y) for name, m in models.items()},
        rounds=args.rounds,
        warmup=2,
        inner=2,
    )
    print(
        f"RNNTranslator train step, batch {BATCH}, length {args.length}, "
        f"{args.policy}; medians of {args.rounds} rounds"
    )
    for name, value in seconds.items():
        print(f"  W_k h_j projected {name:16s} {1000 * value:8.1f} ms")
    ratio = seconds["every step"] / seconds["once per source"]
    print(f"  speed-up of projecting once: {ratio:.2f}x")


if __name__ == "__main__":
    main()
