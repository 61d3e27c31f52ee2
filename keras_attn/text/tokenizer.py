"""`SubwordTokenizer`: a SentencePiece tokenizer layer on TensorFlow Text ops."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import keras
import tensorflow as tf
import tensorflow_text as tf_text

from keras_attn.text.vocabulary import (
    END_ID,
    END_TOKEN,
    PAD_ID,
    PAD_TOKEN,
    START_ID,
    START_TOKEN,
    UNK_ID,
    UNK_TOKEN,
)


class _SharedVocabulary:
    """A tokenizer's vocabulary and what is computed from it, shared by the
    tokenizer and its copies (`TokenizerLayer.copy`): a vocabulary given
    later (`load_assets`, `set_proto`, `set_vocabulary`) reaches them all."""

    def __init__(self):
        self.value = None
        self.derived = {}  # computed from `value`; emptied when it changes

    def set(self, value, derived=None):
        self.value = value
        self.derived = dict(derived or {})


class TokenizerLayer(keras.layers.Layer):
    """What the tokenizer layers share: calling the layer tokenizes, into a
    dense `[..., sequence_length]` tensor or a ragged one.

    The vocabulary is not in the config (`get_config` records `None`, as
    keras-hub's tokenizers do): Keras saves it as an asset file
    (`save_assets`: `assets/.../vocabulary.spm` or `vocabulary.txt` in a
    `.keras` file or a preset) and `keras.saving.load_model` and
    `from_preset` read it back (`load_assets`). A tokenizer made from a
    config alone has no vocabulary until then, and says so when used.
    """

    # The vocabulary's asset file (set by each tokenizer class).
    VOCABULARY_FILE = None

    def _init_vocabulary(self):
        # A plain object, out of Keras' tracking and of the saving walk.
        self._shared_vocabulary = _SharedVocabulary()
        self._is_copy = False

    @property
    def has_vocabulary(self) -> bool:
        """Whether the tokenizer has its vocabulary (one made from a config
        gets it from `load_assets`)."""
        return self._shared_vocabulary.value is not None

    def _vocabulary(self):
        """The vocabulary and what was computed from it, or a `ValueError`
        saying how to give one."""
        shared = self._shared_vocabulary
        if shared.value is None:
            raise ValueError(
                f"{type(self).__name__} {self.name!r} has no vocabulary. Its "
                "config records none (the vocabulary is saved as an asset "
                "file): a tokenizer made from a config alone gets it from "
                "`load_assets(dir_path)`, as `keras.saving.load_model` and "
                f"`from_preset` call it, or from `{self._SET_VOCABULARY}`."
            )
        return shared

    def copy(self, **changes):
        """A tokenizer of this class with this one's config and `changes`
        (say `sequence_length=64`), sharing this one's vocabulary.

        The copy is a view of this tokenizer for code that needs other
        settings (a dense copy for a classifier's inputs): a vocabulary this
        tokenizer gets later (`load_assets`, `set_proto`,
        `set_vocabulary`) reaches the copy too, and the copy writes no asset
        file of its own (`save_assets`), so a saved model holding both
        carries the vocabulary once. Save the original: a copy saved
        without it loads without a vocabulary. For an independent tokenizer,
        pass the vocabulary to the constructor.
        """
        copy = type(self).from_config({**self.get_config(), **changes})
        copy._shared_vocabulary = self._shared_vocabulary
        copy._is_copy = True
        return copy

    def save_assets(self, dir_path):
        """Write the vocabulary to `dir_path` (Keras' saving calls this: the
        vocabulary is an asset of `.keras` files and presets, not part of
        the config). A copy (`copy`), or a tokenizer without a vocabulary,
        writes nothing."""
        if self._is_copy or not self.has_vocabulary:
            return
        self._write_vocabulary(Path(dir_path) / self.VOCABULARY_FILE)

    def load_assets(self, dir_path):
        """Read the vocabulary `save_assets` wrote to `dir_path`. Without
        the file (a file saved before vocabularies were assets holds it in
        its config; Keras passes `None` for a path with no assets), the
        tokenizer keeps the vocabulary it has."""
        if dir_path is None:
            return
        path = Path(dir_path) / self.VOCABULARY_FILE
        if path.is_file():
            self._load_vocabulary(path)

    def call(self, inputs):
        return self.tokenize(inputs)

    def compute_output_spec(self, inputs):
        # Only meaningful on the TensorFlow backend (string inputs).
        length = self.sequence_length
        shape = (*inputs.shape, length) if length else (*inputs.shape, None)
        return keras.KerasTensor(shape, dtype="int32")

    @staticmethod
    def _text_batch(inputs):
        """`(texts [B], scalar)`: a string or a 1-D batch of strings as a
        batch, and whether it was a single string."""
        inputs = tf.convert_to_tensor(inputs, dtype=tf.string)
        scalar = inputs.shape.rank == 0
        return (inputs[tf.newaxis] if scalar else inputs), scalar

    @staticmethod
    def _id_batch(ids):
        """`(int32 ids [B, T], scalar)`: dense or ragged ids, `[B, T]` or
        `[T]`, as a batch, and whether they were a single sequence."""
        if not isinstance(ids, tf.RaggedTensor):
            ids = tf.convert_to_tensor(ids)
        ids = tf.cast(ids, tf.int32)
        scalar = ids.shape.rank == 1
        return (ids[tf.newaxis] if scalar else ids), scalar

    def _tokenized(self, ids, scalar):
        """`tokenize`'s result from ragged ids `[B, None]`: dense `[B,
        sequence_length]` (truncated, padded with `PAD_ID`) when the length is
        set, and without the batch axis for a single string."""
        if self.sequence_length is not None:
            ids = ids[:, : self.sequence_length].to_tensor(
                default_value=PAD_ID, shape=[None, self.sequence_length]
            )  # (B, L)
        return ids[0] if scalar else ids


@keras.saving.register_keras_serializable(package="keras_attn")
class SubwordTokenizer(TokenizerLayer):
    """SentencePiece subword tokenizer whose graph holds TensorFlow Text ops only.

    Wraps `tensorflow_text.SentencepieceTokenizer`, so tokenizing and
    detokenizing run inside a `tf.function`, a `tf.data` map and an exported
    SavedModel, served by TF Serving with the TensorFlow Text ops linked in;
    neither Keras nor the `sentencepiece` package is needed there. (keras-hub's
    `SentencePieceTokenizer` wraps the same ops, but outside a `tf.function`
    it runs the `sentencepiece` package and returns Python lists; this layer
    runs the same TensorFlow ops everywhere, eagerly too.)

    Special ids (`train_subword_vocabulary` trains vocabularies with them; a
    model with other ids is refused): `pad_id` 0 `<pad>`, `unk_id` 1 `<unk>`,
    `start_id` 2 `<s>`, `end_id` 3 `</s>`. `tokenize` never adds start or end
    tokens (the `tf.data` pipelines do where a task needs them).

    The tokenizer runs on strings on the CPU, with TensorFlow, whatever the
    Keras backend: the pipelines call `tokenize`/`detokenize` directly;
    calling the layer (`tokenizer(texts)`, i.e. `tokenize`) inside a model
    needs the TensorFlow backend.

    The SentencePiece model is saved as an asset file (`vocabulary.spm`),
    not in the config (see `TokenizerLayer`).

    Args:
        proto: the SentencePiece model, as the bytes of a `.model` file or its
            path; or `None`, for a tokenizer that gets its model later
            (`set_proto`, `load_assets`).
        sequence_length: if set, `tokenize` returns a dense `int32` tensor of
            this length: longer token sequences are truncated, shorter ones
            padded with `pad_id`. If `None`, a `tf.RaggedTensor`.
        **kwargs: base layer arguments (`name`, ...).

    Example:

    ```python
    path = train_subword_vocabulary(sentences, "vocab/de.model",
                                    vocabulary_size=8000)
    tokenizer = SubwordTokenizer(path)
    ids = tokenizer.tokenize(["Wie geht's?"])      # RaggedTensor [1, None]
    tokenizer.detokenize(ids)                        # [b"Wie geht's?"]
    ```
    """

    pad_id = PAD_ID
    unk_id = UNK_ID
    start_id = START_ID
    end_id = END_ID

    VOCABULARY_FILE = "vocabulary.spm"
    _SET_VOCABULARY = "set_proto(proto)"

    def __init__(self, proto=None, sequence_length: int | None = None, **kwargs):
        kwargs.setdefault("trainable", False)
        super().__init__(**kwargs)
        if sequence_length is not None and (
            not isinstance(sequence_length, int) or sequence_length < 1
        ):
            raise ValueError(
                "`sequence_length` must be a positive int or None. "
                f"Received: {sequence_length=}"
            )
        self.sequence_length = sequence_length
        self._init_vocabulary()
        self.set_proto(proto)
        self.built = True

    @property
    def proto(self) -> bytes | None:
        """The SentencePiece model's bytes (`None` until it has one)."""
        return self._shared_vocabulary.value

    def set_proto(self, proto) -> None:
        """Give the tokenizer its SentencePiece model (the bytes of a
        `.model` file or its path; `None` leaves it without one), shared
        with its copies."""
        if proto is None:
            self._shared_vocabulary.set(None)
            return
        if isinstance(proto, (str, os.PathLike)):
            proto = Path(proto).expanduser().read_bytes()
        if not isinstance(proto, bytes) or not proto:
            raise ValueError(
                "`proto` must be the bytes of a SentencePiece model or the path of "
                f"one. Received: proto of type {type(proto)}"
            )
        try:
            sentencepiece = tf_text.SentencepieceTokenizer(
                model=proto, out_type=tf.int32
            )
            specials = [
                token.decode("utf-8")
                for token in sentencepiece.id_to_string(
                    tf.constant([PAD_ID, UNK_ID, START_ID, END_ID])
                ).numpy()
            ]
            vocabulary_size = int(sentencepiece.vocab_size())
        except (tf.errors.OpError, ValueError) as error:
            raise ValueError(
                f"`proto` is not a SentencePiece model: {error}"
            ) from error
        expected = [PAD_TOKEN, UNK_TOKEN, START_TOKEN, END_TOKEN]
        if specials != expected:
            raise ValueError(
                f"The model's ids 0-3 are {specials}; expected {expected}. Train it "
                "with keras_attn.text.train_subword_vocabulary."
            )
        self._shared_vocabulary.set(
            proto, {"size": vocabulary_size, "eager": sentencepiece}
        )

    def _write_vocabulary(self, path: Path) -> None:
        path.write_bytes(self.proto)

    def _load_vocabulary(self, path: Path) -> None:
        self.set_proto(path.read_bytes())

    def _graph_sentencepiece(self):
        """A TensorFlow Text tokenizer built in the graph being traced.

        TensorFlow Text keeps the SentencePiece model in a resource owned by
        the kernel that created it. Built eagerly, it lives in the eager kernel
        cache, which `tf.random.set_seed`, `keras.utils.set_random_seed` and
        `keras.backend.clear_session` empty, and every graph that captured it
        then fails with "Resource ... SentencepieceOp ... does not exist"
        (tensorflow/text#570). So inside a `tf.function` or a `tf.data`
        function the model op is created in that graph (its kernel, and the
        model, belong to the graph), and the eager one is rebuilt when needed.
        """
        proto = self._vocabulary().value
        return tf_text.SentencepieceTokenizer(model=proto, out_type=tf.int32)

    def _eager_sentencepiece(self, rebuild=False):
        # Kept with the vocabulary, out of Keras/TF tracking: graphs never
        # capture it.
        shared = self._vocabulary()
        if rebuild or shared.derived.get("eager") is None:
            shared.derived["eager"] = tf_text.SentencepieceTokenizer(
                model=shared.value, out_type=tf.int32
            )
        return shared.derived["eager"]

    def _eager(self, fn):
        """Run `fn(tokenizer)` eagerly, rebuilding a resource that was cleared."""
        try:
            return fn(self._eager_sentencepiece())
        except tf.errors.NotFoundError:
            return fn(self._eager_sentencepiece(rebuild=True))

    @property
    def vocabulary_size(self) -> int:
        """Number of ids, special and byte pieces included."""
        return self._vocabulary().derived["size"]

    def get_vocabulary(self) -> list[str]:
        """The pieces, indexed by id."""
        size = self.vocabulary_size
        pieces = self._eager(lambda sp: sp.id_to_string(tf.range(size)))
        return [piece.decode("utf-8") for piece in pieces.numpy()]

    def id_to_token(self, id: int) -> str:
        size = self.vocabulary_size
        if not 0 <= id < size:
            raise ValueError(f"`id` must be in [0, {size}). Received: {id=}")
        return self._eager(lambda sp: sp.id_to_string(id)).numpy().decode("utf-8")

    def token_to_id(self, token: str) -> int:
        """The id of a piece (`unk_id` if it is not one)."""
        return int(self._eager(lambda sp: sp.string_to_id(token)).numpy())

    def tokenize(self, inputs):
        """Strings to token ids.

        Args:
            inputs: a string or a 1-D batch of strings (tensor, list, array).

        Returns:
            `int32` ids: for a batch a `tf.RaggedTensor` `[batch, None]`, or a
            dense `[batch, sequence_length]` tensor if `sequence_length` is
            set; for a single string, the same without the batch axis.
        """
        return self._tokenize(inputs, alpha=None)

    def sample(self, inputs, alpha: float = 0.5):
        """Strings to token ids, each segmentation drawn at random.

        Subword regularization (Kudo, 2018): instead of the most likely
        segmentation, one is sampled from all of them with probability
        proportional to `P(segmentation) ** alpha`, anew at every call, so a
        model trained on sampled segmentations sees each word split several
        ways. Lower `alpha` samples more uniformly (more, shorter pieces;
        docs/DATA_PIPELINES.md gives the counts on the Ding sentences). The
        text is unchanged:
        `detokenize(sample(texts))` equals `detokenize(tokenize(texts))`
        (the normalised texts). For training only;
        evaluate and serve with `tokenize`. The draws come from
        SentencePiece's own generator: `tf.random.set_seed` does not fix them.

        Args:
            inputs: as for `tokenize`.
            alpha: the smoothing exponent, a positive float.

        Returns:
            As `tokenize`.
        """
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
            raise ValueError(f"`alpha` must be a positive float. Received: {alpha=}")
        return self._tokenize(inputs, alpha=float(alpha))

    def _tokenize(self, inputs, alpha):
        inputs, scalar = self._text_batch(inputs)
        if alpha is not None:
            # Sampling: nbest_size -1 draws from every segmentation. Built where
            # it is used, like `_graph_sentencepiece` (a tf.data map traces it).
            ids = tf_text.SentencepieceTokenizer(
                model=self._vocabulary().value,
                out_type=tf.int32,
                nbest_size=-1,
                alpha=alpha,
            ).tokenize(inputs)  # (B, None)
        elif tf.executing_eagerly():
            ids = self._eager(lambda sp: sp.tokenize(inputs))  # (B, None)
        else:
            ids = self._graph_sentencepiece().tokenize(inputs)  # (B, None)
        return self._tokenized(ids, scalar)

    def detokenize(self, ids):
        """Token ids back to text.

        Padding and start tokens are dropped, and everything from the first
        end token on (decoders emit `end_id` when done). Byte pieces are
        reassembled into characters; a byte sequence that is not valid UTF-8
        decodes to U+FFFD.

        Args:
            ids: integer ids, `[batch, length]` (dense, padded with `pad_id`,
                or ragged) or `[length]`.

        Returns:
            A `tf.string` tensor `[batch]`, or a scalar for `[length]` ids.
        """
        ids, scalar = self._id_batch(ids)
        if isinstance(ids, tf.RaggedTensor):
            ids = ids.to_tensor(default_value=PAD_ID)  # (B, T)
        ended = tf.cumsum(tf.cast(ids == END_ID, tf.int32), axis=-1, exclusive=True)
        keep = (ended == 0) & (ids != END_ID) & (ids != PAD_ID) & (ids != START_ID)
        kept = tf.ragged.boolean_mask(ids, keep)
        if tf.executing_eagerly():
            texts = self._eager(lambda sp: sp.detokenize(kept))
        else:
            texts = self._graph_sentencepiece().detokenize(kept)
        return texts[0] if scalar else texts

    def save_proto(self, path: str | os.PathLike) -> Path:
        """Write the SentencePiece model to `path` (load it with `from_file`)."""
        proto = self._vocabulary().value
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(proto)
        return path

    @classmethod
    def from_file(cls, path: str | os.PathLike, **kwargs) -> SubwordTokenizer:
        """A tokenizer for the SentencePiece model file at `path`."""
        return cls(Path(path).expanduser().read_bytes(), **kwargs)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "proto": None,  # an asset file (`save_assets`)
                "sequence_length": self.sequence_length,
            }
        )
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if isinstance(config.get("proto"), str):
            # Saved before the model was an asset: inline, in base64.
            config["proto"] = base64.b64decode(config["proto"])
        return cls(**config)
