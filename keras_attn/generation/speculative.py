"""Speculative decoding: several tokens per target forward pass.

A proposer guesses the next `k` tokens of every row (a small draft model
over its own KV cache, or n-gram matches in the row's own tokens: prompt
lookup); the target scores the last decided token and the `k` guesses in one
`next_fn` call (Leviathan et al. 2023, https://arxiv.org/abs/2211.17192;
Chen et al. 2023, https://arxiv.org/abs/2302.01318).

- Greedy (`speculative_greedy_search`): the guesses are kept up to the first
  one that differs from the target's own greedy choice, plus its choice
  there. The result equals greedy decoding token for token.
- Sampling (`speculative_sample`, with a `keras_attn.generation` sampler):
  the draft draws each guess `x` from its own distribution `q` (the
  sampler's cut and temperature over the draft's logits; prompt lookup's
  guesses are certain, `q(x) = 1`), and the target keeps it with
  probability `min(1, p(x) / q(x))`, `p` the sampler's distribution over the
  target's logits. At the first guess it does not keep it draws from
  `max(0, p - q)` renormalised, and after `k` kept guesses from `p`. Each
  token then follows `p` exactly: the output has the distribution of plain
  sampling with the same sampler (not its tokens for a seed).

Each row advances by its own number of kept tokens. The `next_fn`s take an
int32 `index` of shape `(B,)`, each row's own position (the layers'
per-row `cache_update_index`); positions past a row's last kept token hold
stale keys and values that the causal mask hides until they are written
again, so rolling a cache back is moving the row's index.
"""

from __future__ import annotations

from keras import ops

from keras_attn import _validation as v
from keras_attn.generation.beam_sampler import BeamSampler
from keras_attn.generation.greedy_sampler import GreedySampler
from keras_attn.generation.sampler import (
    CUT,
    Sampler,
    check_token_id,
    is_stop_token,
    last_step_logits,
    prepare_prompt,
    resolve_lengths,
    resolve_stop_token_ids,
)
from keras_attn.ops import counter_random


def _gather_rows(tokens, positions):
    """`tokens[b, positions[b, j]]`, `positions` clipped into the buffer."""
    width = ops.shape(tokens)[1]
    return ops.take_along_axis(tokens, ops.clip(positions, 0, width - 1), axis=1)


def _argmax(logits):
    return ops.cast(ops.argmax(ops.cast(logits, "float32"), axis=-1), "int32")


def _categorical(log_probs, seed):
    """One draw from each distribution of `log_probs` `(B, n, V)`: `(B, n)`
    (with a seed per row, each of a row's `n` draws from its own stream)."""
    shape = ops.shape(log_probs)
    flat = ops.reshape(log_probs, (-1, shape[-1]))
    if counter_random.row_seeds(seed):
        positions = ops.arange(shape[1], dtype="int32")[None, :]  # (1, n)
        seed = ops.reshape(counter_random.step_seed(seed[:, None], positions), (-1,))
    return ops.reshape(counter_random.categorical(flat, seed), (shape[0], shape[1]))


class _Draws:
    """What a round draws: the sampler's distribution of logits, and one
    seed per purpose (the draft's `j`-th guess, the acceptance tests, the
    corrections), each a fresh stream of the call's seed and the round."""

    def __init__(self, sampler, seed, round_index):
        self.sampler = sampler
        self.seed = counter_random.step_seed(seed, round_index)

    def seed_for(self, purpose):
        return counter_random.step_seed(self.seed, purpose)

    def log_probs(self, logits):
        sampler = self.sampler
        return sampler.distribution(sampler.compute_log_probs(logits))


class DraftModelProposer:
    """Guesses from a draft model: `k` steps over its own cache, `k` calls.

    `draft_next_fn` follows the `next_fn` contract with a per-row `(B,)`
    index. Each round's first call feeds the row's last two decided tokens
    (after a round that kept every guess neither is in the draft's cache:
    its last guess was never fed; after any other round the first is, and
    is written again), then one guess per call.
    """

    def __init__(self, draft_next_fn, draft_cache):
        self.draft_next_fn = draft_next_fn
        self.initial_cache = draft_cache

    def prefill(self, prompt, state):
        if prompt.shape[1] == 1:
            return state
        _, cache = self.draft_next_fn(prompt, state, ops.convert_to_tensor(0, "int32"))
        return cache

    def propose(self, tokens, last, k, state, draws=None):
        """`(guesses (B, k), their distributions (B, k, V) or None, state)`:
        greedy guesses without `draws`, else each drawn from the draft's
        distribution."""
        # Positions `start, start + 1`: the last two decided tokens (a row
        # with one decided token feeds it and a position written next).
        start = ops.maximum(last - 1, 0)
        inputs = _gather_rows(tokens, start[:, None] + ops.arange(2)[None, :])
        guesses, distributions = [], []
        cache = state
        for step in range(k):
            if step == 0:
                logits, cache = self.draft_next_fn(inputs, cache, start)  # (B, 2, V)
                logits = ops.take_along_axis(
                    logits, (last - start)[:, None, None], axis=1
                )[:, 0]
            else:
                logits, cache = self.draft_next_fn(inputs, cache, last + step)
                logits = last_step_logits(logits)
            if draws is None:
                guess = _argmax(logits)  # (B,)
            else:
                log_q = draws.log_probs(logits)  # (B, V)
                guess = counter_random.categorical(log_q, draws.seed_for(step))
                distributions.append(log_q)
            guesses.append(guess)
            inputs = guess[:, None]
        q = ops.stack(distributions, axis=1) if distributions else None
        return ops.stack(guesses, axis=1), q, cache


class PromptLookupProposer:
    """Guesses copied from the row itself (prompt-lookup decoding, Saxena
    2023): the `k` tokens that followed the latest earlier occurrence of the
    row's last `ngram_size` tokens. Without a match the guesses repeat the
    last token (the target corrects them). No model, no cache. With a
    sampler the guesses are certain (`q(x) = 1`): each is kept with the
    target's probability of it."""

    def __init__(self, ngram_size: int = 3):
        self.ngram_size = v.check_positive_int("ngram_size", ngram_size)
        self.initial_cache = ()

    def prefill(self, prompt, state):
        return state

    def propose(self, tokens, last, k, state, draws=None):
        """`(guesses (B, k), None, state)`: certain guesses."""
        g = self.ngram_size
        width = tokens.shape[1]
        n = last + 1  # (B,) decided tokens
        # The row's last g tokens, and every window of g tokens of the buffer.
        suffix = _gather_rows(tokens, n[:, None] - g + ops.arange(g)[None, :])  # (B, g)
        starts = ops.arange(width, dtype="int32")  # (L,)
        matched = ops.ones((ops.shape(tokens)[0], width), dtype="bool")
        for j in range(g):
            shifted = _gather_rows(
                tokens, starts[None, :] + j + ops.zeros_like(n)[:, None]
            )
            matched = ops.logical_and(matched, ops.equal(shifted, suffix[:, j : j + 1]))
        # A match must lie inside the decided tokens and end before the suffix.
        matched = ops.logical_and(matched, starts[None, :] + g < n[:, None])
        matched = ops.logical_and(matched, (n >= g)[:, None])
        latest = ops.max(ops.where(matched, starts[None, :], -1), axis=1)  # (B,)
        found = latest >= 0
        follow = latest[:, None] + g + ops.arange(k, dtype="int32")[None, :]  # (B, k)
        copied = _gather_rows(tokens, ops.minimum(follow, last[:, None]))
        repeat = _gather_rows(tokens, last[:, None]) + ops.zeros_like(copied)
        return ops.where(found[:, None], copied, repeat), None, state


def _greedy_choice(logits, guesses):
    """The target's argmax after each block position, and how many guesses
    agree with it (up to the first that does not)."""
    choice = _argmax(logits)  # (B, k+1)
    k = guesses.shape[1]
    agree = ops.cast(ops.equal(guesses, choice[:, :k]), "int32")
    return choice, ops.sum(ops.cumprod(agree, axis=1), axis=1)


def _sampled_choice(logits, guesses, log_q, draws):
    """Speculative sampling's tokens for each block position and how many
    guesses are kept: guess `j` is kept with probability
    `min(1, p_j(x_j) / q_j(x_j))` while every earlier one was; position `j`
    holds the kept guess, or a draw from `max(0, p_j - q_j)` renormalised
    (from `p_k` after `k` kept guesses)."""
    k = guesses.shape[1]
    log_p = draws.log_probs(logits)  # (B, k+1, V)
    p = ops.exp(log_p)
    vocab_size = ops.shape(log_p)[-1]
    if log_q is None:  # certain guesses
        q = ops.one_hot(guesses, vocab_size, dtype="float32")  # (B, k, V)
    else:
        q = ops.exp(log_q)
    p_guess = ops.take_along_axis(p[:, :k], guesses[..., None], axis=-1)[..., 0]
    q_guess = ops.take_along_axis(q, guesses[..., None], axis=-1)[..., 0]
    u = counter_random.uniform(draws.seed_for(k), (ops.shape(guesses)[0], k))
    accept = ops.cast(ops.less(u * q_guess, p_guess), "int32")  # (B, k)
    accepted = ops.sum(ops.cumprod(accept, axis=1), axis=1)  # (B,)
    residual = ops.maximum(p[:, :k] - q, 0.0)  # (B, k, V)
    # Where p <= q everywhere (p == q) the guess is always kept and the
    # residual is never drawn from: `p` stands in for it.
    empty = ops.sum(residual, axis=-1, keepdims=True) <= 0.0
    residual = ops.where(empty, p[:, :k], residual)
    corrections = ops.concatenate(
        [ops.where(residual > 0.0, ops.log(ops.maximum(residual, 1e-30)), CUT),
         log_p[:, k:]],
        axis=1,
    )  # (B, k+1, V)  # fmt: skip
    drawn = _categorical(corrections, draws.seed_for(k + 1))  # (B, k+1)
    steps = ops.arange(k + 1, dtype="int32")[None, :]
    padded = ops.concatenate([guesses, guesses[:, :1]], axis=1)  # (B, k+1)
    choice = ops.where(steps < accepted[:, None], padded, drawn)
    return choice, accepted


def speculative_greedy_search(
    next_fn,
    proposer,
    prompt,
    cache,
    max_length,
    *,
    num_speculative_tokens: int = 4,
    prompt_lengths=None,
    end_token_id: int | None = None,
    stop_token_ids=None,
    pad_token_id: int = 0,
    output_length: int | None = None,
    return_stats: bool = False,
):
    """Greedy decoding with guesses from `proposer`, checked `k` at a time.

    Args:
        next_fn: the target's `(token_ids, cache, index) -> (logits, cache)`
            (see `keras_attn.generation.sampler`), taking an int32 `index`
            of shape `(B,)` (each row's position) and returning logits
            `(B, T, vocab)` for every input position.
        proposer: a `DraftModelProposer` or a `PromptLookupProposer`.
        prompt, cache, max_length, prompt_lengths, end_token_id,
            stop_token_ids, pad_token_id, output_length: as in
            `keras_attn.generation.Sampler`.
        num_speculative_tokens: `k`, the guesses checked per target call.
        return_stats: also return a dict of int32 counts: `target_calls`
            (scalar, the loop's rounds), and per row `row_calls` (the rounds
            the row took part in) and `new_tokens`; a row's acceptance rate
            is `(new_tokens / row_calls - 1) / k`.

    Returns:
        int32 tokens `(B, output_length)`, the same as greedy search's.
    """
    return _speculative_loop(
        next_fn, proposer, prompt, cache, max_length, None, None,
        num_speculative_tokens, prompt_lengths, end_token_id, stop_token_ids,
        pad_token_id, output_length, return_stats,
    )  # fmt: skip


def speculative_sample(
    next_fn,
    proposer,
    prompt,
    cache,
    max_length,
    *,
    sampler,
    seed=None,
    num_speculative_tokens: int = 4,
    prompt_lengths=None,
    end_token_id: int | None = None,
    stop_token_ids=None,
    pad_token_id: int = 0,
    output_length: int | None = None,
    return_stats: bool = False,
):
    """Speculative sampling: the distribution of `sampler`'s plain decoding
    in fewer `next_fn` calls.

    Args:
        sampler: a `keras_attn.generation` sampler (`RandomSampler`,
            `TopKSampler`, `TopPSampler`, ...: its `distribution`, over the
            temperature-scaled logits, is what the target's tokens follow and
            what a draft model draws its guesses from). A `GreedySampler` is
            `speculative_greedy_search`; a `BeamSampler` is refused.
        seed: int or scalar int tensor, or one seed per row (a `(B,)` int
            tensor or a list of ints: a row's draws depend on its own seed
            only) (default: the sampler's seed, else a random one): the
            same seed gives the same tokens. They are not
            the tokens plain sampling draws for that seed.
        The other arguments are `speculative_greedy_search`'s.

    Returns:
        int32 tokens `(B, output_length)`.
    """
    if not isinstance(sampler, Sampler) or isinstance(sampler, BeamSampler):
        raise ValueError(
            "`sampler` must be a keras_attn.generation sampler that draws one "
            f"token per row (not beam search). Received: sampler={sampler!r}"
        )
    if type(sampler) is GreedySampler:
        sampler = None
    else:
        seed = counter_random.seed_tensor(sampler.seed if seed is None else seed)
        counter_random.check_row_seeds(seed, ops.shape(prompt)[0])
    return _speculative_loop(
        next_fn, proposer, prompt, cache, max_length, sampler, seed,
        num_speculative_tokens, prompt_lengths, end_token_id, stop_token_ids,
        pad_token_id, output_length, return_stats,
    )  # fmt: skip


def _speculative_loop(
    next_fn, proposer, prompt, cache, max_length, sampler, seed,
    num_speculative_tokens, prompt_lengths, end_token_id, stop_token_ids,
    pad_token_id, output_length, return_stats,
):  # fmt: skip
    """The decoding loop of both: greedy without `sampler`."""
    k = v.check_positive_int("num_speculative_tokens", num_speculative_tokens)
    pad_token_id = check_token_id("pad_token_id", pad_token_id)
    stop_ids = resolve_stop_token_ids(end_token_id, stop_token_ids)
    output_length, max_length = resolve_lengths(max_length, output_length)
    prompt, tokens, lengths = prepare_prompt(
        prompt, prompt_lengths, pad_token_id, output_length
    )
    zero = ops.convert_to_tensor(0, "int32")
    if prompt.shape[1] != 1:
        _, cache = next_fn(prompt, cache, zero)
    draft_state = proposer.prefill(prompt, proposer.initial_cache)
    decided = ops.minimum(lengths, max_length)  # (B,) tokens decided
    done = decided >= max_length
    positions = ops.arange(output_length, dtype="int32")[None, :]  # (1, L)
    steps = ops.arange(k + 1, dtype="int32")[None, :]  # (1, k+1)

    def cond(tokens, decided, done, cache, draft_state, calls, row_calls):
        return ops.logical_not(ops.all(done))

    def body(tokens, decided, done, cache, draft_state, calls, row_calls):
        last = decided - 1  # (B,) position of the last decided token
        draws = None if sampler is None else _Draws(sampler, seed, calls)
        guesses, log_q, draft_state = proposer.propose(
            tokens, last, k, draft_state, draws
        )
        block = ops.concatenate([_gather_rows(tokens, last[:, None]), guesses], axis=1)
        logits, cache = next_fn(block, cache, last)  # (B, k+1, V)
        if draws is None:
            choice, accepted = _greedy_choice(logits, guesses)
        else:
            choice, accepted = _sampled_choice(logits, guesses, log_q, draws)
        # choice (B, k+1): the token at each block position after the
        # accepted guesses' own; `accepted + 1` of them are decided.
        kept = ops.minimum(accepted + 1, max_length - decided)  # (B,) in 1..k+1
        if stop_ids:  # keep up to the first stop token
            stop = ops.logical_and(
                is_stop_token(choice, stop_ids), steps < kept[:, None]
            )
            first_stop = ops.min(ops.where(stop, steps, k + 1), axis=1)
            ended = first_stop <= k
            kept = ops.minimum(kept, first_stop + 1)
        kept = ops.where(done, 0, kept)
        offsets = positions - decided[:, None]  # (B, L)
        write = ops.logical_and(offsets >= 0, offsets < kept[:, None])
        tokens = ops.where(write, _gather_rows(choice, offsets), tokens)
        new_done = decided + kept >= max_length
        if stop_ids:
            new_done = ops.logical_or(new_done, ops.logical_and(ended, kept > 0))
        return (
            tokens,
            decided + kept,
            ops.logical_or(done, new_done),
            cache,
            draft_state,
            calls + 1,
            row_calls + ops.cast(ops.logical_not(done), "int32"),
        )

    tokens, decided, _, _, _, calls, row_calls = ops.while_loop(
        cond,
        body,
        (tokens, decided, done, cache, draft_state, zero, ops.zeros_like(lengths)),
    )
    if return_stats:
        return tokens, {
            "target_calls": calls,
            "row_calls": row_calls,
            "new_tokens": decided - lengths,
        }
    return tokens
