"""What the model classes share as tasks: their tokenizers in the config, and
checks of the text they are given. Imports no TensorFlow."""

from __future__ import annotations

import keras

# keras_attn.text's special ids (that module imports TensorFlow).
PAD_ID, START_ID, END_ID = 0, 2, 3


def serialize_tokenizer(tokenizer):
    """A tokenizer layer's config for `get_config` (None stays None)."""
    if tokenizer is None:
        return None
    return keras.saving.serialize_keras_object(tokenizer)


def deserialize_tokenizer(config):
    """A tokenizer layer from `serialize_tokenizer`'s config (importing
    `keras_attn.text`, whose tokenizers register themselves, on TensorFlow)."""
    if config is None or isinstance(config, keras.layers.Layer):
        return config
    import keras_attn.text  # noqa: F401  registers the tokenizer classes

    return keras.saving.deserialize_keras_object(config)


def check_tokenizer(name: str, tokenizer):
    """`tokenizer` if it is None or a tokenizer (has `tokenize` and
    `detokenize`), else a `ValueError`."""
    if tokenizer is None or (
        hasattr(tokenizer, "tokenize") and hasattr(tokenizer, "get_config")
    ):
        return tokenizer
    raise ValueError(
        f"`{name}` must be a keras_attn tokenizer (SubwordTokenizer, "
        f"WordPieceTokenizer) or None. Received: {name}={tokenizer!r}"
    )


def require_tokenizer(model, name: str, method: str):
    """The model's tokenizer `name`, or a `ValueError` saying how to give one."""
    tokenizer = getattr(model, name, None)
    if tokenizer is None:
        raise ValueError(
            f"`{method}` works on text and needs the model's `{name}`. Received: "
            f"{name}=None (pass it to the constructor, or set `model.{name}`; "
            "on token ids, use the `*_ids` methods)"
        )
    return tokenizer


def text_list(name: str, texts) -> list[str]:
    """`texts` as a list of strings (a single string is a list of one)."""
    if isinstance(texts, str):
        return [texts]
    try:
        found = list(texts)
    except TypeError:
        found = None
    if found is None or not all(isinstance(text, str) for text in found):
        raise ValueError(
            f"`{name}` must be a string or a list of strings. Received: "
            f"{name} of type {type(texts).__name__}"
        )
    return found


def check_length(name: str, value, allow_none: bool = False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive int. Received: {name}={value!r}")
    return value
