"""`TransformerLanguageModel`'s `sampler` arguments, on every backend: a
sampler's name or config (keras-hub's `samplers.get`) decodes as the
sampler itself, and samplers made anew at every call with the same config
share one compiled decoding (no new trace, nothing kept per call), while a
sampler of a user's own class is compiled per instance."""

import keras
import pytest

from keras_attn import generation
from tests.models.test_streaming import language_model

PROMPTS = ["Where is the station?", "I am very tired today."]


@pytest.fixture(scope="module")
def lm(small_tokenizer):
    return language_model(small_tokenizer)


# `generate` keeps a compiled decoding per setting on TensorFlow and JAX;
# on PyTorch it decodes eagerly and keeps none.
KEPT = keras.backend.backend() in ("tensorflow", "jax")


def compiled_count(lm):
    return len(lm.__dict__.get("_task_cache", {}))


@pytest.mark.parametrize(
    ("identifier", "sampler"),
    [
        ("top_k", generation.TopKSampler()),  # every name: test_serialization.py
        (
            {"class_name": "top_k", "config": {"k": 30, "temperature": 1.5}},
            generation.TopKSampler(k=30, temperature=1.5),
        ),
        (generation.TopPSampler, generation.TopPSampler()),
    ],
    ids=["name", "config", "class"],
)
def test_a_name_or_config_decodes_as_its_sampler(lm, identifier, sampler):
    want = lm.generate(PROMPTS, 10, sampler=sampler, seed=[3, 4])
    assert lm.generate(PROMPTS, 10, sampler=identifier, seed=[3, 4]) == want
    streamed = "".join(lm.stream(PROMPTS[0], 10, sampler=identifier, seed=3))
    assert streamed == lm.generate(PROMPTS[0], 10, sampler=sampler, seed=3)[0]


def test_equal_samplers_made_anew_share_one_compiled_decoding(lm):
    first = lm.generate(PROMPTS, 10, sampler=generation.TopKSampler(k=7), seed=5)
    count = compiled_count(lm)
    for seed in (5, 5, 6):  # a new sampler at every call, as a loop would make
        texts = lm.generate(PROMPTS, 10, sampler=generation.TopKSampler(k=7), seed=seed)
        assert compiled_count(lm) == count
    assert texts != first  # the seed is an input, not part of the kept decoding
    assert (
        lm.generate(PROMPTS, 10, sampler=generation.TopKSampler(k=7), seed=5) == first
    )
    # Its own seed too: the call's seed or the sampler's, both inputs.
    seeded = generation.TopKSampler(k=7, seed=5)
    assert lm.generate(PROMPTS, 10, sampler=seeded) == first
    assert compiled_count(lm) == count
    # Another config is another decoding.
    lm.generate(PROMPTS, 10, sampler=generation.TopKSampler(k=8), seed=5)
    assert compiled_count(lm) == count + KEPT


class ScaledTopK(generation.TopKSampler):
    """A user's sampler with state its config does not describe."""

    def __init__(self, scale, **kwargs):
        super().__init__(**kwargs)
        self.scale = scale

    def compute_log_probs(self, logits):
        return super().compute_log_probs(logits * self.scale)


def test_a_sampler_of_ones_own_class_is_compiled_per_instance(lm):
    cold = lm.generate(PROMPTS, 10, sampler=ScaledTopK(0.01, k=40), seed=9)
    count = compiled_count(lm)
    hot = lm.generate(PROMPTS, 10, sampler=ScaledTopK(100.0, k=40), seed=9)
    assert compiled_count(lm) == count + KEPT
    # Sharing the first's decoding would have drawn with its scale.
    greedy = lm.generate(PROMPTS, 10)
    assert hot == greedy != cold
