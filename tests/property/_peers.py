"""What the peer property tests share (`test_layers_vs_keras.py`,
`test_blocks_vs_keras_hub.py`): the policies, the tolerances against the
peer's own error, the padding masks drawn and the error measure."""

from __future__ import annotations

import os

import numpy as np
from hypothesis import Phase

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")

# Allowed max |error| relative to the largest |output| of the float32
# reference, per policy of keras-attn's layer or block: the larger of this
# floor and `PEER_FACTOR` times the error of the peer's own class (Keras's
# layer, keras-hub's block) under the same policy on the same call. Measured
# on TensorFlow and JAX (CPU): float32 <= ~1.3e-6; float16 <= ~4.5e-3 and
# bfloat16 <= ~3.2e-2 for the layers (8 mantissa bits through three
# projections and the softmax, inputs scaled by 3, T up to 299), the peers'
# own errors in those policies being of the same size (keras-hub's blocks:
# bfloat16 up to ~7e-2 at T=299, float16 ~1.5e-2; keras-attn's float16
# errors are smaller, its softmax being float32).
RELATIVE_TOLERANCE = {
    "float32": 2e-5,
    "mixed_float16": 4e-3,
    "mixed_bfloat16": 3e-2,
}
PEER_FACTOR = 2.0

# A block's error compounds through its layer norms: a row whose
# pre-normalization values nearly cancel amplifies the rounding of every
# sublayer before it, so on one call the maximum error of two equally
# accurate blocks can differ by a factor of 3 to 5 (keras-attn's and
# keras-hub's blocks, 1,100 drawn calls under mixed_bfloat16 and
# mixed_float16 on TensorFlow: ratios up to 2.8 and 3.0 either way round; on
# PyTorch one call reached 4.0 on a row of a fifth of the median spread). The
# blocks' test divides each row's error by that amplification
# (`relative_error(..., amplification)`; the large profile's largest ratio
# then 2.6 against 3.4). Per call the bound is `BLOCK_PEER_FACTOR` times
# keras-hub's error; across the calls `check_no_worse_than_peer` holds
# keras-attn's errors to keras-hub's on average (the mean of log2(ours /
# keras-hub's) was -0.1 under mixed_bfloat16 and -0.2 under mixed_float16 on
# TensorFlow, 0.03 under mixed_bfloat16 on PyTorch).
BLOCK_PEER_FACTOR = 4.0
MEAN_LOG2_RATIO_LIMIT = 0.5  # a geometric mean ratio of sqrt(2)
MIN_RATIOS = 30

# KERAS_ATTN_NO_SHRINK=1 reports the first failing example without
# shrinking it (shrinking a failure takes minutes).
NO_SHRINK = (
    {"phases": (Phase.explicit, Phase.reuse, Phase.generate)}
    if os.environ.get("KERAS_ATTN_NO_SHRINK")
    else {}
)


def padding_mask(rng, batch, length, style):
    """A `(B, L)` padding mask: "suffix" (a length from 0 to L per row, so
    some rows are empty), "random", "empty" (one row all False)."""
    if style == "suffix":
        lengths = rng.integers(0, length + 1, size=batch)
        return np.arange(length)[None, :] < lengths[:, None]
    mask = rng.random((batch, length)) < 0.7
    if style == "empty":
        mask[rng.integers(batch)] = False
    return mask


def relative_error(got, want, rows, amplification=None):
    """max |got - want| on `rows` (`(B, T)` bool) over max |want| there.

    `amplification` (`(B, T)`, >= 1): how much the computation amplifies
    rounding on each row (a layer norm of a row whose values nearly cancel);
    each row's error is divided by it, so one ill-conditioned row does not
    decide the comparison of two equally rounded computations."""
    difference = np.max(np.abs(got - want), axis=-1)  # (B, T)
    if amplification is not None:
        difference = difference / amplification
    difference, want = difference[rows], want[rows]
    if difference.size == 0:
        return 0.0
    scale = max(float(np.max(np.abs(want))), 1e-3)
    return float(np.max(difference)) / scale


def check_no_worse_than_peer(error, peer_error, policy, ratios: dict):
    """Record log2(error / peer_error) for calls where the errors are not
    negligible (the larger above a tenth of the policy's floor) and, once
    `MIN_RATIOS` are recorded for `policy`, assert that their mean is at most
    `MEAN_LOG2_RATIO_LIMIT`: keras-attn as accurate as the peer across the
    calls drawn so far, which one call cannot tell."""
    if peer_error <= 0 or max(error, peer_error) <= RELATIVE_TOLERANCE[policy] / 10:
        return
    logs = ratios.setdefault(policy, [])
    logs.append(float(np.log2(max(error, 1e-12) / peer_error)))
    if len(logs) >= MIN_RATIOS:
        mean = float(np.mean(logs))
        assert mean <= MEAN_LOG2_RATIO_LIMIT, (
            f"over {len(logs)} calls under {policy}, keras-attn's errors are "
            f"2**{mean:.2f} times the peer's on average (allowed "
            f"2**{MEAN_LOG2_RATIO_LIMIT})"
        )


def check_close(
    got, want, policy, rows, what, allowed, errors: dict, amplification=None
):
    """Assert `relative_error <= allowed`; record the largest per policy in
    `errors` (printed at exit with KERAS_ATTN_PRINT_ERRORS=1)."""
    error = relative_error(got, want, rows, amplification)
    errors[policy] = max(errors.get(policy, 0.0), error)
    assert error <= allowed, (
        f"{what}: relative error {error:.3g} > {allowed:.3g} ({policy})"
    )
    return error
