"""A progress bar for the package's own evaluation loops."""

from __future__ import annotations

import keras


def progress_bar(title: str, steps: int | None, verbose: int, unit: str = "batch"):
    """A `keras.utils.Progbar` over `steps` (None: unknown), announced by
    `title` on its own line: `verbose` 1 draws a bar, 2 prints one line at
    the end, 0 nothing."""
    if verbose:
        print(f"{title}:", flush=True)
    return keras.utils.Progbar(steps, verbose=verbose, unit_name=unit)
