"""`RandomSampler`: a draw from the whole next-token distribution."""

from __future__ import annotations

import keras

from keras_attn.generation.sampler import Sampler
from keras_attn.ops import counter_random


@keras.saving.register_keras_serializable(package="keras_attn")
class RandomSampler(Sampler):
    """Ancestral sampling from `softmax(logits / temperature)`.

    Draws are a pure function of the seed and the step (see `Sampler`), so a
    seed reproduces the tokens exactly and can be a tensor input of an
    exported function.

    Args:
        temperature: positive float; below 1 sharpens, above 1 flattens.
        seed: default seed (int or `None`); the call's `seed` overrides it.

    Example:

    ```python
    sampler = keras_attn.generation.RandomSampler(temperature=0.7, seed=1)
    tokens = sampler(next_fn, prompt, cache, max_length=32)
    ```
    """

    def get_next_token(self, log_probs, seed):
        return counter_random.categorical(log_probs, seed)
