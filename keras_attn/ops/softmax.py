"""Masked softmax computed in float32 with finite mask values."""

from __future__ import annotations

import keras
from keras import ops

# A finite "minus infinity": representable in float32, and far enough below any
# real score that exp(MASK_VALUE - max) underflows to exactly 0.
MASK_VALUE = -1e9


def masked_softmax(scores, mask=None, axis: int = -1):
    """Softmax over `axis` that ignores masked entries, computed in float32.

    Whatever the dtype of `scores` (float16 and bfloat16 included), the
    softmax is computed in float32 and returned in float32; cast the result
    back to the compute dtype when mixing it with values.

    Masked entries get weight exactly 0. A row whose entries are all masked
    gets all-zero weights (so the attention context is a zero vector), never
    NaN and never a uniform average over the masked keys.

    Args:
        scores: float tensor of attention scores, e.g. `(batch, Tq, Tk)`.
        mask: optional boolean tensor broadcastable to `scores`, `True` for
            entries that take part.
        axis: the axis to normalise over (the key axis).

    Returns:
        float32 tensor of the shape of `scores`.

    Example:

    >>> masked_softmax([[1.5, 0.9, 0.2, -0.5]])  # ~[[0.51, 0.28, 0.14, 0.07]]
    """
    scores = ops.cast(scores, "float32")
    if mask is None:
        return ops.softmax(scores, axis=axis)
    mask = ops.convert_to_tensor(mask)
    if keras.backend.standardize_dtype(mask.dtype) != "bool":
        mask = ops.not_equal(mask, 0)
    scores = ops.where(mask, scores, MASK_VALUE)
    weights = ops.softmax(scores, axis=axis)
    # Rows with no valid entry came out uniform above; multiplying by the mask
    # zeroes them (and every masked entry) exactly.
    return ops.multiply(weights, ops.cast(mask, "float32"))
