"""The GPU path, checked in one run: numerics, speed and a mixed_float16 translator.

Run with the JAX backend on a GPU machine (docs/GPU_CHECK.md), after
`make gpu-check-bundle` prepared `.gpu_bundle/` on a machine with the project:

    KERAS_BACKEND=jax python3 benchmarks/gpu_check.py --data .gpu_bundle/data \\
        --out gpu_check.json [--train-seconds 120]

It prints the versions it runs with and writes every figure to `--out`:

(a) numerics: `keras_attn.layers.MultiHeadAttention` under mixed_float16 and
    mixed_bfloat16 against float32 (same weights, float32 reference and
    float32 rows at the highest matmul precision, not the GPU's default
    TF32), with `flash_attention` None (the automatic path), True (fused,
    else memory-efficient) and False (explicit), with padding, causal and
    explicit masks, fully masked rows (must be zero) and large logits (must
    stay finite), the gradients of the automatic path
    against the explicit path's; which path each call took: cuDNN's fused
    attention (read from the compiled program's custom calls), the
    memory-efficient op, or the explicit path. Then, per dtype and mask, what
    `keras_attn.ops.fused_kernel_runs` finds and the path `attention_path`
    takes, and the time and XLA temporary memory of causal self-attention's
    forward+backward on each path at long lengths.
(l) long, run first: self-attention's forward+backward at 4k to 64k tokens,
    with and without right padding, in bfloat16 and float32: the time and
    XLA temporary memory of `keras_attn.ops.dot_product_attention`'s
    automatic path (on a GPU in bfloat16, padding reaches cuDNN as sequence
    lengths), its explicit path and `keras.ops.dot_product_attention`; a
    `(T, T)`-sized temporary on the padded bfloat16 automatic path from 16k
    tokens is a problem.
(b) speed: one `TransformerEncoderBlock` forward+backward against
    `keras_hub.layers.TransformerEncoder` with the same weights, both jitted,
    timed alternately in this process, in bfloat16 and float16, as a ratio
    and as a fraction of the matmul peak measured in the same rounds.
(c) training: the Transformer translator trained for `--train-seconds` in
    mixed_float16 on the pre-tokenized Ding pairs, the loss checked finite at
    every step, the test split decoded with the batched beam search on the
    GPU, detokenized with `sentencepiece` and scored with sacrebleu.

(d) PyTorch (a subprocess with `KERAS_BACKEND=torch`): `fused_kernel_runs` on
    CUDA tensors, the layers' paths against the explicit path, the
    memory-efficient op's gradients against the explicit path's.

Parts run in that order; a part that fails is recorded with its error and the
next one runs; parts that would start after `--deadline-seconds` are skipped
with a note; part (d) is skipped with a note where PyTorch is not installed.
The JSON file is rewritten after every part. Its `problems` list names every
finding that needs a fix (an error, a NaN or inf, a fully masked row that is
not zero, a difference beyond tolerance, a non-finite training loss); the
exit status is 1 when it is not empty.

`--tiny` shrinks every size (and trains for 5 seconds) so that the whole
script runs in a couple of minutes on a CPU: tests/benchmarks/test_gpu_check.py
does that with TensorFlow made unimportable, so that the script cannot rot.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras
import numpy as np

from benchmarks._timing import alternate

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
# The worst absolute error allowed against the float32 reference, as a share
# of the reference's largest magnitude.
TOLERANCE = {"float32": 1e-4, "mixed_float16": 5e-3, "mixed_bfloat16": 3e-2}
# Paths a layer is asked for: `flash_attention` None, True, False.
FLASH = {"auto": None, "fused_or_memory_efficient": True, "explicit": False}


# -- shared helpers -------------------------------------------------------------


def versions() -> dict:
    import keras_attn

    info = {
        "python": platform.python_version(),
        "keras": keras.__version__,
        "keras_backend": keras.backend.backend(),
        "keras_attn": keras_attn.__version__,
    }
    if keras.backend.backend() == "jax":
        import jax
        import jaxlib

        info.update(
            jax=jax.__version__,
            jaxlib=jaxlib.__version__,
            devices=[str(device) for device in jax.devices()],
            device_kind=jax.devices()[0].device_kind,
            platform=jax.devices()[0].platform,
        )
    if keras.backend.backend() == "torch":
        import torch

        info.update(torch=torch.__version__, cuda=torch.cuda.is_available())
    try:
        import keras_hub

        info["keras_hub"] = keras_hub.__version__
    except ImportError as error:
        info["keras_hub"] = f"not importable: {error}"
    return info


def block(tree):
    import jax

    return jax.block_until_ready(tree)


def custom_calls(compiled_text: str) -> list[str]:
    return sorted(set(re.findall(r'custom_call_target="([^"]+)"', compiled_text)))


def cudnn_attention(targets) -> bool:
    """Whether custom-call targets include cuDNN's fused attention."""
    return any("cudnn" in target and "fmha" in target for target in targets)


class PathRecorder:
    """Counts the calls of the memory-efficient op while a function is traced."""

    def __init__(self):
        import keras_attn.ops.attention as attention_module

        self.module = attention_module
        self.original = attention_module.memory_efficient_attention
        self.calls = 0

    def __enter__(self):
        def counting(*args, **kwargs):
            self.calls += 1
            return self.original(*args, **kwargs)

        self.module.memory_efficient_attention = counting
        return self

    def __exit__(self, *exc):
        self.module.memory_efficient_attention = self.original


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
    return ~keep_mask(call_kwargs, batch, query_length, key_length).any(axis=-1)


def attention_layer(policy, sizes, flash_attention):
    from keras_attn.layers import MultiHeadAttention

    return MultiHeadAttention(
        num_heads=sizes["heads"],
        key_dim=sizes["head_dim"],
        flash_attention=flash_attention,
        dtype=policy,
    )


def jitted_forward(layer, call_kwargs):
    """`(jitted fn(trainable, query, value), trainable)` of a built layer."""
    import jax

    kwargs = {name: np.asarray(value) for name, value in call_kwargs.items()}

    def forward(trainable, query, value):
        outputs, _ = layer.stateless_call(trainable, [], query, value, **kwargs)
        return outputs

    return jax.jit(forward), [v.value for v in layer.trainable_variables]


def jitted_gradients(layer, call_kwargs):
    import jax
    import jax.numpy as jnp

    forward, trainable = jitted_forward(layer, call_kwargs)

    def loss(trainable, query, value):
        return jnp.sum(jnp.square(forward(trainable, query, value).astype("float32")))

    return jax.jit(jax.grad(loss)), trainable


# Cases not compared with the float32 layer: with logits 900 times the
# unit-variance ones the softmax is nearly one-hot, and a logit moved by the
# rounding of its inputs moves the output a long way. Rounding the projected
# queries and keys to 8 (bfloat16) or 11 (float16) significant bits moves
# each logit by several units; even in float32 two programs that sum in
# another order differ by about 1e-4 of the output's scale (a GPU run with
# near-tied keys). Their reference is exact attention (float64) of the
# policy's own rounded projections, which every path shares. A path may be as
# far from it as the explicit path is (Keras's numerics: on a GPU the logits
# are rounded to the compute dtype, 8 bits in bfloat16) or within the
# policy's tolerance, not further.
SAME_INPUTS_CASES = ("large_logits",)
NUMERICS_CASES = ("unmasked", "padding", "causal", "explicit_mask", "large_logits")


def keep_mask(call_kwargs, batch, query_length, key_length):
    """`(batch, Tq, Tk)` bool: which keys each query attends to."""
    keep = np.ones((batch, query_length, key_length), dtype=bool)
    if "value_mask" in call_kwargs:
        keep &= np.asarray(call_kwargs["value_mask"], bool)[:, None, :]
    if "attention_mask" in call_kwargs:
        keep &= np.asarray(call_kwargs["attention_mask"], bool)
    if call_kwargs.get("use_causal_mask"):
        keep &= np.tril(np.ones((query_length, key_length), dtype=bool))[None]
    return keep


def same_inputs_reference(layer, query, value, call_kwargs):
    """float64 attention of `layer`'s own projections, rounded as its policy
    rounds them: what every path would give with exact arithmetic after the
    projections. The query scale is applied in float64 (exact for the check's
    head size of 64: a power of two)."""

    def projected(dense, inputs):
        return np.asarray(keras.ops.convert_to_numpy(dense(inputs)), dtype="float64")

    query_heads = projected(layer.query_dense, query) / np.sqrt(layer.key_dim)
    key_heads = projected(layer.key_dense, value)
    value_heads = projected(layer.value_dense, value)
    keep = keep_mask(call_kwargs, query.shape[0], query.shape[1], value.shape[1])
    logits = np.einsum("bqnh,bknh->bnqk", query_heads, key_heads)
    logits = np.where(keep[:, None], logits, -np.inf)
    top = logits.max(axis=-1, keepdims=True)
    weights = np.exp(logits - np.where(np.isfinite(top), top, 0.0))
    total = weights.sum(axis=-1, keepdims=True)
    weights = np.divide(weights, total, out=np.zeros_like(weights), where=total > 0)
    attended = np.einsum("bnqk,bknh->bqnh", weights, value_heads)
    kernel = np.asarray(layer.output_dense.kernel.numpy(), dtype="float64")
    outputs = np.einsum("bqnh,nhd->bqd", attended, kernel)
    if layer.output_dense.bias is not None:
        outputs = outputs + np.asarray(layer.output_dense.bias.numpy(), "float64")
    return outputs


def compare_with_same_inputs(rows, case, policy, path_outputs, reference, scale):
    """Check `case`'s rows under `policy` against `same_inputs_reference`."""
    errors = {
        path: float(np.abs(outputs - reference).max()) / scale
        for path, outputs in path_outputs.items()
    }
    explicit_error = errors.get("explicit")
    for row in rows:
        if row.get("case") != case or row.get("policy") != policy:
            continue
        if "max_error_vs_float32" not in row:
            continue
        row["error_vs_float32_not_checked"] = row.pop("max_error_vs_float32")
        if row["asked"] == "explicit":
            # The bound of the others: recorded, not checked against itself.
            row["error_vs_same_inputs_not_checked"] = explicit_error
            continue
        if explicit_error is None:
            row["error"] = "no explicit-path output to compare with"
            continue
        row["max_error_vs_same_inputs"] = errors[row["asked"]]
        row["explicit_error_vs_same_inputs"] = explicit_error
        row["tolerance"] = max(row["tolerance"], explicit_error)


def matmul_precision(policy):
    """The float32 rows run at the highest matmul precision, as the reference.

    JAX's default precision for float32 matrix products on NVIDIA GPUs is
    TF32 (10 mantissa bits), which moves every float32 output by about 1e-3
    of its scale whatever the attention path (Keras's layer too); the check
    compares the paths, so it pins the precision of the float32 rows.
    """
    import contextlib

    import jax

    if policy == "float32":
        return jax.default_matmul_precision("highest")
    return contextlib.nullcontext()


def compare_gradients(case, policy, gradients) -> dict:
    """The automatic path's gradients against the explicit path's.

    Each variable's largest difference is taken as a share of the largest
    gradient of any variable: a per-variable share divides by the key bias's
    gradient, which is zero in exact arithmetic (adding a constant to every
    logit of a row leaves the softmax unchanged), so rounding noise over
    rounding noise.
    """
    auto, explicit = gradients["auto"], gradients["explicit"]
    scale = max(float(np.abs(g).max()) for g in explicit.values()) or 1.0
    per_variable = {
        path: float(np.abs(auto[path] - explicit[path]).max()) / scale
        for path in explicit
    }
    worst = max(per_variable, key=per_variable.get)
    return {
        "case": case,
        "policy": policy,
        "gradients": "auto vs explicit",
        "finite": all(np.isfinite(g).all() for g in auto.values()),
        "max_relative_difference": per_variable[worst],
        "worst_variable": worst,
        "per_variable": per_variable,
        "tolerance": 10 * TOLERANCE[policy],
    }


def check_numerics(sizes, cases=None) -> list[dict]:
    import jax

    rng = np.random.default_rng(0)
    rows = []
    for case, (query, value, call_kwargs) in attention_cases(rng, sizes).items():
        if cases is not None and case not in cases:
            continue
        reference_layer = attention_layer("float32", sizes, flash_attention=False)
        with jax.default_matmul_precision("highest"):
            reference = np.asarray(
                reference_layer(query, value, **call_kwargs), dtype="float64"
            )
        weights = reference_layer.get_weights()
        empty = empty_rows(call_kwargs, query.shape[0], query.shape[1], value.shape[1])
        scale = float(np.abs(reference).max()) or 1.0
        for policy in POLICIES:
            gradients = {}
            path_outputs = {}
            for path, flash in FLASH.items():
                row = {"case": case, "policy": policy, "asked": path}
                rows.append(row)
                try:
                    layer = attention_layer(policy, sizes, flash)
                    layer(query[:1, :1], value[:1, :2])
                    layer.set_weights(weights)
                    with PathRecorder() as recorder, matmul_precision(policy):
                        forward, trainable = jitted_forward(layer, call_kwargs)
                        program = forward.lower(trainable, query, value).compile()
                        outputs = np.asarray(
                            block(forward(trainable, query, value)), dtype="float64"
                        )
                except Exception as error:  # recorded, and the next case runs
                    row["error"] = f"{type(error).__name__}: {error}"[:400]
                    continue
                targets = custom_calls(program.as_text())
                path_outputs[path] = outputs
                error = float(np.abs(outputs - reference).max()) / scale
                row.update(
                    took=(
                        "cudnn_fused"
                        if cudnn_attention(targets)
                        else "memory_efficient"
                        if recorder.calls
                        else "explicit_or_xla"
                    ),
                    custom_calls=targets,
                    finite=bool(np.isfinite(outputs).all()),
                    empty_rows=int(empty.sum()),
                    empty_rows_zero=bool((outputs[empty] == 0).all()),
                    max_error_vs_float32=error,
                    tolerance=TOLERANCE[policy],
                )
                if policy == "float32":
                    row["matmul_precision"] = "highest"
                if case in ("padding", "causal") and path in ("auto", "explicit"):
                    grad_fn, trainable = jitted_gradients(layer, call_kwargs)
                    with matmul_precision(policy):
                        gradients[path] = {
                            # the path inside the layer, e.g. "query/kernel"
                            variable.path.split("/", 1)[-1]: np.asarray(
                                g, dtype="float64"
                            )
                            for variable, g in zip(
                                layer.trainable_variables,
                                block(grad_fn(trainable, query, value)),
                                strict=True,
                            )
                        }
            if case in SAME_INPUTS_CASES and path_outputs:
                with matmul_precision(policy):
                    same_inputs = same_inputs_reference(
                        layer, query, value, call_kwargs
                    )
                compare_with_same_inputs(
                    rows, case, policy, path_outputs, same_inputs, scale
                )
            if len(gradients) == 2:
                rows.append(compare_gradients(case, policy, gradients))
    return rows


def check_paths(sizes) -> dict:
    """What `fused_kernel_runs` finds and the path taken, per dtype and mask,
    and the custom calls of `keras.ops.dot_product_attention`'s program."""
    import jax

    from keras_attn.ops import attention_path, fused_kernel_runs

    length = sizes["path_length"]
    rows = []
    for dtype in ("float32", "bfloat16", "float16"):
        heads = keras.ops.cast(
            np.random.default_rng(0).normal(size=(2, length, 8, 64)), dtype
        )
        for mask, mask_shape, causal in (
            ("none", None, False),
            ("causal", None, True),
            ("explicit", (2, 1, length, length), False),
        ):
            runs = fused_kernel_runs(
                heads, heads, heads, mask_shape=mask_shape, is_causal=causal
            )
            spec = jax.ShapeDtypeStruct((2, length, 8, 64), dtype)
            try:
                text = (
                    jax.jit(
                        lambda q, causal=causal: keras.ops.dot_product_attention(
                            q, q, q, is_causal=causal
                        )
                    )
                    .lower(spec)
                    .compile()
                    .as_text()
                )
                keras_calls = custom_calls(text)
            except Exception as error:
                keras_calls = f"does not compile: {str(error)[:200]}"
            rows.append(
                {
                    "dtype": dtype,
                    "length": length,
                    "mask": mask,
                    "fused_kernel_runs": runs,
                    "path_for_flash_attention_none": attention_path(
                        None,
                        fused_kernel=runs,
                        query_length=length,
                        key_length=length,
                        dtype=dtype,
                    ),
                    "keras_dot_product_attention_custom_calls": keras_calls,
                }
            )
    return {"rows": rows}


def check_costs(sizes) -> list[dict]:
    """Causal self-attention `(1, T, 8, 32)` forward+backward under `jax.jit`
    on each path: median time of 5 steps and XLA's temporary buffer size."""
    import jax

    from keras_attn.ops import dot_product_attention, memory_efficient_attention

    paths = {
        "explicit": lambda q: dot_product_attention(
            q, q, q, is_causal=True, flash_attention=False
        ),
        "memory_efficient": lambda q: memory_efficient_attention(q, q, q, causal=True),
        "keras_dot_product_attention": lambda q: keras.ops.dot_product_attention(
            q, q, q, is_causal=True
        ),
    }
    rows = []
    for dtype in ("float32", "bfloat16"):
        for length in sizes["cost_lengths"]:
            heads = keras.ops.cast(
                np.random.default_rng(0).normal(size=(1, length, 8, 32)), dtype
            )
            for name, attend in paths.items():
                row = {"dtype": dtype, "length": length, "path": name}
                rows.append(row)

                def loss(q, attend=attend):
                    return keras.ops.sum(keras.ops.cast(attend(q), "float32"))

                try:
                    compiled = jax.jit(jax.grad(loss)).lower(heads).compile()
                    memory = compiled.memory_analysis()
                    block(compiled(heads))
                    times = []
                    for _ in range(5):
                        start = time.perf_counter()
                        block(compiled(heads))
                        times.append(time.perf_counter() - start)
                    row.update(
                        ms=1e3 * statistics.median(times),
                        temp_mib=(memory.temp_size_in_bytes / 2**20)
                        if memory is not None
                        else None,
                        cudnn_fused=cudnn_attention(custom_calls(compiled.as_text())),
                    )
                except Exception as error:
                    row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
    return rows


def long_paths(length):
    """The attentions the `long` part compares, as functions of the heads
    `(B, T, N, H)` and a right-padded `(B, T)` padding mask (or `None`):
    keras-attn's automatic path, its explicit path, and
    `keras.ops.dot_product_attention` with the padding as a `(B, 1, T, T)`
    mask."""
    from keras_attn.ops import dot_product_attention

    def keras_attn(flash_attention):
        def attend(heads, padding):
            return dot_product_attention(
                heads,
                heads,
                heads,
                key_padding_mask=padding,
                query_padding_mask=padding,
                flash_attention=flash_attention,
            )

        return attend

    def keras_op(heads, padding):
        mask = None
        if padding is not None:
            mask = padding[:, None, None, :] & padding[:, None, :, None]
        return keras.ops.dot_product_attention(heads, heads, heads, mask=mask)

    return {
        "keras_attn": keras_attn(None),
        "explicit": keras_attn(False),
        "keras_dot_product_attention": keras_op,
    }


def long_fits(path, shape, dtype, device_bytes) -> bool:
    """Whether a path's forward+backward can fit: the explicit path and
    Keras's op (XLA's, where no fused kernel runs it) keep about three
    `(B, N, T, T)` float32 tensors, and Keras's op a `(B, 1, T, T)` mask."""
    batch, length, heads, _ = shape
    if path == "keras_attn" or device_bytes is None:
        return True
    return 3 * batch * heads * length * length * 4 < device_bytes


def check_long(sizes) -> list[dict]:
    """Self-attention `(B, T, 8, 64)` forward+backward under `jax.jit` at long
    lengths, with and without right padding (two batch rows, the second
    three quarters full; the mask an argument of the program, so that its
    values are unknown when traced): median time and XLA temporary memory of
    keras-attn's automatic path, its explicit path and Keras's op, per dtype.
    The automatic path on padded bfloat16 at 16k tokens and more must hold no
    `(T, T)`-sized temporary (`problem`) where it is cuDNN's lengths call or
    the memory-efficient path. Paths that cannot fit are skipped;
    rows that would start after `long_seconds` are skipped."""
    import jax

    from keras_attn.ops import switch_over_length
    from keras_attn.ops.attention_paths import lengths_kernel_implementation

    device = jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    device_bytes = (stats or {}).get("bytes_limit")
    started = time.perf_counter()
    rows = []
    for dtype in ("bfloat16", "float32"):
        for length in sizes["long_lengths"]:
            shape = (2, length, 8, sizes["long_head_dim"])
            heads = keras.ops.cast(np.random.default_rng(0).normal(size=shape), dtype)
            padding = (
                np.arange(length)[None, :]
                < np.array([length, 3 * length // 4])[:, None]
            )
            for padded in (False, True):
                for name, attend in long_paths(length).items():
                    row = {"dtype": dtype, "length": length, "padded": padded}
                    row["path"] = name
                    rows.append(row)
                    if time.perf_counter() - started > sizes["long_seconds"]:
                        row["skipped"] = "past the part's time"
                        continue
                    if not long_fits(name, shape, dtype, device_bytes):
                        row["skipped"] = "does not fit"
                        continue
                    if name == "keras_attn":
                        row["lengths_kernel"] = lengths_kernel_implementation(
                            heads,
                            heads,
                            heads,
                            lengths=padded,
                            is_causal=False,
                            window=None,
                        )
                    try:
                        row.update(
                            long_costs(attend, heads, padding if padded else None)
                        )
                    except Exception as error:
                        row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
                        continue
                    if (
                        name == "keras_attn"
                        and padded
                        and dtype == "bfloat16"
                        and length >= sizes["long_check_length"]
                        # Where neither cuDNN's lengths call nor the
                        # memory-efficient path runs, the explicit one does.
                        and (
                            row["lengths_kernel"] or length >= switch_over_length(dtype)
                        )
                        and row["square_shapes"]
                    ):
                        row["problem"] = (
                            "(T, T)-sized tensors in the program: "
                            + ", ".join(row["square_shapes"])
                        )
    add_time_over_explicit(rows, "path", ("dtype", "length", "padded"))
    return rows


def explicit_row(rows, row, name: str, keys):
    """The explicit path's row among `rows` (its `name` entry starts with
    "explicit") with `row`'s values of `keys`, or None."""
    return next(
        (
            other
            for other in rows
            if other[name].startswith("explicit")
            and all(other[k] == row[k] for k in keys)
        ),
        None,
    )


def add_time_over_explicit(rows, name: str, keys) -> None:
    """Each timed row's `time_over_explicit`: its time over that of the
    explicit path's row with the same `keys` (`explicit_row`)."""
    for row in rows:
        explicit = explicit_row(rows, row, name, keys)
        if "ms" in row and explicit is not None and "ms" in explicit:
            row["time_over_explicit"] = row["ms"] / explicit["ms"]


def long_costs(attend, heads, padding) -> dict:
    """Median time of 5 jitted forward+backward steps, XLA's temporary bytes
    and whether cuDNN's fused attention is in the program."""
    import jax

    def loss(heads, padding):
        return keras.ops.sum(keras.ops.cast(attend(heads, padding), "float32"))

    compiled = jax.jit(jax.grad(loss)).lower(heads, padding).compile()
    memory = compiled.memory_analysis()
    block(compiled(heads, padding))
    times = []
    for _ in range(5):
        start = time.perf_counter()
        block(compiled(heads, padding))
        times.append(time.perf_counter() - start)
    temp = None if memory is None else memory.temp_size_in_bytes
    text = compiled.as_text()
    return {
        "ms": 1e3 * statistics.median(times),
        "temp_bytes": temp,
        "temp_mib": None if temp is None else temp / 2**20,
        "cudnn_fused": cudnn_attention(custom_calls(text)),
        "square_shapes": square_shapes(text, heads.shape[1]),
    }


def square_shapes(compiled_text: str, length: int) -> list[str]:
    """The distinct array shapes in an optimized XLA program with two axes of
    `length` (a `(B, 1, T, T)` mask or bias, `(B, N, T, T)` logits): the
    tensors that make memory grow as `T²`."""
    found = set()
    for match in re.finditer(r"\b([a-z]+[0-9]*)\[([0-9,]+)\]", compiled_text):
        dims = [int(d) for d in match.group(2).split(",") if d]
        if dims.count(length) >= 2:
            found.add(f"{match.group(1)}[{match.group(2)}]")
    return sorted(found)


# -- float32 at a few thousand tokens ----------------------------------------------


def float32_variants(head_dim, interpret, padding):
    """The float32 self-attention candidates of the `float32` part: name ->
    `(masks, attend)`, `attend` a function of `(q, k, v)` and `masks` the
    masks it applies (`"none"`, `"padded"`: `padding` as key and query
    padding, `"causal"`). The explicit path, keras-attn's automatic path
    (`flash_attention=None`, which takes Pallas's kernel on a GPU from 4,096
    keys) with each kind of masks, the memory-efficient path at its default
    blocks and at larger ones, and Pallas's Triton attention kernel
    (`jax.experimental.pallas.ops.gpu.attention.mha`; interpreted off the
    GPU) called directly."""
    from keras_attn.ops import dot_product_attention, memory_efficient_attention

    masks = {
        "none": {},
        "padded": {"key_padding_mask": padding, "query_padding_mask": padding},
        "causal": {"is_causal": True},
    }
    variants = {}
    for kind, kwargs in masks.items():
        suffix = "" if kind == "none" else f" {kind}"
        for name, flash_attention in (("explicit", False), ("keras_attn", None)):

            def attend(q, k, v, kwargs=kwargs, flash_attention=flash_attention):
                return dot_product_attention(
                    q, k, v, flash_attention=flash_attention, **kwargs
                )

            variants[name + suffix] = (kind, attend)
    variants["memory_efficient"] = (
        "none",
        lambda q, k, v: memory_efficient_attention(q, k, v),
    )
    for query_block, key_block in ((512, None), (1024, None), (1024, 1024)):

        def blocked(q, k, v, query_block=query_block, key_block=key_block):
            return memory_efficient_attention(
                q, k, v, query_block_size=query_block, key_block_size=key_block
            )

        name = f"memory_efficient q{query_block} k{key_block or 'all'}"
        variants[name] = ("none", blocked)
    try:
        from jax.experimental.pallas.ops.gpu import attention as pallas_attention
    except ImportError:
        return variants
    for block in (64, 128):
        sizes = pallas_attention.BlockSizes(
            block_q=block,
            block_k=block,
            block_q_dkv=block // 2,
            block_kv_dkv=block // 2,
            block_q_dq=block // 2,
            block_kv_dq=block // 2,
        )

        def pallas(q, k, v, sizes=sizes):
            return pallas_attention.mha(
                q,
                k,
                v,
                None,
                sm_scale=float(head_dim) ** -0.5,
                block_sizes=sizes,
                interpret=interpret,
            )

        variants[f"pallas b{block}"] = ("none", pallas)
    return variants


def check_float32(sizes) -> list[dict]:
    """float32 self-attention `(2, T, 8, H)` forward+backward under `jax.jit`
    at `float32_lengths`, at JAX's default matmul precision (TF32 on NVIDIA
    GPUs) as a user's program runs: median time, XLA temporary memory, whether
    a Triton kernel (Pallas) is in the program, and the largest difference of
    outputs and q/k/v gradients from the explicit path with the same masks at
    the highest precision (a share of the reference's largest value), for
    each of `float32_variants` (padding: the second row three quarters
    full). Where no fused kernel takes float32, these are the candidates for
    `flash_attention=None` at a few thousand keys; rows that would start after
    `float32_seconds` are skipped."""
    import jax

    interpret = jax.default_backend() != "gpu"
    started = time.perf_counter()
    rows = []

    def outputs_and_gradients(attend):
        def run(q, k, v, upstream):
            outputs, pullback = jax.vjp(attend, q, k, v)
            return (outputs, *pullback(upstream))

        return jax.jit(run)

    for length in sizes["float32_lengths"]:
        shape = (2, length, 8, sizes["long_head_dim"])
        rng = np.random.default_rng(0)
        inputs = [
            jax.numpy.asarray(rng.normal(size=shape), "float32") for _ in range(4)
        ]
        padding = (
            np.arange(length)[None, :] < np.array([length, 3 * length // 4])[:, None]
        )
        variants = float32_variants(sizes["long_head_dim"], interpret, padding)
        references = {}
        with jax.default_matmul_precision("highest"):
            for kind in ("none", "padded", "causal"):
                name = "explicit" if kind == "none" else f"explicit {kind}"
                references[kind] = block(
                    outputs_and_gradients(variants[name][1])(*inputs)
                )
        for name, (kind, attend) in variants.items():
            row = {"length": length, "variant": name, "masks": kind}
            rows.append(row)
            if time.perf_counter() - started > sizes["float32_seconds"]:
                row["skipped"] = "past the part's time"
                continue
            try:
                compiled = outputs_and_gradients(attend).lower(*inputs).compile()
                memory = compiled.memory_analysis()
                got = block(compiled(*inputs))
                times = []
                for _ in range(5):
                    start = time.perf_counter()
                    block(compiled(*inputs))
                    times.append(time.perf_counter() - start)
            except Exception as error:
                row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
                continue
            row["ms"] = 1e3 * statistics.median(times)
            row["temp_mib"] = (
                None if memory is None else memory.temp_size_in_bytes / 2**20
            )
            row["triton"] = "triton" in compiled.as_text()
            reference = references[kind]
            differences = [
                float(np.max(np.abs(np.asarray(g) - np.asarray(w))))
                / max(float(np.max(np.abs(np.asarray(w)))), 1e-30)
                for g, w in zip(got, reference, strict=True)
            ]
            row["finite"] = all(bool(np.all(np.isfinite(np.asarray(g)))) for g in got)
            row["max_difference"] = dict(
                zip(
                    ("outputs", "d_query", "d_key", "d_value"),
                    differences,
                    strict=True,
                )
            )
    add_time_over_explicit(rows, "variant", ("masks", "length"))
    return rows


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

    trainable = [w.value for w in layer.trainable_variables]
    non_trainable = [w.value for w in layer.non_trainable_variables]

    def loss(trainable, inputs):
        outputs, _ = layer.stateless_call(trainable, non_trainable, inputs)
        return jnp.sum(jnp.square(outputs.astype("float32")))

    gradients = jax.jit(jax.grad(loss, argnums=(0, 1)))

    def run():
        block(gradients(trainable, inputs))

    return run, gradients, trainable


def matmul_fn(dtype: str, size: int):
    """A jitted square matmul in `dtype`; its FLOP/s is the practical peak."""
    import jax
    import jax.numpy as jnp

    a = jnp.asarray(np.random.default_rng(0).normal(size=(size, size)), dtype=dtype)
    b = jnp.asarray(np.random.default_rng(1).normal(size=(size, size)), dtype=dtype)
    product = jax.jit(jnp.matmul)

    def run():
        block(product(a, b))

    return run


def check_speed(sizes, rounds: int) -> list[dict]:
    import jax.numpy as jnp
    import keras_hub

    from keras_attn.layers import TransformerEncoderBlock

    rows = []
    for policy in sizes["speed_policies"]:
        dtype = policy.removeprefix("mixed_")
        common = {
            "intermediate_dim": sizes["speed_intermediate"],
            "num_heads": sizes["speed_heads"],
            "dropout": 0.0,
            "dtype": policy,
        }
        ours = TransformerEncoderBlock(**common)
        theirs = keras_hub.layers.TransformerEncoder(**common)
        shape = (sizes["speed_batch"], sizes["speed_length"], sizes["speed_model_dim"])
        inputs = jnp.asarray(np.random.default_rng(0).normal(size=shape), dtype=dtype)
        ours(inputs)
        theirs(inputs)
        theirs.set_weights(ours.get_weights())
        ours_run, ours_jitted, ours_vars = train_step_fn(ours, inputs)
        theirs_run, theirs_jitted, theirs_vars = train_step_fn(theirs, inputs)
        medians = alternate(
            {
                "keras_attn": ours_run,
                "keras_hub": theirs_run,
                "matmul": matmul_fn(dtype, sizes["peak_size"]),
            },
            rounds=rounds,
            warmup=2,
            inner=5,
        )
        peak = 2 * sizes["peak_size"] ** 3 / medians["matmul"]
        work = 3 * encoder_flops(sizes)  # forward + backward
        rows.append(
            {
                "policy": policy,
                "shape": shape,
                "keras_attn_ms": 1e3 * medians["keras_attn"],
                "keras_hub_ms": 1e3 * medians["keras_hub"],
                "ratio_hub_over_attn": medians["keras_hub"] / medians["keras_attn"],
                "matmul_peak_tflops": peak / 1e12,
                "keras_attn_fraction_of_peak": work / medians["keras_attn"] / peak,
                "keras_hub_fraction_of_peak": work / medians["keras_hub"] / peak,
                "keras_attn_cudnn_fused": cudnn_attention(
                    custom_calls(
                        ours_jitted.lower(ours_vars, inputs).compile().as_text()
                    )
                ),
                "keras_hub_cudnn_fused": cudnn_attention(
                    custom_calls(
                        theirs_jitted.lower(theirs_vars, inputs).compile().as_text()
                    )
                ),
            }
        )
    return rows


# -- (c) training -------------------------------------------------------------------


class LossWatch(keras.callbacks.Callback):
    """Records the training loss at every callback (every `steps_per_execution`
    steps) and when the first one came. The logged loss is the epoch's running
    mean, so a non-finite step anywhere in the epoch shows."""

    def __init__(self):
        super().__init__()
        self.losses = []
        self.calls = 0
        self.started = None
        self.first_call = None

    def on_train_begin(self, logs=None):
        self.started = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.calls += 1
        if self.first_call is None:
            self.first_call = time.perf_counter()
        self.losses.append(float(logs["loss"]))


def check_training(data_dir: Path, sizes, seconds: float) -> dict:
    """Train the translator in mixed_float16, decode the test split, score it."""
    import sacrebleu
    import sentencepiece

    from keras_attn.models import TransformerTranslator, configs
    from keras_attn.training import (
        BudgetCosineDecay,
        SmoothedSparseCrossentropy,
        TimeBudget,
        make_optimizer,
    )

    data = np.load(data_dir / "pairs.npz")
    processor = sentencepiece.SentencePieceProcessor(
        model_file=str(data_dir / "en_de.model")
    )
    vocabulary_size = processor.get_piece_size()
    max_length = data["train_encoder_inputs"].shape[1]
    # translate.py's from-scratch configuration at this size.
    config = configs.config("translator", sizes["translator"])
    recipe = config["training"]
    keras.config.set_dtype_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(0)
        model = TransformerTranslator(
            vocabulary_size,
            vocabulary_size,
            **{**config["model"], "sequence_length": max_length + 1},
        )
        batch_size = sizes["train_batch"]
        steps_per_epoch = len(data["train_encoder_inputs"]) // batch_size
        steps_per_execution = sizes["steps_per_execution"]
        # The configuration's recipe (AdamW, warm-up, a hold at the peak,
        # then a cosine decay to BudgetCosineDecay's default floor) over the
        # time budget; label smoothing.
        budget = TimeBudget(seconds / 60.0)
        schedule = BudgetCosineDecay(
            recipe["learning_rate"],
            warmup_steps=recipe["warmup_steps"],
            total_steps=10**9,
            budget=budget,
            hold=recipe["lr_hold"],
        )
        model.compile(
            optimizer=make_optimizer(
                recipe["learning_rate"],
                weight_decay=recipe["weight_decay"],
                clipnorm=recipe["clipnorm"],
            ),
            loss=SmoothedSparseCrossentropy(recipe["label_smoothing"]),
            weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
            steps_per_execution=steps_per_execution,
        )
        inputs = {
            "encoder_inputs": data["train_encoder_inputs"].astype("int32"),
            "decoder_inputs": data["train_decoder_inputs"].astype("int32"),
        }
        targets = data["train_decoder_targets"].astype("int32")
        weights = (targets != 0).astype("float32")
        watch = LossWatch()
        started = time.perf_counter()
        history = model.fit(
            inputs,
            targets,
            sample_weight=weights,
            batch_size=batch_size,
            epochs=10_000,
            callbacks=[budget, schedule, watch],
            verbose=0,
        )
        train_seconds = time.perf_counter() - started
        steps = int(model.optimizer.iterations.numpy())
        timed_steps = max(1, steps - steps_per_execution)
        timed_seconds = time.perf_counter() - watch.first_call
        target_tokens_per_step = float(weights.sum()) / len(weights) * batch_size
        loss_scale = getattr(model.optimizer, "dynamic_scale", None)

        decode = model.decoding_fn(max_length=max_length, beam_width=4)
        import jax

        compiled = jax.jit(decode)
        sources = data["test_encoder_inputs"].astype("int32")
        decode_batch = sizes["decode_batch"]
        # Pad the last batch to the decode batch: one compiled program.
        padded = np.zeros((-len(sources) % decode_batch, max_length), "int32")
        padded_sources = np.concatenate([sources, padded])
        decode_started = time.perf_counter()
        tokens = []
        for begin in range(0, len(padded_sources), decode_batch):
            batch_tokens, _ = compiled(padded_sources[begin : begin + decode_batch])
            tokens.append(np.asarray(batch_tokens))
        decode_seconds = time.perf_counter() - decode_started
        tokens = np.concatenate(tokens)[: len(sources)]
        hypotheses = [detokenize(processor, row) for row in tokens]
        references = [str(text) for text in data["test_references"]]
        bleu = sacrebleu.corpus_bleu(hypotheses, [references])
        chrf = sacrebleu.corpus_chrf(hypotheses, [references])
        losses = np.asarray(watch.losses)
        return {
            "policy": "mixed_float16",
            "optimizer": type(model.optimizer).__name__,
            "final_loss_scale": float(np.asarray(loss_scale))
            if loss_scale is not None
            else None,
            "translator": {
                "config": sizes["translator"],
                "embedding_dim": config["model"]["embedding_dim"],
                "layers_per_side": config["model"]["num_encoder_layers"],
                "heads": config["model"]["num_heads"],
                "intermediate_dim": config["model"]["intermediate_dim"],
                "parameters": model.count_params(),
            },
            "train_pairs": len(targets),
            "batch_size": batch_size,
            "steps": steps,
            "epochs": steps / steps_per_epoch,
            "train_seconds": train_seconds,
            "steps_per_execution": steps_per_execution,
            "first_execution_seconds": watch.first_call - watch.started,
            "steps_per_second": timed_steps / timed_seconds,
            "target_tokens_per_second": target_tokens_per_step
            * timed_steps
            / timed_seconds,
            "loss_finite": bool(np.isfinite(losses).all()),
            "first_loss": float(losses[0]),
            "final_loss": float(losses[-1]),
            "final_accuracy": float(history.history["accuracy"][-1]),
            "test_sentences": len(sources),
            "beam_width": 4,
            "decode_seconds_with_compile": decode_seconds,
            "test_bleu": bleu.score,
            "test_chrf": chrf.score,
            "sacrebleu": sacrebleu.__version__,
            "examples": [
                {"source": str(s), "reference": r, "translation": h}
                for s, r, h in list(
                    zip(data["test_sources"], references, hypotheses, strict=True)
                )[:3]
            ],
        }
    finally:
        keras.config.set_dtype_policy("float32")


def detokenize(processor, ids) -> str:
    """Text of beam-search ids: up to the end token, padding dropped."""
    ids = [int(i) for i in ids]
    if 3 in ids:
        ids = ids[: ids.index(3)]
    return processor.decode([i for i in ids if i > 3])


# -- (d) PyTorch ----------------------------------------------------------------------


def check_torch(sizes) -> dict:
    """The layers' paths and the memory-efficient op on PyTorch."""
    import torch

    from keras_attn.layers import MultiHeadAttention, MultiHeadSelfAttention
    from keras_attn.ops import (
        dot_product_attention,
        fused_kernel_runs,
        memory_efficient_attention,
    )

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rng = np.random.default_rng(0)
    report = {"device": device, "fused_kernel_runs": {}, "layers": [], "op": {}}
    length = sizes["torch_length"]
    for dtype in ("float32", "bfloat16", "float16"):
        heads = keras.ops.cast(rng.normal(size=(2, length, 8, 64)), dtype)
        report["fused_kernel_runs"][dtype] = {
            "none": fused_kernel_runs(heads, heads, heads),
            "causal": fused_kernel_runs(heads, heads, heads, is_causal=True),
        }
    query = rng.normal(size=(2, length, 64)).astype("float32")
    padding = np.ones((2, length), bool)
    padding[1, length * 4 // 5 :] = False
    for policy in ("float32", "mixed_bfloat16"):
        for layer, call in (
            (
                MultiHeadAttention(8, 8, dtype=policy),
                lambda layer: layer(
                    query, query, value_mask=padding, use_causal_mask=True
                ),
            ),
            (
                MultiHeadSelfAttention(8, 8, dtype=policy),
                lambda layer: layer(query, mask=padding),
            ),
        ):
            outputs = {}
            explicit_first = sorted(FLASH.items(), key=lambda kv: kv[1] is not False)
            for path, flash in explicit_first:
                layer.flash_attention = flash
                with PathRecorder() as recorder:
                    outputs[path] = keras.ops.convert_to_numpy(
                        keras.ops.cast(call(layer), "float32")
                    )
                report["layers"].append(
                    {
                        "policy": policy,
                        "layer": type(layer).__name__,
                        "asked": path,
                        "memory_efficient_ran": recorder.calls > 0,
                        "finite": bool(np.isfinite(outputs[path]).all()),
                        "max_difference_vs_explicit": float(
                            np.abs(outputs[path] - outputs["explicit"]).max()
                        ),
                        "tolerance": TOLERANCE[policy],
                    }
                )

    def tensor(shape, **kwargs):
        return torch.tensor(rng.normal(size=shape), device=device, **kwargs)

    q, k, v = (
        tensor((2, 300, 4, 16), dtype=torch.float32, requires_grad=True)
        for _ in range(3)
    )
    key_padding = torch.tensor(rng.uniform(size=(2, 300)) > 0.2, device=device)
    cotangent = tensor((2, 300, 4, 16), dtype=torch.float32)
    results = []
    for attend in (
        lambda: memory_efficient_attention(
            q,
            k,
            v,
            key_padding_mask=key_padding,
            causal=True,
            causal_offset=3,
            query_block_size=64,
            key_block_size=96,
        ),
        lambda: dot_product_attention(
            q,
            k,
            v,
            key_padding_mask=key_padding,
            is_causal=True,
            causal_offset=3,
            flash_attention=False,
        ),
    ):
        outputs = attend()
        grads = torch.autograd.grad((outputs * cotangent).sum(), (q, k, v))
        results.append([outputs.detach(), *grads])
    for name, got, want in zip(("outputs", "dq", "dk", "dv"), *results, strict=True):
        report["op"][name] = float((got - want).abs().max())
    return report


def run_torch_subprocess(args, remaining: float) -> dict:
    """Part (d) in a process of its own (a Keras backend is fixed per process)."""
    out = Path(args.out).with_name(Path(args.out).stem + "_torch.json")
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--parts",
        "torch",
        "--out",
        str(out),
    ] + (["--tiny"] if args.tiny else [])
    environment = dict(os.environ, KERAS_BACKEND="torch")
    completed = subprocess.run(
        command,
        env=environment,
        capture_output=True,
        text=True,
        timeout=max(30.0, remaining),
    )
    if completed.returncode != 0 or not out.exists():
        return {"error": completed.stderr[-2000:]}
    return json.loads(out.read_text()).get("torch", {})


# -- main -----------------------------------------------------------------------------

SIZES = {
    "full": {
        "batch": 4,
        "query_length": 512,
        "key_length": 640,
        "model_dim": 512,
        "heads": 8,
        "head_dim": 64,
        "path_length": 1024,
        "cost_lengths": (1024, 4096, 16384),
        "long_lengths": (4096, 16384, 32768, 65536),
        "long_head_dim": 64,
        "long_check_length": 16384,
        "long_seconds": 240,
        "float32_lengths": (4096, 8192),
        "float32_seconds": 150,
        "speed_batch": 32,
        "speed_length": 512,
        "speed_model_dim": 768,
        "speed_heads": 12,
        "speed_intermediate": 3072,
        "peak_size": 8192,
        "speed_policies": ("mixed_bfloat16", "mixed_float16"),
        "translator": "base",
        "train_batch": 128,
        "steps_per_execution": 16,
        "decode_batch": 512,
        "torch_length": 1100,
    },
    "tiny": {
        "batch": 3,
        "query_length": 16,
        "key_length": 24,
        "model_dim": 32,
        "heads": 2,
        "head_dim": 16,
        "path_length": 64,
        "cost_lengths": (64,),
        "long_lengths": (32, 64),
        "long_head_dim": 16,
        "long_check_length": 64,
        "long_seconds": 120,
        "float32_lengths": (64,),
        "float32_seconds": 120,
        "speed_batch": 2,
        "speed_length": 16,
        "speed_model_dim": 32,
        "speed_heads": 2,
        "speed_intermediate": 64,
        "peak_size": 128,
        # Keras's attention backward in float16 does not compile on a CPU
        # (XLA's CPU dot_general has no float16 -> float32 accumulation).
        "speed_policies": ("mixed_bfloat16",),
        "translator": "tiny",
        "train_batch": 32,
        "steps_per_execution": 4,
        "decode_batch": 64,
        "torch_length": 40,
    },
}
PART_ORDER = (
    "long",
    "float32",
    "numerics",
    "paths",
    "speed",
    "training",
    "costs",
    "torch",
)


def problems(report) -> list[str]:
    """Every finding that needs a fix: an error, NaN/inf, a nonzero empty row,
    an error beyond tolerance, a non-finite training loss."""
    found = [f"{part} failed: {error}" for part, error in report["errors"].items()]
    for row in report.get("numerics", []):
        label = " ".join(
            str(row.get(key)) for key in ("case", "policy", "asked", "gradients")
        )
        if "error" in row:
            found.append(f"{label}: {row['error']}")
            continue
        if not row["finite"]:
            found.append(f"non-finite values: {label}")
        if "empty_rows_zero" in row and not row["empty_rows_zero"]:
            found.append(f"fully masked rows not zero: {label}")
        difference = next(
            (
                row[key]
                for key in (
                    "max_error_vs_float32",
                    "max_error_vs_same_inputs",
                    "max_relative_difference",
                )
                if key in row
            ),
            None,
        )
        if difference is not None and not difference <= row["tolerance"]:
            found.append(f"difference {difference:.2e} > {row['tolerance']}: {label}")
    for row in report.get("long", []):
        label = (
            f"long {row['path']} {row['dtype']} {row['length']} padded={row['padded']}"
        )
        if "error" in row and row["path"] == "keras_attn":  # the others may not fit
            found.append(f"{label}: {row['error']}")
        if "problem" in row:
            found.append(f"{label}: {row['problem']}")
    float32_rows = report.get("float32", [])
    on_gpu = (report.get("versions") or {}).get("platform") == "gpu"
    for row in float32_rows:
        label = f"float32 {row['variant']} {row['length']}"
        # Pallas's kernel may refuse a shape or a GPU; the others must run.
        if "error" in row and not row["variant"].startswith("pallas"):
            found.append(f"{label}: {row['error']}")
        if "finite" in row and not row["finite"]:
            found.append(f"non-finite values: {label}")
        if not row["variant"].startswith("keras_attn") or "max_difference" not in row:
            continue
        # keras-attn's automatic path: as accurate as the explicit path at
        # the same (default) precision, and Pallas's kernel from 4,096 keys
        # on a GPU.
        explicit = explicit_row(float32_rows, row, "variant", ("masks", "length"))
        if explicit is not None and "max_difference" in explicit:
            bound = max(2 * max(explicit["max_difference"].values()), 1e-4)
            difference = max(row["max_difference"].values())
            if difference > bound:
                found.append(f"{label}: differs by {difference:.2e} > {bound:.2e}")
        if on_gpu and row["length"] >= 4096 and not row["triton"]:
            found.append(f"{label}: Pallas's kernel did not run")
    training = report.get("training") or {}
    if training and not training.get("loss_finite", False):
        found.append("training loss not finite")
    torch_report = report.get("torch") or {}
    if "error" in torch_report:
        found.append(f"torch part failed: {torch_report['error'][-400:]}")
    for row in torch_report.get("layers", []):
        if not row["finite"] or not (
            row["max_difference_vs_explicit"] <= row["tolerance"]
        ):
            found.append(f"torch {row}")
    for name, difference in (torch_report.get("op") or {}).items():
        if not difference <= 1e-4:
            found.append(f"torch memory-efficient {name} differs by {difference:.2e}")
    return found


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=".gpu_bundle/data", help="bundle data folder")
    parser.add_argument("--out", default="gpu_check.json", help="JSON file to write")
    parser.add_argument(
        "--train-seconds",
        type=float,
        default=None,
        help="training time of part (c) (default 120, or 5 with --tiny)",
    )
    parser.add_argument("--rounds", type=int, default=10, help="speed rounds")
    parser.add_argument(
        "--deadline-seconds",
        type=float,
        default=None,
        help="skip the parts that would start after this many seconds",
    )
    parser.add_argument(
        "--parts",
        default=",".join(PART_ORDER),
        help="comma-separated, of " + ", ".join(PART_ORDER),
    )
    parser.add_argument(
        "--cases",
        default=",".join(NUMERICS_CASES),
        help="the numerics part's cases, comma-separated, of "
        + ", ".join(NUMERICS_CASES),
    )
    parser.add_argument(
        "--long-lengths",
        default=None,
        help="the long part's lengths, comma-separated "
        "(default 4096,16384,32768,65536)",
    )
    parser.add_argument(
        "--long-seconds",
        type=float,
        default=None,
        help="skip the long part's rows that would start after this many "
        "seconds of it (default 240)",
    )
    parser.add_argument("--tiny", action="store_true", help="CPU-sized run")
    args = parser.parse_args(argv)
    long_lengths = None
    if args.long_lengths is not None:
        try:
            long_lengths = tuple(int(x) for x in args.long_lengths.split(","))
        except ValueError:
            long_lengths = ()
        if not long_lengths or min(long_lengths) < 1:
            parser.error(
                "--long-lengths must be positive integers separated by commas. "
                f"Received: {args.long_lengths!r}"
            )
    cases = args.cases.split(",")
    if set(cases) - set(NUMERICS_CASES):
        parser.error(
            f"unknown cases {sorted(set(cases) - set(NUMERICS_CASES))}; "
            f"choose from {NUMERICS_CASES}"
        )
    parts = args.parts.split(",")
    unknown = set(parts) - set(PART_ORDER)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {PART_ORDER}")
    backend = keras.backend.backend()
    if parts != ["torch"] and backend != "jax":
        parser.error(f"run with KERAS_BACKEND=jax. Received: backend={backend!r}")
    if parts == ["torch"] and backend != "torch":
        parser.error(f"--parts torch needs KERAS_BACKEND=torch. Received: {backend!r}")
    sizes = dict(SIZES["tiny" if args.tiny else "full"])
    if long_lengths is not None:
        sizes["long_lengths"] = long_lengths
    if args.long_seconds is not None:
        sizes["long_seconds"] = args.long_seconds
    if args.train_seconds is None:
        args.train_seconds = 5.0 if args.tiny else 120.0
    started = time.perf_counter()
    report = {"versions": versions(), "tiny": args.tiny, "errors": {}, "skipped": []}
    print(json.dumps(report["versions"], indent=2), flush=True)

    def save():
        report["seconds"] = time.perf_counter() - started
        Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")

    def elapsed():
        return time.perf_counter() - started

    runners = {
        "long": lambda: check_long(sizes),
        "float32": lambda: check_float32(sizes),
        "numerics": lambda: check_numerics(sizes, cases),
        "paths": lambda: check_paths(sizes),
        "speed": lambda: check_speed(sizes, args.rounds),
        "training": lambda: check_training(Path(args.data), sizes, args.train_seconds),
        "costs": lambda: check_costs(sizes),
        "torch": (
            (lambda: check_torch(sizes))
            if backend == "torch"
            else lambda: run_torch_subprocess(
                args,
                (args.deadline_seconds or 600.0) - elapsed(),
            )
        ),
    }
    for part in PART_ORDER:
        if part not in parts:
            continue
        if args.deadline_seconds is not None and elapsed() >= args.deadline_seconds:
            report["skipped"].append(f"{part}: started past the deadline")
            continue
        if part == "torch" and importlib.util.find_spec("torch") is None:
            report["skipped"].append("torch: PyTorch is not installed")
            continue
        part_started = time.perf_counter()
        print(f"== {part}", flush=True)
        try:
            report[part] = runners[part]()
        except Exception as error:
            report["errors"][part] = f"{type(error).__name__}: {error}"[:1000]
            traceback.print_exc()
        report.setdefault("part_seconds", {})[part] = time.perf_counter() - part_started
        save()
        print(json.dumps(report.get(part), default=str)[:4000], flush=True)
    report["problems"] = problems(report)
    save()
    print("problems:", json.dumps(report["problems"], indent=2))
    return report


if __name__ == "__main__":
    # Exit status 1 when the check found something to fix (`problems`).
    sys.exit(1 if main()["problems"] else 0)
