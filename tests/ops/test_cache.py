import numpy as np
import pytest
import tensorflow as tf

from keras_attn.ops import update_cache
from tests.test_case import to_numpy

CACHE = np.arange(2 * 5 * 3, dtype="float32").reshape(2, 5, 3)
UPDATE = -np.ones((2, 2, 3), "float32")


@pytest.mark.parametrize("index", [0, 2, 3])
def test_writes_rows_at_the_index(index):
    expected = CACHE.copy()
    expected[:, index : index + 2] = UPDATE
    np.testing.assert_array_equal(
        to_numpy(update_cache(CACHE, UPDATE, index)), expected
    )


@pytest.mark.tf_only
def test_index_tensor_traces_once_and_uses_core_ops_only():
    traces = []

    @tf.function(input_signature=[tf.TensorSpec([], tf.int32)])
    def write(index):
        traces.append(1)
        return update_cache(tf.constant(CACHE), tf.constant(UPDATE[:, :1]), index)

    for index in range(5):
        expected = CACHE.copy()
        expected[:, index] = UPDATE[:, 0]
        np.testing.assert_array_equal(write(tf.constant(index)).numpy(), expected)
    assert len(traces) == 1
    graph_ops = {n.op for n in write.get_concrete_function().graph.as_graph_def().node}
    assert not any(op.startswith("Xla") for op in graph_ops), graph_ops


@pytest.mark.tf_only
@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("static_length", [True, False])
@pytest.mark.parametrize(
    "index, written",
    [
        (1, {1: 0, 2: 1}),
        (3, {3: 0, 4: 1}),  # up to the last position
        (4, {4: 0}),  # the second row would fall past the end: not written
        (5, {}),  # wholly past the end
        (-1, {0: 1}),  # the first row would fall before position 0
    ],
)
def test_rows_outside_the_cache_are_not_written_on_tensorflow(
    index, written, static_length, jit_compile
):
    """TensorFlow writes only the rows that fall inside the cache: eagerly,
    from a traced index, for an update whose length is only known when it
    runs, and under XLA (`jit_compile=True`, as keras-hub compiles its
    decoding); the cache keeps its static shape."""
    update = -np.arange(1, 2 * 2 * 3 + 1, dtype="float32").reshape(2, 2, 3)
    expected = CACHE.copy()
    for position, row in written.items():
        expected[:, position] = update[:, row]

    @tf.function(
        input_signature=[
            tf.TensorSpec([], tf.int32),
            tf.TensorSpec([2, 2 if static_length else None, 3], tf.float32),
        ],
        jit_compile=jit_compile,
    )
    def write(index, update):
        result = update_cache(tf.constant(CACHE), update, index)
        assert result.shape == CACHE.shape
        return result

    np.testing.assert_array_equal(
        write(tf.constant(index), tf.constant(update)).numpy(), expected
    )
    np.testing.assert_array_equal(update_cache(CACHE, update, index).numpy(), expected)


PER_ROW_UPDATE = -np.arange(1, 2 * 2 * 3 + 1, dtype="float32").reshape(2, 2, 3)
# (per-row index, {row: {position: update step written there}})
PER_ROW_CASES = [
    ([1, 3], {0: {1: 0, 2: 1}, 1: {3: 0, 4: 1}}),  # each row at its own place
    ([0, 4], {0: {0: 0, 1: 1}, 1: {4: 0}}),  # row 1's second past the end
    ([5, 2], {0: {}, 1: {2: 0, 3: 1}}),  # row 0 wholly past the end
    ([-1, 0], {0: {0: 1}, 1: {0: 0, 1: 1}}),  # row 0 begins before 0
]


def per_row_expected(written):
    expected = CACHE.copy()
    for row, places in written.items():
        for position, step in places.items():
            expected[row, position] = PER_ROW_UPDATE[row, step]
    return expected


@pytest.mark.parametrize("index, written", PER_ROW_CASES)
def test_per_row_index_writes_each_row_at_its_own_position(index, written):
    """A `(batch,)` index (speculative decoding) writes each row's update at
    that row's position, and nothing outside the cache, on every backend."""
    result = update_cache(CACHE, PER_ROW_UPDATE, np.array(index, "int32"))
    np.testing.assert_array_equal(to_numpy(result), per_row_expected(written))


@pytest.mark.tf_only
@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("index, written", PER_ROW_CASES)
def test_per_row_index_in_a_graph_uses_core_ops_and_compiles(
    index, written, jit_compile
):
    """From a traced `(batch,)` index (the scatter when every row fits, the
    gather and `where` otherwise, chosen as it runs) the update is the same,
    with no `Xla*` op in the plain graph, and it compiles under XLA."""

    @tf.function(
        input_signature=[tf.TensorSpec([2], tf.int32)], jit_compile=jit_compile
    )
    def write(rows):
        return update_cache(tf.constant(CACHE), tf.constant(PER_ROW_UPDATE), rows)

    np.testing.assert_array_equal(
        write(tf.constant(index)).numpy(), per_row_expected(written)
    )
    if not jit_compile:
        graph = write.get_concrete_function().graph.as_graph_def()
        graph_ops = {n.op for n in graph.node}
        graph_ops |= {n.op for f in graph.library.function for n in f.node_def}
        assert not any(op.startswith("Xla") for op in graph_ops), graph_ops
