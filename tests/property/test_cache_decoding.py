"""Property tests: cached decoding equals the full causal forward pass.

`keras_attn.layers.MultiHeadAttention` (multi-head and grouped key/value
heads; no position, rotary positions or ALiBi; `sliding_window`; every
`flash_attention` setting) and `keras_attn.layers.GroupedQueryAttention`
decode a random sequence with a KV cache: a prompt of random length written
at index 0, then the rest token by token (or in chunks), each call at its
`cache_update_index` (an int or a scalar tensor), into a cache longer than
the sequence (tuple or keras-hub's stacked form). Each call's outputs must
equal the full causal pass over the whole sequence at the same positions
(float32, to 1e-5 of the outputs' scale). Ragged batches: left or right
padding given as `value_mask` over the cache (and `query_mask` on the full
pass's keys), the padded positions compared as the full pass gives them.
"""

from __future__ import annotations

import keras
import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from keras import ops

from keras_attn.layers import (
    AlibiBias,
    GroupedQueryAttention,
    MultiHeadAttention,
    RotaryEmbedding,
)
from tests.property_settings import property_settings
from tests.test_case import to_numpy

BACKEND = keras.backend.backend()
# Each new shape costs JAX compilations (the layers run op by op) and
# TensorFlow, eager, nothing: JAX draws fewer examples of each test.


def count(tensorflow: int, jax: int) -> int:
    """The default run's number of examples on this backend."""
    return tensorflow if BACKEND == "tensorflow" else jax


TOLERANCE = 1e-5  # of max(max |full pass|, 1), float32


@st.composite
def decoding_cases(draw, grouped_layer=False):
    heads = draw(st.sampled_from([1, 2, 3, 4]))
    key_value_heads = draw(
        st.sampled_from(
            ([] if grouped_layer else [None])
            + [n for n in (1, 2, 3, 4) if heads % n == 0]
        )
    )
    position = (
        "none" if grouped_layer else draw(st.sampled_from(["none", "rotary", "alibi"]))
    )
    head_dim = 2 * draw(st.integers(1, 8))  # even: rotary pairs the features
    length = draw(st.integers(1, 24))
    prompt = draw(st.integers(0, length))  # 0: every token decoded alone
    steps = []
    start = prompt
    while start < length:  # mostly single tokens, sometimes a chunk
        size = 1 if draw(st.integers(0, 3)) else draw(st.integers(1, length - start))
        steps.append(size)
        start += size
    return dict(
        heads=heads,
        key_value_heads=key_value_heads,
        position=position,
        head_dim=head_dim,
        width=draw(st.sampled_from([4, 8, 12])),
        batch=draw(st.integers(1, 3)),
        length=length,
        prompt=prompt,
        steps=steps,
        extra=draw(st.integers(0, 5)),  # cache positions past the sequence
        sliding_window=draw(st.one_of(st.none(), st.integers(1, length + 1))),
        flash_attention=draw(st.sampled_from([None, False, True])),
        padding=draw(st.sampled_from(["none", "none", "left", "right"])),
        stacked=draw(st.booleans()),
        tensor_index=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def make_layer(case, grouped_layer):
    if grouped_layer:
        return GroupedQueryAttention(
            case["head_dim"],
            case["heads"],
            case["key_value_heads"],
            sliding_window=case["sliding_window"],
            flash_attention=case["flash_attention"],
            seed=0,
        )
    positions = {
        "none": {},
        "rotary": {"rotary_embedding": RotaryEmbedding()},
        "alibi": {"alibi_bias": AlibiBias(alibi_bias_max=2)},  # steep slopes
    }[case["position"]]
    return MultiHeadAttention(
        case["heads"],
        case["head_dim"],
        num_key_value_heads=case["key_value_heads"],
        sliding_window=case["sliding_window"],
        flash_attention=case["flash_attention"],
        seed=0,
        **positions,
    )


def padding(case, rng, cache_length):
    """`(B, cache_length)` bool, the valid positions, or None."""
    if case["padding"] == "none":
        return None
    valid = np.ones((case["batch"], cache_length), bool)
    for b in range(case["batch"]):
        count = int(rng.integers(0, case["length"] + 1))
        if case["padding"] == "left":
            valid[b, : case["length"] - count] = False
        else:
            valid[b, count:] = False
    return valid


def check_decoding(case, grouped_layer):
    rng = np.random.default_rng(case["seed"])
    batch, length, width = case["batch"], case["length"], case["width"]
    x = rng.normal(size=(batch, length, width)).astype("float32")
    layer = make_layer(case, grouped_layer)
    cache_length = length + case["extra"]
    valid = padding(case, rng, cache_length)
    mask = {} if valid is None else {"value_mask": valid[:, :length]}
    full = to_numpy(layer(x, x, use_causal_mask=True, **mask))  # (B, T, width)
    assert np.isfinite(full).all()
    key_value_heads = case["key_value_heads"] or case["heads"]
    shape = (batch, cache_length, key_value_heads, case["head_dim"])
    if case["stacked"]:
        cache = np.zeros((batch, 2, *shape[1:]), "float32")
    else:
        cache = (np.zeros(shape, "float32"), np.zeros(shape, "float32"))
    bound = TOLERANCE * max(np.max(np.abs(full)), 1.0)
    start = 0
    for size in [case["prompt"], *case["steps"]]:
        if size == 0:
            continue
        index = ops.convert_to_tensor(start, "int32") if case["tensor_index"] else start
        chunk = x[:, start : start + size]
        mask = {} if valid is None else {"value_mask": valid}
        got, cache = layer(
            chunk,
            chunk,
            use_causal_mask=True,
            cache=cache,
            cache_update_index=index,
            **mask,
        )
        got = to_numpy(got)
        want = full[:, start : start + size]
        assert np.isfinite(got).all(), f"non-finite outputs at {start}"
        error = np.max(np.abs(got - want))
        assert error <= bound, (
            f"positions {start}..{start + size - 1}: error {error:.3g}"
        )
        start += size
    assert start == length


@given(case=decoding_cases())
@property_settings(count(100, 5))
def test_multi_head_attention_decoding_equals_the_full_pass(case):
    check_decoding(case, grouped_layer=False)


@given(case=decoding_cases(grouped_layer=True))
@property_settings(count(40, 2))
def test_grouped_query_attention_decoding_equals_the_full_pass(case):
    check_decoding(case, grouped_layer=True)


# -- the language model --------------------------------------------------------

VOCABULARY, CONTEXT = 37, 24
_MODELS = {}


def language_model(position, key_value_heads, sliding_window):
    """A small `TransformerLanguageModel`, built once per configuration."""
    from keras_attn.models import TransformerLanguageModel

    config = (position, key_value_heads, sliding_window)
    if config not in _MODELS:
        keras.utils.set_random_seed(len(_MODELS))
        _MODELS[config] = TransformerLanguageModel(
            vocabulary_size=VOCABULARY,
            sequence_length=CONTEXT,
            embedding_dim=16,
            num_layers=2,
            num_heads=4,
            intermediate_dim=32,
            dropout=0.0,
            position=position,
            num_key_value_heads=key_value_heads,
            sliding_window=sliding_window,
        )
    return _MODELS[config]


@st.composite
def language_model_cases(draw):
    length = draw(st.integers(1, CONTEXT))
    prompt = draw(st.integers(0, length))
    steps, start = [], prompt
    while start < length:
        size = 1 if draw(st.integers(0, 3)) else draw(st.integers(1, length - start))
        steps.append(size)
        start += size
    return dict(
        position=draw(st.sampled_from(["learned", "sinusoidal", "rotary", "alibi"])),
        # Eight models in all: grouped heads with a window, or neither.
        variant=draw(st.sampled_from([(None, None), (2, 3)])),
        batch=draw(st.integers(1, 2)),
        length=length,
        prompt=prompt,
        steps=steps,
        extra=draw(st.integers(0, CONTEXT - length)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@given(case=language_model_cases())
@property_settings(count(12, 1))
def test_language_model_decoding_equals_the_full_pass(case):
    model = language_model(case["position"], *case["variant"])
    rng = np.random.default_rng(case["seed"])
    # Ids from 1: 0 is padding.
    tokens = rng.integers(1, VOCABULARY, size=(case["batch"], case["length"]))
    tokens = tokens.astype("int32")
    full = to_numpy(model(tokens))  # (B, T, vocab) float32 logits
    cache = model.initial_cache(case["batch"], case["length"] + case["extra"])
    bound = TOLERANCE * max(np.max(np.abs(full)), 1.0)
    start = 0
    for size in [case["prompt"], *case["steps"]]:
        if size == 0:
            continue
        logits, cache = model.call_with_cache(
            tokens[:, start : start + size],
            cache,
            ops.convert_to_tensor(start, "int32"),
        )
        got = to_numpy(logits)
        assert np.isfinite(got).all()
        error = np.max(np.abs(got - full[:, start : start + size]))
        assert error <= bound, (
            f"positions {start}..{start + size - 1}: error {error:.3g}"
        )
        start += size
