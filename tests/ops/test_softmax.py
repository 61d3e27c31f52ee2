import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from keras import ops

from keras_attn.ops import masked_softmax
from tests.test_case import to_numpy


def test_lecture_worked_numbers():
    # Raw scores 1.5, 0.9, 0.2, -0.5 give weights of about .51, .28, .14, .07.
    weights = to_numpy(masked_softmax(np.array([[1.5, 0.9, 0.2, -0.5]])))
    np.testing.assert_allclose(weights, [[0.51, 0.28, 0.14, 0.07]], atol=5e-3)
    np.testing.assert_allclose(weights.sum(), 1.0, atol=1e-6)


def test_masked_entries_get_zero_weight_and_rest_renormalise():
    scores = np.array([[1.5, 0.9, 0.2, -0.5]], "float32")
    mask = np.array([[True, False, True, False]])
    weights = to_numpy(masked_softmax(scores, mask))
    expected = np.exp([1.5, 0.2]) / np.exp([1.5, 0.2]).sum()
    np.testing.assert_allclose(weights, [[expected[0], 0, expected[1], 0]], atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_fully_masked_row_gives_zeros_not_nan_or_uniform(dtype):
    scores = ops.cast(np.array([[3.0, 1.0, 2.0], [1.0, 2.0, 3.0]]), dtype)
    mask = np.array([[False, False, False], [True, True, False]])
    weights = to_numpy(masked_softmax(scores, mask))
    assert weights.dtype == np.float32
    np.testing.assert_array_equal(weights[0], [0.0, 0.0, 0.0])
    np.testing.assert_allclose(weights[1].sum(), 1.0, atol=1e-6)
    assert weights[1, 2] == 0.0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_scores_are_normalised_in_float32(dtype):
    # Large logits that would overflow exp() in float16 stay finite.
    scores = ops.cast(np.array([[60000.0, 59000.0, -60000.0]]), dtype)
    weights = to_numpy(masked_softmax(scores))
    assert weights.dtype == np.float32
    assert np.all(np.isfinite(weights))
    np.testing.assert_allclose(weights.sum(), 1.0, atol=1e-6)
    assert weights[0, 0] > 0.99


@settings(max_examples=40, deadline=None)
@given(
    scores=hnp.arrays(np.float32, (3, 5), elements=st.floats(-50, 50, width=32)),
    mask=hnp.arrays(np.bool_, (3, 5)),
)
def test_rows_sum_to_one_or_zero(scores, mask):
    weights = to_numpy(masked_softmax(scores, mask))
    assert np.all(np.isfinite(weights))
    assert np.all(weights[~mask] == 0.0)
    sums = weights.sum(-1)
    has_key = mask.any(-1)
    np.testing.assert_allclose(sums[has_key], 1.0, atol=1e-5)
    np.testing.assert_array_equal(sums[~has_key], 0.0)
