"""`memory_efficient_attention` equals the explicit path, outputs and gradients.

The reference is `keras_attn.ops.dot_product_attention(..., return_weights=True)`
(the explicit path on every backend) with the combined `(B, N|1, Tq, Tk)` mask.
Lengths are not multiples of the block sizes, and Tq != Tk.
"""

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
from keras import ops

from keras_attn.ops import (
    blocked_attention,
    causal_mask,
    dot_product_attention,
    sliding_window_mask,
)
from keras_attn.ops import memory_efficient_attention as attention
from keras_attn.ops.softmax import masked_softmax
from tests.test_case import outputs_and_gradients, to_numpy

B, TQ, TK, N, H, HV = 2, 11, 13, 2, 4, 3
RNG = np.random.default_rng(7)
Q = RNG.normal(size=(B, TQ, N, H)).astype("float32")
K = RNG.normal(size=(B, TK, N, H)).astype("float32")
V = RNG.normal(size=(B, TK, N, HV)).astype("float32")
COTANGENT = RNG.normal(size=(B, TQ, N, HV)).astype("float32")
KEY_PADDING = np.ones((B, TK), bool)
KEY_PADDING[0, 9:] = False  # padded keys, in the last key block
KEY_PADDING[1, :4] = False  # left padding
QUERY_PADDING = np.ones((B, TQ), bool)
QUERY_PADDING[1, 7:] = False
EXPLICIT = RNG.random((B, TQ, TK)) > 0.3
EXPLICIT_PER_HEAD = RNG.random((1, N, TQ, TK)) > 0.4
OFFSET = 2  # the first query is key position 2, as in cached decoding
WINDOW = 3  # keys within 2 positions of the query's (spans one or two key blocks)

LAYOUTS = {
    "key_blocks": {"query_block_size": 4, "key_block_size": 3},
    "all_keys": {"query_block_size": 4, "key_block_size": None},
    # All the keys in the forward pass, the backward pass's own key blocks
    # (see `backward_blocks`): another layout than the forward's.
    "all_keys_backward_blocks": {"key_block_size": None},
    "defaults": {},
}


@pytest.fixture
def backward_blocks(monkeypatch):
    """The backward pass of the one-block layout in key blocks of 5 and
    query blocks of 3 (13 keys: 3 blocks, the last padded; 11 queries: 4),
    where the forward pass takes its default query blocks (all 11)."""
    monkeypatch.setattr(blocked_attention, "BACKWARD_KEY_BLOCK_SIZE", 5)
    monkeypatch.setattr(blocked_attention, "BACKWARD_QUERY_BLOCK_SIZE", 3)


def mask_case(kind):
    """`(kwargs of memory_efficient_attention, combined mask (B, N|1, Tq, Tk))`."""
    full = np.ones((B, 1, TQ, TK), bool)
    kwargs = {}
    if kind in ("key_padding", "combined"):
        kwargs["key_padding_mask"] = KEY_PADDING
        full &= KEY_PADDING[:, None, None, :]
    if kind in ("query_padding", "combined"):
        kwargs["query_padding_mask"] = QUERY_PADDING
        full &= QUERY_PADDING[:, None, :, None]
    if kind in ("explicit", "combined", "fully_masked_rows"):
        explicit = EXPLICIT.copy()
        if kind == "fully_masked_rows":
            explicit[0, 3] = False  # a query row with no key at all
            explicit[1, :, :] = False  # and a whole sequence
        kwargs["attention_mask"] = explicit
        full &= explicit[:, None]
    if kind == "explicit_per_head":
        kwargs["attention_mask"] = EXPLICIT_PER_HEAD
        full = full & EXPLICIT_PER_HEAD
    if kind in ("causal", "combined"):
        kwargs["causal"] = True
        full &= np.asarray(to_numpy(causal_mask(TQ, TK)))[None, None]
    if kind == "causal_offset":
        kwargs.update(causal=True, causal_offset=OFFSET)
        full &= np.asarray(to_numpy(causal_mask(TQ, TK, OFFSET)))[None, None]
    if kind == "negative_offset":  # the first rows see no key
        kwargs.update(causal=True, causal_offset=-3)
        full &= np.asarray(to_numpy(causal_mask(TQ, TK, -3)))[None, None]
    if kind in ("sliding_window", "causal_sliding_window"):
        offset = OFFSET if kind == "causal_sliding_window" else 0
        kwargs.update(sliding_window=WINDOW, causal_offset=offset)
        band = sliding_window_mask(TQ, TK, WINDOW, offset)
        full &= np.asarray(to_numpy(band))[None, None]
        if kind == "causal_sliding_window":
            kwargs["causal"] = True
            full &= np.asarray(to_numpy(causal_mask(TQ, TK, offset)))[None, None]
            kwargs["key_padding_mask"] = KEY_PADDING  # rows with no key left
            full &= KEY_PADDING[:, None, None, :]
    return kwargs, full


def explicit(q, k, v, mask):
    return dot_product_attention(q, k, v, mask=mask, return_weights=True)[0]


# JAX compiles the block loops either way; compiling the whole computation
# once is quicker than running it op by op.
JIT = keras.backend.backend() == "jax"


def assert_same_outputs_and_gradients(fn, reference, inputs=(Q, K, V), atol=1e-5):
    """`fn` and `reference` agree on `inputs`, outputs and gradients; returns
    `fn`'s `(outputs, gradients)`."""
    got = outputs_and_gradients(fn, inputs, COTANGENT, jit=JIT)
    want = outputs_and_gradients(reference, inputs, COTANGENT, jit=JIT)
    np.testing.assert_allclose(got[0], want[0], atol=atol)
    for got_grad, want_grad in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(got_grad, want_grad, atol=atol)
    return got


MASK_KINDS = [
    "none",
    "key_padding",
    "query_padding",
    "causal",
    "causal_offset",
    "negative_offset",
    "explicit",
    "explicit_per_head",
    "fully_masked_rows",
    "combined",
    "sliding_window",
    "causal_sliding_window",
]


# Every mask kind with key blocks; with all the keys in one block (the same
# mask code, another softmax and backward pass) the kinds that cover each
# mask component.
ALL_KEYS_KINDS = [
    "none",
    "causal_offset",
    "explicit_per_head",
    "fully_masked_rows",
    "combined",
    "causal_sliding_window",
]


@pytest.mark.parametrize(
    ("kind", "layout"),
    [(kind, "key_blocks") for kind in MASK_KINDS]
    + [(kind, "all_keys") for kind in ALL_KEYS_KINDS]
    + [(kind, "all_keys_backward_blocks") for kind in MASK_KINDS],
)
def test_outputs_and_gradients_equal_the_explicit_path(kind, layout, request):
    if layout == "all_keys_backward_blocks":
        request.getfixturevalue("backward_blocks")
    kwargs, full = mask_case(kind)

    def efficient(q, k, v):
        return attention(q, k, v, **kwargs, **LAYOUTS[layout])

    def reference(q, k, v):
        return explicit(q, k, v, full)

    outputs, (d_query, _, _) = assert_same_outputs_and_gradients(efficient, reference)
    if kind == "fully_masked_rows":
        np.testing.assert_array_equal(outputs[0, 3], 0.0)
        np.testing.assert_array_equal(outputs[1], 0.0)
        np.testing.assert_array_equal(d_query[0, 3], 0.0)


@pytest.mark.tf_only
@pytest.mark.parametrize("kind", ["negative_offset", "combined", "sliding_window"])
@pytest.mark.parametrize("layout", ["key_blocks", "all_keys_backward_blocks"])
def test_small_blocks_in_a_graph(kind, layout, request):
    # On TensorFlow the backward pass adds each pair's query gradients to
    # their rows in place inside a graph's loops, and stacks them eagerly
    # (`blocked_passes._scan_range_add`); the other tests run it eagerly.
    # These masks give key blocks that some query blocks cannot see (a
    # part of the query blocks, or none, in each key block's range).
    if layout == "all_keys_backward_blocks":
        request.getfixturevalue("backward_blocks")
    kwargs, full = mask_case(kind)
    got = outputs_and_gradients(
        lambda q, k, v: attention(q, k, v, **kwargs, **LAYOUTS[layout]),
        (Q, K, V),
        COTANGENT,
        jit=True,
    )
    want = outputs_and_gradients(
        lambda q, k, v: explicit(q, k, v, full), (Q, K, V), COTANGENT
    )
    for g, w in zip([got[0], *got[1]], [want[0], *want[1]], strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5)


@pytest.mark.tf_only
@pytest.mark.parametrize("layout", ["key_blocks", "all_keys_backward_blocks"])
def test_graph_backward_replaces_one_query_block_per_step(layout, request):
    # In a graph the backward pass adds each step's query gradients to one
    # element of a `TensorArray` (a `TensorList`). A scatter-add into the
    # dense `(nq, B, N, bq, H)` gradient copied all of it at every step
    # (TensorFlow's scatter kernels did not reuse their input's buffer): a
    # copy of the query gradient per block pair, a tenth of the time at 32k
    # tokens.
    import tensorflow as tf

    if layout == "all_keys_backward_blocks":
        request.getfixturevalue("backward_blocks")
    kwargs, _ = mask_case("combined")

    @tf.function
    def step(q, k, v):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            outputs = attention(q, k, v, **kwargs, **LAYOUTS[layout])
            loss = tf.reduce_sum(outputs * COTANGENT)
        return tape.gradient(loss, [q, k, v])

    types = graph_op_types(step.get_concrete_function(Q, K, V))
    assert "TensorListSetItem" in types
    assert not types & {"TensorScatterAdd", "TensorScatterUpdate", "ScatterNd"}


@pytest.mark.tf_only
@pytest.mark.parametrize("dropout", [False, True])
def test_graph_backward_subtracts_inside_the_block_products(dropout):
    # Without dropout the backward pass folds each row's log-normaliser and
    # `D = Σ dO·O` into the block products as one more column (`[q, -l] ·
    # [k, 1]`, `[dO, -D] · [v, 1]`): no elementwise subtraction passes over
    # a `(B, N, bq, bk)` block, each a read and a write of it. Under dropout
    # the weights' gradient is scaled first and `D` is subtracted after.
    import tensorflow as tf

    kwargs, _ = mask_case("combined")
    if dropout:
        kwargs.update(
            dropout_rate=0.2,
            training=True,
            seed_generator=keras.random.SeedGenerator(1),
        )
    block = LAYOUTS["key_blocks"]

    @tf.function
    def step(q, k, v):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            outputs = attention(q, k, v, **kwargs, **block)
            loss = tf.reduce_sum(outputs * COTANGENT)
        return tape.gradient(loss, [q, k, v])

    shape = (B, N, block["query_block_size"], block["key_block_size"])
    types = block_op_types(step.get_concrete_function(Q, K, V).graph, shape)
    assert {"Exp", "Mul"} <= types  # the weights and their logits' gradient
    assert ("Sub" in types) == dropout


@pytest.mark.parametrize("kind", ["combined", "causal_offset", "sliding_window"])
def test_default_blocks_compiled(kind):
    kwargs, full = mask_case(kind)
    got = outputs_and_gradients(
        lambda q, k, v: attention(q, k, v, **kwargs), (Q, K, V), COTANGENT, jit=True
    )
    want = outputs_and_gradients(
        lambda q, k, v: explicit(q, k, v, full), (Q, K, V), COTANGENT
    )
    for g, w in zip([got[0], *got[1]], [want[0], *want[1]], strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5)


def test_default_key_blocks():
    default = blocked_attention.default_key_block_size
    causal_block = blocked_attention.CAUSAL_KEY_BLOCK_SIZE
    long_block = blocked_attention.LONG_KEY_BLOCK_SIZE["tensorflow"]
    # A causal mask or a window: blocks that they hide are skipped.
    assert default(100, 8, masked_blocks=True, backend="tensorflow") == causal_block
    assert default(10**5, 8, True, "jax") == causal_block
    assert default(10**5, 8, True, "tensorflow", windowed=True) == causal_block
    # On TensorFlow a causal mask alone takes bigger blocks while they still
    # cut the keys into `min_key_blocks`: 512 keys a block at 8k, 1024 from 16k.
    causal_blocks = blocked_attention.CAUSAL_BLOCKS["tensorflow"]
    assert default(8192, 8, True, "tensorflow") == causal_block
    assert default(16384, 8, True, "tensorflow") == 1024
    assert default(10**5, 8, True, "tensorflow") == causal_blocks["max_key_block"]
    block = default(12000, 8, True, "tensorflow")  # 750 rounded up to 16
    assert block == 752 and -(-12000 // block) == causal_blocks["min_key_blocks"]
    assert default(ops.convert_to_tensor(10**5), 8, True, "tensorflow") == 512
    # Other static lengths take equal blocks of at most CAUSAL_KEY_BLOCK_SIZE:
    # 2,049 keys five blocks of 416, not of 512 (2,560 keys, 511 padding).
    for length, windowed, backend in [(2049, False, "jax"), (2049, True, "tensorflow")]:
        assert default(length, 8, True, backend, windowed=windowed) == 416

    # ... and query blocks of up to `max_query_rows` there, with the default
    # key blocks or given ones; a window, full attention and JAX keep
    # MAX_QUERY_BLOCK_SIZE.
    def layout(key_block_size, causal, windowed, backend, length=8192):
        return blocked_attention.default_layout(
            key_block_size, length, 8, causal, windowed, backend
        )

    for key_block_size in ("auto", 300, None):
        got = layout(key_block_size, True, False, "tensorflow")
        assert got.max_query_block_size == causal_blocks["max_query_rows"]
        assert got.block_bytes == blocked_attention.BLOCK_BYTES
        for args in [(True, True, "tensorflow"), (False, False, "tensorflow")]:
            got = layout(key_block_size, *args)
            assert got.max_query_block_size == blocked_attention.MAX_QUERY_BLOCK_SIZE
        got = layout(key_block_size, True, False, "jax")
        assert got.max_query_block_size == blocked_attention.MAX_QUERY_BLOCK_SIZE
    assert layout("auto", True, False, "tensorflow").key_block_size == causal_block
    assert layout(300, True, False, "tensorflow").key_block_size == 300
    assert layout(None, True, False, "tensorflow").key_block_size is None
    plan = blocked_attention.Plan(8192, 8192, None, 512, 8, max_query_block_size=512)
    assert plan.query_block == 512
    # Otherwise all the keys while the one-block layout's query blocks keep
    # more than THIN_QUERY_ROWS rows (8 heads at batch 1: 80 rows at 6k keys,
    # 64 at 8k)...
    assert default(6000, 8, False, "tensorflow") is None
    assert default(8192, 8, False, "tensorflow") == long_block
    # ... or while two key blocks would hold them all.
    assert default(2 * long_block, 10**4, False, "tensorflow") is None
    # Then the fewest blocks of at most the backend's size, split evenly (a
    # multiple of 16), so that the padding of the last block stays small.
    # (16 heads·rows on TensorFlow: thin from 4k keys, and LONG_QUERY_ROWS
    # rows of 2048 keys fill LONG_BLOCK_BYTES, below.)
    for backend, batch_heads in (("tensorflow", 16), ("jax", 10**4)):
        limit = blocked_attention.LONG_KEY_BLOCK_SIZE[backend]
        for length in (2 * limit + 1, 3 * limit - 5, 5 * limit + 17):
            block = default(length, batch_heads, False, backend)
            num_blocks = -(-length // block)
            assert block <= limit and block % 16 == 0
            assert num_blocks == -(-length // limit)
            assert num_blocks * block - length < 16 * num_blocks
    # Only "auto"'s long layout keeps its blocks within LONG_BLOCK_BYTES: not
    # given key blocks, not all the keys, not JAX.
    long_layout = layout("auto", False, False, "tensorflow")
    assert long_layout.key_block_size == long_block
    block_bytes = long_layout.block_bytes
    assert block_bytes == blocked_attention.LONG_BLOCK_BYTES["tensorflow"]
    for other in [
        layout(2048, False, False, "tensorflow"),
        layout("auto", False, False, "tensorflow", length=2048),  # all the keys
        layout("auto", False, False, "jax"),
    ]:
        assert other.block_bytes == blocked_attention.BLOCK_BYTES
    assert layout("auto", False, False, "jax").key_block_size == 1024
    # On TensorFlow the key blocks also keep LONG_QUERY_ROWS rows within
    # LONG_BLOCK_BYTES (never under CAUSAL_KEY_BLOCK_SIZE keys), and the
    # plan's default rows then fill that block: 8 heads at batch 1, 2, 4, 8.
    rows = blocked_attention.LONG_QUERY_ROWS
    for batch, want in [(1, 2048), (2, 2048), (4, 1024), (8, 512), (64, 512)]:
        block = default(8192, 8 * batch, False, "tensorflow")
        assert block == want, (batch, block)
        plan = blocked_attention.Plan(
            8192, 8192, None, block, 8 * batch, block_bytes=block_bytes
        )
        assert plan.query_block == (rows if batch <= 8 else 32)
        assert 8 * batch * plan.query_block * block * 4 <= block_bytes
    assert default(8192, 32, False, "jax") == long_block // 2  # JAX: 1024
    # The one-block layout's backward pass splits its keys the same way.
    backward_limit = blocked_attention.BACKWARD_KEY_BLOCK_SIZE
    for length in (backward_limit, backward_limit + 1, 3 * backward_limit - 5):
        plan = blocked_attention.Plan(7, length, None, None, batch_heads=8)
        backward = blocked_attention.backward_plan(plan, None, batch_heads=8)
        assert backward.num_key_blocks == -(-length // backward_limit)
        padding = backward.padded_key_length - length
        assert padding < 16 * backward.num_key_blocks
    # A length known only when run, or a backend without a measured size.
    assert default(ops.convert_to_tensor(10**6), 8, False, "tensorflow") is None
    assert default(10**6, 8, False, "torch") is None


@pytest.mark.parametrize(
    ("causal", "window"), [(True, None), (True, 8), (False, 7), (False, 3)]
)
@pytest.mark.parametrize("offset", [-3, 0, 2, 9])
def test_band_mask_only_where_it_hides_keys(causal, window, offset):
    """`BlockMasks.band_hides_keys(i, j)` is true exactly for the block pairs
    where the causal mask or the window hides a key from a query (padding
    positions included), so the pairs that skip the band's mask lose
    nothing and every pair that can skip it does."""
    plan = blocked_attention.Plan(TQ, TK, 4, 3, batch_heads=B * N)
    masks = blocked_attention.BlockMasks(
        plan, None, None, None, causal, ops.convert_to_tensor(offset), window
    )
    query_positions = np.arange(plan.padded_query_length) + offset
    key_positions = np.arange(plan.padded_key_length)
    distance = query_positions[:, None] - key_positions[None, :]
    visible = np.ones_like(distance, bool)
    if causal:
        visible &= distance >= 0
    if window is not None:
        visible &= distance < window
        if not causal:
            visible &= distance > -window
    hidden_somewhere = []
    for i in range(plan.num_query_blocks):
        for j in range(plan.num_key_blocks):
            block = visible[i * 4 : (i + 1) * 4, j * 3 : (j + 1) * 3]
            got = bool(to_numpy(masks.band_hides_keys(i, j)))
            assert got == (not block.all()), (i, j)
            hidden_somewhere.append(got)
    # Pairs of both kinds, except where the window is narrower than a query
    # block's span (then it cuts into every pair it leaves visible).
    assert any(hidden_somewhere)
    assert all(hidden_somewhere) == (window == 3)


@pytest.mark.parametrize("kind", ["none", "key_padding", "explicit"])
def test_long_keys_take_key_blocks_by_default(kind, monkeypatch):
    """Where the one-block layout is thin (here: any query block) and past
    twice `LONG_KEY_BLOCK_SIZE` (5 here) keys, full attention takes key
    blocks of at most that size by default, with the explicit path's
    outputs and gradients."""
    backend = keras.backend.backend()
    monkeypatch.setitem(blocked_attention.LONG_KEY_BLOCK_SIZE, backend, 5)
    monkeypatch.setattr(
        blocked_attention, "THIN_QUERY_ROWS", blocked_attention.MAX_QUERY_BLOCK_SIZE
    )
    module = sys.modules[attention.__module__]
    plans = []

    class RecordedPlan(blocked_attention.Plan):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            plans.append(self)

    monkeypatch.setattr(module, "Plan", RecordedPlan)
    kwargs, full = mask_case(kind)
    assert_same_outputs_and_gradients(
        lambda q, k, v: attention(q, k, v, **kwargs),
        lambda q, k, v: explicit(q, k, v, full),
    )
    assert plans and plans[0].key_block == 5 and plans[0].num_key_blocks == 3
    plans.clear()
    attention(Q, K[:, :10], V[:, :10])  # 10 keys: all at once
    assert plans[0].single_key_block and plans[0].key_block == 10
    plans.clear()
    monkeypatch.setattr(blocked_attention, "THIN_QUERY_ROWS", 64)
    attention(Q, K, V)  # query blocks of all 11 rows: not thin
    assert plans[0].single_key_block and plans[0].key_block == TK


@pytest.mark.parametrize("layout", ["key_blocks", "all_keys"])
def test_causal_offset_may_be_a_tensor(layout):
    _, full = mask_case("causal_offset")
    offset = ops.convert_to_tensor(OFFSET, "int32")
    got = attention(Q, K, V, causal=True, causal_offset=offset, **LAYOUTS[layout])
    np.testing.assert_allclose(
        to_numpy(got), to_numpy(explicit(Q, K, V, full)), atol=1e-5
    )


def test_self_attention_with_one_block_per_sequence_and_one_query():
    # Block sizes above the lengths, and a single query (a decoding step).
    full = np.ones((B, 1, 1, TK), bool)
    got = attention(Q[:, :1], K, V, query_block_size=64, key_block_size=64)
    np.testing.assert_allclose(
        to_numpy(got), to_numpy(explicit(Q[:, :1], K, V, full)), atol=1e-5
    )


@pytest.mark.parametrize(("query_length", "key_length"), [(0, TK), (TQ, 0)])
def test_empty_sequences_give_zeros(query_length, key_length):
    outputs = attention(Q[:, :query_length], K[:, :key_length], V[:, :key_length])
    assert tuple(outputs.shape) == (B, query_length, N, HV)
    np.testing.assert_array_equal(to_numpy(outputs), 0.0)


@pytest.mark.parametrize(
    ("dtype", "layout"), [("float16", "key_blocks"), ("bfloat16", "all_keys")]
)
def test_half_precision_inputs_use_a_float32_softmax(dtype, layout):
    # Logits up to ~±1000: float16 logits would overflow, a float16 softmax
    # would be far off; the float32 softmax stays finite and close.
    kwargs, full = mask_case("combined")
    q, k, v = (ops.cast(x * 6.0, dtype) for x in (Q, K, V))
    outputs = attention(q, k, v, **kwargs, **LAYOUTS[layout])
    assert keras.backend.standardize_dtype(outputs.dtype) == dtype
    # The reference: float32 on the same (rounded) inputs.
    q32, k32, v32 = (ops.cast(x, "float32") for x in (q, k, v))
    want = to_numpy(explicit(q32, k32, v32, full))
    got = to_numpy(ops.cast(outputs, "float32"))
    assert np.isfinite(got).all()
    tolerance = 4e-2 if dtype == "bfloat16" else 5e-3  # output rounding
    np.testing.assert_allclose(got, want, atol=tolerance * 6.0, rtol=tolerance)
    _, grads = outputs_and_gradients(
        lambda a, b, c: attention(a, b, c, **kwargs, **LAYOUTS[layout]),
        (q, k, v),
        COTANGENT,
        jit=JIT,
    )
    for grad in grads:
        assert grad.dtype == np.dtype(keras.backend.standardize_dtype(dtype))
        assert np.isfinite(grad.astype("float32")).all()


# -- dropout ------------------------------------------------------------------------

RATE = 0.3


def one_hot_values():
    """`(B, Tk, N, Tk)`: value k of every head is the k-th unit vector, so the
    output row of query q is its (dropped) weight row."""
    return np.tile(np.eye(TK, dtype="float32")[None, :, None, :], (B, 1, N, 1))


@pytest.mark.parametrize(
    "layout", ["key_blocks", "all_keys", "all_keys_backward_blocks"]
)
def test_dropout_keeps_or_rescales_each_weight_and_the_gradient_follows(
    layout, request
):
    """The keep mask is a function of positions: the backward pass, in
    other blocks than the forward's (`all_keys_backward_blocks`), drops
    the same weights."""
    if layout == "all_keys_backward_blocks":
        request.getfixturevalue("backward_blocks")
    kwargs, full = mask_case("combined")
    values = one_hot_values()

    def dropped(q, k, v, seed=3):
        return attention(
            q,
            k,
            v,
            **kwargs,
            **LAYOUTS[layout],
            dropout_rate=RATE,
            training=True,
            seed_generator=keras.random.SeedGenerator(seed),
        )

    weights = to_numpy(
        masked_softmax(np.einsum("bqnh,bknh->bnqk", Q, K) / np.sqrt(H), full)
    )  # (B, N, Tq, Tk)
    observed_rows = to_numpy(dropped(Q, K, values))  # (B, Tq, N, Tk)
    observed = np.transpose(observed_rows, (0, 2, 1, 3))
    kept = np.isclose(observed, weights / (1 - RATE), atol=1e-6) & (weights > 0)
    zeroed = observed == 0.0
    assert (kept | zeroed).all(), "a weight neither kept and rescaled nor dropped"
    valid = weights > 0
    keep_fraction = kept[valid].mean()
    spread = 5 * np.sqrt(RATE * (1 - RATE) / valid.sum())
    assert abs(keep_fraction - (1 - RATE)) < spread, keep_fraction
    # Another seed draws another mask.
    assert not np.array_equal(to_numpy(dropped(Q, K, values, seed=4)), observed_rows)

    # The same seed draws the same mask, and the gradients are those of the
    # explicit formula with it.
    keep = kept.astype("float32") / (1 - RATE)  # (B, N, Tq, Tk)

    def reference(q, k, v):
        logits = ops.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(H)
        attended = masked_softmax(logits, full) * ops.convert_to_tensor(keep)
        return ops.einsum("bnqk,bknh->bqnh", attended, v)

    assert_same_outputs_and_gradients(dropped, reference)


def test_dropout_only_in_training():
    seed = keras.random.SeedGenerator(0)
    inference = attention(
        Q, K, V, dropout_rate=0.5, training=False, seed_generator=seed
    )
    np.testing.assert_array_equal(to_numpy(inference), to_numpy(attention(Q, K, V)))
    trained = attention(Q, K, V, dropout_rate=0.5, training=True, seed_generator=seed)
    assert not np.allclose(to_numpy(trained), to_numpy(inference))


# -- grouped-query attention: K key/value heads, none repeated -----------------------

GQA_RNG = np.random.default_rng(11)
Q6 = GQA_RNG.normal(size=(B, TQ, 6, H)).astype("float32")  # 6 query heads
K3 = GQA_RNG.normal(size=(B, TK, 3, H)).astype("float32")
V3 = GQA_RNG.normal(size=(B, TK, 3, HV)).astype("float32")
COTANGENT6 = GQA_RNG.normal(size=(B, TQ, 6, HV)).astype("float32")
PER_HEAD6 = GQA_RNG.random((1, 6, TQ, TK)) > 0.4  # a mask per query head


def grouped_case(kind):
    """`mask_case` for 6 query heads: the same components, and a per-head
    mask of the 6 query heads for "explicit_per_head"."""
    if kind == "explicit_per_head":
        return {"attention_mask": PER_HEAD6}, PER_HEAD6
    return mask_case(kind)


@pytest.mark.parametrize("key_heads", [3, 2, 1], ids=["g2", "g3", "mqa"])
@pytest.mark.parametrize(
    ("kind", "layout"),
    [
        ("combined", "key_blocks"),
        ("causal_sliding_window", "key_blocks"),
        ("explicit_per_head", "key_blocks"),
        ("combined", "all_keys"),
        ("explicit_per_head", "all_keys"),
        ("combined", "all_keys_backward_blocks"),
        ("causal_offset", "defaults"),
    ],
)
def test_grouped_heads_equal_repeated_heads_and_the_explicit_path(
    kind, layout, key_heads, request
):
    """Keys and values of `K` heads, as they are, give what the same call on
    heads repeated to 6 gives (the old way) and what the explicit path gives;
    the key and value gradients `(B, Tk, K, H)` are the repeated heads'
    gradients summed over each group."""
    if layout == "all_keys_backward_blocks":
        request.getfixturevalue("backward_blocks")
    kwargs, full = grouped_case(kind)
    groups = 6 // key_heads
    inputs = (Q6, K3[:, :, :key_heads], V3[:, :, :key_heads])

    def grouped(q, k, v):
        return attention(q, k, v, **kwargs, **LAYOUTS[layout])

    def repeated(q, k, v):
        return attention(
            q,
            ops.repeat(k, groups, axis=2),
            ops.repeat(v, groups, axis=2),
            **kwargs,
            **LAYOUTS[layout],
        )

    def explicit_grouped(q, k, v):
        return dot_product_attention(q, k, v, mask=full, flash_attention=False)

    got = outputs_and_gradients(grouped, inputs, COTANGENT6, jit=JIT)
    assert [g.shape for g in got[1]] == [x.shape for x in inputs]
    for reference in (repeated, explicit_grouped):
        want = outputs_and_gradients(reference, inputs, COTANGENT6, jit=JIT)
        for g, w in zip([got[0], *got[1]], [want[0], *want[1]], strict=True):
            np.testing.assert_allclose(g, w, atol=1e-5)


@pytest.mark.parametrize("layout", ["key_blocks", "all_keys"])
def test_grouped_dropout_draws_the_repeated_heads_mask(layout):
    """The keep decision is a function of the (batch, query head, query,
    key) position and the seed alone: grouped keys and values drop exactly
    what the repeated heads drop, forward and backward."""
    kwargs, _ = mask_case("combined")
    inputs = (Q6, K3[:, :, :2], V3[:, :, :2])

    def dropped(repeat):
        def attend(q, k, v):
            if repeat:
                k, v = ops.repeat(k, 3, axis=2), ops.repeat(v, 3, axis=2)
            return attention(
                q,
                k,
                v,
                **kwargs,
                **LAYOUTS[layout],
                dropout_rate=RATE,
                training=True,
                seed_generator=keras.random.SeedGenerator(5),
            )

        return attend

    got = outputs_and_gradients(dropped(False), inputs, COTANGENT6, jit=JIT)
    want = outputs_and_gradients(dropped(True), inputs, COTANGENT6, jit=JIT)
    for g, w in zip([got[0], *got[1]], [want[0], *want[1]], strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5)
    undropped = to_numpy(attention(*inputs, **kwargs, **LAYOUTS[layout]))
    assert not np.allclose(got[0], undropped)  # the control: dropout is on


@pytest.mark.tf_only
def test_grouped_heads_in_a_tf_function_with_unknown_lengths():
    import tensorflow as tf

    @tf.function(
        input_signature=[
            tf.TensorSpec((None, None, 6, H), "float32"),
            tf.TensorSpec((None, None, 2, H), "float32"),
            tf.TensorSpec((None, None, 2, HV), "float32"),
        ]
    )
    def attend_and_differentiate(q, k, v):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = attention(q, k, v, causal=True, query_block_size=4, key_block_size=3)
            loss = tf.reduce_sum(out * COTANGENT6)
        return out, tape.gradient(loss, [q, k, v])

    inputs = (Q6, K3[:, :, :2], V3[:, :, :2])
    got, got_grads = attend_and_differentiate(*inputs)
    mask = np.asarray(to_numpy(causal_mask(TQ, TK)))[None, None]
    want, want_grads = outputs_and_gradients(
        lambda q, k, v: dot_product_attention(
            q, k, v, mask=mask, flash_attention=False
        ),
        inputs,
        COTANGENT6,
    )
    np.testing.assert_allclose(to_numpy(got), want, atol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(to_numpy(g), w, atol=1e-5)


# -- arguments ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"query": Q[0]}, "Received: query.shape=(11, 2, 4)"),
        ({"value": V[:, :, :1]}, "`value` and `key` must have the same number of"),
        (
            {"key": K[:, :, [0, 1, 0]], "value": V[:, :, [0, 1, 0]]},
            "multiple of the number of key/value heads (axis 2), as in "
            "grouped-query attention. Received: query.shape=(2, 11, 2, 4), "
            "key.shape=(2, 13, 3, 4)",
        ),
        ({"value": V[:, :5]}, "`value` and `key` must have the same length"),
        ({"query_block_size": 0}, "Received: query_block_size=0"),
        ({"key_block_size": 2.5}, "Received: key_block_size=2.5"),
        ({"key_block_size": "big"}, "Received: key_block_size='big'"),
        (
            {"key_padding_mask": KEY_PADDING[:, :5]},
            "Received: key_padding_mask.shape=(2, 5)",
        ),
        (
            {"query_padding_mask": KEY_PADDING},
            "Received: query_padding_mask.shape=(2, 13)",
        ),
        (
            {"attention_mask": EXPLICIT[:, :, :5]},
            "Received: attention_mask.shape=(2, 11, 5)",
        ),
        ({"attention_mask": EXPLICIT[0, 0]}, "Received: attention_mask.shape=(13,)"),
        ({"causal": 1}, "Received: causal=1"),
        ({"causal": True, "causal_offset": 1.5}, "Received: causal_offset=1.5"),
        ({"sliding_window": 0}, "Received: sliding_window=0"),
        ({"dropout_rate": 1.0}, "Received: dropout_rate=1.0"),
        ({"scale": float("nan")}, "Received: scale=nan"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, message):
    args = {"query": Q, "key": K, "value": V, **kwargs}
    with pytest.raises(
        ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
    ):
        attention(args.pop("query"), args.pop("key"), args.pop("value"), **args)


# -- TensorFlow: unknown lengths, SavedModel -------------------------------------------


@pytest.mark.tf_only
@pytest.mark.parametrize("layout", ["key_blocks", "all_keys", "defaults"])
def test_tf_function_with_unknown_lengths(layout):
    import tensorflow as tf

    spec = tf.TensorSpec((None, None, N, None), "float32")

    @tf.function(
        input_signature=[
            spec,
            spec,
            spec,
            tf.TensorSpec((None, None), "bool"),
            tf.TensorSpec((), "int32"),
        ]
    )
    def attend_and_differentiate(q, k, v, key_padding, offset):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = attention(
                q,
                k,
                v,
                key_padding_mask=key_padding,
                causal=True,
                causal_offset=offset,
                **LAYOUTS[layout],
            )
            loss = tf.reduce_sum(out * out)
        return out, tape.gradient(loss, [q, k, v])

    for query_length, key_length, offset in (
        (TQ, TK, OFFSET),
        (1, TK, TK - 1),
        (7, 7, 0),
    ):
        q, k, v = Q[:, :query_length], K[:, :key_length], V[:, :key_length, :, :H]
        key_padding = KEY_PADDING[:, :key_length]
        got, got_grads = attend_and_differentiate(q, k, v, key_padding, offset)
        full = (
            key_padding[:, None, None, :]
            & np.asarray(causal_mask(query_length, key_length, offset))[None, None]
        )

        def reference(q, k, v, full=full):
            return explicit(q, k, v, full)

        want = to_numpy(reference(q, k, v))
        np.testing.assert_allclose(to_numpy(got), want, atol=1e-5)
        _, want_grads = outputs_and_gradients(reference, (q, k, v), 2 * want)
        for g, w in zip(got_grads, want_grads, strict=True):
            np.testing.assert_allclose(to_numpy(g), w, atol=1e-5)


def graph_op_types(concrete_function) -> set:
    """Op types of a concrete function's graph and of every function it calls
    (the loop bodies, the custom gradient)."""
    graph_def = concrete_function.graph.as_graph_def()
    types = {node.op for node in graph_def.node}
    for function in graph_def.library.function:
        types |= {node.op for node in function.node_def}
    return types


def block_op_types(graph, shape) -> set:
    """Op types of `graph` and of every function graph it calls (loop
    bodies, branches, the custom gradient) whose first output has `shape`."""
    types = set()
    for op in graph.get_operations():
        if op.outputs and op.outputs[0].shape == tuple(shape):
            types.add(op.type)
        for attr in ("body", "cond", "then_branch", "else_branch", "f"):
            try:
                name = op.get_attr(attr).name
            except (ValueError, AttributeError):
                continue
            function = graph._get_function(name)
            if function is not None:
                types |= block_op_types(function.graph, shape)
    return types


@pytest.mark.tf_only
def test_saved_model_loads_with_tensorflow_alone_and_has_no_xla_ops(tmp_path):
    import tensorflow as tf

    spec = tf.TensorSpec((None, None, N, H), "float32")

    class Attend(tf.Module):
        @tf.function(input_signature=[spec, tf.TensorSpec((None, None), "bool")])
        def serve(self, x, key_padding):
            return attention(
                x,
                x,
                x,
                key_padding_mask=key_padding,
                causal=True,
                query_block_size=4,
                key_block_size=3,
            )

        @tf.function(input_signature=[spec, tf.TensorSpec((None, None), "bool")])
        def serve_all_keys(self, x, key_padding):
            return attention(
                x, x, x, key_padding_mask=key_padding, causal=True, key_block_size=None
            )

        @tf.function(input_signature=[spec])
        def train(self, x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(attention(x, x, x, causal=True, key_block_size=3))
            return tape.gradient(loss, x)

    module = Attend()
    for function in (module.serve, module.serve_all_keys, module.train):
        types = graph_op_types(function.get_concrete_function())
        assert "While" in types or "StatelessWhile" in types  # the block loops
        assert not [t for t in types if t.startswith("Xla")], sorted(types)

    export_dir = str(tmp_path / "attend")
    tf.saved_model.save(module, export_dir)
    # The graph as saved, its functions (loop bodies, gradient) included.
    from tensorflow.core.protobuf import saved_model_pb2

    saved = saved_model_pb2.SavedModel()
    with open(os.path.join(export_dir, "saved_model.pb"), "rb") as file:
        saved.ParseFromString(file.read())
    graph_def = saved.meta_graphs[0].graph_def
    saved_types = {node.op for node in graph_def.node} | {
        node.op for function in graph_def.library.function for node in function.node_def
    }
    assert not [t for t in saved_types if t.startswith("Xla")], sorted(saved_types)
    x = Q[:, :, :, :H]
    key_padding = QUERY_PADDING
    expected = [
        to_numpy(module.serve(x, key_padding)),
        to_numpy(module.serve_all_keys(x, key_padding)),
    ]
    np.savez(tmp_path / "inputs.npz", x=x, key_padding=key_padding)
    script = textwrap.dedent(f"""
        import sys
        for blocked in ("keras", "keras_attn", "keras_hub", "keras_nlp"):
            sys.modules[blocked] = None
        import numpy as np
        import tensorflow as tf
        loaded = tf.saved_model.load({export_dir!r})
        data = np.load({str(tmp_path / "inputs.npz")!r})
        outputs = [loaded.serve(data["x"], data["key_padding"]).numpy(),
                   loaded.serve_all_keys(data["x"], data["key_padding"]).numpy()]
        np.savez({str(tmp_path / "outputs.npz")!r}, *outputs)
    """)
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = np.load(tmp_path / "outputs.npz")
    for index, want in enumerate(expected):
        np.testing.assert_allclose(loaded[f"arr_{index}"], want, atol=1e-6)


MEMORY_SCRIPT = """
import json
import numpy as np
import tensorflow as tf
from keras_attn.ops import dot_product_attention, memory_efficient_attention

LENGTH = {length}


def resident(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024


spec = tf.TensorSpec((1, None, 1, 8), "float32")


def step_of(attend):
    @tf.function(input_signature=[spec])
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(attend(x))
        return tape.gradient(loss, x)

    return step


steps = {{
    "key_blocks": step_of(lambda x: memory_efficient_attention(x, x, x, causal=True)),
    "all_keys": step_of(
        lambda x: memory_efficient_attention(x, x, x, key_block_size=None)
    ),
    "explicit": step_of(
        lambda x: dot_product_attention(x, x, x, return_weights=True)[0]
    ),
}}
x = tf.constant(np.random.default_rng(0).normal(size=(1, LENGTH, 1, 8)), "float32")
peaks = {{}}
for name, step in steps.items():  # in increasing order of expected peak
    step(x[:, :64]).numpy()  # traced at a short length, run below at LENGTH
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # the peak (VmHWM) restarts from VmRSS
    baseline = resident("VmRSS")
    step(x).numpy()
    peaks[name] = resident("VmHWM") - baseline
print(json.dumps(peaks))
"""


@pytest.mark.tf_only
def test_graph_mode_memory_stays_below_one_quadratic_tensor():
    """In `tf.function`, forward+backward at T=4096 peaks below half of one
    `(T, T)` float32 tensor above its baseline, where the explicit path (the
    control: the measurement sees quadratic memory) takes several."""
    length = 4096
    result = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT.format(length=length)],
        capture_output=True,
        text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    peaks = json.loads(result.stdout.strip().splitlines()[-1])
    quadratic = length * length * 4  # bytes of one (T, T) float32 tensor
    assert peaks["explicit"] > 2 * quadratic, peaks
    assert peaks["key_blocks"] < quadratic / 2, peaks
    assert peaks["all_keys"] < quadratic / 2, peaks


@pytest.mark.jax_only
@pytest.mark.parametrize("transform", ["cond", "scan", "checkpoint"])
def test_gradients_under_jax_control_flow_and_remat(transform):
    """The masks, the offset, the slopes and the dropout seed reach the custom
    gradient as its arguments: inside `jax.lax.cond`, `jax.lax.scan` and
    `jax.checkpoint`, where a custom gradient that closes over them does not
    compile, the gradients are those of the plain call."""
    import jax

    def attend(q, k, v, key_padding, query_padding, explicit, offset):
        return attention(
            q,
            k,
            v,
            key_padding_mask=key_padding,
            query_padding_mask=query_padding,
            attention_mask=explicit,
            causal=True,
            causal_offset=offset,
            alibi_slopes=np.array([0.5, 0.25], "float32"),
            dropout_rate=0.3,
            training=True,
            seed_generator=keras.random.SeedGenerator(3),
            key_block_size=4,
        )

    transformed = {
        "cond": lambda *args: jax.lax.cond(
            True, attend, lambda q, k, v, *_: ops.zeros_like(q)[..., :HV], *args
        ),
        "scan": lambda *args: jax.lax.scan(
            lambda carry, _: (carry, attend(*args)), 0, None, length=1
        )[1][0],
        "checkpoint": jax.checkpoint(attend),
    }[transform]

    def gradients(function):
        def loss(q, k, v, *masks):
            return ops.sum(function(q, k, v, *masks) * COTANGENT)

        masks = (KEY_PADDING, QUERY_PADDING, EXPLICIT, np.int32(OFFSET))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(Q, K, V, *masks)

    for got, expected in zip(gradients(transformed), gradients(attend), strict=True):
        np.testing.assert_allclose(to_numpy(got), to_numpy(expected), atol=1e-5)
        assert np.abs(to_numpy(expected)).max() > 0
