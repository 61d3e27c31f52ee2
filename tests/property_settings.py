"""Hypothesis settings shared by the property tests.

Each property test states its example count for the default run
(`make test`); the profile scales it. Choose the profile with
`KERAS_ATTN_HYPOTHESIS_PROFILE`:

- `default` (what `make test` and CI run): the stated counts, derandomized so
  a run draws the same examples every time.
- `large` (`make test-large`): ten times the counts, random seeds; a failure
  prints the `@reproduce_failure` line to pin it.

`KERAS_ATTN_HYPOTHESIS_SCALE` (a float) overrides the profile's factor, e.g.
`KERAS_ATTN_HYPOTHESIS_SCALE=0.1` for a quick local pass. `make
test-backends` and CI run them on JAX at 0.25 (`BACKEND_HYPOTHESIS_SCALE`: there
each drawn shape compiles); TensorFlow's and PyTorch's runs draw them all.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

PROFILES = {"default": 1.0, "large": 10.0}

PROFILE = os.environ.get("KERAS_ATTN_HYPOTHESIS_PROFILE", "default")
if PROFILE not in PROFILES:
    raise ValueError(
        "KERAS_ATTN_HYPOTHESIS_PROFILE must be one of "
        f"{sorted(PROFILES)}. Received: {PROFILE!r}"
    )
SCALE = float(os.environ.get("KERAS_ATTN_HYPOTHESIS_SCALE", PROFILES[PROFILE]))


def examples(count: int) -> int:
    """`count` (the default run's number of examples) scaled by the profile."""
    return max(1, round(count * SCALE))


def property_settings(count: int, **overrides) -> settings:
    """Settings for a property test that draws `count` examples by default.

    No deadline (tracing and compiling make the first example slow), no
    example database (CI starts from a clean clone), derandomized in the
    default profile, and fixtures allowed (they are module-scoped models and
    exports, which the examples only read).
    """
    options = dict(
        max_examples=examples(count),
        deadline=None,
        database=None,
        derandomize=PROFILE == "default",
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
        ],
        print_blob=True,
    )
    options.update(overrides)
    return settings(**options)
