"""Training SentencePiece subword vocabularies on a training split.

Why SentencePiece (and not WordPiece): its detokenizer reconstructs the
spacing of the original text from the pieces (`▁` marks a space), so German
output reads as normal text for sacrebleu, and with the lossless settings
below `detokenize(tokenize(text)) == text` for any text, newlines included,
which bits-per-character needs. WordPiece (keras-hub's
`compute_word_piece_vocabulary`) splits off punctuation and, lowercased,
loses case; its detokenized output has to be re-spaced by hand.

The trainer is the `sentencepiece` package (a dependency of keras-hub); the
trained model runs with TensorFlow Text's ops only (`SubwordTokenizer`), so
the `sentencepiece` package is not needed to serve it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from keras_attn._extras import missing_extra_error

PAD_ID, UNK_ID, START_ID, END_ID = 0, 1, 2, 3
PAD_TOKEN, UNK_TOKEN, START_TOKEN, END_TOKEN = "<pad>", "<unk>", "<s>", "</s>"
MODEL_TYPES = ("unigram", "bpe")


def train_subword_vocabulary(
    texts: Iterable[str],
    path: str | os.PathLike,
    *,
    vocabulary_size: int = 8000,
    lossless: bool = False,
    lowercase: bool = False,
    model_type: str = "unigram",
    character_coverage: float = 0.9995,
    max_sentences: int = 0,
    num_threads: int | None = None,
    verbose: bool = False,
) -> Path:
    """Train a SentencePiece model and save it as `path` (+ a `.vocab` file).

    Special ids, the same in every vocabulary this library trains: 0
    `<pad>`, 1 `<unk>`, 2 `<s>` (start), 3 `</s>` (end). Characters outside
    the vocabulary fall back to their UTF-8 bytes (`byte_fallback`), so
    nothing tokenizes to `<unk>`.

    Two modes:

    - `lossless=False` (sentences: translation, classification): NFKC
      normalisation (`nmt_nfkc`, or `nmt_nfkc_cf` with `lowercase=True`),
      leading, trailing and repeated spaces removed. Detokenizing gives the
      normalised sentence back, spaces and punctuation in place.
    - `lossless=True` (running text: language modelling): no normalisation,
      every space kept, `\\n` a piece of its own; `detokenize(tokenize(t))
      == t` for every string `t`. Texts are fed to the trainer line by line
      (with their `\\n`), and since no piece crosses a `\\n`, tokenizing a text
      line by line gives the same ids as tokenizing it whole.

    Args:
        texts: training texts (use the training split only).
        path: where to write the model, e.g. `"vocab/de.model"`; the pieces
            and their scores are also written, as text, next to it with the
            suffix `.vocab`. Parent directories are created.
        vocabulary_size: number of pieces, special and byte pieces included;
            a soft limit (a small corpus may give fewer).
        lossless: see above.
        lowercase: lowercase while normalising (not with `lossless`).
        model_type: `"unigram"` (default) or `"bpe"`.
        character_coverage: share of characters given pieces of their own;
            the rest fall back to bytes.
        max_sentences: train on a random sample of this many lines (0: all).
        num_threads: trainer threads, default `os.cpu_count()`.
        verbose: show the trainer's log.

    Returns:
        The path of the model file.

    Raises:
        ValueError: no non-empty training text, or bad arguments.
    """
    try:  # the trainer only; not needed at serving time
        import sentencepiece as spm
    except ImportError as error:
        raise missing_extra_error(
            "train_subword_vocabulary", "text", "sentencepiece", error
        ) from error

    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"`model_type` must be one of {MODEL_TYPES}. Received: {model_type=}"
        )
    if lossless and lowercase:
        raise ValueError("`lowercase=True` cannot be lossless; pass one of them.")
    if vocabulary_size < 260 + 4:
        raise ValueError(
            "`vocabulary_size` must leave room for the 256 byte pieces and the 4 "
            f"special tokens (at least 264). Received: {vocabulary_size=}"
        )
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    sentences = _training_lines(texts, lossless)
    first = next(sentences, None)
    if first is None:
        raise ValueError("No training text: `texts` is empty or only whitespace.")
    options = dict(
        model_prefix=str(path.with_suffix("")),
        vocab_size=vocabulary_size,
        model_type=model_type,
        character_coverage=character_coverage,
        byte_fallback=True,
        hard_vocab_limit=False,
        pad_id=PAD_ID,
        unk_id=UNK_ID,
        bos_id=START_ID,
        eos_id=END_ID,
        pad_piece=PAD_TOKEN,
        unk_piece=UNK_TOKEN,
        bos_piece=START_TOKEN,
        eos_piece=END_TOKEN,
        max_sentence_length=1 << 16,
        input_sentence_size=max_sentences,
        shuffle_input_sentence=bool(max_sentences),
        num_threads=num_threads or os.cpu_count() or 1,
        minloglevel=0 if verbose else 2,
    )
    if lossless:
        options.update(
            normalization_rule_name="identity",
            add_dummy_prefix=False,
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            user_defined_symbols=["\n"],
        )
    else:
        options.update(
            normalization_rule_name="nmt_nfkc_cf" if lowercase else "nmt_nfkc"
        )
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_chain(first, sentences), **options
        )
    except RuntimeError as error:
        raise ValueError(
            f"SentencePiece could not train a {vocabulary_size}-piece vocabulary "
            f"on these texts: {error}"
        ) from error
    model_path = path.with_suffix("").with_suffix(".model")
    if model_path != path:
        os.replace(model_path, path)
    return path


def _training_lines(texts: Iterable[str], lossless: bool) -> Iterator[str]:
    if isinstance(texts, str):
        texts = [texts]
    for text in texts:
        if not isinstance(text, str):
            raise TypeError(
                f"`texts` must hold strings. Received an item of type {type(text)}."
            )
        if lossless:
            # Each line with its "\n", so that the trainer sees the newlines.
            yield from (line for line in re.split(r"(?<=\n)", text) if line)
        else:
            for line in text.splitlines():
                if line.strip():
                    yield line


def _chain(first: str, rest: Iterator[str]) -> Iterator[str]:
    yield first
    yield from rest
