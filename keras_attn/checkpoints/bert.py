"""BERT-style checkpoints in Hugging Face's layout, read and mapped onto
keras_attn's layers.

A BERT encoder (learned positions, an embedding layer norm, post-norm GELU
blocks) has the layout of keras_attn's `TokenAndPositionEmbedding`,
`LayerNormalization` and `TransformerEncoderBlock`s, so its weights load into
them: `load_bert_checkpoint(path)` reads and checks a checkpoint directory,
`load_bert_encoder(checkpoint, embedding, embedding_norm, blocks)` copies its
weights into those layers (the models' `from_bert` class methods call it).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np

from keras_attn.checkpoints.safetensors import read_safetensors

CHECKPOINT_FILES = ("config.json", "vocab.txt", "model.safetensors")


@dataclasses.dataclass(frozen=True)
class BertCheckpoint:
    """A pretrained BERT-style encoder: its config, weights and vocabulary.

    Attributes:
        config: the Hugging Face `config.json` as a dict.
        weights: parameter name -> float32 NumPy array (PyTorch layout).
        vocabulary: the word pieces, indexed by id.
        lowercase: whether the vocabulary is uncased (`do_lower_case` of
            `tokenizer_config.json` if present; else uncased unless the
            vocabulary holds capitalised pieces).
        path: the directory it was read from.
    """

    config: dict
    weights: dict
    vocabulary: list
    lowercase: bool
    path: Path

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def hidden_size(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def num_heads(self) -> int:
        return int(self.config["num_attention_heads"])

    @property
    def intermediate_size(self) -> int:
        return int(self.config["intermediate_size"])

    @property
    def max_positions(self) -> int:
        return int(self.config["max_position_embeddings"])

    @property
    def layer_norm_epsilon(self) -> float:
        return float(self.config.get("layer_norm_eps", 1e-12))

    def tokenizer(self, **kwargs):
        """The matching `WordPieceTokenizer` (`max_length`, `sequence_length`,
        ... as keyword arguments)."""
        # TensorFlow Text, imported only here: the models stay backend-agnostic.
        from keras_attn.text.wordpiece import WordPieceTokenizer

        return WordPieceTokenizer(self.vocabulary, lowercase=self.lowercase, **kwargs)


def load_bert_checkpoint(path: str | os.PathLike) -> BertCheckpoint:
    """Read a BERT-style checkpoint directory and check it can be loaded.

    Args:
        path: a directory with `config.json` (a `"bert"` model: absolute
            positions, GELU), `vocab.txt` and `model.safetensors`, as
            Hugging Face writes them (a `"bert."` prefix on the names is
            accepted).

    Returns:
        A `BertCheckpoint`.

    Raises:
        ValueError: a file is missing, or the model is not one this loader
            maps (the message names the setting and its value).
    """
    path = Path(path).expanduser()
    missing = [name for name in CHECKPOINT_FILES if not (path / name).is_file()]
    if missing:
        raise ValueError(
            f"`path` must be a BERT checkpoint directory holding "
            f"{', '.join(CHECKPOINT_FILES)}. Received: {path} (missing "
            f"{', '.join(missing)})"
        )
    config = json.loads((path / "config.json").read_text("utf-8"))
    expected = {
        "model_type": "bert",
        "hidden_act": "gelu",
        "position_embedding_type": "absolute",
    }
    for key, value in expected.items():
        if config.get(key, value) != value:
            raise ValueError(
                f"Only BERT encoders with {key}={value!r} can be loaded. "
                f"Received: {key}={config.get(key)!r} in {path / 'config.json'}"
            )
    for key in (
        "num_hidden_layers",
        "hidden_size",
        "num_attention_heads",
        "intermediate_size",
        "max_position_embeddings",
        "vocab_size",
    ):
        if not isinstance(config.get(key), int) or config[key] < 1:
            raise ValueError(
                f"{path / 'config.json'} must give {key} as a positive int. "
                f"Received: {key}={config.get(key)!r}"
            )
    if config["hidden_size"] % config["num_attention_heads"]:
        raise ValueError(
            "num_attention_heads must divide hidden_size. Received: "
            f"hidden_size={config['hidden_size']}, "
            f"num_attention_heads={config['num_attention_heads']}"
        )
    weights = {
        name.removeprefix("bert."): np.asarray(array, np.float32)
        for name, array in read_safetensors(path / "model.safetensors").items()
    }
    vocabulary = (path / "vocab.txt").read_text("utf-8").splitlines()
    if len(vocabulary) != config["vocab_size"]:
        raise ValueError(
            f"vocab.txt has {len(vocabulary)} pieces but config.json says "
            f"vocab_size={config['vocab_size']}. Received: {path}"
        )
    checkpoint = BertCheckpoint(
        config, weights, vocabulary, _is_uncased(path, vocabulary), path
    )
    _check_shapes(checkpoint)
    return checkpoint


def load_bert_encoder(checkpoint: BertCheckpoint, embedding, embedding_norm, blocks):
    """Copy the checkpoint's encoder weights into keras_attn layers.

    Args:
        checkpoint: a `BertCheckpoint`.
        embedding: a built `TokenAndPositionEmbedding` with learned positions
            (`vocabulary_size` pieces, at least `max_positions` positions):
            gets the word embeddings, and the position embeddings plus the
            token-type embedding of type 0 (every input is one segment).
        embedding_norm: a built `LayerNormalization`: the embedding norm.
        blocks: `checkpoint.num_layers` built post-norm GELU
            `TransformerEncoderBlock`s of the checkpoint's sizes.
    """
    w = checkpoint.weights
    d, heads = checkpoint.hidden_size, checkpoint.num_heads
    head_dim = d // heads
    if len(blocks) != checkpoint.num_layers:
        raise ValueError(
            f"`blocks` must be the checkpoint's {checkpoint.num_layers} encoder "
            f"blocks. Received: {len(blocks)} blocks"
        )
    embedding.set_weights(
        [
            w["embeddings.word_embeddings.weight"],
            w["embeddings.position_embeddings.weight"]
            + w["embeddings.token_type_embeddings.weight"][0],
        ]
    )
    embedding_norm.set_weights(
        [w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"]]
    )
    for index, block in enumerate(blocks):
        prefix = f"encoder.layer.{index}."

        def projection(part, prefix=prefix):  # (out, in) -> (d, heads, head_dim)
            kernel = w[f"{prefix}attention.self.{part}.weight"].T
            bias = w[f"{prefix}attention.self.{part}.bias"]
            return [kernel.reshape(d, heads, head_dim), bias.reshape(heads, head_dim)]

        def dense(part, prefix=prefix):
            return [w[f"{prefix}{part}.weight"].T, w[f"{prefix}{part}.bias"]]

        def norm(part, prefix=prefix):
            return [
                w[f"{prefix}{part}.LayerNorm.weight"],
                w[f"{prefix}{part}.LayerNorm.bias"],
            ]

        output = w[f"{prefix}attention.output.dense.weight"]
        block.set_weights(
            # The order of TransformerEncoderBlock.weights (keras-hub's layout).
            projection("query")
            + projection("key")
            + projection("value")
            + [
                output.T.reshape(heads, head_dim, d),
                w[f"{prefix}attention.output.dense.bias"],
            ]
            + norm("attention.output")
            + norm("output")
            + dense("intermediate.dense")
            + dense("output.dense")
        )


def _check_shapes(checkpoint: BertCheckpoint) -> None:
    """Every weight the loader reads is there with BERT's shape."""
    d, ff = checkpoint.hidden_size, checkpoint.intermediate_size
    shapes = {
        "embeddings.word_embeddings.weight": (len(checkpoint.vocabulary), d),
        "embeddings.position_embeddings.weight": (checkpoint.max_positions, d),
        "embeddings.LayerNorm.weight": (d,),
        "embeddings.LayerNorm.bias": (d,),
    }
    shapes["embeddings.token_type_embeddings.weight"] = (
        int(checkpoint.config.get("type_vocab_size", 2)),
        d,
    )
    for index in range(checkpoint.num_layers):
        prefix = f"encoder.layer.{index}."
        for part in ("query", "key", "value"):
            shapes[f"{prefix}attention.self.{part}.weight"] = (d, d)
            shapes[f"{prefix}attention.self.{part}.bias"] = (d,)
        shapes[f"{prefix}attention.output.dense.weight"] = (d, d)
        shapes[f"{prefix}intermediate.dense.weight"] = (ff, d)
        shapes[f"{prefix}intermediate.dense.bias"] = (ff,)
        shapes[f"{prefix}output.dense.weight"] = (d, ff)
        for part in ("attention.output.dense.bias", "output.dense.bias"):
            shapes[f"{prefix}{part}"] = (d,)
        for part in ("attention.output", "output"):
            shapes[f"{prefix}{part}.LayerNorm.weight"] = (d,)
            shapes[f"{prefix}{part}.LayerNorm.bias"] = (d,)
    for name, shape in shapes.items():
        found = checkpoint.weights.get(name)
        if found is None or found.shape != shape:
            raise ValueError(
                f"{checkpoint.path / 'model.safetensors'} must hold {name} of shape "
                f"{shape}. Received: "
                f"{'no such tensor' if found is None else found.shape}"
            )


def _is_uncased(path: Path, vocabulary: list) -> bool:
    tokenizer_config = path / "tokenizer_config.json"
    if tokenizer_config.is_file():
        value = json.loads(tokenizer_config.read_text("utf-8")).get("do_lower_case")
        if isinstance(value, bool):
            return value
    return not any(piece[:1].isupper() for piece in vocabulary if piece[:1] != "[")
