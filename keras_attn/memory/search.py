"""`grid_search`: the validation search shared by kNN-MT and the continuous
cache (and any other setting chosen on held-out data)."""

from __future__ import annotations

import itertools
import math


def grid_search(loss_fn, **grid):
    """Try every combination of the `grid`'s values; keep the lowest loss.

    Combinations go in order, the first keyword varying slowest; of equal
    losses the first is kept. Memoise in `loss_fn` what several settings
    share (one neighbour search for every `k`, one cache pass per `theta`).

    Args:
        loss_fn: `loss_fn(**setting) -> float`, lower is better.
        **grid: each argument of `loss_fn` with the sequence of its values.

    Returns:
        `(best, trials)`: the best setting (a dict of the grid's names), and
        every setting tried with its `"loss"`.

    Example:

    ```python
    best, trials = grid_search(
        lambda k, lam: validation_loss(k, lam), k=(32, 64), lam=(0.1, 0.3)
    )
    ```
    """
    if not grid:
        raise ValueError("`grid` must name at least one argument. Received: none")
    for name, values in grid.items():
        if isinstance(values, str) or not hasattr(values, "__iter__"):
            raise ValueError(
                f"Each grid entry must be a sequence of values. Received: "
                f"{name}={values!r}"
            )
    names = list(grid)
    values = [tuple(grid[name]) for name in names]
    empty = [name for name, options in zip(names, values, strict=True) if not options]
    if empty:
        raise ValueError(f"Each grid entry needs a value. Received: {empty[0]}=()")
    trials = []
    for combination in itertools.product(*values):
        setting = dict(zip(names, combination, strict=True))
        loss = float(loss_fn(**setting))
        if math.isnan(loss):
            raise ValueError(f"`loss_fn` returned NaN. Received: setting {setting}")
        trials.append({**setting, "loss": loss})
    best = min(trials, key=lambda trial: trial["loss"])
    return {name: best[name] for name in names}, trials
