"""Transformer blocks against keras-hub's TransformerEncoder / TransformerDecoder.

Forward+backward (gradients of every weight and of the inputs) of one block:
encoder batch 32, length 128; decoder batch 32, 64 target / 64 source tokens;
d_model 256, 8 heads, intermediate 1024. Both implementations get the same
weights, run inside the same kind of `tf.function`, and are timed alternately
in this one process (medians of `--rounds` rounds after warm-up). The matmul
peak of each dtype is measured in the same rounds (a 2048x2048 `tf.matmul`,
timed alternately with the blocks so that it sees the same machine load), and
the fraction of it that each block reaches is printed (FLOPs: the matmuls of
the forward pass, times 3 for forward+backward).

    .venv/bin/python benchmarks/blocks_bench.py [--rounds 15] [--dropout 0.0] [--jit]
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
import tensorflow as tf
from _timing import alternate

from keras_attn.layers.transformer_decoder_block import (
    TransformerDecoderBlock,
)
from keras_attn.layers.transformer_encoder_block import (
    TransformerEncoderBlock,
)

BATCH, MODEL_DIM, HEADS, INTERMEDIATE = 32, 256, 8, 1024
ENCODER_LENGTH, TARGET_LENGTH, SOURCE_LENGTH = 128, 64, 64
PEAK_SIZE = 2048


def encoder_flops(length=ENCODER_LENGTH) -> float:
    tokens = BATCH * length
    projections = 4 * 2 * tokens * MODEL_DIM * MODEL_DIM  # q, k, v, output
    attention = 2 * 2 * tokens * length * MODEL_DIM  # q·kᵀ and weights·v
    feed_forward = 2 * 2 * tokens * MODEL_DIM * INTERMEDIATE
    return projections + attention + feed_forward


def decoder_flops() -> float:
    target, source = BATCH * TARGET_LENGTH, BATCH * SOURCE_LENGTH
    self_attention = (
        4 * 2 * target * MODEL_DIM**2 + 4 * target * TARGET_LENGTH * MODEL_DIM
    )
    cross_projections = 2 * 2 * (target + source) * MODEL_DIM**2  # q, out | k, v
    cross_attention = 4 * target * SOURCE_LENGTH * MODEL_DIM
    feed_forward = 4 * target * MODEL_DIM * INTERMEDIATE
    return self_attention + cross_projections + cross_attention + feed_forward


def make_step(layer, inputs, jit: bool):
    """A compiled forward+backward: gradients of all weights and inputs."""

    def step():
        with tf.GradientTape() as tape:
            tape.watch(inputs)
            outputs = layer(*inputs, training=True)
            loss = tf.reduce_sum(tf.square(tf.cast(outputs, "float32")))
        return tape.gradient(loss, [*layer.trainable_variables, *inputs])

    compiled = tf.function(step, jit_compile=jit)

    def run():
        tf.nest.map_structure(lambda t: t.numpy(), compiled())

    return run


def make_matmul(dtype: str, size: int = PEAK_SIZE):
    """A compiled square matmul in `dtype`, the practical peak of the CPU."""
    rng = np.random.default_rng(0)
    a = tf.constant(rng.normal(size=(size, size)), dtype=dtype)
    b = tf.constant(rng.normal(size=(size, size)), dtype=dtype)
    compiled = tf.function(lambda: tf.matmul(a, b))

    def run():
        compiled().numpy()

    return run


def pairs(dropout: float):
    """(name, our block, keras-hub block, inputs, forward FLOPs) to compare."""
    rng = np.random.default_rng(0)
    dtype = keras.config.dtype_policy().compute_dtype

    def sequence(length):
        return tf.constant(rng.normal(size=(BATCH, length, MODEL_DIM)), dtype=dtype)

    encoder_inputs = (sequence(ENCODER_LENGTH),)
    decoder_inputs = (sequence(TARGET_LENGTH), sequence(SOURCE_LENGTH))
    common = {"num_heads": HEADS, "intermediate_dim": INTERMEDIATE, "dropout": dropout}
    yield (
        "encoder",
        TransformerEncoderBlock(**common),
        keras_hub.layers.TransformerEncoder(**common),
        encoder_inputs,
        encoder_flops(),
    )
    yield (
        "decoder",
        TransformerDecoderBlock(**common),
        keras_hub.layers.TransformerDecoder(**common),
        decoder_inputs,
        decoder_flops(),
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--jit", action="store_true", help="XLA-compile both")
    parser.add_argument(
        "--policies", default="float32,mixed_bfloat16", help="comma-separated"
    )
    args = parser.parse_args()
    print(
        f"tensorflow {tf.__version__}, keras {keras.__version__}, keras-hub "
        f"{keras_hub.__version__}; jit_compile={args.jit}, dropout={args.dropout}, "
        f"batch {BATCH}, d_model {MODEL_DIM}, {HEADS} heads, intermediate "
        f"{INTERMEDIATE}; encoder length {ENCODER_LENGTH}, decoder "
        f"{TARGET_LENGTH}/{SOURCE_LENGTH}; medians of {args.rounds} rounds"
    )
    rows = []
    for policy in args.policies.split(","):
        keras.config.set_dtype_policy(policy)
        matmul = make_matmul(keras.config.dtype_policy().compute_dtype)
        for name, ours, theirs, inputs, flops in pairs(args.dropout):
            ours(*inputs)
            theirs(*inputs)
            theirs.set_weights(ours.get_weights())
            medians = alternate(
                {
                    "keras_attn": make_step(ours, inputs, args.jit),
                    "keras_hub": make_step(theirs, inputs, args.jit),
                    "matmul": matmul,
                },
                rounds=args.rounds,
            )
            peak = 2 * PEAK_SIZE**3 / medians["matmul"]
            rows.append((policy, name, medians, peak, 3 * flops / peak))
        keras.config.set_dtype_policy("float32")
    print(
        f"{'policy':<15} {'block':<8} {'keras_attn ms':>13} {'keras_hub ms':>12} "
        f"{'ratio':>6} {'peak GFLOP/s':>12} {'ours %peak':>10} {'hub %peak':>9}"
    )
    for policy, name, medians, peak, peak_seconds in rows:
        ours_s, theirs_s = medians["keras_attn"], medians["keras_hub"]
        print(
            f"{policy:<15} {name:<8} {ours_s * 1e3:13.2f} {theirs_s * 1e3:12.2f} "
            f"{theirs_s / ours_s:6.2f} {peak / 1e9:12.1f} "
            f"{100 * peak_seconds / ours_s:9.1f}% {100 * peak_seconds / theirs_s:8.1f}%"
        )
    print("ratio = keras_hub time / keras_attn time (> 1: keras_attn faster)")


if __name__ == "__main__":
    main()
