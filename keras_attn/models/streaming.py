"""Text streamed as it is decoded: what `TransformerLanguageModel.stream` and
`Translator.stream_translate` share.

The decoding is the task's own (`keras_attn.generation`'s samplers over the
KV cache), cut into chunks: a compiled `start` (the prompt prefilled and the
first new token decoded) and a compiled `advance` (the loop run on until an
index), each compiled once per shape and kept on the task
(`GenerativeTask.make_generate_function`), called from Python with the
decoding's state (a dict of tensors, the cache among them) passed from one
call to the next. The tokens decided so far are detokenized as they come;
`TextPieces` holds back what is not yet final text (an incomplete UTF-8
sequence of byte pieces), so the pieces join to the text the whole decoding
gives.

Imports no TensorFlow.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable, Iterator

import numpy as np

from keras_attn.models import _task

PAD_ID, END_ID = _task.PAD_ID, _task.END_ID
REPLACEMENT = "\ufffd"


class TextPieces:
    """The new text of a growing token sequence, piece by piece.

    `extend(token_ids)` appends tokens and returns the text each completes
    (a list, one `str` per token, maybe empty); `close()` the rest. The
    pieces join to the text of all the ids. Text is final once
    detokenizing more tokens cannot change it: the bytes of a character
    split over byte pieces (SentencePiece's byte fallback: `<0xC3>` then
    `<0xA9>` for `é`) come out of the detokenizer as U+FFFD, one per byte,
    until the character's last byte has come; those are held back, and
    given once a later token completes the character or shows the sequence
    invalid (U+FFFD for good, as in the whole text).

    Args:
        detokenize: a list of token id lists -> their texts (a list of
            `str`): one call for the prefixes of a chunk.
        byte_pieces: `{token id: byte}` of the vocabulary's byte pieces
            (`byte_pieces(tokenizer)`). Without it, every trailing U+FFFD is
            held back until a later character follows it.
        dropped_ids: the ids the detokenizer leaves out of the text, so that
            the byte pieces on either side of one join into one character
            (SentencePiece's control pieces `<s>`, `</s>`, `<pad>`:
            `dropped_ids(detokenize, byte_pieces)`).
    """

    def __init__(
        self,
        detokenize: Callable[[list[list[int]]], list[str]],
        byte_pieces: dict[int, int] | None = None,
        dropped_ids: frozenset[int] = frozenset(),
    ):
        self.detokenize = detokenize
        self.byte_pieces = byte_pieces
        self.dropped_ids = dropped_ids
        self.ids: list[int] = []
        self.sent = ""

    def _incomplete(self, ids) -> int | None:
        """How many bytes at the end of `ids` begin a character still to
        come (None: not known)."""
        if self.byte_pieces is None:
            return None
        tail = []  # the last three byte pieces, the dropped ids skipped
        for token_id in reversed(ids):
            if token_id in self.dropped_ids:
                continue
            if token_id not in self.byte_pieces or len(tail) == 3:
                break
            tail.append(self.byte_pieces[token_id])
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        decoder.decode(bytes(reversed(tail)), final=False)
        return len(decoder.getstate()[0])

    def extend(self, token_ids) -> list[str]:
        token_ids = [int(token_id) for token_id in token_ids]
        if not token_ids:
            return []
        start = len(self.ids)
        self.ids.extend(token_ids)
        prefixes = [self.ids[: start + n] for n in range(1, len(token_ids) + 1)]
        return [
            self._piece(ids, text)
            for ids, text in zip(prefixes, self.detokenize(prefixes), strict=True)
        ]

    def add(self, token_id: int) -> str:
        return self.extend([token_id])[0]

    def _piece(self, ids, text) -> str:
        incomplete = self._incomplete(ids)
        held = len(text) - incomplete if incomplete is not None else len(text)
        if incomplete is not None and text[held:] == REPLACEMENT * incomplete:
            stable = text[:held]
        else:
            stable = text.rstrip(REPLACEMENT)
        if len(stable) <= len(self.sent) or not stable.startswith(self.sent):
            return ""
        piece, self.sent = stable[len(self.sent) :], stable
        return piece

    def close(self) -> str:
        text = self.detokenize([self.ids])[0] if self.ids else ""
        if not text.startswith(self.sent):  # pragma: no cover - a tokenizer bug
            raise RuntimeError(
                "The tokenizer's text of a token sequence does not begin with the "
                f"text of its beginning: {self.sent!r} then {text!r}"
            )
        rest, self.sent = text[len(self.sent) :], text
        return rest


def compiled_detokenizer(tokenizer):
    """`fn(rows)`: lists of token ids -> their texts, a list of `str`, as
    `keras_attn.text.preprocessors.detokenized_texts` gives them: the
    tokenizer's `detokenize` traced once in a `tf.function` (an eager call
    dispatches a dozen ragged ops: 10 ms where this takes 1)."""
    import tensorflow as tf

    from keras_attn.text.preprocessors import decoded

    detokenize = tf.function(
        tokenizer.detokenize,
        input_signature=[tf.TensorSpec([None, None], tf.int32)],
        autograph=False,
    )

    def fn(rows):
        ids = np.full((len(rows), max(map(len, rows))), PAD_ID, "int32")
        for row, found in zip(ids, rows, strict=True):
            row[: len(found)] = found
        return decoded(detokenize(ids).numpy())

    return fn


BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_pieces(tokenizer) -> dict[int, int] | None:
    """`{token id: byte}` of a tokenizer's byte pieces (`<0xC3>`, ...), or
    None when it has no `get_vocabulary`."""
    get_vocabulary = getattr(tokenizer, "get_vocabulary", None)
    if get_vocabulary is None:
        return None
    found = {}
    for token_id, piece in enumerate(get_vocabulary()):
        match = BYTE_PIECE.fullmatch(piece)
        if match:
            found[token_id] = int(match.group(1), 16)
    return found


def dropped_ids(detokenize, byte_pieces, vocabulary_size: int) -> frozenset[int]:
    """The ids `detokenize` leaves out of the text: those between the byte
    pieces of `é` (`<0xC3>`, `<0xA9>`) that still give `é`. Empty without
    those byte pieces (no character is then split over tokens)."""
    ids = {byte: token_id for token_id, byte in (byte_pieces or {}).items()}
    if 0xC3 not in ids or 0xA9 not in ids:
        return frozenset()
    rows = [[ids[0xC3], token_id, ids[0xA9]] for token_id in range(vocabulary_size)]
    texts = detokenize(rows)
    return frozenset(i for i, text in enumerate(texts) if text == "\u00e9")


def decode_chunk(sampler, next_fn, state, until):
    """One chunk of a streamed decoding: `sampler.decode` of `state` until
    its index reaches `until` (stopping at END_ID), returned as
    `(state, tokens, index, running)`, what `stream_pieces`' compiled
    `start` and `advance` give it."""
    stop_ids = (END_ID,)
    state = sampler.decode(
        next_fn, state, stop_ids=stop_ids, pad_token_id=PAD_ID, until=until
    )
    return (
        state,
        sampler.decided_tokens(state, stop_ids=stop_ids),
        state["index"],
        sampler.running(state, stop_ids=stop_ids),
    )


def stream_pieces(
    start: Callable,
    advance: Callable,
    first: int,
    last: int,
    chunk_size: int,
    detokenize: Callable[[list[list[int]]], list[str]],
    byte_pieces: dict[int, int] | None = None,
    dropped: frozenset[int] = frozenset(),
) -> Iterator[str]:
    """The text pieces of a chunked decoding, as they are decoded.

    Args:
        start: `start(until)` -> `(state, tokens, index, running)`: the
            decoding begun and run until its index reaches `until` (an
            int32 NumPy scalar).
        advance: `advance(state, until)` -> the same, from `state`.
        first: the position of the first new token (its index is
            `first - 1`).
        last: the last position a new token may take.
        chunk_size: steps per `advance` call (the first call decodes one
            token, for a first piece as early as can be).
        detokenize: lists of new token ids -> their texts (`TextPieces`).
        byte_pieces: the tokenizer's byte pieces (`TextPieces`).
        dropped: the ids the detokenizer leaves out (`TextPieces`).

    `tokens` `(1, L)` holds the decided tokens, final up to `index` while
    `running`, and all of them once not; new tokens end at the end token.
    """
    pieces = TextPieces(detokenize, byte_pieces, dropped)
    position = first
    found = start(np.int32(min(first, last)))
    while True:
        state, tokens, index, running = found
        tokens = np.asarray(_numpy(tokens)).reshape(-1)
        index, running = int(_numpy(index)), bool(_numpy(running))
        decided = min(index if running else len(tokens) - 1, last)
        new = []
        ended = False
        while position <= decided and not ended:
            token = int(tokens[position])
            ended = token in (END_ID, PAD_ID)
            if not ended:
                new.append(token)
                position += 1
        for piece in pieces.extend(new):
            if piece:
                yield piece
        if ended or not running or position > last:
            break
        found = advance(state, np.int32(min(index + chunk_size, last)))
    rest = pieces.close()
    if rest:
        yield rest


def _numpy(x):
    import keras

    return keras.ops.convert_to_numpy(x)


def text_of(model, tokenizer):
    """`(detokenize, byte_pieces, dropped)` of `tokenizer` for
    `stream_pieces`, built once and kept on `model` (rebuilt when the
    tokenizer is another)."""

    def build():
        detokenize = compiled_detokenizer(tokenizer)
        table = byte_pieces(tokenizer)
        size = tokenizer.vocabulary_size
        return detokenize, table, dropped_ids(detokenize, table, size)

    return _task.cached(model, "stream_text", [tokenizer], build)


def check_chunk_size(chunk_size) -> int:
    from keras_attn import _validation as v

    return v.check_positive_int("chunk_size", chunk_size)


def check_one_text(name: str, text) -> str:
    """`text`, one string; a list (a batch) or anything else is refused."""
    if not isinstance(text, str):
        kind = (
            f"a {type(text).__name__} of {len(text)} items"
            if isinstance(text, (list, tuple))
            else f"of type {type(text).__name__}"
        )
        raise ValueError(
            f"`{name}` must be one string: streaming continues one text at a "
            "time (for a batch, call the method once per text, or use the "
            f"batched method). Received: {name} {kind}"
        )
    return text
