"""`WordPieceTokenizer`: BERT's tokenizer as a Keras layer on TensorFlow Text ops."""

from __future__ import annotations

import os
from pathlib import Path

import keras
import tensorflow as tf
import tensorflow_text as tf_text

from keras_attn.text.tokenizer import TokenizerLayer
from keras_attn.text.vocabulary import PAD_ID

CLS_TOKEN = "[CLS]"
SEP_TOKEN = "[SEP]"
PAD_TOKEN = "[PAD]"
UNK_TOKEN = "[UNK]"


@keras.saving.register_keras_serializable(package="keras_attn")
class WordPieceTokenizer(TokenizerLayer):
    """The tokenizer of a pretrained BERT-style encoder, `[CLS] pieces [SEP]`.

    Wraps `tensorflow_text.FastBertTokenizer` (BERT's basic tokenization:
    Unicode normalization, lower-casing and accent stripping when
    `lowercase`, splits on whitespace and punctuation; then greedy
    longest-match WordPiece), so it runs in a `tf.function`, a `tf.data` map
    and an exported SavedModel, where TF Serving needs the TensorFlow Text
    ops and nothing else. On the 2,119 validation and test movie sentences it
    gives the ids of Hugging Face's `BertTokenizer` for all but one (which
    holds `½`, which Hugging Face splits into `1`, a fraction slash and `2`).

    `tokenize` wraps every text as `[CLS] pieces [SEP]`, as the encoder saw
    its inputs in pretraining. `[PAD]` must be id 0, the padding id of the
    pipelines and of `mask_zero` embeddings (it is in BERT vocabularies).

    The vocabulary is saved as an asset file (`vocabulary.txt`, one piece a
    line), not in the config (see `TokenizerLayer`).

    Args:
        vocabulary: the word pieces, indexed by id (a list of strings), or the
            path of a `vocab.txt` file with one piece per line; or `None`, for
            a tokenizer that gets its vocabulary later (`set_vocabulary`,
            `load_assets`).
        lowercase: lower-case and strip accents first (uncased models).
        max_length: if set, the longest output in tokens, `[CLS]` and `[SEP]`
            included: longer texts lose their last word pieces and keep
            `[SEP]` last.
        sequence_length: if set, `tokenize` returns a dense `int32` tensor of
            this length (truncated as `max_length`, padded with 0); if `None`,
            a `tf.RaggedTensor`.
        **kwargs: base layer arguments (`name`, ...).

    Example:

    ```python
    tokenizer = WordPieceTokenizer("vocab.txt", max_length=64)
    tokenizer.tokenize(["A gripping film."])
    # <tf.RaggedTensor [[101, 1037, 13940, 2143, 1012, 102]]>
    ```
    """

    pad_id = PAD_ID
    VOCABULARY_FILE = "vocabulary.txt"
    _SET_VOCABULARY = "set_vocabulary(vocabulary)"

    def __init__(
        self,
        vocabulary=None,
        lowercase: bool = True,
        max_length: int | None = None,
        sequence_length: int | None = None,
        **kwargs,
    ):
        kwargs.setdefault("trainable", False)
        super().__init__(**kwargs)
        if not isinstance(lowercase, bool):
            raise ValueError(f"`lowercase` must be a bool. Received: {lowercase=}")
        for name, value, least in (
            ("max_length", max_length, 3),
            ("sequence_length", sequence_length, 3),
        ):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < least
            ):
                raise ValueError(
                    f"`{name}` must be an int of at least {least} ([CLS], a piece "
                    f"and [SEP]) or None. Received: {name}={value!r}"
                )
        self.lowercase = lowercase
        self.max_length = max_length
        self.sequence_length = sequence_length
        self._init_vocabulary()
        self.set_vocabulary(vocabulary)
        self.built = True

    @property
    def vocabulary(self) -> list[str] | None:
        """The word pieces, indexed by id (`None` until it has them)."""
        return self._shared_vocabulary.value

    def set_vocabulary(self, vocabulary) -> None:
        """Give the tokenizer its word pieces (a list of strings or the path
        of a `vocab.txt`; `None` leaves it without), shared with its
        copies."""
        if vocabulary is None:
            self._shared_vocabulary.set(None)
            return
        if isinstance(vocabulary, (str, os.PathLike)):
            vocabulary = read_vocabulary(vocabulary)
        if (
            not isinstance(vocabulary, (list, tuple))
            or not vocabulary
            or not all(isinstance(piece, str) for piece in vocabulary)
        ):
            raise ValueError(
                "`vocabulary` must be a non-empty list of strings or the path of "
                f"a vocab.txt file. Received: vocabulary of type {type(vocabulary)}"
            )
        vocabulary = list(vocabulary)
        missing = [
            token
            for token in (CLS_TOKEN, SEP_TOKEN, PAD_TOKEN, UNK_TOKEN)
            if token not in vocabulary
        ]
        if missing:
            raise ValueError(
                f"`vocabulary` must hold the special tokens {missing}. "
                f"Received: a vocabulary of {len(vocabulary)} pieces"
            )
        if vocabulary[PAD_ID] != PAD_TOKEN:
            raise ValueError(
                f"`vocabulary` must have {PAD_TOKEN} at id {PAD_ID}. "
                f"Received: {vocabulary[PAD_ID]!r} at id {PAD_ID}"
            )
        derived = {
            "cls_id": vocabulary.index(CLS_TOKEN),
            "sep_id": vocabulary.index(SEP_TOKEN),
            "unk_id": vocabulary.index(UNK_TOKEN),
            "index": {piece: index for index, piece in enumerate(vocabulary)},
        }
        self._shared_vocabulary.set(vocabulary, derived)

    @property
    def cls_id(self) -> int:
        return self._vocabulary().derived["cls_id"]

    @property
    def sep_id(self) -> int:
        return self._vocabulary().derived["sep_id"]

    @property
    def unk_id(self) -> int:
        return self._vocabulary().derived["unk_id"]

    def _write_vocabulary(self, path: Path) -> None:
        # Bytes: no newline translation, so `_load_vocabulary` reads back
        # every piece exactly.
        path.write_bytes("".join(f"{piece}\n" for piece in self.vocabulary).encode())

    def _load_vocabulary(self, path: Path) -> None:
        self.set_vocabulary(path.read_bytes().decode("utf-8").split("\n")[:-1])

    def _fast_bert(self):
        """A `FastBertTokenizer`: one kept for eager calls; a new one in each
        traced graph, so that graphs hold their own copy of the model (its
        flatbuffer is a constant of the graph that builds it)."""
        shared = self._vocabulary()
        if not tf.executing_eagerly():
            return self._build_fast_bert(shared.value)
        # Kept with the vocabulary (copies may differ in `lowercase`), out of
        # Keras/TF tracking: graphs never capture it.
        key = ("fast_bert", self.lowercase)
        if shared.derived.get(key) is None:
            shared.derived[key] = self._build_fast_bert(shared.value)
        return shared.derived[key]

    def _build_fast_bert(self, vocabulary):
        return tf_text.FastBertTokenizer(
            vocab=vocabulary,
            token_out_type=tf.int32,
            unknown_token=UNK_TOKEN,
            lower_case_nfd_strip_accents=self.lowercase,
            support_detokenization=True,
        )

    @property
    def vocabulary_size(self) -> int:
        return len(self._vocabulary().value)

    def get_vocabulary(self) -> list[str]:
        return list(self._vocabulary().value)

    def id_to_token(self, id: int) -> str:
        vocabulary = self._vocabulary().value
        if not 0 <= id < len(vocabulary):
            raise ValueError(f"`id` must be in [0, {len(vocabulary)}). Received: {id=}")
        return vocabulary[id]

    def token_to_id(self, token: str) -> int:
        """The id of a piece (`unk_id` if it is not one)."""
        return self._vocabulary().derived["index"].get(token, self.unk_id)

    def tokenize(self, inputs):
        """Strings to `[CLS] pieces [SEP]` ids.

        Args:
            inputs: a string or a 1-D batch of strings (tensor, list, array).

        Returns:
            `int32` ids: for a batch a `tf.RaggedTensor` `[batch, None]`, or a
            dense `[batch, sequence_length]` tensor if `sequence_length` is
            set; for a single string, the same without the batch axis. An
            empty text gives `[CLS] [SEP]`.
        """
        inputs, scalar = self._text_batch(inputs)
        pieces = self._fast_bert().tokenize(inputs)  # (B, None)
        limits = [n for n in (self.max_length, self.sequence_length) if n is not None]
        if limits:
            pieces = pieces[:, : min(limits) - 2]  # room for [CLS] and [SEP]
        rows = pieces.nrows()
        ids = tf.concat(
            [
                tf.RaggedTensor.from_tensor(tf.fill([rows, 1], self.cls_id)),
                pieces,
                tf.RaggedTensor.from_tensor(tf.fill([rows, 1], self.sep_id)),
            ],
            axis=1,
        )  # (B, None), within sequence_length already
        return self._tokenized(ids, scalar)

    def detokenize(self, ids):
        """Ids back to text: the word pieces joined into words, separated by
        spaces (lower-cased text stays lower-cased); `[CLS]`, `[SEP]` and
        padding are dropped.

        Args:
            ids: integer ids, `[batch, length]` (dense or ragged) or `[length]`.

        Returns:
            A `tf.string` tensor `[batch]`, or a scalar for `[length]` ids.
        """
        ids, scalar = self._id_batch(ids)
        if not isinstance(ids, tf.RaggedTensor):
            ids = tf.RaggedTensor.from_tensor(ids)
        keep = (ids != PAD_ID) & (ids != self.cls_id) & (ids != self.sep_id)
        texts = self._fast_bert().detokenize(tf.ragged.boolean_mask(ids, keep))
        return texts[0] if scalar else texts

    def save_vocabulary(self, path: str | os.PathLike) -> Path:
        """Write the pieces to `path`, one a line (a `vocab.txt`)."""
        vocabulary = self._vocabulary().value
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(f"{piece}\n" for piece in vocabulary), "utf-8")
        return path

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "vocabulary": None,  # an asset file (`save_assets`)
                "lowercase": self.lowercase,
                "max_length": self.max_length,
                "sequence_length": self.sequence_length,
            }
        )
        return config


def read_vocabulary(path: str | os.PathLike) -> list[str]:
    """The pieces of a `vocab.txt` file (one a line, ids from 0)."""
    path = Path(path).expanduser()
    try:
        text = path.read_text("utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(
            f"`vocabulary` must be a readable UTF-8 vocab.txt file. "
            f"Received: {path} ({error})"
        ) from error
    return text.splitlines()
