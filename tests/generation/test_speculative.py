"""Speculative greedy decoding (`keras_attn.generation.speculative`) and the
per-row cache positions it rests on: the same tokens as greedy search, from
a draft model, from the target itself and from prompt lookup, with ragged
prompts and end tokens inside a checked block; fewer target passes than new
tokens; on every backend."""

import keras
import numpy as np
import pytest

from keras_attn import generation
from keras_attn.layers import MultiHeadAttention
from keras_attn.layers.alibi_bias import AlibiBias
from keras_attn.models import TransformerLanguageModel
from tests.test_case import to_numpy

VOCAB, CONTEXT = 30, 24
PROMPT = np.array([[2, 5, 6, 7, 8], [2, 9, 0, 0, 0], [2, 4, 4, 4, 0]], "int32")
LENGTHS = np.array([5, 2, 4], "int32")


def language_model(seed, num_layers=2, embedding_dim=16, **kwargs):
    """Weights drawn normal (standard deviation 0.5): the greedy tokens vary
    from step to step, so a draft's guesses are often wrong."""
    model = TransformerLanguageModel(
        VOCAB, CONTEXT, embedding_dim=embedding_dim, num_layers=num_layers,
        num_heads=2, intermediate_dim=2 * embedding_dim, **kwargs,
    )  # fmt: skip
    rng = np.random.default_rng(seed)
    model.set_weights(
        [rng.normal(0, 0.5, w.shape).astype(w.dtype) for w in model.get_weights()]
    )
    return model


def decode(model, **kwargs):
    """`generate_ids` on PROMPT to CONTEXT tokens, compiled on TensorFlow
    (an eager `while_loop` there runs op by op)."""

    def run():
        return model.generate_ids(PROMPT, CONTEXT, prompt_lengths=LENGTHS, **kwargs)

    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return to_numpy(tf.function(run)())
    return to_numpy(run())


@pytest.fixture(scope="module")
def models():
    return {
        "learned": language_model(0),
        "rotary_gqa": language_model(0, position="rotary", num_key_value_heads=1),
        "draft": language_model(1, num_layers=1, embedding_dim=8),
    }


@pytest.fixture(scope="module")
def greedy(models):
    """Greedy search's tokens, per (target, end token), computed once."""
    found = {}

    def tokens(target, end_token_id):
        key = (target, end_token_id)
        if key not in found:
            found[key] = decode(models[target], end_token_id=end_token_id)
        return found[key]

    return tokens


@pytest.mark.parametrize(
    "target, assistant, end_token_id, k",
    [
        ("learned", "draft", 3, 1),
        ("learned", "draft", 22, 4),
        ("learned", "itself", 22, 3),
        ("learned", "prompt_lookup", 22, 3),
        ("rotary_gqa", "draft", 22, 3),
    ],
)
def test_speculative_tokens_equal_greedy_search(
    models, greedy, target, assistant, end_token_id, k
):
    model = models[target]
    helper = {"draft": models["draft"], "itself": model}.get(assistant, assistant)
    want = greedy(target, end_token_id)
    if end_token_id == 22:  # frequent under these weights: rows end early
        ended = (want[:, 5:] == 22).any(-1)
        assert ended.any() and (want[ended][:, -1] == 0).all()
    got = decode(
        model,
        end_token_id=end_token_id,
        assistant_model=helper,
        num_speculative_tokens=k,
    )
    np.testing.assert_array_equal(got, want)


def test_a_perfect_draft_keeps_every_guess(models, greedy):
    """The target as its own draft: every guess agrees, so a round keeps
    k + 1 tokens and the target runs once per k + 1 new tokens."""
    model = models["learned"]
    next_fn = model_next_fn(model)
    k = 3
    tokens, stats = generation.speculative_greedy_search(
        next_fn,
        generation.DraftModelProposer(next_fn, model.initial_cache(3, CONTEXT)),
        PROMPT,
        model.initial_cache(3, CONTEXT),
        CONTEXT,
        num_speculative_tokens=k,
        prompt_lengths=LENGTHS,
        return_stats=True,
    )
    new = to_numpy(stats["new_tokens"])
    np.testing.assert_array_equal(new, CONTEXT - LENGTHS)
    # The longest row (22 new tokens) sets the rounds: ceil(22 / 4).
    assert int(to_numpy(stats["target_calls"])) == -(-max(new) // (k + 1))
    np.testing.assert_array_equal(to_numpy(tokens), greedy("learned", None))


def test_generate_with_an_assistant_gives_the_same_text(small_tokenizer):
    """The text method, compiled once per prompt bucket with the draft's
    weights read at each call: the same continuations as without one."""
    vocabulary = small_tokenizer.vocabulary_size
    model, draft = (
        TransformerLanguageModel(
            vocabulary, 48, embedding_dim=width, num_layers=layers, num_heads=2,
            intermediate_dim=2 * width, tokenizer=small_tokenizer,
        )
        for layers, width in ((2, 16), (1, 8))
    )  # fmt: skip
    for seed, layer in ((2, model), (3, draft)):  # seed 2: varied tokens
        rng = np.random.default_rng(seed)
        layer.set_weights(
            [rng.normal(0, 0.5, w.shape).astype(w.dtype) for w in layer.get_weights()]
        )
    prompts = ["Where is the station?", "", "I am very tired today. " * 3]
    want = model.generate(prompts, max_new_tokens=20)
    assert len(set(want)) == 3 and all(want)
    for assistant in (draft, "prompt_lookup"):
        found = model.generate(prompts, max_new_tokens=20, assistant_model=assistant)
        assert found == want


def model_next_fn(model):
    from keras_attn.models import _task

    return _task.WithoutPadding(model.call_with_cache)


def test_prompt_lookup_copies_a_repeated_phrase():
    """A row that repeats itself: prompt lookup guesses the continuation of
    the earlier occurrence, so a model that copies it (the target here is
    the lookup's own guess checked against greedy search) keeps several
    tokens per pass."""
    tokens = np.array([[2, 5, 6, 7, 8, 9, 5, 6, 7, 0, 0, 0]], "int32")
    proposer = generation.PromptLookupProposer(ngram_size=3)
    guesses, _, _ = proposer.propose(
        keras.ops.convert_to_tensor(tokens), keras.ops.convert_to_tensor([8]), 3, ()
    )
    np.testing.assert_array_equal(to_numpy(guesses), [[8, 9, 5]])
    # No earlier match of the last 3 tokens: the last token, repeated.
    guesses, _, _ = proposer.propose(
        keras.ops.convert_to_tensor(tokens), keras.ops.convert_to_tensor([5]), 2, ()
    )
    np.testing.assert_array_equal(to_numpy(guesses), [[9, 9]])


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"position": "sinusoidal"}, {"position": "rotary", "num_key_value_heads": 1},
     {"sliding_window": 3}],
    ids=["learned", "sinusoidal", "rotary_gqa", "window"],
)  # fmt: skip
def test_a_per_row_cache_index_places_each_row_at_its_own_position(kwargs):
    """`call_with_cache` with an index `(B,)` answers each row as a call of
    that row alone at its own index, over a cache that holds stale entries
    after each row's position (written there by an earlier call)."""
    model = language_model(2, **kwargs)
    rng = np.random.default_rng(0)
    batch, length, new = 3, 16, 3
    ids = rng.integers(1, VOCAB, (batch, length)).astype("int32")
    index = np.array([2, 9, 5], "int32")
    want = []
    for row in range(batch):
        cache = model.initial_cache(1, length)
        _, cache = model.call_with_cache(ids[row : row + 1, : index[row]], cache, 0)
        found, _ = model.call_with_cache(
            ids[row : row + 1, index[row] : index[row] + new], cache, int(index[row])
        )
        want.append(to_numpy(found)[0])
    cache = model.initial_cache(batch, length)
    _, cache = model.call_with_cache(ids, cache, 0)  # every position written
    stale = rng.integers(1, VOCAB, (batch, new)).astype("int32")
    _, cache = model.call_with_cache(stale, cache, index + new)  # after each row
    block = np.stack([ids[row, index[row] : index[row] + new] for row in range(batch)])
    found, _ = model.call_with_cache(block, cache, keras.ops.convert_to_tensor(index))
    np.testing.assert_allclose(to_numpy(found), np.stack(want), atol=2e-5, rtol=1e-5)


def test_per_row_cache_updates_write_each_row_at_its_index():
    from keras_attn.ops import update_cache

    cache = np.zeros((2, 6, 1), "float32")
    update = np.array([[[1.0], [2.0]], [[3.0], [4.0]]], "float32")
    found = to_numpy(update_cache(cache, update, keras.ops.convert_to_tensor([0, 3])))
    np.testing.assert_array_equal(
        found[..., 0], [[1, 2, 0, 0, 0, 0], [0, 0, 0, 3, 4, 0]]
    )
    # Writes past the end are dropped.
    found = to_numpy(update_cache(cache, update, keras.ops.convert_to_tensor([5, 1])))
    np.testing.assert_array_equal(
        found[..., 0], [[0, 0, 0, 0, 0, 1], [0, 3, 4, 0, 0, 0]]
    )


def test_bad_per_row_indices_are_refused():
    layer = MultiHeadAttention(num_heads=2, key_dim=4)
    query = np.zeros((2, 1, 8), "float32")
    cache = (np.zeros((2, 5, 2, 4), "float32"), np.zeros((2, 5, 2, 4), "float32"))
    with pytest.raises(ValueError, match=r"`cache_update_index` must be .*\(batch,\)"):
        layer(query, query, cache=cache, cache_update_index=np.zeros((3,), "int32"))
    with pytest.raises(ValueError, match=r"`cache_update_index` must be"):
        layer(query, query, cache=cache, cache_update_index=np.zeros((2, 1), "int32"))
    alibi = MultiHeadAttention(num_heads=2, key_dim=4, alibi_bias=AlibiBias())
    with pytest.raises(ValueError, match=r"`alibi_bias` takes one position.*\(2,\)"):
        alibi(query, query, cache=cache, cache_update_index=np.zeros((2,), "int32"))


@pytest.mark.parametrize(
    "sampler",
    [generation.TopKSampler(k=1), generation.TopPSampler(p=1e-6, temperature=0.5)],
    ids=["top_k_1", "top_p_tiny"],
)
def test_a_sampler_that_keeps_one_token_samples_greedy_search(models, greedy, sampler):
    """Speculative sampling through the language model with a draft: a cut
    to the most probable token leaves one draw, greedy search's (the
    distribution tests are in test_speculative_sampling.py)."""
    got = decode(
        models["learned"],
        end_token_id=22,
        sampler=sampler,
        seed=3,
        assistant_model=models["draft"],
        num_speculative_tokens=3,
    )
    np.testing.assert_array_equal(got, greedy("learned", 22))


def test_speculative_sampling_draws_from_the_seed_and_never_pads(models):
    model = models["learned"]

    def sampled(seed):
        return decode(
            model,
            end_token_id=None,
            sampler=generation.RandomSampler(temperature=1.5),
            seed=seed,
            assistant_model=models["draft"],
            num_speculative_tokens=2,
        )

    first, again, other = sampled(1), sampled(1), sampled(2)
    np.testing.assert_array_equal(first, again)
    assert (first != other).any()
    for row, prompt, length in zip(first, PROMPT, LENGTHS, strict=True):
        np.testing.assert_array_equal(row[:length], prompt[:length])
        assert (row[length:] != 0).all()  # no end token: every row is full


def test_speculative_decoding_refuses_bad_arguments(models):
    model = models["learned"]
    other_vocabulary = TransformerLanguageModel(
        40, CONTEXT, embedding_dim=8, num_layers=1, num_heads=2, intermediate_dim=8
    )
    with pytest.raises(ValueError, match=r"share the model's vocabulary.*=40"):
        model.generate_ids(PROMPT, 8, assistant_model=other_vocabulary)
    with pytest.raises(ValueError, match="`assistant_model` must be a Transformer"):
        model.generate_ids(PROMPT, 8, assistant_model="ngram")
    with pytest.raises(ValueError, match=r"not beam search.*BeamSampler"):
        model.generate_ids(
            PROMPT,
            8,
            sampler=generation.BeamSampler(beam_width=2),
            assistant_model="prompt_lookup",
        )
    with pytest.raises(ValueError, match="`num_speculative_tokens` must be a positive"):
        model.generate_ids(
            PROMPT, 8, assistant_model="prompt_lookup", num_speculative_tokens=0
        )
    short = TransformerLanguageModel(
        VOCAB, 8, embedding_dim=8, num_layers=1, num_heads=2, intermediate_dim=8
    )
    with pytest.raises(ValueError, match=r"must hold 24 tokens.*sequence_length=8"):
        model.generate_ids(PROMPT, CONTEXT, assistant_model=short)
