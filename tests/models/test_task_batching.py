"""The task methods over any number of texts: batched, padded to length
buckets, the tokenizer built once; the results do not depend on the batching,
keep the order of the texts, and an empty list gives an empty answer."""

import keras
import numpy as np
import pytest

from keras_attn.models import (
    RNNTranslator,
    TextClassifier,
    TransformerLanguageModel,
    TransformerTranslator,
    _task,
)

pytestmark = pytest.mark.tf_only  # the tokenizers run TensorFlow Text

CONTEXT = 32  # the language model's


@pytest.fixture(scope="module")
def texts(english_sentences):
    """13 texts of many lengths, an empty one and a repeated one among them."""
    picked = sorted(set(english_sentences), key=len)[::4][:11]
    return [picked[5], "", *picked, picked[5]]


@pytest.fixture(scope="module")
def models(small_tokenizer):
    vocabulary = small_tokenizer.vocabulary_size
    tokenizers = {
        "source_tokenizer": small_tokenizer,
        "target_tokenizer": small_tokenizer,
    }
    return {
        "transformer": TransformerTranslator(
            vocabulary, vocabulary, sequence_length=17, embedding_dim=16,
            num_encoder_layers=1, num_decoder_layers=1, num_heads=2,
            intermediate_dim=32, shared_vocabulary=True, **tokenizers,
        ),
        "rnn": RNNTranslator(vocabulary, vocabulary, embedding_dim=8, units=12,
                             **tokenizers),
        "classifier": TextClassifier(
            vocabulary, 24, embedding_dim=8, num_layers=1, num_heads=2,
            intermediate_dim=16, pooling="attention", tokenizer=small_tokenizer,
        ),
        "language_model": TransformerLanguageModel(
            vocabulary, CONTEXT, embedding_dim=16, num_layers=1, num_heads=2,
            intermediate_dim=32, tokenizer=small_tokenizer,
        ),
    }  # fmt: skip


def answers(models, texts, **batching):
    """Every task method's answer to `texts`, as plain Python / NumPy."""
    lm = models["language_model"]
    return {
        "transformer": models["transformer"].translate(texts, 2, **batching),
        "rnn": models["rnn"].translate(texts, 2, max_length=12, **batching),
        "classify": models["classifier"].classify(texts, **batching),
        "generate": lm.generate(texts, max_new_tokens=4, **batching),
        "score": lm.score(texts, **batching),
    }


def assert_same(got, want):
    for name in ("transformer", "rnn", "generate"):
        assert got[name] == want[name], name
    np.testing.assert_allclose(
        got["classify"]["positive_probability"],
        want["classify"]["positive_probability"],
        atol=1e-5,
    )
    assert got["classify"]["label"] == want["classify"]["label"]
    np.testing.assert_allclose(
        got["score"]["log_likelihood"], want["score"]["log_likelihood"], rtol=1e-4
    )
    np.testing.assert_array_equal(
        got["score"]["num_tokens"], want["score"]["num_tokens"]
    )


def test_batch_sizes_give_the_same_answers_in_the_order_of_the_texts(models, texts):
    default = answers(models, texts)
    assert len(default["transformer"]) == len(default["generate"]) == len(texts)
    assert default["classify"]["positive_probability"].shape == (len(texts),)
    assert_same(answers(models, texts, batch_size=1, verbose=0), default)
    assert_same(answers(models, texts, batch_size=7, verbose=0), default)
    # Each text answered alone gives its own answer: the order is kept.
    for index in (0, 1, 3, len(texts) - 1):
        alone = answers(models, texts[index])
        assert alone["transformer"] == default["transformer"][index : index + 1]
        assert alone["generate"] == default["generate"][index : index + 1]
        np.testing.assert_allclose(
            alone["classify"]["positive_probability"],
            default["classify"]["positive_probability"][index : index + 1],
            atol=1e-5,
        )
        np.testing.assert_allclose(
            alone["score"]["log_likelihood"],
            default["score"]["log_likelihood"][index : index + 1],
            rtol=1e-4,
        )
    # The repeated text gets the same answer both times.
    assert default["transformer"][0] == default["transformer"][-1]
    assert default["score"]["num_tokens"][1] == 1  # "": the end token alone


def test_the_classifier_reads_padding_to_any_bucket_as_before(models, texts):
    """The bucketed batches answer what the whole list padded to
    `sequence_length` answers (the method's result before it batched)."""
    classifier = models["classifier"]
    ids = classifier.tokenizer.tokenize(texts)[:, :24].to_tensor(shape=[None, 24])
    want = np.asarray(classifier(np.asarray(ids)))[:, 0]
    got = classifier.classify(texts, batch_size=5)["positive_probability"]
    np.testing.assert_allclose(got, want, atol=1e-5)
    scores = models["language_model"].score_strings(texts)  # one padded batch
    np.testing.assert_allclose(
        models["language_model"].score(texts, batch_size=3)["log_likelihood"],
        np.asarray(scores["log_likelihood"]),
        rtol=1e-4,
    )


def test_an_empty_list_gets_an_empty_answer(models):
    empty = answers(models, [])
    assert empty["transformer"] == empty["rnn"] == empty["generate"] == []
    assert empty["classify"]["positive_probability"].shape == (0,)
    assert empty["classify"]["label"] == []
    assert empty["score"]["log_likelihood"].shape == (0,)
    assert empty["score"]["num_tokens"].dtype == np.int32


def test_the_tokenizer_is_built_once_and_rebuilt_when_set(models, small_tokenizer):
    classifier = models["classifier"]
    first = classifier.dense_tokenizer()
    assert classifier.dense_tokenizer() is first
    assert classifier.dense_tokenizer(12) is not first
    assert classifier.dense_tokenizer(12).sequence_length == 12
    assert classifier.dense_tokenizer() is first
    other = type(small_tokenizer).from_config(small_tokenizer.get_config())
    classifier.tokenizer = other
    try:
        rebuilt = classifier.dense_tokenizer()
        assert rebuilt is not first and rebuilt.sequence_length == 24
    finally:
        classifier.tokenizer = small_tokenizer


def test_batches_are_padded_to_length_buckets(models, texts):
    """Sources are padded to a few widths, not to `max_length` and not to
    every distinct length: one compiled decoding per width."""
    rnn = models["rnn"]
    rnn.__dict__.pop("_task_cache", None)  # the kept compiled functions
    rnn.translate(texts, 1, max_length=100, batch_size=2, verbose=0)
    widths = {key[-1] for key in rnn.__dict__["_task_cache"] if key[0] == "decoding"}
    lengths = np.asarray(rnn.source_tokenizer.tokenize(texts).row_lengths())
    assert widths <= {8, 16, 32, 64} and len(widths) < len(set(lengths)), widths
    assert max(widths) == _task.bucket_length(lengths.max())
    assert [_task.bucket_length(n) for n in (0, 1, 8, 9, 100, 129, 300)] == [
        8,
        8,
        8,
        16,
        128,
        256,
        384,
    ]
    assert _task.bucket_length(20, cap=17) == 17
    ids = _task.padded_ids(np.array([[5, 6, 0, 0, 0], [7, 0, 0, 0, 0]]), cap=4)
    assert ids.shape == (2, 4) and ids.tolist()[0] == [5, 6, 0, 0]
    assert _task.padded_ids(np.zeros((3, 0), "int32")).shape == (3, 8)


def test_a_progress_bar_for_more_than_one_batch(models, texts, capsys):
    classifier = models["classifier"]
    classifier.classify(texts, batch_size=4)  # verbose="auto": 4 batches
    shown = capsys.readouterr().out
    assert "Classifying:" in shown and "4/4" in shown
    classifier.classify(texts)  # one batch: no bar
    assert capsys.readouterr().out == ""
    classifier.classify(texts, batch_size=4, verbose=2)
    assert "4/4" in capsys.readouterr().out
    classifier.classify(texts, batch_size=4, verbose=0)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(
    "method, arguments",
    [
        ("classify", {"batch_size": 0}),
        ("classify", {"batch_size": 2.5}),
        ("classify", {"verbose": "yes"}),
        ("classify", {"threshold": "high"}),
        ("translate", {"batch_size": -1}),
        ("generate", {"batch_size": True}),
        ("score", {"verbose": 3}),
    ],
)
def test_bad_batching_arguments(models, method, arguments):
    model = models["transformer" if method == "translate" else "classifier"]
    if method in ("generate", "score"):
        model = models["language_model"]
    ((name, value),) = arguments.items()
    with pytest.raises(ValueError, match=rf"`{name}`.*Received: {name}={value!r}"):
        getattr(model, method)(["a text"], **arguments)


def test_translate_defaults_to_what_the_positions_allow(models):
    transformer = models["transformer"]  # sequence_length 17: 16 target tokens
    assert transformer.max_length_limit() == 16
    assert models["rnn"].max_length_limit() is None
    assert transformer.translate(["Where is the station?"], 1) == transformer.translate(
        ["Where is the station?"], 1, max_length=16
    )
    with pytest.raises(ValueError, match="Received: max_length=17"):
        transformer.translate(["Where is the station?"], max_length=17)


# -- generate: how many new tokens, and what a long prompt keeps --------------


def test_generate_fills_the_context_by_default(models, small_tokenizer):
    lm = models["language_model"]
    (completion,) = lm.generate(["To be, or not"])  # raised with a default of 64
    assert isinstance(completion, str)
    ids = small_tokenizer.tokenize(["To be, or not", "the house"])
    prompt_tokens = np.asarray(ids.row_lengths())
    new = lm.continue_ids(ids)  # the start token, the prompt, then new tokens
    np.testing.assert_array_equal(
        np.asarray(new.row_lengths()), CONTEXT - 1 - prompt_tokens
    )
    new = lm.continue_ids(ids, max_new_tokens=5)
    np.testing.assert_array_equal(np.asarray(new.row_lengths()), [5, 5])


def test_a_long_prompt_keeps_its_last_tokens(models, small_tokenizer):
    lm = models["language_model"]
    long_prompt = " ".join(["the station is near the house"] * 10)
    ids = small_tokenizer.tokenize([long_prompt])
    assert int(ids.row_lengths()[0]) > CONTEXT
    # Default: its last CONTEXT - 2 tokens, and one new token.
    new = lm.continue_ids(ids)
    assert np.asarray(new.row_lengths()).tolist() == [1]
    np.testing.assert_array_equal(
        new.to_tensor(), lm.continue_ids(ids[:, -(CONTEXT - 2) :]).to_tensor()
    )
    # max_new_tokens=N: its last CONTEXT - 1 - N tokens.
    new = lm.continue_ids(ids, max_new_tokens=10)
    np.testing.assert_array_equal(
        new.to_tensor(),
        lm.continue_ids(ids[:, -(CONTEXT - 11) :], max_new_tokens=10).to_tensor(),
    )
    # CONTEXT - 1 new tokens: the prompt keeps nothing, the start token stays.
    assert len(lm.generate([long_prompt], max_new_tokens=CONTEXT - 1)) == 1
    with pytest.raises(ValueError, match=f"Received: max_new_tokens={CONTEXT}"):
        lm.generate(["To be"], max_new_tokens=CONTEXT)


# -- valid UTF-8 out ------------------------------------------------------------


class _BadBytes:
    """A tokenizer whose detokenized text is not valid UTF-8."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def tokenize(self, texts):
        return self.tokenizer.tokenize(texts)

    def get_config(self):
        return self.tokenizer.get_config()

    def detokenize(self, ids):
        import tensorflow as tf

        rows = tf.shape(ids)[0] if not isinstance(ids, tf.RaggedTensor) else ids.nrows()
        return tf.fill([rows], b"ok \xc3\x28 \xff\xfe")


def test_generated_text_is_always_valid_utf8(models, small_tokenizer, tmp_path):
    from keras_attn.text import SubwordTokenizer, train_subword_vocabulary
    from keras_attn.text.preprocessors import decoded

    lm = models["language_model"]
    lm.tokenizer = _BadBytes(small_tokenizer)
    try:
        assert (
            lm.generate(["To be", "x"], max_new_tokens=2)
            == ["ok \ufffd( \ufffd\ufffd"] * 2
        )
    finally:
        lm.tokenizer = small_tokenizer
    # A byte-level vocabulary's byte pieces that are no UTF-8 text decode to
    # U+FFFD (byte 0xC3 starts a two-byte character that 0x28 does not end).
    text = "KING: Where is the house?\nQUEEN: The house is near the station.\n" * 20
    tokenizer = SubwordTokenizer(
        train_subword_vocabulary(
            [text], tmp_path / "bytes.model", vocabulary_size=300, lossless=True
        )
    )
    pieces = {piece: i for i, piece in enumerate(tokenizer.get_vocabulary())}
    ids = [[pieces["<0xC3>"], pieces["<0x28>"], pieces["<0xFF>"]]]
    assert decoded(tokenizer.detokenize(np.array(ids, "int32"))) == ["\ufffd(\ufffd"]
    assert decoded([b"\xc3\x28", "already text"]) == ["\ufffd(", "already text"]


def test_classify_compiles_its_network_once_per_width_and_reads_new_weights(
    small_tokenizer, monkeypatch
):
    """Batches of any size and width bucket 8 trace the network once (a
    `tf.function` per width, kept); weights set later are read, not the
    ones of the trace."""
    classifier = TextClassifier(
        small_tokenizer.vocabulary_size, 24, embedding_dim=8, num_layers=1,
        num_heads=2, intermediate_dim=16, tokenizer=small_tokenizer,
    )  # fmt: skip
    traces = []
    call = classifier.call
    monkeypatch.setattr(
        classifier,
        "call",
        lambda *args, **kwargs: traces.append(1) or call(*args, **kwargs),
    )
    short = ["a house", "the dog.", "I go"]
    ids = _task.padded_ids(classifier.dense_tokenizer().tokenize(short), 24)
    assert len(short) == 3 and ids.shape == (3, 8)  # one width bucket
    first = classifier.classify(short, batch_size=1)["positive_probability"]
    classifier.classify(short * 30, batch_size=64, verbose=0)
    classifier.classify(short[:2])
    assert len(traces) == 1
    np.testing.assert_allclose(
        first, np.asarray(call(keras.ops.convert_to_tensor(ids)))[:, 0], atol=1e-6
    )
    head = classifier.get_layer("positive_probability")
    head.kernel.assign(np.ones(head.kernel.shape, "float32"))
    again = classifier.classify(short)["positive_probability"]
    np.testing.assert_allclose(
        again, np.asarray(call(keras.ops.convert_to_tensor(ids)))[:, 0], atol=1e-6
    )
    assert not np.allclose(again, first) and len(traces) == 1
