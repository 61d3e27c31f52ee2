"""`make_optimizer`: AdamW with decoupled weight decay and, when asked, a
moving average of the weights, as the example scripts train every model."""

from __future__ import annotations

import math
import numbers

import keras


def make_optimizer(
    learning_rate: float,
    *,
    weight_decay: float = 0.01,
    ema_momentum: float = 0.0,
    clipnorm: float | None = None,
) -> keras.optimizers.AdamW:
    """AdamW (Loshchilov and Hutter, 2019) with an optional moving average of
    the weights.

    With `ema_momentum > 0` the optimizer keeps `average = ema_momentum *
    average + (1 - ema_momentum) * weights` after every step (Keras'
    `use_ema`); `fit_within_budget(..., ema=True)` then validates,
    checkpoints and ends training with the average. The learning rate is a
    plain value, as `fit_within_budget(learning_rate=...)` needs: its
    `BudgetCosineDecay` sets it before every batch (warm-up, hold, cosine
    decay to the end of the epochs or of the time budget). Under
    `mixed_float16`, `compile` wraps it in a `LossScaleOptimizer`.

    Args:
        learning_rate: the learning rate (with `fit_within_budget`'s
            schedule, overwritten by it at every step).
        weight_decay: decoupled weight decay, `>= 0`.
        ema_momentum: momentum of the moving average of the weights, in
            `[0, 1)`; 0: no average.
        clipnorm: clip each gradient to this norm, or None.

    Returns:
        A `keras.optimizers.AdamW`.

    Example:

    ```python
    optimizer = make_optimizer(1e-3, weight_decay=0.1, ema_momentum=0.999, clipnorm=1.0)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    ```
    """
    _check_number("learning_rate", learning_rate, "> 0", lambda x: x > 0)
    # Keras' AdamW takes a negative decay and grows every weight with it.
    _check_number("weight_decay", weight_decay, ">= 0", lambda x: x >= 0)
    _check_number("ema_momentum", ema_momentum, "in [0, 1)", lambda x: 0 <= x < 1)
    if clipnorm is not None:
        _check_number("clipnorm", clipnorm, "> 0 or None", lambda x: x > 0)
    ema = {"use_ema": True, "ema_momentum": ema_momentum} if ema_momentum else {}
    return keras.optimizers.AdamW(
        learning_rate, weight_decay=weight_decay, clipnorm=clipnorm, **ema
    )


def _check_number(name, value, bounds, test) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or not test(value)
    ):
        raise ValueError(f"`{name}` must be {bounds}. Received: {name}={value!r}")
