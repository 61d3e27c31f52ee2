import re

import numpy as np
import pytest

from keras_attn.ops import (
    attention_mask_from_padding,
    band_mask,
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


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 1, 3])
@pytest.mark.parametrize("offset", [0, 2])
def test_band_mask_is_the_causal_mask_and_the_window_together(causal, window, offset):
    band = band_mask(4, 7, causal=causal, window=window, offset=offset)
    if not causal and window is None:
        assert band is None
        return
    query_positions = np.arange(4)[:, None] + offset
    key_positions = np.arange(7)[None, :]
    expected = np.ones((4, 7), bool)
    if causal:
        expected &= key_positions <= query_positions
    if window is not None:
        expected &= np.abs(query_positions - key_positions) < window
    np.testing.assert_array_equal(to_numpy(band), expected)


def _as_scores(mask):
    """A mask in Keras's broadcasting, as (B, N, Tq, Tk) = (2, 2, 3, 4)."""
    mask = np.asarray(mask)
    if mask.ndim == 2:
        mask = mask[None, None]
    elif mask.ndim == 3:
        mask = mask[:, None]
    return np.broadcast_to(mask, (2, 2, 3, 4))


@pytest.mark.parametrize(
    ("shape", "parts"),
    [
        ((2, 1, 4), (((2, 4)), None, None)),
        ((1, 1, 4), (((1, 4)), None, None)),
        ((2, 1, 1, 4), (((2, 4)), None, None)),
        ((2, 3, 1), (None, (2, 3), None)),
        ((2, 1, 3, 1), (None, (2, 3), None)),
        ((3, 4), (None, None, (1, 1, 3, 4))),
        ((1, 3, 4), (None, None, (1, 1, 3, 4))),
        ((2, 3, 4), (None, None, (2, 1, 3, 4))),
        ((2, 2, 3, 4), (None, None, (2, 2, 3, 4))),
        ((2, 2, 1, 4), (None, None, (2, 2, 1, 4))),
    ],
)
def test_split_attention_mask_keeps_what_each_form_is(shape, parts):
    from keras_attn.ops.masks import split_attention_mask

    mask = np.random.default_rng(1).uniform(size=shape) > 0.4
    keys, queries, rest = split_attention_mask(mask)
    got = tuple(
        None if part is None else tuple(part.shape) for part in (keys, queries, rest)
    )
    assert got == parts
    # The parts AND back to the mask, broadcast as Keras does.
    combined = np.ones((2, 2, 3, 4), bool)
    if keys is not None:
        combined &= to_numpy(keys)[:, None, None, :]
    if queries is not None:
        combined &= to_numpy(queries)[:, None, :, None]
    if rest is not None:
        combined &= to_numpy(rest)
    np.testing.assert_array_equal(combined, _as_scores(mask))


def test_split_attention_mask_refuses_other_ranks():
    from keras_attn.ops.masks import split_attention_mask

    assert split_attention_mask(None) == (None, None, None)
    for shape in ((4,), (1, 2, 2, 3, 4)):
        with pytest.raises(
            ValueError, match=re.escape(f"Received: attention_mask.shape={shape}")
        ):
            split_attention_mask(np.ones(shape, bool))


def test_rows_with_keys_of_a_shared_mask_and_key_padding():
    from keras_attn.ops.masks import rows_with_keys

    shared = np.array([[[True, False, False, False], [False, True, True, False]]])
    keys = np.array([[False, True, True, True], [True, False, False, True]])
    rows = to_numpy(rows_with_keys(2, 4, attention_mask=shared, key_padding_mask=keys))
    np.testing.assert_array_equal(rows, (shared & keys[:, None, :]).any(-1))
    np.testing.assert_array_equal(rows, [[False, True], [True, False]])
