"""Attention heatmaps (matplotlib)."""

from keras_attn.visualize.attention_plot import plot_attention, save_attention_plot

__all__ = ["plot_attention", "save_attention_plot"]
