"""`TransformerLanguageModel.generate`'s seeds with a random sampler, on
every backend (the tokenizers run TensorFlow Text on each):
without a seed each call draws anew (the compiled decoding takes the seed
as an input, so none is frozen into its trace); an int fixes the draws; one
seed per prompt fixes each prompt's own, whatever it is batched with."""

import pytest

from keras_attn import generation
from tests.models.test_streaming import language_model

PROMPTS = ["Where is the station?", "", "I am very tired today.", "Where is the"]


@pytest.fixture(scope="module")
def lm(small_tokenizer):
    return language_model(small_tokenizer)


@pytest.mark.parametrize(
    "sampler",
    [generation.RandomSampler(), generation.TopPSampler(p=0.9, temperature=1.5)],
    ids=["random", "top_p"],
)
def test_without_a_seed_each_call_draws_anew(lm, sampler):
    texts = {lm.generate(PROMPTS[0], 12, sampler=sampler)[0] for _ in range(3)}
    assert len(texts) == 3  # 12 draws of a near-uniform choice: never equal


def test_an_int_seed_fixes_the_draws(lm):
    sampler = generation.RandomSampler()
    first = lm.generate(PROMPTS, 12, sampler=sampler, seed=7)
    assert lm.generate(PROMPTS, 12, sampler=sampler, seed=7) == first
    assert lm.generate(PROMPTS, 12, sampler=sampler, seed=8) != first
    # The sampler's own seed when the call gives none.
    seeded = generation.RandomSampler(seed=7)
    assert lm.generate(PROMPTS, 12, sampler=seeded) == first


def test_a_seed_per_prompt_fixes_each_prompts_draws(lm):
    sampler = generation.TopKSampler(k=30)
    seeds = [3, 4, 5, 3]
    together = lm.generate(PROMPTS, 12, sampler=sampler, seed=seeds, batch_size=3)
    alone = [
        lm.generate([prompt], 12, sampler=sampler, seed=[seed])[0]
        for prompt, seed in zip(PROMPTS, seeds, strict=True)
    ]
    assert together == alone
    order = [2, 0, 3, 1]
    shuffled = lm.generate(
        [PROMPTS[i] for i in order], 12, sampler=sampler, seed=[seeds[i] for i in order]
    )
    assert shuffled == [together[i] for i in order]


@pytest.mark.parametrize(
    ("seed", "message"),
    [
        ([1, 2], "Received: 2 seeds for 4 prompts"),
        ([1.5] * 4, "`seed` must be an int, one int per prompt or None"),
        ("seven", "`seed` must be an int, one int per prompt or None"),
        (True, "`seed` must be an int, one int per prompt or None"),
    ],
)
def test_bad_seeds_name_the_argument(lm, seed, message):
    with pytest.raises(ValueError, match=message):
        lm.generate(PROMPTS, 4, sampler=generation.RandomSampler(), seed=seed)
