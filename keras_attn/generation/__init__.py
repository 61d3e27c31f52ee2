"""Decoding over a KV cache: greedy, beam search, sampling.

Every decoder is one `ops.while_loop` over a user `next_fn`:

```
logits, cache = next_fn(token_ids, cache, index)
```

(token ids `(B, T)` at positions `index..index+T-1`, a fixed-shape cache nest
with the batch on axis 0, a scalar int32 `index`; logits `(B, vocab)` or
`(B, T, vocab)` for the token after the last input). It traces once under
`tf.function` / `jax.jit`, uses TF ops only on TensorFlow and exports in a
SavedModel. See `Sampler` for the full contract. `speculative_greedy_search`
and `speculative_sample` check several guessed tokens per `next_fn` call (a
`(B,)` index there). `WeightsReadOnce` reads and casts a loop's weights once
per call rather than at every step. `get`, `serialize` and `deserialize`
make samplers from names and configs, as `keras_hub.samplers` does.
"""

from keras_attn.generation.beam_sampler import BeamSampler, length_penalty
from keras_attn.generation.decoding import beam_search, greedy_search, sample
from keras_attn.generation.greedy_sampler import GreedySampler
from keras_attn.generation.random_sampler import RandomSampler
from keras_attn.generation.sampler import Sampler
from keras_attn.generation.serialization import deserialize, get, serialize
from keras_attn.generation.speculative import (
    DraftModelProposer,
    PromptLookupProposer,
    speculative_greedy_search,
    speculative_sample,
)
from keras_attn.generation.top_k_sampler import TopKSampler
from keras_attn.generation.top_p_sampler import TopPSampler
from keras_attn.generation.weights import WeightsReadOnce

__all__ = [
    "BeamSampler",
    "DraftModelProposer",
    "GreedySampler",
    "PromptLookupProposer",
    "RandomSampler",
    "Sampler",
    "TopKSampler",
    "TopPSampler",
    "WeightsReadOnce",
    "beam_search",
    "deserialize",
    "get",
    "greedy_search",
    "length_penalty",
    "sample",
    "serialize",
    "speculative_greedy_search",
    "speculative_sample",
]
