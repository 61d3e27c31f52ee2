"""Differential property tests: keras-attn's attention layers against Keras's.

`keras_attn.layers.MultiHeadAttention` against `keras.layers.MultiHeadAttention`
and `keras_attn.layers.GroupedQueryAttention` against
`keras.layers.GroupQueryAttention`, with weights copied from Keras's layer
(`set_weights(get_weights())`). Hypothesis draws the structure of the layers
from a small set (built layer pairs are cached per structure, dtype policy,
`flash_attention` and `sliding_window`) and, per example, the data: batch,
lengths (mostly 1-40, some up to 300 across the memory-efficient path's
256-query blocks), values, every mask form Keras takes (explicit
`attention_mask` of rank 2, 3 and 4 with broadcast axes, `query_mask`,
`value_mask`, `key_mask` arguments, Keras masks of the inputs from
`keras.layers.Masking`), padding masks with fully masked rows,
`use_causal_mask`, `return_attention_scores`.

The reference is Keras's layer in float32 (Keras's `flash_attention=None`,
its automatic choice; Keras's `True` means "fused kernel or error", which on
a CPU is an error, so the reference never takes it). keras-attn's layer runs
under float32 (compared to ~1e-5 of the output scale), mixed_float16 and
mixed_bfloat16 (compared to the float32 reference within the measured
rounding error of those policies).

Documented differences (docs/COMING_FROM_KERAS.md, "Where keras-attn
deliberately differs") are asserted as documented:

- a query row with no key left (every key masked, all heads) is a zero row
  in keras-attn (Keras averages the values there): asserted zero, the other
  rows compared to Keras's; with a per-head mask, a head whose row has no
  key contributes zero weights (the reference is Keras's weights with those
  rows zeroed, pushed through Keras's own value and output projections);
- an explicit `query_mask` is combined with the query's Keras mask (Keras's
  `MultiHeadAttention` replaces the argument by the Keras mask): the
  reference is given the combination.

Malformed arguments: each one Keras refuses (at construction, build or
call), keras-attn refuses too, with a `ValueError`/`TypeError` naming the
argument and saying what it received; where keras-attn refuses an argument
Keras accepts, the case is listed in `STRICTER` with the reason.
"""

from __future__ import annotations

import atexit
import os

import keras
import numpy as np
import pytest
from hypothesis import example, given, note
from hypothesis import strategies as st

import keras_attn
from tests.property._peers import (
    NO_SHRINK,
    PEER_FACTOR,
    POLICIES,
    RELATIVE_TOLERANCE,
    check_close,
    padding_mask,
    relative_error,
)
from tests.property_settings import property_settings

BACKEND = keras.backend.backend()

# Allowed absolute error of the attention weights (in [0, 1]), per policy:
# the logits' rounding in half precision, through a softmax over logits of
# up to ~30 (inputs scaled by 3); or `PEER_FACTOR` times the error of
# Keras's own weights under the policy, if larger.
WEIGHTS_TOLERANCE = {
    "float32": 2e-5,
    "mixed_float16": 1e-2,
    "mixed_bfloat16": 6e-2,
}

# Lengths: mostly short, some long ones around the memory-efficient path's
# 256-query block (none a multiple of 8 by construction of the long ones).
LENGTHS = st.one_of(
    st.integers(1, 12),
    st.integers(1, 40),
    st.integers(1, 40),
    st.sampled_from([41, 57, 97, 129, 255, 257, 263, 299]),
)
BATCHES = st.integers(1, 3)

# JAX compiles every eager op for each new shape (~0.5-3 s a layer call on
# these machines), and reuses the compiled op for a shape seen before (~5
# ms): there the examples draw from a few shapes, and a tenth as many.
JAX_SHARE = 0.1
JAX_LENGTH_PAIRS = ((1, 1), (13, 13), (13, 37), (37, 13), (257, 37))
JAX_STRUCTURES = {"mha": (0, 2, 4, 5), "gqa": (0, 2, 4)}
if BACKEND == "jax":
    BATCHES = st.just(2)


def count(examples: int) -> int:
    """The default run's examples for this backend."""
    return max(1, round(examples * JAX_SHARE)) if BACKEND == "jax" else examples


# The forms of `attention_mask` Keras takes for rank-3 inputs ("B": batch,
# "N": heads, "T": query length, "S": key length, "1": broadcast).
ATTENTION_FORMS = (
    None,
    "TS",
    "BTS",
    "B1S",
    "1TS",
    "BT1",
    "BNTS",
    "B11S",
    "11TS",
    "B1TS",
)
QUERY_MASK_SOURCES = (None, "argument", "keras", "both")


# -- the layers, built once per structure --------------------------------------

# MultiHeadAttention structures: (num_heads, key_dim, value_dim, use_bias,
# use_gate, output_shape, query width, value width, key width or None: the
# key is the value).
MHA_STRUCTURES = (
    (1, 8, None, True, False, None, 8, 8, None),
    (2, 4, None, False, False, None, 8, 8, None),
    (3, 5, 7, True, False, None, 12, 6, None),
    (4, 16, None, True, True, None, 16, 16, None),
    (2, 3, None, True, False, 10, 6, 9, 5),
    (8, 2, None, True, False, None, 16, 16, 16),
    (4, 1, None, True, False, None, 5, 5, None),
    (2, 32, None, False, True, None, 7, 7, 3),
)
# GroupQueryAttention structures: (head_dim, num_query_heads,
# num_key_value_heads, use_bias, use_gate, query width, value width, key
# width or None).
GQA_STRUCTURES = (
    (8, 4, 2, True, False, 16, 16, None),
    (4, 6, 3, False, False, 12, 8, None),
    (5, 3, 1, True, False, 7, 7, 9),
    (16, 8, 8, True, True, 16, 16, None),
    (2, 4, 1, True, True, 6, 10, None),
    (3, 2, 2, False, False, 5, 5, 5),
)

# The largest relative errors seen, per policy (printed at exit with
# KERAS_ATTN_PRINT_ERRORS=1: how the tolerances above were measured).
MAX_ERRORS: dict = {}
if os.environ.get("KERAS_ATTN_PRINT_ERRORS"):
    atexit.register(lambda: print("max relative errors:", MAX_ERRORS))

# KERAS_ATTN_NO_SHRINK=1: report the first failing example as drawn (while
# debugging: shrinking examples that build layers takes minutes).

_KERAS_LAYERS: dict = {}
_OUR_LAYERS: dict = {}


def _initializers(index):
    return dict(
        kernel_initializer=keras.initializers.GlorotUniform(seed=index),
        bias_initializer=keras.initializers.RandomNormal(stddev=0.3, seed=index),
    )


def _mha_arguments(structure, window):
    heads, key_dim, value_dim, bias, gate, output_shape, *_ = structure
    return dict(
        num_heads=heads,
        key_dim=key_dim,
        value_dim=value_dim,
        use_bias=bias,
        use_gate=gate,
        output_shape=output_shape,
        sliding_window=window,
    )


def _gqa_arguments(structure, window):
    head_dim, query_heads, kv_heads, bias, gate, *_ = structure
    return dict(
        head_dim=head_dim,
        num_query_heads=query_heads,
        num_key_value_heads=kv_heads,
        use_bias=bias,
        use_gate=gate,
        sliding_window=window,
    )


def _widths(kind, structure):
    return structure[-3:]


def keras_layer(kind, index, window, policy):
    """Keras's layer under `policy` with the float32 reference's weights
    (its own rounding error calibrates the tolerance); cached."""
    key = (kind, index, window, policy)
    if key not in _KERAS_LAYERS:
        theirs = _KERAS_LAYERS[kind, index, window]
        arguments = (_mha_arguments if kind == "mha" else _gqa_arguments)(
            (MHA_STRUCTURES if kind == "mha" else GQA_STRUCTURES)[index], window
        )
        peer = type(theirs)(**arguments, dtype=policy)
        peer.build(*theirs._keras_attn_test_shapes)
        peer.set_weights(theirs.get_weights())
        _KERAS_LAYERS[key] = peer
    return _KERAS_LAYERS[key]


def layer_pair(kind, index, policy, flash, window):
    """`(keras_layer, our_layer)`: Keras's float32 layer (flash_attention None)
    and keras-attn's under `policy` with Keras's weights; cached."""
    structures = MHA_STRUCTURES if kind == "mha" else GQA_STRUCTURES
    structure = structures[index]
    query_width, value_width, key_width = _widths(kind, structure)
    shapes = (
        (1, 2, query_width),
        (1, 3, value_width),
        (1, 3, value_width if key_width is None else key_width),
    )
    arguments = (_mha_arguments if kind == "mha" else _gqa_arguments)(structure, window)
    keras_class, our_class = (
        (keras.layers.MultiHeadAttention, keras_attn.layers.MultiHeadAttention)
        if kind == "mha"
        else (keras.layers.GroupQueryAttention, keras_attn.layers.GroupedQueryAttention)
    )
    keras_key = (kind, index, window)
    if keras_key not in _KERAS_LAYERS:
        theirs = keras_class(**arguments, **_initializers(index), dtype="float32")
        theirs.build(*shapes)
        theirs._keras_attn_test_shapes = shapes
        _KERAS_LAYERS[keras_key] = theirs
    theirs = _KERAS_LAYERS[keras_key]
    our_key = (kind, index, policy, flash, window)
    if our_key not in _OUR_LAYERS:
        ours = our_class(**arguments, flash_attention=flash, dtype=policy)
        ours.build(*shapes)
        ours.set_weights(theirs.get_weights())
        _OUR_LAYERS[our_key] = ours
    return theirs, _OUR_LAYERS[our_key]


# -- masks -----------------------------------------------------------------------


def _attention_mask(rng, form, batch, heads, query_length, key_length):
    """`(mask in its form, the same broadcast to (B, N, T, S))`."""
    sizes = {"B": batch, "N": heads, "T": query_length, "S": key_length, "1": 1}
    shape = tuple(sizes[c] for c in form)
    mask = rng.random(shape) < rng.choice([0.3, 0.7, 0.95])
    if "T" in form and rng.random() < 0.5:  # some query rows with no key
        rows = rng.random(query_length) < 0.3
        index = [slice(None)] * len(form)
        index[form.index("T")] = rows
        mask[tuple(index)] = False
    full = mask
    while full.ndim < 4:  # Keras's rule: missing axes before the query axis
        full = np.expand_dims(full, -3)
    return mask, np.broadcast_to(full, (batch, heads, query_length, key_length))


def _band(query_length, key_length, causal, window):
    i = np.arange(query_length)[:, None]
    j = np.arange(key_length)[None, :]
    band = np.ones((query_length, key_length), bool)
    if causal:
        band &= j <= i
    if window is not None:
        band &= np.abs(i - j) < window
    return band


@st.composite
def attention_cases(draw, kind):
    structures = MHA_STRUCTURES if kind == "mha" else GQA_STRUCTURES
    if BACKEND == "jax":  # a few structures and lengths (see JAX_SHARE)
        index = draw(st.sampled_from(JAX_STRUCTURES[kind]))
        query_length, key_length = draw(st.sampled_from(JAX_LENGTH_PAIRS))
    else:
        index = draw(st.integers(0, len(structures) - 1))
        query_length, key_length = draw(LENGTHS), draw(LENGTHS)
    structure = structures[index]
    query_width, value_width, key_width = _widths(kind, structure)
    self_attention = (
        key_width is None and query_width == value_width and draw(st.booleans())
    )
    if self_attention:
        key_length = query_length
    if BACKEND == "tensorflow" and kind == "mha" and structure[1] == 1:
        # Keras's EinsumDense("abc,cde->abde", bias_axes="de") is wrong on
        # TensorFlow for a head size of 1 and as many positions as heads
        # (Keras 3.15: its output is off by ~0.1 from einsum + bias; keras-
        # attn's projection is right): no such reference is drawn.
        query_length += query_length == structure[0]
        key_length += key_length == structure[0]
    forms = (
        ATTENTION_FORMS
        if kind == "mha"
        else tuple(f for f in ATTENTION_FORMS if f != "BNTS")
    )
    flash = draw(st.sampled_from([None, False, True]))
    return dict(
        kind=kind,
        index=index,
        policy=draw(st.sampled_from(POLICIES)),
        flash=flash,
        window=draw(st.sampled_from([None, None, 1, 2, 5, 33])),
        batch=draw(BATCHES),
        query_length=query_length,
        key_length=key_length,
        self_attention=self_attention,
        causal=draw(st.booleans()),
        attention_form=draw(st.sampled_from(forms)),
        value_mask=draw(st.sampled_from([None, "suffix", "random", "empty"])),
        key_mask=draw(st.sampled_from([None, None, "random", "empty"])),
        value_keras_mask=draw(st.booleans()),
        query_mask=draw(st.sampled_from(QUERY_MASK_SOURCES)),
        query_style=draw(st.sampled_from(["suffix", "random", "empty"])),
        # Keras given the same arguments (rank <= 3 forms), not the combined mask.
        same_arguments=draw(st.booleans()),
        return_scores=flash is not True and draw(st.booleans()),
        scale=draw(st.sampled_from([1.0, 3.0])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _masked(x, mask):
    """`x` (zero at its padded positions) with `mask` as its Keras mask
    (through `keras.layers.Masking`, as an embedding's mask would come)."""
    assert np.all(x[~mask] == 0)
    return keras.layers.Masking(0.0)(keras.ops.convert_to_tensor(x))


def _check_close(got, want, policy, rows, what, allowed):
    return check_close(got, want, policy, rows, what, allowed, MAX_ERRORS)


def run_case(case):
    note(repr(case))
    kind, policy = case["kind"], case["policy"]
    theirs, ours = layer_pair(
        kind, case["index"], policy, case["flash"], case["window"]
    )
    structures = MHA_STRUCTURES if kind == "mha" else GQA_STRUCTURES
    query_width, value_width, key_width = _widths(kind, structures[case["index"]])
    heads = theirs.num_heads if kind == "mha" else theirs.num_query_heads
    rng = np.random.default_rng(case["seed"])
    batch, query_length, key_length = (
        case["batch"],
        case["query_length"],
        case["key_length"],
    )
    scale = case["scale"]
    query = (scale * rng.normal(size=(batch, query_length, query_width))).astype(
        "float32"
    )
    value = (
        query
        if case["self_attention"]
        else (scale * rng.normal(size=(batch, key_length, value_width))).astype(
            "float32"
        )
    )
    key = (
        None
        if key_width is None
        else (scale * rng.normal(size=(batch, key_length, key_width))).astype("float32")
    )

    # The truth: every mask of the call as (B, N, T, S), before causal/window.
    truth = np.ones((batch, heads, query_length, key_length), bool)
    our_kwargs, keras_kwargs = {}, {}
    form = case["attention_form"]
    if form is not None:
        mask, full = _attention_mask(rng, form, batch, heads, query_length, key_length)
        truth &= full
        our_kwargs["attention_mask"] = mask
    for name in ("value_mask", "key_mask"):
        if case[name] is not None:
            mask = padding_mask(rng, batch, key_length, case[name])
            truth &= mask[:, None, None, :]
            our_kwargs[name] = mask
    query_keras_mask = value_keras_mask = None
    source = case["query_mask"]
    if source in ("argument", "both"):
        mask = padding_mask(rng, batch, query_length, case["query_style"])
        truth &= mask[:, None, :, None]
        our_kwargs["query_mask"] = mask
    if source in ("keras", "both"):
        query_keras_mask = padding_mask(rng, batch, query_length, "random")
        truth &= query_keras_mask[:, None, :, None]
        # `keras.layers.Masking` zeroes what it masks: both layers get these.
        query = np.where(query_keras_mask[..., None], query, 0.0).astype("float32")
    if case["value_keras_mask"] and not case["self_attention"]:
        value_keras_mask = padding_mask(rng, batch, key_length, "random")
        if case["value_mask"] is None:  # an explicit `value_mask` replaces it
            truth &= value_keras_mask[:, None, None, :]
        value = np.where(value_keras_mask[..., None], value, 0.0).astype("float32")

    def inputs(for_keras):
        q, v = query, value
        if for_keras and not same:  # the combined mask holds them
            return q, v
        if query_keras_mask is not None:
            q = _masked(q, query_keras_mask)
        if value_keras_mask is not None:
            v = _masked(v, value_keras_mask)
        return q, v

    # Keras's arguments: the same ones where Keras's semantics are ours
    # (rank <= 3 masks; Keras's `MultiHeadAttention` ignores an explicit
    # `query_mask`, GroupQueryAttention honours it), else the combined mask.
    same = (
        case["same_arguments"]
        and (form is None or len(form) <= 3)
        and source
        in ((None, "keras", "argument") if kind == "gqa" else (None, "keras"))
    )
    if same:
        keras_kwargs = dict(our_kwargs)
    else:
        per_head = form == "BNTS"
        keras_kwargs["attention_mask"] = truth if per_head else truth[:, 0]
    band = _band(query_length, key_length, case["causal"], case["window"])
    valid = truth & band  # (B, N, T, S)
    head_has_key = valid.any(-1)  # (B, N, T)
    has_key = head_has_key.any(1)  # (B, T): keras-attn's nonzero rows
    mixed_heads = has_key & ~head_has_key.all(1)  # some heads with no key

    common = dict(use_causal_mask=case["causal"])
    # Keras's fused route fails on JAX when value_dim != key_dim (JAX's
    # kernel needs equal head sizes; documented): its explicit one, taken
    # when the scores are returned, is the reference there.
    unequal_heads = kind == "mha" and structures[case["index"]][2] not in (
        None,
        theirs.key_dim,
    )
    want_scores = bool(
        case["return_scores"]
        or mixed_heads.any()
        or (BACKEND == "jax" and unequal_heads)
    )
    keras_query, keras_value = inputs(True)
    keras_result = theirs(
        keras_query,
        keras_value,
        key=key,
        return_attention_scores=want_scores,
        **keras_kwargs,
        **common,
    )
    our_query, our_value = inputs(False)
    our_result = ours(
        our_query,
        our_value,
        key=key,
        return_attention_scores=case["return_scores"],
        **our_kwargs,
        **common,
    )
    if want_scores:
        keras_outputs, keras_scores = keras_result
        keras_scores = keras.ops.convert_to_numpy(keras_scores).astype("float32")
    else:
        keras_outputs = keras_result
    if case["return_scores"]:
        our_outputs, our_scores = our_result
        our_scores = keras.ops.convert_to_numpy(our_scores).astype("float32")
    else:
        our_outputs = our_result
    keras_outputs = keras.ops.convert_to_numpy(keras_outputs).astype("float32")
    our_outputs = keras.ops.convert_to_numpy(our_outputs).astype("float32")
    rows_shape = (batch, query_length)

    assert our_outputs.shape == keras_outputs.shape
    assert np.all(np.isfinite(our_outputs)), "non-finite outputs"
    # Documented: a query row with no key is a zero row.
    assert np.all(our_outputs[~has_key] == 0), "a row with no key is not zero"
    full_rows = has_key & ~mixed_heads
    allowed = RELATIVE_TOLERANCE[policy]
    allowed_weights = WEIGHTS_TOLERANCE[policy]
    if policy != "float32":
        peer = keras_layer(kind, case["index"], case["window"], policy)
        peer_query, peer_value = inputs(True)
        peer_outputs = peer(
            peer_query,
            peer_value,
            key=key,
            return_attention_scores=want_scores,
            **keras_kwargs,
            **common,
        )
        if want_scores:
            peer_outputs, peer_scores = peer_outputs
            if case["return_scores"]:
                rows = np.broadcast_to(head_has_key[..., None], keras_scores.shape)
                peer_scores = keras.ops.convert_to_numpy(peer_scores).astype("float32")
                peer_weights_error = float(
                    np.max(np.abs(peer_scores - keras_scores)[rows], initial=0.0)
                )
                if np.isfinite(peer_weights_error):
                    allowed_weights = max(
                        allowed_weights, PEER_FACTOR * peer_weights_error
                    )
        peer_error = relative_error(
            keras.ops.convert_to_numpy(peer_outputs).astype("float32"),
            keras_outputs,
            full_rows,
        )
        if np.isfinite(peer_error):
            MAX_ERRORS[f"Keras {policy}"] = max(
                MAX_ERRORS.get(f"Keras {policy}", 0.0), peer_error
            )
            allowed = max(allowed, PEER_FACTOR * peer_error)
    _check_close(our_outputs, keras_outputs, policy, full_rows, "outputs", allowed)
    if mixed_heads.any():
        # Documented: a head with no key gets zero weights; the reference is
        # Keras's weights with those rows zeroed, through Keras's projections.
        weights = np.where(head_has_key[..., None], keras_scores, 0.0)
        value_heads = keras.ops.convert_to_numpy(
            theirs._value_dense(keras.ops.convert_to_tensor(value))
        )
        if kind == "gqa":
            value_heads = np.repeat(value_heads, theirs.num_repeats, axis=2)
        attended = np.einsum("bnts,bsnh->btnh", weights, value_heads)
        if structures[case["index"]][4]:  # use_gate
            gate = keras.ops.convert_to_numpy(
                theirs._gate_dense(keras.ops.convert_to_tensor(query))
            )
            attended = attended * gate
        reference = keras.ops.convert_to_numpy(
            theirs._output_dense(keras.ops.convert_to_tensor(attended))
        )
        _check_close(
            our_outputs, reference, policy, mixed_heads, "per-head rows", allowed
        )
    assert rows_shape == our_outputs.shape[:2]
    if case["return_scores"]:
        assert np.all(np.isfinite(our_scores))
        # Documented: zero weights for a head's row with no key.
        assert np.all(our_scores[~head_has_key] == 0)
        rows = np.broadcast_to(head_has_key[..., None], our_scores.shape)
        error = float(np.max(np.abs(our_scores - keras_scores)[rows], initial=0.0))
        MAX_ERRORS[f"{policy} weights"] = max(
            MAX_ERRORS.get(f"{policy} weights", 0.0), error
        )
        assert error <= allowed_weights, (
            f"weights: error {error:.3g} > {allowed_weights:.3g}"
        )


pytestmark = pytest.mark.filterwarnings(
    "ignore:You are using a softmax over axis:UserWarning"
)


@given(attention_cases("mha"))
@property_settings(count(220), **NO_SHRINK)
@example(  # a fully masked query row under a causal window, on every path
    dict(
        kind="mha",
        index=0,
        policy="float32",
        flash=True,
        window=2,
        batch=2,
        query_length=257,
        key_length=5,
        self_attention=False,
        causal=True,
        attention_form="B1S",
        value_mask="empty",
        key_mask=None,
        value_keras_mask=False,
        query_mask="both",
        query_style="suffix",
        same_arguments=False,
        return_scores=False,
        scale=3.0,
        seed=7,
    )
)
def test_multi_head_attention_matches_keras(case):
    run_case(case)


@given(attention_cases("gqa"))
@property_settings(count(160), **NO_SHRINK)
def test_grouped_query_attention_matches_keras(case):
    run_case(case)


# -- malformed arguments ---------------------------------------------------------

# (argument, bad value): where keras-attn refuses what Keras accepts, and why.
STRICTER = {
    # Keras's checks take `isinstance(x, int)`, which a bool passes.
    ("num_heads", True): "a bool is not a head count",
    ("key_dim", True): "a bool is not a size",
    ("sliding_window", True): "a bool is not a window",
    # Keras drops a falsy `output_shape` (0, ()) as if it were None.
    ("output_shape", 0): "0 is not an output size",
    ("output_shape", ()): "an empty shape is not an output shape",
    # Keras's Dropout takes rate 1 (every weight dropped, the output all 0).
    ("dropout", 1.0): "a dropout rate is in [0, 1)",
    # Keras reads these by truthiness.
    ("flash_attention", "yes"): "None, True or False",
    ("flash_attention", 1): "None, True or False",
    ("use_gate", "yes"): "a bool",
    ("seed", "x"): "an int or None",
    # Keras's GroupQueryAttention does not check its sizes: a 0 or float size
    # builds empty or fails later, or not at all without dropout.
    ("head_dim", 0): "a positive int",
    ("head_dim", -1): "a positive int",
    ("head_dim", 2.5): "a positive int",
    ("num_query_heads", 0): "a positive int",
    ("num_query_heads", 2.0): "a positive int",
    ("num_key_value_heads", 2.0): "a positive int",
    # Keras's attention over the batch axis builds and runs.
    ("attention_axes", (0,)): "the batch axis is not an attention axis",
    # Calls: Keras broadcasts a mask larger than the scores against one query
    # (its output gets the mask's rows, no error), ignores an explicit
    # `query_mask` (MultiHeadAttention), and takes a (B, 1, S) value mask.
    ("attention_mask_queries",): "a (B, T + 2, S) mask does not fit T queries",
    ("query_mask_length",): "a (B, T + 1) query mask does not fit T queries",
    ("value_mask_rank",): "`value_mask` is (B, S), as documented",
    # On JAX Keras broadcasts a value of length 1 against a longer key.
    ("key_length",): "key and value of different lengths",
    # On PyTorch Keras builds a zero-size output axis, and broadcasts a query
    # batch of 1 against a larger value batch.
    ("output_shape", (2, 0)): "a zero-size output axis is not an output",
    ("value_batch",): "query, key and value of different batch sizes",
}

MHA_BAD = {
    "num_heads": [0, -2, 2.5, "4", None, True],
    "key_dim": [0, -1, 1.5, "8", None, True],
    "value_dim": [0, -4, 2.5, "8"],
    "dropout": [-0.1, 1.0, 1.5, "0.1"],
    "output_shape": [-1, 0, (), "a", (2, 0)],
    "attention_axes": ["x", 1.5, 5, (0,)],
    "sliding_window": [0, -1, 2.0, "3", True],
    "flash_attention": ["yes", 1],
    "kernel_initializer": ["no_such_initializer"],
    "bias_regularizer": ["no_such_regularizer"],
    "use_gate": ["yes"],
    "seed": ["x"],
}
GQA_BAD = {
    "head_dim": [0, -1, 2.5],
    "num_query_heads": [0, 3, 2.0],
    "num_key_value_heads": [0, -2, 3, 2.0],
    "dropout": [-0.1, 1.0, 1.5],
    "sliding_window": [0, -1, 2.0, True],
    "flash_attention": ["yes"],
    "kernel_initializer": ["no_such_initializer"],
}
MHA_VALID = dict(num_heads=2, key_dim=4)
GQA_VALID = dict(head_dim=4, num_query_heads=4, num_key_value_heads=2)


def _outcome(make):
    """The exception that constructing, building and calling raises, or None."""
    query = np.ones((2, 3, 8), "float32")
    value = np.ones((2, 4, 8), "float32")
    try:
        layer = make()
        layer(query, value)
        layer(query, value, use_causal_mask=True, training=True)
    except Exception as error:  # any refusal counts
        return error
    return None


def _names_argument(error, names):
    message = str(error)
    return "Received" in message and any(
        f"`{name}`" in message or f"{name}=" in message for name in names
    )


def check_refused_alike(keras_error, our_error, names, case):
    if keras_error is not None:
        assert our_error is not None, f"Keras refuses {case}, keras-attn does not"
        assert isinstance(our_error, (ValueError, TypeError)), repr(our_error)
        if isinstance(keras_error, (ValueError, TypeError)):
            # The same family: a ValueError where Keras raises one (a TypeError
            # of Keras's from comparing a str is a bad value here too).
            assert isinstance(our_error, ValueError) or isinstance(
                keras_error, TypeError
            ), (repr(keras_error), repr(our_error))
    elif our_error is not None:
        assert case in STRICTER, (
            f"keras-attn refuses {case}, which Keras accepts: {our_error!r}"
        )
    if our_error is not None:
        assert _names_argument(our_error, names), (
            f"the error for {case} does not name {names} with 'Received': {our_error}"
        )


@st.composite
def bad_constructor_arguments(draw):
    kind = draw(st.sampled_from(["mha", "gqa"]))
    table = MHA_BAD if kind == "mha" else GQA_BAD
    name = draw(st.sampled_from(sorted(table)))
    value = draw(st.sampled_from(table[name]))
    return kind, name, value


@given(bad_constructor_arguments())
@property_settings(count(40), **NO_SHRINK)
@example(("mha", "dropout", 0.2))  # flash_attention=True with dropout, below
@example(("gqa", "kernel_initializer", "no_such_initializer"))  # named since
@example(("gqa", "sliding_window", True))  # checked at construction since
def test_malformed_constructor_arguments_are_refused_as_keras_refuses(case):
    kind, name, value = case
    valid = dict(MHA_VALID if kind == "mha" else GQA_VALID)
    keras_class, our_class = (
        (keras.layers.MultiHeadAttention, keras_attn.layers.MultiHeadAttention)
        if kind == "mha"
        else (keras.layers.GroupQueryAttention, keras_attn.layers.GroupedQueryAttention)
    )
    arguments = {**valid, name: value}
    names = [name]
    if name == "dropout" and value == 0.2:
        arguments["flash_attention"] = True  # refused by both: no fused dropout
        names = ["flash_attention", "dropout"]
    if name in ("num_query_heads", "num_key_value_heads"):
        names = ["num_query_heads", "num_key_value_heads"]
    keras_error = _outcome(lambda: keras_class(**arguments))
    our_error = _outcome(lambda: our_class(**arguments))
    note(f"Keras: {keras_error!r}; keras-attn: {our_error!r}")
    check_refused_alike(keras_error, our_error, names, (name, value))
    if name == "dropout" and value == 0.2:
        assert keras_error is not None and our_error is not None


def _bad_call(kind, case, batch, query_length, key_length):
    """`(arguments, names)`: a call with one malformed input."""
    rng = np.random.default_rng(0)
    query = rng.normal(size=(batch, query_length, 8)).astype("float32")
    value = rng.normal(size=(batch, key_length, 8)).astype("float32")
    arguments = dict(query=query, value=value)
    if case == "key_length":
        arguments["key"] = rng.normal(size=(batch, key_length + 1, 8)).astype("float32")
        return arguments, ["key", "value"]
    if case == "query_width":
        arguments["query"] = query[..., :5]
        return arguments, ["query"]
    if case == "value_width":
        arguments["value"] = value[..., :5]
        return arguments, ["value"]
    if case == "query_rank":
        arguments["query"] = query[:, 0]
        return arguments, ["query"]
    if case == "value_batch":
        arguments["value"] = np.concatenate([value, value], axis=0)
        return arguments, ["value", "query"]
    shapes = {
        "attention_mask_keys": (batch, query_length, key_length + 1),
        "attention_mask_queries": (batch, query_length + 2, key_length),
        "attention_mask_rank5": (batch, 1, 1, query_length, key_length),
        "attention_mask_heads": (batch, 3, query_length, key_length),  # 4 heads
        "value_mask_length": (batch, key_length + 1),
        "value_mask_rank": (batch, 1, key_length),
        "key_mask_length": (batch, key_length + 3),
        "query_mask_length": (batch, query_length + 1),
    }
    name = case[: case.index("_mask") + len("_mask")]
    arguments[name] = np.ones(shapes[case], bool)
    return arguments, [name]


CALL_CASES = (
    "key_length",
    "query_width",
    "value_width",
    "query_rank",
    "value_batch",
    "attention_mask_keys",
    "attention_mask_queries",
    "attention_mask_rank5",
    "attention_mask_heads",
    "value_mask_length",
    "value_mask_rank",
    "key_mask_length",
    "query_mask_length",
)


@given(
    st.sampled_from(["mha", "gqa"]),
    st.sampled_from(CALL_CASES),
    st.integers(1, 3),
    st.integers(1, 9),
    st.integers(1, 9),
)
@property_settings(count(60), **NO_SHRINK)
# Regressions: keras-attn's layers failed inside a matmul (TensorFlow's
# InvalidArgumentError) on these once built; GroupedQueryAttention checked
# no mask shape.
@example("mha", "key_length", 2, 3, 4)
@example("mha", "query_width", 1, 1, 1)
@example("mha", "value_batch", 1, 1, 1)
@example("gqa", "key_length", 2, 3, 4)
@example("gqa", "attention_mask_keys", 2, 3, 4)
@example("gqa", "value_mask_length", 2, 3, 4)
@example("gqa", "query_mask_length", 2, 3, 4)
def test_malformed_call_inputs_are_refused_as_keras_refuses(
    kind, case, batch, query_length, key_length
):
    if kind == "mha":
        theirs = keras.layers.MultiHeadAttention(num_heads=4, key_dim=4)
        ours = keras_attn.layers.MultiHeadAttention(num_heads=4, key_dim=4)
    else:
        theirs = keras.layers.GroupQueryAttention(4, 4, 2)
        ours = keras_attn.layers.GroupedQueryAttention(4, 4, 2)
    shapes = ((1, 2, 8), (1, 3, 8))
    theirs.build(*shapes)
    ours.build(*shapes)
    arguments, names = _bad_call(kind, case, batch, query_length, key_length)
    errors = []
    for layer in (theirs, ours):
        try:
            layer(**arguments)
        except Exception as error:  # any refusal counts
            errors.append(error)
        else:
            errors.append(None)
    note(f"Keras: {errors[0]!r}; keras-attn: {errors[1]!r}")
    check_refused_alike(errors[0], errors[1], names, (case,))


# -- flash_attention against Keras's meaning of it ----------------------------------


@given(
    st.sampled_from(["mha", "gqa"]),
    st.sampled_from(["default", "disabled"]),
    st.sampled_from([None, False]),
    st.sampled_from([None, False, True]),
    st.booleans(),
    st.integers(0, 2**31 - 1),
)
@property_settings(count(16), **NO_SHRINK)
def test_flash_attention_settings_against_keras(
    kind, setting, keras_flash, our_flash, causal, seed
):
    """Keras's `flash_attention=False` (and None) is its automatic choice
    unless `keras.config.disable_flash_attention()` was called; keras-attn's
    None / False / True are its paths (True: the memory-efficient path where
    no fused kernel runs). Every combination gives Keras's outputs; Keras's
    own `True` on a CPU is an error (no fused kernel), keras-attn's is not."""
    rng = np.random.default_rng(seed)
    query = rng.normal(size=(2, 13, 8)).astype("float32")
    value = rng.normal(size=(2, 7, 8)).astype("float32")
    if kind == "mha":
        arguments = dict(num_heads=2, key_dim=4)
        keras_class, our_class = (
            keras.layers.MultiHeadAttention,
            keras_attn.layers.MultiHeadAttention,
        )
    else:
        arguments = dict(head_dim=4, num_query_heads=4, num_key_value_heads=2)
        keras_class, our_class = (
            keras.layers.GroupQueryAttention,
            keras_attn.layers.GroupedQueryAttention,
        )
    enabled = keras.config.is_flash_attention_enabled()
    if setting == "disabled":
        keras.config.disable_flash_attention()
    try:
        theirs = keras_class(**arguments, flash_attention=keras_flash)
        ours = our_class(**arguments, flash_attention=our_flash)
        theirs(query, value)
        ours(query, value)
        ours.set_weights(theirs.get_weights())
        mask = rng.random((2, 13, 7)) < 0.8
        mask[:, 0] = False  # a row with no key: zero in keras-attn
        want = keras.ops.convert_to_numpy(
            theirs(query, value, attention_mask=mask, use_causal_mask=causal)
        )
        got = keras.ops.convert_to_numpy(
            ours(query, value, attention_mask=mask, use_causal_mask=causal)
        )
        rows = (mask & np.tril(np.ones((13, 7), bool)) if causal else mask).any(-1)
        np.testing.assert_allclose(got[rows], want[rows], rtol=0, atol=1e-5)
        assert np.all(got[~rows] == 0)
        # Keras's None and False read the global setting (None: automatic).
        assert theirs._flash_attention == (False if setting == "disabled" else None)
        if BACKEND in ("tensorflow", "jax") and kind == "mha" and not causal:
            forced = keras_class(**arguments, flash_attention=True)
            forced.build(query.shape, value.shape)
            with pytest.raises((ValueError, RuntimeError)):
                forced(query, value)
    finally:
        if setting == "disabled":
            if enabled is None:
                keras.config.enable_flash_attention()  # Keras 3.15: back to None
            assert keras.config.is_flash_attention_enabled() == enabled
