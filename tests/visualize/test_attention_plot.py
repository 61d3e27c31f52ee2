import numpy as np
import pytest
from PIL import Image

from keras_attn.visualize import plot_attention, save_attention_plot

WEIGHTS = np.array([[0.9, 0.1, 0.0], [0.2, 0.7, 0.1]], "float32")
SOURCE, TARGET = ["ich", "bin", "müde"], ["i", "am"]


def cell_colours(image, weights, source, target, **kwargs):
    """The RGB pixel at the centre of each cell of the saved heatmap `image`
    (`(rows, columns, 3)`), found from the same figure drawn at the PNG's
    100 dpi."""
    import matplotlib.pyplot as plt

    fig = plot_attention(weights, source, target, **kwargs)
    try:
        fig.set_dpi(100)  # save_attention_plot's
        fig.canvas.draw()
        ax = fig.axes[0]
        height = image.shape[0]
        colours = np.zeros((*weights.shape, 3), int)
        for row, column in np.ndindex(*weights.shape):
            x, y = ax.transData.transform((column, row))  # origin bottom left
            colours[row, column] = image[round(height - y), round(x)]
        return colours
    finally:
        plt.close(fig)


def test_heatmap_png_draws_each_cell_in_its_weights_colour(tmp_path):
    import matplotlib

    path = save_attention_plot(
        tmp_path / "alignment.png", WEIGHTS, SOURCE, TARGET, title="alignment"
    )
    image = np.asarray(Image.open(path).convert("RGB"))
    height, width, _ = image.shape
    assert width >= 300 and height >= 250
    # Each cell has the colour map's colour of its weight over the largest
    # (vmax 0.9): the strong cell bright yellow, the zero cell dark purple.
    colours = cell_colours(image, WEIGHTS, SOURCE, TARGET, title="alignment")
    viridis = matplotlib.colormaps["viridis"]
    expected = np.round(255 * viridis(WEIGHTS / WEIGHTS.max())[..., :3])
    np.testing.assert_allclose(colours, expected, atol=2)  # 8-bit rounding
    # Distinct weights, distinct colours: a swapped cell would be caught.
    strong, weak = colours[0, 0], colours[0, 2]
    assert np.abs(strong - weak).sum() > 300
    assert strong.sum() > weak.sum() + 200  # the strong cell is the brighter
    np.testing.assert_array_equal(colours[0, 1], colours[1, 2])  # both 0.1


def test_the_image_holds_the_weights_in_place():
    import matplotlib.pyplot as plt

    fig = plot_attention(WEIGHTS, SOURCE, TARGET)
    try:
        (image,) = fig.axes[0].images
        np.testing.assert_array_equal(np.asarray(image.get_array()), WEIGHTS)
        assert image.norm.vmin == 0.0 and image.norm.vmax == pytest.approx(0.9)
    finally:
        plt.close(fig)


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
