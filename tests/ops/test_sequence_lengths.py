"""Padding as sequence lengths (`keras_attn.ops.sequence_lengths`): the mask
components as `jax.nn.dot_product_attention`'s lengths and window, the
right-padding check, and `dot_product_attention`'s lengths call against the
explicit path. On a CPU no cuDNN kernel runs, so the call is made with
`implementation="xla"`, JAX's reference semantics of the same arguments."""

import keras
import numpy as np
import pytest

import keras_attn.ops.attention as attention_module
from keras_attn.ops import dot_product_attention
from keras_attn.ops.attention_paths import lengths_kernel_implementation
from keras_attn.ops.masks import band_mask
from keras_attn.ops.sequence_lengths import (
    concrete_right_padded,
    kernel_arguments,
    lengths_form,
    right_padded,
)
from tests.test_case import to_numpy

pytestmark = pytest.mark.jax_only

RNG = np.random.default_rng(7)


def lengths_mask(lengths, length):
    return np.arange(length)[None, :] < np.asarray(lengths)[:, None]


def components(**given):
    return {
        "key_padding_mask": given.get("key_padding_mask"),
        "query_padding_mask": given.get("query_padding_mask"),
        "causal": given.get("causal", False),
        "causal_offset": given.get("causal_offset", 0),
        "sliding_window": given.get("sliding_window"),
    }


def numpy_visible(case, query_length, key_length, batch):
    """The combined mask `(B, Tq, Tk)` of a case, from its definition."""
    query_positions = np.arange(query_length)[:, None]
    key_positions = np.arange(key_length)[None, :]
    visible = np.ones((batch, query_length, key_length), bool)
    if case.get("key_padding_mask") is not None:
        visible &= np.asarray(case["key_padding_mask"])[:, None, :]
    if case.get("query_padding_mask") is not None:
        visible &= np.asarray(case["query_padding_mask"])[:, :, None]
    if case.get("is_causal"):
        visible &= key_positions <= query_positions
    if case.get("sliding_window"):
        visible &= np.abs(query_positions - key_positions) < case["sliding_window"]
    return visible


# -- the arguments --------------------------------------------------------------------


@pytest.mark.parametrize("lengths", [(6, 9), (9, 6), (7, 7)], ids=str)
@pytest.mark.parametrize("window", [1, 2, 4, 20])
def test_local_window_size_is_the_causal_sliding_window(window, lengths):
    """JAX's `local_window_size=(w - 1, 0)` with `is_causal` keeps the pairs
    that `band_mask(causal=True, window=w)` keeps: with equal logits each
    query's output is the mean of the one-hot values of the keys it sees."""
    import jax

    query_length, key_length = lengths
    form = lengths_form(None, components(causal=True, sliding_window=window), 1.0)
    arguments, rows = kernel_arguments(form, 1, query_length, key_length)
    zeros = np.zeros((1, max(lengths), 1, key_length), "float32")
    one_hot = np.eye(key_length, dtype="float32")[None, :, None, :]
    outputs = jax.nn.dot_product_attention(
        zeros[:, :query_length],
        zeros[:, :key_length],
        one_hot,
        implementation="xla",
        **arguments,
    )  # (1, Tq, 1, Tk)
    seen = to_numpy(outputs)[0, :, 0] > 0
    if rows is not None:
        seen &= to_numpy(rows)[0][:, None]
    expected = to_numpy(band_mask(query_length, key_length, True, window))
    np.testing.assert_array_equal(seen, expected)


KEY_LENGTHS = [9, 4, 0]
QUERY_LENGTHS = [6, 2, 6]
ARGUMENT_CASES = {
    "key_padding": {"key_padding_mask": lengths_mask(KEY_LENGTHS, 9)},
    "query_padding": {"query_padding_mask": lengths_mask(QUERY_LENGTHS, 6)},
    "both_causal": {
        "key_padding_mask": lengths_mask(KEY_LENGTHS, 9),
        "query_padding_mask": lengths_mask(QUERY_LENGTHS, 6),
        "is_causal": True,
    },
    "window_past_the_keys": {"is_causal": True, "sliding_window": 2},
    "window_and_padding": {
        "key_padding_mask": lengths_mask(KEY_LENGTHS, 9),
        "is_causal": True,
        "sliding_window": 3,
    },
}


@pytest.mark.parametrize("case", list(ARGUMENT_CASES))
def test_kernel_arguments_give_the_lengths_and_the_rows_with_keys(case):
    arguments = ARGUMENT_CASES[case]
    # Keys shorter than the queries for the window: the last queries see none.
    query_length, key_length = (6, 3) if case == "window_past_the_keys" else (6, 9)
    form = lengths_form(
        None,
        components(
            key_padding_mask=arguments.get("key_padding_mask"),
            query_padding_mask=arguments.get("query_padding_mask"),
            causal=arguments.get("is_causal", False),
            sliding_window=arguments.get("sliding_window"),
        ),
        0.5,
    )
    kernel, rows = kernel_arguments(form, 3, query_length, key_length)
    visible = numpy_visible(arguments, query_length, key_length, 3)
    has_keys = visible.any(-1)  # (B, Tq)
    np.testing.assert_array_equal(to_numpy(rows), has_keys)
    # The rows with keys are a prefix: the kernel computes exactly them (at
    # least one), against the keys that exist (at least one).
    np.testing.assert_array_equal(
        to_numpy(kernel["query_seq_lengths"]), np.maximum(has_keys.sum(-1), 1)
    )
    keys = arguments.get("key_padding_mask", np.ones((3, key_length), bool))
    np.testing.assert_array_equal(
        to_numpy(kernel["key_value_seq_lengths"]), np.maximum(keys.sum(-1), 1)
    )
    assert kernel["is_causal"] == arguments.get("is_causal", False)
    window = arguments.get("sliding_window")
    assert kernel["local_window_size"] == (None if window is None else (window - 1, 0))


def test_a_window_that_leaves_every_query_a_key_passes_no_lengths():
    form = lengths_form(None, components(causal=True, sliding_window=3), 1.0)
    kernel, rows = kernel_arguments(form, 2, 8, 8)
    assert rows is None
    assert "query_seq_lengths" not in kernel and "key_value_seq_lengths" not in kernel


@pytest.mark.parametrize(
    "given, scale",
    [
        ({"mask": np.ones((1, 1, 4, 6), bool)}, 1.0),  # an explicit mask
        ({"causal": True, "causal_offset": 2}, 1.0),
        ({"sliding_window": 2, "key_padding_mask": np.ones((1, 6), bool)}, 1.0),
        ({"causal": True, "sliding_window": 2.5}, 1.0),
        ({"causal": True}, 1.0),  # the causal kernel alone: Keras's call
        ({}, 1.0),
        ({"key_padding_mask": np.ones((1, 6), bool)}, "tensor"),
    ],
    ids=[
        "explicit_mask",
        "causal_offset",
        "symmetric_window",
        "float_window",
        "causal_only",
        "no_mask",
        "tensor_scale",
    ],
)
def test_calls_the_lengths_cannot_express(given, scale):
    given = dict(given)
    mask = given.pop("mask", None)
    if scale == "tensor":
        scale = keras.ops.convert_to_tensor(0.5)
    assert lengths_form(mask, components(**given), scale) is None


def test_calls_the_lengths_express():
    padding = np.ones((2, 6), bool)
    form = lengths_form(
        None,
        components(key_padding_mask=padding, causal=True, sliding_window=4),
        0.25,
    )
    assert form == {
        "key_padding_mask": padding,
        "query_padding_mask": None,
        "causal": True,
        "sliding_window": 4,
    }
    assert lengths_form(None, components(causal=True, sliding_window=4), 1.0)


# -- right padding --------------------------------------------------------------------

PADDING_CASES = {
    "right": (lengths_mask([5, 2, 0], 5), True),
    "full": (np.ones((2, 5), bool), True),
    "empty": (np.zeros((2, 5), bool), True),
    "left": (np.array([[False, False, True, True, True]] * 2), False),
    "one_left_row": (
        np.array([[True, True, False, False, False], [False, True, True, True, True]]),
        False,
    ),
    "hole": (np.array([[True, False, True, True, False]]), False),
    "last_only": (np.array([[False, False, False, False, True]]), False),
}


@pytest.mark.parametrize("case", list(PADDING_CASES))
def test_right_padding_is_recognised_eagerly_and_under_jit(case):
    import jax

    padding, expected = PADDING_CASES[case]
    assert concrete_right_padded(padding) is expected
    assert concrete_right_padded(keras.ops.convert_to_tensor(padding)) is expected
    assert bool(right_padded(padding)) is expected

    def traced(mask):
        assert concrete_right_padded(mask) is None  # unknown while traced
        return right_padded(mask)

    assert bool(jax.jit(traced)(padding)) is expected


# -- dot_product_attention's lengths call ---------------------------------------------


@pytest.fixture
def lengths_calls(monkeypatch):
    """A lengths kernel that "runs" (with `implementation="xla"`, which the
    CPU has), and the keyword arguments of every call of
    `jax.nn.dot_product_attention` made with lengths or a window."""
    import jax

    monkeypatch.setattr(
        attention_module, "lengths_kernel_implementation", lambda *a, **k: "xla"
    )
    calls = []
    original = jax.nn.dot_product_attention

    def recording(*args, **kwargs):
        if "local_window_size" in kwargs:  # keras_attn's call, not Keras's
            calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
    return calls


def heads(batch, query_length, key_length, query_heads=4, key_heads=4):
    q = RNG.normal(size=(batch, query_length, query_heads, 8)).astype("float32")
    k = RNG.normal(size=(batch, key_length, key_heads, 8)).astype("float32")
    v = RNG.normal(size=(batch, key_length, key_heads, 8)).astype("float32")
    return q, k, v


ATTENTION_CASES = {
    "key_padding": {"key_padding_mask": lengths_mask([7, 3, 0], 7)},
    "query_padding": {"query_padding_mask": lengths_mask([5, 1, 0], 5)},
    "padding_causal": {
        "key_padding_mask": lengths_mask([7, 3, 1], 7),
        "query_padding_mask": lengths_mask([5, 2, 0], 5),
        "is_causal": True,
    },
    "causal_window": {"is_causal": True, "sliding_window": 2},
    "window_and_padding": {
        "key_padding_mask": lengths_mask([7, 2, 0], 7),
        "is_causal": True,
        "sliding_window": 3,
    },
    "shared_key_padding": {"key_padding_mask": lengths_mask([4], 7)},  # (1, Tk)
    "key_padding_in_the_mask": {"mask": lengths_mask([7, 3, 0], 7)[:, None, None]},
}


def call_arguments(case, as_tensors=False):
    arguments = dict(ATTENTION_CASES[case])
    if as_tensors:
        arguments = {
            name: keras.ops.convert_to_tensor(x) if isinstance(x, np.ndarray) else x
            for name, x in arguments.items()
        }
    return arguments


def attention_and_gradients(arguments, q, k, v, jit, **options):
    """`dot_product_attention`'s outputs and the gradients of a weighted sum
    of them with respect to the query, key and value."""
    import jax

    weights = np.random.default_rng(0).normal(size=q.shape[:3] + v.shape[3:])
    # Tensors are traced under `jit`; flags and window sizes stay static.
    masks = {n: x for n, x in arguments.items() if not isinstance(x, (bool, int))}
    options.update({n: x for n, x in arguments.items() if n not in masks})

    def loss(q, k, v, masks):
        outputs = dot_product_attention(q, k, v, **masks, **options)
        return keras.ops.sum(outputs * weights), outputs

    function = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    function = jax.jit(function) if jit else function
    (_, outputs), gradients = function(q, k, v, masks)
    return to_numpy(outputs), [to_numpy(g) for g in gradients]


@pytest.mark.parametrize("key_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_the_lengths_call_equals_the_explicit_path(case, jit, key_heads, lengths_calls):
    # Cross-attention (Tq = 5 < Tk = 7) for padding alone, else Tq = Tk = 7.
    query_length = 5 if case in ("key_padding", "query_padding") else 7
    arguments = call_arguments(case)
    q, k, v = heads(3, query_length, 7, key_heads=key_heads)
    if case == "query_padding":
        arguments["query_padding_mask"] = lengths_mask([5, 1, 0], query_length)
    if case == "padding_causal":
        arguments["query_padding_mask"] = lengths_mask([5, 2, 0], query_length)
    got, got_gradients = attention_and_gradients(arguments, q, k, v, jit)
    expected, expected_gradients = attention_and_gradients(
        arguments, q, k, v, jit=False, flash_attention=False
    )
    # The explicit path never calls JAX's attention: every call is the
    # lengths call, with no mask or bias, only (B,) lengths.
    assert len(lengths_calls) == 1, lengths_calls
    call = lengths_calls[0]
    assert call.get("mask") is None and call.get("bias") is None
    for name in ("query_seq_lengths", "key_value_seq_lengths"):
        if name in call:
            assert tuple(call[name].shape) == (3,)
    assert call["implementation"] == "xla"
    np.testing.assert_allclose(got, expected, atol=1e-5)
    visible = numpy_visible(
        {
            "key_padding_mask": np.broadcast_to(
                arguments.get(
                    "key_padding_mask",
                    arguments["mask"][:, 0, 0] if "mask" in arguments else True,
                ),
                (3, 7),
            ),
            **{
                n: x
                for n, x in arguments.items()
                if n not in ("key_padding_mask", "mask")
            },
        },
        query_length,
        7,
        3,
    )
    np.testing.assert_array_equal(got[~visible.any(-1)], 0.0)  # rows with no keys
    for got_gradient, expected_gradient in zip(
        got_gradients, expected_gradients, strict=True
    ):
        np.testing.assert_allclose(got_gradient, expected_gradient, atol=1e-5)


NOT_RIGHT_PADDED = {
    "left": np.array([[False, False, True, True, True, True, True]] * 3),
    "hole": np.array([[True, True, False, True, True, False, False]] * 3),
    "one_row_left": np.concatenate(
        [lengths_mask([7, 3], 7), [[False, False, False, True, True, True, True]]]
    ),
}


@pytest.mark.parametrize("long", [False, True], ids=["short", "long"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", list(NOT_RIGHT_PADDED))
def test_padding_that_is_not_right_padding_is_never_taken_as_lengths(
    case, jit, long, lengths_calls, monkeypatch
):
    """Eagerly the lengths call is not made; under `jax.jit` the conditional
    takes the other branch: either way the outputs and gradients are the
    explicit path's (as lengths, these masks would give others). From the
    switch-over length the other branch is the memory-efficient path."""
    taken = []
    original = attention_module.memory_efficient_attention

    def memory_efficient(*args, **kwargs):
        taken.append("memory_efficient")
        return original(*args, **kwargs)

    monkeypatch.setattr(
        attention_module, "memory_efficient_attention", memory_efficient
    )
    if long:
        monkeypatch.setattr(attention_module, "switch_over_length", lambda dtype: 4)
    q, k, v = heads(3, 7, 7)
    arguments = {"key_padding_mask": NOT_RIGHT_PADDED[case], "is_causal": True}
    got, got_gradients = attention_and_gradients(arguments, q, k, v, jit)
    expected, expected_gradients = attention_and_gradients(
        arguments, q, k, v, jit=False, flash_attention=False
    )
    np.testing.assert_allclose(got, expected, atol=1e-5)
    for got_gradient, expected_gradient in zip(
        got_gradients, expected_gradients, strict=True
    ):
        np.testing.assert_allclose(got_gradient, expected_gradient, atol=1e-5)
    # Traced, both branches are built; eagerly only the one taken.
    assert len(lengths_calls) == (1 if jit else 0)
    assert bool(taken) == long
    # The same mask as lengths would not give these outputs.
    as_lengths = lengths_mask(NOT_RIGHT_PADDED[case].sum(-1), 7)
    wrong, _ = attention_and_gradients(
        {**arguments, "key_padding_mask": as_lengths}, q, k, v, jit=False
    )
    assert np.abs(wrong - expected).max() > 1e-3


def test_without_a_lengths_kernel_the_fused_call_is_keras_with_one_mask(monkeypatch):
    """Where no lengths kernel runs (a CPU: the cuDNN call does not compile),
    a fused call is Keras's with the masks combined, as before."""
    import jax

    assert (
        lengths_kernel_implementation(
            *heads(2, 5, 7)[:3], lengths=True, is_causal=False, window=None
        )
        is None
    )
    monkeypatch.setattr(attention_module, "fused_kernel_runs", lambda *a, **k: True)
    masks = []
    original = jax.nn.dot_product_attention

    def recording(*args, **kwargs):
        masks.append(kwargs.get("mask"))
        return original(*args, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
    q, k, v = heads(2, 5, 7)
    padding = lengths_mask([7, 3], 7)
    got = to_numpy(dot_product_attention(q, k, v, key_padding_mask=padding))
    expected = to_numpy(
        dot_product_attention(q, k, v, key_padding_mask=padding, flash_attention=False)
    )
    np.testing.assert_allclose(got, expected, atol=1e-5)
    assert len(masks) == 1 and tuple(masks[0].shape) == (2, 1, 5, 7)


def test_dropout_and_weights_keep_their_paths(lengths_calls):
    q, k, v = heads(2, 5, 7)
    padding = lengths_mask([7, 3], 7)
    dot_product_attention(q, k, v, key_padding_mask=padding, return_weights=True)
    dot_product_attention(
        q,
        k,
        v,
        key_padding_mask=padding,
        dropout_rate=0.5,
        training=True,
        seed_generator=keras.random.SeedGenerator(0),
    )
    assert lengths_calls == []


@pytest.mark.parametrize("case", ["right", "left"])
def test_under_jit_the_masks_values_choose_the_branch(case, lengths_calls, monkeypatch):
    """The conditional runs the lengths call for right padding and the other
    branch for left padding: a lengths call marked by a constant shows which
    one ran."""
    import jax

    original = attention_module.attention_with_lengths
    monkeypatch.setattr(
        attention_module,
        "attention_with_lengths",
        lambda *args: original(*args) + 100.0,
    )
    padding = (
        lengths_mask([7, 3], 7)
        if case == "right"
        else np.array([[True] * 7, [False] * 4 + [True] * 3])
    )
    q, k, v = heads(2, 7, 7)
    got = to_numpy(
        jax.jit(lambda q, k, v, p: dot_product_attention(q, k, v, key_padding_mask=p))(
            q, k, v, padding
        )
    )
    expected = to_numpy(
        dot_product_attention(q, k, v, key_padding_mask=padding, flash_attention=False)
    )
    np.testing.assert_allclose(
        got, expected + (100.0 if case == "right" else 0.0), atol=1e-4
    )


def test_a_layer_with_a_right_padded_value_mask_makes_the_lengths_call(lengths_calls):
    from keras_attn.layers import MultiHeadAttention

    query = RNG.normal(size=(3, 5, 16)).astype("float32")
    value = RNG.normal(size=(3, 7, 16)).astype("float32")
    value_mask = lengths_mask([7, 2, 0], 7)
    layer = MultiHeadAttention(num_heads=2, key_dim=8)
    got = to_numpy(layer(query, value, value_mask=value_mask))
    assert len(lengths_calls) == 1
    assert lengths_calls[0].get("mask") is None
    layer.flash_attention = False
    expected = to_numpy(layer(query, value, value_mask=value_mask))
    np.testing.assert_allclose(got, expected, atol=1e-5)
    np.testing.assert_array_equal(got[2], 0.0)  # no keys: no output bias either
