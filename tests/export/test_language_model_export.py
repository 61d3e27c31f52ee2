import math

import numpy as np
import pytest
import tensorflow as tf

from keras_attn.export import check_servable, export_language_model
from keras_attn.models import transformer_language_model
from keras_attn.text import END_ID, START_ID
from tests.export.conftest import nasty_batch

pytestmark = pytest.mark.tf_only

CONTEXT = 16


@pytest.fixture(scope="module")
def exported(small_tokenizer, tmp_path_factory):
    model = transformer_language_model(
        small_tokenizer.vocabulary_size,
        sequence_length=CONTEXT,
        embedding_dim=16,
        num_layers=1,
        num_heads=2,
        intermediate_dim=32,
    )
    base = tmp_path_factory.mktemp("export")
    path = export_language_model(model, small_tokenizer, base, max_new_tokens=6)
    return model, small_tokenizer, path


def reference_log_likelihood(model, tokenizer, text):
    """Token by token with a growing (at most CONTEXT-long) left context."""
    ids = [START_ID, *tokenizer.tokenize(text).numpy().tolist(), END_ID]
    total = 0.0
    for position in range(1, len(ids)):
        context = ids[max(0, position - CONTEXT) : position]
        logits = np.asarray(model(np.array([context], "int32")))[0, -1]
        log_probs = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
        total += log_probs[ids[position]]
    return total, len(ids) - 1


def test_servable(exported):
    _, _, path = exported
    report = check_servable(path, verbose=False)
    assert report.ok, str(report)
    assert report.signatures == ["score", "serving_default"]


def test_score_of_short_and_long_texts(exported):
    model, tokenizer, path = exported
    score = tf.saved_model.load(str(path)).signatures["score"]
    short = "where is the house"
    long_text = " ".join(["the station is near the house"] * 8)  # > CONTEXT tokens
    outputs = score(text=tf.constant([short, long_text]))
    want_short, count_short = reference_log_likelihood(model, tokenizer, short)
    assert outputs["num_tokens"].numpy()[0] == count_short
    np.testing.assert_allclose(
        outputs["log_likelihood"].numpy()[0], want_short, rtol=1e-4
    )
    # The long text is scored whole: every token counted, none truncated.
    count_long = len(tokenizer.tokenize(long_text).numpy()) + 1
    assert count_long > CONTEXT
    assert outputs["num_tokens"].numpy()[1] == count_long
    log_likelihood = outputs["log_likelihood"].numpy()[1]
    assert math.isfinite(log_likelihood) and log_likelihood < 0
    # About as likely per token as scoring it with the full window each time.
    want_long, _ = reference_log_likelihood(model, tokenizer, long_text)
    np.testing.assert_allclose(
        log_likelihood / count_long, want_long / count_long, atol=0.2
    )


def test_bad_input_on_the_export(exported):
    _, _, path = exported
    loaded = tf.saved_model.load(str(path))
    batch = tf.constant(nasty_batch())
    completion = loaded.signatures["serving_default"](prompt=batch)["completion"]
    assert completion.shape == (len(nasty_batch()),)
    scores = loaded.signatures["score"](text=batch)
    assert np.isfinite(scores["log_likelihood"].numpy()).all()
    assert (scores["num_tokens"].numpy() >= 1).all()  # the end token at least
    empty = loaded.signatures["serving_default"](prompt=tf.zeros([0], tf.string))
    assert empty["completion"].shape == (0,)
    assert loaded.signatures["score"](text=tf.zeros([0], tf.string))[
        "log_likelihood"
    ].shape == (0,)
    big = loaded.signatures["serving_default"](prompt=tf.constant(["the"] * 256))
    assert big["completion"].shape == (256,)
