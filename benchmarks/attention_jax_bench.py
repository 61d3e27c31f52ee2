"""MultiHeadAttention against keras.layers.MultiHeadAttention on JAX (GPU).

On a GPU the fused path (`keras.ops.dot_product_attention`, cuDNN where it
applies: `keras_attn.ops.fused_kernel_runs` says where, printed first) runs
where the CPU tests run the explicit path. This script checks it there and
times it:

- checks, in float32 and mixed_bfloat16: padded queries and a sequence with
  no valid key give fully masked rows; with `flash_attention` `None`, `True`
  and `False` the outputs are finite, those rows are zeros, and the other rows
  equal the explicit path's and Keras's layer's with copied weights; the
  gradients of the fused path are finite and equal the explicit path's
  (cross-attention and causal self-attention);
- timing: a jit-compiled forward+backward pass of causal self-attention in
  mixed_bfloat16, both layers, the same weights, medians of alternating
  rounds.

It exits with status 1 when a check fails. Needs JAX and Keras only.

    KERAS_BACKEND=jax python benchmarks/attention_jax_bench.py [--small]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import keras
import numpy as np
from keras import ops

from keras_attn.layers import MultiHeadAttention
from keras_attn.ops import fused_kernel_runs


def masked_inputs(rng, batch=4, query_length=256, key_length=192, model_dim=512):
    """Inputs whose masks leave some query rows without any key."""
    query = rng.normal(size=(batch, query_length, model_dim)).astype("float32")
    value = rng.normal(size=(batch, key_length, model_dim)).astype("float32")
    query_mask = np.ones((batch, query_length), bool)
    query_mask[1, query_length * 3 // 4 :] = False  # padded queries
    value_mask = np.ones((batch, key_length), bool)
    value_mask[2, key_length // 2 :] = False
    value_mask[3] = False  # a sequence with no valid key at all
    return query, value, query_mask, value_mask


def gradients(layer, flash_attention, inputs):
    """Gradients of `sum(outputs²)` with respect to the layer's weights."""
    variables = layer.trainable_variables

    def loss(values):
        layer.flash_attention = flash_attention
        with keras.StatelessScope(
            state_mapping=list(zip(variables, values, strict=True))
        ):
            outputs = layer(**inputs)
        return ops.sum(ops.square(ops.cast(outputs, "float32")))

    grads = jax.grad(loss)([variable.value for variable in variables])
    return {
        variable.path.split("/", 1)[1]: np.asarray(grad, "float32")
        for variable, grad in zip(variables, grads, strict=True)
    }


def check(policy: str, tolerance: float, rng) -> list:
    keras.config.set_dtype_policy(policy)
    query, value, query_mask, value_mask = masked_inputs(rng)
    rows = query_mask & value_mask.any(-1)[:, None]  # rows with keys
    heads, model_dim = 8, query.shape[-1]
    ours = MultiHeadAttention(heads, model_dim // heads)
    ours(query, value)
    theirs = keras.layers.MultiHeadAttention(heads, model_dim // heads)
    theirs(query, value, return_attention_scores=True)
    theirs.set_weights(ours.get_weights())
    masks = {"query_mask": query_mask, "value_mask": value_mask}
    want, _ = theirs(query, value, return_attention_scores=True, **masks)
    want = np.asarray(ops.cast(want, "float32"))
    failures, outputs = [], {}
    for flash in (False, None, True):
        ours.flash_attention = flash
        outputs[flash] = np.asarray(ops.cast(ours(query, value, **masks), "float32"))
    for flash, out in outputs.items():
        finite = bool(np.isfinite(out).all())
        zero_rows = bool((out[~rows] == 0).all())
        to_explicit = float(np.abs(out[rows] - outputs[False][rows]).max())
        to_keras = float(np.abs(out[rows] - want[rows]).max())
        print(
            f"{policy:>14} flash_attention={flash!s:>5}: finite={finite} "
            f"zero rows={zero_rows} max|-explicit|={to_explicit:.1e} "
            f"max|-keras|={to_keras:.1e}"
        )
        if not (
            finite and zero_rows and to_explicit < tolerance and to_keras < tolerance
        ):
            failures.append(f"{policy} outputs flash_attention={flash}")
    for name, inputs in (
        ("cross-attention", {"query": query, "value": value, **masks}),
        (
            "causal self-attention",
            {
                "query": query,
                "value": query,
                "query_mask": query_mask,
                "value_mask": query_mask,
                "use_causal_mask": True,
            },
        ),
    ):
        if name.startswith("causal"):
            ours = MultiHeadAttention(heads, model_dim // heads)
            ours(query, query)
        fused, explicit = gradients(ours, None, inputs), gradients(ours, False, inputs)
        finite = all(np.isfinite(grad).all() for grad in fused.values())
        # The key bias gets no gradient (the softmax ignores it): not compared.
        relative = max(
            float(np.abs(fused[path] - explicit[path]).max())
            / (float(np.abs(explicit[path]).max()) + 1e-6)
            for path in fused
            if path != "key/bias"
        )
        print(
            f"{policy:>14} {name} gradients: finite={finite} "
            f"max relative |fused-explicit|={relative:.1e}"
        )
        if not finite or relative > 10 * tolerance:
            failures.append(f"{policy} {name} gradients")
    return failures


def timing(rounds: int, small: bool, rng):
    keras.config.set_dtype_policy("mixed_bfloat16")
    batch, length, model_dim, heads = (2, 64, 64, 4) if small else (16, 1024, 1024, 16)
    inputs = rng.normal(size=(batch, length, model_dim)).astype("float32")
    layers = {
        "keras_attn": MultiHeadAttention(heads, model_dim // heads),
        "keras": keras.layers.MultiHeadAttention(heads, model_dim // heads),
    }
    for layer in layers.values():
        layer(inputs, inputs)
    layers["keras"].set_weights(layers["keras_attn"].get_weights())
    steps = {}
    for name, layer in layers.items():
        variables = layer.trainable_variables

        def loss(values, layer=layer, variables=variables):
            with keras.StatelessScope(
                state_mapping=list(zip(variables, values, strict=True))
            ):
                outputs = layer(inputs, inputs, use_causal_mask=True)
            return ops.sum(ops.cast(outputs, "float32"))

        step = jax.jit(jax.grad(loss))
        values = [variable.value for variable in variables]
        jax.block_until_ready(step(values))  # compile
        steps[name] = (step, values)
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, (step, values) in steps.items():
            start = time.perf_counter()
            for _ in range(5):
                result = step(values)
            jax.block_until_ready(result)
            times[name].append((time.perf_counter() - start) / 5)
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(
        f"forward+backward, mixed_bfloat16, causal, batch {batch}, length {length}, "
        f"d_model {model_dim}, {heads} heads; medians of {rounds} rounds:"
    )
    for name, seconds in medians.items():
        print(f"  {name:>10}: {seconds * 1e3:8.3f} ms")
    print(f"  ratio keras / keras_attn: {medians['keras'] / medians['keras_attn']:.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--small", action="store_true", help="tiny timing sizes")
    args = parser.parse_args()
    if keras.backend.backend() != "jax":
        parser.error("run with KERAS_BACKEND=jax")
    print(f"jax {jax.__version__}, keras {keras.__version__}, devices {jax.devices()}")
    for dtype in ("float32", "bfloat16"):
        heads = ops.zeros((16, 1024, 16, 64), dtype)  # the timing's (B, T, N, H)
        print(
            f"fused kernel for causal self-attention in {dtype} here: "
            f"{fused_kernel_runs(heads, heads, heads, is_causal=True)}"
        )
    rng = np.random.default_rng(0)
    failures = check("float32", 2e-3, rng) + check("mixed_bfloat16", 3e-2, rng)
    timing(args.rounds, args.small, rng)
    keras.config.set_dtype_policy("float32")
    if failures:
        print("FAILED:", "; ".join(failures))
        sys.exit(1)
    print("all checks passed")


if __name__ == "__main__":
    main()
