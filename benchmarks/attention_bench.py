"""MultiHeadSelfAttention against keras.layers.MultiHeadAttention.

Batch 32, length 128, d_model 256, 8 heads; forward and forward+backward, in
float32 and mixed_bfloat16. Both layers run inside the same kind of
`tf.function`, are timed alternately in this one process, and the medians are
compared; the fraction of the matmul peak (measured here too) is printed.

    .venv/bin/python benchmarks/attention_bench.py [--rounds 15] [--jit]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras
import numpy as np
import tensorflow as tf
from _timing import alternate, matmul_peak

from keras_attn.layers import MultiHeadSelfAttention

BATCH, LENGTH, MODEL_DIM, HEADS = 32, 128, 256, 8


def forward_flops() -> float:
    projections = 4 * 2 * BATCH * LENGTH * MODEL_DIM * MODEL_DIM  # q, k, v, out
    attention = 2 * 2 * BATCH * LENGTH * LENGTH * MODEL_DIM  # q·k and w·v
    return projections + attention


def make_step(layer, inputs, backward: bool, jit: bool):
    if backward:

        def step():
            with tf.GradientTape() as tape:
                out = (
                    layer(inputs, inputs)
                    if isinstance(layer, keras.layers.MultiHeadAttention)
                    and not isinstance(layer, MultiHeadSelfAttention)
                    else layer(inputs)
                )
                loss = tf.reduce_sum(tf.cast(out, "float32"))
            return tape.gradient(loss, layer.trainable_variables)
    else:

        def step():
            if isinstance(layer, MultiHeadSelfAttention):
                return layer(inputs)
            return layer(inputs, inputs)

    compiled = tf.function(step, jit_compile=jit)

    def run():
        result = compiled()
        tf.nest.map_structure(lambda t: t.numpy(), result)

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--jit", action="store_true", help="XLA-compile both")
    args = parser.parse_args()
    print(
        f"threads: {tf.config.threading.get_intra_op_parallelism_threads() or 'auto'}, "
        f"jit_compile={args.jit}, batch {BATCH}, length {LENGTH}, "
        f"d_model {MODEL_DIM}, {HEADS} heads; medians of {args.rounds} rounds"
    )
    peaks = {
        "float32": matmul_peak("float32"),
        "mixed_bfloat16": matmul_peak("bfloat16"),
    }
    for policy, peak in peaks.items():
        print(f"matmul peak {policy:>15}: {peak / 1e9:8.1f} GFLOP/s")
    rows = []
    for policy in ("float32", "mixed_bfloat16"):
        keras.config.set_dtype_policy(policy)
        inputs = tf.constant(
            np.random.default_rng(0).normal(size=(BATCH, LENGTH, MODEL_DIM)),
            dtype=keras.config.dtype_policy().compute_dtype,
        )
        ours = MultiHeadSelfAttention(num_heads=HEADS)
        theirs = keras.layers.MultiHeadAttention(
            num_heads=HEADS, key_dim=MODEL_DIM // HEADS
        )
        ours(inputs)
        theirs(inputs, inputs)
        theirs.set_weights(ours.get_weights())
        for backward in (False, True):
            fns = {
                "keras_attn": make_step(ours, inputs, backward, args.jit),
                "keras": make_step(theirs, inputs, backward, args.jit),
            }
            medians = alternate(fns, rounds=args.rounds)
            flops = forward_flops() * (3 if backward else 1)
            pass_name = "fwd+bwd" if backward else "forward"
            rows.append((policy, pass_name, medians, flops / peaks[policy]))
        keras.config.set_dtype_policy("float32")
    print()
    print(
        f"{'policy':<15} {'pass':<8} {'keras_attn ms':>13} {'keras ms':>9} "
        f"{'ratio':>6} {'ours %peak':>10} {'keras %peak':>11}"
    )
    for policy, pass_name, medians, peak_seconds in rows:
        ours_s, theirs_s = medians["keras_attn"], medians["keras"]
        print(
            f"{policy:<15} {pass_name:<8} {ours_s * 1e3:13.2f} {theirs_s * 1e3:9.2f} "
            f"{theirs_s / ours_s:6.2f} {100 * peak_seconds / ours_s:9.1f}% "
            f"{100 * peak_seconds / theirs_s:10.1f}%"
        )
    print("ratio = keras time / keras_attn time (>= 1.0: keras_attn not slower)")


if __name__ == "__main__":
    main()
