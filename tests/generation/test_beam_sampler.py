"""Beam search over a KV cache (`keras_attn.generation.BeamSampler`)."""

from __future__ import annotations

import itertools

import numpy as np
from keras import ops

from keras_attn import generation
from tests.generation.test_sampler import LENGTH, PAD, _prompts
from tests.generation.tiny_lm import build_lm, build_translator
from tests.test_case import TestCase, to_numpy

END = 1


class _TableNext:
    """A Markov `next_fn`: log P(token | previous token, position) from a table.

    `table[index, previous]` are the log-probabilities of the token at
    `index + 1`, so beam search results can be checked by hand or by brute
    force enumeration.
    """

    def __init__(self, log_probs):
        self.log_probs = np.asarray(log_probs, dtype="float32")  # (L, V, V)

    def __call__(self, token_ids, cache, index):
        table = ops.take(ops.convert_to_tensor(self.log_probs), index, axis=0)
        return ops.take(table, token_ids[:, -1], axis=0), cache  # (B, V)


def _penalty(length, alpha):
    return ((5.0 + length) / 6.0) ** alpha


def _brute_force(log_probs, start, length, alpha):
    """Every hypothesis from `start` (ended by END or by `length`), best first."""
    vocab = log_probs.shape[-1]
    results = []
    for generated in range(1, length):
        for tail in itertools.product(range(vocab), repeat=generated):
            ended = tail[-1] == END
            if END in tail[:-1] or (not ended and generated < length - 1):
                continue
            sequence = (start, *tail)
            score = sum(
                log_probs[i, sequence[i], sequence[i + 1]] for i in range(generated)
            )
            padded = list(sequence) + [PAD] * (length - len(sequence))
            results.append((score / _penalty(generated, alpha), padded))
    results.sort(key=lambda item: -item[0])
    return results


def _full_pass_score(lm, tokens, prompt_length, alpha, end_token_id=END):
    """Length-normalised log-probability of the generated tokens, full pass."""
    logits = to_numpy(lm(tokens[None]))[0].astype("float64")  # (L, V)
    log_probs = (
        logits
        - np.log(
            np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True)
        )
        - logits.max(-1, keepdims=True)
    )
    generated = tokens[prompt_length:]
    stop = np.where(generated == end_token_id)[0]
    count = len(generated) if len(stop) == 0 else stop[0] + 1
    total = sum(log_probs[prompt_length + i - 1, generated[i]] for i in range(count))
    return total / _penalty(count, alpha), count


class BeamSamplerTest(TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.lm = build_lm()

    def _cache(self, batch):
        return self.lm.initial_cache(batch, LENGTH)

    def test_length_penalty(self):
        lengths = ops.convert_to_tensor([1.0, 7.0, 19.0])
        self.assertAllClose(generation.length_penalty(lengths, 0.0), np.ones(3), atol=0)
        self.assertAllClose(
            generation.length_penalty(lengths, 0.6),
            np.array([1.0, 2.0**0.6, 4.0**0.6]),
            atol=1e-6,
        )

    def test_hand_built_table(self):
        """Alpha decides between "end" now and "a end" later.

        After the start token: P(end) = P(a) = 0.5; after "a": P(end) = 0.95.
        alpha=0: log .5 = -0.693 beats log .5 + log .95 = -0.744.
        alpha=1: -0.744 / (7/6) = -0.638 beats -0.693 / 1.
        """
        table = np.full((4, 4, 4), np.log(1e-7))  # tokens: pad, end, a, start
        table[0, 3] = np.log([1e-7, 0.5, 0.5 - 2e-7, 1e-7])  # after start (3)
        table[1, 2] = np.log([1e-7, 0.95, 0.05 - 2e-7, 1e-7])  # after "a" (2)
        table[2, 2] = np.log([1e-7, 1.0 - 3e-7, 1e-7, 1e-7])
        next_fn = _TableNext(table)
        start = np.array([[3]], "int32")
        for alpha, tokens, score in (
            (0.0, [3, END, PAD, PAD], np.log(0.5)),
            (1.0, [3, 2, END, PAD], (np.log(0.5) + np.log(0.95)) / (7 / 6)),
        ):
            best, best_score = generation.beam_search(
                next_fn,
                start,
                (),
                4,
                beam_width=2,
                length_penalty=alpha,
                end_token_id=END,
            )
            np.testing.assert_array_equal(to_numpy(best), [tokens])
            self.assertAllClose(best_score, np.array([score]), atol=1e-5)

    def test_matches_brute_force(self):
        rng = np.random.default_rng(3)
        vocab, length = 5, 5
        logits = rng.normal(size=(length, vocab, vocab)) * 1.5
        log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        starts = np.array([[2], [3], [4]], "int32")
        # 320 beams hold every hypothesis: at most 4**3 live prefixes before
        # the last step, 5 continuations each, all ranked among the best 320.
        width = 320
        for alpha in (0.0, 0.7, 2.0):
            sampler = generation.BeamSampler(
                beam_width=width, length_penalty=alpha, return_all_beams=True
            )
            tokens, scores = sampler(
                _TableNext(log_probs), starts, (), length, end_token_id=END
            )
            tokens, scores = to_numpy(tokens), to_numpy(scores)
            self.assertEqual(tokens.shape, (3, width, length))
            best, best_score = generation.beam_search(
                _TableNext(log_probs),
                starts,
                (),
                length,
                beam_width=width,
                length_penalty=alpha,
                end_token_id=END,
            )
            for row, start in enumerate(starts[:, 0]):
                expected = _brute_force(log_probs, start, length, alpha)[:5]
                np.testing.assert_array_equal(
                    tokens[row, :5], [seq for _, seq in expected], f"alpha={alpha}"
                )
                self.assertAllClose(
                    scores[row, :5], np.array([s for s, _ in expected]), atol=1e-5
                )
                np.testing.assert_array_equal(to_numpy(best)[row], expected[0][1])
                self.assertAllClose(
                    to_numpy(best_score)[row], expected[0][0], atol=1e-5
                )

    def test_width_one_is_greedy(self):
        prompt, lengths = _prompts()
        for end_token_id in (None, 15):
            greedy = generation.greedy_search(
                self.lm.next_fn,
                prompt,
                self._cache(3),
                LENGTH,
                prompt_lengths=lengths,
                end_token_id=end_token_id,
            )
            beam, _ = generation.beam_search(
                self.lm.next_fn,
                prompt,
                self._cache(3),
                LENGTH,
                beam_width=1,
                prompt_lengths=lengths,
                end_token_id=end_token_id,
            )
            np.testing.assert_array_equal(
                to_numpy(beam), to_numpy(greedy), str(end_token_id)
            )

    def test_rows_decode_as_alone_and_scores_match_full_pass(self):
        prompt, lengths = _prompts()
        alpha, width = 0.6, 3
        tokens, scores = generation.beam_search(
            self.lm.next_fn,
            prompt,
            self._cache(3),
            LENGTH,
            beam_width=width,
            length_penalty=alpha,
            prompt_lengths=lengths,
            end_token_id=END,
        )
        tokens, scores = to_numpy(tokens), to_numpy(scores)
        for b in range(3):
            alone, alone_score = generation.beam_search(
                self.lm.next_fn,
                prompt[b : b + 1, : lengths[b]],
                self._cache(1),
                LENGTH,
                beam_width=width,
                length_penalty=alpha,
                end_token_id=END,
            )
            np.testing.assert_array_equal(to_numpy(alone)[0], tokens[b])
            self.assertAllClose(to_numpy(alone_score)[0], scores[b], atol=1e-5)
            # The score is the full-pass log-probability of the tokens: the
            # cache rows followed their beams.
            expected, count = _full_pass_score(self.lm, tokens[b], lengths[b], alpha)
            self.assertAllClose(scores[b], expected, atol=1e-4, rtol=1e-5)
            self.assertTrue(np.all(tokens[b, lengths[b] + count :] == PAD))
            np.testing.assert_array_equal(
                tokens[b, : lengths[b]], prompt[b, : lengths[b]]
            )

    def test_all_beams_sorted_and_distinct(self):
        prompt, lengths = _prompts()
        sampler = generation.BeamSampler(beam_width=4, return_all_beams=True)
        tokens, scores = sampler(
            self.lm.next_fn, prompt, self._cache(3), LENGTH, prompt_lengths=lengths
        )
        tokens, scores = to_numpy(tokens), to_numpy(scores)
        self.assertEqual(tokens.shape, (3, 4, LENGTH))
        self.assertTrue(np.all(np.diff(scores, axis=1) <= 1e-6))
        for b in range(3):
            self.assertLen({tuple(t) for t in tokens[b]}, 4)
            for beam in range(4):
                expected, _ = _full_pass_score(
                    self.lm, tokens[b, beam], lengths[b], 0.0, end_token_id=None
                )
                self.assertAllClose(scores[b, beam], expected, atol=1e-4, rtol=1e-5)

    def test_invalid_arguments(self):
        with self.assertRaisesRegex(ValueError, "Received: beam_width=0"):
            generation.BeamSampler(beam_width=0)
        with self.assertRaisesRegex(ValueError, "Received: length_penalty=-1"):
            generation.BeamSampler(length_penalty=-1)
        with self.assertRaisesRegex(ValueError, "return_all_beams"):
            generation.BeamSampler(return_all_beams=1)

    def test_config_round_trip(self):
        sampler = generation.BeamSampler(beam_width=3, length_penalty=0.6)
        revived = generation.BeamSampler.from_config(sampler.get_config())
        self.assertEqual(revived.get_config(), sampler.get_config())


class TranslationTest(TestCase):
    """Start-token decoding of an encoder-decoder: the cross-attention keys,
    values and source mask ride in the cache nest, repeated and reordered by
    beam search like the self-attention cache."""

    START, LENGTH = 2, 9

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.model = build_translator(seed=1)
        rng = np.random.default_rng(5)
        cls.source = 3 * rng.normal(size=(3, 6, 32)).astype("float32")
        cls.source_mask = np.arange(6)[None] < np.array([[6], [2], [4]])
        # The end token: what row 1 generates second (so it stops early).
        cls.END = None
        free, _ = cls._decode([0, 1, 2], beam_width=1)
        cls.END = int(to_numpy(free)[1, 2])

    @classmethod
    def _decode(cls, rows, **kwargs):
        source, mask = cls.source[rows], cls.source_mask[rows]
        start = np.full((len(rows), 1), cls.START, "int32")
        cache = cls.model.initial_cache(source, mask, cls.LENGTH)
        return generation.beam_search(
            cls.model.next_fn,
            start,
            cache,
            cls.LENGTH,
            end_token_id=cls.END,
            **kwargs,
        )

    def test_greedy_and_beam_over_a_source(self):
        # Width 1 against a full-pass greedy recompute.
        tokens, _ = self._decode([0, 1, 2], beam_width=1)
        tokens = to_numpy(tokens)
        expected = np.full((3, self.LENGTH), PAD, "int32")
        expected[:, 0] = self.START
        done = np.zeros(3, dtype=bool)
        for position in range(1, self.LENGTH):
            logits = to_numpy(self.model(expected, self.source, self.source_mask))
            for b in np.flatnonzero(~done):
                expected[b, position] = int(np.argmax(logits[b, position - 1]))
                done[b] = expected[b, position] == self.END
        np.testing.assert_array_equal(tokens, expected)
        self.assertIn(self.END, tokens[1])
        # Width 3: each source decodes as it would alone.
        batched, scores = self._decode([0, 1, 2], beam_width=3, length_penalty=0.6)
        for b in range(3):
            alone, alone_score = self._decode([b], beam_width=3, length_penalty=0.6)
            np.testing.assert_array_equal(to_numpy(alone)[0], to_numpy(batched)[b])
            self.assertAllClose(
                to_numpy(alone_score)[0], to_numpy(scores)[b], atol=1e-5
            )
