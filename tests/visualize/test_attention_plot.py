import numpy as np
import pytest
from PIL import Image

from keras_attn.visualize import plot_attention, save_attention_plot


def test_heatmap_png_has_size_and_is_not_blank(tmp_path):
    weights = np.array([[0.9, 0.1, 0.0], [0.2, 0.7, 0.1]], "float32")
    path = save_attention_plot(
        tmp_path / "alignment.png",
        weights,
        ["ich", "bin", "müde"],
        ["i", "am"],
        title="alignment",
    )
    image = np.asarray(Image.open(path).convert("RGB"))
    height, width, _ = image.shape
    assert width >= 300 and height >= 250
    # Not blank: many distinct colours, and the strong cell differs from the weak.
    assert len(np.unique(image.reshape(-1, 3), axis=0)) > 50
    assert image.std() > 20


def test_figure_axes_carry_the_tokens():
    fig = plot_attention(np.eye(2), ["a", "b"], ["x", "y"])
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["x", "y"]


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match=r"Received: weights.shape=\(2, 2\)"):
        plot_attention(np.eye(2), ["a", "b", "c"], ["x", "y"])
    with pytest.raises(ValueError, match=r"2-D.*Received: weights.shape=\(1, 2, 2\)"):
        plot_attention(np.ones((1, 2, 2)), ["a", "b"], ["x", "y"])
