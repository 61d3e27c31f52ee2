"""Function forms of the samplers: `greedy_search`, `beam_search`, `sample`."""

from __future__ import annotations

from keras_attn.generation.beam_sampler import BeamSampler
from keras_attn.generation.greedy_sampler import GreedySampler
from keras_attn.generation.random_sampler import RandomSampler
from keras_attn.generation.top_k_sampler import TopKSampler
from keras_attn.generation.top_p_sampler import TopPSampler


def greedy_search(
    next_fn,
    prompt,
    cache,
    max_length,
    *,
    prompt_lengths=None,
    end_token_id: int | None = None,
    pad_token_id: int = 0,
    output_length: int | None = None,
    prefill: bool = True,
    stop_token_ids=None,
):
    """Greedy decoding over a cache: the most probable token at every step.

    Args:
        next_fn: `(token_ids (B, T), cache, index) -> (logits, cache)`, see
            `keras_attn.generation.Sampler`.
        prompt: int `(B, T0)`, right-padded with `pad_token_id`.
        cache: initial cache nest with room for `output_length` positions.
        max_length: int or scalar int tensor, total length to stop at.
        prompt_lengths: optional int `(B,)`; defaults to `T0`.
        end_token_id: optional end token: a row stops after emitting it.
        pad_token_id: filler after the end token and past `max_length`.
        output_length: static width of the result (defaults to `max_length`).
        prefill: fill the cache for the prompt in one call first.
        stop_token_ids: optional list or tuple of more ids that end a row
            (keras-hub's name); combined with `end_token_id`.

    Returns:
        int32 tokens `(B, output_length)`: prompt, generated tokens, padding.

    Example:

    ```python
    tokens = keras_attn.generation.greedy_search(
        next_fn, prompt, cache, max_length=72, end_token_id=2
    )
    ```
    """
    return GreedySampler()(
        next_fn,
        prompt,
        cache,
        max_length,
        prompt_lengths=prompt_lengths,
        end_token_id=end_token_id,
        pad_token_id=pad_token_id,
        output_length=output_length,
        prefill=prefill,
        stop_token_ids=stop_token_ids,
    )


def beam_search(
    next_fn,
    prompt,
    cache,
    max_length,
    *,
    beam_width: int = 4,
    length_penalty: float = 0.0,
    prompt_lengths=None,
    end_token_id: int | None = None,
    pad_token_id: int = 0,
    output_length: int | None = None,
    prefill: bool = True,
    stop_token_ids=None,
):
    """Beam search with the GNMT length penalty; returns the best beam.

    Hypotheses are ranked by `log P / ((5 + length) / 6) ** length_penalty`,
    `length` counting the generated tokens with the end token. The cache
    leaves get `B * beam_width` rows (repeated after the prefill) and are
    reordered by parent beam at each step. See `BeamSampler`.

    Args:
        beam_width: positive int.
        length_penalty: GNMT `alpha >= 0` (0: plain log-probability).
        Other arguments as in `greedy_search`.

    Returns:
        `(best_tokens, best_score)`: int32 `(B, output_length)` and float32
        `(B,)`, the length-normalised log-probability of the generated tokens.

    Example:

    ```python
    tokens, scores = keras_attn.generation.beam_search(
        next_fn, start_tokens, cache, max_length=50, beam_width=4,
        length_penalty=0.6, end_token_id=2,
    )
    ```
    """
    return BeamSampler(beam_width=beam_width, length_penalty=length_penalty)(
        next_fn,
        prompt,
        cache,
        max_length,
        prompt_lengths=prompt_lengths,
        end_token_id=end_token_id,
        pad_token_id=pad_token_id,
        output_length=output_length,
        prefill=prefill,
        stop_token_ids=stop_token_ids,
    )


def sample(
    next_fn,
    prompt,
    cache,
    max_length,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed=None,
    prompt_lengths=None,
    end_token_id: int | None = None,
    pad_token_id: int = 0,
    output_length: int | None = None,
    prefill: bool = True,
    stop_token_ids=None,
):
    """Random sampling with temperature, optionally cut to top-k and/or top-p.

    `top_p` uses `TopPSampler` (with `top_k` as its pre-cut when both are
    given), `top_k` alone `TopKSampler`, neither `RandomSampler`.

    Args:
        temperature: positive float dividing the logits.
        top_k: optional positive int.
        top_p: optional float in (0, 1].
        seed: int or scalar int tensor; the same seed gives the same tokens.
            `None` draws a seed at call (trace) time.
        Other arguments as in `greedy_search`.

    Returns:
        int32 tokens `(B, output_length)`.

    Example:

    ```python
    tokens = keras_attn.generation.sample(
        next_fn, prompt, cache, max_length=72, top_p=0.9, temperature=0.8,
        seed=1234,
    )
    ```
    """
    if top_p is not None:
        sampler = TopPSampler(p=top_p, k=top_k, temperature=temperature)
    elif top_k is not None:
        sampler = TopKSampler(k=top_k, temperature=temperature)
    else:
        sampler = RandomSampler(temperature=temperature)
    return sampler(
        next_fn,
        prompt,
        cache,
        max_length,
        prompt_lengths=prompt_lengths,
        end_token_id=end_token_id,
        pad_token_id=pad_token_id,
        output_length=output_length,
        seed=seed,
        prefill=prefill,
        stop_token_ids=stop_token_ids,
    )
