"""`TransformerLanguageModel`: a decoder-only (GPT-style) next-token model."""

from __future__ import annotations

import keras
import numpy as np
from keras import ops

from keras_attn import _validation as v
from keras_attn import generation
from keras_attn.layers import kv_cache
from keras_attn.models import _task
from keras_attn.models.backbones import TransformerDecoderBackbone
from keras_attn.models.generative_task import GenerativeTask
from keras_attn.models.quantization import float32_head_policy
from keras_attn.models.scoring import stream_log_probs, windowed_log_likelihood
from keras_attn.models.task import BackboneTask

PAD_ID, START_ID, END_ID = _task.PAD_ID, _task.START_ID, _task.END_ID


def _seed_array(sampler, seed, rows: int | None = None):
    """The seed of a call's draws as a NumPy array of the hash's dtype, the
    input of a compiled decoding (so each call draws from its own seed, not
    one frozen into the trace): `seed`, else the sampler's, else a fresh one
    per call. With `rows` (a batch of that many prompts), `seed` may also be
    one int per prompt: a `(rows,)` array."""
    import random

    from keras_attn.ops import counter_random
    from keras_attn.ops._hash import hash_dtype

    seed = getattr(sampler, "seed", None) if seed is None else seed
    if seed is None:
        seed = random.SystemRandom().randrange(2**32)
    if rows is not None and not isinstance(seed, (int, np.integer)):
        if isinstance(seed, (list, tuple, np.ndarray)):
            values = np.asarray(seed)
        else:  # a tensor
            values = np.asarray(keras.ops.convert_to_numpy(seed))
        if values.ndim == 1 and values.dtype.kind in "iu":
            if len(values) != rows:
                raise ValueError(
                    "`seed` must be one int or one per prompt. Received: "
                    f"{len(values)} seeds for {rows} prompts"
                )
            return counter_random.seed_bits(values)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        expected = "an int, one int per prompt" if rows is not None else "an int"
        raise ValueError(f"`seed` must be {expected} or None. Received: seed={seed!r}")
    return np.asarray(int(seed) & 0xFFFFFFFF, hash_dtype())


def _sampler(sampler):
    """`sampler` as the decodings take it: `"greedy"` as it is, another
    sampler name or a config the sampler of `keras_attn.generation.get`
    (`"top_k"`, `{"class_name": "top_p", "config": {"p": 0.9}}`), anything
    else as it is (checked where it is used)."""
    if isinstance(sampler, str) and sampler == "greedy":
        return sampler
    if isinstance(sampler, (str, dict)) or (
        isinstance(sampler, type) and issubclass(sampler, generation.Sampler)
    ):
        return generation.get(sampler)
    return sampler


def _stop_length(prompt, prompt_lengths, max_length, max_new_tokens, sampler):
    """Where `generate_ids` stops decoding: `max_length`, or with
    `max_new_tokens` the longest prompt's end plus that many tokens (at most
    `max_length`; an int32 scalar tensor with `prompt_lengths`). Beam
    search's scores look at `max_length`: it searches to there."""
    if max_new_tokens is None or isinstance(sampler, generation.BeamSampler):
        return max_length
    v.check_positive_int("max_new_tokens", max_new_tokens)
    if prompt_lengths is None and isinstance(prompt.shape[1], int):
        return min(prompt.shape[1] + max_new_tokens, max_length)
    longest = (
        ops.shape(prompt)[1]
        if prompt_lengths is None
        else ops.max(ops.cast(prompt_lengths, "int32"), initial=0)
    )
    return ops.minimum(ops.cast(longest + max_new_tokens, "int32"), max_length)


@keras.saving.register_keras_serializable(package="keras_attn")
class TransformerLanguageModel(BackboneTask, GenerativeTask, keras.Model):
    """Decoder-only next-token model (GPT-style) of causal decoder blocks.

    Input `token_ids` `(batch, T)` (0 = padding); output float32 logits
    `(batch, T, vocabulary_size)` predicting token `t + 1` at position `t`:
    a `TransformerDecoderBackbone` and the output projection. Pre-norm blocks
    and a final layer norm by default (as GPT-2), learned positions, output
    projection tied to the token embedding.

    Build it from a backbone, as keras-hub's tasks
    (`TransformerLanguageModel(backbone=TransformerDecoderBackbone(...))`),
    or from the sizes below, which build `backbone`.

    Decoding over a KV cache: `initial_cache` and `call_with_cache` (the
    `keras_attn.generation` contract), `generate_ids`; with a `tokenizer`,
    `generate(prompts)` and `score(texts)` on raw strings and `export`.
    `call_with_states` gives the last hidden states with the logits (what a
    continuous cache remembers), `stream_log_probs` scores a dataset,
    `attention_maps` gives the weights for plots.

    Args:
        vocabulary_size: token ids are in `[0, vocabulary_size)`.
        sequence_length: the context (size of learned positions).
        embedding_dim, num_layers, num_heads, intermediate_dim, dropout:
            sizes of the blocks.
        tie_embeddings: output projection = transposed token embedding.
        normalize_first: pre-norm blocks and a final layer norm.
        position: `"learned"` or `"sinusoidal"` positions added to the
            embeddings, or `"rotary"` / `"alibi"` inside the attention (see
            `TransformerDecoderBackbone`).
        tokenizer: the tokenizer of `generate`, `score` and `export`
            (optional; a lossless `SubwordTokenizer`).
        backbone: a `TransformerDecoderBackbone` without cross-attention to
            put the output projection on (then leave the sizes out).
        num_key_value_heads: keyword-only, grouped-query attention in every
            block (`None`: `num_heads`); the KV cache holds these heads.
        sliding_window: keyword-only, each block's self-attention window.
        dtype: keyword-only, the dtype policy of the backbone built here
            (the logits stay float32); with `backbone` given, the
            backbone's policy is the task's (`dtype` may repeat it).
            Default the global policy. A quantized task's config gives a
            `DTypePolicyMap` of its quantized `logits` layer (built
            quantized from it).
        **kwargs: `keras.Model` arguments (`name`, `trainable`).
    """

    def __init__(
        self,
        vocabulary_size: int | None = None,
        sequence_length: int = 256,
        embedding_dim: int = 256,
        num_layers: int = 4,
        num_heads: int = 4,
        intermediate_dim: int = 1024,
        dropout: float = 0.1,
        tie_embeddings: bool = True,
        normalize_first: bool = True,
        position: str = "learned",
        tokenizer=None,
        *,
        backbone=None,
        num_key_value_heads: int | None = None,
        sliding_window: int | None = None,
        assistant_model=None,
        dtype=None,
        **kwargs,
    ):
        kwargs.setdefault("name", "transformer_language_model")
        sizes = {
            "vocabulary_size": vocabulary_size,
            "sequence_length": sequence_length,
            "embedding_dim": embedding_dim,
            "num_layers": num_layers,
            "num_heads": num_heads,
            "intermediate_dim": intermediate_dim,
            "dropout": dropout,
            "normalize_first": normalize_first,
            "position": position,
            "num_key_value_heads": num_key_value_heads,
            "sliding_window": sliding_window,
        }
        if backbone is not None:
            self.check_sizes_unset(TransformerLanguageModel.__init__, sizes)
            self.check_backbone("backbone", backbone, TransformerDecoderBackbone)
            if backbone.cross_attention:
                raise ValueError(
                    "A language model's backbone has no cross-attention. Received: "
                    "a TransformerDecoderBackbone with cross_attention=True"
                )
        tokenizer = v.check_tokenizer("tokenizer", tokenizer)
        dtype = self.check_dtype(dtype, [backbone])
        if backbone is None:
            backbone = TransformerDecoderBackbone(
                **sizes,
                embeddings_initializer={
                    "class_name": "RandomNormal",
                    "config": {"stddev": 0.02},
                },
                dtype=dtype,
            )
        self.backbone = backbone
        # The stack's parts and sizes, as before the backbones (set before
        # the graph: on PyTorch, untracked; the graph tracks the layers).
        self.embedding = backbone.embedding
        self.decoder_blocks = backbone.blocks
        self.final_norm = backbone.final_norm
        self.vocabulary_size = backbone.vocabulary_size
        self.sequence_length = backbone.sequence_length
        self.embedding_dim = backbone.embedding_dim
        self.num_layers = backbone.num_layers
        self.num_heads = backbone.num_heads
        self.intermediate_dim = backbone.intermediate_dim
        self.dropout = backbone.dropout
        self.normalize_first = backbone.normalize_first
        self.position = backbone.position
        self.num_key_value_heads = backbone.num_key_value_heads
        self.sliding_window = backbone.sliding_window
        token_ids = keras.Input((None,), dtype="int32", name="token_ids")
        states = backbone(token_ids)
        if tie_embeddings:
            self.logits_layer = keras.layers.Activation(
                "linear", dtype="float32", name="logits"
            )
            logits = self.logits_layer(backbone.embedding(states, reverse=True))
        else:
            self.logits_layer = keras.layers.Dense(
                backbone.vocabulary_size,
                dtype=float32_head_policy(dtype),
                name="logits",
            )
            logits = self.logits_layer(states)
        super().__init__(token_ids, logits, **kwargs)
        self._adopt_dtype_policy(backbone)
        # The same graph with the last states as a second output; kept out
        # of Keras' tracking (it holds no state of its own).
        object.__setattr__(
            self, "_states_model", keras.Model(token_ids, [states, logits])
        )
        self.tie_embeddings = tie_embeddings
        self.tokenizer = tokenizer
        self.assistant_model = assistant_model

    def _check_own_assistant(self, assistant_model) -> None:
        """A draft on the same vocabulary or `"prompt_lookup"`
        (`check_assistant`); `stream` decodes without it (with a random
        sampler, `generate(..., assistant_model=False)` draws the same
        tokens for a seed)."""
        self.check_assistant(assistant_model, "greedy", None)

    def _assistant(self, assistant_model, sampler="greedy"):
        """The assistant a decoding with `sampler` uses: `assistant_model`;
        for None the model's own, unless `sampler` is beam search (which
        takes none); none (None) for False."""
        if assistant_model is None:
            if isinstance(sampler, generation.BeamSampler):
                return None
            return self.assistant_model
        if assistant_model is False:
            return None
        return assistant_model

    @property
    def preprocessor(self):
        """Strings -> training examples, a Keras layer for `tf.data`
        (`keras_attn.text.LanguageModelPreprocessor` of `tokenizer` and
        `sequence_length`; built once per tokenizer)."""
        tokenizer = _task.require_tokenizer(self, "tokenizer", "preprocessor")

        def build():
            from keras_attn.text import LanguageModelPreprocessor

            return LanguageModelPreprocessor(tokenizer, self.sequence_length)

        return _task.cached(self, "preprocessor", [tokenizer], build)

    text_methods = "`score(texts)` or `generate(prompts)`"

    # -- the decoding contract -------------------------------------------------

    def initial_cache(self, batch_size, max_length):
        """A tuple, one `(key_cache, value_cache)` per block, each
        `(batch, max_length, heads, head_dim)` zeros."""
        return tuple(
            block.initial_cache(batch_size, max_length) for block in self.decoder_blocks
        )

    def call_with_cache(self, token_ids, cache, index):
        """Token ids `(batch, T)` at positions `index .. index + T - 1` (a
        prompt chunk or one token) -> `(logits (batch, T, vocab) float32,
        cache)`: the `keras_attn.generation` contract. `index` is an int, a
        scalar, or an int tensor `(batch,)` placing each row at its own
        position (speculative decoding)."""
        if kv_cache.is_per_row(index):
            positions = kv_cache.row_positions(index, ops.shape(token_ids)[1])
            # A speculative block may run past the context; those positions'
            # outputs are never used, but a learned table has no row there.
            positions = ops.minimum(positions, self.sequence_length - 1)
            x = self.embedding(token_ids, positions=positions)  # (B, T, d)
        else:
            x = self.embedding(token_ids, start_index=index)  # (B, T, d)
        new_cache = []
        for block, block_cache in zip(self.decoder_blocks, cache, strict=True):
            x, block_cache = block(
                x, self_attention_cache=block_cache, cache_update_index=index
            )
            new_cache.append(block_cache)
        if self.final_norm is not None:
            x = self.final_norm(x)
        if self.tie_embeddings:
            logits = self.logits_layer(self.embedding(x, reverse=True))
        else:
            logits = self.logits_layer(x)
        return logits, tuple(new_cache)

    def call_with_states(self, token_ids, training=False):
        """`(states (B, T, d), logits)`: the last hidden states (after the
        final norm of a pre-norm model: what the output projection sees, and
        what a continuous cache remembers) and the logits, one call of the
        model's own graph."""
        return self._states_model(token_ids, training=training)

    def attention_maps(self, token_ids) -> dict:
        """`{"self_attention": [(B, heads, T, T) float32 per block]}`, the
        causal self-attention weights of every block."""
        x = self.embedding(ops.convert_to_tensor(token_ids, "int32"))
        maps = []
        for block in self.decoder_blocks:
            x, scores = block(x, return_attention_scores=True)
            maps.append(ops.cast(scores["self_attention"], "float32"))
        return {"self_attention": maps}

    def generate_ids(
        self,
        prompt,
        max_length: int,
        sampler="greedy",
        prompt_lengths=None,
        end_token_id: int | None = END_ID,
        seed=None,
        assistant_model=None,
        num_speculative_tokens: int = 4,
        max_new_tokens: int | None = None,
    ):
        """Continue right-padded prompt ids `(B, T0)` to `max_length` tokens
        over the KV cache: int32 `(B, max_length)`, the prompt, the new
        tokens, then padding after the end token. The new tokens are never
        the padding id 0 (a padded position to the model's own mask, but a
        token to the cache): the samplers choose among the other ids.

        `max_new_tokens`: decoding stops once every row holds that many new
        tokens (the longest prompt's end plus `max_new_tokens`), not at
        `max_length`; a shorter row's later positions then hold whatever it
        decoded up to there (the first `max_new_tokens` of each row are what
        they would be without it). None (default): decode to `max_length`.
        Beam search always searches to `max_length`.

        `sampler`: `"greedy"` or a `keras_attn.generation` sampler instance
        (`TopKSampler(k=10, temperature=0.8)`, `TopPSampler`, `BeamSampler`,
        ...), or its name or config as keras-hub takes them (`"top_k"`,
        `{"class_name": "top_k", "config": {"k": 10}}`:
        `keras_attn.generation.get`); `seed` fixes a random sampler's draws.
        Samplers of keras-attn's classes with the same config share one
        compiled decoding, so a sampler made anew at every call costs no
        new trace; one of a class of your own is compiled per instance.

        `assistant_model`: speculative decoding, fewer forward passes of this
        model for the same result: a smaller `TransformerLanguageModel` on
        the same vocabulary (a draft) or `"prompt_lookup"` (guesses copied
        from n-gram matches in the row's own tokens), checked
        `num_speculative_tokens` at a time
        (`keras_attn.generation.speculative_sample`). Greedy gives greedy
        search's tokens; a random sampler gives its own distribution
        exactly (not the tokens it draws alone for a seed). None (default)
        uses the model's own `assistant_model`; False decodes without one.
        """
        prompt = ops.convert_to_tensor(prompt, "int32")
        sampler = _sampler(sampler)
        assistant_model = self._assistant(assistant_model, sampler)
        if sampler == "greedy":
            sampler = generation.GreedySampler()
        if assistant_model is None and not isinstance(sampler, generation.Sampler):
            raise ValueError(
                "`sampler` must be 'greedy', a keras_attn.generation sampler, "
                "its name or its config. "
                f"Received: sampler={sampler!r}"
            )
        stop = _stop_length(prompt, prompt_lengths, max_length, max_new_tokens, sampler)
        if assistant_model is not None:
            return self._speculative_ids(
                prompt, max_length, sampler, prompt_lengths, end_token_id,
                seed, assistant_model, num_speculative_tokens, stop,
            )  # fmt: skip
        cache = self.initial_cache(ops.shape(prompt)[0], max_length)
        tokens = sampler(
            _task.WithoutPadding(self.call_with_cache),
            prompt,
            cache,
            stop,
            prompt_lengths=prompt_lengths,
            end_token_id=end_token_id,
            pad_token_id=PAD_ID,
            output_length=max_length,
            seed=seed,
        )
        return tokens[0] if isinstance(tokens, tuple) else tokens

    def _speculative_ids(
        self, prompt, max_length, sampler, prompt_lengths, end_token_id, seed,
        assistant_model, num_speculative_tokens, stop, return_stats=False,
    ):  # fmt: skip
        """`generate_ids` with an assistant, decoding to `stop` in a buffer
        of `max_length`; `return_stats`: `(tokens, counts)` as
        `generation.speculative_sample` returns them."""
        self.check_assistant(assistant_model, sampler, max_length)
        batch = ops.shape(prompt)[0]
        return generation.speculative_sample(
            _task.WithoutPadding(self.call_with_cache),
            self._proposer(assistant_model, batch, max_length),
            prompt,
            self.initial_cache(batch, max_length),
            stop,
            sampler=sampler,
            seed=seed,
            num_speculative_tokens=num_speculative_tokens,
            prompt_lengths=prompt_lengths,
            end_token_id=end_token_id,
            pad_token_id=PAD_ID,
            output_length=max_length,
            return_stats=return_stats,
        )

    @staticmethod
    def _proposer(assistant_model, batch, max_length):
        """The guesses' source for `batch` rows of `max_length` tokens: prompt
        lookup for `"prompt_lookup"`, else the draft model over its own
        cache."""
        if isinstance(assistant_model, str):
            return generation.PromptLookupProposer()
        return generation.DraftModelProposer(
            _task.WithoutPadding(assistant_model.call_with_cache),
            assistant_model.initial_cache(batch, max_length),
        )

    # -- scoring ------------------------------------------------------------------

    def score_ids(self, token_ids, continuous_cache=None, context_length=None):
        """The log-likelihood of each row of token ids, in sliding windows.

        Each row is one text: its tokens `[START, ..., END]` right-padded
        with 0. Windows of `context_length` inputs (default
        `sequence_length`) start every `context_length // 2` positions; a
        window scores only the targets the previous one did not (each with
        at least that much context), so every target is scored exactly once.
        Rows narrower than the context are scored by one window as wide as
        the rows (the same scores, at the cost of the batch's length rather
        than the context's), eagerly and in a traced graph.
        With a `ContinuousCache`, each target's probability is the mixture
        of the model's and a cache of the text's own earlier positions
        (`keras_attn.memory.continuous_cache_log_probs`; a text is one
        document).

        `keras.ops` throughout: it runs eagerly (`score`) and inside the
        TF Serving export's graph, with the same results.

        Returns:
            A dict of `(B,)` tensors: `log_likelihood` (float32, natural
            log), `num_tokens` (int32, targets scored: the end token
            included) and, with a cache, `model_log_likelihood` (the model
            alone).
        """
        if continuous_cache is not None and not callable(
            getattr(continuous_cache, "log_probs", None)
        ):
            raise ValueError(
                "`continuous_cache` must be a keras_attn.memory.ContinuousCache or "
                f"None. Received: continuous_cache={continuous_cache!r}"
            )
        context = v.check_positive_int(
            "context_length", context_length or self.sequence_length
        )
        if context < 2:
            raise ValueError(
                f"`context_length` must be at least 2. Received: {context}"
            )
        return windowed_log_likelihood(self, token_ids, context, continuous_cache)

    # -- text (TensorFlow Text tokenizer) --------------------------------------

    def score_strings(
        self, texts, continuous_cache=None, context_length=None, tokenizer=None
    ) -> dict:
        """`score_ids` of strings (a `tf.string` tensor `[B]` or a list):
        each text's tokens between the start and the end token, with
        `tokenizer` (default the model's), as the preprocessor's
        `score_preprocess` gives them. TensorFlow, eagerly or in a
        `tf.function` (the export's `score` signature is this)."""
        return self.score_ids(
            self._text_preprocessor(tokenizer, "score").score_preprocess(texts),
            continuous_cache=continuous_cache,
            context_length=context_length,
        )

    def score(
        self,
        texts,
        continuous_cache=None,
        batch_size: int = _task.DEFAULT_BATCH_SIZE,
        verbose="auto",
    ) -> dict:
        """The log-likelihood of raw strings (`score_strings`) as NumPy
        arrays: `log_likelihood`, `num_tokens` and, with a
        `ContinuousCache`, `model_log_likelihood`; what the export's `score`
        signature answers.

        Any number of texts, in batches of `batch_size` (memory stays flat),
        texts of similar length batched together and each batch padded to a
        bucket of its longest text; each text's figures do not depend on
        the batching. `verbose`: as in `keras.Model.predict` (`"auto"`: a
        progress bar when there is more than one batch).
        """
        texts = _task.text_list("texts", texts)
        preprocessor = self._text_preprocessor(None, "score")
        names = ["log_likelihood", "num_tokens"]
        if continuous_cache is not None:
            names.insert(1, "model_log_likelihood")

        def score_batch(batch):
            # [START, ..., END], padded to the bucket of the longest row.
            rows = _task.padded_ids(preprocessor.score_preprocess(batch))
            scores = self.score_ids(rows, continuous_cache=continuous_cache)
            columns = [np.asarray(ops.convert_to_numpy(scores[n])) for n in names]
            return list(zip(*columns, strict=True))

        found = self.generate_texts(score_batch, texts, batch_size, verbose, "Scoring")
        dtypes = {"num_tokens": "int32"}
        return {
            name: np.asarray(
                [row[column] for row in found], dtypes.get(name, "float32")
            )
            for column, name in enumerate(names)
        }

    def generate(
        self,
        prompts,
        max_new_tokens: int | None = None,
        sampler="greedy",
        seed=None,
        batch_size: int = _task.DEFAULT_BATCH_SIZE,
        verbose="auto",
        assistant_model=None,
        num_speculative_tokens: int = 4,
    ) -> list[str]:
        """Continue raw-string prompts: the text of the new tokens after each
        prompt (the prompt itself not repeated).

        Each prompt starts with the start token, and generation stops at the
        end token. How many new tokens, and what a long prompt keeps:

        - `max_new_tokens=None` (the default; keras-hub's `generate` fills its
          `max_length` the same way): each prompt goes on until the context
          (`sequence_length` tokens, the start token included) is full. A
          prompt of more than `sequence_length - 2` tokens keeps its last
          `sequence_length - 2`, leaving room for one new token.
        - `max_new_tokens=N` (at most `sequence_length - 1`): at most `N` new
          tokens; a prompt keeps its last `sequence_length - 1 - N` tokens
          (none when `N = sequence_length - 1`), so prompt and new tokens fit
          the context.

        Any number of prompts, in batches of `batch_size` (memory stays
        flat), prompts of similar length batched together and each batch
        padded to a bucket of its longest prompt. With greedy decoding the
        completions do not depend on the batching; a random sampler with one
        `seed` draws from it anew in every batch (a prompt's text depends on
        the prompts batched with it), with one seed per prompt each prompt
        draws from its own, whatever the batching.

        The text is valid UTF-8: a byte sequence that is not (a byte-level
        vocabulary can emit one) is decoded with U+FFFD in its place. What
        the export's `serving_default` answers (with greedy decoding).

        Args:
            prompts: a string or a list of strings.
            max_new_tokens: see above; None or a positive int.
            sampler: `"greedy"` or a `keras_attn.generation` sampler, as in
                `generate_ids`.
            seed: an int fixes a random sampler's draws; a list of ints,
                one per prompt, fixes each prompt's own (what the export's
                `sample` signature answers for that prompt and seed). None:
                the sampler's `seed`, else a fresh one at every call.
            batch_size: prompts continued at once.
            verbose: `"auto"` (a progress bar when there is more than one
                batch), 0, 1 (a bar) or 2 (one line at the end), as in
                `keras.Model.predict`.
            assistant_model: a draft `TransformerLanguageModel` on the same
                vocabulary, or `"prompt_lookup"`: speculative decoding in
                fewer forward passes of this model (`generate_ids`): with
                greedy decoding the same text as without it; with a random
                sampler text of the same distribution (a seed draws other
                tokens than without it). None (default): the model's own
                `assistant_model`, if any; False: none.
            num_speculative_tokens: the guesses checked per forward pass of
                this model with an `assistant_model`.
        """
        preprocessor = self._text_preprocessor(None, "generate")
        prompts = _task.text_list("prompts", prompts)
        sampler = _sampler(sampler)
        keep = self.prompt_room(max_new_tokens, self.sequence_length)
        seeds = None  # one per prompt, or one `seed` for every batch
        if seed is not None and not isinstance(seed, (int, np.integer)):
            seeds = _seed_array(sampler, seed, rows=len(prompts))

        def generate_batch(indices):
            ids = preprocessor.generate_preprocess([prompts[i] for i in indices])
            longest = int(np.max(np.asarray(ids.row_lengths()), initial=0))
            width = _task.bucket_length(min(longest, keep) + 1, cap=keep + 1)
            new = self.continue_ids(
                ids, max_new_tokens, sampler=sampler,
                seed=seed if seeds is None else seeds[list(indices)],
                prompt_width=width, assistant_model=assistant_model,
                num_speculative_tokens=num_speculative_tokens,
            )  # fmt: skip
            return preprocessor.generate_postprocess(new)

        return self.generate_texts(
            generate_batch, range(len(prompts)), batch_size, verbose,
            title="Generating", length=lambda i: len(prompts[i]),
        )  # fmt: skip

    def _text_preprocessor(self, tokenizer, method: str):
        """The `LanguageModelPreprocessor` of `tokenizer` (default the
        model's: `preprocessor`) for the text methods."""
        if tokenizer is None:
            _task.require_tokenizer(self, "tokenizer", method)
            return self.preprocessor
        from keras_attn.text import LanguageModelPreprocessor

        return LanguageModelPreprocessor(tokenizer, self.sequence_length)

    def check_assistant(self, assistant_model, sampler, max_length) -> None:
        """Raises unless this model can decode with `assistant_model`:
        `"prompt_lookup"` or a language model on its vocabulary with room for
        `max_length` tokens, with greedy decoding or a sampler that draws one
        token per row."""
        if isinstance(assistant_model, str):
            if assistant_model != "prompt_lookup":
                raise ValueError(
                    "`assistant_model` must be a TransformerLanguageModel or "
                    f"'prompt_lookup'. Received: assistant_model={assistant_model!r}"
                )
        elif not isinstance(assistant_model, TransformerLanguageModel):
            raise ValueError(
                "`assistant_model` must be a TransformerLanguageModel or "
                f"'prompt_lookup'. Received: assistant_model={assistant_model!r}"
            )
        else:
            if assistant_model.vocabulary_size != self.vocabulary_size:
                raise ValueError(
                    "`assistant_model` must share the model's vocabulary. Received: "
                    f"an assistant of vocabulary_size={assistant_model.vocabulary_size}"
                    f" for a model of vocabulary_size={self.vocabulary_size}"
                )
            length = assistant_model.sequence_length
            if isinstance(max_length, int) and length < max_length:
                raise ValueError(
                    f"`assistant_model` must hold {max_length} tokens. Received: an "
                    f"assistant of sequence_length={length}"
                )
        if not (sampler == "greedy" or isinstance(sampler, generation.Sampler)) or (
            isinstance(sampler, generation.BeamSampler)
        ):
            raise ValueError(
                "Speculative decoding (`assistant_model`) takes 'greedy' or a "
                "sampler that draws one token per row (RandomSampler, TopKSampler, "
                f"TopPSampler), not beam search. Received: sampler={sampler!r}"
            )

    @staticmethod
    def prompt_room(max_new_tokens, context) -> int:
        """Prompt tokens kept (the start token not counted) in a context of
        `context` tokens, with `max_new_tokens` (checked) after them."""
        if max_new_tokens is None:
            if context < 2:
                raise ValueError(
                    "A context of one token leaves no room to generate. "
                    f"Received: context_length={context}"
                )
            return context - 2
        v.check_positive_int("max_new_tokens", max_new_tokens)
        if max_new_tokens > context - 1:
            raise ValueError(
                f"`max_new_tokens` must be at most {context - 1}: the context of "
                f"{context} tokens holds the start token too. Received: "
                f"max_new_tokens={max_new_tokens}"
            )
        return context - 1 - max_new_tokens

    def continue_ids(
        self,
        ids,
        max_new_tokens: int | None = None,
        context_length: int | None = None,
        sampler="greedy",
        seed=None,
        prompt_width: int | None = None,
        assistant_model=None,
        num_speculative_tokens: int = 4,
    ):
        """Ragged prompt ids `(B, None)` (a `tf.RaggedTensor`, without the
        start token) -> ragged new ids `(B, None)`, as `generate` and the
        export's `serving_default` continue prompts (TensorFlow, eagerly or
        in a `tf.function`). `max_new_tokens` and what long prompts keep:
        as in `generate`, in a context of `context_length` tokens (default
        `sequence_length`). `prompt_width`: the prompts' padded width, start
        token included (default: the most a prompt keeps, plus one).
        `sampler`, `assistant_model`, `num_speculative_tokens`: as in
        `generate`; `seed` too, or in a `tf.function` an integer tensor,
        scalar or `(B,)` (one seed per row: the export's `sample`)."""
        import tensorflow as tf

        sampler = _sampler(sampler)
        assistant_model = self._assistant(assistant_model, sampler)
        if assistant_model is None:
            assistant_model = False  # resolved: none, not the model's own
        context = context_length or self.sequence_length
        keep = self.prompt_room(max_new_tokens, context)
        ids = ids[:, -keep:] if keep > 0 else ids[:, :0]  # keep the end
        ids = tf.concat([tf.fill([ids.nrows(), 1], START_ID), ids], axis=1)
        lengths = tf.cast(ids.row_lengths(), tf.int32)  # (B,), START included
        width = prompt_width or keep + 1
        prompt = ids.to_tensor(default_value=PAD_ID, shape=[None, width])
        total = context if max_new_tokens is None else width + max_new_tokens
        eager = tf.executing_eagerly()
        if eager:  # checked; a fresh seed per call without one
            seed = _seed_array(sampler, seed, rows=int(ids.nrows()))
        if eager and keras.backend.backend() in ("tensorflow", "jax"):
            # The seed is an input of the compiled decoding: each call draws
            # from its own, not from one frozen into the trace.
            generate = self._compiled_generation(
                width, total, sampler, seed.ndim == 1, assistant_model,
                num_speculative_tokens, max_new_tokens,
            )  # fmt: skip
            tokens = tf.convert_to_tensor(
                self.run_generate_function(
                    generate, prompt.numpy(), lengths.numpy(), seed
                )
            )
        else:
            tokens = self.generate_ids(
                prompt,
                total,
                sampler=sampler,
                prompt_lengths=lengths,
                seed=seed,
                assistant_model=assistant_model,
                num_speculative_tokens=num_speculative_tokens,
                max_new_tokens=max_new_tokens,
            )  # (B, total): prompt, new tokens, padding; fmt: skip
        positions = tf.range(total)[None, :]
        first_new = lengths[:, None]
        new = positions >= first_new
        if max_new_tokens is not None:
            new &= positions < first_new + max_new_tokens
        return tf.ragged.boolean_mask(tokens, new)

    def stream(
        self,
        prompt: str,
        max_new_tokens: int | None = None,
        sampler="greedy",
        seed=None,
        chunk_size: int = 8,
    ):
        """Continue one raw-string prompt, its text yielded as it is decoded:
        a generator of `str` pieces whose join is `generate(prompt, ...)`'s
        text with the same options.

        The decoding is `generate`'s (the same prompt, cache, sampler and
        draws), cut into chunks: a compiled call prefills the prompt and
        decodes the first new token, then each compiled call decodes
        `chunk_size` more; both are compiled once per shape (`generate`'s
        prompt-width buckets) and reused by later calls, on TensorFlow
        (`tf.function`) and JAX (`jax.jit`). Each piece is whole characters:
        the bytes of a character spread over byte pieces are held back
        until it is complete (a sequence that is not valid UTF-8 comes out
        as U+FFFD once a later token shows it, as in `generate`).

        One prompt at a time (a list is refused: call `stream` once per
        prompt, or `generate` for a batch).

        Args:
            prompt: one string.
            max_new_tokens, sampler: as in `generate` (beam search cannot
                stream: it chooses its tokens at the end).
            seed: fixes a random sampler's draws (default the sampler's
                `seed`): with it the pieces join to `generate(prompt,
                sampler=sampler, seed=seed)`. With neither, the draws come
                from a fresh seed at every call.
            chunk_size: new tokens decoded per compiled call after the
                first (more: fewer calls from Python; fewer: pieces sooner).

        Example:

        ```python
        for piece in model.stream("KING:", max_new_tokens=40):
            print(piece, end="", flush=True)
        ```
        """
        from keras_attn.models import streaming

        prompt = streaming.check_one_text("prompt", prompt)
        chunk_size = streaming.check_chunk_size(chunk_size)
        sampler = self._stream_sampler(_sampler(sampler))
        seed = _seed_array(sampler, seed)
        preprocessor = self._text_preprocessor(None, "stream")
        context = self.sequence_length
        keep = self.prompt_room(max_new_tokens, context)
        # The prompt as `generate` decodes a batch of this one prompt
        # (`continue_ids`): its end kept, the start token first, padded to
        # the bucket of its length.
        ids = preprocessor.generate_preprocess([prompt]).to_list()[0]
        width = _task.bucket_length(min(len(ids), keep) + 1, cap=keep + 1)
        row = [START_ID, *(ids[-keep:] if keep > 0 else [])]
        prompt_ids = np.full((1, width), PAD_ID, "int32")
        prompt_ids[0, : len(row)] = row
        lengths = np.asarray([len(row)], "int32")
        total = context if max_new_tokens is None else width + max_new_tokens
        first = len(row)  # the first new token's position
        last = total - 1 if max_new_tokens is None else first + max_new_tokens - 1
        start, advance = self._compiled_stream(width, total, sampler)
        detokenizing = streaming.text_of(self, self.tokenizer)
        return streaming.stream_pieces(
            lambda until: start(prompt_ids, lengths, seed, until),
            advance,
            first,
            last,
            chunk_size,
            *detokenizing,
        )

    def _stream_sampler(self, sampler):
        """`sampler` for `stream`: `"greedy"` is one `GreedySampler` kept on
        the model (so the compiled chunks are reused); beam search refused."""
        if isinstance(sampler, str) and sampler == "greedy":
            return _task.cached(self, "stream_greedy", [], generation.GreedySampler)
        if isinstance(sampler, generation.BeamSampler):
            raise ValueError(
                "`stream` decodes token by token; beam search chooses its tokens "
                "only when it ends, so it cannot stream (use `generate`). "
                f"Received: sampler={sampler!r}"
            )
        if not isinstance(sampler, generation.Sampler):
            raise ValueError(
                "`sampler` must be 'greedy', a keras_attn.generation sampler, "
                "its name or its config. "
                f"Received: sampler={sampler!r}"
            )
        return sampler

    def _compiled_stream(self, width, total, sampler):
        """`(start, advance)`: `generate_ids`' decoding of one prompt
        `(1, width)` to `total` tokens in chunks, each compiled once per
        setting (`make_generate_function`). `start(prompt, lengths, seed,
        until)` prefills and decodes until the index reaches `until`;
        `advance(state, until)` goes on; both return `(state, tokens,
        index, running)` (`keras_attn.models.streaming.stream_pieces`)."""

        from keras_attn.models import streaming

        def chunk(next_fn, state, until):
            return streaming.decode_chunk(sampler, next_fn, state, until)

        def build_start():
            def start(prompt, lengths, seed, until):
                next_fn = _task.WithoutPadding(self.call_with_cache)
                cache = self.initial_cache(ops.shape(prompt)[0], total)
                state = sampler.start(
                    next_fn,
                    prompt,
                    cache,
                    total,
                    prompt_lengths=lengths,
                    pad_token_id=PAD_ID,
                    seed=seed,
                )
                return chunk(next_fn, state, until)

            return start

        def build_advance():
            def advance(state, until):
                return chunk(_task.WithoutPadding(self.call_with_cache), state, until)

            return advance

        from keras_attn.ops._hash import hash_dtype

        sampler_key, depends = generation.serialization.compile_key(sampler)
        key = ("stream", width, total, sampler_key)
        start = self.make_generate_function(
            (*key, "start"),
            build_start,
            depends=depends,
            signature=[
                ([1, width], "int32"),
                ([1], "int32"),
                ([], hash_dtype()),
                ([], "int32"),
            ],
        )
        advance = self.make_generate_function(
            (*key, "advance"), build_advance, depends=depends
        )
        return start, advance

    def _compiled_generation(
        self,
        width,
        total,
        sampler,
        row_seeds,
        assistant_model=None,
        num_speculative_tokens=4,
        max_new_tokens=None,
    ):
        """`generate_ids` of `(prompt (B, width), lengths (B,), seed)` to
        `total` tokens, compiled once per setting (`make_generate_function`;
        a draft model's weights are read at each call too); `seed` of the
        hash's dtype (`_seed_array`), a scalar or, with `row_seeds`, `(B,)`."""
        from keras_attn.ops._hash import hash_dtype

        def build():
            def generate(prompt, lengths, seed):
                return self.generate_ids(
                    prompt, total, sampler=sampler, prompt_lengths=lengths, seed=seed,
                    assistant_model=assistant_model,
                    num_speculative_tokens=num_speculative_tokens,
                    max_new_tokens=max_new_tokens,
                )  # fmt: skip

            return generate

        draft = assistant_model if isinstance(assistant_model, keras.Model) else None
        seed_shape = [None] if row_seeds else []
        sampler_key, depends = generation.serialization.compile_key(sampler)
        return self.make_generate_function(
            ("generation", width, total, sampler_key, bool(row_seeds),
             id(assistant_model), num_speculative_tokens, max_new_tokens),
            build,
            depends=(*depends, assistant_model),
            signature=[
                ([None, width], "int32"), ([None], "int32"), (seed_shape, hash_dtype())
            ],
            others=() if draft is None else (draft,),
        )  # fmt: skip

    def stream_log_probs(
        self, dataset, states: bool = False, verbose: int = 0, title: str = "Scoring"
    ) -> dict:
        """The model's log-probability of every non-padding target of a
        dataset of `(inputs, targets)` windows, in stream order.

        Args:
            dataset: batches as `keras_attn.text.language_model_dataset`
                gives them (`shuffle=False`).
            states: also return the last hidden states (for a continuous
                cache).
            verbose: 1 or 2 show the progress over the batches, under `title`.

        Returns:
            A dict of NumPy arrays: `log_probs` `(T,)` float32, `targets`,
            `inputs` (the token before each target), `document_ids` (a
            document per start token, as the dataset packs them) and, with
            `states=True`, `states` `(T, d)` float32.
        """
        return stream_log_probs(self, dataset, states, verbose, title)

    def serving_spec(
        self,
        context_length: int | None = None,
        max_new_tokens: int | None = None,
        max_chars: int = 100_000,
        continuous_cache=None,
        assistant_model=None,
        num_speculative_tokens: int = 4,
        sampler=None,
    ):
        """What the TF Serving export serves: a `keras_attn.export.ServingSpec`
        (which `keras_attn.export.export_task` writes) of `serving_default`
        (`prompt` -> `completion`), `score` (`text` -> `log_likelihood`,
        `num_tokens`) and, with a `sampler`, `sample` (`prompt`, `seed` ->
        `completion`), with `export`'s options (see
        `keras_attn.export.export_language_model`): built by
        `keras_attn.export.language_model.language_model_serving_spec`."""
        from keras_attn.export.language_model import language_model_serving_spec

        return language_model_serving_spec(
            self, context_length, max_new_tokens, max_chars, continuous_cache,
            assistant_model, num_speculative_tokens, sampler,
        )  # fmt: skip

    def export(
        self,
        base_dir,
        model_name: str = "language_model",
        version: int | None = None,
        context_length: int | None = None,
        max_new_tokens: int | None = None,
        max_chars: int = 100_000,
        continuous_cache=None,
        precision: str | None = None,
        assistant_model=None,
        num_speculative_tokens: int = 4,
        sampler=None,
    ):
        """Export for TF Serving (completions and scores of raw strings):
        `keras_attn.export.export_language_model(self, ...)` (see there),
        which is `export_task` of `serving_spec`. Returns the version
        directory. Replaces `keras.Model.export`."""
        from keras_attn.export.task import export_task

        return export_task(
            self,
            base_dir,
            model_name=model_name,
            version=version,
            context_length=context_length,
            max_new_tokens=max_new_tokens,
            max_chars=max_chars,
            continuous_cache=continuous_cache,
            precision=precision,
            assistant_model=assistant_model,
            num_speculative_tokens=num_speculative_tokens,
            sampler=sampler,
        )

    def get_config(self):
        return {
            "name": self.name,
            "trainable": self.trainable,
            "backbone": keras.saving.serialize_keras_object(self.backbone),
            "tie_embeddings": self.tie_embeddings,
            "tokenizer": _task.serialize_tokenizer(self.tokenizer),
            "assistant_model": _task.serialize_assistant(
                self.assistant_model, ("tokenizer",)
            ),
            **self.head_policy_config(),
        }

    @classmethod
    def from_config(cls, config):
        return super().from_config(_task.deserialize_assistant(config))
