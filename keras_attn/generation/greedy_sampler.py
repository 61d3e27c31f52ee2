"""`GreedySampler`: the most probable token at every step."""

from __future__ import annotations

import keras
from keras import ops

from keras_attn.generation.sampler import Sampler, keep_most_probable


@keras.saving.register_keras_serializable(package="keras_attn")
class GreedySampler(Sampler):
    """Greedy search: `argmax` of the next-token distribution at every step.

    Deterministic; `temperature` and `seed` have no effect. See `Sampler` for
    the call arguments and `keras_attn.generation.greedy_search` for the
    function form.

    Example:

    ```python
    tokens = keras_attn.generation.GreedySampler()(
        next_fn, prompt, cache, max_length=32, end_token_id=2
    )  # (batch, 32)
    ```
    """

    def __init__(self):
        super().__init__()

    def get_next_token(self, log_probs, seed):
        return ops.argmax(log_probs, axis=-1)

    def distribution(self, log_probs):
        return keep_most_probable(ops.cast(log_probs, "float32"), 1)

    def get_config(self) -> dict:
        return {}
