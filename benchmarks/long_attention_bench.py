"""Long-sequence self-attention: memory and time of the attention paths.

Forward+backward of one self-attention layer (batch 1, d_model 256, 8 heads,
no mask unless `--causal`) at each length, in float32 and mixed_bfloat16,
through the layers users get:

- `keras`: `keras.layers.MultiHeadAttention`;
- `explicit`: `keras_attn.layers.MultiHeadAttention(flash_attention=False)`,
  which materialises the `(B, N, T, T)` weights;
- `memory_efficient`: `keras_attn.layers.MultiHeadAttention(flash_attention=True)`:
  on TensorFlow (no fused kernel) the memory-efficient path at every length;
- `auto` (not run by default): `flash_attention=None`, the path the layer
  takes by itself (`keras_attn.ops.attention_path`: memory-efficient from
  the switch-over length on).

`--blocks 256xall 512x512` adds variants of the memory-efficient op with
other block sizes (`QxK` query and key block sizes, `all` for all the keys in
one block), called inside `SelfAttention` below (Keras's `EinsumDense`
projections) since the layer takes the default blocks. All paths get the
Keras layer's weights, and the outputs are checked to agree.

Memory: the peak resident memory above the process's baseline (the layer
built, the inputs made), measured for each point in its own process. Before
starting a point, its size is predicted (from the same path at a shorter
length, else from the size of its largest tensors) and the point is skipped,
with a note, when it would not fit the memory available, rather than trigger
the out-of-memory killer. Time: the median of `--rounds` forward+backward
steps inside `tf.function`, the paths that fit timed alternately in one
process per length and policy.

    .venv/bin/python benchmarks/long_attention_bench.py \\
        [--lengths 1024 2048 4096 8192 16384] [--policies float32 mixed_bfloat16] \\
        [--paths keras explicit memory_efficient auto] [--blocks 256xall 512x512] \\
        [--rounds 5] [--causal] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BATCH, MODEL_DIM, HEADS = 1, 256, 8
HEAD_DIM = MODEL_DIM // HEADS
GIB = 2**30
# Bytes of (B, N, T, T) float32 tensors alive at the peak of a forward+backward
# step, per element of one such tensor: a conservative prior, used only when no
# shorter length of the same path has been measured.
QUADRATIC_TENSORS = {"keras": 5.0, "explicit": 4.0}


# -- the paths ------------------------------------------------------------------


def parse_blocks(text: str) -> tuple[int, int | None]:
    """`"256xall"` -> `(256, None)`, `"512x512"` -> `(512, 512)`."""
    query, _, key = text.partition("x")
    try:
        return int(query), None if key == "all" else int(key)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--blocks takes QUERYxKEY (e.g. 256xall, 512x512). Received: {text!r}"
        ) from None


def path_name(blocks) -> str:
    if blocks is None:
        return "memory_efficient"
    query, key = blocks
    return f"memory_efficient[{query}x{'all' if key is None else key}]"


# flash_attention of the keras-attn layer on each of its paths.
LAYER_PATHS = {"explicit": False, "memory_efficient": True, "auto": None}


def build_layer(path: str, policy: str, causal: bool):
    """The layer of one path; `path` is `keras`, a key of `LAYER_PATHS` or a
    `memory_efficient[...]` name from `path_name`."""
    import keras

    from keras_attn.layers import MultiHeadAttention
    from keras_attn.ops import memory_efficient_attention

    if path == "keras":
        return keras.layers.MultiHeadAttention(
            num_heads=HEADS, key_dim=HEAD_DIM, dtype=policy
        )
    if path in LAYER_PATHS:
        return MultiHeadAttention(
            num_heads=HEADS,
            key_dim=HEAD_DIM,
            flash_attention=LAYER_PATHS[path],
            dtype=policy,
        )
    query_block, key_block = parse_blocks(path[len("memory_efficient[") : -1])

    def attend(query, key, value):
        return memory_efficient_attention(
            query,
            key,
            value,
            causal=causal,
            query_block_size=query_block,
            key_block_size=key_block,
        )

    return SelfAttention(attend, dtype=policy, name="self_attention")


def SelfAttention(attend, **kwargs):
    """Keras' `EinsumDense` head projections around an attention function
    `attend(query, key, value) -> outputs`, all `(B, T, N, H)`."""
    import keras

    class _SelfAttention(keras.layers.Layer):
        def build(self, inputs_shape):
            model_dim = inputs_shape[-1]
            policy = self.dtype_policy
            self.query_dense, self.key_dense, self.value_dense = (
                keras.layers.EinsumDense(
                    "abc,cde->abde",
                    output_shape=(None, HEADS, HEAD_DIM),
                    bias_axes="de",
                    dtype=policy,
                    name=name,
                )
                for name in ("query", "key", "value")
            )
            for dense in (self.query_dense, self.key_dense, self.value_dense):
                dense.build(inputs_shape)
            self.output_dense = keras.layers.EinsumDense(
                "abcd,cde->abe",
                output_shape=(None, model_dim),
                bias_axes="e",
                dtype=policy,
                name="attention_output",
            )
            self.output_dense.build((None, None, HEADS, HEAD_DIM))

        def call(self, inputs):
            heads = attend(
                self.query_dense(inputs),
                self.key_dense(inputs),
                self.value_dense(inputs),
            )  # (B, T, N, H)
            return self.output_dense(heads)  # (B, T, d)

    return _SelfAttention(**kwargs)


def make_step(layer, inputs, causal: bool):
    """A compiled forward+backward step (gradients of the layer's weights)."""
    import keras
    import tensorflow as tf

    def forward():
        if isinstance(layer, keras.layers.MultiHeadAttention):
            return layer(inputs, inputs, use_causal_mask=causal)
        return layer(inputs)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.cast(forward(), "float32"))
        return tape.gradient(loss, layer.trainable_variables)

    def run():
        for gradient in step():
            gradient.numpy()

    return tf.function(forward), run


def make_inputs(length: int):
    import numpy as np
    import tensorflow as tf

    data = np.random.default_rng(0).normal(size=(BATCH, length, MODEL_DIM))
    return tf.constant(data, "float32")


# -- memory: one process per point ------------------------------------------------


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure_point(path: str, length: int, policy: str, causal: bool) -> dict:
    """Peak resident memory above the baseline of two forward+backward steps
    (the first one traces)."""
    inputs = make_inputs(length)
    layer = build_layer(path, policy, causal)
    _, step = make_step(layer, inputs[:, :8], causal)
    step()  # builds the layer on a short input
    _, step = make_step(layer, inputs, causal)
    # Reset the peak (VmHWM) to the current resident size (Linux >= 4.0).
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    baseline = _status_bytes("VmRSS")
    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    step()
    return {
        "peak_bytes": _status_bytes("VmHWM") - baseline,
        "first_step_seconds": first,
    }


def available_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def predicted_bytes(path: str, length: int, policy: str, measured: dict) -> int:
    """A point's predicted peak: the same path's measurement at the longest
    shorter length, scaled by (T/T0)² for the explicit paths and T/T0 for
    the memory-efficient ones; without one, the size of its largest tensors."""
    quadratic = path in QUADRATIC_TENSORS
    if path == "auto":  # the explicit path below the switch-over length
        from keras_attn.ops import switch_over_length

        compute_dtype = "float32" if policy == "float32" else policy.split("_")[-1]
        quadratic = length < switch_over_length(compute_dtype)
    shorter = [
        (t, peak)
        for (p, t, pol), peak in measured.items()
        if p == path and pol == policy and t < length and peak is not None
    ]
    if shorter:
        t0, peak = max(shorter)
        ratio = length / t0
        return int(max(peak, 64 * 2**20) * (ratio**2 if quadratic else ratio))
    if quadratic:
        tensors = QUADRATIC_TENSORS.get(path, QUADRATIC_TENSORS["explicit"])
        return int(tensors * BATCH * HEADS * length**2 * 4)
    return int(64 * BATCH * length * MODEL_DIM * 4 + 256 * 2**20)


def run_point(path, length, policy, causal, timeout) -> dict:
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--point",
        path,
        str(length),
        policy,
    ] + (["--causal"] if causal else [])
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    if result.returncode != 0:
        tail = result.stderr.strip().splitlines()[-1:] or [""]
        return {"error": f"exit status {result.returncode}: {tail[0][:200]}"}
    return json.loads(result.stdout.strip().splitlines()[-1])


# -- time: the paths that fit, alternately in one process ---------------------------


def time_paths(paths, length, policy, causal, rounds) -> dict:
    """Median seconds per step of each path, and each path's largest output
    difference from the first path's (same weights)."""
    import numpy as np
    from _timing import alternate

    inputs = make_inputs(length)
    layers = {path: build_layer(path, policy, causal) for path in paths}
    reference_weights = None
    forwards, steps, outputs = {}, {}, {}
    for path, layer in layers.items():
        make_step(layer, inputs[:, :8], causal)[1]()  # build
        if reference_weights is None:
            reference_weights = layer.get_weights()
        else:
            layer.set_weights(reference_weights)
        forwards[path], steps[path] = make_step(layer, inputs, causal)
        outputs[path] = np.asarray(forwards[path](), "float32")
    first = outputs[paths[0]]
    differences = {
        path: float(np.max(np.abs(output - first))) for path, output in outputs.items()
    }
    medians = alternate(steps, rounds=rounds, warmup=1, inner=1)
    return {"seconds": medians, "max_difference": differences}


# -- report ---------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384]
    )
    parser.add_argument("--policies", nargs="+", default=["float32", "mixed_bfloat16"])
    parser.add_argument(
        "--paths",
        nargs="+",
        default=["keras", "explicit", "memory_efficient"],
        choices=["keras", *LAYER_PATHS],
    )
    parser.add_argument(
        "--blocks",
        type=parse_blocks,
        nargs="*",
        default=[],
        help="extra memory-efficient variants, QUERYxKEY block sizes (KEY may be all)",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--causal", action="store_true", help="causal self-attention")
    parser.add_argument(
        "--memory-fraction",
        type=float,
        default=0.8,
        help="run a point only if its predicted peak is below this fraction "
        "of the memory available when it starts",
    )
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per process")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument(
        "--point", nargs=3, metavar=("PATH", "LENGTH", "POLICY"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()

    if args.point:
        path, length, policy = args.point
        print(json.dumps(measure_point(path, int(length), policy, args.causal)))
        return

    paths = list(args.paths) + [path_name(blocks) for blocks in args.blocks]
    print(
        f"batch {BATCH}, d_model {MODEL_DIM}, {HEADS} heads, "
        f"{'causal' if args.causal else 'no mask'}, forward+backward in "
        f"tf.function; time: median of {args.rounds} rounds"
    )
    measured, results, notes = {}, [], []
    for length in sorted(args.lengths):
        for policy in args.policies:
            fitting = []
            for path in paths:
                predicted = predicted_bytes(path, length, policy, measured)
                budget = args.memory_fraction * available_bytes()
                row = {
                    "length": length,
                    "policy": policy,
                    "path": path,
                    "predicted_bytes": predicted,
                }
                if predicted > budget:
                    measured[(path, length, policy)] = None
                    note = (
                        f"skipped {path} at {length} ({policy}): predicted "
                        f"{predicted / GIB:.1f} GiB > {budget / GIB:.1f} GiB"
                    )
                    notes.append(note)
                    row["skipped"] = note
                    print(note, flush=True)
                else:
                    row.update(
                        run_point(path, length, policy, args.causal, args.timeout)
                    )
                    measured[(path, length, policy)] = row.get("peak_bytes")
                    if "peak_bytes" in row:
                        fitting.append(path)
                    else:
                        print(
                            f"{path} at {length} ({policy}): {row['error']}", flush=True
                        )
                results.append(row)
            if fitting:
                timing = time_paths(fitting, length, policy, args.causal, args.rounds)
                for row in results:
                    if (row["length"], row["policy"]) == (length, policy) and (
                        row["path"] in timing["seconds"]
                    ):
                        row["seconds"] = timing["seconds"][row["path"]]
                        row["max_difference"] = timing["max_difference"][row["path"]]
            print_rows(
                [r for r in results if (r["length"], r["policy"]) == (length, policy)]
            )
    print("\n## All points\n")
    print_rows(results, header=True)
    for note in notes:
        print(f"- {note}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=1)


def print_rows(rows, header=False):
    by_key = {(r["length"], r["policy"], r["path"]): r for r in rows}
    if header:
        print(
            "| length | policy | path | peak MiB | ms | time / explicit "
            "| time / keras | memory / keras | max diff |"
        )
        print("|---:|---|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        if "seconds" not in row:
            reason = row.get("skipped") or row.get("error", "")
            print(
                f"| {row['length']} | {row['policy']} | {row['path']} | — | — "
                f"| | | | {reason} |"
            )
            continue
        explicit = by_key.get((row["length"], row["policy"], "explicit"), {})
        keras_row = by_key.get((row["length"], row["policy"], "keras"), {})

        def ratio(other, field, row=row):
            return f"{row[field] / other[field]:.2f}" if field in other else "—"

        print(
            f"| {row['length']} | {row['policy']} | {row['path']} "
            f"| {row['peak_bytes'] / 2**20:.0f} | {row['seconds'] * 1e3:.0f} "
            f"| {ratio(explicit, 'seconds')} | {ratio(keras_row, 'seconds')} "
            f"| {ratio(keras_row, 'peak_bytes')} | {row['max_difference']:.1e} |"
        )


if __name__ == "__main__":
    main()
