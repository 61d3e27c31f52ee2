"""The two backbones of a `TransformerTranslator`: built from the
constructor's sizes (`backbones_of_sizes`, `decoder_sizes`) or given and
checked (`given_backbones`). Imports no TensorFlow."""

from __future__ import annotations

import keras

from keras_attn import _validation as v
from keras_attn.models.backbones import (
    TransformerDecoderBackbone,
    TransformerEncoderBackbone,
)
from keras_attn.models.task import BackboneTask

ENCODER_LAYOUTS = ("transformer", "bert")
POSITIONS = ("sinusoidal", "learned")


def translator_embedding_settings(embedding_dim) -> dict:
    """A translator side's embedding as in the paper: scaled by `sqrt(d)`,
    initialised with standard deviation `d ** -0.5` (so tied output logits
    start near unit scale)."""
    return {
        "scale_embeddings": True,
        "embeddings_initializer": {
            "class_name": "RandomNormal",
            "config": {"stddev": embedding_dim**-0.5},
        },
    }


def decoder_sizes(
    vocabulary_size,
    sequence_length,
    embedding_dim,
    num_layers,
    num_heads,
    intermediate_dim,
    dropout,
    position,
    normalize_first,
    encoder_dim,
) -> dict:
    return {
        "vocabulary_size": vocabulary_size,
        "sequence_length": sequence_length,
        "embedding_dim": embedding_dim,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "intermediate_dim": intermediate_dim,
        "dropout": dropout,
        "position": position,
        "normalize_first": normalize_first,
        "cross_attention": True,
        "encoder_dim": encoder_dim if encoder_dim != embedding_dim else None,
        **translator_embedding_settings(embedding_dim),
    }


def backbones_of_sizes(
    source_vocabulary_size,
    target_vocabulary_size,
    sequence_length,
    embedding_dim,
    num_encoder_layers,
    num_decoder_layers,
    num_heads,
    intermediate_dim,
    dropout,
    normalize_first,
    position,
    encoder_layout,
    encoder_dim,
    encoder_num_heads,
    encoder_intermediate_dim,
    source_sequence_length,
    encoder_layer_norm_epsilon,
    shared_vocabulary,
    dtype=None,
):
    """The encoder and decoder backbones of the constructor's sizes."""
    for name, value in (
        ("source_vocabulary_size", source_vocabulary_size),
        ("target_vocabulary_size", target_vocabulary_size),
        ("sequence_length", sequence_length),
        ("embedding_dim", embedding_dim),
        ("num_encoder_layers", num_encoder_layers),
        ("num_decoder_layers", num_decoder_layers),
    ):
        v.check_positive_int(name, value)
    for name, value in (
        ("encoder_dim", encoder_dim),
        ("encoder_num_heads", encoder_num_heads),
        ("encoder_intermediate_dim", encoder_intermediate_dim),
        ("source_sequence_length", source_sequence_length),
    ):
        v.check_positive_int(name, value, allow_none=True)
    v.check_rate("dropout", dropout)
    v.check_choice("position", position, POSITIONS)
    v.check_choice("encoder_layout", encoder_layout, ENCODER_LAYOUTS)
    bert = encoder_layout == "bert"
    if shared_vocabulary and (
        source_vocabulary_size != target_vocabulary_size
        or bert
        or (encoder_dim or embedding_dim) != embedding_dim
    ):
        raise ValueError(
            "A shared vocabulary needs equal vocabulary sizes and widths and "
            "the Transformer encoder layout. Received: "
            f"source_vocabulary_size={source_vocabulary_size}, "
            f"target_vocabulary_size={target_vocabulary_size}, "
            f"encoder_dim={encoder_dim}, encoder_layout={encoder_layout!r}"
        )
    epsilon = encoder_layer_norm_epsilon
    if epsilon is None:
        epsilon = 1e-12 if bert else 1e-5
    source_dim = encoder_dim or embedding_dim
    encoder_sizes = {
        "vocabulary_size": source_vocabulary_size,
        "sequence_length": source_sequence_length or sequence_length,
        "embedding_dim": source_dim,
        "num_layers": num_encoder_layers,
        "num_heads": encoder_num_heads or num_heads,
        "intermediate_dim": encoder_intermediate_dim or intermediate_dim,
        "dropout": dropout,
        "layer_norm_epsilon": epsilon,
    }
    if bert:
        encoder = TransformerEncoderBackbone(
            **encoder_sizes,
            position="learned",
            activation="gelu",
            embedding_norm=True,
            dtype=dtype,
        )
    else:
        if shared_vocabulary:
            encoder_sizes["sequence_length"] = sequence_length
        encoder = TransformerEncoderBackbone(
            **encoder_sizes,
            position=position,
            normalize_first=normalize_first,
            **translator_embedding_settings(source_dim),
            dtype=dtype,
        )
    decoder = TransformerDecoderBackbone(
        **decoder_sizes(
            target_vocabulary_size,
            sequence_length,
            embedding_dim,
            num_decoder_layers,
            num_heads,
            intermediate_dim,
            dropout,
            position,
            # A pretrained (post-norm) encoder gets a pre-norm decoder.
            normalize_first=normalize_first or bert,
            encoder_dim=source_dim,
        ),
        token_embedding=encoder.embedding if shared_vocabulary else None,
        dtype=dtype,
    )
    return encoder, decoder


def given_backbones(backbone, decoder_backbone, shared_vocabulary):
    """The encoder and decoder backbones given to the constructor, checked;
    with a shared vocabulary the decoder (a config, or None for the
    encoder's sizes) is built on the encoder's embedding."""
    BackboneTask.check_backbone("backbone", backbone, TransformerEncoderBackbone)
    if shared_vocabulary:
        if isinstance(decoder_backbone, keras.Model):
            if decoder_backbone.embedding is not backbone.embedding:
                raise ValueError(
                    "With shared_vocabulary=True the decoder backbone must be "
                    "built on the encoder's embedding "
                    "(token_embedding=backbone.embedding). Received: a "
                    "decoder_backbone with its own embedding"
                )
        else:
            raise ValueError(
                "With shared_vocabulary=True pass a decoder_backbone built with "
                "token_embedding=backbone.embedding. Received: "
                f"decoder_backbone={decoder_backbone!r}"
            )
    BackboneTask.check_backbone(
        "decoder_backbone", decoder_backbone, TransformerDecoderBackbone
    )
    if not decoder_backbone.cross_attention:
        raise ValueError(
            "A translator's decoder backbone attends to the encoder. Received: "
            "decoder_backbone with cross_attention=False"
        )
    width = decoder_backbone.encoder_dim or decoder_backbone.embedding_dim
    if width != backbone.embedding_dim:
        raise ValueError(
            "The decoder backbone's `encoder_dim` must be the encoder's width. "
            f"Received: encoder_dim={width}, the encoder's "
            f"embedding_dim={backbone.embedding_dim}"
        )
    return backbone, decoder_backbone
