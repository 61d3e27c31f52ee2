"""kNN-MT's datastore search: one decoding step's `nearest_neighbors`.

The search of one beam-search step of the default translator's kNN-MT
decoding (`examples/translate.py`): 256 queries (64 sentences x 4 beams) of
dimension 384 against the 198,387 keys of the Ding training pairs' datastore,
k = 128, in chunks of 65,536 keys. Ours (`keras_attn.memory.nearest_neighbors`
with the keys' squared norms kept, as `NearestNeighborDecoding` does)
against the plain exact search that computes the norms at every call: the
same matrix product and `top_k` per chunk. Both must
return the same neighbours. Ours with the keys held in bfloat16 too
(`NearestNeighborDecoding(key_dtype="bfloat16")`, the script's choice for a
mixed_bfloat16 model): products in bfloat16, half the memory; the share of
neighbours it finds in common with the exact search is printed. Random keys
(the search's cost does not depend on the data) unless `--datastore PATH`
names a saved `TranslationDatastore` (`.npz`). Medians of alternating rounds
in one process.

    .venv/bin/python benchmarks/knn_bench.py [--rounds 15] [--datastore PATH]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import tensorflow as tf

from benchmarks._timing import alternate
from keras_attn.memory import nearest_neighbors


def plain_search(queries, keys, k, key_chunk_size):
    """Exact search, one `top_k` over every chunk's distances, then a merge."""
    query_norms = tf.reduce_sum(tf.square(queries), axis=-1, keepdims=True)
    best_distances = best_indices = None
    for start in range(0, keys.shape[0], key_chunk_size):
        chunk = keys[start : start + key_chunk_size]
        distances = (
            query_norms
            - 2.0 * tf.matmul(queries, chunk, transpose_b=True)
            + tf.reduce_sum(tf.square(chunk), axis=-1)[None, :]
        )
        negative, indices = tf.math.top_k(-distances, k=k)
        indices = indices + start
        if best_distances is not None:
            negative = tf.concat([-best_distances, negative], axis=1)
            indices = tf.concat([best_indices, indices], axis=1)
            negative, pick = tf.math.top_k(negative, k=k)
            indices = tf.gather(indices, pick, batch_dims=1)
        best_distances, best_indices = -negative, indices
    return best_distances, best_indices


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--datastore", help="a saved TranslationDatastore (.npz)")
    parser.add_argument("--queries", type=int, default=256)
    parser.add_argument("--k", type=int, default=128)
    parser.add_argument("--key-chunk-size", type=int, default=65536)
    args = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    if args.datastore:
        from keras_attn.memory import TranslationDatastore

        keys = TranslationDatastore.load(args.datastore).keys
        rows = rng.choice(len(keys), size=args.queries, replace=False)
        queries = keys[rows] + rng.normal(scale=0.1, size=(args.queries, keys.shape[1]))
        source = args.datastore
    else:
        keys = rng.normal(size=(198_387, 384))
        queries = rng.normal(size=(args.queries, 384))
        source = "random normal keys"
    keys = tf.constant(keys, tf.float32)
    queries = tf.constant(queries, tf.float32)
    key_norms = tf.reduce_sum(tf.square(keys), axis=-1)
    half_keys = tf.cast(keys, tf.bfloat16)
    half_norms = tf.reduce_sum(tf.square(tf.cast(half_keys, tf.float32)), axis=-1)
    k, chunk = args.k, args.key_chunk_size

    ours = tf.function(
        lambda: nearest_neighbors(
            queries, keys, k, key_chunk_size=chunk, key_norms=key_norms
        )
    )
    half = tf.function(
        lambda: nearest_neighbors(
            queries, half_keys, k, key_chunk_size=chunk, key_norms=half_norms
        )
    )
    plain = tf.function(lambda: plain_search(queries, keys, k, chunk))
    ours_distances, ours_indices = ours()
    plain_distances, plain_indices = plain()
    np.testing.assert_allclose(
        ours_distances.numpy(), plain_distances.numpy(), rtol=1e-5, atol=1e-3
    )
    same = np.mean(ours_indices.numpy() == plain_indices.numpy())
    print(
        f"{keys.shape[0]:,} keys of dimension {keys.shape[1]} ({source}), "
        f"{args.queries} queries, k {k}, chunks of {chunk:,} keys"
    )
    print(f"same neighbours as the plain search: {100 * same:.2f}% of positions")
    half_indices = half()[1].numpy()
    overlap = np.mean(
        [
            len(set(row) & set(want)) / k
            for row, want in zip(half_indices, plain_indices.numpy(), strict=True)
        ]
    )
    print(f"bfloat16 keys: {100 * overlap:.2f}% of the exact neighbours found")

    seconds = alternate(
        {
            "ours": lambda: [t.numpy() for t in ours()],
            "half": lambda: [t.numpy() for t in half()],
            "plain": lambda: [t.numpy() for t in plain()],
        },
        rounds=args.rounds,
    )
    print(f"{'search':<40} {'median ms':>10}")
    print(f"{'keras_attn nearest_neighbors':<40} {1000 * seconds['ours']:>10.1f}")
    print(f"{'  the same, bfloat16 keys':<40} {1000 * seconds['half']:>10.1f}")
    print(f"{'plain matmul + top_k per chunk':<40} {1000 * seconds['plain']:>10.1f}")
    print(
        f"ratio = plain / ours: {seconds['plain'] / seconds['ours']:.2f} (float32), "
        f"{seconds['plain'] / seconds['half']:.2f} (bfloat16 keys)"
    )


if __name__ == "__main__":
    main()
