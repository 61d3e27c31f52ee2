"""The language model's export with rotary positions and grouped-query
attention (and one with ALiBi): servable, no `Xla*` op, the answers of
`generate` and `score`; in the newest TF Serving release's runtime (large)."""

import numpy as np
import pytest
import tensorflow as tf

from keras_attn.export import check_servable
from keras_attn.export.releases import newest_releases
from keras_attn.models import TransformerLanguageModel

pytestmark = pytest.mark.tf_only


def exported_model(tokenizer, directory, position, **options):
    model = TransformerLanguageModel(
        tokenizer.vocabulary_size,
        sequence_length=16,
        embedding_dim=16,
        num_layers=1,
        num_heads=4,
        intermediate_dim=32,
        position=position,
        tokenizer=tokenizer,
        **options,
    )
    return model, model.export(directory, max_new_tokens=6)


@pytest.fixture(scope="module")
def rotary_export(small_tokenizer, tmp_path_factory):
    return exported_model(
        small_tokenizer,
        tmp_path_factory.mktemp("rotary"),
        "rotary",
        num_key_value_heads=2,
    )


def assert_answers_match(model, path):
    texts = ["where is the house", " ".join(["the station is near the house"] * 8)]
    loaded = tf.saved_model.load(str(path))
    served = loaded.signatures["serving_default"](prompt=tf.constant(texts))
    completions = [c.decode("utf-8") for c in served["completion"].numpy()]
    assert completions == model.generate(texts, max_new_tokens=6)
    outputs = loaded.signatures["score"](text=tf.constant(texts))
    for name, value in model.score(texts).items():
        np.testing.assert_allclose(outputs[name].numpy(), value, rtol=1e-5)


def graph_ops(path):
    loaded = tf.saved_model.load(str(path))
    names = set()
    for signature in loaded.signatures.values():
        graph = signature.graph.as_graph_def()
        functions = [graph.node, *(f.node_def for f in graph.library.function)]
        names.update(node.op for nodes in functions for node in nodes)
    return names


def test_rotary_grouped_query_export_answers_as_the_model(rotary_export):
    model, path = rotary_export
    ops = graph_ops(path)
    assert not [op for op in ops if op.startswith("Xla")]
    assert {"Sin", "Cos"} <= ops  # the rotation is in the graph
    assert_answers_match(model, path)


# Slow (a TensorFlow process of its own): the export's ops and answers in
# test_rotary_grouped_query_export_answers_as_the_model, a learned-position
# export's servability in test_language_model_export.py's test_servable.
@pytest.mark.slow
def test_rotary_grouped_query_export_is_servable(rotary_export):
    _, path = rotary_export
    report = check_servable(path, verbose=False)
    assert report.ok, str(report)
    assert report.signatures == ["score", "serving_default"]


# ALiBi and windows in process in tests/layers; the rotary export's answers
# stay in the default run
@pytest.mark.slow
def test_alibi_sliding_window_export_answers_as_the_model(small_tokenizer, tmp_path):
    model, path = exported_model(
        small_tokenizer, tmp_path, "alibi", num_key_value_heads=1, sliding_window=8
    )
    assert check_servable(path, verbose=False).ok
    assert_answers_match(model, path)


@pytest.mark.large
def test_rotary_grouped_query_export_in_the_newest_release(rotary_export):
    _, path = rotary_export
    release = newest_releases(1)[0].version
    report = check_servable(path, verbose=False, serving_release=release)
    assert report.ok, str(report)
    assert report.tensorflow == release
    assert report.warmup["records"] > 0 and not report.warmup["errors"]
