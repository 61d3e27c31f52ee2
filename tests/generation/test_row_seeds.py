"""One seed per row (`seed` a `(B,)` tensor or a list of ints) for the random
samplers and speculative sampling: a row's tokens depend on its own seed
alone, not on the other rows nor its place in the batch (what a served
request needs when TF Serving batches it with others), and still follow
the sampler's distribution."""

import numpy as np
import pytest
from keras import ops

from keras_attn import generation
from keras_attn.ops import counter_random
from tests.generation.test_speculative_sampling import (
    DRAFT,
    END,
    MAX_LENGTH,
    SAMPLERS,
    TARGET,
    batch,
    check_follows_the_target,
)
from tests.test_case import to_numpy

# Ragged prompts, right-padded to one width (a row decoded alone keeps it).
PROMPT = np.array([[1, 2], [3, 0], [1, 2], [2, 1], [3, 0], [1, 2]], "int32")
LENGTHS = np.array([2, 1, 2, 2, 1, 2], "int32")
SEEDS = [7, 2**32 + 8, 123456789, 0, 99, 5]  # taken modulo 2**32


def decode(kind, method, prompt, lengths, seed):
    batch_size = len(prompt)
    sampler = SAMPLERS[kind]()
    cache = TARGET.initial_cache(batch_size)
    options = dict(prompt_lengths=lengths, end_token_id=END, seed=seed)
    if method == "plain":
        return to_numpy(sampler(TARGET, prompt, cache, MAX_LENGTH, **options))
    helper = (
        generation.DraftModelProposer(DRAFT, DRAFT.initial_cache(batch_size))
        if method == "draft"
        else generation.PromptLookupProposer(ngram_size=1)
    )
    tokens = generation.speculative_sample(
        TARGET, helper, prompt, cache, MAX_LENGTH, sampler=sampler,
        num_speculative_tokens=2, **options,
    )  # fmt: skip
    return to_numpy(tokens)


@pytest.mark.parametrize("kind", sorted(SAMPLERS))
@pytest.mark.parametrize("method", ["plain", "draft", "prompt_lookup"])
def test_a_rows_tokens_depend_on_its_own_seed_alone(kind, method):
    together = decode(kind, method, PROMPT, LENGTHS, SEEDS)
    for row in range(len(PROMPT)):
        alone = decode(kind, method, PROMPT[row : row + 1], LENGTHS[row : row + 1],
                       [SEEDS[row]])  # fmt: skip
        np.testing.assert_array_equal(alone[0], together[row], err_msg=f"row {row}")
    order = np.arange(len(PROMPT))[::-1]
    reversed_rows = decode(
        kind, method, PROMPT[order], LENGTHS[order], ops.convert_to_tensor(
            np.array(SEEDS, "int64")[order])
    )  # fmt: skip
    np.testing.assert_array_equal(reversed_rows, together[order])
    # The same prompt under other seeds draws other tokens (rows 0, 2, 5).
    assert len({tuple(together[r]) for r in (0, 2, 5)}) > 1


@pytest.mark.parametrize("kind", sorted(SAMPLERS))
@pytest.mark.parametrize("method", ["plain", "draft"])
def test_rows_with_their_own_seeds_follow_the_distribution(kind, method):
    prompt, lengths = batch()
    seeds = np.arange(len(prompt), dtype="int64") * 7919 + 3
    check_follows_the_target(decode(kind, method, prompt, lengths, seeds), kind)


def test_uniform_with_a_seed_per_row():
    seeds = counter_random.seed_tensor([3, 4, 2**32 + 3])
    values = to_numpy(counter_random.uniform(seeds, (3, 6)))
    for row, seed in enumerate([3, 4, 3]):
        alone = to_numpy(
            counter_random.uniform(counter_random.seed_tensor([seed]), (1, 6))
        )
        np.testing.assert_array_equal(values[row], alone[0])
    assert not np.array_equal(values[0], values[1])
    assert ((values > 0) & (values < 1)).all()


def test_seeds_past_int32_are_taken_modulo_2_to_the_32():
    # JAX without 64-bit types refuses such a list and truncates such an
    # array: the seeds are reduced before they become tensors. A batch of one
    # row draws the same under its scalar seed and under a seed per row.
    seeds = [3_000_000_000, 2**32 - 1, -1, 2**40 + 5]
    for given in (seeds, np.array(seeds, "int64")):
        values = to_numpy(
            counter_random.uniform(counter_random.seed_tensor(given), (4, 3))
        )
        for row, seed in enumerate(seeds):
            scalar = counter_random.seed_tensor(seed % 2**32)
            want = to_numpy(counter_random.uniform(scalar, (1, 3)))[0]
            np.testing.assert_array_equal(values[row], want, err_msg=str(seed))


@pytest.mark.parametrize(
    "seed, message",
    [
        ([1, 2], "Received: 2 seeds for a batch of 6"),
        ([1.5, 2], "`seed` must be an int, integers or None"),
        ([True, 2], "`seed` must be an int, integers or None"),
        (np.zeros((6, 1), "int32"), "integer tensor of rank 0 or 1"),
        (np.zeros((6,), "float32"), "integer tensor of rank 0 or 1"),
    ],
)
def test_bad_seeds_are_refused(seed, message):
    for method in ("plain", "draft"):
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            decode("random", method, PROMPT, LENGTHS, seed)
