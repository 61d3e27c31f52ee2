"""The GPU path, checked in one run: numerics, speed and a mixed_float16 translator.

Run with the JAX backend on a GPU machine (docs/GPU_CHECK.md), after
`make gpu-check-bundle` prepared `.gpu_bundle/` on a machine with the project:

    KERAS_BACKEND=jax python3 benchmarks/gpu_check.py --data .gpu_bundle/data \\
        --out gpu_check.json [--train-seconds 120]

It prints the versions it runs with and writes every figure to `--out`:

(a) numerics: `keras_attn.layers.MultiHeadAttention` under mixed_float16 and
    mixed_bfloat16 against float32 (same weights, float32 reference at the
    highest matmul precision), the default (fused where the backend has it)
    path against the explicit path, with padding, causal and explicit masks,
    fully masked rows (must be zero) and large logits (must stay finite); the
    custom calls of each compiled program, to tell whether cuDNN's fused
    attention actually ran.
(b) speed: one `TransformerEncoderBlock` forward+backward against
    `keras_hub.layers.TransformerEncoder` with the same weights, both jitted,
    timed alternately in this process, in bfloat16 and float16, as a ratio
    and as a fraction of the matmul peak measured in the same rounds.
(c) training: the Transformer translator trained for `--train-seconds` in
    mixed_float16 on the pre-tokenized Ding pairs, the loss checked finite at
    every step, the test split decoded with the batched beam search on the
    GPU, detokenized with `sentencepiece` and scored with sacrebleu.

`--tiny` shrinks every size so that the whole script runs in a minute on a
CPU (the test suite does that, so that the script cannot rot).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
# Worst absolute error allowed against the float32 reference, relative to the
# reference's largest magnitude (half-precision inputs and outputs).
TOLERANCE = {"float32": 1e-4, "mixed_float16": 5e-3, "mixed_bfloat16": 3e-2}


# -- versions -----------------------------------------------------------------


def versions() -> dict:
    import jax

    import keras_attn

    info = {
        "python": platform.python_version(),
        "keras": keras.__version__,
        "keras_backend": keras.backend.backend(),
        "keras_attn": keras_attn.__version__,
        "jax": jax.__version__,
        "devices": [str(device) for device in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,
        "platform": jax.devices()[0].platform,
    }
    try:
        import jaxlib

        info["jaxlib"] = jaxlib.__version__
    except ImportError:
        pass
    try:
        import keras_hub

        info["keras_hub"] = keras_hub.__version__
    except ImportError as error:
        info["keras_hub"] = f"not importable: {error}"
    return info


# -- helpers --------------------------------------------------------------------


def custom_calls(jitted, *args) -> list[str]:
    """The custom-call targets of a jitted function's compiled program."""
    text = jitted.lower(*args).compile().as_text()
    return sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))


def uses_cudnn_attention(targets) -> bool:
    return any("cudnn" in target and "fmha" in target for target in targets)


def block(tree):
    import jax

    return jax.block_until_ready(tree)


def alternate(fns: dict, rounds: int, warmup: int = 2, inner: int = 5) -> dict:
    """Median seconds per call of each function, timed alternately."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            times[name].append((time.perf_counter() - start) / inner)
    return {name: statistics.median(values) for name, values in times.items()}


def matmul_peak_fn(dtype: str, size: int):
    """A jitted square matmul in `dtype`; its FLOP/s is the practical peak."""
    import jax
    import jax.numpy as jnp

    a = jnp.asarray(np.random.default_rng(0).normal(size=(size, size)), dtype=dtype)
    b = jnp.asarray(np.random.default_rng(1).normal(size=(size, size)), dtype=dtype)
    product = jax.jit(jnp.matmul)

    def run():
        block(product(a, b))

    return run


# -- (a) numerics -----------------------------------------------------------------


def attention_cases(rng, sizes):
    """Inputs and call arguments of each numerics case."""
    batch, query_length, key_length, model_dim = (
        sizes["batch"],
        sizes["query_length"],
        sizes["key_length"],
        sizes["model_dim"],
    )
    query = rng.normal(size=(batch, query_length, model_dim)).astype("float32")
    value = rng.normal(size=(batch, key_length, model_dim)).astype("float32")
    # Batch row b keeps lengths[b] keys; the last row keeps none (all masked).
    lengths = np.linspace(key_length, 0, batch).round().astype("int32")
    value_mask = np.arange(key_length)[None, :] < lengths[:, None]
    attention_mask = rng.random((batch, query_length, key_length)) > 0.3
    attention_mask[:, ::7, :] = False  # every 7th query attends to nothing
    return {
        "unmasked": (query, value, {}),
        "padding": (query, value, {"value_mask": value_mask}),
        "causal": (query, query, {"use_causal_mask": True}),
        "explicit_mask": (query, value, {"attention_mask": attention_mask}),
        "large_logits": (30.0 * query, 30.0 * value, {"value_mask": value_mask}),
    }


def empty_rows(call_kwargs, batch, query_length, key_length):
    """`(batch, Tq)` bool: the query rows with no key to attend to."""
    keep = np.ones((batch, query_length, key_length), dtype=bool)
    if "value_mask" in call_kwargs:
        keep &= call_kwargs["value_mask"][:, None, :]
    if "attention_mask" in call_kwargs:
        keep &= call_kwargs["attention_mask"]
    return ~keep.any(axis=-1)


def attention_layer(policy, sizes, flash_attention):
    from keras_attn.layers import MultiHeadAttention

    return MultiHeadAttention(
        num_heads=sizes["heads"],
        key_dim=sizes["head_dim"],
        flash_attention=flash_attention,
        dtype=policy,
    )


def check_numerics(sizes) -> list[dict]:
    import jax

    rng = np.random.default_rng(0)
    cases = attention_cases(rng, sizes)
    rows = []
    for case, (query, value, call_kwargs) in cases.items():
        reference_layer = attention_layer("float32", sizes, flash_attention=False)
        with jax.default_matmul_precision("highest"):
            reference = np.asarray(
                reference_layer(query, value, **call_kwargs), dtype="float64"
            )
        weights = reference_layer.get_weights()
        empty = empty_rows(call_kwargs, query.shape[0], query.shape[1], value.shape[1])
        scale = float(np.abs(reference).max()) or 1.0
        for policy in POLICIES:
            for path, flash in (("default", None), ("explicit", False)):
                layer = attention_layer(policy, sizes, flash)
                layer(query[:1, :1], value[:1, :2])
                layer.set_weights(weights)

                def forward(trainable, q, v, layer=layer):
                    outputs, _ = layer.stateless_call(
                        trainable,
                        [],
                        q,
                        v,
                        **{k: np.asarray(a) for k, a in call_kwargs.items()},
                    )
                    return outputs

                jitted = jax.jit(forward)
                trainable = [w.value for w in layer.trainable_weights]
                outputs = np.asarray(
                    block(jitted(trainable, query, value)), dtype="float64"
                )
                error = float(np.abs(outputs - reference).max()) / scale
                rows.append(
                    {
                        "case": case,
                        "policy": policy,
                        "path": path,
                        "finite": bool(np.isfinite(outputs).all()),
                        "empty_rows": int(empty.sum()),
                        "empty_rows_zero": bool(
                            (outputs[empty] == 0).all() if empty.any() else True
                        ),
                        "max_error_vs_float32": error,
                        "tolerance": TOLERANCE[policy],
                        "within_tolerance": error <= TOLERANCE[policy],
                        "cudnn_fused_attention": uses_cudnn_attention(
                            custom_calls(jitted, trainable, query, value)
                        ),
                    }
                )
            rows.append(forced_fused(policy, sizes, query, value, call_kwargs))
    return rows


def forced_fused(policy, sizes, query, value, call_kwargs) -> dict:
    """What `flash_attention=True` does for this case: run, or a clear error."""
    row = {"case": "flash_attention=True", "policy": policy, "of": None}
    layer = attention_layer(policy, sizes, True)
    try:
        outputs = np.asarray(layer(query, value, **call_kwargs), dtype="float64")
        row.update(ran=True, finite=bool(np.isfinite(outputs).all()))
    except ValueError as error:
        row.update(ran=False, error=str(error).splitlines()[0][:300])
    return row


# -- (b) speed ----------------------------------------------------------------------


def encoder_flops(sizes) -> float:
    """Forward matmul FLOPs of one encoder block."""
    tokens = sizes["speed_batch"] * sizes["speed_length"]
    model_dim, intermediate = sizes["speed_model_dim"], sizes["speed_intermediate"]
    projections = 4 * 2 * tokens * model_dim * model_dim
    attention = 2 * 2 * tokens * sizes["speed_length"] * model_dim
    feed_forward = 2 * 2 * tokens * model_dim * intermediate
    return projections + attention + feed_forward


def train_step_fn(layer, inputs):
    """A jitted forward+backward: gradients of every weight and of the inputs."""
    import jax
    import jax.numpy as jnp

    trainable = [w.value for w in layer.trainable_weights]
    non_trainable = [w.value for w in layer.non_trainable_weights]

    def loss(trainable, inputs):
        outputs, _ = layer.stateless_call(trainable, non_trainable, inputs)
        return jnp.sum(jnp.square(outputs.astype("float32")))

    gradients = jax.jit(jax.grad(loss, argnums=(0, 1)))

    def run():
        block(gradients(trainable, inputs))

    return run, gradients, trainable


def check_speed(sizes, rounds: int) -> list[dict]:
    import jax.numpy as jnp
    import keras_hub

    from keras_attn.layers import TransformerEncoderBlock

    rows = []
    for policy, dtype in (("mixed_bfloat16", "bfloat16"), ("mixed_float16", "float16")):
        common = {
            "intermediate_dim": sizes["speed_intermediate"],
            "num_heads": sizes["speed_heads"],
            "dropout": 0.0,
            "dtype": policy,
        }
        ours = TransformerEncoderBlock(**common)
        theirs = keras_hub.layers.TransformerEncoder(**common)
        shape = (sizes["speed_batch"], sizes["speed_length"], sizes["speed_model_dim"])
        inputs = jnp.asarray(
            np.random.default_rng(0).normal(size=shape), dtype=dtype
        )
        ours(inputs)
        theirs(inputs)
        theirs.set_weights(ours.get_weights())
        ours_run, ours_jitted, ours_vars = train_step_fn(ours, inputs)
        theirs_run, theirs_jitted, theirs_vars = train_step_fn(theirs, inputs)
        medians = alternate(
            {
                "keras_attn": ours_run,
                "keras_hub": theirs_run,
                "matmul": matmul_peak_fn(dtype, sizes["peak_size"]),
            },
            rounds=rounds,
        )
        peak = 2 * sizes["peak_size"] ** 3 / medians["matmul"]
        work = 3 * encoder_flops(sizes)  # forward + backward
        rows.append(
            {
                "policy": policy,
                "keras_attn_ms": 1e3 * medians["keras_attn"],
                "keras_hub_ms": 1e3 * medians["keras_hub"],
                "ratio_hub_over_attn": medians["keras_hub"] / medians["keras_attn"],
                "matmul_peak_tflops": peak / 1e12,
                "keras_attn_fraction_of_peak": work / medians["keras_attn"] / peak,
                "keras_hub_fraction_of_peak": work / medians["keras_hub"] / peak,
                "keras_attn_cudnn_fused_attention": uses_cudnn_attention(
                    custom_calls(ours_jitted, ours_vars, inputs)
                ),
                "keras_hub_cudnn_fused_attention": uses_cudnn_attention(
                    custom_calls(theirs_jitted, theirs_vars, inputs)
                ),
            }
        )
    return rows


# -- (c) training -------------------------------------------------------------------


def check_training(data_dir: Path, sizes, seconds: float) -> dict:
    """Train, decode and score the translator; see the module docstring."""
    from _gpu_translation import train_and_evaluate

    return train_and_evaluate(data_dir, sizes, seconds)


# -- main -----------------------------------------------------------------------------

SIZES = {
    "full": {
        "batch": 4,
        "query_length": 512,
        "key_length": 640,
        "model_dim": 512,
        "heads": 8,
        "head_dim": 64,
        "speed_batch": 32,
        "speed_length": 512,
        "speed_model_dim": 768,
        "speed_heads": 12,
        "speed_intermediate": 3072,
        "peak_size": 8192,
        "translator": "base",
        "train_batch": 256,
        "decode_batch": 512,
    },
    "tiny": {
        "batch": 3,
        "query_length": 16,
        "key_length": 24,
        "model_dim": 32,
        "heads": 2,
        "head_dim": 16,
        "speed_batch": 2,
        "speed_length": 16,
        "speed_model_dim": 32,
        "speed_heads": 2,
        "speed_intermediate": 64,
        "peak_size": 256,
        "translator": "tiny",
        "train_batch": 32,
        "decode_batch": 64,
    },
}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=".gpu_bundle/data", help="bundle data folder")
    parser.add_argument("--out", default="gpu_check.json", help="JSON file to write")
    parser.add_argument("--train-seconds", type=float, default=120.0)
    parser.add_argument("--rounds", type=int, default=10, help="speed rounds")
    parser.add_argument(
        "--parts", default="numerics,speed,training", help="comma-separated"
    )
    parser.add_argument("--tiny", action="store_true", help="CPU-sized run")
    args = parser.parse_args(argv)
    if keras.backend.backend() != "jax":
        raise SystemExit(
            "Run with KERAS_BACKEND=jax. Received: "
            f"backend={keras.backend.backend()!r}"
        )
    sizes = SIZES["tiny" if args.tiny else "full"]
    parts = args.parts.split(",")
    report = {"versions": versions(), "tiny": args.tiny}
    print(json.dumps(report["versions"], indent=2), flush=True)
    started = time.perf_counter()

    def save():
        report["seconds"] = time.perf_counter() - started
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")

    if "numerics" in parts:
        report["numerics"] = check_numerics(sizes)
        save()
        print_numerics(report["numerics"])
    if "speed" in parts:
        report["speed"] = check_speed(sizes, args.rounds)
        save()
        print(json.dumps(report["speed"], indent=2), flush=True)
    if "training" in parts:
        report["training"] = check_training(Path(args.data), sizes, args.train_seconds)
        save()
        print(json.dumps(report["training"], indent=2), flush=True)
    report["problems"] = problems(report)
    save()
    print("problems:", json.dumps(report["problems"], indent=2))
    return report


def print_numerics(rows):
    for row in rows:
        print(json.dumps(row), flush=True)


def problems(report) -> list[str]:
    """Every finding that needs a fix: NaN/inf, a nonzero empty row, an error
    beyond tolerance, a non-finite training loss."""
    found = []
    for row in report.get("numerics", []):
        if row.get("of", "") is None:
            continue
        label = f"{row['case']} {row['policy']} {row['path']}"
        if not row["finite"]:
            found.append(f"non-finite outputs: {label}")
        if not row["empty_rows_zero"]:
            found.append(f"fully masked rows not zero: {label}")
        if not row["within_tolerance"]:
            found.append(
                f"error {row['max_error_vs_float32']:.2e} > {row['tolerance']}: {label}"
            )
    training = report.get("training")
    if training and not training.get("loss_finite", True):
        found.append("training loss not finite")
    if training and not math.isfinite(training.get("final_loss", 0.0)):
        found.append("final training loss not finite")
    return found


if __name__ == "__main__":
    main()
