"""`BeamSampler`: batched beam search with the GNMT length penalty."""

from __future__ import annotations

import numbers

import keras
from keras import ops

from keras_attn import _validation as v
from keras_attn.generation import sampler as base

# Score of an empty slot (a dead beam, no finished hypothesis yet). Finite, so
# sums never meet inf - inf; anything below `_NEG / 2` counts as empty.
_NEG = -1e9


def length_penalty(length, alpha: float):
    """GNMT length penalty `((5 + length) / 6) ** alpha` (Wu et al., 2016).

    Beam search ranks a hypothesis by `log P(Y | X) / length_penalty(|Y|)`;
    `alpha=0` gives the plain log-probability, larger `alpha` favours longer
    outputs. `length` counts the generated tokens, the end token included.
    """
    length = ops.cast(length, "float32")
    if alpha == 0:
        return ops.ones_like(length)
    return ops.power((5.0 + length) / 6.0, alpha)


@keras.saving.register_keras_serializable(package="keras_attn")
class BeamSampler(base.Sampler):
    """Beam search over a cache, batched: `batch * beam_width` rows per step.

    At each step every live beam proposes its continuations; the
    `2 * beam_width` best (by summed log-probability) are kept. Those ending
    with `end_token_id` and ranked among the `beam_width` best join the
    finished hypotheses, scored `log P / length_penalty(generated length,
    alpha)` (an end candidate ranked lower would not have been a beam: it is
    dropped, as in Hugging Face's beam search, so that width 1 is greedy
    search); the `beam_width` best candidates that did not end stay alive,
    and the cache rows are reordered to follow their
    parent beams (`ops.take` on axis 0 of every cache tensor, which holds
    `batch * beam_width` rows). A row stops once its best finished score beats
    what any live beam could still reach (`log P / length_penalty(max)`, an
    exact bound for `alpha >= 0`; with `return_all_beams`, once its worst
    finished score does); the loop ends when every row has stopped or
    `max_length` is reached, when the live beams join the candidates.

    The prompt is prefilled once per sequence, before the cache is repeated
    `beam_width` times; rows with longer prompts follow their prompt as in
    `Sampler`. With `beam_width=1` and `alpha=0` this is greedy search.

    Args:
        beam_width: positive int, the number of live beams per sequence.
        length_penalty: the GNMT `alpha >= 0`.
        return_all_beams: return every finished beam (best first) instead of
            the best one.
        temperature: positive float applied to the logits (1 by default).

    Call arguments:
        As `Sampler` (`next_fn`, `prompt`, `cache`, `max_length`,
        `prompt_lengths`, `end_token_id`, `pad_token_id`, `output_length`,
        `prefill`, `stop_token_ids`), without `seed`.

    Returns:
        `(tokens, scores)`: int32 tokens `(B, output_length)` of the best
        hypothesis (prompt, generated tokens, end token, then `pad_token_id`)
        and its float32 score `(B,)`, the length-normalised log-probability
        of the generated tokens. With `return_all_beams=True`: tokens
        `(B, beam_width, output_length)` and scores `(B, beam_width)`, sorted
        best first, `-inf` for slots with no hypothesis.

    Example:

    ```python
    sampler = keras_attn.generation.BeamSampler(beam_width=4, length_penalty=0.6)
    tokens, scores = sampler(next_fn, start_tokens, cache, max_length=50,
                             end_token_id=2)
    ```
    """

    def __init__(
        self,
        beam_width: int = 4,
        length_penalty: float = 0.0,
        return_all_beams: bool = False,
        temperature: float = 1.0,
    ):
        super().__init__(temperature=temperature)
        self.beam_width = v.check_positive_int("beam_width", beam_width)
        if (
            isinstance(length_penalty, bool)
            or not isinstance(length_penalty, numbers.Real)
            or length_penalty < 0
        ):
            raise ValueError(
                "`length_penalty` (alpha) must be a float >= 0. "
                f"Received: length_penalty={length_penalty!r}"
            )
        self.length_penalty = float(length_penalty)
        if not isinstance(return_all_beams, bool):
            raise ValueError(
                "`return_all_beams` must be a bool. "
                f"Received: return_all_beams={return_all_beams!r}"
            )
        self.return_all_beams = return_all_beams

    def get_next_token(self, log_probs, seed):  # pragma: no cover - unused
        raise NotImplementedError("BeamSampler chooses beams in `__call__`.")

    def __call__(
        self,
        next_fn,
        prompt,
        cache,
        max_length,
        *,
        prompt_lengths=None,
        end_token_id: int | None = None,
        pad_token_id: int = 0,
        output_length: int | None = None,
        seed=None,
        prefill: bool = True,
        stop_token_ids=None,
    ):
        del seed  # deterministic
        stop_ids = base.resolve_stop_token_ids(end_token_id, stop_token_ids)
        state = self.start(
            next_fn,
            prompt,
            cache,
            max_length,
            prompt_lengths=prompt_lengths,
            pad_token_id=pad_token_id,
            output_length=output_length,
            prefill=prefill,
        )
        state = self.decode(next_fn, state, stop_ids=stop_ids)
        return self.result(state, stop_ids=stop_ids)

    # -- the loop in parts (see `Sampler.start`) ---------------------------------

    def start(
        self,
        next_fn,
        prompt,
        cache,
        max_length,
        *,
        prompt_lengths=None,
        pad_token_id: int = 0,
        output_length: int | None = None,
        seed=None,
        prefill: bool = True,
    ) -> dict:
        """The search's state before its first step: the prompt prefilled,
        the cache repeated for the beams, only beam 0 alive."""
        del seed  # deterministic
        width = self.beam_width
        pad_token_id = base.check_token_id("pad_token_id", pad_token_id)
        output_length, max_length = base.resolve_lengths(max_length, output_length)
        prompt, tokens, lengths = base.prepare_prompt(
            prompt, prompt_lengths, pad_token_id, output_length
        )
        cache = base.run_prefill(next_fn, prompt, cache, prefill)
        index = base.start_index(lengths, prefill)

        def to_beams(x):  # (B, ...) -> (B * W, ...), rows b * W + w
            return ops.repeat(x, width, axis=0)

        cache = base.map_cache(to_beams, cache)
        batch_size = ops.shape(tokens)[0]
        sequences = ops.reshape(
            to_beams(tokens), (-1, width, output_length)
        )  # (B, W, L)
        inputs = ops.reshape(
            ops.take(to_beams(tokens), index, axis=1), (-1, 1)
        )  # (B*W, 1)
        # Only beam 0 is live at first: the others would repeat it.
        alive_log_probs = ops.broadcast_to(
            ops.convert_to_tensor([[0.0] + [_NEG] * (width - 1)], "float32"),
            (batch_size, width),
        )  # (B, W)
        finished = sequences  # (B, W, L), contents unused while scores are empty
        finished_scores = ops.full((batch_size, width), _NEG, dtype="float32")
        return {
            "sequences": sequences,
            "inputs": inputs,
            "cache": cache,
            "index": index,
            "alive": alive_log_probs,
            "finished": finished,
            "scores": finished_scores,
            "tokens": tokens,
            "lengths": lengths,
            "max_length": max_length,
        }

    def _bound(self, state):
        """`length_penalty` of the most tokens a row may still generate."""
        max_generated = ops.cast(state["max_length"] - state["lengths"], "float32")
        return length_penalty(max_generated, self.length_penalty)  # (B,)

    def _searching(self, index, alive, scores, max_length, bound, stop_ids, until=None):
        going = ops.less(index, max_length - 1)
        if until is not None:
            going = ops.logical_and(going, ops.less(index, until))
        if not stop_ids:
            return going
        best_alive = ops.max(alive, axis=-1) / bound  # (B,)
        # The best beam is settled once it beats every live beam's bound;
        # all beams once the worst finished one does.
        settled = ops.min if self.return_all_beams else ops.max
        row_done = ops.greater_equal(settled(scores, axis=-1), best_alive)
        return ops.logical_and(going, ops.logical_not(ops.all(row_done)))

    def running(self, state, *, stop_ids: tuple = (), until=None):
        return self._searching(
            state["index"],
            state["alive"],
            state["scores"],
            state["max_length"],
            self._bound(state),
            stop_ids,
            until,
        )

    def decode(
        self, next_fn, state, *, stop_ids: tuple = (), pad_token_id: int = 0, until=None
    ) -> dict:
        width = self.beam_width
        alpha = self.length_penalty
        tokens, lengths = state["tokens"], state["lengths"]
        max_length = state["max_length"]
        best_possible_penalty = self._bound(state)  # (B,)
        batch_size = ops.shape(tokens)[0]
        row_offsets = ops.arange(batch_size, dtype="int32")[:, None] * width  # (B,1)

        def cond(sequences, inputs, cache, index, alive, finished, scores):
            return self._searching(
                index, alive, scores, max_length, best_possible_penalty, stop_ids, until
            )

        def body(sequences, inputs, cache, index, alive, finished, scores):
            logits, cache = next_fn(inputs, cache, index)
            log_probs = self.compute_log_probs(base.last_step_logits(logits))
            vocab_size = log_probs.shape[-1]
            log_probs = ops.reshape(log_probs, (-1, width, vocab_size))  # (B, W, V)
            position = index + 1
            in_prompt = ops.less(position, lengths)  # (B,)
            prompt_token = ops.take(tokens, position, axis=1)  # (B,)
            forced = ops.where(
                ops.equal(
                    ops.arange(vocab_size, dtype="int32")[None, :],
                    prompt_token[:, None],
                ),
                0.0,
                _NEG,
            )  # (B, V): the prompt token only, at no cost
            log_probs = ops.where(
                in_prompt[:, None, None], forced[:, None, :], log_probs
            )
            candidates = ops.reshape(
                alive[..., None] + log_probs, (-1, width * vocab_size)
            )  # (B, W*V)
            k = min(2 * width, width * vocab_size)
            cand_log_probs, cand_ids = base.top_k(candidates, k)
            cand_beams = ops.cast(cand_ids // vocab_size, "int32")  # (B, 2W)
            cand_tokens = ops.cast(cand_ids % vocab_size, "int32")  # (B, 2W)
            cand_sequences = ops.take_along_axis(
                sequences, cand_beams[..., None], axis=1
            )  # (B, 2W, L)
            cand_sequences = base.write_column(cand_sequences, position, cand_tokens)
            valid = ops.greater(cand_log_probs, _NEG / 2)
            if not stop_ids:
                ended = ops.zeros_like(valid)
            else:
                ended = ops.logical_and(
                    base.is_stop_token(cand_tokens, stop_ids),
                    ops.logical_not(in_prompt)[:, None],
                )  # (B, 2W)
            # An ended candidate finishes only if it is among the W best of
            # the step (it would have been a beam): width 1 is greedy search.
            top_ranks = ops.less(ops.arange(k, dtype="int32"), width)[None, :]
            finishing = ops.logical_and(ops.logical_and(ended, valid), top_ranks)

            # The live beams: the best candidates that did not end.
            alive, pick = base.top_k(
                ops.where(ended, 2 * _NEG, cand_log_probs), width
            )  # (B, W)
            parents = ops.take_along_axis(cand_beams, pick, axis=1)  # (B, W)
            sequences = ops.take_along_axis(cand_sequences, pick[..., None], axis=1)
            inputs = ops.reshape(
                ops.take_along_axis(cand_tokens, pick, axis=1), (-1, 1)
            )  # (B*W, 1)
            rows = ops.reshape(row_offsets + parents, (-1,))  # (B*W,)
            cache = base.map_cache(lambda x: ops.take(x, rows, axis=0), cache)

            # The finished hypotheses: the best of the old and the new.
            if stop_ids:
                generated = position + 1 - lengths  # (B,)
                penalty = length_penalty(generated, alpha)[:, None]  # (B, 1)
                new_scores = ops.where(finishing, cand_log_probs / penalty, _NEG)
                finished, scores = _merge(
                    finished, scores, cand_sequences, new_scores, width
                )
            return sequences, inputs, cache, position, alive, finished, scores

        names = ("sequences", "inputs", "cache", "index", "alive", "finished", "scores")
        found = ops.while_loop(cond, body, tuple(state[name] for name in names))
        return {**state, **dict(zip(names, found, strict=True))}

    def result(self, state, *, stop_ids: tuple = ()):
        """`__call__`'s `(tokens, scores)` of a finished state: the live beams
        that reached `max_length` join the finished hypotheses."""
        width = self.beam_width
        index, alive = state["index"], state["alive"]
        # Live beams that reached max_length are complete hypotheses too.
        reached_end = ops.greater_equal(index, state["max_length"] - 1)
        final_penalty = length_penalty(
            index + 1 - state["lengths"], self.length_penalty
        )[:, None]  # (B, 1)
        alive_scores = ops.where(
            ops.logical_and(reached_end, ops.greater(alive, _NEG / 2)),
            alive / final_penalty,
            _NEG,
        )
        finished, scores = _merge(
            state["finished"], state["scores"], state["sequences"], alive_scores, width
        )
        scores = ops.where(ops.greater(scores, _NEG / 2), scores, float("-inf"))
        if self.return_all_beams:
            return finished, scores
        return finished[:, 0], scores[:, 0]

    def decided_tokens(self, state, *, stop_ids: tuple = ()):
        """The tokens decided so far, which only greedy search has before the
        end (`beam_width=1`, `length_penalty=0`, one hypothesis): the live
        beam while the search goes on, the result once it has ended. A wider
        search, or a length penalty, may still prefer another hypothesis:
        a `ValueError`."""
        if self.beam_width != 1 or self.length_penalty != 0 or self.return_all_beams:
            raise ValueError(
                "Only greedy search (beam_width=1, length_penalty=0) decides its "
                "tokens before the search ends. Received: "
                f"beam_width={self.beam_width}, length_penalty={self.length_penalty}"
                f", return_all_beams={self.return_all_beams}"
            )
        tokens, _ = self.result(state, stop_ids=stop_ids)
        going = self.running(state, stop_ids=stop_ids)
        return ops.where(going, state["sequences"][:, 0], tokens)

    def get_config(self) -> dict:
        return {
            "beam_width": self.beam_width,
            "length_penalty": self.length_penalty,
            "return_all_beams": self.return_all_beams,
            "temperature": self.temperature,
        }


def _merge(sequences, scores, new_sequences, new_scores, width: int):
    """The `width` best of two sets of scored hypotheses, best first."""
    all_scores = ops.concatenate([scores, new_scores], axis=1)  # (B, n)
    all_sequences = ops.concatenate([sequences, new_sequences], axis=1)  # (B, n, L)
    scores, pick = base.top_k(all_scores, width)  # (B, W)
    sequences = ops.take_along_axis(all_sequences, pick[..., None], axis=1)
    return sequences, scores
