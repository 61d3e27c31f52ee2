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
