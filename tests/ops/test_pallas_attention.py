"""Pallas's FlashAttention kernel as the float32 GPU path
(`keras_attn.ops.pallas_attention`): which calls it takes, its outputs and
gradients against the explicit path, and `dot_product_attention`'s choice.
No GPU here: the kernel runs in Pallas's interpreter (`mode="interpret"`),
the same kernel program that Triton compiles on a GPU, where
benchmarks/gpu_check.py's `float32` part measures it."""

from unittest import mock

import keras
import numpy as np
import pytest

import keras_attn.ops.pallas_attention as pallas_module
from keras_attn.ops import dot_product_attention
from keras_attn.ops.pallas_attention import (
    pallas_attention,
    pallas_form,
    pallas_runs,
    same_padding,
)
from tests.ops.test_sequence_lengths import components, lengths_mask
from tests.test_case import to_numpy

pytestmark = pytest.mark.jax_only

RNG = np.random.default_rng(11)
# Lengths that are not a multiple of the kernel's block of 128.
LENGTH = 150


def heads(batch, length, num_heads, head_dim):
    return RNG.normal(size=(batch, length, num_heads, head_dim)).astype("float32")


def form_of(
    query, key, value, mask=None, alibi=False, dropout=False, scale=0.25, **given
):
    return pallas_form(
        query,
        key,
        value,
        mask=mask,
        components=components(**given),
        scale=scale,
        alibi=alibi,
        dropout_active=dropout,
    )


def outputs_and_gradients(attend, inputs, upstream):
    import jax

    def run(q, k, v):
        outputs, pullback = jax.vjp(attend, q, k, v)
        return (outputs, *pullback(upstream))

    return [to_numpy(x) for x in jax.jit(run)(*inputs)]


def test_the_kernel_runs_only_on_a_gpu_without_a_distribution(monkeypatch):
    import jax

    assert pallas_runs() is None  # JAX on a CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert pallas_runs() == "gpu"
    devices = keras.distribution.list_devices()
    with keras.distribution.DataParallel(devices=devices).scope():
        assert pallas_runs() is None  # a Triton call is not split across devices


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padding", [None, "right", "left_and_empty_row"])
@pytest.mark.parametrize("key_heads", [4, 2])
def test_outputs_and_gradients_equal_the_explicit_path(causal, padding, key_heads):
    """Grouped key/value heads repeated, lengths padded to the block with a
    segment of their own, padding as segment ids: outputs and q/k/v
    gradients as the explicit path's, padded queries' rows zero."""
    batch, num_heads, head_dim = 3, 4, 16
    query = heads(batch, LENGTH, num_heads, head_dim)
    key = heads(batch, LENGTH, key_heads, head_dim)
    value = heads(batch, LENGTH, key_heads, head_dim)
    upstream = RNG.normal(size=query.shape).astype("float32")
    mask = None
    if padding == "right":
        mask = lengths_mask([LENGTH, 97, 1], LENGTH)
    elif padding == "left_and_empty_row":
        mask = np.zeros((batch, LENGTH), bool)
        mask[0, 30:] = True  # left padding
        mask[1, ::3] = True  # holes
        # Row 2: no key and no query at all.
    given = {"causal": causal}
    if mask is not None:
        given.update(key_padding_mask=mask, query_padding_mask=mask)
    with mock.patch.object(pallas_module, "MIN_KEY_LENGTH", 64):
        form = form_of(query, key, value, **given)
    assert form is not None

    def kernel(q, k, v):
        return pallas_attention(q, k, v, form, 0.25, mode="interpret")

    def explicit(q, k, v):
        return dot_product_attention(
            q,
            k,
            v,
            scale=0.25,
            is_causal=causal,
            key_padding_mask=mask,
            query_padding_mask=mask,
            flash_attention=False,
        )

    got = outputs_and_gradients(kernel, (query, key, value), upstream)
    want = outputs_and_gradients(explicit, (query, key, value), upstream)
    for name, g, w in zip(("outputs", "dq", "dk", "dv"), got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-4, err_msg=name)
    if mask is not None:
        assert np.all(got[0][~mask] == 0.0)
        assert np.all(got[1][~mask] == 0.0)


def test_which_calls_the_kernel_takes():
    query = heads(1, 4096, 2, 16)
    key_value = heads(1, 4096, 1, 16)
    padding = np.ones((1, 4096), bool)
    assert form_of(query, key_value, key_value) == {
        "key_padding_mask": None,
        "query_padding_mask": None,
        "causal": False,
    }
    assert form_of(query, key_value, key_value, causal=True)["causal"]
    assert form_of(
        query,
        key_value,
        key_value,
        key_padding_mask=padding,
        query_padding_mask=padding,
    )
    refused = {
        "an explicit mask": dict(mask=np.ones((1, 1, 4096, 4096), bool)),
        "a sliding window": dict(sliding_window=8, causal=True),
        "a causal offset": dict(causal=True, causal_offset=3),
        "ALiBi": dict(alibi=True),
        "dropout": dict(dropout=True),
        "a tensor scale": dict(scale=keras.ops.convert_to_tensor(0.25)),
        "key padding alone": dict(key_padding_mask=padding),
        "query padding alone": dict(query_padding_mask=padding),
    }
    for name, given in refused.items():
        assert form_of(query, key_value, key_value, **given) is None, name
    short = heads(1, 2048, 2, 16)
    assert form_of(short, short, short) is None  # below MIN_KEY_LENGTH
    assert form_of(query, heads(1, 4100, 2, 16), heads(1, 4100, 2, 16)) is None
    narrow = heads(1, 4096, 2, 8)
    assert form_of(narrow, narrow, narrow) is None  # below Triton's 16
    value_wider = heads(1, 4096, 1, 32)
    assert form_of(query, key_value, value_wider) is None
    half = query.astype("float16")
    assert form_of(half, half, half) is None  # cuDNN's


def test_same_padding():
    first = lengths_mask([5, 3], 6)
    assert same_padding(form_of_padding(None, None)) is True
    assert bool(to_numpy(same_padding(form_of_padding(first, first.copy()))))
    other = first.copy()
    other[1, 0] = False
    assert not bool(to_numpy(same_padding(form_of_padding(first, other))))


def form_of_padding(key_padding, query_padding):
    return {
        "key_padding_mask": key_padding,
        "query_padding_mask": query_padding,
        "causal": False,
    }


class TestDotProductAttentionTakesTheKernel:
    """`dot_product_attention` on a (pretend) GPU: the kernel where the
    memory-efficient path would run and the call qualifies, under `jax.jit`
    with the padding masks as program arguments (same masks: the kernel;
    different ones: the memory-efficient path, decided when it runs)."""

    @pytest.fixture
    def calls(self):
        made = []
        real = pallas_module.pallas_attention

        def counting(*args, **kwargs):
            made.append(args[3])
            return real(*args, **kwargs)

        with (
            mock.patch.object(pallas_module, "pallas_runs", lambda: "interpret"),
            mock.patch.object(pallas_module, "MIN_KEY_LENGTH", 64),
            mock.patch.object(pallas_module, "pallas_attention", counting),
        ):
            yield made

    def attend(self, query, key, value, flash_attention, **kwargs):
        import jax

        def call(q, k, v, key_padding_mask, query_padding_mask):
            return dot_product_attention(
                q,
                k,
                v,
                key_padding_mask=key_padding_mask,
                query_padding_mask=query_padding_mask,
                flash_attention=flash_attention,
                **kwargs,
            )

        return jax.jit(call)

    @pytest.mark.parametrize("same", [True, False])
    def test_padding_masks(self, calls, same):
        query, key, value = (heads(2, LENGTH, 2, 16) for _ in range(3))
        key_padding = lengths_mask([LENGTH, 90], LENGTH)
        query_padding = key_padding.copy()
        if not same:
            query_padding[1, 100:] = True  # queries past the keys
        got = self.attend(query, key, value, True)(
            query, key, value, key_padding, query_padding
        )
        want = self.attend(query, key, value, False)(
            query, key, value, key_padding, query_padding
        )
        np.testing.assert_allclose(to_numpy(got), to_numpy(want), atol=2e-5)
        # The program holds the kernel under a conditional either way.
        assert len(calls) == 1 and calls[0]["key_padding_mask"] is not None

    def test_unmasked_and_causal_calls(self, calls):
        query, key, value = (heads(2, LENGTH, 2, 16) for _ in range(3))
        for causal in (False, True):
            got = dot_product_attention(
                query, key, value, is_causal=causal, flash_attention=True
            )
            want = dot_product_attention(
                query, key, value, is_causal=causal, flash_attention=False
            )
            np.testing.assert_allclose(to_numpy(got), to_numpy(want), atol=2e-5)
        assert [form["causal"] for form in calls] == [False, True]

    def test_other_calls_keep_the_memory_efficient_path(self, calls):
        query, key, value = (heads(2, LENGTH, 2, 16) for _ in range(3))
        for kwargs in (
            dict(is_causal=True, sliding_window=16),
            dict(is_causal=True, causal_offset=2),
            dict(key_padding_mask=lengths_mask([LENGTH, 90], LENGTH)),
        ):
            got = dot_product_attention(
                query, key, value, flash_attention=True, **kwargs
            )
            want = dot_product_attention(
                query, key, value, flash_attention=False, **kwargs
            )
            np.testing.assert_allclose(to_numpy(got), to_numpy(want), atol=2e-5)
        explicit = dot_product_attention(query, key, value, flash_attention=False)
        assert explicit.shape == query.shape
        assert calls == []
