"""Property tests: `keras_attn.ops` attention against a float64 NumPy reference.

Every path of `dot_product_attention` (explicit, memory-efficient, and on
JAX the fused `keras.ops.dot_product_attention`, forced by pretending a fused
kernel runs), and `memory_efficient_attention` called directly with small
block sizes, are compared with a float64 NumPy softmax attention, outputs and
gradients (an analytic float64 backward pass). Drawn: batch, lengths (mostly
short, some up to 300; block sizes drawn so that lengths fall on either side
of block boundaries), head sizes, query and key/value heads (grouped-query
attention), every mask form (explicit masks of rank 2 to 4, key and query
padding, with fully masked rows and sequences), causal masks with offsets
(negative, past the keys, as a tensor), `sliding_window`, ALiBi slopes, the
scale, and float32 / bfloat16 / float16 inputs.

Documented behaviour compared as documented: a query row with no key to
attend to gets a zero output (and zero gradients). Low-precision inputs are
compared with the reference of the rounded inputs, within bounds a few times
the errors measured (see `TOLERANCES`).
"""

from __future__ import annotations

import contextlib
from unittest import mock

import keras
import ml_dtypes
import numpy as np
from hypothesis import assume, example, given
from hypothesis import strategies as st
from keras import ops

import keras_attn.ops.attention as attention_module
from keras_attn.layers.alibi_bias import alibi_slopes
from keras_attn.ops import dot_product_attention, memory_efficient_attention
from tests.property_settings import property_settings
from tests.test_case import outputs_and_gradients, to_numpy

BACKEND = keras.backend.backend()
# JAX compiles every new shape (op by op when eager): compiling the whole
# computation once per example is quicker.
JIT = BACKEND == "jax"
# A new shape costs JAX a compilation (about a second of CPU here, the
# memory-efficient loops more) and TensorFlow, eager, nothing: JAX draws
# fewer examples of each test (`count`).


def count(tensorflow: int, jax: int) -> int:
    """The default run's number of examples on this backend."""
    return tensorflow if BACKEND == "tensorflow" else jax


# The fused path: Keras's dot_product_attention, simulated on JAX (below),
# PyTorch's scaled_dot_product_attention on PyTorch (its CPU flash kernel
# where the masks allow, tests/ops/test_torch_cpu_kernel.py).
PATHS = ["explicit", "memory_efficient"] + (
    ["fused"] if BACKEND in ("jax", "torch") else []
)
DTYPES = ["float32", "float32", "float32", "bfloat16", "float16"]
# The fused path is simulated off the GPU (`forced`): XLA's CPU attention
# computes the call, and its CPU matrix product has no float16 x float16 ->
# float32 form ("The precision 'F16_F16_F32' is not supported by dot_general
# on CPU") and no bfloat16 one where every axis but the features is 1
# ("Algorithm not supported by the ElementalIrEmitter: ALG_DOT_BF16_BF16_F32",
# jaxlib 0.10). On a GPU, where the fused path runs, benchmarks/gpu_check.py
# checks it in float16 and bfloat16.
FUSED_DTYPES = ["float32", "float32", "bfloat16"]
NUMPY_DTYPES = {
    "float32": np.float32,
    "bfloat16": ml_dtypes.bfloat16,
    "float16": np.float16,
}

# Bounds on `max |got - want| / max(max |want|, 1)` per tensor, outputs and
# gradients: `FACTOR[dtype] * eps * (1 + logit_range)`, `logit_range` the
# spread of the logits the masks leave (the softmax's sensitivity to their
# rounding grows with it). float32: the logits' and softmax's round-off.
# Low precision: the reference takes the rounded inputs, so what is left is
# the rounding of the outputs, of the weights cast to the values' dtype and
# (bfloat16 on the explicit path) of the logits. Measured over about 900
# examples on TensorFlow and 230 on JAX (both tests, every path), the largest
# `error / (eps * (1 + logit_range))` was 7.9 (float32, a key gradient),
# 0.78 (bfloat16) and 0.37 (float16): the factors are about four times those.
EPS = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}
FACTOR = {"float32": 32.0, "bfloat16": 3.0, "float16": 1.5}


def tolerance(dtype, logit_range):
    """The bound for outputs and gradients (see above)."""
    return FACTOR[dtype] * EPS[dtype] * (1.0 + logit_range)


def round_to(x, dtype):
    """`x` rounded to `dtype` and back to float64."""
    return np.asarray(x).astype(NUMPY_DTYPES[dtype]).astype(np.float64)


# -- the reference ----------------------------------------------------------------


def reference_attention(q, k, v, mask, scale, bias, upstream):
    """float64 attention and its gradients.

    `q` `(B, Tq, N, H)`, `k` `(B, Tk, K, H)`, `v` `(B, Tk, K, Hv)`; `mask`
    bool `(B, N, Tq, Tk)` (True: attend); `bias` `(N, Tq, Tk)` or None;
    `upstream` `(B, Tq, N, Hv)`, the gradient of the outputs.

    Returns `(outputs, (d_q, d_k, d_v), logit_range, rows, scales)`:
    `rows` `(B, N, Tq)`, whether a row has a key (the others get zero outputs
    and gradients); `scales`, the size of each gradient's intermediates
    (`dS = P (dP - rowsum(dP P))` cancels: a row of one key has `dS = 0`, up
    to the round-off of `dP`), the floor of its error's normaliser.
    """
    groups = q.shape[2] // k.shape[2]
    k_rep = np.repeat(k, groups, axis=2)  # query head n uses key head n // G
    v_rep = np.repeat(v, groups, axis=2)
    logits = np.einsum("bqnh,bknh->bnqk", q, k_rep) * scale
    if bias is not None:
        logits = logits + bias[None]
    rows = mask.any(-1)  # (B, N, Tq)
    masked = np.where(mask, logits, -np.inf)
    top = np.where(rows, masked.max(-1), 0.0)[..., None]
    weights = np.where(mask, np.exp(np.where(mask, logits, 0.0) - top), 0.0)
    total = weights.sum(-1, keepdims=True)
    weights = weights / np.where(total > 0, total, 1.0)  # zero rows stay zero
    outputs = np.einsum("bnqk,bknh->bqnh", weights, v_rep)
    # Backward: dP = dO Vᵀ, dS = P (dP - rowsum(dP P)), dQ = dS K scale, ...
    d_weights = np.einsum("bqnh,bknh->bnqk", upstream, v_rep)
    d_logits = weights * (d_weights - (d_weights * weights).sum(-1, keepdims=True))
    d_q = np.einsum("bnqk,bknh->bqnh", d_logits, k_rep) * scale
    d_k_rep = np.einsum("bnqk,bqnh->bknh", d_logits, q) * scale
    d_v_rep = np.einsum("bnqk,bqnh->bknh", weights, upstream)

    def group_sum(x):  # (B, Tk, N, D) -> (B, Tk, K, D)
        b, t, n, d = x.shape
        return x.reshape(b, t, n // groups, groups, d).sum(3)

    valid_logits = logits[np.broadcast_to(mask, logits.shape)]
    logit_range = float(np.ptp(valid_logits)) if valid_logits.size else 0.0
    d_weights_size = np.max(np.abs(d_weights), initial=0.0)
    scales = (
        d_weights_size * np.max(np.abs(k), initial=0.0) * scale,
        d_weights_size * np.max(np.abs(q), initial=0.0) * scale,
        np.max(np.abs(upstream), initial=0.0),
    )
    gradients = (d_q, group_sum(d_k_rep), group_sum(d_v_rep))
    return outputs, gradients, logit_range, rows, scales


def assert_close(name, got, want, bound, floor=1.0):
    """`max |got - want| / max(max |want|, floor, 1) <= bound`, all finite."""
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert np.isfinite(got).all(), f"{name}: non-finite values"
    error = np.max(np.abs(got - want), initial=0.0) / max(
        np.max(np.abs(want), initial=0.0), floor, 1.0
    )
    assert error <= bound, f"{name}: error {error:.3g} > {bound:.3g}"
    return error


# -- drawing --------------------------------------------------------------------


def lengths(max_long=300):
    """Mostly 1-64, sometimes up to `max_long`."""
    return st.one_of(st.integers(1, 16), st.integers(1, 64), st.integers(65, max_long))


@st.composite
def shapes(draw, max_long=300):
    heads = draw(st.sampled_from([1, 2, 3, 4]))
    key_heads = draw(st.sampled_from([n for n in (1, 2, 3, 4) if heads % n == 0]))
    head_dim = draw(st.one_of(st.sampled_from([1, 2, 8, 16, 32]), st.integers(1, 32)))
    value_dim = draw(st.one_of(st.just(head_dim), st.integers(1, 32)))
    query_length = draw(lengths(max_long))
    key_length = draw(st.one_of(st.just(query_length), lengths(max_long)))
    batch = draw(st.integers(1, 3))
    if query_length * key_length > 64 * 64:  # long: keep the tensors small
        batch, head_dim, value_dim = 1, min(head_dim, 8), min(value_dim, 8)
    return batch, query_length, key_length, heads, key_heads, head_dim, value_dim


@st.composite
def mask_components(draw, batch, query_length, key_length, heads):
    """Keyword arguments of the mask components (for `dot_product_attention`;
    the explicit mask in its NumPy broadcasting form), drawn with a seed."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    arguments = {}
    form = draw(
        st.sampled_from(
            ["none", "none", "2d", "3d", "4d", "4d_heads", "4d_keys", "4d_queries"]
        )
    )
    density = draw(st.sampled_from([0.2, 0.6, 0.95]))

    def random_mask(shape):
        mask = rng.random(shape) < density
        if draw(st.booleans()):  # some rows with no key at all
            rows = rng.random(shape[:-1]) < 0.3
            mask[rows] = False
        return mask

    shape = {
        "2d": (query_length, key_length),
        "3d": (heads, query_length, key_length),  # (N|1, Tq, Tk): NumPy's rule
        "4d": (batch, heads, query_length, key_length),
        "4d_heads": (1, heads, query_length, key_length),
        "4d_keys": (batch, 1, 1, key_length),
        "4d_queries": (batch, 1, query_length, 1),
    }.get(form)
    if shape is not None:
        arguments["mask"] = random_mask(shape)
    if draw(st.booleans()):
        padding = np.ones((batch, key_length), bool)
        for b in range(batch):
            kind = draw(st.sampled_from(["right", "left", "random", "none", "all"]))
            valid = int(rng.integers(0, key_length + 1))
            if kind == "right":
                padding[b, valid:] = False
            elif kind == "left":
                padding[b, : key_length - valid] = False
            elif kind == "random":
                padding[b] = rng.random(key_length) < 0.7
            elif kind == "all":
                padding[b] = False  # a sequence with no key
        arguments["key_padding_mask"] = padding
    if draw(st.integers(0, 3)) == 0:
        arguments["query_padding_mask"] = rng.random((batch, query_length)) < 0.8
    if draw(st.booleans()):
        arguments["is_causal"] = True
    offset_kind = draw(st.sampled_from(["zero", "zero", "drawn", "tensor"]))
    if offset_kind != "zero":
        offset = draw(st.integers(-4, key_length + 2))
        arguments["causal_offset"] = (
            offset if offset_kind == "drawn" else ops.convert_to_tensor(offset, "int32")
        )
    if draw(st.integers(0, 2)) == 0:
        arguments["sliding_window"] = draw(st.integers(1, key_length + 2))
    return arguments


def combined_mask(arguments, batch, heads, query_length, key_length):
    """The AND of the components as `(B, N, Tq, Tk)` bool."""
    mask = np.ones((batch, heads, query_length, key_length), bool)
    if "mask" in arguments:
        mask &= np.broadcast_to(arguments["mask"], mask.shape)
    if "key_padding_mask" in arguments:
        mask &= arguments["key_padding_mask"][:, None, None, :]
    if "query_padding_mask" in arguments:
        mask &= arguments["query_padding_mask"][:, None, :, None]
    offset = int(to_numpy(arguments.get("causal_offset", 0)))
    distance = np.arange(query_length)[:, None] + offset - np.arange(key_length)
    if arguments.get("is_causal"):
        mask &= distance >= 0
    if arguments.get("sliding_window") is not None:
        mask &= np.abs(distance) < arguments["sliding_window"]
    return mask


def alibi(heads, draw_slopes, arguments, query_length, key_length):
    """`(slopes (N,) float32, bias (N, Tq, Tk) float64)` or `(None, None)`."""
    if draw_slopes is None:
        return None, None
    slopes = np.asarray(to_numpy(alibi_slopes(heads, draw_slopes)), np.float32)
    offset = int(to_numpy(arguments.get("causal_offset", 0)))
    distance = np.arange(key_length)[None, :] - (
        np.arange(query_length)[:, None] + offset
    )
    return slopes, slopes.astype(np.float64)[:, None, None] * distance[None]


@contextlib.contextmanager
def forced(path):
    """`flash_attention` for `path`; the fused path by pretending that a fused
    kernel runs the call (on a CPU none does: XLA's attention computes it)."""
    if path == "fused":
        with mock.patch.object(
            attention_module, "fused_kernel_runs", lambda *a, **k: True
        ):
            yield None
    else:
        yield path == "memory_efficient"


def draw_inputs(seed, shape, dtype, magnitude):
    """float32 `q, k, v, upstream` (rounded to `dtype`) from `seed`."""
    batch, query_length, key_length, heads, key_heads, head_dim, value_dim = shape
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, query_length, heads, head_dim)) * magnitude
    k = rng.normal(size=(batch, key_length, key_heads, head_dim)) * magnitude
    v = rng.normal(size=(batch, key_length, key_heads, value_dim))
    upstream = rng.normal(size=(batch, query_length, heads, value_dim))
    return [round_to(x, dtype).astype(np.float32) for x in (q, k, v, upstream)]


def check_against_reference(fn, inputs, mask, scale, bias, dtype):
    """Run `fn` (float32 inputs, cast inside) for outputs and gradients and
    compare them with the reference; zero rows compared exactly."""
    q, k, v, upstream = inputs
    got, grads = outputs_and_gradients(fn, (q, k, v), upstream, jit=JIT)
    reference_upstream = round_to(upstream, dtype)  # the gradient's dtype
    want, want_grads, logit_range, rows, scales = reference_attention(
        *(x.astype(np.float64) for x in (q, k, v)),
        mask,
        scale,
        bias,
        reference_upstream,
    )
    bound = tolerance(dtype, logit_range)
    assert_close("outputs", got, want, bound)
    empty = ~np.transpose(rows, (0, 2, 1))  # (B, Tq, N)
    assert np.all(np.asarray(got)[empty] == 0.0), "fully masked rows must be zeros"
    for name, g, w, floor in zip(
        ("d_query", "d_key", "d_value"), grads, want_grads, scales, strict=True
    ):
        assert_close(name, g, w, bound, floor)
    assert np.all(np.asarray(grads[0])[empty] == 0.0), "zero rows' query gradient"


def cast_fn(fn, dtype):
    def cast_and_call(q, k, v):
        return fn(ops.cast(q, dtype), ops.cast(k, dtype), ops.cast(v, dtype))

    return cast_and_call


# -- dot_product_attention on every path -------------------------------------------


@st.composite
def attention_cases(draw):
    shape = draw(shapes())
    batch, query_length, key_length, heads = shape[:4]
    arguments = draw(mask_components(batch, query_length, key_length, heads))
    path = draw(st.sampled_from(PATHS))
    simulated = path == "fused" and BACKEND == "jax"
    dtype = draw(st.sampled_from(FUSED_DTYPES if simulated else DTYPES))
    assume(
        not (
            simulated
            and dtype == "bfloat16"
            and batch == query_length == key_length == heads == 1
        )
    )
    return dict(
        shape=shape,
        arguments=arguments,
        path=path,
        dtype=dtype,
        alibi_bias_max=draw(st.sampled_from([None, None, 8, 2])),
        scale=draw(st.sampled_from([None, None, 0.5, 1.0, 0.05])),
        magnitude=draw(st.sampled_from([1.0, 1.0, 3.0])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def mask_broadcast_along_a_sequence_axis(form, path="memory_efficient"):
    """A case whose explicit mask has a sequence axis of size 1: the
    memory-efficient path refused `(B, 1, 1, Tk)` and `(B, 1, Tq, 1)` masks
    (and `(B, N, 1, Tk)`), which `dot_product_attention` documents as
    broadcasting; fixed in `_whole_sequence_axes`."""
    batch, query_length, key_length, heads = 2, 5, 7, 2
    rng = np.random.default_rng(3)
    shape = {
        "keys": (batch, 1, 1, key_length),
        "queries": (batch, 1, query_length, 1),
        "heads_keys": (batch, heads, 1, key_length),
    }[form]
    mask = rng.random(shape) < 0.6
    mask[0] = False  # a sequence with nothing to attend to
    return dict(
        shape=(batch, query_length, key_length, heads, 1, 4, 3),
        arguments={"mask": mask, "is_causal": True, "causal_offset": 2},
        path=path,
        dtype="float32",
        alibi_bias_max=None,
        scale=None,
        magnitude=1.0,
        seed=0,
    )


@given(case=attention_cases())
@example(case=mask_broadcast_along_a_sequence_axis("keys"))
@example(case=mask_broadcast_along_a_sequence_axis("queries"))
@example(case=mask_broadcast_along_a_sequence_axis("heads_keys"))
@example(  # one key per row: dS = P (dP - rowsum(dP P)) is round-off alone
    case=dict(
        shape=(1, 14, 14, 1, 1, 19, 19),
        arguments={"sliding_window": 1},
        path="memory_efficient",
        dtype="float32",
        alibi_bias_max=None,
        scale=None,
        magnitude=3.0,
        seed=54675,
    )
)
@property_settings(count(300, 30))
def test_dot_product_attention_equals_the_float64_reference(case):
    shape, arguments, dtype = case["shape"], case["arguments"], case["dtype"]
    batch, query_length, key_length, heads, _, head_dim, _ = shape
    inputs = draw_inputs(case["seed"], shape, dtype, case["magnitude"])
    mask = combined_mask(arguments, batch, heads, query_length, key_length)
    slopes, bias = alibi(
        heads, case["alibi_bias_max"], arguments, query_length, key_length
    )
    scale = case["scale"]
    with forced(case["path"]) as flash_attention:

        def attend(q, k, v):
            return dot_product_attention(
                q,
                k,
                v,
                scale=scale,
                flash_attention=flash_attention,
                alibi_slopes=slopes,
                **arguments,
            )

        check_against_reference(
            cast_fn(attend, dtype),
            inputs,
            mask,
            1.0 / np.sqrt(head_dim) if scale is None else scale,
            bias,
            dtype,
        )


# -- memory_efficient_attention's blocks --------------------------------------------


@st.composite
def block_cases(draw):
    query_block = draw(st.integers(1, 24))
    key_block = draw(st.one_of(st.none(), st.integers(1, 24)))
    shape = list(draw(shapes(max_long=160)))
    # At most 4 blocks a side (eager loops run block by block); lengths at
    # a block boundary or one off, or anywhere below 4 blocks.
    for axis, block in ((1, query_block), (2, key_block or 24)):
        if draw(st.booleans()):
            shape[axis] = draw(st.integers(1, 4)) * block + draw(st.integers(-1, 1))
        shape[axis] = max(1, min(shape[axis], 4 * block))
    batch, query_length, key_length, heads = shape[:4]
    arguments = draw(mask_components(batch, query_length, key_length, heads))
    return dict(
        shape=tuple(shape),
        arguments=arguments,
        blocks=(query_block, key_block),
        dtype=draw(st.sampled_from(DTYPES)),
        alibi_bias_max=draw(st.sampled_from([None, None, 8, 2])),
        magnitude=draw(st.sampled_from([1.0, 1.0, 3.0])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def memory_efficient_arguments(arguments, query_shape, key_length):
    """`dot_product_attention`'s mask arguments as `memory_efficient_attention`
    takes them (its rank-3 mask is `(B|1, Tq, Tk)`: a rank-3 NumPy-rule mask
    `(N|1, Tq, Tk)` goes as rank 4)."""
    arguments = dict(arguments)
    if "mask" in arguments:
        mask = arguments.pop("mask")
        mask = mask[None] if mask.ndim == 3 else mask
        if mask.ndim == 4:  # its sequence axes whole, as the blocks read them
            query_length = query_shape[1]
            mask = np.broadcast_to(mask, (*mask.shape[:2], query_length, key_length))
        arguments["attention_mask"] = mask
    if "is_causal" in arguments:
        arguments["causal"] = arguments.pop("is_causal")
    return arguments


@given(case=block_cases())
@property_settings(count(150, 12))
def test_memory_efficient_blocks_equal_the_float64_reference(case):
    shape, arguments, dtype = case["shape"], case["arguments"], case["dtype"]
    batch, query_length, key_length, heads, _, head_dim, _ = shape
    inputs = draw_inputs(case["seed"], shape, dtype, case["magnitude"])
    mask = combined_mask(arguments, batch, heads, query_length, key_length)
    slopes, bias = alibi(
        heads, case["alibi_bias_max"], arguments, query_length, key_length
    )
    query_block, key_block = case["blocks"]

    def attend(q, k, v):
        return memory_efficient_attention(
            q,
            k,
            v,
            alibi_slopes=slopes,
            query_block_size=query_block,
            key_block_size=key_block,
            **memory_efficient_arguments(arguments, shape[:2], key_length),
        )

    check_against_reference(
        cast_fn(attend, dtype), inputs, mask, 1.0 / np.sqrt(head_dim), bias, dtype
    )
