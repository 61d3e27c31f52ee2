"""Alignment heatmaps of attention weights, as in Bahdanau et al.'s figure 3."""

from __future__ import annotations

import numpy as np


def _to_2d(weights) -> np.ndarray:
    weights = np.asarray(weights, dtype="float32")
    if weights.ndim != 2:
        raise ValueError(
            "`weights` must be a 2-D (target, source) matrix; select one example "
            f"and one head first. Received: weights.shape={weights.shape}"
        )
    return weights


def plot_attention(
    weights,
    source_tokens,
    target_tokens,
    title: str | None = None,
    cmap: str = "viridis",
    ax=None,
):
    """Heatmap of attention weights: target tokens down, source tokens across.

    Args:
        weights: `(len(target_tokens), len(source_tokens))` array (one example,
            one head), e.g. `weights[b, h, :T, :S]` of a multi-head layer.
        source_tokens: labels of the columns (the attended positions).
        target_tokens: labels of the rows (the attending positions).
        title: optional title.
        cmap: matplotlib colour map.
        ax: an existing matplotlib `Axes` to draw into (a new figure if None).

    Returns:
        The matplotlib `Figure`.

    Example:

    ```python
    fig = plot_attention(weights[0], ["ich", "bin", "hier"], ["i", "am", "here"])
    fig.savefig("alignment.png")
    ```
    """
    import matplotlib

    if ax is None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    weights = _to_2d(weights)
    source_tokens = [str(t) for t in source_tokens]
    target_tokens = [str(t) for t in target_tokens]
    if weights.shape != (len(target_tokens), len(source_tokens)):
        raise ValueError(
            "`weights` must have shape (len(target_tokens), len(source_tokens)) = "
            f"{(len(target_tokens), len(source_tokens))}. "
            f"Received: weights.shape={weights.shape}"
        )
    if ax is None:
        width = max(3.0, 0.45 * len(source_tokens) + 1.5)
        height = max(2.5, 0.45 * len(target_tokens) + 1.2)
        fig, ax = plt.subplots(figsize=(width, height))
    else:
        fig = ax.figure
    image = ax.imshow(
        weights,
        cmap=cmap,
        vmin=0.0,
        vmax=max(float(weights.max()), 1e-6),
        aspect="auto",
    )
    ax.set_xticks(range(len(source_tokens)))
    ax.set_xticklabels(source_tokens, rotation=90)
    ax.set_yticks(range(len(target_tokens)))
    ax.set_yticklabels(target_tokens)
    ax.set_xlabel("source")
    ax.set_ylabel("target")
    if title:
        ax.set_title(title)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    return fig


def save_attention_plot(path, weights, source_tokens, target_tokens, **kwargs) -> str:
    """`plot_attention` to a PNG file (the figure is closed afterwards)."""
    import matplotlib.pyplot as plt

    fig = plot_attention(weights, source_tokens, target_tokens, **kwargs)
    try:
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return str(path)
