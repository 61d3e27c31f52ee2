import keras
import numpy as np
import pytest

import keras_attn.ops.attention as attention_module
import keras_attn.ops.attention_paths as attention_paths_module
from keras_attn.ops import (
    attention_path,
    dot_product_attention,
    fused_kernel_runs,
    rows_with_keys,
    switch_over_length,
)
from keras_attn.ops.attention import check_flash_attention
from tests.test_case import to_numpy

RNG = np.random.default_rng(1)
Q = RNG.normal(size=(2, 4, 3, 8)).astype("float32")  # (B, Tq, N, H)
K = RNG.normal(size=(2, 6, 3, 8)).astype("float32")
V = RNG.normal(size=(2, 6, 3, 8)).astype("float32")
V_NARROW = RNG.normal(size=(2, 6, 3, 5)).astype("float32")  # Hv != H


def numpy_attention(q, k, v, mask):
    logits = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    logits = np.where(mask, logits, -np.inf)
    with np.errstate(invalid="ignore"):
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        weights = weights / weights.sum(-1, keepdims=True)
    weights = np.nan_to_num(weights)
    return np.einsum("bnts,bsnh->btnh", weights, v), weights


def make_mask():
    mask = np.ones((2, 1, 4, 6), bool)
    mask[0, :, :, 4:] = False  # padded keys
    mask[1, :, 2, :] = False  # a query row with no keys at all
    return mask


@pytest.mark.parametrize("value", [V, V_NARROW], ids=["same_head_dim", "narrow_values"])
def test_fused_and_explicit_paths_agree_with_numpy_including_masked_rows(value):
    V = value
    mask = make_mask()
    fused = to_numpy(dot_product_attention(Q, K, V, mask=mask))
    explicit, weights = dot_product_attention(Q, K, V, mask=mask, return_weights=True)
    expected, expected_weights = numpy_attention(Q, K, V, mask)
    np.testing.assert_allclose(fused, expected, atol=1e-5)
    np.testing.assert_allclose(to_numpy(explicit), expected, atol=1e-5)
    np.testing.assert_allclose(to_numpy(weights), expected_weights, atol=1e-6)
    np.testing.assert_array_equal(fused[1, 2], 0.0)
    np.testing.assert_array_equal(to_numpy(explicit)[1, 2], 0.0)


def test_dropout_only_in_training():
    seed = keras.random.SeedGenerator(0)
    inference = dot_product_attention(
        Q, K, V, dropout_rate=0.5, training=False, seed_generator=seed
    )
    np.testing.assert_allclose(
        to_numpy(inference), to_numpy(dot_product_attention(Q, K, V)), atol=1e-6
    )
    trained = dot_product_attention(
        Q, K, V, dropout_rate=0.5, training=True, seed_generator=seed
    )
    assert not np.allclose(to_numpy(trained), to_numpy(inference))


@pytest.mark.parametrize("mask", [None, "padding"], ids=["causal_only", "and_mask"])
def test_is_causal_equals_an_explicit_causal_mask_on_both_paths(mask):
    mask = None if mask is None else make_mask()
    causal = np.tril(np.ones((4, 6), bool))[None, None]
    combined = causal if mask is None else mask & causal
    expected, _ = numpy_attention(Q, K, V, combined)
    for flash in (None, False):  # fused where the backend has it, explicit
        got = dot_product_attention(
            Q, K, V, mask=mask, is_causal=True, flash_attention=flash
        )
        np.testing.assert_allclose(to_numpy(got), expected, atol=1e-5)
    _, weights = dot_product_attention(
        Q, K, V, mask=mask, is_causal=True, return_weights=True
    )
    np.testing.assert_array_equal(to_numpy(weights)[..., ~causal[0, 0]], 0.0)


LONG = {"query_length": 4096, "key_length": 4096}
SHORT = {"query_length": 512, "key_length": 512}


@pytest.mark.parametrize(
    ("flash", "call", "expected"),
    [
        # A fused kernel runs the call (JAX with cuDNN, PyTorch on CUDA): it
        # keeps priority at every length, unless dropout or narrow value heads.
        (None, {"fused_kernel": True, **LONG}, "fused"),
        (None, {"fused_kernel": True, **SHORT}, "fused"),
        (True, {"fused_kernel": True, **SHORT}, "fused"),
        (
            None,
            {"fused_kernel": True, "dropout_active": True, **LONG},
            "memory_efficient",
        ),
        (None, {"fused_kernel": True, "dropout_active": True, **SHORT}, "explicit"),
        (
            None,
            {"fused_kernel": True, "same_head_dims": False, **LONG},
            "memory_efficient",
        ),
        (
            True,
            {"fused_kernel": True, "same_head_dims": False, **SHORT},
            "memory_efficient",
        ),
        # No fused kernel (TensorFlow, JAX on a CPU or on a GPU in float32):
        # the memory-efficient path from the switch-over length on.
        (None, {**LONG}, "memory_efficient"),
        (None, {**SHORT}, "explicit"),
        (None, {"query_length": 2, "key_length": 1024}, "memory_efficient"),
        (None, {"query_length": 2, "key_length": 1023}, "explicit"),
        (None, {"query_length": 1, "key_length": 8192}, "explicit"),  # decoding
        (
            None,
            {"query_length": 2048, "key_length": 1024, "dtype": "bfloat16"},
            "explicit",
        ),
        (
            None,
            {"query_length": 2048, "key_length": 2048, "dtype": "float16"},
            "memory_efficient",
        ),
        (None, {"dropout_active": True, **LONG}, "memory_efficient"),
        (None, {"same_head_dims": False, **LONG}, "memory_efficient"),
        # Lengths unknown when traced: decided when the graph runs.
        (None, {}, "by_length"),
        (None, {"query_length": 8, "key_length": None}, "by_length"),
        (None, {"query_length": None, "key_length": 100}, "explicit"),
        (None, {"query_length": 1, "key_length": None}, "explicit"),
        # True: fused, else memory-efficient at any length; False: explicit.
        (True, {**SHORT}, "memory_efficient"),
        (True, {"query_length": 1, "key_length": 4}, "memory_efficient"),
        (True, {"dropout_active": True, "fused_kernel": True}, "memory_efficient"),
        (False, {"fused_kernel": True, **LONG}, "explicit"),
        (False, {**LONG}, "explicit"),
        # Weights requested: only the explicit path returns them.
        (None, {"return_weights": True, "fused_kernel": True, **LONG}, "explicit"),
        (False, {"return_weights": True}, "explicit"),
    ],
)
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_attention_path_decisions(flash, call, expected, backend):
    assert attention_path(flash, backend=backend, **call) == expected


def test_tensorflow_has_no_fused_kernel_whatever_it_is_told():
    for flash, call, expected in (
        (None, {"fused_kernel": True, **SHORT}, "explicit"),
        (None, {"fused_kernel": True, **LONG}, "memory_efficient"),
        (True, {"fused_kernel": True, **SHORT}, "memory_efficient"),
    ):
        assert attention_path(flash, backend="tensorflow", **call) == expected


def test_switch_over_length_by_dtype():
    assert switch_over_length("float32") == 1024
    assert switch_over_length("bfloat16") == switch_over_length("float16") == 2048
    assert switch_over_length("float64") == 1024


def test_flash_attention_true_refuses_a_call_that_needs_the_weights():
    with pytest.raises(
        ValueError,
        match=r"weights are requested.*Received: flash_attention=True, "
        r"return_attention_scores=True",
    ):
        attention_path(True, return_weights=True, backend="jax", fused_kernel=True)


def test_attention_path_follows_keras_flash_attention_config(monkeypatch):
    monkeypatch.setattr(keras.config, "is_flash_attention_enabled", lambda: False)
    assert attention_path(None, backend="jax", fused_kernel=True) == "explicit"
    assert attention_path(None, backend="tensorflow", **LONG) == "explicit"
    monkeypatch.setattr(keras.config, "is_flash_attention_enabled", lambda: True)
    assert attention_path(None, backend="jax", fused_kernel=True) == "fused"
    assert attention_path(None, backend="tensorflow", **SHORT) == "memory_efficient"
    with pytest.raises(ValueError, match="attention weights are requested"):
        attention_path(None, backend="jax", return_weights=True)
    assert attention_path(False, backend="jax", return_weights=True) == "explicit"


def test_check_flash_attention():
    assert check_flash_attention(None, 0.5) is None
    assert check_flash_attention(True, 0.0) is True
    with pytest.raises(
        ValueError, match=r"Received: flash_attention=True, dropout=0\.1"
    ):
        check_flash_attention(True, 0.1)
    with pytest.raises(ValueError, match="Received: flash_attention=1"):
        check_flash_attention(1)


def test_check_flash_attention_follows_keras_flash_attention_config(monkeypatch):
    monkeypatch.setattr(keras.config, "is_flash_attention_enabled", lambda: True)
    with pytest.raises(
        ValueError, match=r"Received: flash_attention=None, dropout=0\.1"
    ):
        check_flash_attention(None, 0.1)
    assert check_flash_attention(False, 0.1) is False


# -- mask components and the paths ------------------------------------------------

KEY_PADDING = np.array([[True] * 4 + [False] * 2, [False] + [True] * 5])
QUERY_PADDING = np.array([[True] * 4, [True, True, True, False]])
COMPONENT_CASES = {
    "key_padding": {"key_padding_mask": KEY_PADDING},
    "query_padding": {"query_padding_mask": QUERY_PADDING},
    "causal": {"is_causal": True},
    "causal_offset": {"is_causal": True, "causal_offset": 2},
    "causal_tensor_offset": {"is_causal": True, "causal_offset": "tensor"},
    "negative_offset": {"is_causal": True, "causal_offset": -2},
    "sliding_window": {"sliding_window": 2, "causal_offset": 1},
    "explicit_2d": {"mask": "explicit_2d"},
    "everything": {
        "mask": "explicit",
        "key_padding_mask": KEY_PADDING,
        "query_padding_mask": QUERY_PADDING,
        "is_causal": True,
        "causal_offset": 1,
        "sliding_window": 3,
    },
}


def numpy_combined_mask(case):
    mask = np.ones((2, 1, 4, 6), bool)
    offset = case.get("causal_offset", 0)
    offset = 2 if offset == "tensor" else offset
    query_positions = np.arange(4)[:, None] + offset
    key_positions = np.arange(6)[None, :]
    if case.get("mask") == "explicit":
        mask &= make_mask()
    if case.get("mask") == "explicit_2d":
        mask &= make_mask()[0, 0]
    if "key_padding_mask" in case:
        mask &= case["key_padding_mask"][:, None, None, :]
    if "query_padding_mask" in case:
        mask &= case["query_padding_mask"][:, None, :, None]
    if case.get("is_causal"):
        mask &= key_positions <= query_positions
    if "sliding_window" in case:
        mask &= np.abs(query_positions - key_positions) < case["sliding_window"]
    return mask


def component_arguments(case):
    arguments = dict(case)
    masks = {"explicit": make_mask(), "explicit_2d": make_mask()[0, 0]}  # 4-D, 2-D
    if "mask" in arguments:
        arguments["mask"] = masks[arguments["mask"]]
    if arguments.get("causal_offset") == "tensor":
        arguments["causal_offset"] = keras.ops.convert_to_tensor(2, "int32")
    return arguments


# The fused path only where keras.ops.dot_product_attention can compute it
# (JAX's XLA attention, PyTorch's scaled_dot_product_attention; TensorFlow
# has none).
FORCED_PATHS = ["explicit", "memory_efficient"] + (
    ["fused"] if keras.backend.backend() in ("jax", "torch") else []
)


@pytest.fixture(params=FORCED_PATHS)
def forced_path(request, monkeypatch):
    """`flash_attention` forcing each path; the fused one by pretending that a
    fused kernel runs (on a CPU none does, and XLA computes the attention)."""
    if request.param == "fused":
        monkeypatch.setattr(attention_module, "fused_kernel_runs", lambda *a, **k: True)
        return None
    return request.param == "memory_efficient"


# Low precision: each path against float64 attention of the same rounded
# inputs, within `LOW_PRECISION_TOLERANCE[dtype] * (scale + |expected|)`. The
# largest errors measured (TensorFlow and JAX on a CPU, every path) were
# 3.3e-4 in float16 and 3.4e-3 in bfloat16 (the explicit path's bfloat16
# logits); logits 1.1 times too large move the unit-scale outputs by up to
# 0.13 and fail every path. The big logits (scale 30) saturate the softmax,
# where such a factor hardly shows: that case checks overflow and masking.
LOW_PRECISION_TOLERANCE = {"float16": 1e-3, "bfloat16": 1e-2}


@pytest.fixture
def paths_taken(monkeypatch):
    """The paths `dot_product_attention` runs, recorded: `"explicit"`,
    `"memory_efficient"`, or `"fused"` for a call of Keras's
    `dot_product_attention` by the fused branch."""
    taken = []

    def recording(name, function):
        def record(*args, **kwargs):
            taken.append(name)
            return function(*args, **kwargs)

        return record

    for name, attribute in (
        ("explicit", "_explicit_attention"),
        ("memory_efficient", "memory_efficient_attention"),
    ):
        original = getattr(attention_module, attribute)
        monkeypatch.setattr(attention_module, attribute, recording(name, original))
    return taken


@pytest.mark.parametrize("scale", [1.0, 30.0], ids=["unit", "big_logits"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_paths_match_float64_of_the_rounded_inputs(
    dtype, scale, forced_path, paths_taken, monkeypatch
):
    mask = make_mask()
    q, k, v = (keras.ops.cast(x * scale, dtype) for x in (Q, K, V))
    rounded = [
        to_numpy(keras.ops.cast(x, "float32")).astype("float64") for x in (q, k, v)
    ]
    expected, _ = numpy_attention(*rounded, mask)
    fused_calls = []
    if forced_path is None:  # the fused branch: count its Keras call
        original = keras.ops.dot_product_attention

        def fused(*args, **kwargs):
            fused_calls.append(1)
            return original(*args, **kwargs)

        monkeypatch.setattr(keras.ops, "dot_product_attention", fused)
    outputs = dot_product_attention(q, k, v, mask=mask, flash_attention=forced_path)
    assert keras.backend.standardize_dtype(outputs.dtype) == dtype
    got = to_numpy(keras.ops.cast(outputs, "float32")).astype("float64")
    # The path forced is the path taken (the paths differ: in bfloat16 the
    # explicit path's logits are bfloat16; the fused one is Keras's op).
    if forced_path is None:
        assert paths_taken == [] and fused_calls == [1]
    else:
        assert paths_taken == ["memory_efficient" if forced_path else "explicit"]
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[1, 2], 0.0)  # the query row with no keys
    tolerance = LOW_PRECISION_TOLERANCE[dtype]
    np.testing.assert_allclose(got, expected, atol=tolerance * scale, rtol=tolerance)


@pytest.mark.parametrize("case", list(COMPONENT_CASES))
def test_mask_components_equal_the_combined_mask_on_every_path(case, forced_path):
    arguments = component_arguments(COMPONENT_CASES[case])
    got = to_numpy(
        dot_product_attention(Q, K, V, flash_attention=forced_path, **arguments)
    )
    full = numpy_combined_mask(COMPONENT_CASES[case])
    expected, _ = numpy_attention(Q, K, V, full)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    empty_rows = ~full.any(-1)[:, 0]  # (B, Tq)
    np.testing.assert_array_equal(got[empty_rows], 0.0)


@pytest.mark.jax_only
@pytest.mark.parametrize("case", ["key_padding", "query_padding", "everything"])
def test_the_fused_call_gets_both_sequence_axes_whole(case, monkeypatch):
    """cuDNN refuses a mask (its bias) whose query or key axis is broadcast
    ("Bias must have same seq length as QKV"): the fused call hands Keras's
    `dot_product_attention` a `(B|1, N|1, Tq, Tk)` mask, which is what
    `fused_kernel_runs` probes with."""
    monkeypatch.setattr(attention_module, "fused_kernel_runs", lambda *a, **k: True)
    masks = []
    original = keras.ops.dot_product_attention

    def recording(*args, mask=None, **kwargs):
        masks.append(None if mask is None else tuple(mask.shape))
        return original(*args, mask=mask, **kwargs)

    monkeypatch.setattr(keras.ops, "dot_product_attention", recording)
    arguments = component_arguments(COMPONENT_CASES[case])
    got = to_numpy(dot_product_attention(Q, K, V, flash_attention=None, **arguments))
    assert len(masks) == 1 and masks[0][2:] == (Q.shape[1], K.shape[1]), masks
    expected, _ = numpy_attention(Q, K, V, numpy_combined_mask(COMPONENT_CASES[case]))
    np.testing.assert_allclose(got, expected, atol=1e-5)


@pytest.mark.parametrize("case", ["causal_offset", "everything"])
def test_rows_with_keys_from_components(case):
    arguments = component_arguments(COMPONENT_CASES[case])
    explicit = arguments.pop("mask", None)
    rows = rows_with_keys(
        4,
        6,
        attention_mask=None if explicit is None else explicit[:, 0],
        key_padding_mask=arguments.get("key_padding_mask"),
        query_padding_mask=arguments.get("query_padding_mask"),
        causal=arguments.get("is_causal", False),
        offset=arguments.get("causal_offset", 0),
        sliding_window=arguments.get("sliding_window"),
    )
    expected = numpy_combined_mask(COMPONENT_CASES[case]).any(-1)[:, 0]
    np.testing.assert_array_equal(np.broadcast_to(to_numpy(rows), (2, 4)), expected)


def test_rows_with_keys_without_an_explicit_mask_covers_every_window():
    rng = np.random.default_rng(3)
    key_padding = rng.uniform(size=(3, 9)) > 0.6
    for causal in (False, True):
        for window in (None, 1, 2, 4):
            for offset in (-3, 0, 2, 9):
                rows = rows_with_keys(
                    5,
                    9,
                    key_padding_mask=key_padding,
                    causal=causal,
                    offset=offset,
                    sliding_window=window,
                )
                query_positions = np.arange(5)[:, None] + offset
                key_positions = np.arange(9)[None, :]
                pairs = np.broadcast_to(key_padding[:, None, :], (3, 5, 9)).copy()
                if causal:
                    pairs &= key_positions <= query_positions
                if window:
                    pairs &= np.abs(query_positions - key_positions) < window
                np.testing.assert_array_equal(
                    np.broadcast_to(to_numpy(rows), (3, 5)),
                    pairs.any(-1),
                    err_msg=f"causal={causal}, window={window}, offset={offset}",
                )
    assert rows_with_keys(5, 9) is None


@pytest.mark.jax_only
def test_fused_kernel_runs_reads_the_compiled_program(monkeypatch):
    import jax

    assert jax.default_backend() == "cpu"
    program = attention_paths_module._jax_program_has_fused_kernel
    program.cache_clear()
    # XLA on a CPU: matmuls and a softmax, no fused attention custom call;
    # in float16 the program does not even compile there.
    for dtype in ("float32", "bfloat16", "float16"):
        q = keras.ops.cast(Q, dtype)
        assert not fused_kernel_runs(q, q, q)
        assert not fused_kernel_runs(q, q, q, mask_shape=(2, 1, 4, 4))
        assert not fused_kernel_runs(q, q, q, is_causal=True)
    # The answer comes from the program's text: a target that the CPU
    # program does hold is found.
    program.cache_clear()
    monkeypatch.setattr(
        attention_paths_module, "_FUSED_KERNEL_TARGETS", ("exponential",)
    )
    assert fused_kernel_runs(Q, Q, Q)
    program.cache_clear()


@pytest.mark.tf_only
def test_tensorflow_runs_no_fused_kernel():
    assert not fused_kernel_runs(Q, K, V)


# -- grouped-query attention: fewer key/value heads -------------------------------

Q6 = RNG.normal(size=(2, 4, 6, 8)).astype("float32")  # 6 query heads


@pytest.mark.parametrize("key_heads", [1, 2, 3])
@pytest.mark.parametrize("case", ["key_padding", "everything"])
def test_grouped_heads_equal_repeated_heads_on_every_path(key_heads, case, forced_path):
    """`K` key/value heads for 6 query heads: query head `n` reads key/value
    head `n // (6 / K)`, what the NumPy attention of repeated heads gives,
    weights included."""
    k, v = K[:, :, :key_heads], V_NARROW[:, :, :key_heads]
    arguments = component_arguments(COMPONENT_CASES[case])
    got = to_numpy(
        dot_product_attention(Q6, k, v, flash_attention=forced_path, **arguments)
    )
    groups = 6 // key_heads
    repeated_k, repeated_v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    full = numpy_combined_mask(COMPONENT_CASES[case])
    expected, expected_weights = numpy_attention(Q6, repeated_k, repeated_v, full)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    if forced_path is False:  # the explicit path returns the weights
        _, weights = dot_product_attention(
            Q6, k, v, flash_attention=False, return_weights=True, **arguments
        )
        np.testing.assert_allclose(to_numpy(weights), expected_weights, atol=1e-6)


def test_key_heads_must_divide_the_query_heads():
    with pytest.raises(ValueError, match=r"multiple of the number of key/value heads"):
        four = np.zeros((2, 6, 4, 8), "float32")
        dot_product_attention(Q6, four, four)
    with pytest.raises(ValueError, match=r"same number of heads \(axis 2\)"):
        dot_product_attention(Q6, K[:, :, :2], V[:, :, :3])


@pytest.mark.tf_only
@pytest.mark.parametrize("key_heads", [3, 1])
def test_a_one_query_step_reads_the_keys_transposed(key_heads):
    """A decoding step's query (one position) multiplies the cached keys in
    the values' layout, read transposed by the product (on TensorFlow a
    batched matmul with `adj_y`), with the same outputs as numpy's; longer
    queries keep the keys moved to `(B, K, H, Tk)`."""
    import tensorflow as tf

    mask = make_mask()[:, :, :1]
    k, v = K[:, :, :key_heads], V[:, :, :key_heads]
    repeat = 3 // key_heads
    want, _ = numpy_attention(
        Q[:, :1], np.repeat(k, repeat, axis=2), np.repeat(v, repeat, axis=2), mask
    )

    def adjoint_products(query):
        fn = tf.function(lambda q: dot_product_attention(q, k, v, mask=mask))
        graph = fn.get_concrete_function(tf.TensorSpec(query.shape)).graph
        return [
            op.get_attr("adj_y")
            for op in graph.get_operations()
            if op.type.startswith("BatchMatMul")
        ]

    assert adjoint_products(Q[:, :1]) == [True, False]
    assert adjoint_products(Q) == [False, False]
    got = dot_product_attention(Q[:, :1], k, v, mask=mask, flash_attention=False)
    np.testing.assert_allclose(to_numpy(got), want, rtol=1e-5, atol=1e-5)
