"""Greedy search and sampling over a KV cache (`keras_attn.generation`)."""

from __future__ import annotations

import hashlib

import keras
import numpy as np
import pytest
from keras import ops

from keras_attn import generation
from tests.generation.tiny_lm import build_lm
from tests.test_case import TestCase, to_numpy

VOCAB = 48
LENGTH = 14  # output length = cache length
PAD = 0


def _prompts():
    """Three right-padded prompts of lengths 5, 2 and 3."""
    prompt = np.array(
        [[11, 7, 30, 22, 5], [19, 4, PAD, PAD, PAD], [40, 3, 27, PAD, PAD]],
        dtype="int32",
    )
    return prompt, np.array([5, 2, 3], dtype="int32")


def _full_pass_greedy(lm, prompt, lengths, length, end_token_id=None):
    """Greedy decoding that recomputes the full pass for every new token.

    The model is causal, so a `(B, length)` buffer padded on the right gives
    the logits of every prefix (one input shape: fast on every backend).
    """
    batch = len(lengths)
    tokens = np.full((batch, length), PAD, dtype="int32")
    tokens[:, : prompt.shape[1]] = prompt
    done = np.zeros(batch, dtype=bool)
    for position in range(int(np.min(lengths)), length):
        logits = to_numpy(lm(tokens))  # (B, L, V)
        for b in range(batch):
            if position < lengths[b]:
                continue
            if done[b]:
                tokens[b, position] = PAD
                continue
            tokens[b, position] = int(np.argmax(logits[b, position - 1]))
            done[b] = tokens[b, position] == end_token_id
    return tokens


class _FixedNext:
    """A `next_fn` returning the same logits for every row and step."""

    def __init__(self, logits):
        self.logits = np.asarray(logits, dtype="float32")

    def __call__(self, token_ids, cache, index):
        batch = ops.shape(token_ids)[0]
        logits = ops.broadcast_to(
            ops.convert_to_tensor(self.logits)[None], (batch, len(self.logits))
        )
        return logits, cache


class SamplerTest(TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.lm = build_lm()

    def _cache(self, batch):
        return self.lm.initial_cache(batch, LENGTH)

    # -- the cache against the full pass --------------------------------------

    def test_cached_logits_equal_full_pass(self):
        prompt, _ = _prompts()
        rng = np.random.default_rng(1)
        sequence = np.concatenate(
            [prompt[:, :3], rng.integers(1, VOCAB, (3, LENGTH - 3))], axis=1
        ).astype("int32")
        full = to_numpy(self.lm(sequence))  # (B, L, V)
        # Prefill three tokens in one call, then one token per call.
        logits, cache = self.lm.next_fn(sequence[:, :3], self._cache(3), 0)
        self.assertAllClose(logits, full[:, :3], atol=1e-5, rtol=1e-5)
        for index in range(3, LENGTH):
            logits, cache = self.lm.next_fn(
                sequence[:, index : index + 1],
                cache,
                ops.convert_to_tensor(index, "int32"),
            )
            self.assertAllClose(
                logits[:, 0], full[:, index], atol=1e-5, rtol=1e-5, msg=str(index)
            )

    def test_greedy_equals_full_pass_recompute(self):
        prompt, lengths = _prompts()
        tokens = generation.greedy_search(
            self.lm.next_fn, prompt, self._cache(3), LENGTH, prompt_lengths=lengths
        )
        self.assertEqual(tuple(tokens.shape), (3, LENGTH))
        self.assertEqual(keras.backend.standardize_dtype(tokens.dtype), "int32")
        expected = _full_pass_greedy(self.lm, prompt, lengths, LENGTH)
        np.testing.assert_array_equal(to_numpy(tokens), expected)

    def test_rows_decode_as_alone(self):
        prompt, lengths = _prompts()
        batched = to_numpy(
            generation.greedy_search(
                self.lm.next_fn,
                prompt,
                self._cache(3),
                LENGTH,
                prompt_lengths=lengths,
                end_token_id=9,
            )
        )
        for b in range(3):
            alone = generation.greedy_search(
                self.lm.next_fn,
                prompt[b : b + 1, : lengths[b]],
                self._cache(1),
                LENGTH,
                end_token_id=9,
            )
            np.testing.assert_array_equal(to_numpy(alone)[0], batched[b])

    def test_prefill_and_stepping_through_the_prompt_agree(self):
        prompt, lengths = _prompts()
        results = [
            to_numpy(
                generation.greedy_search(
                    self.lm.next_fn,
                    prompt,
                    self._cache(3),
                    LENGTH,
                    prompt_lengths=lengths,
                    prefill=prefill,
                )
            )
            for prefill in (True, False)
        ]
        np.testing.assert_array_equal(results[0], results[1])

    def test_rank_two_logits_and_dict_cache(self):
        """`next_fn` may return `(B, V)` logits and any cache nest."""
        prompt, lengths = _prompts()

        def next_fn(token_ids, cache, index):
            logits, layers = self.lm.next_fn(token_ids, cache["layers"], index)
            return logits[:, -1], {"layers": layers}

        tokens = generation.greedy_search(
            next_fn, prompt, {"layers": self._cache(3)}, LENGTH, prompt_lengths=lengths
        )
        expected = generation.greedy_search(
            self.lm.next_fn, prompt, self._cache(3), LENGTH, prompt_lengths=lengths
        )
        np.testing.assert_array_equal(to_numpy(tokens), to_numpy(expected))

    # -- stopping --------------------------------------------------------------

    def test_end_token_stops_each_row(self):
        prompt, lengths = _prompts()
        free = to_numpy(
            generation.greedy_search(
                self.lm.next_fn, prompt, self._cache(3), LENGTH, prompt_lengths=lengths
            )
        )
        # The token row 0 generates first: an end token for that row.
        end = int(free[0, lengths[0]])
        stopped = to_numpy(
            generation.greedy_search(
                self.lm.next_fn,
                prompt,
                self._cache(3),
                LENGTH,
                prompt_lengths=lengths,
                end_token_id=end,
                pad_token_id=PAD,
            )
        )
        expected = _full_pass_greedy(self.lm, prompt, lengths, LENGTH, end)
        np.testing.assert_array_equal(stopped, expected)
        self.assertEqual(stopped[0, lengths[0]], end)
        self.assertTrue(np.all(stopped[0, lengths[0] + 1 :] == PAD))

    def test_stop_token_ids_stop_rows_as_the_end_token_does(self):
        prompt, lengths = _prompts()
        free = to_numpy(
            generation.greedy_search(
                self.lm.next_fn, prompt, self._cache(3), LENGTH, prompt_lengths=lengths
            )
        )
        # keras-hub's `stop_token_ids`, alone or beside `end_token_id`: each
        # stops the rows that generate it.
        first, second = int(free[0, lengths[0]]), int(free[1, lengths[1]])
        want = _full_pass_greedy(self.lm, prompt, lengths, LENGTH, first)
        for kwargs in (
            {"stop_token_ids": [first]},
            {"stop_token_ids": (first, first)},
            {"end_token_id": first, "stop_token_ids": ()},
        ):
            got = generation.GreedySampler()(
                self.lm.next_fn,
                prompt,
                self._cache(3),
                LENGTH,
                prompt_lengths=lengths,
                **kwargs,
            )
            np.testing.assert_array_equal(to_numpy(got), want, str(kwargs))
        both = to_numpy(
            generation.greedy_search(
                self.lm.next_fn,
                prompt,
                self._cache(3),
                LENGTH,
                prompt_lengths=lengths,
                end_token_id=first,
                stop_token_ids=[second],
            )
        )
        for row, stop in ((0, first), (1, second)):
            self.assertEqual(both[row, lengths[row]], stop)
            self.assertTrue(np.all(both[row, lengths[row] + 1 :] == PAD))
        beams, _ = generation.beam_search(
            self.lm.next_fn,
            prompt,
            self._cache(3),
            LENGTH,
            beam_width=1,
            prompt_lengths=lengths,
            stop_token_ids=[first, second],
        )
        np.testing.assert_array_equal(to_numpy(beams)[:2], both[:2])
        with self.assertRaisesRegex(ValueError, "Received: stop_token_ids=3"):
            generation.greedy_search(
                self.lm.next_fn, prompt, self._cache(3), 8, stop_token_ids=3
            )
        with self.assertRaisesRegex(ValueError, r"Received: stop_token_ids=\[2, -1\]"):
            generation.greedy_search(
                self.lm.next_fn, prompt, self._cache(3), 8, stop_token_ids=[2, -1]
            )

    def test_end_token_in_prompt_does_not_stop(self):
        prompt, _ = _prompts()
        end = int(prompt[0, 1])  # inside row 0's prompt
        tokens = to_numpy(
            generation.greedy_search(
                self.lm.next_fn,
                prompt[:1],
                self._cache(1),
                LENGTH,
                end_token_id=end,
            )
        )
        self.assertNotEqual(tokens[0, 5], PAD)
        np.testing.assert_array_equal(tokens[0, :5], prompt[0])

    def test_loop_ends_when_all_rows_are_done(self):
        calls = []

        def next_fn(token_ids, cache, index):
            calls.append(1)  # counts steps in eager TF; JAX traces once
            return _FixedNext([0.0, 5.0, 1.0])(token_ids, cache, index)

        tokens = generation.greedy_search(
            next_fn, np.full((2, 1), 2, "int32"), (), 10, end_token_id=1
        )
        np.testing.assert_array_equal(
            to_numpy(tokens), [[2, 1] + [0] * 8, [2, 1] + [0] * 8]
        )
        if keras.backend.backend() == "tensorflow":
            self.assertLen(calls, 1)

    def test_max_length_tensor_and_output_length(self):
        prompt, lengths = _prompts()
        full = to_numpy(
            generation.greedy_search(
                self.lm.next_fn, prompt, self._cache(3), LENGTH, prompt_lengths=lengths
            )
        )
        short = to_numpy(
            generation.greedy_search(
                self.lm.next_fn,
                prompt,
                self._cache(3),
                ops.convert_to_tensor(8, "int32"),
                prompt_lengths=lengths,
                output_length=LENGTH,
            )
        )
        np.testing.assert_array_equal(short[:, :8], full[:, :8])
        self.assertTrue(np.all(short[:, 8:] == PAD))

    # -- sampling --------------------------------------------------------------

    @pytest.mark.filterwarnings("ignore")
    def test_top_k_one_and_tiny_top_p_are_greedy(self):
        prompt, lengths = _prompts()
        greedy = to_numpy(
            generation.greedy_search(
                self.lm.next_fn, prompt, self._cache(3), LENGTH, prompt_lengths=lengths
            )
        )
        for kwargs in ({"top_k": 1}, {"top_p": 1e-6}, {"top_p": 1e-6, "top_k": 5}):
            sampled = generation.sample(
                self.lm.next_fn,
                prompt,
                self._cache(3),
                LENGTH,
                prompt_lengths=lengths,
                seed=3,
                temperature=2.0,
                **kwargs,
            )
            np.testing.assert_array_equal(to_numpy(sampled), greedy, str(kwargs))

    def test_seeds_reproduce(self):
        prompt, lengths = _prompts()

        def draw(seed):
            return to_numpy(
                generation.sample(
                    self.lm.next_fn,
                    prompt,
                    self._cache(3),
                    LENGTH,
                    prompt_lengths=lengths,
                    temperature=3.0,
                    seed=seed,
                )
            )

        first = draw(5)
        np.testing.assert_array_equal(draw(5), first)
        np.testing.assert_array_equal(draw(ops.convert_to_tensor(5, "int32")), first)
        self.assertFalse(np.array_equal(draw(6), first))
        # The prompts are kept whatever the seed.
        for b, length in enumerate(lengths):
            np.testing.assert_array_equal(first[b, :length], prompt[b, :length])

    def test_samples_stay_in_top_k_and_nucleus(self):
        prompt, lengths = _prompts()
        prompt, lengths = np.tile(prompt, (2, 1)), np.tile(lengths, 2)
        batch, temperature = len(lengths), 2.0
        for sampler, name in (
            (generation.TopKSampler(k=3, temperature=temperature), "top_k"),
            (generation.TopPSampler(p=0.6, temperature=temperature), "top_p"),
        ):
            tokens = to_numpy(
                sampler(
                    self.lm.next_fn,
                    prompt,
                    self._cache(batch),
                    LENGTH,
                    prompt_lengths=lengths,
                    seed=4,
                )
            )
            # Different draws for the same prompt: the noise differs per row.
            self.assertFalse(np.array_equal(tokens[:3], tokens[3:]), name)
            logits = to_numpy(self.lm(tokens)) / temperature  # (B, L, V)
            for b in range(batch):
                for position in range(lengths[b], LENGTH):
                    row = logits[b, position - 1]
                    order = np.argsort(-row)
                    rank = int(np.where(order == tokens[b, position])[0][0])
                    if name == "top_k":
                        self.assertLess(rank, 3)
                    else:
                        probs = np.exp(row - row.max())
                        probs = probs[order] / probs.sum()
                        self.assertLess(np.sum(probs[:rank]), 0.6 + 1e-5)

    def test_sampled_frequencies_follow_the_distribution(self):
        probs = np.array([0.1, 0.2, 0.3, 0.4])
        next_fn = _FixedNext(np.log(probs))
        batch = 4000
        prompt = np.zeros((batch, 1), "int32")
        cases = {
            "random": (generation.RandomSampler(), probs),
            "temperature": (
                generation.RandomSampler(temperature=2.0),
                np.sqrt(probs) / np.sqrt(probs).sum(),
            ),
            "top_k": (generation.TopKSampler(k=2), np.array([0, 0, 3, 4]) / 7),
            # Nucleus of p=0.6: 0.4 then 0.3 (mass before 0.4 < 0.6).
            "top_p": (generation.TopPSampler(p=0.6), np.array([0, 0, 3, 4]) / 7),
        }
        for name, (sampler, expected) in cases.items():
            tokens = to_numpy(sampler(next_fn, prompt, (), 2, seed=11))[:, 1]
            freq = np.bincount(tokens, minlength=4) / batch
            tolerance = 4 * np.sqrt(expected * (1 - expected) / batch) + 1e-9
            self.assertTrue(
                np.all(np.abs(freq - expected) <= tolerance), f"{name}: {freq}"
            )

    def test_mixed_precision(self):
        """bfloat16 logits: probabilities and scores are still float32."""
        keras.config.set_dtype_policy("mixed_bfloat16")
        lm = build_lm()
        keras.config.set_dtype_policy("float32")
        prompt, lengths = _prompts()
        logits, _ = lm.next_fn(prompt, lm.initial_cache(3, LENGTH), 0)
        self.assertEqual(keras.backend.standardize_dtype(logits.dtype), "bfloat16")
        greedy = to_numpy(
            generation.greedy_search(
                lm.next_fn,
                prompt,
                lm.initial_cache(3, LENGTH),
                LENGTH,
                prompt_lengths=lengths,
            )
        )
        self.assertTrue(np.all((greedy >= 0) & (greedy < VOCAB)))
        tokens, scores = generation.beam_search(
            lm.next_fn,
            prompt,
            lm.initial_cache(3, LENGTH),
            LENGTH,
            beam_width=1,
            prompt_lengths=lengths,
        )
        np.testing.assert_array_equal(to_numpy(tokens), greedy)
        self.assertEqual(keras.backend.standardize_dtype(scores.dtype), "float32")
        self.assertAllFinite(scores)

    def test_noise_is_uniform_and_the_same_on_every_backend(self):
        from keras_attn.ops import counter_random

        seed = counter_random.step_seed(counter_random.seed_tensor(12345), 7)
        noise = to_numpy(counter_random.uniform(seed, (300, 500)))
        self.assertTrue(np.all((noise > 0) & (noise < 1)))
        self.assertAlmostEqual(float(noise.mean()), 0.5, delta=0.003)
        self.assertAlmostEqual(float(noise.var()), 1 / 12, delta=0.002)
        other = to_numpy(
            counter_random.uniform(
                counter_random.step_seed(counter_random.seed_tensor(12345), 8),
                (300, 500),
            )
        )
        self.assertLess(abs(np.corrcoef(noise.ravel(), other.ravel())[0, 1]), 0.01)
        # Exact integer hashing: TensorFlow and JAX draw the same bits.
        self.assertEqual(
            hashlib.md5(noise.tobytes()).hexdigest(), "5dc25bc171b2f7cc4c33978609e94841"
        )

    # -- arguments -------------------------------------------------------------

    def test_invalid_arguments(self):
        prompt, _ = _prompts()
        with self.assertRaisesRegex(ValueError, "temperature"):
            generation.RandomSampler(temperature=0.0)
        with self.assertRaisesRegex(ValueError, "Received: k=0"):
            generation.TopKSampler(k=0)
        with self.assertRaisesRegex(ValueError, "Received: p=1.5"):
            generation.TopPSampler(p=1.5)
        with self.assertRaisesRegex(ValueError, "output_length"):
            generation.greedy_search(
                self.lm.next_fn,
                prompt,
                self._cache(3),
                ops.convert_to_tensor(5),
            )
        with self.assertRaisesRegex(ValueError, "rank|shape"):
            generation.greedy_search(self.lm.next_fn, prompt[0], self._cache(3), 8)
        with self.assertRaisesRegex(ValueError, "longer than the output"):
            generation.greedy_search(self.lm.next_fn, prompt, self._cache(3), 4)
        with self.assertRaisesRegex(ValueError, "end_token_id"):
            generation.greedy_search(
                self.lm.next_fn, prompt, self._cache(3), 8, end_token_id=-1
            )

    def test_config_round_trip(self):
        for sampler in (
            generation.GreedySampler(),
            generation.RandomSampler(temperature=0.5, seed=3),
            generation.TopKSampler(k=7, seed=1),
            generation.TopPSampler(p=0.8, k=20, temperature=0.9),
        ):
            revived = type(sampler).from_config(sampler.get_config())
            self.assertEqual(revived.get_config(), sampler.get_config())


@pytest.mark.jax_only
class JaxCompileTest(TestCase):
    def test_jit_traces_once(self):
        import jax

        lm = build_lm()
        traces = []

        @jax.jit
        def decode(prompt, lengths, max_length, seed):
            traces.append(1)
            cache = lm.initial_cache(prompt.shape[0], LENGTH)
            return generation.sample(
                lm.next_fn,
                prompt,
                cache,
                max_length,
                prompt_lengths=lengths,
                output_length=LENGTH,
                top_k=4,
                seed=seed,
            )

        prompt, lengths = _prompts()
        first = decode(prompt, lengths, np.int32(LENGTH), np.int32(1))
        second = decode(
            prompt[::-1].copy(), lengths[::-1].copy(), np.int32(9), np.int32(2)
        )
        self.assertLen(traces, 1)
        eager = generation.sample(
            lm.next_fn,
            prompt,
            lm.initial_cache(3, LENGTH),
            LENGTH,
            prompt_lengths=lengths,
            top_k=4,
            seed=1,
        )
        np.testing.assert_array_equal(np.asarray(first), to_numpy(eager))
        self.assertTrue(np.all(np.asarray(second)[:, 9:] == PAD))
