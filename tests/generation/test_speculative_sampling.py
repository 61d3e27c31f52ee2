"""Speculative sampling (`keras_attn.generation.speculative_sample`) follows
the target's distribution exactly: thousands of rows decoded from a small
model whose every sequence probability is known are compared, by a
chi-square test, with the exact distribution that plain sampling with the
same sampler follows (computed here in NumPy, cut and temperature
included), for a draft model and for prompt lookup, with ragged prompts and
an end token. The same test rejects the draft's own distribution, so it can
tell the two apart."""

import numpy as np
import pytest
import scipy.stats
from keras import ops

from keras_attn import generation
from tests.test_case import to_numpy

VOCAB, WIDTH, END = 5, 6, 4
ROWS = 3000  # per prompt
PROMPTS = [[1, 2], [3]]
MAX_LENGTH = 5


class ToyModel:
    """A next function whose logits depend on the last two tokens and the
    position: `w1[x_t] + w2[x_{t-1}] + bias[t + 1]`, the earlier token read
    from a token cache written at per-row positions (so a wrong roll-back
    would show)."""

    def __init__(self, seed, scale=1.2, like=None):
        """Weights drawn normal; with `like`, that model's plus the noise
        (a draft that often agrees with it)."""
        rng = np.random.default_rng(seed)
        self.w1 = rng.normal(0, scale, (VOCAB, VOCAB)).astype("float32")
        self.w2 = rng.normal(0, scale, (VOCAB, VOCAB)).astype("float32")
        self.bias = rng.normal(0, 0.5, (WIDTH + 1, VOCAB)).astype("float32")
        if like is not None:
            self.w1, self.w2 = self.w1 + like.w1, self.w2 + like.w2
            self.bias = self.bias + like.bias

    def initial_cache(self, batch):
        return ops.zeros((batch, WIDTH), "int32")

    def __call__(self, token_ids, cache, index):
        token_ids = ops.cast(token_ids, "int32")
        batch, steps = ops.shape(token_ids)[0], token_ids.shape[1]
        index = ops.cast(index, "int32")
        if len(index.shape) == 0:
            index = ops.full((batch,), index, "int32")
        positions = index[:, None] + ops.arange(steps, dtype="int32")[None, :]
        hit = ops.equal(positions[:, :, None], ops.arange(WIDTH, dtype="int32"))
        written = ops.sum(ops.where(hit, token_ids[:, :, None], 0), axis=1)
        cache = ops.where(ops.any(hit, axis=1), written, cache)
        before = ops.take_along_axis(cache, ops.clip(positions - 1, 0, WIDTH - 1), 1)
        before = ops.where(positions >= 1, before, 0)
        logits = (
            ops.take(ops.convert_to_tensor(self.w1), token_ids, axis=0)
            + ops.take(ops.convert_to_tensor(self.w2), before, axis=0)
            + ops.take(
                ops.convert_to_tensor(self.bias), ops.clip(positions + 1, 0, WIDTH), 0
            )
        )
        return logits, cache

    def next_probs(self, context, cut):
        """NumPy: the sampler's distribution of the token after `context`."""
        t = len(context) - 1
        before = context[-2] if len(context) >= 2 else 0
        logits = self.w1[context[-1]] + self.w2[before] + self.bias[t + 1]
        return cut(logits.astype("float64"))


def cut_of(kind):
    """NumPy reference of each sampler's distribution over logits."""

    def softmax(x):
        e = np.exp(x - x.max())
        return e / e.sum()

    def random(logits):
        return softmax(logits / 0.8)

    def top_k(logits):
        keep = np.argsort(-logits, kind="stable")[:3]
        out = np.zeros_like(logits)
        out[keep] = softmax(logits[keep])
        return out

    def top_p(logits):
        probs = softmax(logits)
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]
        keep = order[before < 0.7]
        out = np.zeros_like(probs)
        out[keep] = probs[keep] / probs[keep].sum()
        return out

    return {"random": random, "top_k": top_k, "top_p": top_p}[kind]


SAMPLERS = {
    "random": lambda: generation.RandomSampler(temperature=0.8),
    "top_k": lambda: generation.TopKSampler(k=3),
    "top_p": lambda: generation.TopPSampler(p=0.7),
}


def exact_distribution(model, prompt, cut):
    """Every continuation of `prompt` to MAX_LENGTH tokens (or to the end
    token) and its probability."""
    found = {}

    def walk(context, probability):
        ended = context[-1] == END and len(context) > len(prompt)
        if ended or len(context) == MAX_LENGTH:
            found[tuple(context[len(prompt) :])] = probability
            return
        for token, p in enumerate(model.next_probs(context, cut)):
            if p > 0:
                walk([*context, token], probability * p)

    walk(list(prompt), 1.0)
    return found


def continuations(tokens, prompt_length):
    out = []
    for row in tokens:
        generated = list(row[prompt_length:])
        if END in generated:
            generated = generated[: generated.index(END) + 1]
        out.append(tuple(int(t) for t in generated))
    return out


def chi_square_p_value(samples, expected):
    """p-value of the samples against the exact distribution; cells with
    fewer than 5 expected draws are pooled."""
    counts = {}
    for key in samples:
        assert key in expected, f"a sequence the sampler never draws: {key}"
        counts[key] = counts.get(key, 0) + 1
    n = len(samples)
    observed, wanted, pooled_o, pooled_e = [], [], 0, 0.0
    for key, p in expected.items():
        if n * p >= 5:
            observed.append(counts.get(key, 0))
            wanted.append(n * p)
        else:
            pooled_o += counts.get(key, 0)
            pooled_e += n * p
    if pooled_e > 0:
        observed.append(pooled_o)
        wanted.append(pooled_e)
    return scipy.stats.chisquare(observed, wanted).pvalue


def batch():
    prompt = np.zeros((ROWS * len(PROMPTS), 2), "int32")
    lengths = np.zeros((ROWS * len(PROMPTS),), "int32")
    for i, p in enumerate(PROMPTS):
        prompt[i * ROWS : (i + 1) * ROWS, : len(p)] = p
        lengths[i * ROWS : (i + 1) * ROWS] = len(p)
    return prompt, lengths


TARGET = ToyModel(0)
DRAFT = ToyModel(1, scale=0.6, like=TARGET)


def check_follows_the_target(tokens, kind):
    for i, p in enumerate(PROMPTS):
        rows = tokens[i * ROWS : (i + 1) * ROWS]
        expected = exact_distribution(TARGET, p, cut_of(kind))
        assert sum(expected.values()) == pytest.approx(1.0)
        assert chi_square_p_value(continuations(rows, len(p)), expected) > 1e-3


@pytest.mark.parametrize("kind", sorted(SAMPLERS))
@pytest.mark.parametrize("proposer", ["draft", "prompt_lookup"])
def test_speculative_samples_follow_the_targets_distribution(kind, proposer):
    prompt, lengths = batch()
    if proposer == "draft":
        helper = generation.DraftModelProposer(DRAFT, DRAFT.initial_cache(len(prompt)))
    else:
        helper = generation.PromptLookupProposer(ngram_size=1)

    def decode():
        return generation.speculative_sample(
            TARGET,
            helper,
            prompt,
            TARGET.initial_cache(len(prompt)),
            MAX_LENGTH,
            sampler=SAMPLERS[kind](),
            seed=11,
            num_speculative_tokens=2,
            prompt_lengths=lengths,
            end_token_id=END,
            return_stats=True,
        )

    tokens, stats = decode()
    tokens = to_numpy(tokens)
    check_follows_the_target(tokens, kind)
    # Some rows kept guesses (fewer target calls than new tokens), some
    # rejected them (more calls than full blocks of k + 1 need); the draft,
    # near the target, is kept more often than prompt lookup's copies.
    new, calls = to_numpy(stats["new_tokens"]), to_numpy(stats["row_calls"])
    assert (new > calls).mean() > 0.1 and (calls > -(-new // 3)).mean() > 0.1
    assert new.sum() / calls.sum() > (1.3 if proposer == "draft" else 1.05)
    # The same seed draws the same tokens.
    np.testing.assert_array_equal(to_numpy(decode()[0]), tokens)


@pytest.mark.parametrize("kind", sorted(SAMPLERS))
def test_the_test_accepts_plain_sampling_and_rejects_the_draft(kind):
    """The reference and the test hold for plain sampling of the target,
    and the draft's distribution, sampled the same way, fails it."""
    prompt, lengths = batch()
    for model, follows in ((TARGET, True), (DRAFT, False)):
        tokens = to_numpy(
            SAMPLERS[kind]()(
                model,
                prompt,
                model.initial_cache(len(prompt)),
                MAX_LENGTH,
                prompt_lengths=lengths,
                end_token_id=END,
                seed=5,
            )
        )
        p_values = [
            chi_square_p_value(
                continuations(tokens[i * ROWS : (i + 1) * ROWS], len(p)),
                exact_distribution(TARGET, p, cut_of(kind)),
            )
            if follows
            else _p_value_or_zero(tokens[i * ROWS : (i + 1) * ROWS], p, kind)
            for i, p in enumerate(PROMPTS)
        ]
        if follows:
            assert min(p_values) > 1e-3
        else:
            assert max(p_values) < 1e-6


def _p_value_or_zero(rows, prompt, kind):
    """The draft's samples against the target's distribution (0 when the
    draft draws a sequence the target never would)."""
    expected = exact_distribution(TARGET, prompt, cut_of(kind))
    samples = continuations(rows, len(prompt))
    if any(key not in expected for key in samples):
        return 0.0
    return chi_square_p_value(samples, expected)


def test_the_distributions_are_the_samplers_cuts():
    logits = np.random.default_rng(3).normal(0, 2, (4, 3, VOCAB)).astype("float32")
    for kind, make in SAMPLERS.items():
        sampler = make()
        got = np.exp(to_numpy(sampler.distribution(sampler.compute_log_probs(logits))))
        want = np.apply_along_axis(cut_of(kind), -1, logits.astype("float64"))
        np.testing.assert_allclose(got, want, atol=1e-6)
    greedy = generation.GreedySampler().distribution(logits)
    np.testing.assert_array_equal(
        np.argmax(to_numpy(greedy), -1), np.argmax(logits, -1)
    )
    np.testing.assert_allclose(np.exp(to_numpy(greedy)).max(-1), 1.0)


def test_a_draft_equal_to_the_target_keeps_every_guess():
    """p == q: every guess is kept, so a round decides k + 1 tokens."""
    prompt, lengths = batch()
    k = 3
    _, stats = generation.speculative_sample(
        TARGET,
        generation.DraftModelProposer(TARGET, TARGET.initial_cache(len(prompt))),
        prompt,
        TARGET.initial_cache(len(prompt)),
        MAX_LENGTH + 1,
        sampler=generation.TopKSampler(k=3),
        seed=2,
        num_speculative_tokens=k,
        prompt_lengths=lengths,
        return_stats=True,
    )
    assert int(to_numpy(stats["target_calls"])) == 2  # ceil(5 / 4)
    new_tokens = to_numpy(stats["new_tokens"])
    np.testing.assert_array_equal(new_tokens, MAX_LENGTH + 1 - lengths)


def test_a_greedy_sampler_is_greedy_search():
    prompt, lengths = batch()
    prompt, lengths = prompt[::500], lengths[::500]
    want = generation.greedy_search(
        TARGET, prompt, TARGET.initial_cache(len(prompt)), MAX_LENGTH,
        prompt_lengths=lengths, end_token_id=END,
    )  # fmt: skip
    got = generation.speculative_sample(
        TARGET,
        generation.DraftModelProposer(DRAFT, DRAFT.initial_cache(len(prompt))),
        prompt,
        TARGET.initial_cache(len(prompt)),
        MAX_LENGTH,
        sampler=generation.GreedySampler(),
        prompt_lengths=lengths,
        end_token_id=END,
    )
    np.testing.assert_array_equal(to_numpy(got), to_numpy(want))


def test_beam_search_and_other_objects_are_refused():
    prompt, _ = batch()
    for sampler in (generation.BeamSampler(beam_width=2), "top_k"):
        with pytest.raises(ValueError, match="`sampler` must be"):
            generation.speculative_sample(
                TARGET,
                generation.PromptLookupProposer(),
                prompt,
                TARGET.initial_cache(len(prompt)),
                MAX_LENGTH,
                sampler=sampler,
            )
