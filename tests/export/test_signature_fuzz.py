"""Every signature of every export, fed hypothesis-drawn strings through the
serve-tag loader (`serving_standin.StandInServer`, the export loaded as TF
Serving loads it): any Unicode with control characters and NUL, bytes that
are not UTF-8, very long texts, batches of 0 to 256 rows.

Each answer has the outputs the signature declares, with its dtypes, one
row per input and the declared sizes past the batch axis; floats are
finite and strings valid UTF-8; and the rows whose input is valid UTF-8
equal what the task method gives in process (`classify`, `translate`,
`generate`, `score` with the export's options) on the text the export reads:
its first `max_chars` characters (`clean_text`: 16 per token kept for the
classifier and the translator, 100,000 for the language model; a text whose
first `16 * max_length` characters hold fewer than `max_length` tokens, e.g.
300 spaces and a word, is served as its cut, not as `classify` reads it).
The task models are the conftest's exports' own: rebuilt with the same
configuration and given the export's weights.

Example counts are `tests/property_settings.py`'s (`KERAS_ATTN_HYPOTHESIS_
PROFILE=large`: ten times as many, random seeds).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from tests.property_settings import property_settings

pytestmark = pytest.mark.tf_only

# ---- what is drawn -------------------------------------------------------

WORDS = (
    "the",
    "station",
    "is",
    "near",
    "house",
    "where",
    "good",
    "film",
    "KING:",
    "To be, or not",
    "Grüße",
    "日本語",
    "🙂",
)
# Control and invisible characters a client may send (NUL among them).
CONTROLS = ("\x00", "\t", "\n", "\r", "\x1b", "\x7f", "\x85", "\u2028", "\ufeff")
# Byte sequences that are not UTF-8: a lone lead byte, continuation bytes,
# an encoded surrogate, an overlong NUL, a code point past U+10FFFF, a cut
# three-byte sequence, bytes that never occur.
BAD_BYTES = (
    b"\xff",
    b"\xfe\xff",
    b"\xc3",
    b"\x80\x80",
    b"\xed\xa0\x80",
    b"\xc0\x80",
    b"\xf4\x90\x80\x80",
    b"\xe2\x82",
)

any_text = st.text(st.characters(exclude_categories=["Cs"]), max_size=40)
word_text = st.lists(
    st.one_of(st.sampled_from(WORDS), st.sampled_from(CONTROLS)), max_size=12
).map(" ".join)
utf8 = functools.partial(str.encode, encoding="utf-8")
rows = st.one_of(
    any_text.map(utf8),
    word_text.map(utf8),
    st.binary(max_size=40),  # mostly not UTF-8
    st.tuples(any_text.map(utf8), st.sampled_from(BAD_BYTES), word_text.map(utf8)).map(
        b"".join
    ),
)
# 0 to 8 rows mostly; sometimes up to 256 (a few distinct rows repeated).
batches = st.one_of(
    st.lists(rows, max_size=8),
    st.lists(rows, max_size=8),
    st.tuples(st.lists(rows, min_size=1, max_size=4), st.integers(9, 256)).map(
        lambda drawn: [drawn[0][i % len(drawn[0])] for i in range(drawn[1])]
    ),
)
# Very long rows: 1,000 to 10,000 characters of a drawn unit.
long_rows = st.tuples(
    st.one_of(any_text, word_text).filter(bool), st.integers(1_000, 10_000)
).map(lambda drawn: utf8((drawn[0] * (drawn[1] // len(drawn[0]) + 1))[: drawn[1]]))

NASTY = [
    b"",
    b"   \t  ",
    b"\x00",
    b"a\x00b",
    "Grüße aus Köln! \u2028\x85\ufeff".encode(),
    b"bad bytes \xff\xfe here",
    b"\xc3\x28",
    b"\xed\xa0\x80",
    b"\xf4\x90\x80\x80",
    "\U0010ffff\ufffe\uffff".encode(),
    " ".join(WORDS).encode(),
]

# ---- the exports and their task models ------------------------------------

# (export fixture, signature, input) for every signature the exports serve.
SIGNATURES = [
    ("sentiment", "serving_default", "text"),
    ("translator", "serving_default", "text"),
    ("translator", "translate_with_alignment", "text"),
    ("language_model", "serving_default", "prompt"),
    ("language_model", "score", "text"),
]
# Texts the in-process score is not asked for: it scores a long text window
# by window eagerly (minutes for 10,000 tokens); the served rows are still
# checked (shapes, dtypes, finite).
SCORE_REFERENCE_MAX_BYTES = 2_000
# `score` scores a text whole (up to 100,000 characters), about 0.5 ms per
# token here: its long rows are cut to this many characters (up to ~16,000
# tokens of byte pieces).
SCORE_LONG_CHARS = 4_000


def _give_weights(model, path):
    """`model` (built as the conftest built the export's) with the export's
    weights, in the order the export tracked them."""
    import tensorflow as tf

    saved = list(tf.saved_model.load(str(path)).variables)
    ours = list(model.variables)
    shapes = [tuple(v.shape) for v in ours], [tuple(v.shape) for v in saved]
    assert shapes[0] == shapes[1], (
        "the model rebuilt here no longer matches the export of "
        "tests/export/conftest.py: keep their configurations the same"
    )
    for variable, value in zip(ours, saved, strict=True):
        assert variable.path.split("/")[-1] == value.name.split("/")[-1][:-2]
        variable.assign(value.numpy())
    return model


class Served:
    """One export: its stand-in server, metadata and rebuilt task model."""

    def __init__(self, path, model):
        from keras_attn.export._common import read_metadata
        from serving_standin import StandInServer

        self.path = path
        self.metadata = read_metadata(path)
        self.server = StandInServer(path)
        self.model = _give_weights(model, path)

    def ask(self, signature, input_name, batch):
        from keras_attn.export._predict import response_arrays
        from serving_standin import predict_request

        request = predict_request(
            self.server.model_name, signature, {input_name: batch}
        )
        return response_arrays(self.server.predict(request))


@pytest.fixture(scope="module")
def served(
    small_tokenizer,
    small_sentiment_export,
    small_translator_export,
    small_language_model_export,
):
    from keras_attn.models import (
        TextClassifier,
        TransformerLanguageModel,
        TransformerTranslator,
    )

    vocabulary = small_tokenizer.vocabulary_size
    # The configurations of tests/export/conftest.py's exports.
    classifier = TextClassifier(
        vocabulary,
        12,
        embedding_dim=16,
        num_layers=1,
        num_heads=2,
        intermediate_dim=32,
        pooling="attention",
        tokenizer=small_tokenizer,
    )
    translator = TransformerTranslator(
        vocabulary,
        vocabulary,
        sequence_length=11,
        embedding_dim=16,
        num_encoder_layers=1,
        num_decoder_layers=1,
        num_heads=2,
        intermediate_dim=32,
        shared_vocabulary=True,
        source_tokenizer=small_tokenizer,
        target_tokenizer=small_tokenizer,
    )
    language_model = TransformerLanguageModel(
        vocabulary,
        sequence_length=16,
        embedding_dim=16,
        num_layers=1,
        num_heads=2,
        intermediate_dim=32,
        tokenizer=small_tokenizer,
    )
    exports = {
        "sentiment": Served(small_sentiment_export, classifier),
        "translator": Served(small_translator_export, translator),
        "language_model": Served(small_language_model_export, language_model),
    }
    yield exports
    for export in exports.values():
        export.server.close()


def test_every_signature_is_fuzzed(served):
    found = sorted(
        (name, signature)
        for name, export in served.items()
        for signature, definition in export.server.meta_graph.signature_def.items()
        if definition.method_name == "tensorflow/serving/predict"
    )
    assert found == sorted((name, signature) for name, signature, _ in SIGNATURES)


# ---- the task methods in process ------------------------------------------

# A filler row makes every in-process batch as wide as the export's longest
# (one compiled width per method instead of one per bucket); each text's
# answer does not depend on the batching.
FILLER = "the station is near the house " * 8


def _max_chars(name, metadata):
    # keras_attn/export/sentiment.py and translator.py: clean_text(text,
    # 16 * max_length); language_model.py: export_language_model's max_chars.
    if name == "language_model":
        return 100_000
    return 16 * metadata["max_length"]


def reference(export_name, signature, export, texts):
    """`{output: list of rows}` of the task method in process for `texts`
    (valid UTF-8, as `str`), with the export's options."""
    model, metadata = export.model, export.metadata
    texts = [text[: _max_chars(export_name, metadata)] for text in texts]
    if export_name == "sentiment":
        found = model.classify(
            [*texts, FILLER],
            max_length=metadata["max_length"],
            threshold=metadata["threshold"],
            verbose=0,
        )
        return {name: list(value)[:-1] for name, value in found.items()}
    if export_name == "translator":
        translations = model.translate(
            [*texts, FILLER],
            beam_width=metadata["beam_width"],
            length_penalty=metadata["length_penalty"],
            max_length=metadata["max_length"],
            verbose=0,
        )[:-1]
        if signature == "serving_default":
            return {"translation": translations}
        # translate_with_alignment: the source pieces as the model reads
        # them; the rest is checked against the alignment's own rules.
        pieces = np.asarray(model.source_tokenizer.get_vocabulary(), dtype=object)
        ids = np.asarray(model.source_ids(texts, metadata["max_length"]))
        tokens = np.where(ids != 0, pieces[ids], "")
        return {
            "translation": translations,
            "source_tokens": [list(row) for row in tokens],
        }
    if signature == "serving_default":
        return {
            "completion": model.generate(
                [*texts, FILLER],
                max_new_tokens=metadata["max_new_tokens"],
                verbose=0,
            )[:-1]
        }
    from keras_attn.memory import ContinuousCache

    cache = metadata["continuous_cache"]
    cache = cache and ContinuousCache(
        theta=cache["theta"], lam=cache["lambda"], window=cache["window"]
    )
    found = model.score(texts, continuous_cache=cache, verbose=0)
    return {name: list(value) for name, value in found.items()}


# ---- the checks -----------------------------------------------------------


def check_answer(export_name, signature, export, batch, outputs):
    """Declared outputs, dtypes and shapes; finite floats; valid UTF-8; the
    task method's answer for the rows that are valid UTF-8."""
    import tensorflow as tf

    definition = export.server.meta_graph.signature_def[signature]
    assert sorted(outputs) == sorted(definition.outputs)
    for name, value in outputs.items():
        info = definition.outputs[name]
        dims = [dim.size for dim in info.tensor_shape.dim]
        assert value.ndim == len(dims), (name, value.shape, dims)
        assert value.shape[0] == len(batch), (name, value.shape)
        for got, want in zip(value.shape[1:], dims[1:], strict=True):
            assert want in (-1, got), (name, value.shape, dims)
        dtype = tf.dtypes.as_dtype(info.dtype)
        if dtype == tf.string:
            assert value.dtype == object, (name, value.dtype)
            for item in value.reshape(-1):
                item.decode("utf-8")  # strict: raises on invalid UTF-8
        else:
            assert value.dtype == dtype.as_numpy_dtype, (name, value.dtype)
            if value.dtype.kind == "f":
                assert np.isfinite(value).all(), name
    if signature == "translate_with_alignment":
        check_alignment(outputs)

    valid = {}
    for row, item in enumerate(batch):
        try:
            text = item.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if signature == "score" and len(item) > SCORE_REFERENCE_MAX_BYTES:
            continue
        valid.setdefault(text, row)
    if not valid:
        return
    texts = list(valid)
    expected = reference(export_name, signature, export, texts)
    for name, want in expected.items():
        got = outputs[name][[valid[text] for text in texts]]
        if got.dtype == object:
            got = [
                [piece.decode("utf-8") for piece in row]
                if isinstance(row, np.ndarray)
                else row.decode("utf-8")
                for row in got
            ]
            want = [
                [str(p) for p in row] if isinstance(row, list) else row for row in want
            ]
            assert got == want, name
        elif name == "num_tokens":
            np.testing.assert_array_equal(got, np.asarray(want), err_msg=name)
        elif name == "positive_probability":
            # Padded to max_length here, to a bucket in process: float
            # rounding apart, the same probability.
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-6, err_msg=name)
        else:  # log-likelihoods: sums over up to a few hundred tokens
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-4, err_msg=name)


def check_alignment(outputs):
    """Rows past a translation's end and columns past its source's are
    zero; a real token's row sums to 1 over a non-empty source."""
    alignment = outputs["alignment"]
    assert ((alignment >= 0) & (alignment <= 1 + 1e-6)).all()
    real_target = outputs["translation_tokens"] != b""
    real_source = outputs["source_tokens"] != b""
    np.testing.assert_array_equal(alignment[~real_target], 0.0)
    for row in range(alignment.shape[0]):
        assert np.all(alignment[row][:, ~real_source[row]] == 0.0)
        sums = alignment[row][real_target[row]].sum(-1)
        if real_source[row].any():
            np.testing.assert_allclose(sums, 1.0, atol=1e-3)
        else:
            np.testing.assert_array_equal(sums, 0.0)


# ---- the tests ------------------------------------------------------------


@pytest.mark.parametrize(("export_name", "signature", "input_name"), SIGNATURES)
@property_settings(8)
@given(batch=batches)
@example(batch=[])
@example(batch=NASTY)
@example(batch=[NASTY[i % len(NASTY)] for i in range(256)])
def test_drawn_strings(served, export_name, signature, input_name, batch):
    export = served[export_name]
    outputs = export.ask(signature, input_name, batch)
    check_answer(export_name, signature, export, batch, outputs)


@pytest.mark.parametrize(("export_name", "signature", "input_name"), SIGNATURES)
@property_settings(1)
@given(long_row=long_rows, others=st.lists(rows, max_size=2))
@example(long_row=b" " * 300 + b"a good film", others=[])
def test_very_long_strings(
    served, export_name, signature, input_name, long_row, others
):
    export = served[export_name]
    if signature == "score":  # scores every token: cost linear in the length
        long_row = long_row.decode("utf-8")[:SCORE_LONG_CHARS].encode("utf-8")
    batch = [long_row, *others]
    outputs = export.ask(signature, input_name, batch)
    check_answer(export_name, signature, export, batch, outputs)


@pytest.mark.parametrize(("export_name", "signature", "input_name"), SIGNATURES)
@property_settings(3)
@given(
    shape=st.lists(st.integers(0, 3), max_size=3).filter(lambda shape: len(shape) != 1)
)
@example(shape=[1, 2])  # a REST body of [["a", "b"]]: was answered with 2 rows
@example(shape=[])  # {"inputs": "a"}: was answered with 1 row
@example(shape=[1, 0])  # [[]]: was answered with 0 rows
def test_strings_of_another_rank_are_refused(
    served, export_name, signature, input_name, shape
):
    """TF Serving feeds a request's tensor whatever its shape; a signature of
    strings `[batch]` refuses any other rank (INVALID_ARGUMENT: HTTP 400)
    rather than answer for another batch size, and the next request is
    answered as before."""
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2

    from keras_attn.export._predict import PredictError

    export = served[export_name]
    before = export.ask(signature, input_name, [b"where is the house"])
    request = predict_pb2.PredictRequest()
    request.model_spec.name = export.server.model_name
    request.model_spec.signature_name = signature
    values = np.full(shape, b"a good film", dtype=object)
    request.inputs[input_name].CopyFrom(tf.make_tensor_proto(values, dtype=tf.string))
    with pytest.raises(PredictError) as error:
        export.server.predict(request)
    assert error.value.code == "INVALID_ARGUMENT"
    assert "is not compatible with expected shape [?]" in error.value.message
    after = export.ask(signature, input_name, [b"where is the house"])
    for name, value in before.items():
        np.testing.assert_array_equal(after[name], value, err_msg=name)
