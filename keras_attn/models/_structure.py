"""What kind of model a `keras.Model` is, read off its layers.

The builders name their layers (`encoder_0`, `decoder_norm`, ...), so the
decoding and export code can find them again in a model rebuilt from a
`.keras` file, where Python attributes set by a builder are gone.
"""

from __future__ import annotations

import keras


def _has(model: keras.Model, name: str) -> bool:
    try:
        model.get_layer(name)
    except ValueError:
        return False
    return True


def _count(model: keras.Model, prefix: str) -> int:
    count = 0
    while _has(model, f"{prefix}_{count}"):
        count += 1
    return count


def translator_config(model: keras.Model) -> dict:
    """`{"kind": "rnn", "attention": ...}` or the Transformer's structure."""
    from keras_attn.models.rnn_translator import BahdanauDecoder

    if _has(model, "encoder_0") and _has(model, "decoder_0"):
        return {
            "kind": "transformer",
            "num_encoder_layers": _count(model, "encoder"),
            "num_decoder_layers": _count(model, "decoder"),
            "shared_vocabulary": _has(model, "shared_embedding"),
            # Each optional layer norm: absent from post-norm stacks; a
            # pretrained BERT encoder has post-norm blocks, an embedding norm
            # and a pre-norm decoder.
            "source_embedding_norm": _has(model, "source_embedding_norm"),
            "encoder_norm": _has(model, "encoder_norm"),
            "decoder_norm": _has(model, "decoder_norm"),
        }
    if _has(model, "encoder") and _has(model, "decoder"):
        if isinstance(model.get_layer("decoder"), BahdanauDecoder):
            attention = "bahdanau"
        else:
            attention = "luong_" + model.get_layer("attention").score_mode
        return {"kind": "rnn", "attention": attention}
    raise ValueError(
        "Expected a model built by rnn_translator or transformer_translator. "
        f"Received: a model {model.name!r} without their layers"
    )


def language_model_config(model: keras.Model) -> dict:
    if not _has(model, "decoder_0") or not _has(model, "embedding"):
        raise ValueError(
            "Expected a model built by transformer_language_model. "
            f"Received: a model {model.name!r} without its layers"
        )
    return {
        "num_layers": _count(model, "decoder"),
        "normalize_first": _has(model, "final_norm"),
    }


def stack_blocks(
    x,
    block_class,
    count,
    prefix,
    *,
    num_heads,
    intermediate_dim,
    dropout,
    normalize_first,
    final_norm_name,
    context=None,
    **block_kwargs,
):
    """`count` blocks named `{prefix}_{i}` over `x`, then, for pre-norm
    blocks, a final `LayerNormalization` named `final_norm_name`.

    `context` (an encoder sequence) is passed to every block when given: the
    decoder blocks of a translator. `block_kwargs` (`activation`,
    `layer_norm_epsilon`, ...) go to every block.
    """
    for index in range(count):
        block = block_class(
            intermediate_dim=intermediate_dim,
            num_heads=num_heads,
            dropout=dropout,
            normalize_first=normalize_first,
            name=f"{prefix}_{index}",
            **block_kwargs,
        )
        x = block(x) if context is None else block(x, context)
    if normalize_first:
        epsilon = block_kwargs.get("layer_norm_epsilon", 1e-5)
        x = keras.layers.LayerNormalization(epsilon=epsilon, name=final_norm_name)(x)
    return x
