"""Attention heatmaps (matplotlib): `plot_attention` and `save_attention_plot`
for any weights, and the model classes' heatmaps written as PNG files
(`save_alignment_plots`, `save_classifier_plots`,
`save_language_model_plots`)."""

from keras_attn._extras import require

# matplotlib comes with the `visualize` extra (and `examples`).
require("keras_attn.visualize", "visualize")

from keras_attn.visualize.attention_plot import plot_attention, save_attention_plot  # noqa: E402
from keras_attn.visualize.model_plots import (  # noqa: E402
    save_alignment_plots,
    save_classifier_plots,
    save_language_model_plots,
)

__all__ = [
    "plot_attention",
    "save_alignment_plots",
    "save_attention_plot",
    "save_classifier_plots",
    "save_language_model_plots",
]
