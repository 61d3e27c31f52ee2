import keras
import numpy as np
import pytest

from keras_attn import generation
from keras_attn.memory import ContinuousCache, continuous_cache_log_probs
from keras_attn.models import TransformerLanguageModel
from tests.test_case import to_numpy

TOKENS = np.array([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]], "int32")


def small_language_model(**kwargs):
    return TransformerLanguageModel(
        30,
        sequence_length=12,
        embedding_dim=16,
        num_layers=2,
        num_heads=2,
        intermediate_dim=32,
        dropout=0.0,
        **kwargs,
    )


def test_cache_equals_full_pass_and_generates():
    model = small_language_model()
    full = to_numpy(model(TOKENS))
    cache = model.initial_cache(2, 12)
    logits, cache = model.call_with_cache(TOKENS[:, :3], cache, 0)  # prefill
    np.testing.assert_allclose(to_numpy(logits), full[:, :3], atol=1e-5)
    for index in range(3, 6):
        logits, cache = model.call_with_cache(
            TOKENS[:, index : index + 1], cache, index
        )
        np.testing.assert_allclose(to_numpy(logits)[:, -1], full[:, index], atol=1e-5)
    tokens = to_numpy(model.generate_ids(TOKENS[:, :3], 12, end_token_id=None))
    assert tokens.shape == (2, 12)
    np.testing.assert_array_equal(tokens[:, :3], TOKENS[:, :3])
    # The first generated token is the argmax of the full pass's last logits
    # among the ids other than padding (0), which decoding never picks.
    np.testing.assert_array_equal(tokens[:, 3], full[:, 2, 1:].argmax(-1) + 1)
    sampled = model.generate_ids(
        TOKENS[:, :3], 8, sampler=generation.TopKSampler(k=3), seed=4
    )
    again = model.generate_ids(
        TOKENS[:, :3], 8, sampler=generation.TopKSampler(k=3), seed=4
    )
    np.testing.assert_array_equal(to_numpy(sampled), to_numpy(again))
    # A sampler's name or config, as keras-hub takes them.
    named = model.generate_ids(TOKENS[:, :3], 8, sampler="top_k", seed=4)
    configured = model.generate_ids(
        TOKENS[:, :3], 8, sampler={"class_name": "top_k", "config": {"k": 3}}, seed=4
    )
    np.testing.assert_array_equal(to_numpy(configured), to_numpy(sampled))
    by_instance = model.generate_ids(
        TOKENS[:, :3], 8, sampler=generation.TopKSampler(), seed=4
    )
    np.testing.assert_array_equal(to_numpy(named), to_numpy(by_instance))
    with pytest.raises(ValueError, match=r"one of \['beam'.*Received: sampler='bean'"):
        model.generate_ids(TOKENS, 8, sampler="bean")
    with pytest.raises(ValueError, match="`sampler` must be 'greedy', a keras_attn"):
        model.generate_ids(TOKENS, 8, sampler=3)


@pytest.mark.parametrize(
    "sampler, assistant",
    [
        ("greedy", None),
        (generation.TopKSampler(k=3, seed=7), None),
        ("greedy", "prompt_lookup"),
    ],
    ids=["greedy", "top_k", "prompt_lookup"],
)
def test_max_new_tokens_stops_once_every_row_has_them(sampler, assistant):
    # Rows of 2 and 4 prompt tokens in a buffer of 12: with max_new_tokens=3
    # decoding stops at position 4 + 3, where it went on to 12 before. The
    # first 3 new tokens of every row are unchanged; later positions are
    # padding (never decoded).
    model = small_language_model()
    lengths = np.array([2, 4], "int32")
    prompt = np.where(np.arange(6) < lengths[:, None], TOKENS, 0).astype("int32")
    options = dict(
        prompt_lengths=lengths, end_token_id=None, seed=3, assistant_model=assistant
    )
    full = to_numpy(model.generate_ids(prompt, 12, sampler=sampler, **options))
    short = to_numpy(
        model.generate_ids(prompt, 12, sampler=sampler, max_new_tokens=3, **options)
    )
    assert short.shape == (2, 12)
    for row, length in enumerate(lengths):
        np.testing.assert_array_equal(short[row, : length + 3], full[row, : length + 3])
    assert (full[:, 7:] != 0).all()  # decoded to the end without it
    np.testing.assert_array_equal(short[:, 7:], 0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate_ids(prompt, 12, max_new_tokens=0)


def test_is_causal_and_ties_embeddings():
    model = small_language_model()
    changed = TOKENS.copy()
    changed[:, 4:] = 20
    np.testing.assert_allclose(
        to_numpy(model(changed))[:, :4], to_numpy(model(TOKENS))[:, :4], atol=1e-6
    )
    untied = small_language_model(tie_embeddings=False)
    assert len(untied.trainable_weights) == len(model.trainable_weights) + 2
    maps = model.attention_maps(TOKENS)["self_attention"]
    assert len(maps) == 2 and tuple(maps[0].shape) == (2, 2, 6, 6)
    np.testing.assert_array_equal(np.triu(to_numpy(maps[1])[0, 0], 1), 0.0)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"tie_embeddings": False}, {"normalize_first": False}],
    ids=["pre_norm_tied", "untied", "post_norm"],
)
def test_states_are_what_the_output_projection_sees(kwargs):
    model = small_language_model(**kwargs)
    states, logits = model.call_with_states(TOKENS)
    assert tuple(states.shape) == (2, 6, 16)
    np.testing.assert_allclose(to_numpy(logits), to_numpy(model(TOKENS)), atol=1e-6)
    if model.tie_embeddings:
        projected = model.embedding(states, reverse=True)
    else:
        projected = model.logits_layer(states)
    np.testing.assert_allclose(to_numpy(projected), to_numpy(logits), atol=1e-5)


def naive_score(model, row, context):
    """Every target scored once: targets 1..C by the first window, each later
    one by a window ending at it, `context // 2` at a time."""
    ids = [t for t in row if t != 0]
    stride = context // 2
    log_probs, states, scored = [], [], 0
    begin = 0
    while scored < len(ids) - 1:
        window = np.array([ids[begin : begin + context]], "int32")
        hidden, logits = model.call_with_states(window)
        logits = to_numpy(logits)[0].astype("float64")
        log_softmax = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        first = 0 if begin == 0 else context - stride
        for position in range(first, window.shape[1]):
            target = begin + position + 1
            if target < len(ids):
                log_probs.append(log_softmax[position, ids[target]])
                states.append(to_numpy(hidden)[0, position])
                scored += 1
        begin += stride
    return np.array(log_probs), np.array(states), np.array(ids[1:])


def test_score_ids_scores_every_target_once_in_sliding_windows():
    model = small_language_model()
    rows = np.array(
        [[2, 5, 6, 7, 8, 9, 10, 11, 12, 13, 3], [2, 8, 9, 3, 0, 0, 0, 0, 0, 0, 0]],
        "int32",
    )
    scores = model.score_ids(rows, context_length=4)
    cache = ContinuousCache(theta=0.5, lam=0.3)
    mixed = model.score_ids(rows, continuous_cache=cache, context_length=4)
    np.testing.assert_array_equal(to_numpy(scores["num_tokens"]), [10, 3])
    for index, row in enumerate(rows):
        log_probs, states, targets = naive_score(model, row, 4)
        np.testing.assert_allclose(
            to_numpy(scores["log_likelihood"])[index], log_probs.sum(), rtol=1e-5
        )
        expected = to_numpy(
            continuous_cache_log_probs(
                states, targets, log_probs.astype("float32"), theta=0.5, lam=0.3
            )
        )
        np.testing.assert_allclose(
            to_numpy(mixed["log_likelihood"])[index], expected.sum(), rtol=1e-4
        )
    np.testing.assert_allclose(
        to_numpy(mixed["model_log_likelihood"]), to_numpy(scores["log_likelihood"])
    )


@pytest.mark.parametrize("position", ["learned", "rotary", "alibi"])
def test_rows_shorter_than_the_context_are_scored_in_one_window_as_wide(
    position, monkeypatch
):
    """A batch narrower than the context is scored by one window of its own
    width, with the scores of the context-wide window (the model is causal)."""
    model = small_language_model(position=position)  # a context of 12
    rows = np.array([[2, 5, 6, 7, 3], [2, 8, 3, 0, 0]], "int32")
    widths = []
    call_with_states = model.call_with_states

    def recorded(inputs):
        widths.append(int(inputs.shape[1]))
        return call_with_states(inputs)

    monkeypatch.setattr(model, "call_with_states", recorded)
    cache = ContinuousCache(theta=0.5, lam=0.3)
    short = model.score_ids(rows, continuous_cache=cache)
    assert widths == [4]  # the inputs of the longest row's 4 targets
    wide = np.pad(rows, [[0, 0], [0, 13 - rows.shape[1]]])  # 12 targets wide
    full = model.score_ids(wide, continuous_cache=cache)
    assert widths == [4, 12]
    for name in ("log_likelihood", "model_log_likelihood", "num_tokens"):
        np.testing.assert_allclose(
            to_numpy(short[name]), to_numpy(full[name]), rtol=1e-5, err_msg=name
        )
    np.testing.assert_array_equal(to_numpy(short["num_tokens"]), [4, 2])
    # Longer than the context: windows of the context's width, as before.
    widths.clear()
    model.score_ids(np.full((1, 20), 5, "int32"))
    assert set(widths) == {12}


@pytest.mark.tf_only
def test_a_traced_width_narrows_the_window_too(monkeypatch):
    """The export's `score` signature traces ids of unknown width: its one
    window is as wide as the batch there too, with the eager scores."""
    import tensorflow as tf

    model = small_language_model()
    rows = np.array([[2, 5, 6, 7, 3], [2, 8, 3, 0, 0]], "int32")
    eager = model.score_ids(rows)["log_likelihood"].numpy()
    call_with_states = model.call_with_states

    def at_most_four_wide(inputs):
        check = tf.debugging.assert_less_equal(tf.shape(inputs)[1], 4)
        with tf.control_dependencies([check]):
            return call_with_states(tf.identity(inputs))

    monkeypatch.setattr(model, "call_with_states", at_most_four_wide)
    traced = tf.function(
        lambda ids: model.score_ids(ids)["log_likelihood"],
        input_signature=[tf.TensorSpec((None, None), tf.int32)],
    )
    np.testing.assert_allclose(traced(rows).numpy(), eager, rtol=1e-6)
    with pytest.raises(tf.errors.InvalidArgumentError):  # 12 wide: one window
        traced(np.full((1, 13), 5, "int32"))


def test_round_trip_and_bad_arguments(tmp_path):
    model = small_language_model()
    model.save(tmp_path / "lm.keras")
    restored = keras.saving.load_model(tmp_path / "lm.keras")
    np.testing.assert_allclose(to_numpy(restored(TOKENS)), to_numpy(model(TOKENS)))
    with pytest.raises(ValueError, match="Received: num_layers=0"):
        TransformerLanguageModel(10, num_layers=0)
    with pytest.raises(ValueError, match="needs the model's `tokenizer`"):
        model.generate(["KING:"])
    with pytest.raises(ValueError, match=r"Received: continuous_cache=0\.3"):
        model.score_ids(TOKENS, continuous_cache=0.3)


@pytest.mark.tf_only
def test_stream_log_probs_follow_the_token_stream(tmp_path):
    """What the cache is given: every target once, in the order of the text,
    with the token before it, its document, the model's log-probability and
    its state."""
    import re
    from pathlib import Path

    from keras_attn.datasets import Document
    from keras_attn.text import (
        END_ID,
        START_ID,
        SubwordTokenizer,
        language_model_dataset,
        train_subword_vocabulary,
    )

    text = (Path(__file__).parents[1] / "fixtures" / "play_sample.txt").read_text()
    tokenizer = SubwordTokenizer(
        train_subword_vocabulary(
            [text], tmp_path / "v.model", vocabulary_size=400, lossless=True
        )
    )
    documents = [Document("a", text), Document("b", text[150:] + text)]
    stream, document_ids = [], []
    for index, document in enumerate(documents):  # tokenized line by line
        lines = [line for line in re.split(r"(?<=\n)", document.text) if line]
        tokens = tokenizer.tokenize(lines).flat_values.numpy().tolist()
        stream += [START_ID, *tokens, END_ID]
        document_ids += [index + 1] * (len(tokens) + 2)
    dataset = language_model_dataset(
        documents,
        tokenizer,
        sequence_length=16,
        batch_size=3,
        shuffle=False,
        document_tokens=True,
    )
    model = TransformerLanguageModel(
        tokenizer.vocabulary_size,
        16,
        embedding_dim=8,
        num_layers=1,
        num_heads=2,
        intermediate_dim=16,
    )
    scores = model.stream_log_probs(dataset, states=True)
    np.testing.assert_array_equal(scores["targets"], stream[1:])
    np.testing.assert_array_equal(scores["inputs"], stream[:-1])
    np.testing.assert_array_equal(scores["document_ids"], document_ids[:-1])
    assert scores["states"].shape == (len(stream) - 1, 8)
    # The log-probabilities are the tied projection of the states.
    logits = scores["states"] @ to_numpy(model.embedding.token_embedding.embeddings).T
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(
        scores["log_probs"],
        log_probs[np.arange(len(stream) - 1), scores["targets"]],
        atol=1e-4,
    )
    plain = model.stream_log_probs(dataset)
    assert "states" not in plain
    np.testing.assert_allclose(plain["log_probs"], scores["log_probs"], atol=1e-6)


def test_generation_never_decodes_the_padding_id():
    """A model whose likeliest next token is the padding id continues with
    its likeliest other token: a decoded 0 would be padding to the model's
    mask in a full pass but a token to the KV cache."""
    model = TransformerLanguageModel(
        30, sequence_length=10, embedding_dim=16, num_layers=1, num_heads=2,
        intermediate_dim=32, tie_embeddings=False,
    )  # fmt: skip
    bias = np.zeros(30, "float32")
    bias[0] = 100.0  # padding far ahead of every other id
    model.logits_layer.bias.assign(bias)
    prompt = np.array([[1, 7, 8, 9], [1, 5, 0, 0]], "int32")
    tokens = keras.ops.convert_to_numpy(
        model.generate_ids(
            prompt, 10, prompt_lengths=np.array([4, 2]), end_token_id=None
        )
    )
    for row, length in enumerate((4, 2)):
        assert np.all(tokens[row, length:] != 0)
        for position in range(length, 10):
            logits = keras.ops.convert_to_numpy(model(tokens[row : row + 1, :position]))
            assert np.argmax(logits[0, -1]) == 0
            assert tokens[row, position] == 1 + np.argmax(logits[0, -1, 1:])
