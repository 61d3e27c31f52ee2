import numpy as np
import pytest

from keras_attn.ops import (
    attention_mask_from_padding,
    causal_mask,
    combine_masks,
    padding_mask,
    padding_mask_from_lengths,
    sliding_window_mask,
)
from tests.test_case import to_numpy


def test_padding_mask_from_lengths():
    mask = to_numpy(padding_mask_from_lengths([2, 0, 3], 3))
    np.testing.assert_array_equal(
        mask, [[True, True, False], [False, False, False], [True, True, True]]
    )


def test_padding_mask_from_lengths_rejects_wrong_rank():
    with pytest.raises(ValueError, match=r"lengths.*Received: lengths.shape=\(2, 1\)"):
        padding_mask_from_lengths([[1], [2]], 3)


def test_padding_mask_from_keras_mask_or_ints():
    assert padding_mask(None) is None
    np.testing.assert_array_equal(
        to_numpy(padding_mask([[1, 0, 2]])), [[True, False, True]]
    )


def test_causal_mask_is_lower_triangular():
    np.testing.assert_array_equal(
        to_numpy(causal_mask(3)), np.tril(np.ones((3, 3), bool))
    )


def test_causal_mask_with_offset_for_cached_decoding():
    # One new query written at index 2 of a length-5 cache sees keys 0..2.
    np.testing.assert_array_equal(
        to_numpy(causal_mask(1, 5, offset=2)), [[True, True, True, False, False]]
    )
    # Two queries at positions 3 and 4 of a length-5 key sequence.
    np.testing.assert_array_equal(
        to_numpy(causal_mask(2, 5, offset=3)),
        [[True, True, True, True, False], [True, True, True, True, True]],
    )


def test_combine_masks_skips_none_and_broadcasts():
    assert combine_masks(None, None) is None
    a = np.array([[True, False, True]])  # (1, 3)
    b = np.array([[True], [False]])  # (2, 1)
    np.testing.assert_array_equal(
        to_numpy(combine_masks(a, None, b)),
        [[True, False, True], [False, False, False]],
    )


def test_attention_mask_from_padding():
    query_mask = np.array([[True, False]])
    key_mask = np.array([[True, True, False]])
    mask = to_numpy(attention_mask_from_padding(query_mask, key_mask))
    np.testing.assert_array_equal(mask, [[[True, True, False], [False, False, False]]])
    assert attention_mask_from_padding(None, None) is None
    assert to_numpy(attention_mask_from_padding(None, key_mask)).shape == (1, 1, 3)


@pytest.mark.parametrize("offset", [0, 2])
def test_sliding_window_mask_is_a_band_around_each_query(offset):
    mask = to_numpy(sliding_window_mask(3, 6, window=2, offset=offset))
    query_positions = np.arange(3)[:, None] + offset
    expected = np.abs(query_positions - np.arange(6)[None, :]) < 2
    np.testing.assert_array_equal(mask, expected)
    assert mask.sum(-1).tolist() == ([2, 3, 3] if offset == 0 else [3, 3, 3])
