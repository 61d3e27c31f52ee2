"""`TransformerTranslator` with an `assistant_model`: a smaller translator on
the same vocabularies proposes tokens, the translator checks them in one
pass; the translations are greedy search's (`beam_width=1,
length_penalty=0.0`), token for token, for ragged sources and rows ending
inside a block of guesses. On TensorFlow, JAX and PyTorch (token ids); the
text method needs TensorFlow Text (`tf_only`)."""

import keras
import numpy as np
import pytest

from keras_attn.models import RNNTranslator, TransformerTranslator
from keras_attn.models._task import END_ID, PAD_ID

VOCABULARY = 120


def translator(num_layers, embedding_dim, seed, tokenizer=None, end_bias=0.0):
    """Kernels and embeddings drawn normal (standard deviation 0.5; norms
    and biases as built), so that greedy tokens vary; `end_bias` on the end
    token's logit makes rows end at different steps."""
    size = tokenizer.vocabulary_size if tokenizer is not None else VOCABULARY
    model = TransformerTranslator(
        size, size, sequence_length=24, embedding_dim=embedding_dim,
        num_encoder_layers=num_layers, num_decoder_layers=num_layers,
        num_heads=2, intermediate_dim=2 * embedding_dim, shared_vocabulary=True,
        normalize_first=True, tie_embeddings=False,
        source_tokenizer=tokenizer, target_tokenizer=tokenizer,
    )  # fmt: skip
    rng = np.random.default_rng(seed)
    for weight in model.weights:
        if weight.path.split("/")[-1] not in ("gamma", "beta", "bias"):
            weight.assign(rng.normal(0, 0.5, weight.shape).astype(weight.dtype))
    kernel, bias = model.logits_layer.get_weights()
    bias[END_ID] = end_bias
    model.logits_layer.set_weights([kernel, bias])
    return model


@pytest.fixture(scope="module")
def models():
    return translator(2, 32, seed=1, end_bias=3.5), translator(1, 16, seed=2)


SOURCES = np.array(
    [
        [5, 6, 7, 8, 0, 0, 0],
        [9, 10, 11, 12, 13, 14, 15],
        [4, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0],  # an empty source
        [30, 31, 32, 33, 34, 0, 0],
        [50, 51, 52, 53, 54, 55, 0],
    ],
    "int32",
)


def greedy(model, sources, max_length):
    tokens, scores = model.translate_ids(
        sources, max_length=max_length, beam_width=1, length_penalty=0.0
    )
    return np.asarray(keras.ops.convert_to_numpy(tokens)), np.asarray(
        keras.ops.convert_to_numpy(scores)
    )


@pytest.mark.parametrize("max_length", [3, 12])
@pytest.mark.parametrize("k", [1, 3])
def test_speculative_translation_gives_greedy_search_tokens(models, max_length, k):
    target, draft = models
    want, want_scores = greedy(target, SOURCES, max_length)
    tokens, scores = target.translate_ids(
        SOURCES, max_length=max_length, beam_width=1, length_penalty=0.0,
        assistant_model=draft, num_speculative_tokens=k,
    )  # fmt: skip
    tokens = np.asarray(keras.ops.convert_to_numpy(tokens))
    np.testing.assert_array_equal(tokens, want)
    ended = (want == END_ID).any(axis=1)
    if max_length == 12:
        # The rows end at different steps, some not at all: the loop's
        # per-row positions and its end handling are both exercised.
        assert ended.any() and not ended.all()
        assert len({int(np.argmax(row == END_ID)) for row in want[ended]}) > 1
        assert len({tuple(row) for row in want}) > 2  # not one repeated token
    # Where greedy search ended, its score is the log-probability of the
    # tokens, the end token included: what the teacher-forced score gives.
    scores = np.asarray(keras.ops.convert_to_numpy(scores))
    np.testing.assert_allclose(scores[ended], want_scores[ended], atol=1e-4)
    assert (scores < 0).all()
    assert ((tokens == PAD_ID).cumsum(axis=1) > 0).sum() == (
        (want == PAD_ID).cumsum(axis=1) > 0
    ).sum()


def test_the_target_as_its_own_draft_and_a_draft_on_other_weights(models):
    target, _ = models
    want, _ = greedy(target, SOURCES, 10)
    for draft in (target, translator(1, 16, seed=7), translator(2, 32, seed=1)):
        tokens, _ = target.translate_ids(
            SOURCES, max_length=10, beam_width=1, length_penalty=0.0,
            assistant_model=draft, num_speculative_tokens=4,
        )  # fmt: skip
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(tokens), want)


def test_bad_assistants_and_settings_are_refused(models):
    target, draft = models
    greedy_settings = {"beam_width": 1, "length_penalty": 0.0}

    def refuse(match, model=target, **kwargs):
        with pytest.raises(ValueError, match=match):
            model.translate_ids(SOURCES, max_length=6, **kwargs)

    refuse(
        r"greedy search: pass beam_width=1, length_penalty=0.0\. "
        r"Received: beam_width=4, length_penalty=1.0",
        assistant_model=draft,
    )
    refuse(
        r"length_penalty=0.6", assistant_model=draft, beam_width=1, length_penalty=0.6
    )
    refuse(
        r"`assistant_model` must be a TransformerTranslator. Received: "
        r"assistant_model='prompt_lookup'",
        assistant_model="prompt_lookup", **greedy_settings,
    )  # fmt: skip
    rnn = RNNTranslator(VOCABULARY, VOCABULARY, embedding_dim=8, units=8)
    refuse(r"must be a TransformerTranslator", assistant_model=rnn, **greedy_settings)
    refuse(
        r"needs a TransformerTranslator.*Received: a RNNTranslator",
        model=rnn, assistant_model=draft, **greedy_settings,
    )  # fmt: skip
    other = TransformerTranslator(
        VOCABULARY, VOCABULARY + 1, sequence_length=24, embedding_dim=8,
        num_encoder_layers=1, num_decoder_layers=1, num_heads=2, intermediate_dim=8,
    )  # fmt: skip
    refuse(
        r"share the translator's vocabularies. Received: an assistant of "
        rf"target_vocabulary_size={VOCABULARY + 1}",
        assistant_model=other, **greedy_settings,
    )  # fmt: skip
    short = TransformerTranslator(
        VOCABULARY, VOCABULARY, sequence_length=4, embedding_dim=8,
        num_encoder_layers=1, num_decoder_layers=1, num_heads=2, intermediate_dim=8,
        position="learned",
    )  # fmt: skip
    refuse(r"must hold 6 target tokens", assistant_model=short, **greedy_settings)
    refuse(
        r"num_speculative_tokens",
        assistant_model=draft, num_speculative_tokens=0, **greedy_settings,
    )  # fmt: skip


@pytest.mark.tf_only
def test_translate_with_an_assistant_gives_greedy_translations(small_tokenizer):
    target = translator(2, 32, seed=3, tokenizer=small_tokenizer, end_bias=2.0)
    draft = translator(1, 16, seed=4, tokenizer=small_tokenizer)
    texts = ["Where is the station?", "", "I am very tired today.", "The cat."]
    want = target.translate(texts, beam_width=1, length_penalty=0.0, max_length=10)
    got = target.translate(
        texts, beam_width=1, length_penalty=0.0, max_length=10,
        assistant_model=draft, num_speculative_tokens=3, batch_size=2,
    )  # fmt: skip
    assert got == want
    assert len(set(want)) > 1
    with pytest.raises(ValueError, match="beam_width=4"):
        target.translate(texts, assistant_model=draft)
