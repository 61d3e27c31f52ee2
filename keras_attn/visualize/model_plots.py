"""Heatmaps of the model classes' attention, written as PNG files: what the
example scripts put under `plots/`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from keras import ops

from keras_attn.visualize.attention_plot import save_attention_plot


def save_alignment_plots(translator, sources, translations, plot_dir, max_length=40):
    """One alignment heatmap (target pieces x source pieces) per translated
    sentence, `alignment_<i>.png`, from `translator.alignment`. Returns
    the paths."""
    plot_dir = Path(plot_dir)
    plot_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, (source, translation) in enumerate(
        zip(sources, translations, strict=True)
    ):
        weights, source_pieces, target_pieces = translator.alignment(
            source, translation, max_length=max_length
        )
        paths.append(
            save_attention_plot(
                plot_dir / f"alignment_{index}.png",
                weights,
                source_pieces,
                target_pieces,
                title=source[:60],
            )
        )
    return paths


def save_classifier_plots(classifier, examples, plot_dir, max_length=64):
    """Per-token attention of `(text, label)` examples, `review_<i>.png`:
    the attention pooling's weights (one row), or, for mean pooling, the
    last encoder block's self-attention averaged over its heads (token by
    token). Returns the paths."""
    plot_dir = Path(plot_dir)
    plot_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = classifier.tokenizer
    texts = [text for text, _ in examples]
    ids = np.asarray(tokenizer.tokenize(texts).to_tensor())[:, :max_length]
    probabilities = np.asarray(ops.convert_to_numpy(classifier(ids)))[:, 0]
    maps = classifier.attention_maps(ids)
    pooling = "pooling" in maps
    if pooling:  # (B, 1, T): the weights of the pooling's query
        weights = np.asarray(ops.convert_to_numpy(maps["pooling"]))[:, None, :]
    else:  # (B, T, T), averaged over the heads
        last = np.asarray(ops.convert_to_numpy(maps["self_attention"][-1]))
        weights = last.mean(axis=1)
    paths = []
    for index, (_, label) in enumerate(examples):
        length = int((ids[index] != 0).sum())
        pieces = [tokenizer.id_to_token(int(t)) for t in ids[index, :length]]
        rows = ["attention"] if pooling else pieces
        title = f"p(positive)={float(probabilities[index]):.2f} (label {label})"
        paths.append(
            save_attention_plot(
                plot_dir / f"review_{index}.png",
                weights[index, : len(rows), :length],
                pieces,
                rows,
                title=title if pooling else f"{title}, last block",
            )
        )
    return paths


def save_language_model_plots(language_model, text, plot_dir, length=24):
    """Head 0 of every decoder block's self-attention over the first
    `length` tokens of `text`, `layer_<i>_head_0.png`. Returns the paths."""
    plot_dir = Path(plot_dir)
    plot_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = language_model.tokenizer
    ids = np.asarray(tokenizer.tokenize([text[:400]]).to_tensor())[:, :length]
    pieces = [tokenizer.id_to_token(int(t)).replace("\n", "\\n") for t in ids[0]]
    maps = language_model.attention_maps(ids)["self_attention"]
    paths = []
    for index, weights in enumerate(maps):
        paths.append(
            save_attention_plot(
                plot_dir / f"layer_{index}_head_0.png",
                np.asarray(ops.convert_to_numpy(weights))[0, 0],
                pieces,
                pieces,
                title=f"decoder_{index}, head 0",
            )
        )
    return paths
