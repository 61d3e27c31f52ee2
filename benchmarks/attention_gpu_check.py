"""The attention paths on a GPU: which calls a fused kernel runs, and what
each path costs there (JAX or PyTorch backend; needs Keras, no TensorFlow).

- JAX: for float32, bfloat16 and float16 self-attention with no mask, a
  causal mask and an explicit mask, what `keras_attn.ops.fused_kernel_runs`
  finds in the compiled program and the path `attention_path` takes, and the
  custom-call targets of `keras.ops.dot_product_attention`'s program; then
  the attention alone (causal, `(1, T, 8, 32)`, forward+backward under
  `jax.jit`) on the explicit path, the memory-efficient op and
  `keras.ops.dot_product_attention`: median time of 5 steps and XLA's temp
  buffer size from the compiled program (`memory_analysis()`), per length.
- PyTorch: `fused_kernel_runs` on CUDA tensors; `MultiHeadAttention` and
  `MultiHeadSelfAttention` with `flash_attention` `None` and `True` against
  the explicit path (float32 and mixed_bfloat16, 1100 tokens, padding and
  causal masks); the memory-efficient op's outputs and gradients against the
  explicit path's.

It exits with status 1 when a check fails.

    KERAS_BACKEND=jax python benchmarks/attention_gpu_check.py [--lengths 1024 4096]
    KERAS_BACKEND=torch python benchmarks/attention_gpu_check.py
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras
import numpy as np

import keras_attn.ops.attention as attention_module
from keras_attn.layers import MultiHeadAttention, MultiHeadSelfAttention
from keras_attn.ops import (
    attention_path,
    dot_product_attention,
    fused_kernel_runs,
    memory_efficient_attention,
)

RNG = np.random.default_rng(0)
DTYPES = ("float32", "bfloat16", "float16")


def kernels(length=1024):
    """`fused_kernel_runs` and the path taken, per dtype and mask."""
    for dtype in DTYPES:
        heads = keras.ops.cast(RNG.normal(size=(2, length, 8, 64)), dtype)
        for mask_shape, causal in (
            (None, False),
            (None, True),
            ((2, 1, length, length), False),
        ):
            runs = fused_kernel_runs(
                heads, heads, heads, mask_shape=mask_shape, is_causal=causal
            )
            path = attention_path(
                None,
                fused_kernel=runs,
                query_length=length,
                key_length=length,
                dtype=dtype,
            )
            print(
                f"{dtype:>8} T={length} mask={mask_shape is not None!s:5} "
                f"causal={causal!s:5} fused kernel={runs!s:5} path(None)={path}"
            )


def jax_programs(length=4096):
    import jax

    for dtype in DTYPES:
        spec = jax.ShapeDtypeStruct((2, length, 8, 64), dtype)

        def attend(heads):
            return keras.ops.dot_product_attention(heads, heads, heads, is_causal=True)

        try:
            text = jax.jit(attend).lower(spec).compile().as_text()
            targets = sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))
        except Exception as error:
            targets = f"does not compile: {str(error)[:100]}"
        print(f"{dtype:>8} keras.ops.dot_product_attention custom calls: {targets}")


def jax_costs(lengths):
    import jax

    paths = {
        "explicit": lambda q: dot_product_attention(
            q, q, q, is_causal=True, flash_attention=False
        ),
        "memory_efficient": lambda q: memory_efficient_attention(q, q, q, causal=True),
        "keras_dpa": lambda q: keras.ops.dot_product_attention(q, q, q, is_causal=True),
    }
    print("causal self-attention (1, T, 8, 32), forward+backward, jax.jit:")
    for dtype in ("float32", "bfloat16"):
        for length in lengths:
            heads = keras.ops.cast(RNG.normal(size=(1, length, 8, 32)), dtype)
            cells = []
            for name, attend in paths.items():

                def loss(q, attend=attend):
                    return keras.ops.sum(keras.ops.cast(attend(q), "float32"))

                try:
                    compiled = jax.jit(jax.grad(loss)).lower(heads).compile()
                    temp = compiled.memory_analysis().temp_size_in_bytes
                    jax.block_until_ready(compiled(heads))
                    times = []
                    for _ in range(5):
                        start = time.perf_counter()
                        jax.block_until_ready(compiled(heads))
                        times.append(time.perf_counter() - start)
                    cells.append(
                        f"{name} {statistics.median(times) * 1e3:.2f} ms "
                        f"{temp / 2**20:.0f} MiB"
                    )
                except Exception as error:
                    cells.append(f"{name} failed: {str(error)[:80]}")
            print(f"  {dtype:>8} T={length:6} | " + " | ".join(cells), flush=True)


def torch_layers():
    taken = []
    original = attention_module.memory_efficient_attention

    def counting(*args, **kwargs):
        taken.append(1)
        return original(*args, **kwargs)

    attention_module.memory_efficient_attention = counting
    try:
        for policy, tolerance in (("float32", 1e-4), ("mixed_bfloat16", 3e-2)):
            query = RNG.normal(size=(2, 1100, 64)).astype("float32")
            padding = np.ones((2, 1100), bool)
            padding[1, 900:] = False
            for layer, call in (
                (
                    MultiHeadAttention(8, 8, dtype=policy),
                    lambda layer, query=query, padding=padding: layer(
                        query, query, value_mask=padding, use_causal_mask=True
                    ),
                ),
                (
                    MultiHeadSelfAttention(8, 8, dtype=policy),
                    lambda layer, query=query, padding=padding: layer(
                        query, mask=padding
                    ),
                ),
            ):
                outputs = {}
                for flash in (False, None, True):
                    layer.flash_attention = flash
                    before = len(taken)
                    outputs[flash] = keras.ops.convert_to_numpy(
                        keras.ops.cast(call(layer), "float32")
                    )
                    difference = float(np.abs(outputs[flash] - outputs[False]).max())
                    print(
                        f"  {policy:>14} {type(layer).__name__} flash={flash!s:5}: "
                        f"memory-efficient={len(taken) > before!s:5} "
                        f"max |- explicit|={difference:.1e}"
                    )
                    assert difference < tolerance, (policy, flash, difference)
    finally:
        attention_module.memory_efficient_attention = original


def torch_op_gradients():
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"

    def tensor(shape, **kwargs):
        return torch.tensor(RNG.normal(size=shape), device=device, **kwargs)

    q, k, v = (
        tensor((2, 300, 4, 16), dtype=torch.float32, requires_grad=True)
        for _ in range(3)
    )
    padding = torch.tensor(RNG.uniform(size=(2, 300)) > 0.2, device=device)
    cotangent = tensor((2, 300, 4, 16), dtype=torch.float32)
    results = []
    for attend in (
        lambda: memory_efficient_attention(
            q,
            k,
            v,
            key_padding_mask=padding,
            causal=True,
            causal_offset=3,
            query_block_size=64,
            key_block_size=96,
        ),
        lambda: dot_product_attention(
            q,
            k,
            v,
            key_padding_mask=padding,
            is_causal=True,
            causal_offset=3,
            flash_attention=False,
        ),
    ):
        outputs = attend()
        grads = torch.autograd.grad((outputs * cotangent).sum(), (q, k, v))
        results.append([outputs.detach(), *grads])
    for name, got, want in zip(("outputs", "dq", "dk", "dv"), *results, strict=True):
        difference = float((got - want).abs().max())
        print(f"  {name}: max |memory-efficient - explicit| = {difference:.1e}")
        assert difference < 1e-4, (name, difference)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    args = parser.parse_args()
    backend = keras.backend.backend()
    sections = [("which calls a fused kernel runs", kernels)]
    if backend == "jax":
        import jax

        print(f"jax {jax.__version__}, keras {keras.__version__}, {jax.devices()}")
        sections += [
            ("compiled programs", jax_programs),
            ("costs", lambda: jax_costs(args.lengths)),
        ]
    elif backend == "torch":
        import torch

        print(
            f"torch {torch.__version__}, keras {keras.__version__}, "
            f"cuda {torch.cuda.is_available()}"
        )
        sections += [
            ("layers against the explicit path", torch_layers),
            ("memory-efficient op's gradients", torch_op_gradients),
        ]
    else:
        parser.error("run with KERAS_BACKEND=jax or KERAS_BACKEND=torch")
    failures = []
    for name, section in sections:
        print(f"== {name}", flush=True)
        try:
            section()
        except Exception:
            traceback.print_exc()
            failures.append(name)
    if failures:
        print("FAILED:", "; ".join(failures))
        sys.exit(1)
    print("all checks passed")


if __name__ == "__main__":
    main()
