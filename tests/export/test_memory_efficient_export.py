"""An export whose attention takes the memory-efficient path is servable.

The language model is exported with `keras.config.is_flash_attention_enabled()`
answering `True`, so that every attention of its graph (the scoring pass, the
prompt and each decoding step over the KV cache) is traced on the
memory-efficient path, as long sequences take it: the block loops and their
custom gradient's forward pass. `check_servable` loads it as TF Serving does,
runs its signatures against the in-process outputs and replays its warmup
requests; bad requests through the serve-tag loader leave no trace.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_attn.ops.attention as attention_module
from keras_attn.export import check_servable
from keras_attn.models import TransformerLanguageModel
from tests.export.conftest import assert_bad_requests_leave_no_trace
from tests.export.test_language_model_export import reference_log_likelihood

pytestmark = pytest.mark.tf_only

CONTEXT = 16


def counting(taken, name, function):
    def wrapper(*args, **kwargs):
        taken[name] += 1
        return function(*args, **kwargs)

    return wrapper


@pytest.fixture(scope="module")
def exported(small_tokenizer, tmp_path_factory):
    model = TransformerLanguageModel(
        small_tokenizer.vocabulary_size,
        sequence_length=CONTEXT,
        embedding_dim=16,
        num_layers=1,
        num_heads=2,
        intermediate_dim=32,
        tokenizer=small_tokenizer,
    )
    base = tmp_path_factory.mktemp("memory_efficient_export")
    taken = {"memory_efficient": 0, "explicit": 0}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            attention_module,
            "memory_efficient_attention",
            counting(
                taken, "memory_efficient", attention_module.memory_efficient_attention
            ),
        )
        patch.setattr(
            attention_module,
            "_explicit_attention",
            counting(taken, "explicit", attention_module._explicit_attention),
        )
        patch.setattr(keras.config, "is_flash_attention_enabled", lambda: True)
        path = model.export(base, max_new_tokens=6)
    return model, small_tokenizer, path, taken


def test_every_attention_of_the_graph_is_memory_efficient(exported):
    *_, taken = exported
    assert taken["memory_efficient"] > 0
    assert taken["explicit"] == 0


# Slow: the graph and its answers:
# test_every_attention_of_the_graph_is_memory_efficient,
# test_scores_equal_the_explicit_path
@pytest.mark.slow
def test_servable_with_its_warmup_requests(exported):
    _, _, path, _ = exported
    report = check_servable(path, verbose=False)
    # ok: every op registered (no Xla* op), signatures equal to the
    # in-process outputs, every warmup request answered.
    assert report.ok, str(report)
    assert report.signatures == ["score", "serving_default"]
    assert report.warmup["records"] > 0


def test_scores_equal_the_explicit_path(exported):
    # The reference runs the Keras model on short contexts: the explicit path.
    model, tokenizer, path, _ = exported
    score = tf.saved_model.load(str(path)).signatures["score"]
    text = "where is the house"
    outputs = score(text=tf.constant([text]))
    want, count = reference_log_likelihood(model, tokenizer, text)
    assert outputs["num_tokens"].numpy()[0] == count
    np.testing.assert_allclose(outputs["log_likelihood"].numpy()[0], want, rtol=1e-5)


@pytest.mark.parametrize(
    ("signature", "input_name"), [("serving_default", "prompt"), ("score", "text")]
)
def test_bad_requests_leave_no_trace(exported, signature, input_name):
    from serving_standin import StandInServer

    _, _, path, _ = exported
    with StandInServer(path) as server:
        assert_bad_requests_leave_no_trace(
            server, signature, input_name, ["To be, or not", "where is the house"]
        )


@pytest.mark.large
def test_servable_in_the_newest_serving_release(exported):
    from keras_attn.export.releases import newest_releases

    _, _, path, _ = exported
    release = newest_releases(1)[0].version
    report = check_servable(path, serving_release=release, verbose=False)
    assert report.ok, str(report)
