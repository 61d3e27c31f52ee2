"""Export the sentiment classifier: raw strings in, probability and label out."""

from __future__ import annotations

from pathlib import Path

from keras_attn.export._common import SAMPLE_TEXTS, TEXT_SPEC, clean_text
from keras_attn.export.task import Endpoint, ServingSpec, export_with_options
from keras_attn.text.wordpiece import WordPieceTokenizer


def sentiment_serving_fn(classifier, max_length: int, threshold: float = 0.5):
    """The `serving_default` function: strings -> probability and label
    (`classifier.classify_strings`: the probabilities `classify` gives, up
    to float rounding, with every text padded to `max_length`), and the
    dense tokenizer it needs tracked (what the classifiers' `serving_spec`
    serves)."""
    tokenizer = classifier.dense_tokenizer(max_length)

    def serve(text):
        text = clean_text(text, max_chars=16 * max_length)
        return classifier.classify_strings(
            text, max_length, threshold, tokenizer=tokenizer
        )

    return serve, tokenizer


def sentiment_serving_spec(
    classifier, max_length: int = 64, threshold: float = 0.5
) -> ServingSpec:
    """The classifiers' `serving_spec`: the `ServingSpec` of `serving_default`
    (`text` -> `positive_probability`, `label`), with `export_sentiment`'s
    options."""
    tokenizer = classifier.tokenizer
    if tokenizer is None:
        raise ValueError(
            "Exporting for TF Serving needs the classifier's `tokenizer`. "
            f"Received: tokenizer=None on {type(classifier).__name__} "
            f"{classifier.name!r}"
        )
    serve, serving_tokenizer = sentiment_serving_fn(classifier, max_length, threshold)
    endpoint = Endpoint(
        serve,
        [TEXT_SPEC],
        {"text": "string [batch]"},
        {"positive_probability": "float32 [batch]", "label": "string [batch]"},
        {"text": list(SAMPLE_TEXTS)},
    )
    return ServingSpec(
        task="sentiment",
        model_name="sentiment",
        endpoints={"serving_default": endpoint},
        resources=(serving_tokenizer,),
        metadata={
            "max_length": max_length,
            "threshold": threshold,
            "labels": list(classifier.labels),
            "vocabulary_size": tokenizer.vocabulary_size,
            "tokenizer": type(tokenizer).__name__,
        },
        assets=dict([vocabulary_asset(tokenizer)]),
    )


def export_sentiment(
    classifier,
    base_dir,
    model_name: str = "sentiment",
    version: int | None = None,
    max_length: int = 64,
    threshold: float = 0.5,
    precision: str | None = None,
) -> Path:
    """Export a classifier with its tokenizer for TF Serving (what
    `classifier.export(base_dir)` does: `export_task(classifier, ...)` with
    the classifier's options).

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
    `precision` (`"float32"`, `"bfloat16"`, `"int8"`, `"int4"`) exports a
    copy of the classifier with its weights so (see `export_task`); None
    exports it as it is.

    Returns:
        The version directory.
    """
    return export_with_options(
        classifier,
        base_dir,
        model_name,
        version,
        {"max_length": max_length, "threshold": threshold, "precision": precision},
        argument="classifier",
        expected_task="sentiment",
    )


def vocabulary_asset(tokenizer) -> tuple:
    """`(asset name, write(path))`: the tokenizer's vocabulary as the export
    holds it for reference (`vocab.txt` of a WordPiece tokenizer, else the
    SentencePiece model, `sentiment.model`)."""
    if isinstance(tokenizer, WordPieceTokenizer):
        return "vocab.txt", tokenizer.save_vocabulary

    def write_model(path: Path) -> None:
        Path(path).write_bytes(tokenizer.proto)

    return "sentiment.model", write_model
