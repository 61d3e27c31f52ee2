"""Grouped-query against multi-head attention: decoding speed and KV-cache size.

A stack of `--layers` pre-norm `keras_attn.layers.TransformerDecoderBlock`s
(default 4 blocks, d_model 512, 8 query heads of 64, intermediate 2048, no
dropout, float32) decodes one new token per sequence per step (batch
`--batch`, default 4) over a KV cache of `context` positions, for each
context of `--contexts` (default 512 1024 2048 4096 8192), in two variants
with the same sizes:

- `MHA`: full multi-head attention, `num_key_value_heads=None` (8 key/value
  heads: the cache holds 8 heads);
- `GQA`: grouped-query attention, `num_key_value_heads=--kv-heads` (default
  2: the cache holds 2 heads, each shared by 4 query heads).

The cache of each block is the tuple `(key_cache, value_cache)` of
`block.initial_cache(batch, context)`, `(batch, context, heads, 64)` each,
pre-filled with random values (the cost of a step does not depend on them).
One compiled call runs `--steps` decoding steps in an `ops.fori_loop` (as
`keras_attn.generation` decodes): step `s` feeds one token per sequence
(the previous step's output, RMS-normalised) through every block with
`self_attention_cache=cache, cache_update_index=context - steps + s`, so the
last steps of the context are written and every step attends over the whole
cache of `context` positions (the layers score all the cache's positions and
mask the later ones: the cost of a step is that of the full context). The
call is compiled once per variant and context: `tf.function` with a fixed
input signature and `jit_compile=True` (XLA; `--no-xla` for plain graphs) on
TensorFlow, `jax.jit` over `stateless_call`-style variables on JAX
(`--backend jax`). The tracing count is checked to stay at one. What a
step costs is the library's: on TensorFlow `keras_attn.ops.update_cache` is
a gather and a `where` over the whole cache (core ops only), so each step
also rewrites every cache tensor; on JAX it is a dynamic update slice.

Time: the median of `--rounds` rounds (after one warm-up call), MHA and GQA
calls alternating within each round, in this one process, including the
device-to-host copy of the last output; tokens/s = batch * steps / seconds
(the JSON also has every round's seconds and the best round's tokens/s).
The ratio GQA/MHA is also given as the median of the per-round ratios, more
robust on a loaded machine. Bytes: the sum of the sizes of the cache tensors
a compiled call returned (shape * item size, every block, keys and values);
their ratio GQA/MHA must be exactly `kv_heads / heads` (checked). The
returned caches are checked to have the variant's key/value heads, the
written positions changed and the other positions kept.

    .venv/bin/python benchmarks/gqa_decoding_bench.py \\
        [--contexts 512 1024 2048 4096 8192] [--rounds 15] [--steps 8] \\
        [--batch 4] [--layers 4] [--model-dim 512] [--heads 8] [--kv-heads 2] \\
        [--intermediate 2048] [--backend tensorflow|jax] [--no-xla] \\
        [--json results.json] [--quick]

`--quick` (tiny sizes, for the test): contexts 16 32, 2 blocks of d_model 32,
4 heads, 2 key/value heads, batch 2, 3 steps, 2 rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from fractions import Fraction

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._timing import machine

MIB = 2**20
VARIANTS = ("MHA", "GQA")
QUICK = dict(
    contexts=[16, 32],
    layers=2,
    model_dim=32,
    heads=4,
    kv_heads=2,
    intermediate=64,
    batch=2,
    steps=3,
    rounds=2,
)


def use_backend(name: str) -> None:
    """Select the Keras backend before Keras is imported (or check it)."""
    if "keras" in sys.modules:
        import keras

        if keras.backend.backend() != name:
            raise SystemExit(
                f"Keras is already imported with the {keras.backend.backend()} "
                f"backend; cannot switch to --backend {name} in this process."
            )
        return
    os.environ["KERAS_BACKEND"] = name


# -- the model ---------------------------------------------------------------------


def build_blocks(args, variant: str):
    """The decoder stack of one variant (same seed: same weight shapes and,
    where they coincide, the same initial values)."""
    import keras
    from keras import ops

    from keras_attn.layers import TransformerDecoderBlock

    keras.utils.set_random_seed(args.seed)
    kv_heads = None if variant == "MHA" else args.kv_heads
    blocks = [
        TransformerDecoderBlock(
            intermediate_dim=args.intermediate,
            num_heads=args.heads,
            dropout=0.0,
            normalize_first=True,
            key_dim=args.model_dim // args.heads,
            num_key_value_heads=kv_heads,
            name=f"{variant.lower()}_block_{i}",
        )
        for i in range(args.layers)
    ]
    x = ops.zeros((1, 2, args.model_dim))
    for block in blocks:
        x = block(x)
    return blocks


def filled_cache(blocks, batch: int, context: int, seed: int):
    """One `(key_cache, value_cache)` per block, random values."""
    import keras
    from keras import ops

    caches = []
    for i, block in enumerate(blocks):
        pair = block.initial_cache(batch, context)
        caches.append(
            tuple(
                ops.cast(
                    keras.random.normal(tuple(t.shape), seed=seed + 2 * i + j),
                    t.dtype,
                )
                for j, t in enumerate(pair)
            )
        )
    return tuple(caches)


def decode_fn(blocks, steps: int):
    """`(x (B, 1, d), cache, start) -> (x, cache)`: `steps` decoding steps,
    writing positions `start .. start + steps - 1`."""
    from keras import ops

    def decode(x, cache, start):
        def body(i, state):
            h, cache = state
            new_cache = []
            for block, block_cache in zip(blocks, cache, strict=True):
                h, block_cache = block(
                    h, self_attention_cache=block_cache, cache_update_index=start + i
                )
                new_cache.append(tuple(block_cache))
            # The next step's input: this output, RMS-normalised (bounded).
            h = h * ops.rsqrt(ops.mean(ops.square(h), axis=-1, keepdims=True) + 1e-6)
            return h, tuple(new_cache)

        return ops.fori_loop(0, steps, body, (x, cache))

    return decode


def compiled_decode(blocks, steps, x, cache, xla: bool):
    """`(run, tracing_count)`: `run(x, cache, start)` calls the compiled decode
    and returns host-side output and the cache; `tracing_count()` the number
    of traces so far."""
    import keras

    decode = decode_fn(blocks, steps)
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        spec = lambda t: tf.TensorSpec(t.shape, t.dtype)  # noqa: E731
        signature = [
            spec(x),
            tuple(tuple(spec(t) for t in pair) for pair in cache),
            tf.TensorSpec((), tf.int32),
        ]
        fn = tf.function(
            decode, input_signature=signature, jit_compile=xla, autograph=False
        )

        def run(x, cache, start):
            out, new_cache = fn(x, cache, tf.constant(start, tf.int32))
            return out.numpy(), new_cache

        return run, fn.experimental_get_tracing_count

    if keras.backend.backend() == "jax":
        import jax
        import jax.numpy as jnp

        variables = [v for block in blocks for v in block.variables]
        traces = [0]

        def pure(values, x, cache, start):
            traces[0] += 1
            mapping = list(zip(variables, values, strict=True))
            with keras.StatelessScope(state_mapping=mapping):
                return decode(x, cache, start)

        jitted = jax.jit(pure)
        values = [v.value for v in variables]

        def run(x, cache, start):
            out, new_cache = jitted(values, x, cache, jnp.asarray(start, jnp.int32))
            new_cache = jax.block_until_ready(new_cache)
            return jax.device_get(out), new_cache

        return run, lambda: traces[0]

    raise SystemExit(f"Unsupported backend: {keras.backend.backend()}")


def cache_bytes(cache) -> int:
    """Sum over the cache tensors of shape * item size."""
    import keras
    import numpy as np

    total = 0
    for pair in cache:
        for t in pair:
            itemsize = np.dtype(keras.backend.standardize_dtype(t.dtype)).itemsize
            total += int(np.prod(tuple(t.shape))) * itemsize
    return total


def check_cache(before, after, start: int, steps: int) -> dict:
    """Whether the call wrote the positions `start .. start + steps - 1` of
    every cache tensor and kept the others (block 0 and the last block)."""
    from keras import ops

    written, kept = True, True
    for index in sorted({0, len(before) - 1}):
        for old, new in zip(before[index], after[index], strict=True):
            old, new = ops.convert_to_numpy(old), ops.convert_to_numpy(new)
            window = slice(start, start + steps)
            # Every written row differs from the random value it replaced.
            differs = (old[:, window] != new[:, window]).any(axis=(2, 3))
            written = written and bool(differs.all())
            kept = kept and bool((old[:, :start] == new[:, :start]).all())
            kept = kept and bool(
                (old[:, start + steps :] == new[:, start + steps :]).all()
            )
    return {"written_positions_changed": written, "other_positions_kept": kept}


# -- one context ------------------------------------------------------------------


def run_context(args, blocks, context: int) -> dict:
    """Both variants at one context: compile, check, time alternately."""
    import numpy as np
    from keras import ops

    steps = args.steps
    start = context - steps
    rng = np.random.default_rng(args.seed)
    x = ops.convert_to_tensor(
        rng.normal(size=(args.batch, 1, args.model_dim)).astype("float32")
    )
    result = {"context": context, "start_index": start}
    runs, caches = {}, {}
    for variant in VARIANTS:
        cache = filled_cache(blocks[variant], args.batch, context, args.seed)
        run, tracing_count = compiled_decode(
            blocks[variant], steps, x, cache, not args.no_xla
        )
        began = time.perf_counter()
        out, new_cache = run(x, cache, start)
        first = time.perf_counter() - began
        key_cache = new_cache[0][0]
        result[variant] = {
            "first_call_seconds": first,
            "cache_bytes": cache_bytes(new_cache),
            "input_cache_bytes": cache_bytes(cache),
            "key_cache_shape": [int(d) for d in key_cache.shape],
            "key_value_heads": int(key_cache.shape[2]),
            "cache_tensors": 2 * len(new_cache),
            "output_finite": bool(np.isfinite(out).all()),
            **check_cache(cache, new_cache, start, steps),
        }
        del new_cache
        runs[variant] = (run, cache, tracing_count)
        caches[variant] = cache

    times = {variant: [] for variant in VARIANTS}
    for variant in VARIANTS:  # one warm-up call each
        run, cache, _ = runs[variant]
        run(x, cache, start)
    for _ in range(args.rounds):
        for variant in VARIANTS:
            run, cache, _ = runs[variant]
            began = time.perf_counter()
            run(x, cache, start)
            times[variant].append(time.perf_counter() - began)

    for variant in VARIANTS:
        seconds = statistics.median(times[variant])
        result[variant].update(
            seconds_per_call=seconds,
            seconds_per_round=times[variant],
            ms_per_step=1000 * seconds / steps,
            tokens_per_s=args.batch * steps / seconds,
            # The best round: the figure least disturbed by other processes.
            best_tokens_per_s=args.batch * steps / min(times[variant]),
            tracing_count=int(runs[variant][2]()),
        )
    mha, gqa = result["MHA"], result["GQA"]
    result["speed_ratio"] = gqa["tokens_per_s"] / mha["tokens_per_s"]
    result["speed_ratio_per_round_median"] = statistics.median(
        m / g for m, g in zip(times["MHA"], times["GQA"], strict=True)
    )
    ratio = Fraction(gqa["cache_bytes"], mha["cache_bytes"])
    result["bytes_ratio"] = float(ratio)
    result["bytes_ratio_exact"] = f"{ratio.numerator}/{ratio.denominator}"
    expected = Fraction(args.kv_heads, args.heads)
    if ratio != expected:
        raise AssertionError(
            f"KV-cache bytes GQA/MHA at context {context} is {ratio}, not "
            f"kv_heads/heads = {expected}"
        )
    return result


# -- report -----------------------------------------------------------------------


def table(results) -> str:
    lines = [
        "| context | MHA tokens/s | GQA tokens/s | GQA/MHA speed | per-round median "
        "| MHA ms/step | GQA ms/step | MHA KV MiB | GQA KV MiB | GQA/MHA bytes |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        mha, gqa = r["MHA"], r["GQA"]
        lines.append(
            f"| {r['context']} | {mha['tokens_per_s']:.1f} | "
            f"{gqa['tokens_per_s']:.1f} | {r['speed_ratio']:.2f}x | "
            f"{r['speed_ratio_per_round_median']:.2f}x | {mha['ms_per_step']:.1f} | "
            f"{gqa['ms_per_step']:.1f} | {mha['cache_bytes'] / MIB:.2f} | "
            f"{gqa['cache_bytes'] / MIB:.2f} | {r['bytes_ratio']:.4g} "
            f"({r['bytes_ratio_exact']}) |"
        )
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192]
    )
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=8, help="steps per call")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--model-dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--backend",
        choices=["tensorflow", "jax"],
        default=os.environ.get("KERAS_BACKEND", "tensorflow"),
    )
    parser.add_argument(
        "--no-xla", action="store_true", help="TensorFlow: tf.function without XLA"
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a test)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    if args.model_dim % args.heads or args.heads % args.kv_heads:
        parser.error(
            "--model-dim must be divisible by --heads, and --heads by --kv-heads. "
            f"Received: {args.model_dim}, {args.heads}, {args.kv_heads}"
        )
    if args.kv_heads == args.heads:
        parser.error("--kv-heads must be fewer than --heads (GQA against MHA)")
    if min(args.contexts) <= args.steps:
        parser.error(
            f"every context must exceed --steps ({args.steps}). "
            f"Received: {args.contexts}"
        )
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    use_backend(args.backend)
    import keras

    from keras_attn.ops import attention_path

    versions = {"keras": keras.__version__}
    if args.backend == "tensorflow":
        import tensorflow as tf

        versions["tensorflow"] = tf.__version__
    else:
        import jax

        versions["jax"] = jax.__version__
    config = {
        name: getattr(args, name)
        for name in (
            "contexts",
            "rounds",
            "steps",
            "batch",
            "layers",
            "model_dim",
            "heads",
            "kv_heads",
            "intermediate",
            "quick",
        )
    }
    config["head_dim"] = args.model_dim // args.heads
    config["xla"] = not (args.backend == "tensorflow" and args.no_xla)
    config["compiled_with"] = (
        "jax.jit"
        if args.backend == "jax"
        else "tf.function" + ("" if args.no_xla else "(jit_compile=True)")
    )
    info = machine()
    print(
        f"{info['cpu']}, {info['cpus']} CPUs, avx512_bf16 {info['avx512_bf16']}, "
        f"amx_bf16 {info['amx_bf16']}, amx_tile {info['amx_tile']}; backend "
        f"{args.backend}, "
        + ", ".join(f"{k} {v}" for k, v in versions.items())
        + f"; load average {info['load_average']:.1f}",
        flush=True,
    )
    print(
        f"{args.layers} pre-norm decoder blocks, d_model {args.model_dim}, "
        f"{args.heads} query heads of {config['head_dim']}, intermediate "
        f"{args.intermediate}, float32; batch {args.batch}, {args.steps} decoding "
        f"steps per call of {config['compiled_with']}; "
        f"MHA: {args.heads} key/value heads, GQA: {args.kv_heads}; medians of "
        f"{args.rounds} alternating rounds",
        flush=True,
    )
    blocks = {variant: build_blocks(args, variant) for variant in VARIANTS}
    results = []
    for context in sorted(args.contexts):
        began = time.perf_counter()
        row = run_context(args, blocks, context)
        row["attention_path"] = attention_path(
            query_length=1, key_length=context, backend=args.backend
        )
        row["wall_seconds"] = time.perf_counter() - began
        results.append(row)
        print(
            f"context {context}: MHA {row['MHA']['tokens_per_s']:.1f} tokens/s, "
            f"GQA {row['GQA']['tokens_per_s']:.1f} tokens/s "
            f"({row['wall_seconds']:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
    info["load_average_end"] = os.getloadavg()[0]
    report = {
        "machine": info,
        "versions": versions,
        "backend": args.backend,
        "config": config,
        "results": results,
    }
    print()
    print(table(results))
    print(
        f"\nload average {info['load_average']:.1f} at the start, "
        f"{info['load_average_end']:.1f} at the end"
    )
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=1)
    return report


if __name__ == "__main__":
    main()
