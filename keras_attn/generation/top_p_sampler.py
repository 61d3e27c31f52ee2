"""`TopPSampler`: nucleus sampling."""

from __future__ import annotations

import numbers

import keras
from keras import ops

from keras_attn import _validation as v
from keras_attn.generation.sampler import CUT, Sampler, keep_most_probable, top_k
from keras_attn.ops import counter_random


@keras.saving.register_keras_serializable(package="keras_attn")
class TopPSampler(Sampler):
    """Top-p (nucleus) sampling (Holtzman et al., 2019).

    Draws from the smallest set of most probable tokens whose probabilities
    sum to at least `p` (the most probable token is always kept, so a tiny `p`
    is greedy search), renormalised.

    Args:
        p: float in (0, 1].
        k: optional int: only the `k` most probable tokens are sorted and
            considered (faster over large vocabularies).
        temperature: positive float, applied before the cut.
        seed: default seed (int or `None`); the call's `seed` overrides it.

    Example:

    ```python
    sampler = keras_attn.generation.TopPSampler(p=0.9)
    tokens = sampler(next_fn, prompt, cache, max_length=32, seed=7)
    ```
    """

    def __init__(
        self,
        p: float = 0.9,
        k: int | None = None,
        temperature: float = 1.0,
        seed: int | None = None,
    ):
        super().__init__(temperature=temperature, seed=seed)
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 < p <= 1:
            raise ValueError(f"`p` must be a float in (0, 1]. Received: p={p!r}")
        self.p = float(p)
        self.k = v.check_positive_int("k", k, allow_none=True)

    def _nucleus(self, log_probs):
        """`(sorted log-probabilities, their tokens, which are kept)`, each
        `(..., n)`, best first, over the `n` tokens considered."""
        vocab_size = log_probs.shape[-1]
        if vocab_size is None:
            vocab_size = ops.shape(log_probs)[-1]
        cutoff = vocab_size if self.k is None else min(self.k, vocab_size)
        sorted_log_probs, sorted_indices = top_k(log_probs, cutoff)  # (..., n)
        probs = ops.exp(sorted_log_probs)
        # Mass strictly before each token: keep while it is below p.
        mass_before = ops.cumsum(probs, axis=-1) - probs
        keep = ops.less(mass_before, self.p)
        keep = ops.concatenate(
            [ops.ones_like(keep[..., :1]), keep[..., 1:]], axis=-1
        )  # the most probable token is always kept
        return sorted_log_probs, sorted_indices, keep

    def get_next_token(self, log_probs, seed):
        sorted_log_probs, sorted_indices, keep = self._nucleus(log_probs)
        filtered = ops.where(keep, sorted_log_probs, CUT)
        choice = counter_random.categorical(filtered, seed)  # (B,)
        return ops.take_along_axis(sorted_indices, choice[:, None], axis=-1)[:, 0]

    def distribution(self, log_probs):
        log_probs = ops.cast(log_probs, "float32")
        _, _, keep = self._nucleus(log_probs)  # a prefix of the sorted tokens
        return keep_most_probable(log_probs, ops.sum(ops.cast(keep, "int32"), -1))

    def get_config(self) -> dict:
        return {**super().get_config(), "p": self.p, "k": self.k}
