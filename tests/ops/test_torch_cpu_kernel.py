"""PyTorch's CPU flash kernel as keras-attn's fused path (PyTorch backend).

On a CPU, `torch.nn.functional.scaled_dot_product_attention` computes
attention in a blocked C++ kernel (linear memory, forward and backward)
where its dispatcher picks it; `keras.ops.dot_product_attention` calls it.
`dot_product_attention` takes it for the calls it runs with no `(Tq, Tk)`
tensor: no mask, the causal mask with no offset, key padding alone, and one
query with any mask.
"""

import keras
import numpy as np
import pytest

from keras_attn.ops import dot_product_attention, fused_kernel_runs
from tests.test_case import fresh_json, to_numpy

pytestmark = pytest.mark.torch_only

RNG = np.random.default_rng(3)


def _tensors(batch=2, queries=24, keys=24, heads=4, key_heads=4, width=8):
    return (
        RNG.normal(size=(batch, queries, heads, width)).astype("float32"),
        RNG.normal(size=(batch, keys, key_heads, width)).astype("float32"),
        RNG.normal(size=(batch, keys, key_heads, width)).astype("float32"),
    )


def test_the_flash_kernel_is_claimed_only_without_a_whole_mask():
    import torch

    q = torch.zeros((2, 64, 4, 8))
    kv = torch.zeros((2, 64, 2, 8))
    assert fused_kernel_runs(q, q, q)
    assert fused_kernel_runs(q, q, q, is_causal=True)
    assert fused_kernel_runs(q, kv, kv)  # grouped key/value heads
    assert fused_kernel_runs(q, q, q, mask_shape=(2, 1, 1, 64))  # key padding
    assert fused_kernel_runs(q[:, :1], q, q, mask_shape=(2, 1, 1, 64))
    # A mask with both sequence axes whole would reach the kernel as a
    # (Tq, Tk) tensor of floats: not claimed.
    assert not fused_kernel_runs(q, q, q, mask_shape=(2, 1, 64, 64))
    assert not fused_kernel_runs(q, q, q, mask_shape=(1, 1, 64, 64))


def _key_padding():
    padding = np.ones((2, 24), bool)
    padding[0, 17:] = False
    padding[1, :] = False  # a row with no key at all: zero outputs
    return padding


def _query_padding():
    padding = np.ones((2, 24), bool)
    padding[1, 20:] = False
    return padding


# (arguments, whether the fused path runs them)
CASES = {
    "none": ({}, True),
    "causal": ({"is_causal": True}, True),
    "key_padding": ({"key_padding_mask": _key_padding()}, True),
    "grouped_key_padding": ({"key_padding_mask": _key_padding(), "groups": 2}, True),
    "query_padding": ({"query_padding_mask": _query_padding()}, False),
    "causal_key_padding": (
        {"is_causal": True, "key_padding_mask": _key_padding()},
        False,
    ),
    "explicit_mask": ({"mask": RNG.random((2, 1, 24, 24)) > 0.3}, False),
    "one_query_offset": (
        {"is_causal": True, "causal_offset": 9, "queries": 1},
        True,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_calls_take_the_flash_kernel_and_equal_the_explicit_path(case, monkeypatch):
    import torch

    arguments, fused = dict(CASES[case][0]), CASES[case][1]
    groups = arguments.pop("groups", 1)
    queries = arguments.pop("queries", 24)
    q, k, v = _tensors(queries=queries, key_heads=4 // groups)
    calls = []
    original = keras.ops.dot_product_attention

    def recording(*args, **kwargs):
        calls.append(kwargs.get("mask"))
        return original(*args, **kwargs)

    monkeypatch.setattr(keras.ops, "dot_product_attention", recording)

    def outputs_and_gradients(flash_attention):
        tensors = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
        outputs = dot_product_attention(
            *tensors, flash_attention=flash_attention, **arguments
        )
        weights = torch.arange(outputs.numel()).reshape(outputs.shape) / 100
        (outputs * weights).sum().backward()
        return [to_numpy(outputs.detach())] + [to_numpy(x.grad) for x in tensors]

    taken = outputs_and_gradients(None)
    assert bool(calls) == fused
    if fused and calls[0] is not None:
        # The mask reaches the kernel broadcast along the query axis.
        assert tuple(calls[0].shape)[2] == 1
    calls.clear()
    expected = outputs_and_gradients(False)
    assert not calls
    for got, want in zip(taken, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    if case in ("key_padding", "grouped_key_padding"):
        assert np.all(taken[0][1] == 0.0)  # the row with no key


def test_a_long_call_trains_in_linear_memory():
    """Forward and backward at 8,192 tokens, in a fresh process: the
    explicit path would hold 1 GiB of (Tq, Tk) weights per tensor."""
    result = fresh_json(
        """
        import json, resource, sys
        import torch
        from keras_attn.ops import dot_product_attention
        length = int(sys.argv[1])
        tensors = [torch.randn(1, length, 4, 16, requires_grad=True) for _ in range(3)]
        padding = torch.ones(1, length, dtype=torch.bool)
        padding[0, length - 100:] = False
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        outputs = dot_product_attention(*tensors, key_padding_mask=padding)
        outputs.sum().backward()
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({"growth_mib": (after - before) / 1024,
                          "finite": bool(torch.isfinite(tensors[0].grad).all())}))
        """,
        8192,
    )
    assert result["finite"]
    assert result["growth_mib"] < 200, result
