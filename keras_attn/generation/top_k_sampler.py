"""`TopKSampler`: a draw among the `k` most probable tokens."""

from __future__ import annotations

import keras
from keras import ops

from keras_attn import _validation as v
from keras_attn.generation.sampler import Sampler, keep_most_probable, top_k
from keras_attn.ops import counter_random


@keras.saving.register_keras_serializable(package="keras_attn")
class TopKSampler(Sampler):
    """Top-k sampling (Fan et al., 2018): renormalise over the `k` best tokens.

    Args:
        k: positive int; `k=1` is greedy search.
        temperature: positive float, applied before the cut.
        seed: default seed (int or `None`); the call's `seed` overrides it.

    Example:

    ```python
    sampler = keras_attn.generation.TopKSampler(k=40, temperature=0.8)
    tokens = sampler(next_fn, prompt, cache, max_length=32, seed=7)
    ```
    """

    def __init__(self, k: int = 5, temperature: float = 1.0, seed: int | None = None):
        super().__init__(temperature=temperature, seed=seed)
        self.k = v.check_positive_int("k", k)

    def get_next_token(self, log_probs, seed):
        k = min(self.k, log_probs.shape[-1] or self.k)
        top_log_probs, top_indices = top_k(log_probs, k)  # (B, k)
        choice = counter_random.categorical(top_log_probs, seed)  # (B,)
        return ops.take_along_axis(top_indices, choice[:, None], axis=-1)[:, 0]

    def distribution(self, log_probs):
        k = min(self.k, log_probs.shape[-1] or self.k)
        return keep_most_probable(ops.cast(log_probs, "float32"), k)

    def get_config(self) -> dict:
        return {**super().get_config(), "k": self.k}
