"""Long-sequence self-attention: memory, time and GFLOP/s of the attention paths.

Two levels (`--level`), on TensorFlow or JAX (`--backend`), causal or not
(`--causal`), per length and dtype policy (float32, mixed_bfloat16).

`--level layer` (the default): forward+backward of one self-attention layer
(batch 1, d_model 256, 8 heads), gradients of its weights, through the
layers users get:

- `keras`: `keras.layers.MultiHeadAttention`;
- `explicit`: `keras_attn.layers.MultiHeadAttention(flash_attention=False)`,
  which materialises the `(B, N, T, T)` weights;
- `memory_efficient`: `keras_attn.layers.MultiHeadAttention(flash_attention=True)`:
  on a CPU (no fused kernel) the memory-efficient path at every length;
- `auto` (not run by default): `flash_attention=None`, the path the layer
  takes by itself (`keras_attn.ops.attention_path`: memory-efficient from
  the switch-over length on).

`--blocks 256xall 512x512` adds variants of the memory-efficient op with
other block sizes (`QxK` query and key block sizes, `all` for all the keys in
one block), called inside `SelfAttention` below (Keras's `EinsumDense`
projections) since the layer takes the default blocks. All paths get the
Keras layer's weights.

`--level op`: the attention op alone on `(1, T, 8, 32)` query, key and value
(float32, or bfloat16 for a bfloat16 policy), forward+backward of
`sum(outputs * cotangent)` (gradients of the query, key and value):

- `keras`: `keras.ops.dot_product_attention(q, k, v, is_causal=...)`;
- `memory_efficient`: `keras_attn.ops.memory_efficient_attention(q, k, v,
  causal=...)`;
- `torch` (when `import torch` works, else a note): PyTorch's CPU
  `torch.nn.functional.scaled_dot_product_attention(..., is_causal=...)`,
  eager, `torch.set_num_threads` the number of cores;
- `explicit` (not run by default): `keras_attn.ops.dot_product_attention(...,
  flash_attention=False)`.

The outputs of the paths are checked to agree (`max diff`: the largest
difference from the first path's).

Memory: the peak resident memory above the process's baseline (the layer
built or the op's inputs made), measured for each point in its own process
(KERAS_BACKEND set to `--backend` before Keras is imported; a `torch` point
imports neither Keras nor its backend). Before starting a point, its size is
predicted (from the same path at a shorter length, else from the size of its
largest tensors) and the point is skipped, with a note, when it would not fit
the memory available, rather than trigger the out-of-memory killer.

Time: the median of `--rounds` forward+backward steps, compiled (in
`tf.function` on TensorFlow, `jax.jit(jax.value_and_grad(...))` on JAX; the
`torch` path eager), the paths that fit timed alternately in one process per
length and policy (this one, KERAS_BACKEND set to `--backend` first).

GFLOP/s: attention's useful work, `4·T²·d_model` (the `q·kᵀ` and weights·`v`
products, d_model 256) forward, times 3.5 with the backward, times 0.5 when causal,
over the median time (at the layer level the projections are not counted).
Share: GFLOP/s over the float32 matmul peak measured in the timing process
just before the paths are timed (the best of 5 runs of a compiled
`--peak-size`² float32 matmul, 2048 by default, arguments passed in); rows of
a bfloat16 policy also get the share of the bfloat16 matmul peak, measured
alike. The header gives the CPU model and whether it has avx512_bf16 and AMX.

    .venv/bin/python benchmarks/long_attention_bench.py \\
        [--backend tensorflow|jax] [--level layer|op] \\
        [--lengths 1024 2048 4096 8192 16384] [--policies float32 mixed_bfloat16] \\
        [--paths keras explicit memory_efficient auto torch] \\
        [--blocks 256xall 512x512] \\
        [--rounds 5] [--causal] [--peak-size 2048] [--json results.json]

For example, issue 46's table at 8k and 32k, full and causal, on both backends:

    for backend in tensorflow jax; do for causal in "" --causal; do
      .venv/bin/python benchmarks/long_attention_bench.py --backend $backend \\
          --level op --lengths 8192 32768 --rounds 5 $causal \\
          --json long-op-$backend${causal:+-causal}.json
    done; done
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


def backend() -> str:
    import keras

    return keras.backend.backend()


def forward_call(layer, inputs, causal: bool, call=None):
    """The layer's forward pass (through `call`: the layer, or a stateless
    call with the variables bound)."""
    import keras

    call = layer if call is None else call
    if isinstance(layer, keras.layers.MultiHeadAttention):
        return call(inputs, inputs, use_causal_mask=causal)
    return call(inputs)


def make_step(layer, inputs, causal: bool):
    """`(forward, step)`: the compiled forward pass, and a compiled
    forward+backward step (gradients of the layer's weights) that waits for
    its results."""
    if backend() == "jax":
        return _make_jax_step(layer, inputs, causal)
    import tensorflow as tf

    def forward():
        return forward_call(layer, inputs, causal)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.cast(forward(), "float32"))
        return tape.gradient(loss, layer.trainable_variables)

    def run():
        for gradient in step():
            gradient.numpy()

    return tf.function(forward), run


def _make_jax_step(layer, inputs, causal: bool):
    """`jax.jit(jax.value_and_grad(...))` over the layer's stateless call,
    the variables' current values and the inputs passed in as arguments."""
    import jax
    import jax.numpy as jnp

    if not layer.built:
        forward_call(layer, inputs[:, :8], causal)
    trainable = [variable.value for variable in layer.trainable_variables]
    non_trainable = [variable.value for variable in layer.non_trainable_variables]

    def outputs(trainable, non_trainable, inputs):
        def call(*args, **kwargs):
            return layer.stateless_call(trainable, non_trainable, *args, **kwargs)[0]

        return forward_call(layer, inputs, causal, call=call)

    def loss(trainable, non_trainable, inputs):
        return jnp.sum(outputs(trainable, non_trainable, inputs).astype("float32"))

    forward = jax.jit(outputs)
    step = jax.jit(jax.value_and_grad(loss))

    def run():
        jax.block_until_ready(step(trainable, non_trainable, inputs))

    return (lambda: forward(trainable, non_trainable, inputs)), run


def build_on_short_input(layer, inputs, causal: bool):
    """Builds the layer's weights (on 8 positions)."""
    if backend() == "jax":
        forward_call(layer, inputs[:, :8], causal)
    else:
        make_step(layer, inputs[:, :8], causal)[1]()


def make_inputs(length: int):
    import keras
    import numpy as np

    data = np.random.default_rng(0).normal(size=(BATCH, length, MODEL_DIM))
    return keras.ops.convert_to_tensor(data.astype("float32"))


# -- the op level -------------------------------------------------------------------

# "keras_attn": `keras_attn.ops.dot_product_attention` with its own choice of
# path (what the layers run: on PyTorch's CPU its flash kernel).
OP_PATHS = ("keras", "keras_attn", "explicit", "memory_efficient", "torch")


def compute_dtype(policy: str) -> str:
    """`"float32"` -> `"float32"`, `"mixed_bfloat16"` -> `"bfloat16"`."""
    return "float32" if policy == "float32" else policy.split("_")[-1]


def op_arrays(length: int, policy: str) -> dict:
    """Query, key and value `(B, T, N, H)` and the cotangent of the outputs,
    NumPy float32; for a 16-bit policy the inputs are rounded to its dtype
    here, so that every path gets exactly the same values."""
    import ml_dtypes
    import numpy as np

    rng = np.random.default_rng(0)
    shape = (BATCH, length, HEADS, HEAD_DIM)
    arrays = {
        name: rng.normal(size=shape).astype("float32")
        for name in ("query", "key", "value", "cotangent")
    }
    dtype = compute_dtype(policy)
    if dtype != "float32":
        rounding = getattr(ml_dtypes, dtype, None) or np.dtype(dtype)
        for name in ("query", "key", "value"):
            arrays[name] = arrays[name].astype(rounding).astype("float32")
    return arrays


def op_function(path: str, causal: bool):
    """`attend(query, key, value) -> outputs` of a Keras-backend op path."""
    import keras

    from keras_attn.ops import dot_product_attention, memory_efficient_attention

    if path == "keras":
        return lambda q, k, v: keras.ops.dot_product_attention(
            q, k, v, is_causal=causal
        )
    if path == "keras_attn":
        return lambda q, k, v: dot_product_attention(q, k, v, is_causal=causal)
    if path == "explicit":
        return lambda q, k, v: dot_product_attention(
            q, k, v, is_causal=causal, flash_attention=False
        )
    if path == "memory_efficient":
        return lambda q, k, v: memory_efficient_attention(q, k, v, causal=causal)
    if path.startswith("memory_efficient["):  # a --blocks variant
        query_block, key_block = parse_blocks(path[len("memory_efficient[") : -1])
        return lambda q, k, v: memory_efficient_attention(
            q,
            k,
            v,
            causal=causal,
            query_block_size=query_block,
            key_block_size=key_block,
        )
    raise ValueError(f"no op path {path!r}")


def make_op_step(path: str, arrays: dict, policy: str, causal: bool):
    """`(forward, step)` of an op path: its outputs as NumPy float32
    `(B, T, N, H)`, and a forward+backward step of `sum(outputs * cotangent)`
    (gradients of query, key and value) that waits for its results. The
    inputs are made here, before the step is first called."""
    if path == "torch":
        return _make_torch_step(arrays, policy, causal)
    import numpy as np

    attend = op_function(path, causal)
    dtype = compute_dtype(policy)
    if backend() == "jax":
        import jax
        import jax.numpy as jnp

        q, k, v = (jnp.asarray(arrays[n], dtype) for n in ("query", "key", "value"))
        cotangent = jnp.asarray(arrays["cotangent"])

        def loss(q, k, v, cotangent):
            return jnp.sum(attend(q, k, v).astype("float32") * cotangent)

        forward = jax.jit(attend)
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

        def run():
            jax.block_until_ready(step(q, k, v, cotangent))

    elif backend() == "torch":
        # Keras's layout, (B, T, N, H), as the arrays are.
        return _torch_eager_step(attend, arrays, policy, lambda x: x)

    else:
        import tensorflow as tf

        q, k, v = (
            tf.cast(tf.constant(arrays[n]), dtype) for n in ("query", "key", "value")
        )
        cotangent = tf.constant(arrays["cotangent"])
        forward = tf.function(attend)

        @tf.function
        def step(q, k, v, cotangent):
            with tf.GradientTape() as tape:
                tape.watch([q, k, v])
                loss = tf.reduce_sum(tf.cast(attend(q, k, v), "float32") * cotangent)
            return tape.gradient(loss, [q, k, v])

        def run():
            for gradient in step(q, k, v, cotangent):
                gradient.numpy()

    return (lambda: np.asarray(forward(q, k, v), "float32")), run


def torch_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def torch_available() -> str | None:
    """None when `import torch` works, else why not."""
    try:
        import torch  # noqa: F401
    except Exception as error:  # ImportError, or a broken installation
        return f"{type(error).__name__}: {error}"
    return None


def _make_torch_step(arrays: dict, policy: str, causal: bool):
    """PyTorch's `scaled_dot_product_attention` on the CPU, eager, on
    `(B, N, T, H)` tensors (its layout)."""
    import torch

    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal
        )

    return _torch_eager_step(attend, arrays, policy, lambda x: x.transpose(0, 2, 1, 3))


def _torch_eager_step(attend, arrays: dict, policy: str, layout):
    """`(forward, step)` of `attend` on PyTorch tensors, eager: the arrays
    put in `attend`'s layout by `layout` (a NumPy axes permutation, its own
    inverse), the forward's outputs returned in the arrays' layout as NumPy
    float32, and a step of `sum(outputs * cotangent)`'s gradients of query,
    key and value."""
    import numpy as np
    import torch

    torch.set_num_threads(torch_threads())
    dtype = getattr(torch, compute_dtype(policy))

    def tensor(x):
        return torch.from_numpy(np.ascontiguousarray(layout(x)))

    q, k, v = (
        tensor(arrays[n]).to(dtype).requires_grad_() for n in ("query", "key", "value")
    )
    cotangent = tensor(arrays["cotangent"])

    def forward():
        with torch.no_grad():
            outputs = attend(q, k, v)
        return layout(outputs.float().numpy())

    def run():
        loss = torch.sum(attend(q, k, v).float() * cotangent)
        torch.autograd.grad(loss, (q, k, v))

    return forward, run


# -- useful work and the matmul peak ----------------------------------------------


def useful_flops(length: int, causal: bool) -> float:
    """Attention's useful work in a forward+backward step: `4·T²·d_model`
    forward (`q·kᵀ` and weights·`v`), times 3.5 with the backward (the
    recomputation of the weights and the four gradient products), times 0.5
    when causal."""
    flops = 4 * BATCH * length**2 * MODEL_DIM * 3.5
    return flops / 2 if causal else flops


def matmul_peak(dtype: str, size: int = 2048, runs: int = 5) -> float:
    """FLOP/s of a compiled `size`² matmul in `dtype` on the Keras backend,
    the best of `runs` runs after one to compile; the matrices are passed in
    as arguments (nothing for the compiler to fold)."""
    import numpy as np

    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(2, size, size)).astype("float32")
    if backend() == "jax":
        import jax
        import jax.numpy as jnp

        a, b = jnp.asarray(a, dtype), jnp.asarray(b, dtype)
        matmul = jax.jit(jnp.matmul)

        def call():
            matmul(a, b).block_until_ready()

    elif backend() == "torch":
        import torch

        torch.set_num_threads(torch_threads())
        a, b = (torch.from_numpy(x).to(getattr(torch, dtype)) for x in (a, b))

        def call():
            torch.matmul(a, b)

    else:
        import tensorflow as tf

        a, b = tf.cast(tf.constant(a), dtype), tf.cast(tf.constant(b), dtype)
        matmul = tf.function(lambda a, b: tf.matmul(a, b))

        def call():
            matmul(a, b)[0, 0].numpy()

    call()
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def add_rates(row: dict, causal: bool) -> None:
    """GFLOP/s of a timed row and its shares of the matmul peaks."""
    row["gflops"] = useful_flops(row["length"], causal) / row["seconds"] / 1e9
    row["share"] = row["gflops"] / row["peak_gflops"]
    dtype = compute_dtype(row["policy"])
    if f"{dtype}_peak_gflops" in row:
        row[f"{dtype}_share"] = row["gflops"] / row[f"{dtype}_peak_gflops"]


# -- memory: one process per point ------------------------------------------------


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure_point(
    path: str, length: int, policy: str, causal: bool, level: str = "layer"
) -> dict:
    """Peak resident memory above the baseline of two forward+backward steps
    (the first one traces or compiles)."""
    if level == "op":
        _, step = make_op_step(path, op_arrays(length, policy), policy, causal)
    else:
        inputs = make_inputs(length)
        layer = build_layer(path, policy, causal)
        build_on_short_input(layer, inputs, causal)
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
        # The backend this process ran (None: a torch point, Keras not imported).
        "point_backend": backend() if "keras" in sys.modules else None,
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


def run_point(
    path, length, policy, causal, timeout, level="layer", keras_backend="tensorflow"
):
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--point",
        path,
        str(length),
        policy,
        "--level",
        level,
        "--backend",
        keras_backend,
    ] + (["--causal"] if causal else [])
    try:
        result = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env={**os.environ, "KERAS_BACKEND": keras_backend},
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    if result.returncode != 0:
        tail = result.stderr.strip().splitlines()[-1:] or [""]
        return {"error": f"exit status {result.returncode}: {tail[0][:200]}"}
    return json.loads(result.stdout.strip().splitlines()[-1])


# -- time: the paths that fit, alternately in one process ---------------------------


def time_paths(
    paths, length, policy, causal, rounds, level="layer", peak_size=2048
) -> dict:
    """Median seconds per step of each path, each path's largest output
    difference from the first path's (same weights, same inputs), and the
    matmul peaks (FLOP/s) measured just before, in this process."""
    import numpy as np
    from _timing import alternate

    forwards, steps, outputs = {}, {}, {}
    if level == "op":
        arrays = op_arrays(length, policy)
        for path in paths:
            forwards[path], steps[path] = make_op_step(path, arrays, policy, causal)
            outputs[path] = forwards[path]()
    else:
        inputs = make_inputs(length)
        layers = {path: build_layer(path, policy, causal) for path in paths}
        reference_weights = None
        for path, layer in layers.items():
            build_on_short_input(layer, inputs, causal)
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
    peaks = {"float32": matmul_peak("float32", peak_size)}
    dtype = compute_dtype(policy)
    if dtype != "float32":
        peaks[dtype] = matmul_peak(dtype, peak_size)
    medians = alternate(steps, rounds=rounds, warmup=1, inner=1)
    return {
        "seconds": medians,
        "max_difference": differences,
        "peaks": peaks,
        "backend": backend(),
    }


# -- report ---------------------------------------------------------------------


LAYER_DEFAULT_PATHS = ["keras", "explicit", "memory_efficient"]
OP_DEFAULT_PATHS = ["keras", "memory_efficient", "torch"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--backend",
        choices=["tensorflow", "jax", "torch"],
        default="tensorflow",
        help="the Keras backend (KERAS_BACKEND of this process and of the "
        "per-point processes; torch at the op level only, eager)",
    )
    parser.add_argument(
        "--level",
        choices=["layer", "op"],
        default="layer",
        help="a self-attention layer (projections included) or the attention "
        "op alone on (1, T, 8, 32) inputs",
    )
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384]
    )
    parser.add_argument("--policies", nargs="+", default=["float32", "mixed_bfloat16"])
    parser.add_argument(
        "--paths",
        nargs="+",
        choices=sorted({"keras", *LAYER_PATHS, *OP_PATHS}),
        help=f"default: {' '.join(LAYER_DEFAULT_PATHS)} (layer level), "
        f"{' '.join(OP_DEFAULT_PATHS)} (op level; torch when installed)",
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
        "--peak-size",
        type=int,
        default=2048,
        help="size of the square matmul whose FLOP/s is the peak",
    )
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
    args = parser.parse_args(argv)

    # Before Keras is imported (a torch point imports neither).
    os.environ["KERAS_BACKEND"] = args.backend
    if "keras" in sys.modules and backend() != args.backend:
        parser.error(
            f"Keras was imported with the {backend()} backend before "
            f"--backend {args.backend}: run the script in its own process"
        )

    if args.point:
        path, length, policy = args.point
        print(
            json.dumps(
                measure_point(path, int(length), policy, args.causal, args.level)
            )
        )
        return None

    if args.backend == "torch" and args.level != "op":
        parser.error(
            "--backend torch: the op level only (--level op). Received: "
            f"--level {args.level}"
        )
    allowed = OP_PATHS if args.level == "op" else ("keras", *LAYER_PATHS)
    requested = args.paths or (
        OP_DEFAULT_PATHS if args.level == "op" else LAYER_DEFAULT_PATHS
    )
    wrong = [path for path in requested if path not in allowed]
    if wrong:
        parser.error(
            f"--paths {' '.join(wrong)}: not at the {args.level} level "
            f"(it has {', '.join(allowed)})"
        )
    notes = []
    if "torch" in requested:
        missing = torch_available()
        if missing is not None:
            requested = [path for path in requested if path != "torch"]
            notes.append(f"no torch path: `import torch` failed ({missing})")
            print(notes[-1], flush=True)
    paths = list(requested) + [path_name(blocks) for blocks in args.blocks]

    from _timing import machine

    info = machine()
    amx = info["amx_tile"] or info["amx_bf16"]
    step = (
        {"jax": "jax.jit(jax.value_and_grad)", "torch": "eager autograd"}.get(
            args.backend, "tf.function"
        )
    ) + (" (torch eager)" if "torch" in paths else "")
    what = (
        f"the attention op on ({BATCH}, T, {HEADS}, {HEAD_DIM}) inputs"
        if args.level == "op"
        else f"a self-attention layer, batch {BATCH}, d_model {MODEL_DIM}, "
        f"{HEADS} heads"
    )
    print(
        f"{args.backend}: {what}, {'causal' if args.causal else 'no mask'}, "
        f"forward+backward in {step}; time: median of {args.rounds} rounds; "
        f"GFLOP/s of 4·T²·{MODEL_DIM}·3.5{'·0.5' if args.causal else ''}; "
        f"peak: best of 5 {args.peak_size}² matmuls\n"
        f"CPU: {info['cpu']}, {info['cpus']} CPUs, "
        f"avx512_bf16 {'present' if info['avx512_bf16'] else 'absent'}, "
        f"AMX {'present' if amx else 'absent'}"
    )
    measured, results = {}, []
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
                    "backend": args.backend,
                    "level": args.level,
                    "causal": args.causal,
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
                        run_point(
                            path,
                            length,
                            policy,
                            args.causal,
                            args.timeout,
                            level=args.level,
                            keras_backend=args.backend,
                        )
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
                timing = time_paths(
                    fitting,
                    length,
                    policy,
                    args.causal,
                    args.rounds,
                    level=args.level,
                    peak_size=args.peak_size,
                )
                for row in results:
                    if (row["length"], row["policy"]) == (length, policy) and (
                        row["path"] in timing["seconds"]
                    ):
                        row["seconds"] = timing["seconds"][row["path"]]
                        row["backend"] = timing["backend"]  # the one that ran
                        row["max_difference"] = timing["max_difference"][row["path"]]
                        row["peak_gflops"] = timing["peaks"]["float32"] / 1e9
                        for dtype, peak in timing["peaks"].items():
                            if dtype != "float32":
                                row[f"{dtype}_peak_gflops"] = peak / 1e9
                        add_rates(row, args.causal)
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
    return results


def print_rows(rows, header=False):
    by_key = {(r["length"], r["policy"], r["path"]): r for r in rows}
    if header:
        print(
            "| length | policy | path | peak MiB | ms | GFLOP/s "
            "| share of f32 peak | share of bf16 peak | matmul peak GFLOP/s "
            "| time / explicit | time / keras | memory / keras | max diff |"
        )
        print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        if "seconds" not in row:
            reason = row.get("skipped") or row.get("error", "")
            print(
                f"| {row['length']} | {row['policy']} | {row['path']} | — | — "
                f"| | | | | | | | {reason} |"
            )
            continue
        explicit = by_key.get((row["length"], row["policy"], "explicit"), {})
        keras_row = by_key.get((row["length"], row["policy"], "keras"), {})

        def ratio(other, field, row=row):
            return f"{row[field] / other[field]:.2f}" if field in other else "—"

        bf16_share = f"{row['bfloat16_share']:.1%}" if "bfloat16_share" in row else "—"
        peaks = f"{row['peak_gflops']:.0f}" + (
            f" / {row['bfloat16_peak_gflops']:.0f}"
            if "bfloat16_peak_gflops" in row
            else ""
        )
        print(
            f"| {row['length']} | {row['policy']} | {row['path']} "
            f"| {row['peak_bytes'] / 2**20:.0f} | {row['seconds'] * 1e3:.1f} "
            f"| {row['gflops']:.1f} | {row['share']:.1%} | {bf16_share} | {peaks} "
            f"| {ratio(explicit, 'seconds')} | {ratio(keras_row, 'seconds')} "
            f"| {ratio(keras_row, 'peak_bytes')} | {row['max_difference']:.1e} |"
        )


if __name__ == "__main__":
    main()
