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


class TokenizerLayer(keras.layers.Layer):
    """What the tokenizer layers share: calling the layer tokenizes, into a
    dense `[..., sequence_length]` tensor or a ragged one."""

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

    Args:
        proto: the SentencePiece model, as the bytes of a `.model` file or its
            path.
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

    def __init__(self, proto, sequence_length: int | None = None, **kwargs):
        kwargs.setdefault("trainable", False)
        super().__init__(**kwargs)
        if isinstance(proto, (str, os.PathLike)):
            proto = Path(proto).expanduser().read_bytes()
        if not isinstance(proto, bytes) or not proto:
            raise ValueError(
                "`proto` must be the bytes of a SentencePiece model or the path of "
                f"one. Received: proto of type {type(proto)}"
            )
        if sequence_length is not None and (
            not isinstance(sequence_length, int) or sequence_length < 1
        ):
            raise ValueError(
                "`sequence_length` must be a positive int or None. "
                f"Received: {sequence_length=}"
            )
        self.proto = proto
        self.sequence_length = sequence_length
        try:
            specials = [
                token.decode("utf-8")
                for token in self._eager(
                    lambda sp: sp.id_to_string(
                        tf.constant([PAD_ID, UNK_ID, START_ID, END_ID])
                    )
                ).numpy()
            ]
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
        self._vocabulary_size = int(self._eager(lambda sp: sp.vocab_size()))
        self.built = True

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
        return tf_text.SentencepieceTokenizer(model=self.proto, out_type=tf.int32)

    def _eager_sentencepiece(self, rebuild=False):
        if rebuild or self.__dict__.get("_eager_tokenizer") is None:
            # Kept out of Keras/TF tracking: graphs never capture it.
            self.__dict__["_eager_tokenizer"] = tf_text.SentencepieceTokenizer(
                model=self.proto, out_type=tf.int32
            )
        return self.__dict__["_eager_tokenizer"]

    def _eager(self, fn):
        """Run `fn(tokenizer)` eagerly, rebuilding a resource that was cleared."""
        try:
            return fn(self._eager_sentencepiece())
        except tf.errors.NotFoundError:
            return fn(self._eager_sentencepiece(rebuild=True))

    @property
    def vocabulary_size(self) -> int:
        """Number of ids, special and byte pieces included."""
        return self._vocabulary_size

    def get_vocabulary(self) -> list[str]:
        """The pieces, indexed by id."""
        pieces = self._eager(
            lambda sp: sp.id_to_string(tf.range(self._vocabulary_size))
        )
        return [piece.decode("utf-8") for piece in pieces.numpy()]

    def id_to_token(self, id: int) -> str:
        if not 0 <= id < self._vocabulary_size:
            raise ValueError(
                f"`id` must be in [0, {self._vocabulary_size}). Received: {id=}"
            )
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
                model=self.proto, out_type=tf.int32, nbest_size=-1, alpha=alpha
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
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self.proto)
        return path

    @classmethod
    def from_file(cls, path: str | os.PathLike, **kwargs) -> SubwordTokenizer:
        """A tokenizer for the SentencePiece model file at `path`."""
        return cls(Path(path).expanduser().read_bytes(), **kwargs)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "proto": base64.b64encode(self.proto).decode("ascii"),
                "sequence_length": self.sequence_length,
            }
        )
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["proto"] = base64.b64decode(config["proto"])
        return cls(**config)
