"""ALiBi as a component of `dot_product_attention`, on every path.

The reference is NumPy in float64: `softmax(q·kᵀ·scale + slope[n]·(j - (i +
offset)))` over the keys the masks leave, zero rows where none is left, with
the key/value heads repeated for grouped-query attention. Every path is
compared with it: the explicit path (its weights included), the
memory-efficient path (through `dot_product_attention` and directly, with
block sizes that leave partial blocks), the by-length branch of a
`tf.function` traced with unknown lengths; and the fused path is never taken
with ALiBi. Gradients: the memory-efficient path's custom backward pass
against the explicit path's automatic one.

The query's term `-slope·(i + offset)` is constant along a row, which the
softmax ignores: what the weights test is the key term `slope·j` in each
head, masked and offset consistently with the masks.
"""

import keras
import numpy as np
import pytest
from keras import ops

import keras_attn.ops.attention as attention_module
import keras_attn.ops.attention_paths as attention_paths_module
from keras_attn.layers.alibi_bias import alibi_bias as layer_alibi_bias
from keras_attn.layers.alibi_bias import alibi_slopes
from keras_attn.ops import (
    attention_path,
    dot_product_attention,
    memory_efficient_attention,
)
from keras_attn.ops.alibi import alibi_bias
from tests.test_case import outputs_and_gradients, to_numpy

B, TQ, TK, N, H, HV = 2, 11, 13, 4, 4, 3
RNG = np.random.default_rng(31)
Q = RNG.normal(size=(B, TQ, N, H)).astype("float32")
K = RNG.normal(size=(B, TK, N, H)).astype("float32")
V = RNG.normal(size=(B, TK, N, HV)).astype("float32")
COTANGENT = RNG.normal(size=(B, TQ, N, HV)).astype("float32")
# Steeper slopes than the default's (1/4 to 1/256 for 4 heads), so that the
# bias moves the weights well beyond the tolerances.
SLOPES = np.asarray(to_numpy(alibi_slopes(N, alibi_bias_max=3)))
KEY_PADDING = np.ones((B, TK), bool)
KEY_PADDING[0, 10:] = False  # right padding, in the last key block
KEY_PADDING[1, :3] = False  # left padding
QUERY_PADDING = np.ones((B, TQ), bool)
QUERY_PADDING[1, 8:] = False
EXPLICIT_MASK = RNG.random((B, 1, TQ, TK)) > 0.25
EXPLICIT_MASK[0, 0, 4] = False  # a row with no key at all

# `dot_product_attention` arguments, with the offset as given ("tensor": a
# scalar int32 tensor of 2).
CASES = {
    "none": {},
    "causal": {"is_causal": True},
    "causal_offset": {"is_causal": True, "causal_offset": 2},
    "causal_tensor_offset": {"is_causal": True, "causal_offset": "tensor"},
    "negative_offset": {"is_causal": True, "causal_offset": -3},
    "offset_alone": {"causal_offset": 5},
    "padding": {"key_padding_mask": KEY_PADDING, "query_padding_mask": QUERY_PADDING},
    "sliding_window": {"sliding_window": 3, "causal_offset": 1},
    "everything": {
        "mask": EXPLICIT_MASK,
        "key_padding_mask": KEY_PADDING,
        "query_padding_mask": QUERY_PADDING,
        "is_causal": True,
        "causal_offset": 2,
        "sliding_window": 4,
    },
}

# `memory_efficient_attention` block sizes: partial query and key blocks,
# all the keys at once, blocks larger than the lengths.
LAYOUTS = {
    "q4_k3": {"query_block_size": 4, "key_block_size": 3},
    "q3_k5": {"query_block_size": 3, "key_block_size": 5},
    "q4_all_keys": {"query_block_size": 4, "key_block_size": None},
    "one_block": {"query_block_size": 64, "key_block_size": 64},
    "defaults": {},
}

JIT = keras.backend.backend() == "jax"


def offset_of(case):
    offset = case.get("causal_offset", 0)
    return 2 if isinstance(offset, str) else offset


def arguments_of(case):
    arguments = dict(case)
    if isinstance(arguments.get("causal_offset"), str):
        arguments["causal_offset"] = ops.convert_to_tensor(2, "int32")
    return arguments


def numpy_mask(case, query_length=TQ, key_length=TK):
    """The combined mask `(B, 1, Tq, Tk)` of a case, in NumPy."""
    mask = np.ones((B, 1, query_length, key_length), bool)
    query_positions = np.arange(query_length)[:, None] + offset_of(case)
    key_positions = np.arange(key_length)[None, :]
    if "mask" in case:
        mask &= case["mask"][..., :query_length, :key_length]
    if "key_padding_mask" in case:
        mask &= case["key_padding_mask"][:, None, None, :key_length]
    if "query_padding_mask" in case:
        mask &= case["query_padding_mask"][:, None, :query_length, None]
    if case.get("is_causal"):
        mask &= key_positions <= query_positions
    if "sliding_window" in case:
        mask &= np.abs(query_positions - key_positions) < case["sliding_window"]
    return mask


def numpy_alibi_attention(q, k, v, slopes, mask, offset=0, scale=None):
    """`(outputs (B, Tq, N, Hv), weights (B, N, Tq, Tk))` in float64."""
    q, k, v = (np.asarray(x, "float64") for x in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    logits = np.einsum("bqnh,bknh->bnqk", q, k) * scale
    query_positions = np.arange(q.shape[1]) + offset
    key_positions = np.arange(k.shape[1])
    distance = key_positions[None, :] - query_positions[:, None]  # (Tq, Tk)
    logits = logits + np.asarray(slopes, "float64")[None, :, None, None] * distance
    logits = np.where(mask, logits, -np.inf)
    with np.errstate(invalid="ignore"):
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        weights = weights / weights.sum(-1, keepdims=True)
    weights = np.nan_to_num(weights)  # rows with no key: all zero
    return np.einsum("bnqk,bknh->bqnh", weights, v), weights


def expected(case, q=Q, k=K, v=V, slopes=SLOPES):
    return numpy_alibi_attention(
        q, k, v, slopes, numpy_mask(case, q.shape[1], k.shape[1]), offset_of(case)
    )


def test_the_bias_matters():
    """The control: the reference without the bias is far from the one with
    it, so the comparisons below see a missing or misplaced bias."""
    with_bias, _ = expected(CASES["causal"])
    without, _ = expected(CASES["causal"], slopes=np.zeros(N))
    assert np.abs(with_bias - without).max() > 0.1


def test_the_ops_bias_is_the_layers_bias():
    keys = ops.arange(3, 9, dtype="int32")
    queries = ops.arange(2, 7, dtype="int32")
    slopes = alibi_slopes(N)
    np.testing.assert_array_equal(
        to_numpy(alibi_bias(slopes, keys, queries)),
        to_numpy(layer_alibi_bias(slopes, keys, queries)),
    )


# -- every path equals NumPy -------------------------------------------------------


@pytest.mark.parametrize("key_heads", [N, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("case", list(CASES))
def test_explicit_path_and_its_weights(case, key_heads):
    k, v = K[:, :, :key_heads], V[:, :, :key_heads]
    outputs, weights = dot_product_attention(
        Q,
        k,
        v,
        flash_attention=False,
        return_weights=True,
        alibi_slopes=SLOPES,
        **arguments_of(CASES[case]),
    )
    want_outputs, want_weights = expected(CASES[case], k=k, v=v)
    np.testing.assert_allclose(to_numpy(outputs), want_outputs, atol=1e-5)
    np.testing.assert_allclose(to_numpy(weights), want_weights, atol=1e-6)


@pytest.mark.parametrize("key_heads", [N, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("case", list(CASES))
def test_memory_efficient_path(case, key_heads):
    k, v = K[:, :, :key_heads], V[:, :, :key_heads]
    outputs = dot_product_attention(
        Q, k, v, flash_attention=True, alibi_slopes=SLOPES, **arguments_of(CASES[case])
    )
    want, _ = expected(CASES[case], k=k, v=v)
    np.testing.assert_allclose(to_numpy(outputs), want, atol=1e-5)


def memory_efficient_arguments(case):
    """`dot_product_attention`'s arguments of a case as
    `memory_efficient_attention` names them."""
    arguments = arguments_of(case)
    renamed = {"mask": "attention_mask", "is_causal": "causal"}
    return {renamed.get(name, name): value for name, value in arguments.items()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", list(CASES))
def test_memory_efficient_attention_in_blocks(case, layout):
    outputs = memory_efficient_attention(
        Q,
        K,
        V,
        alibi_slopes=SLOPES,
        **memory_efficient_arguments(CASES[case]),
        **LAYOUTS[layout],
    )
    want, _ = expected(CASES[case])
    np.testing.assert_allclose(to_numpy(outputs), want, atol=1e-5)


def test_default_slopes_and_a_scale():
    slopes = alibi_slopes(N)  # the paper's, a float32 tensor
    want, _ = numpy_alibi_attention(
        Q, K, V, to_numpy(slopes), numpy_mask(CASES["causal"]), scale=0.3
    )
    for flash_attention in (False, True):
        got = dot_product_attention(
            Q,
            K,
            V,
            scale=0.3,
            is_causal=True,
            flash_attention=flash_attention,
            alibi_slopes=slopes,
        )
        np.testing.assert_allclose(to_numpy(got), want, atol=1e-5)


# -- gradients: the custom backward pass equals automatic differentiation ------------


def assert_same_outputs_and_gradients(fn, reference, inputs, atol=1e-5):
    got = outputs_and_gradients(fn, inputs, COTANGENT, jit=JIT)
    want = outputs_and_gradients(reference, inputs, COTANGENT, jit=JIT)
    np.testing.assert_allclose(got[0], want[0], atol=atol)
    for got_grad, want_grad in zip(got[1], want[1], strict=True):
        assert got_grad.shape == want_grad.shape
        np.testing.assert_allclose(got_grad, want_grad, atol=atol)


@pytest.mark.parametrize("layout", ["q4_k3", "q3_k5", "q4_all_keys"])
@pytest.mark.parametrize(
    "case", ["none", "causal_offset", "padding", "sliding_window", "everything"]
)
def test_memory_efficient_gradients_equal_the_explicit_ones(case, layout):
    arguments = arguments_of(CASES[case])

    def efficient(q, k, v):
        return memory_efficient_attention(
            q,
            k,
            v,
            alibi_slopes=SLOPES,
            **memory_efficient_arguments(CASES[case]),
            **LAYOUTS[layout],
        )

    def explicit(q, k, v):
        return dot_product_attention(
            q, k, v, flash_attention=False, alibi_slopes=SLOPES, **arguments
        )

    assert_same_outputs_and_gradients(efficient, explicit, (Q, K, V))


@pytest.mark.parametrize("key_heads", [2, 1], ids=["gqa", "mqa"])
def test_grouped_gradients_equal_between_paths(key_heads):
    """Key/value gradients `(B, Tk, K, H)`, summed over each group, on both
    paths."""
    arguments = arguments_of(CASES["everything"])

    def path(flash_attention):
        def attend(q, k, v):
            return dot_product_attention(
                q,
                k,
                v,
                flash_attention=flash_attention,
                alibi_slopes=SLOPES,
                **arguments,
            )

        return attend

    inputs = (Q, K[:, :, :key_heads], V[:, :, :key_heads])
    assert_same_outputs_and_gradients(path(True), path(False), inputs)


def test_explicit_gradients_equal_finite_differences():
    """The explicit path's gradient (the reference above) against central
    differences of the NumPy reference, along a random direction."""
    case = CASES["everything"]
    _, grads = outputs_and_gradients(
        lambda q, k, v: dot_product_attention(
            q, k, v, flash_attention=False, alibi_slopes=SLOPES, **arguments_of(case)
        ),
        (Q, K, V),
        COTANGENT,
    )
    rng = np.random.default_rng(5)
    for index, x in enumerate((Q, K, V)):
        direction = rng.normal(size=x.shape)
        step = 1e-4

        def loss(shifted, index=index):
            inputs = [Q, K, V]
            inputs[index] = shifted
            outputs, _ = expected(case, *inputs)
            return np.sum(outputs * COTANGENT)

        numeric = (loss(x + step * direction) - loss(x - step * direction)) / (2 * step)
        np.testing.assert_allclose(
            np.sum(grads[index] * direction), numeric, rtol=1e-3, atol=1e-4
        )


# -- low precision -------------------------------------------------------------------


@pytest.mark.parametrize("slopes_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("flash_attention", [False, True])
def test_low_precision_inputs(dtype, slopes_dtype, flash_attention):
    """Half-precision heads with float32 or bfloat16 slopes: the bias is
    added in float32; the reference is float64 on the rounded inputs and
    slopes."""
    case = CASES["everything"]
    q, k, v = (ops.cast(x * 2.0, dtype) for x in (Q, K, V))
    slopes = ops.cast(SLOPES, slopes_dtype)
    got = dot_product_attention(
        q,
        k,
        v,
        flash_attention=flash_attention,
        alibi_slopes=slopes,
        **arguments_of(case),
    )
    assert keras.backend.standardize_dtype(got.dtype) == dtype
    rounded = [to_numpy(ops.cast(x, "float32")) for x in (q, k, v, slopes)]
    want, _ = expected(case, *rounded)
    got = to_numpy(ops.cast(got, "float32"))
    assert np.isfinite(got).all()
    tolerance = 5e-2 if dtype == "bfloat16" else 5e-3
    np.testing.assert_allclose(got, want, atol=2 * tolerance, rtol=tolerance)


def test_bfloat16_gradients_are_close_between_paths():
    case = CASES["everything"]
    inputs = tuple(ops.cast(x, "bfloat16") for x in (Q, K, V))

    def path(flash_attention):
        return lambda q, k, v: dot_product_attention(
            q,
            k,
            v,
            flash_attention=flash_attention,
            alibi_slopes=SLOPES,
            **arguments_of(case),
        )

    got = outputs_and_gradients(path(True), inputs, COTANGENT, jit=JIT)
    want = outputs_and_gradients(path(False), inputs, COTANGENT, jit=JIT)
    for g, w in zip([got[0], *got[1]], [want[0], *want[1]], strict=True):
        g, w = g.astype("float32"), w.astype("float32")
        np.testing.assert_allclose(g, w, atol=0.1, rtol=0.05)


# -- the path choice -----------------------------------------------------------------


def test_attention_path_never_fused_with_alibi():
    call = {"fused_kernel": True, "backend": "jax", "alibi": True}
    assert attention_path(None, **call, query_length=8, key_length=8) == "explicit"
    long = {"query_length": 4096, "key_length": 4096}
    assert attention_path(None, **call, **long) == "memory_efficient"
    assert attention_path(True, **call) == "memory_efficient"
    assert attention_path(None, fused_kernel=True, backend="jax") == "fused"


@pytest.mark.jax_only
def test_a_fused_kernel_does_not_take_an_alibi_call(monkeypatch):
    """Even where a fused kernel would run, `keras.ops.dot_product_attention`
    (which would need the whole (Tq, Tk) bias) is not called, and the result
    has the bias."""
    monkeypatch.setattr(attention_module, "fused_kernel_runs", lambda *a, **k: True)
    calls = []
    original = keras.ops.dot_product_attention

    def recording(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(keras.ops, "dot_product_attention", recording)
    case = CASES["causal"]
    values = K[..., ::-1]  # as wide as the keys, as JAX's fused kernel needs
    for flash_attention in (None, True):
        got = dot_product_attention(
            Q, K, values, flash_attention=flash_attention, alibi_slopes=SLOPES, **case
        )
        want, _ = expected(case, v=values)
        np.testing.assert_allclose(to_numpy(got), want, atol=1e-5)
    assert not calls
    # The control: without ALiBi the fused call is made.
    dot_product_attention(Q, K, values, is_causal=True)
    assert calls


@pytest.mark.tf_only
def test_by_length_branch_in_a_tf_function_with_unknown_lengths(monkeypatch):
    """Traced with `None` lengths, the path is decided when the graph runs:
    both branches get the slopes. The switch-over is lowered to 8 keys so
    that these lengths reach both branches."""
    import tensorflow as tf

    monkeypatch.setitem(attention_paths_module.SWITCH_OVER_KEY_LENGTH, "float32", 8)
    assert (
        attention_path(None, query_length=None, key_length=None, backend="tensorflow")
        == "by_length"
    )
    spec = tf.TensorSpec((B, None, N, H), "float32")
    slopes = tf.constant(SLOPES)

    @tf.function(
        input_signature=[
            spec,
            spec,
            spec,
            tf.TensorSpec((B, None), "bool"),
            tf.TensorSpec((), "int32"),
        ]
    )
    def attend_and_differentiate(q, k, v, key_padding, offset):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = dot_product_attention(
                q,
                k,
                v,
                key_padding_mask=key_padding,
                is_causal=True,
                causal_offset=offset,
                alibi_slopes=slopes,
            )
            loss = tf.reduce_sum(out * out)
        return out, tape.gradient(loss, [q, k, v])

    values = V[..., :1].repeat(H, axis=-1) + V[..., 1:2]  # Hv = H, varied
    for query_length, key_length, offset, branch in (
        (TQ, TK, 2, "memory_efficient"),
        (5, 6, 1, "explicit"),  # keys below the switch-over
        (1, TK, TK - 1, "explicit"),  # one query: a decoding step
    ):
        q, k = Q[:, :query_length], K[:, :key_length]
        v = values[:, :key_length]
        key_padding = KEY_PADDING[:, :key_length]
        got, got_grads = attend_and_differentiate(q, k, v, key_padding, offset)
        case = {"key_padding_mask": key_padding, "is_causal": True}
        case["causal_offset"] = offset
        want, _ = expected(case, q, k, v)
        np.testing.assert_allclose(to_numpy(got), want, atol=1e-5, err_msg=branch)

        def reference(q, k, v, case=case):
            return dot_product_attention(
                q, k, v, flash_attention=False, alibi_slopes=SLOPES, **case
            )

        _, want_grads = outputs_and_gradients(reference, (q, k, v), 2 * want)
        for g, w in zip(got_grads, want_grads, strict=True):
            np.testing.assert_allclose(to_numpy(g), w, atol=1e-5, err_msg=branch)


@pytest.mark.jax_only
def test_jax_jit_with_a_traced_offset_and_slopes():
    import jax

    @jax.jit
    def attend(q, k, v, slopes, offset):
        return (
            dot_product_attention(
                q,
                k,
                v,
                flash_attention=True,
                is_causal=True,
                causal_offset=offset,
                alibi_slopes=slopes,
            ),
            dot_product_attention(
                q,
                k,
                v,
                flash_attention=False,
                is_causal=True,
                causal_offset=offset,
                alibi_slopes=slopes,
            ),
        )

    efficient, explicit = attend(Q, K, V, SLOPES, 2)
    want, _ = expected(CASES["causal_offset"])
    np.testing.assert_allclose(np.asarray(efficient), want, atol=1e-5)
    np.testing.assert_allclose(np.asarray(explicit), want, atol=1e-5)


# -- arguments -----------------------------------------------------------------------


BAD_SLOPES = [
    (SLOPES[None], r"Received: alibi_slopes.shape=(1, 4)"),
    (np.float32(0.5), r"Received: alibi_slopes.shape=()"),
    (SLOPES[:2], r"Received: alibi_slopes.shape=(2,)"),
    (np.concatenate([SLOPES, SLOPES]), r"Received: alibi_slopes.shape=(8,)"),
    (np.arange(N, dtype="int32"), r"Received: alibi_slopes.dtype=int32"),
]


def escaped(message):
    return message.replace("(", r"\(").replace(")", r"\)")


@pytest.mark.parametrize("flash_attention", [False, True])
@pytest.mark.parametrize(("slopes", "message"), BAD_SLOPES)
def test_bad_slopes_raise_clear_errors(slopes, message, flash_attention):
    with pytest.raises(ValueError, match=r"`alibi_slopes`.*" + escaped(message)):
        dot_product_attention(
            Q, K, V, flash_attention=flash_attention, alibi_slopes=slopes
        )
    with pytest.raises(ValueError, match=r"`alibi_slopes`.*" + escaped(message)):
        memory_efficient_attention(Q, K, V, alibi_slopes=slopes)


def test_slopes_are_per_query_head_not_per_key_head():
    # Two key/value heads for four query heads: two slopes are refused.
    with pytest.raises(ValueError, match=r"shape \(4,\).*alibi_slopes.shape=\(2,\)"):
        dot_product_attention(Q, K[:, :, :2], V[:, :, :2], alibi_slopes=SLOPES[:2])


@pytest.mark.parametrize("layout", ["q4_k3", "q3_k5", "q4_all_keys"])
@pytest.mark.parametrize("key_heads", [2, 1], ids=["gqa", "mqa"])
def test_memory_efficient_attention_with_grouped_heads(key_heads, layout):
    """Keys and values of `K < N` heads given as they are: the slopes stay
    those of the `N` query heads; outputs equal NumPy, and gradients the
    explicit path's."""
    case = CASES["everything"]
    inputs = (Q, K[:, :, :key_heads], V[:, :, :key_heads])

    def efficient(q, k, v):
        return memory_efficient_attention(
            q,
            k,
            v,
            alibi_slopes=SLOPES,
            **memory_efficient_arguments(case),
            **LAYOUTS[layout],
        )

    def explicit(q, k, v):
        return dot_product_attention(
            q, k, v, flash_attention=False, alibi_slopes=SLOPES, **arguments_of(case)
        )

    want, _ = expected(case, *inputs)
    np.testing.assert_allclose(to_numpy(efficient(*inputs)), want, atol=1e-5)
    assert_same_outputs_and_gradients(efficient, explicit, inputs)
