"""Exports in a cheaper precision (`export(..., precision=...)`, built on
`keras_attn.models.precision.with_precision`), and the served classifier's
batch padded to its longest text."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_attn.export import check_servable
from keras_attn.models import TextClassifier, TransformerLanguageModel
from keras_attn.models._task import without_padding_columns
from keras_attn.models.precision import PRECISIONS, with_precision

pytestmark = pytest.mark.tf_only  # the tokenizers and exports run TensorFlow

MAX_LENGTH = 16
TEXTS = [
    "the plot is thin and the jokes fall flat",
    "a gorgeous witty film",
    "",
    "where is the station? " * 10,  # longer than MAX_LENGTH tokens
]
# How far each precision's probability may move from float32's on these
# random weights (bfloat16 keeps 8 bits of mantissa; int8 and int4 quantize
# every kernel and the embedding per channel or group).
TOLERANCE = {"float32": 1e-6, "bfloat16": 0.02, "int8": 0.03, "int4": 0.15}


def random_weights(model, seed=0, scale=0.1):
    rng = np.random.default_rng(seed)
    model.set_weights(
        [
            rng.normal(size=w.shape, scale=scale).astype(w.dtype)
            for w in model.get_weights()
        ]
    )


@pytest.fixture(scope="module")
def classifier(small_tokenizer):
    model = TextClassifier(
        small_tokenizer.vocabulary_size, MAX_LENGTH, embedding_dim=64,
        num_layers=2, num_heads=4, intermediate_dim=256, tokenizer=small_tokenizer,
    )  # fmt: skip
    random_weights(model)
    return model


@pytest.fixture(scope="module")
def exports(classifier, tmp_path_factory):
    """`{precision: version directory}` of the classifier's exports."""
    base = tmp_path_factory.mktemp("exports")
    return {
        precision: classifier.export(
            base,
            model_name=f"sentiment_{precision}",
            max_length=MAX_LENGTH,
            precision=precision,
        )
        for precision in PRECISIONS
    }


def test_with_precision_refuses_what_it_cannot_convert(classifier):
    with pytest.raises(ValueError, match=r"`precision` must be one of .*float16"):
        with_precision(classifier, "float16")
    with pytest.raises(ValueError, match="precision=None"):
        with_precision(classifier, None)
    with pytest.raises(ValueError, match="`task` must be a keras_attn task"):
        with_precision(keras.Sequential([keras.layers.Dense(1)]), "int8")
    quantized = with_precision(classifier, "int8")
    with pytest.raises(ValueError, match="must not be quantized already"):
        with_precision(quantized, "bfloat16")
    with pytest.raises(ValueError, match=r"`precision` must be one of"):
        classifier.export("unused", precision="int2")


def test_a_bfloat16_copy_holds_bfloat16_weights_and_leaves_the_task(classifier):
    before = [np.array(w) for w in classifier.get_weights()]
    copy = with_precision(classifier, "bfloat16")
    assert copy is not classifier and copy.tokenizer is classifier.tokenizer
    # The weights (not the seed generators' int64 states).
    dtypes = {v.path: v.dtype for v in copy.variables if "float" in v.dtype}
    head = [path for path in dtypes if path.startswith("positive_probability")]
    assert head and all(dtypes[path] == "float32" for path in head)  # the head
    assert {dtypes[p] for p in dtypes if p not in head} == {"bfloat16"}
    # The task itself is untouched: float32, the same weights.
    assert {v.dtype for v in classifier.variables if "float" in v.dtype} == {"float32"}
    for want, got in zip(before, classifier.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)
    # Its answers are the float32 ones to bfloat16's precision.
    want = classifier.classify(TEXTS)["positive_probability"]
    got = copy.classify(TEXTS)["positive_probability"]
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=TOLERANCE["bfloat16"])


@pytest.mark.slow  # four exports; the conversion itself is tested above
@pytest.mark.parametrize("precision", PRECISIONS)
def test_each_precision_exports_servably_with_close_answers(
    classifier, exports, precision
):
    path = exports[precision]
    metadata = json.loads((path / "assets.extra" / "keras_attn.json").read_text())
    assert metadata["precision"] == precision
    if precision in ("bfloat16", "int8"):  # all four: the large release test
        report = check_servable(path, verbose=False)  # an Xla* op would fail it
        assert report.ok, str(report)
        assert report.warmup["records"] > 0 and not report.warmup["errors"]
    serve = tf.saved_model.load(str(path)).signatures["serving_default"]
    got = serve(text=tf.constant(TEXTS))["positive_probability"].numpy()
    want = classifier.classify(TEXTS)["positive_probability"]
    error = np.abs(got - want).max()
    assert error <= TOLERANCE[precision], error
    if precision != "float32":  # the cheaper copy answers otherwise
        assert error > 0


@pytest.mark.slow
def test_cheaper_exports_hold_fewer_bytes(exports):
    def variables_bytes(path):
        return sum(f.stat().st_size for f in (path / "variables").iterdir())

    size = {precision: variables_bytes(path) for precision, path in exports.items()}
    assert size["bfloat16"] < 0.6 * size["float32"]
    assert size["int8"] < 0.4 * size["float32"]
    assert size["int4"] < size["int8"]


@pytest.mark.slow
def test_a_language_model_exports_in_int8(small_tokenizer, tmp_path):
    model = TransformerLanguageModel(
        small_tokenizer.vocabulary_size, 16, embedding_dim=32, num_layers=1,
        num_heads=2, intermediate_dim=64, tokenizer=small_tokenizer,
    )  # fmt: skip
    random_weights(model)
    path = model.export(tmp_path, precision="int8")
    assert (
        json.loads((path / "assets.extra" / "keras_attn.json").read_text())["precision"]
        == "int8"
    )
    report = check_servable(path, verbose=False)
    assert report.ok, str(report)
    score = tf.saved_model.load(str(path)).signatures["score"]
    got = score(text=tf.constant(TEXTS[:2]))["log_likelihood"].numpy()
    want = model.score(TEXTS[:2])["log_likelihood"]
    np.testing.assert_allclose(got, want, rtol=0.05)
    assert not np.allclose(got, want, rtol=1e-6)


def test_padding_columns_are_cut_to_the_longest_row():
    ids = tf.constant([[5, 6, 7, 0, 0, 0], [8, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(without_padding_columns(ids), [[5, 6, 7], [8, 0, 0]])
    # A batch of empty rows, or no rows, keeps one column.
    assert without_padding_columns(tf.zeros([2, 6], tf.int32)).shape == (2, 1)
    assert without_padding_columns(tf.zeros([0, 6], tf.int32)).shape == (0, 1)
    traced = tf.function(
        without_padding_columns,
        input_signature=[tf.TensorSpec([None, None], tf.int32)],
    )
    np.testing.assert_array_equal(traced(ids), [[5, 6, 7], [8, 0, 0]])


def test_the_served_batch_answers_as_one_padded_to_max_length(classifier):
    """`classify_strings` (the export's signature) pads a batch to its
    longest text: the probabilities of the ids padded to `max_length`."""
    tokenizer = classifier.dense_tokenizer(MAX_LENGTH)
    for texts in (TEXTS, TEXTS[1:2], ["", ""]):
        got = classifier.classify_strings(tf.constant(texts), MAX_LENGTH)
        ids = np.asarray(tokenizer.tokenize(texts))  # (B, MAX_LENGTH)
        want = np.asarray(classifier(ids))[:, 0]
        np.testing.assert_allclose(got["positive_probability"], want, atol=1e-6)
