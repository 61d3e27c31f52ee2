import json
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from keras_attn.export import check_servable, export_sentiment
from keras_attn.models import TextClassifier, TextClassifierEnsemble
from tests.export.conftest import assert_bad_requests_leave_no_trace, nasty_batch
from tests.layers.test_serving_mode import serving_layouts

pytestmark = pytest.mark.tf_only

MAX_LENGTH = 12


@pytest.fixture(scope="module")
def exported(small_tokenizer, tmp_path_factory):
    model = TextClassifier(
        small_tokenizer.vocabulary_size,
        MAX_LENGTH,
        embedding_dim=16,
        num_layers=1,
        num_heads=2,
        intermediate_dim=32,
        pooling="attention",
        tokenizer=small_tokenizer,
    )
    base = tmp_path_factory.mktemp("export")
    path = model.export(base, max_length=MAX_LENGTH)
    return model, small_tokenizer, base, path


def test_layout_metadata_and_servability(exported):
    model, tokenizer, base, path = exported
    assert path == base / "sentiment" / "1"
    assert (path / "saved_model.pb").is_file()
    assert (path / "assets" / "sentiment.model").read_bytes() == tokenizer.proto
    metadata = json.loads((path / "assets.extra" / "keras_attn.json").read_text())
    assert metadata["signatures"]["serving_default"]["outputs"] == {
        "positive_probability": "float32 [batch]",
        "label": "string [batch]",
    }
    report = check_servable(path, verbose=False)
    assert report.ok, str(report)
    assert report.text_ops == ["SentencepieceOp", "SentencepieceTokenizeOp"]
    # Each weight is saved once (Keras' ExportArchive wrote each one twice).
    entries = tf.train.load_checkpoint(str(path / "variables" / "variables"))
    saved = sum(
        int(np.prod(shape))
        for name, shape in entries.get_variable_to_shape_map().items()
        if name != "_CHECKPOINTABLE_OBJECT_GRAPH"
    )
    assert saved == sum(int(np.prod(v.shape)) for v in model.variables)
    assert "serving_default" in report.cli_summary
    # The next export goes to version 2; an existing version is never replaced.
    assert export_sentiment(model, base, max_length=MAX_LENGTH).name == "2"
    with pytest.raises(ValueError, match="versions are immutable"):
        export_sentiment(model, base, version=1)


def test_signature_matches_the_keras_model(exported):
    model, tokenizer, _, path = exported
    serve = tf.saved_model.load(str(path)).signatures["serving_default"]
    texts = ["the plot is thin", "a gorgeous witty film"]
    outputs = serve(text=tf.constant(texts))
    ids = tokenizer.tokenize(texts).to_tensor(shape=[None, MAX_LENGTH])
    expected = np.asarray(model(ids))[:, 0]
    np.testing.assert_allclose(
        outputs["positive_probability"].numpy(), expected, atol=1e-5
    )
    labels = [b"positive" if p > 0.5 else b"negative" for p in expected]
    assert list(outputs["label"].numpy()) == labels


def test_the_export_is_traced_in_serving_mode(exported):
    """The saved graph (traced again by `tf.saved_model.save`) holds the
    serving layouts: the encoder's real-token rows and the heads moved as
    integers; a batch of texts of mixed lengths answers as the Keras model
    does for each text alone."""
    from tensorflow.core.protobuf import saved_model_pb2

    model, tokenizer, _, path = exported
    saved = saved_model_pb2.SavedModel()
    saved.ParseFromString((path / "saved_model.pb").read_bytes())
    graph = saved.meta_graphs[0].graph_def
    assert serving_layouts(graph) == {"rows", "bitcast"}
    texts = ["a", "the plot is thin and slow", "", "a gorgeous witty film"]
    served = tf.saved_model.load(str(path)).signatures["serving_default"]
    probabilities = served(text=tf.constant(texts))["positive_probability"].numpy()
    alone = [
        np.asarray(model(tokenizer.tokenize([t]).to_tensor(shape=[1, MAX_LENGTH])))[
            0, 0
        ]
        for t in texts
    ]  # each text alone, padded to `max_length`
    np.testing.assert_allclose(probabilities, alone, atol=1e-5)


def test_bad_input_on_the_export(exported):
    _, _, _, path = exported
    serve = tf.saved_model.load(str(path)).signatures["serving_default"]
    batch = nasty_batch()
    outputs = serve(text=tf.constant(batch))
    probability = outputs["positive_probability"].numpy()
    assert probability.shape == (len(batch),) and np.isfinite(probability).all()
    assert set(outputs["label"].numpy()) <= {b"positive", b"negative"}
    # A 10,000-character text is truncated: it scores like its first tokens.
    long_text = outputs["positive_probability"].numpy()[2]
    short = serve(text=tf.constant(["word " * 40]))["positive_probability"].numpy()
    np.testing.assert_allclose(long_text, short[0], atol=1e-6)
    empty = serve(text=tf.zeros([0], tf.string))
    assert empty["positive_probability"].shape == (0,)
    assert empty["label"].shape == (0,)
    big = serve(text=tf.constant(["good film"] * 256))
    assert big["positive_probability"].shape == (256,)


def test_bad_requests_through_the_serve_tag_loader_leave_no_trace(exported):
    from serving_standin import StandInServer

    _, _, _, path = exported
    with StandInServer(path) as server:
        assert_bad_requests_leave_no_trace(
            server, "serving_default", "text", ["the plot is thin", "a witty film"]
        )


# the check itself is tested in tests/export/test_check.py; this runs its command line
@pytest.mark.slow
def test_cli_check(exported):
    _, _, _, path = exported
    result = subprocess.run(  # the model directory: its highest version
        [sys.executable, "-m", "keras_attn.export", "check", str(path.parent)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"SERVABLE: {path.parent}/" in result.stdout
    assert "serving_default" in result.stdout and "serve-tag load" in result.stdout


def test_check_fails_when_the_export_disagrees_with_the_model(exported, tmp_path):
    import shutil

    _, _, _, path = exported
    copy = tmp_path / "sentiment" / "1"
    shutil.copytree(path, copy)
    metadata_path = copy / "assets.extra" / "keras_attn.json"
    metadata = json.loads(metadata_path.read_text())
    outputs = metadata["sample_outputs"]["serving_default"]
    outputs["positive_probability"][0] += 0.1
    metadata_path.write_text(json.dumps(metadata))
    report = check_servable(copy, verbose=False)
    assert not report.ok
    assert any("tf2 loader" in p for p in report.problems)
    assert any("tf1 loader" in p for p in report.problems)


# Slow: the check's report and CLI: test_layout_metadata_and_servability, test_cli_check
@pytest.mark.slow
def test_check_prints_rest_requests_and_the_served_responses(exported):
    model, tokenizer, _, path = exported
    texts = ["the plot is thin", "a gorgeous witty film"]
    report = check_servable(path, verbose=False, examples=texts)
    assert report.ok, str(report)
    ids = tokenizer.tokenize(texts).to_tensor(shape=[None, MAX_LENGTH])
    expected = np.asarray(model(ids))[:, 0]
    labels = ["positive" if p > 0.5 else "negative" for p in expected]
    (url, row_body, row_response), (url2, column_body, column_response) = (
        report.rest_examples
    )
    assert url == url2 == "/v1/models/sentiment:predict"
    assert json.loads(row_body) == {"instances": texts}
    predictions = json.loads(row_response)["predictions"]
    assert [p["label"] for p in predictions] == labels
    np.testing.assert_allclose(
        [p["positive_probability"] for p in predictions], expected, atol=1e-5
    )
    assert json.loads(column_body) == {
        "signature_name": "serving_default",
        "inputs": {"text": texts},
    }
    outputs = json.loads(column_response)["outputs"]
    assert outputs["label"] == labels
    np.testing.assert_allclose(outputs["positive_probability"], expected, atol=1e-5)
    assert "POST /v1/models/sentiment:predict" in str(report)
    with pytest.raises(ValueError, match="examples"):
        check_servable(path, verbose=False, examples="one string")


@pytest.mark.slow  # from_bert's export; tests/models/test_from_bert covers its parts
def test_pretrained_encoder_exports_with_its_wordpiece_tokenizer(tmp_path):
    from keras_attn.checkpoints import load_bert_checkpoint
    from tests.test_case import write_bert_checkpoint

    checkpoint = load_bert_checkpoint(write_bert_checkpoint(tmp_path / "bert"))
    tokenizer = checkpoint.tokenizer(max_length=MAX_LENGTH)
    model = TextClassifier.from_bert(checkpoint, tokenizer=tokenizer)
    path = model.export(tmp_path / "export", max_length=MAX_LENGTH)
    assert (path / "assets" / "vocab.txt").read_text().splitlines() == (
        checkpoint.vocabulary
    )
    metadata = json.loads((path / "assets.extra" / "keras_attn.json").read_text())
    assert metadata["tokenizer"] == "WordPieceTokenizer"
    serve = tf.saved_model.load(str(path)).signatures["serving_default"]
    texts = ["The film is great!", "a dull, boring plot " * 5, ""]
    outputs = serve(text=tf.constant(texts))
    # [CLS] pieces [SEP], truncated to MAX_LENGTH with [SEP] kept last.
    ids = tokenizer.tokenize(texts).to_tensor(shape=[None, MAX_LENGTH])
    assert ids.numpy()[1, -1] == tokenizer.sep_id
    expected = np.asarray(model(ids))[:, 0]
    np.testing.assert_allclose(
        outputs["positive_probability"].numpy(), expected, atol=1e-5
    )
    batch = nasty_batch()
    probability = serve(text=tf.constant(batch))["positive_probability"].numpy()
    assert probability.shape == (len(batch),) and np.isfinite(probability).all()
    report = check_servable(path, verbose=False, examples=texts[:1])
    assert report.ok, str(report)
    assert report.text_ops == ["FastBertNormalize", "FastWordpieceTokenizeWithOffsets"]


def test_an_ensemble_exports_its_averaged_probability(small_tokenizer, tmp_path):
    members = [
        TextClassifier(
            small_tokenizer.vocabulary_size,
            MAX_LENGTH,
            embedding_dim=8,
            num_layers=1,
            num_heads=2,
            intermediate_dim=16,
            name=f"member_{index}",
        )
        for index in range(2)
    ]
    ensemble = TextClassifierEnsemble(members, tokenizer=small_tokenizer)
    path = ensemble.export(tmp_path / "export", max_length=MAX_LENGTH)
    texts = ["A gripping, beautifully acted film.", "dull"]
    served = tf.saved_model.load(str(path)).signatures["serving_default"](
        text=tf.constant(texts)
    )
    expected = ensemble.classify(texts, max_length=MAX_LENGTH)
    np.testing.assert_allclose(
        served["positive_probability"].numpy(),
        expected["positive_probability"],
        atol=1e-6,
    )
    assert [label.decode() for label in served["label"].numpy()] == expected["label"]
    with pytest.raises(ValueError, match="needs the classifier's `tokenizer`"):
        export_sentiment(members[0], tmp_path / "again")
