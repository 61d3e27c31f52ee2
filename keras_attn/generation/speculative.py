"""Speculative greedy decoding: several tokens per target forward pass.

A proposer guesses the next `k` tokens of every row (a small draft model
over its own KV cache, or n-gram matches in the row's own tokens: prompt
lookup); the target scores the last decided token and the `k` guesses in one
`next_fn` call and keeps the guesses up to the first one that differs from
its own greedy choice, plus its own choice there (Leviathan et al. 2023,
https://arxiv.org/abs/2211.17192). The result equals greedy decoding token
for token: every kept token is the target's argmax after the tokens before
it.

Each row advances by its own number of kept tokens. The `next_fn`s take an
int32 `index` of shape `(B,)`, each row's own position (the layers'
per-row `cache_update_index`); positions past a row's last kept token hold
stale keys and values that the causal mask hides until they are written
again, so rolling a cache back is moving the row's index.
"""

from __future__ import annotations

from keras import ops

from keras_attn import _validation as v
from keras_attn.generation.sampler import (
    check_token_id,
    is_stop_token,
    last_step_logits,
    prepare_prompt,
    resolve_lengths,
    resolve_stop_token_ids,
)


def _gather_rows(tokens, positions):
    """`tokens[b, positions[b, j]]`, `positions` clipped into the buffer."""
    width = ops.shape(tokens)[1]
    return ops.take_along_axis(tokens, ops.clip(positions, 0, width - 1), axis=1)


def _argmax(logits):
    return ops.cast(ops.argmax(ops.cast(logits, "float32"), axis=-1), "int32")


class DraftModelProposer:
    """Guesses from a draft model: `k` greedy steps over its own cache.

    `draft_next_fn` follows the `next_fn` contract with a per-row `(B,)`
    index. Each round feeds the last decided token and then its own guesses,
    one per call, and writes the last guess too (one more call), so the
    draft cache holds every position up to the block the target checks.
    """

    def __init__(self, draft_next_fn, draft_cache):
        self.draft_next_fn = draft_next_fn
        self.initial_cache = draft_cache

    def prefill(self, prompt, state):
        if prompt.shape[1] == 1:
            return state
        _, cache = self.draft_next_fn(prompt, state, ops.convert_to_tensor(0, "int32"))
        return cache

    def propose(self, tokens, last, k, state):
        inputs = _gather_rows(tokens, last[:, None])  # (B, 1)
        guesses = []
        cache = state
        for step in range(k):
            logits, cache = self.draft_next_fn(inputs, cache, last + step)
            guess = _argmax(last_step_logits(logits))  # (B,)
            guesses.append(guess)
            inputs = guess[:, None]
        _, cache = self.draft_next_fn(inputs, cache, last + k)
        return ops.stack(guesses, axis=1), cache


class PromptLookupProposer:
    """Guesses copied from the row itself (prompt-lookup decoding, Saxena
    2023): the `k` tokens that followed the latest earlier occurrence of the
    row's last `ngram_size` tokens. Without a match the guesses repeat the
    last token (the target corrects them). No model, no cache."""

    def __init__(self, ngram_size: int = 3):
        self.ngram_size = v.check_positive_int("ngram_size", ngram_size)
        self.initial_cache = ()

    def prefill(self, prompt, state):
        return state

    def propose(self, tokens, last, k, state):
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
        return ops.where(found[:, None], copied, repeat), state


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
        return_stats: also return `{"target_calls": (), "new_tokens": (B,)}`
            (scalar and per-row int32 counts; the acceptance rate is
            `new_tokens / target_calls - 1` over `k`).

    Returns:
        int32 tokens `(B, output_length)`, the same as greedy search's.
    """
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

    def cond(tokens, decided, done, cache, draft_state, calls):
        return ops.logical_not(ops.all(done))

    def body(tokens, decided, done, cache, draft_state, calls):
        last = decided - 1  # (B,) position of the last decided token
        guesses, draft_state = proposer.propose(tokens, last, k, draft_state)
        block = ops.concatenate([_gather_rows(tokens, last[:, None]), guesses], axis=1)
        logits, cache = next_fn(block, cache, last)  # (B, k+1, V)
        choice = _argmax(logits)  # (B, k+1): the target's token after each
        agree = ops.cast(ops.equal(guesses, choice[:, :k]), "int32")
        kept = ops.sum(ops.cumprod(agree, axis=1), axis=1) + 1  # (B,) in 1..k+1
        kept = ops.minimum(kept, max_length - decided)
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
        )

    tokens, decided, _, _, _, calls = ops.while_loop(
        cond, body, (tokens, decided, done, cache, draft_state, zero)
    )
    if return_stats:
        return tokens, {"target_calls": calls, "new_tokens": decided - lengths}
    return tokens
