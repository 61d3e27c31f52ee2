"""`Translator`: what the RNN and Transformer translators share as tasks.

A translator network defines the decoding contract (`encode`,
`call_with_cache`) and `attention_maps`; this base class turns them into
beam search over token ids (`translate_ids`), translation of raw strings
with its tokenizers (`translate`), scoring against references
(`evaluate_translations`) and the TF Serving export (`export`). TensorFlow
(for the tokenizers) and sacrebleu are imported only by the methods that
need them.
"""

from __future__ import annotations

import time

import keras
import numpy as np
from keras import ops

from keras_attn import _validation as v
from keras_attn import generation
from keras_attn._extras import missing_extra_error
from keras_attn.models import _task
from keras_attn.models._saving import ExplicitSignatures
from keras_attn.models.generative_task import GenerativeTask
from keras_attn.models.quantization import deserialize_dtype

PAD_ID, START_ID, END_ID = _task.PAD_ID, _task.START_ID, _task.END_ID


class Translator(GenerativeTask, ExplicitSignatures, keras.Model):
    """Base class of `RNNTranslator` and `TransformerTranslator`.

    Subclasses build their functional graph (inputs `{"encoder_inputs":
    (B, S), "decoder_inputs": (B, T)}` int ids, 0 = padding; output float32
    logits `(B, T, target_vocabulary_size)`) and define:

    - `encode(encoder_inputs, max_length) -> cache`: the decoding cache of a
      batch of sources (a dict of tensors with batch on axis 0);
    - `call_with_cache(token_ids, cache, index, nearest_neighbors=None) ->
      (logits, cache)`: decoder tokens `(B, T)` at positions
      `index .. index + T - 1`: the `keras_attn.generation` contract;
    - `attention_maps(encoder_inputs, decoder_inputs)`: a dict holding
      `"alignment"`, `(B, T, S)` float32 weights of every target position
      over the source, teacher-forced.

    Attributes:
        source_tokenizer, target_tokenizer: the tokenizers of `translate`
            and `export` (None for a network used on token ids only).
    """

    text_methods = "`translate(texts)`"

    # -- decoding over token ids (any backend) ---------------------------------

    def decoding_fn(
        self,
        max_length: int = 40,
        beam_width: int = 4,
        length_penalty: float = 1.0,
        nearest_neighbors=None,
        assistant_model=None,
        num_speculative_tokens: int = 4,
    ):
        """`fn(encoder_inputs (B, S)) -> (tokens (B, max_length), scores (B,))`:
        beam search (GNMT length penalty; `beam_width=1` is greedy search).

        Tokens exclude the start token; they end with the end token (id 3)
        then padding (id 0), never decoded before it. `nearest_neighbors` (a
        `keras_attn.memory.NearestNeighborDecoding`) mixes its neighbours into
        every step (kNN-MT). Wrap the function in `tf.function` or `jax.jit`
        to compile it once.

        `assistant_model` (a smaller `TransformerTranslator` on the same
        vocabularies) decodes speculatively: the draft encodes the source
        itself and proposes `num_speculative_tokens` tokens with its own KV
        cache, this model checks them in one pass
        (`keras_attn.generation.speculative_greedy_search`), each row
        advancing by the tokens it accepts. It is greedy search, so it takes
        `beam_width=1, length_penalty=0.0`, and gives greedy search's tokens;
        the scores are this model's log-probability of them, from one
        teacher-forced pass. None (default) is the translator's own
        `assistant_model` when the options are greedy search's; False: none.
        """
        max_length = v.check_positive_int("max_length", max_length)
        assistant_model = self._assistant(
            assistant_model, beam_width, length_penalty, nearest_neighbors
        )
        if assistant_model is not None:
            self.check_assistant(
                assistant_model, max_length, beam_width, length_penalty,
                nearest_neighbors, num_speculative_tokens,
            )  # fmt: skip
            tokens_fn = self._speculative_tokens_fn(
                max_length, assistant_model, num_speculative_tokens
            )

            def decode_speculatively(encoder_inputs):
                encoder_inputs = ops.convert_to_tensor(encoder_inputs, "int32")
                tokens = tokens_fn(encoder_inputs)
                return tokens, self._greedy_scores(encoder_inputs, tokens)

            return decode_speculatively
        next_fn = self._next_fn(nearest_neighbors)

        def decode(encoder_inputs):
            encoder_inputs = ops.convert_to_tensor(encoder_inputs, "int32")
            cache = self.encode(encoder_inputs, max_length + 1)
            batch = ops.shape(encoder_inputs)[0]
            start = ops.full((batch, 1), START_ID, dtype="int32")
            tokens, scores = generation.beam_search(
                next_fn,
                start,
                cache,
                max_length + 1,
                beam_width=beam_width,
                length_penalty=length_penalty,
                end_token_id=END_ID,
                pad_token_id=PAD_ID,
            )
            return tokens[:, 1:], scores

        return decode

    def _check_own_assistant(self, assistant_model) -> None:
        """A smaller `TransformerTranslator` on the same vocabularies
        (`check_assistant`; each call checks its own `max_length`);
        `stream_translate` decodes without it."""
        self.check_assistant(assistant_model, 1)

    def _assistant(
        self, assistant_model, beam_width, length_penalty, nearest_neighbors
    ):
        """The assistant a decoding with these options uses:
        `assistant_model`; for None the translator's own when the decoding
        is greedy search without kNN-MT, else none (None); none for
        False."""
        if assistant_model is False:
            return None
        if assistant_model is not None:
            return assistant_model
        if beam_width != 1 or length_penalty != 0 or nearest_neighbors is not None:
            return None
        return self.assistant_model

    def check_assistant(
        self,
        assistant_model,
        max_length,
        beam_width=1,
        length_penalty=0.0,
        nearest_neighbors=None,
        num_speculative_tokens=4,
    ) -> None:
        """Raises unless this translator can decode with `assistant_model`:
        both `TransformerTranslator`s (their KV caches place each row at its
        own position), on the same vocabularies, the draft's positions
        holding `max_length` target tokens, with greedy search and no
        kNN-MT."""
        if not self.per_row_cache:
            raise ValueError(
                "Speculative translation (`assistant_model`) needs a "
                "TransformerTranslator, whose KV cache places each row at its "
                f"own position. Received: a {type(self).__name__}"
            )
        if not (
            isinstance(assistant_model, Translator) and assistant_model.per_row_cache
        ):
            raise ValueError(
                "`assistant_model` must be a TransformerTranslator. Received: "
                f"assistant_model={assistant_model!r}"
            )
        for name in ("source_vocabulary_size", "target_vocabulary_size"):
            if getattr(assistant_model, name) != getattr(self, name):
                raise ValueError(
                    "`assistant_model` must share the translator's vocabularies. "
                    f"Received: an assistant of {name}="
                    f"{getattr(assistant_model, name)} for a translator of "
                    f"{name}={getattr(self, name)}"
                )
        limit = assistant_model.max_length_limit()
        if limit is not None and max_length > limit:
            raise ValueError(
                f"`assistant_model` must hold {max_length} target tokens. "
                f"Received: an assistant of max_length_limit()={limit}"
            )
        if beam_width != 1 or length_penalty != 0:
            raise ValueError(
                "Speculative translation (`assistant_model`) is greedy search: "
                "pass beam_width=1, length_penalty=0.0. Received: "
                f"beam_width={beam_width}, length_penalty={length_penalty}"
            )
        if nearest_neighbors is not None:
            raise ValueError(
                "`assistant_model` and `nearest_neighbors` do not combine. "
                f"Received: nearest_neighbors={nearest_neighbors!r}"
            )
        v.check_positive_int("num_speculative_tokens", num_speculative_tokens)

    def _speculative_tokens_fn(self, max_length, assistant_model, k):
        """`fn(encoder_inputs (B, S)) -> tokens (B, max_length)`: greedy
        search with `assistant_model`'s guesses, `k` per pass of this model."""
        next_fn = self._next_fn()
        draft_next_fn = _task.WithoutPadding(assistant_model.call_with_cache)

        def decode(encoder_inputs):
            encoder_inputs = ops.convert_to_tensor(encoder_inputs, "int32")
            batch = ops.shape(encoder_inputs)[0]
            proposer = generation.DraftModelProposer(
                draft_next_fn, assistant_model.encode(encoder_inputs, max_length + 1)
            )
            tokens = generation.speculative_greedy_search(
                next_fn,
                proposer,
                ops.full((batch, 1), START_ID, dtype="int32"),
                self.encode(encoder_inputs, max_length + 1),
                max_length + 1,
                num_speculative_tokens=k,
                end_token_id=END_ID,
                pad_token_id=PAD_ID,
            )
            return tokens[:, 1:]

        return decode

    def _greedy_scores(self, encoder_inputs, tokens):
        """`(B,)` float32: the log-probability of `tokens` (up to the end
        token, padding after it not counted) under the distribution the
        decoding draws from (`_task.WithoutPadding`: the padding id
        excluded), teacher-forced: beam search's score of an ended row."""
        batch = ops.shape(tokens)[0]
        start = ops.full((batch, 1), START_ID, dtype="int32")
        decoder_inputs = ops.concatenate([start, tokens[:, :-1]], axis=1)
        logits = self(
            {"encoder_inputs": encoder_inputs, "decoder_inputs": decoder_inputs}
        )
        padding = ops.one_hot(PAD_ID, ops.shape(logits)[-1], dtype="bool")
        logits = ops.where(padding, -1e9, ops.cast(logits, "float32"))
        log_probs = ops.log_softmax(logits, axis=-1)
        picked = ops.take_along_axis(log_probs, tokens[:, :, None], axis=-1)[:, :, 0]
        return ops.sum(ops.where(ops.not_equal(tokens, PAD_ID), picked, 0.0), axis=1)

    def _next_fn(self, nearest_neighbors=None):
        if nearest_neighbors is None:
            return _task.WithoutPadding(self.call_with_cache)
        return _task.WithoutPadding(_CallWithNeighbors(self, nearest_neighbors))

    def translate_ids(
        self,
        encoder_inputs,
        max_length: int = 40,
        beam_width: int = 4,
        length_penalty: float = 1.0,
        nearest_neighbors=None,
        assistant_model=None,
        num_speculative_tokens: int = 4,
    ):
        """Beam-search translations of source token ids: `(tokens, scores)`
        as `decoding_fn` gives them (speculatively with `assistant_model`),
        computed eagerly."""
        return self.decoding_fn(
            max_length, beam_width, length_penalty, nearest_neighbors,
            assistant_model, num_speculative_tokens,
        )(encoder_inputs)  # fmt: skip

    # -- text (TensorFlow Text tokenizers) -------------------------------------

    def translate(
        self,
        texts,
        beam_width: int = 4,
        length_penalty: float = 1.0,
        max_length: int | None = None,
        nearest_neighbors=None,
        batch_size: int = _task.DEFAULT_BATCH_SIZE,
        verbose="auto",
        title: str = "Translating",
        assistant_model=None,
        num_speculative_tokens: int = 4,
    ) -> list[str]:
        """Translate raw strings with beam search.

        Any number of texts, in batches of `batch_size` (memory stays flat),
        sources of similar length batched together and each batch padded to
        a bucket of its longest source (`keras_attn.models._task.
        bucket_length`: one compiled decoding per bucket). The translations
        do not depend on the batching.

        Args:
            texts: a string or a list of strings.
            beam_width: beams (1: greedy search).
            length_penalty: GNMT `alpha`: hypotheses are ranked by
                `log P / ((5 + length) / 6) ** alpha`.
            max_length: source tokens kept, and target tokens at most
                (default 40, at most what the model's positions allow:
                `max_length_limit()`).
            nearest_neighbors: a `keras_attn.memory.NearestNeighborDecoding`
                (kNN-MT; Transformer only).
            batch_size: sources decoded at once.
            verbose: `"auto"` (a progress bar when there is more than one
                batch), 0, 1 (a bar) or 2 (one line at the end), under
                `title`, as in `keras.Model.predict`.
            assistant_model: a smaller `TransformerTranslator` on the same
                vocabularies: speculative greedy search, the same
                translations as `beam_width=1, length_penalty=0.0` (which
                it takes) in fewer passes of this model (`decoding_fn`).
                None (default): the translator's own `assistant_model` when
                the options are greedy search's; False: none.
            num_speculative_tokens: the draft's guesses per pass.

        Returns:
            The translations, detokenized, one per text (valid UTF-8: what
            is not is replaced by U+FFFD).
        """
        texts = _task.text_list("texts", texts)
        source = _task.require_tokenizer(self, "source_tokenizer", "translate")
        target = _task.require_tokenizer(self, "target_tokenizer", "translate")
        max_length = self.translation_length(max_length)
        source_cap = min(max_length, self._source_positions() or max_length)
        assistant_model = self._assistant(
            assistant_model, beam_width, length_penalty, nearest_neighbors
        )
        if assistant_model is not None:
            self.check_assistant(
                assistant_model, max_length, beam_width, length_penalty,
                nearest_neighbors, num_speculative_tokens,
            )  # fmt: skip
        from keras_attn.text.preprocessors import detokenized_texts

        def translate_batch(batch):
            ids = _task.padded_ids(source.tokenize(batch), source_cap)
            if assistant_model is not None:
                decode = self._compiled_speculative_decoding(
                    max_length, assistant_model, num_speculative_tokens, ids.shape[1]
                )
                tokens = self.run_generate_function(decode, ids)
            else:
                decode = self._compiled_decoding(
                    max_length, beam_width, length_penalty, nearest_neighbors,
                    ids.shape[1],
                )  # fmt: skip
                tokens, _ = self.run_generate_function(decode, ids)
            return detokenized_texts(target, tokens)

        return self.generate_texts(translate_batch, texts, batch_size, verbose, title)

    def stream_translate(
        self,
        text: str,
        max_length: int | None = None,
        beam_width: int = 1,
        length_penalty: float = 0.0,
        nearest_neighbors=None,
        chunk_size: int = 8,
    ):
        """Translate one raw string with greedy search, the translation
        yielded as it is decoded: a generator of `str` pieces whose join is
        `translate(text, beam_width=1, length_penalty=0.0, ...)`'s.

        The decoding is `translate`'s (the same source ids, cache and
        search), cut into chunks: a compiled call encodes the source and
        decodes the first token, then each compiled call decodes
        `chunk_size` more; both are compiled once per source width and
        reused. Each piece is whole characters (see
        `TransformerLanguageModel.stream`).

        Only greedy search streams: a wider beam, or a length penalty with
        one beam, may prefer another hypothesis until the search ends, so
        `beam_width` must be 1 and `length_penalty` 0 (they are arguments so
        that `translate`'s options can be passed as they are). One text at a
        time (a list is refused).

        Args:
            text: one string.
            max_length, nearest_neighbors: as in `translate`.
            beam_width: 1.
            length_penalty: 0.
            chunk_size: target tokens decoded per compiled call after the
                first.
        """
        from keras_attn.models import streaming

        text = streaming.check_one_text("text", text)
        chunk_size = streaming.check_chunk_size(chunk_size)
        if beam_width != 1 or length_penalty != 0:
            raise ValueError(
                "`stream_translate` streams greedy search only (beam_width=1, "
                "length_penalty=0): a wider beam or a length penalty chooses its "
                "translation when the search ends (use `translate`). Received: "
                f"beam_width={beam_width!r}, length_penalty={length_penalty!r}"
            )
        source = _task.require_tokenizer(self, "source_tokenizer", "stream_translate")
        target = _task.require_tokenizer(self, "target_tokenizer", "stream_translate")
        max_length = self.translation_length(max_length)
        source_cap = min(max_length, self._source_positions() or max_length)
        # The source as `translate` decodes a batch of this one text.
        ids = _task.padded_ids(source.tokenize([text]), source_cap)
        start, advance = self._compiled_stream_decoding(
            max_length, nearest_neighbors, ids.shape[1]
        )

        detokenizing = streaming.text_of(self, target)
        return streaming.stream_pieces(
            lambda until: start(ids, until),
            advance,
            1,  # after the start token
            max_length,
            chunk_size,
            *detokenizing,
        )

    def _compiled_stream_decoding(self, max_length, knn, source_width):
        """`(start, advance)`: `decoding_fn`'s greedy search (a
        `BeamSampler` of width 1, no length penalty) of one source
        `(1, source_width)` in chunks, each compiled once per setting:
        `start(encoder_inputs, until)` encodes and decodes until the index
        reaches `until`, `advance(state, until)` goes on; both return
        `(state, tokens, index, running)`
        (`keras_attn.models.streaming.stream_pieces`)."""
        sampler = generation.BeamSampler(beam_width=1, length_penalty=0.0)
        next_fn = self._next_fn(knn)  # a kNN-MT datastore's weights made here

        from keras_attn.models import streaming

        def chunk(state, until):
            return streaming.decode_chunk(sampler, next_fn, state, until)

        def build_start():
            def start(encoder_inputs, until):
                encoder_inputs = ops.convert_to_tensor(encoder_inputs, "int32")
                cache = self.encode(encoder_inputs, max_length + 1)
                batch = ops.shape(encoder_inputs)[0]
                start_tokens = ops.full((batch, 1), START_ID, dtype="int32")
                state = sampler.start(
                    next_fn, start_tokens, cache, max_length + 1, pad_token_id=PAD_ID
                )
                return chunk(state, until)

            return start

        key = ("stream_decoding", max_length, id(knn), source_width)
        start = self.make_generate_function(
            (*key, "start"),
            build_start,
            depends=(knn,),
            signature=[([1, source_width], "int32"), ([], "int32")],
        )
        advance = self.make_generate_function(
            (*key, "advance"), lambda: chunk, depends=(knn,)
        )
        return start, advance

    def max_length_limit(self) -> int | None:
        """The most target tokens the model's positions allow
        (`sequence_length - 1`: the start token comes first), or None where
        it has no position table (the RNN)."""
        positions = getattr(self, "sequence_length", None)
        return None if positions is None else positions - 1

    def _source_positions(self) -> int | None:
        return getattr(self, "source_sequence_length", None) or getattr(
            self, "sequence_length", None
        )

    def translation_length(self, max_length):
        """`max_length`, checked; None: 40, at most `max_length_limit()`."""
        limit = self.max_length_limit()
        if max_length is None:
            return max(1, min(40, limit)) if limit else 40
        max_length = v.check_positive_int("max_length", max_length)
        if limit is not None and max_length > limit:
            raise ValueError(
                f"`max_length` must be at most {limit} (the model's sequence_length "
                f"{limit + 1} holds the start token and {limit} more). Received: "
                f"max_length={max_length}"
            )
        return max_length

    def source_ids(self, texts, max_length: int = 40, tokenizer=None):
        """Source ids `(B, max_length)` of strings (a list or a `tf.string`
        tensor `[B]`): tokenized (with `tokenizer`, default the model's
        `source_tokenizer`), truncated, padded with 0. A fixed width keeps one
        compiled shape and gives even an all-empty batch a (fully masked)
        source to attend to. TensorFlow, eagerly or in a `tf.function` (the
        export's signatures read their sources so)."""
        if tokenizer is None:
            tokenizer = _task.require_tokenizer(self, "source_tokenizer", "translate")
        ids = tokenizer.tokenize(texts)[:, :max_length]  # ragged (B, <= max_length)
        return ids.to_tensor(default_value=PAD_ID, shape=[None, max_length])

    def _compiled_decoding(
        self, max_length, beam_width, length_penalty, knn, source_width=None
    ):
        """`decoding_fn` compiled once per setting and source width
        (`make_generate_function`). `source_width` defaults to `max_length`."""
        source_width = source_width or max_length
        return self.make_generate_function(
            (
                "decoding",
                max_length,
                beam_width,
                float(length_penalty),
                id(knn),
                source_width,
            ),
            # Without an assistant (False: not the translator's own either);
            # speculative decoding is `_compiled_speculative_decoding`.
            lambda: self.decoding_fn(
                max_length, beam_width, length_penalty, knn, assistant_model=False
            ),
            depends=(knn,),
            # One trace for every batch of this width, of any size.
            signature=[([None, source_width], "int32")],
        )

    def _compiled_speculative_decoding(self, max_length, assistant_model, k, width):
        """`_speculative_tokens_fn` compiled once per setting and source
        width (the draft's weights read at each call too)."""
        return self.make_generate_function(
            ("speculative", max_length, id(assistant_model), k, width),
            lambda: self._speculative_tokens_fn(max_length, assistant_model, k),
            depends=(assistant_model,),
            signature=[([None, width], "int32")],
            others=(assistant_model,),
        )

    def evaluate_translations(
        self,
        pairs,
        beam_width: int = 4,
        length_penalty: float = 1.0,
        max_length: int | None = None,
        nearest_neighbors=None,
        batch_size: int = _task.DEFAULT_BATCH_SIZE,
        verbose=0,
        title: str = "Translating",
    ) -> dict:
        """Translate the sources of `(source, reference)` pairs and score the
        translations with sacrebleu (BLEU and chrF on detokenized text). The
        arguments are `translate`'s.

        Returns:
            A dict: `sources`, `references`, `hypotheses` (lists of strings),
            `bleu` and `chrf` (sacrebleu's score objects: `.score`),
            `bleu_signature`, `chrf_signature`, `decode_ms_per_sentence`.
        """
        try:
            import sacrebleu
        except ImportError as error:
            raise missing_extra_error(
                "evaluate_translations", "examples", "sacrebleu", error
            ) from error
        pairs = list(pairs)
        if not pairs:
            raise ValueError("`pairs` must hold at least one pair. Received: none")
        sources = [source for source, _ in pairs]
        references = [reference for _, reference in pairs]
        started = time.monotonic()
        hypotheses = self.translate(
            sources,
            beam_width=beam_width,
            length_penalty=length_penalty,
            max_length=max_length,
            nearest_neighbors=nearest_neighbors,
            batch_size=batch_size,
            verbose=verbose,
            title=title,
        )
        seconds = time.monotonic() - started
        bleu, chrf = sacrebleu.BLEU(), sacrebleu.CHRF()
        return {
            "sources": sources,
            "references": references,
            "hypotheses": hypotheses,
            "bleu": bleu.corpus_score(hypotheses, [references]),
            "chrf": chrf.corpus_score(hypotheses, [references]),
            "bleu_signature": str(bleu.get_signature()),
            "chrf_signature": str(chrf.get_signature()),
            "decode_ms_per_sentence": 1000 * seconds / len(sources),
        }

    def alignment(self, source: str, translation: str, max_length: int = 40):
        """`(weights (T + 1, S), source_pieces, target_pieces)` of one
        translation: the alignment (`attention_maps`) of its target pieces
        and the end token over the source pieces, for a heatmap
        (`keras_attn.visualize.plot_attention(weights, source_pieces,
        target_pieces)`)."""
        source_tokenizer = _task.require_tokenizer(
            self, "source_tokenizer", "alignment"
        )
        target_tokenizer = _task.require_tokenizer(
            self, "target_tokenizer", "alignment"
        )
        source_ids = np.asarray(source_tokenizer.tokenize([source]).to_tensor())
        source_ids = source_ids[:, :max_length]
        target_ids = np.asarray(target_tokenizer.tokenize([translation]).to_tensor())
        target_ids = target_ids[:, :max_length]
        decoder_inputs = np.concatenate([[[START_ID]], target_ids], axis=1)
        weights = self.attention_maps(source_ids, decoder_inputs)["alignment"]
        source_pieces = [source_tokenizer.id_to_token(int(t)) for t in source_ids[0]]
        target_pieces = [target_tokenizer.id_to_token(int(t)) for t in target_ids[0]]
        return (
            np.asarray(ops.convert_to_numpy(weights))[0],
            source_pieces,
            [
                *target_pieces,
                "</s>",
            ],
        )

    # -- TF Serving ------------------------------------------------------------

    # `model_kind` in the export's metadata: each subclass names its kind.
    model_kind: str | None = None
    # Whether `call_with_cache` takes a `(B,)` index, each row at its own
    # position (speculative decoding).
    per_row_cache: bool = False

    def alignment_description(self) -> str:
        """What the export's `alignment` output is (each subclass says)."""
        return "the alignment of `attention_maps`, teacher-forced"

    def serving_spec(
        self,
        max_length: int | None = None,
        beam_width: int = 4,
        length_penalty: float = 1.0,
        nearest_neighbors=None,
        assistant_model=None,
        num_speculative_tokens: int = 4,
    ):
        """What the TF Serving export serves: a `keras_attn.export.ServingSpec`
        (which `keras_attn.export.export_task` writes) of `serving_default`
        (`text` -> `translation`) and `translate_with_alignment`, with
        `export`'s options (see `keras_attn.export.export_translator`;
        built by `keras_attn.export.translator.translator_serving_spec`). The
        metadata's `model_kind` and `alignment` are the class's
        (`model_kind`, `alignment_description()`).
        """
        from keras_attn.export.translator import translator_serving_spec

        return translator_serving_spec(
            self, max_length, beam_width, length_penalty, nearest_neighbors,
            assistant_model, num_speculative_tokens,
        )  # fmt: skip

    def export(
        self,
        base_dir,
        model_name: str = "translator",
        version: int | None = None,
        max_length: int | None = None,
        beam_width: int = 4,
        length_penalty: float = 1.0,
        nearest_neighbors=None,
        precision: str | None = None,
        assistant_model=None,
        num_speculative_tokens: int = 4,
    ):
        """Export for TF Serving, strings in and translations out:
        `keras_attn.export.export_translator(self, ...)` (see there), which is
        `export_task` of `serving_spec`. Returns the version directory
        `<base_dir>/<model_name>/<version>/`.

        This replaces `keras.Model.export`; `keras.Model.export(model, path)`
        still writes Keras' plain SavedModel of the token-id network.
        """
        from keras_attn.export.task import export_task

        return export_task(
            self,
            base_dir,
            model_name=model_name,
            version=version,
            max_length=max_length,
            beam_width=beam_width,
            length_penalty=length_penalty,
            nearest_neighbors=nearest_neighbors,
            precision=precision,
            assistant_model=assistant_model,
            num_speculative_tokens=num_speculative_tokens,
        )

    # -- config ----------------------------------------------------------------

    def _tokenizer_config(self) -> dict:
        return {
            "source_tokenizer": _task.serialize_tokenizer(self.source_tokenizer),
            "target_tokenizer": _task.serialize_tokenizer(self.target_tokenizer),
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        for name in ("source_tokenizer", "target_tokenizer"):
            config[name] = _task.deserialize_tokenizer(config.get(name))
        return cls(**deserialize_dtype(config))


class _CallWithNeighbors:
    """`call_with_cache` with a kNN-MT decoding (a class, not a lambda or a
    nested function: AutoGraph reads a function's source when it converts
    it, and logs a warning for every trace where it cannot)."""

    def __init__(self, translator, nearest_neighbors):
        self.translator = translator
        self.nearest_neighbors = nearest_neighbors
        # The datastore's weights are made here, eagerly, not inside the
        # function a decoding loop traces.
        nearest_neighbors.weights_layer()

    def __call__(self, token_ids, cache, index):
        return self.translator.call_with_cache(
            token_ids, cache, index, nearest_neighbors=self.nearest_neighbors
        )
