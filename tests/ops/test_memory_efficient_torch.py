"""The memory-efficient path on PyTorch's eager autograd: each step's
tensors are freed when its graph is, not when Python's cyclic garbage
collector next runs.

Keras's PyTorch `custom_gradient` keeps the backward closure on the autograd
node; a closure holding the very tensor the node returns is a reference
cycle (node → closure → tensor → node), which kept every training step's
saved blocks (about 40 MiB at 8k tokens) until a full collection: resident
memory grew step after step. The checks below run with the collector off,
so a cycle would keep the tensors alive for the rest of the test.
"""

import gc
import weakref

import numpy as np
import pytest

from keras_attn.ops import memory_efficient_attention
from keras_attn.ops.blocked_passes import _map, _scan, _scan_range_add

pytestmark = pytest.mark.torch_only

RNG = np.random.default_rng(5)


@pytest.fixture
def no_collector():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _inputs(length=96):
    import torch

    return tuple(
        torch.tensor(
            RNG.normal(size=(1, length, 2, 8)), dtype=torch.float32
        ).requires_grad_()
        for _ in range(3)
    )


@pytest.mark.parametrize("causal", [False, True])
def test_outputs_are_freed_with_their_graph(no_collector, causal):
    import torch

    query, key, value = _inputs()
    outputs = memory_efficient_attention(
        query, key, value, causal=causal, query_block_size=32, key_block_size=32
    )
    grads = torch.autograd.grad(torch.sum(outputs * outputs), (query, key, value))
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads)
    node = weakref.ref(outputs.grad_fn)
    alive = weakref.ref(outputs)
    del outputs
    assert alive() is None, "the outputs outlived their last reference (a cycle)"
    assert node() is None, "the autograd node outlived its outputs (a cycle)"


def test_outputs_in_float32_are_not_the_tensor_the_backward_pass_keeps(no_collector):
    # The float32 case is the one where a cast returns its input unchanged.
    import torch

    query, key, value = _inputs()
    outputs = memory_efficient_attention(query, key, value, query_block_size=32)
    alive = weakref.ref(outputs)
    torch.autograd.grad(outputs.sum(), (query,))
    del outputs
    assert alive() is None


def test_the_python_loops_equal_keras_ops_loops():
    # On PyTorch the block loops are Python loops (no `keras.tree` packing
    # per step); they compute what `ops.map` / `ops.scan` would.
    from keras import ops

    def equal(got, want):
        np.testing.assert_array_equal(
            ops.convert_to_numpy(got), ops.convert_to_numpy(want)
        )

    xs = (ops.arange(12, dtype="float32").reshape(4, 3), ops.arange(4, dtype="float32"))

    def element(elements):
        row, scalar = elements
        return row * scalar, ops.sum(row)

    mapped = _map(element, xs, num_outputs=2)
    expected = ops.map(element, xs)
    for got, want in zip(mapped, expected, strict=True):
        equal(got, want)

    def step(carry, elements):
        row, scalar = elements
        return carry + row, row * scalar

    carry, ys = _scan(step, ops.zeros((3,)), xs)
    want_carry, want_ys = ops.scan(step, ops.zeros((3,)), xs)
    equal(carry, want_carry)
    equal(ys, want_ys)

    def ranged(carry, elements, i):
        row, _ = elements
        return carry + row, row * 2.0

    rows = ops.convert_to_numpy(xs[0])
    total = np.full_like(rows, 0.5)
    half = ops.ones_like(xs[0]) * 0.5
    carry, summed = _scan_range_add(ranged, ops.zeros((3,)), xs, 1, 3, half)
    equal(carry, rows[1] + rows[2])
    expected = total.copy()
    expected[1:3] += 2.0 * rows[1:3]
    equal(summed, expected)
    # An empty range
    carry, summed = _scan_range_add(ranged, ops.zeros((3,)), xs, 2, 2, half)
    equal(carry, np.zeros(3))
    equal(summed, total)
