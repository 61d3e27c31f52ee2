"""The one exporter: each task says what it serves (`serving_spec`) and
`export_task` writes it; the translator's kind comes from its class."""

import json

import keras
import pytest
import tensorflow as tf

from keras_attn.export import (
    Endpoint,
    ServingSpec,
    export_language_model,
    export_sentiment,
    export_task,
    export_translator,
)
from keras_attn.export._common import TEXT_SPEC
from keras_attn.export.batching import BATCHING_PARAMS_FILE, task_batching
from keras_attn.models import (
    RNNTranslator,
    TextClassifier,
    TransformerLanguageModel,
    TransformerTranslator,
)

pytestmark = pytest.mark.tf_only


def small_task(kind, tokenizer, cls=None):
    vocabulary = tokenizer.vocabulary_size
    if kind == "sentiment":
        return TextClassifier(
            vocabulary,
            8,
            embedding_dim=8,
            num_layers=1,
            num_heads=2,
            intermediate_dim=16,
            tokenizer=tokenizer,
        )
    if kind == "rnn":
        return (cls or RNNTranslator)(
            vocabulary,
            vocabulary,
            embedding_dim=8,
            units=8,
            attention="luong_general",
            source_tokenizer=tokenizer,
            target_tokenizer=tokenizer,
        )
    if kind == "transformer":
        return (cls or TransformerTranslator)(
            vocabulary,
            vocabulary,
            sequence_length=7,
            embedding_dim=8,
            num_encoder_layers=1,
            num_decoder_layers=1,
            num_heads=2,
            intermediate_dim=16,
            shared_vocabulary=True,
            source_tokenizer=tokenizer,
            target_tokenizer=tokenizer,
        )
    return TransformerLanguageModel(
        vocabulary,
        sequence_length=8,
        embedding_dim=8,
        num_layers=1,
        num_heads=2,
        intermediate_dim=16,
        tokenizer=tokenizer,
    )


# (task kind, export options, the spec's task and default model name)
TASKS = {
    "sentiment": ({"max_length": 8}, "sentiment", "sentiment"),
    "rnn": ({"max_length": 5, "beam_width": 2}, "translation", "translator"),
    "transformer": ({"beam_width": 2}, "translation", "translator"),
    "language_model": ({"max_new_tokens": 3}, "language_model", "language_model"),
}


# The rnn translator's and the language model's exports are served in
# test_translator_export.py and test_language_model_export.py; here they run
# with the slow tests.
@pytest.mark.parametrize(
    "kind",
    [
        pytest.param(kind, marks=pytest.mark.slow)
        if kind in ("rnn", "language_model")
        else kind
        for kind in sorted(TASKS)
    ],
)
def test_the_one_exporter_serves_each_task(kind, small_tokenizer, tmp_path):
    options, task_name, model_name = TASKS[kind]
    task = small_task(kind, small_tokenizer)
    spec = task.serving_spec(**options)
    assert (spec.task, spec.model_name) == (task_name, model_name)

    path = export_task(task, tmp_path, **options)

    assert path == tmp_path / model_name / "1"  # the task's default name
    loaded = tf.saved_model.load(str(path))
    assert sorted(loaded.signatures) == sorted(spec.endpoints)
    metadata = json.loads((path / "assets.extra" / "keras_attn.json").read_text())
    assert (metadata["task"], metadata["model_name"], metadata["version"]) == (
        task_name,
        model_name,
        1,
    )
    assert metadata["signatures"] == spec.signatures_metadata()
    assert metadata["samples"] == spec.samples()
    assert sorted(metadata["sample_outputs"]) == sorted(spec.endpoints)
    for name, endpoint in spec.endpoints.items():
        served = metadata["sample_outputs"][name]
        assert sorted(served) == sorted(endpoint.outputs), name
    for key, value in spec.metadata.items():
        assert metadata[key] == json.loads(json.dumps(value)), key
    # The batching parameters and warmup requests of the spec's task.
    batching = task_batching(task_name)
    assert (path / BATCHING_PARAMS_FILE).read_text() == batching.to_text()
    assert metadata["serving"]["warmup_requests"]["records"] == len(
        spec.endpoints
    ) * len(batching.execution_batch_sizes)
    if kind in ("rnn", "transformer"):
        assert metadata["model_kind"] == kind


class RNNTranslatorWithStates(RNNTranslator):
    """An RNN translator with a method the Transformer has: still "rnn"."""

    def call_with_states(self, inputs, training=False):
        return self(inputs, training=training)


class TransformerTranslatorWithExtras(TransformerTranslator):
    """A Transformer translator with an unrelated attribute."""

    attention = "luong_dot"

    def extra(self):
        return "unrelated"


def test_an_export_builds_no_default_signature(small_tokenizer, tmp_path, monkeypatch):
    """Keras's `ExportArchive` reads `_default_save_signature` of every model
    it tracks and traces it (the whole model at unknown lengths) only to
    drop it; keras-attn's models have none, so no such trace happens, and
    `tf.saved_model.save` of one writes no signature it was not given."""
    from keras.src.backend.tensorflow.layer import TFLayer

    built = []

    def counting(self):
        if isinstance(self, keras.Model):  # Keras builds one for models only
            built.append(type(self).__name__)
        return None

    monkeypatch.setattr(TFLayer, "_default_save_signature", property(counting))
    task = small_task("sentiment", small_tokenizer)
    export_task(task, tmp_path / "export", **TASKS["sentiment"][0])
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    tf.saved_model.save(plain, str(tmp_path / "plain"))
    # Read for the plain Keras model (and its inner functional model) only.
    assert built and set(built) <= {"Sequential", "Functional"}, built
    tf.saved_model.save(task.backbone, str(tmp_path / "backbone"))
    assert list(tf.saved_model.load(str(tmp_path / "backbone")).signatures) == []


@pytest.mark.parametrize(
    "kind, cls, alignment",
    [
        ("rnn", RNNTranslator, "attention weights of the decoder's luong_general"),
        ("rnn", RNNTranslatorWithStates, "attention weights of the decoder's"),
        ("transformer", TransformerTranslator, "cross-attention of the last"),
        ("transformer", TransformerTranslatorWithExtras, "cross-attention of the"),
    ],
)
def test_the_translator_kind_comes_from_the_class(
    kind, cls, alignment, small_tokenizer
):
    translator = small_task(kind, small_tokenizer, cls)
    assert cls.model_kind == kind
    spec = translator.serving_spec(max_length=5)
    assert spec.metadata["model_kind"] == kind
    assert spec.metadata["alignment"].startswith(alignment)


def test_a_model_that_is_not_a_task_is_refused(tmp_path):
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    with pytest.raises(
        ValueError, match=r"`task` must be a keras_attn task .*task of type Functional"
    ):
        export_task(model, tmp_path)
    with pytest.raises(ValueError, match="`translator` must be a keras_attn task"):
        export_translator(model, tmp_path)
    with pytest.raises(ValueError, match="`classifier` must be a keras_attn task"):
        export_sentiment(model, tmp_path)
    with pytest.raises(ValueError, match="`model` must be a keras_attn task"):
        export_language_model(model, tmp_path)
    assert not (tmp_path / "translator").exists()


def test_a_task_of_another_kind_and_unknown_options_are_refused(
    small_tokenizer, tmp_path
):
    classifier = small_task("sentiment", small_tokenizer)
    with pytest.raises(
        ValueError,
        match=r"`translator` must be a translation task, .*of type TextClassifier",
    ):
        export_translator(classifier, tmp_path)
    translator = small_task("rnn", small_tokenizer)
    with pytest.raises(
        ValueError, match=r"`classifier` must be a sentiment task, .*RNNTranslator"
    ):
        export_sentiment(translator, tmp_path)

    class SentimentOptionsOtherTask:  # the options of a classifier, another task
        def serving_spec(self, max_length=64, threshold=0.5):
            return small_task("language_model", small_tokenizer).serving_spec()

    with pytest.raises(
        ValueError,
        match=r"`classifier` must be a sentiment task .*a language_model task",
    ):
        export_sentiment(SentimentOptionsOtherTask(), tmp_path)
    with pytest.raises(ValueError, match=r"options .*Received: beam_width=3"):
        export_task(classifier, tmp_path, beam_width=3)
    assert list(tmp_path.iterdir()) == []


def test_a_serving_spec_is_checked():
    def serve(text):
        return {"label": text}

    endpoint = Endpoint(
        serve,
        [TEXT_SPEC],
        {"text": "string [batch]"},
        {"label": "string"},
        {"text": ["a"]},
    )
    with pytest.raises(ValueError, match="Received: task='summary'"):
        ServingSpec("summary", "summary", {"serving_default": endpoint})
    with pytest.raises(ValueError, match="`serving_default` among them"):
        ServingSpec("sentiment", "sentiment", {"classify": endpoint})
    with pytest.raises(ValueError, match=r"Received: metadata with \['version'\]"):
        ServingSpec(
            "sentiment",
            "sentiment",
            {"serving_default": endpoint},
            metadata={"version": 2},
        )
    with pytest.raises(ValueError, match="name the same inputs"):
        Endpoint(serve, [TEXT_SPEC], {"prompt": "string [batch]"}, {}, {"text": ["a"]})
