"""Export the sentiment classifier: raw strings in, probability and label out."""

from __future__ import annotations

from pathlib import Path

import keras

from keras_attn.export._common import (
    SAMPLE_TEXTS,
    TEXT_SPEC,
    clean_text,
    next_version_dir,
    run_samples,
    write_export,
)
from keras_attn.text.wordpiece import WordPieceTokenizer


def sentiment_serving_fn(classifier, max_length: int, threshold: float = 0.5):
    """The `serving_default` function: strings -> probability and label
    (`classifier.classify_strings`: the probabilities `classify` gives, up
    to float rounding, with every text padded to `max_length`), and the
    dense tokenizer it needs tracked."""
    tokenizer = classifier.dense_tokenizer(max_length)

    def serve(text):
        text = clean_text(text, max_chars=16 * max_length)
        return classifier.classify_strings(
            text, max_length, threshold, tokenizer=tokenizer
        )

    return serve, tokenizer


def export_sentiment(
    classifier,
    base_dir,
    model_name: str = "sentiment",
    version: int | None = None,
    max_length: int = 64,
    threshold: float = 0.5,
) -> Path:
    """Export a classifier with its tokenizer for TF Serving (what
    `classifier.export(base_dir)` does).

    `classifier` is a `keras_attn.models.TextClassifier` or
    `TextClassifierEnsemble` with its `tokenizer`.

    Writes `<base_dir>/<model_name>/<version>/` (TF Serving's layout) with one
    signature, `serving_default`: `text` (string `[batch]`) ->
    `positive_probability` (float32 `[batch]`) and `label` (string `[batch]`,
    `"positive"` when the probability exceeds `threshold`, else
    `"negative"`). Texts are cleaned (invalid UTF-8 replaced) and truncated to
    `max_length` tokens; empty and whitespace-only texts are valid inputs.
    The tokenizer (SentencePiece, or a pretrained encoder's WordPiece) runs
    inside the graph; its vocabulary is also written to `assets/`
    (`sentiment.model` or `vocab.txt`) for reference.
    `assets.extra/keras_attn.json` records the configuration and the outputs of
    sample requests computed here, which `check_servable` compares against.

    Returns:
        The version directory.
    """
    tokenizer = classifier.tokenizer
    if tokenizer is None:
        raise ValueError(
            "Exporting for TF Serving needs the classifier's `tokenizer`. "
            f"Received: tokenizer=None on {type(classifier).__name__} "
            f"{classifier.name!r}"
        )
    path = next_version_dir(base_dir, model_name, version)
    serve, serving_tokenizer = sentiment_serving_fn(classifier, max_length, threshold)
    archive = keras.export.ExportArchive()
    archive.track(classifier)
    archive.track(serving_tokenizer)
    signatures = {
        "serving_default": archive.add_endpoint(
            "serving_default", serve, input_signature=[TEXT_SPEC]
        )
    }
    samples = {"serving_default": {"text": list(SAMPLE_TEXTS)}}
    metadata = {
        "task": "sentiment",
        "model_name": model_name,
        "version": int(path.name),
        "max_length": max_length,
        "threshold": threshold,
        "labels": list(classifier.labels),
        "vocabulary_size": tokenizer.vocabulary_size,
        "tokenizer": type(tokenizer).__name__,
        "signatures": {
            "serving_default": {
                "inputs": {"text": "string [batch]"},
                "outputs": {
                    "positive_probability": "float32 [batch]",
                    "label": "string [batch]",
                },
            }
        },
        "samples": samples,
        "sample_outputs": run_samples(signatures, samples),
    }
    name, vocab_file = _write_vocabulary(tokenizer, path.parent)
    try:
        return write_export(archive, path, metadata, {name: vocab_file})
    finally:
        Path(vocab_file).unlink(missing_ok=True)


def _write_vocabulary(tokenizer, directory: Path) -> tuple[str, str]:
    """`(asset name, temporary file)` holding the tokenizer's vocabulary."""
    directory.mkdir(parents=True, exist_ok=True)
    if isinstance(tokenizer, WordPieceTokenizer):
        return "vocab.txt", str(tokenizer.save_vocabulary(directory / ".vocab.txt.tmp"))
    target = directory / ".sentiment.model.tmp"
    target.write_bytes(tokenizer.proto)
    return "sentiment.model", str(target)
