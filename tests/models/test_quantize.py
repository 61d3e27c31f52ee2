"""`task.quantize(mode)` on every task: the default set of layers it
quantizes, answers close to the float task's, `.keras` files and presets
that load quantized and answer the same (in a fresh process too), and the
compiled task methods answering with the quantized weights when the task is
quantized after their first call. Token ids on TensorFlow and JAX (this
module runs on JAX in `make test-backends`); the text methods need TensorFlow Text
(`tf_only`)."""

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

from keras_attn.models import (
    RNNTranslator,
    TextClassifier,
    TextClassifierEnsemble,
    TransformerLanguageModel,
    TransformerTranslator,
    _task,
)
from tests.test_case import REPO_ROOT

# The layers Keras quantizes (Keras 3.15).
QUANTIZABLE = (
    keras.layers.Dense,
    keras.layers.EinsumDense,
    keras.layers.Embedding,
    keras.layers.ReversibleEmbedding,
)
VOCABULARY = 300  # the `small_tokenizer` fixture's
MODES = ("int8", "int4")
# The largest change quantizing may make, as a fraction of the largest float
# output (probabilities, logits) of the tiny random models below.
BOUND = {"int8": 0.05, "int4": 0.25}
TASKS = ("classifier", "ensemble", "transformer", "rnn", "language_model")
TEXTS = ["Where is the station?", "I am very tired today.", "The cat sat."]


def build(name):
    """A tiny task of `name` with random weights (normal, standard deviation
    0.5), the same for the same name: large enough that the decodings vary
    and that int4 changes their tokens."""
    # One width (16) and hidden size (32) throughout: the tasks share most
    # kernel shapes, so JAX compiles each quantized op once for them all.
    classifier = {
        "sequence_length": 16, "embedding_dim": 16, "num_layers": 1,
        "num_heads": 2, "intermediate_dim": 32,
    }  # fmt: skip
    transformer = {
        "sequence_length": 12, "embedding_dim": 16, "num_encoder_layers": 1,
        "num_decoder_layers": 1, "num_heads": 2, "intermediate_dim": 32,
    }  # fmt: skip
    language_model = {
        "sequence_length": 16, "embedding_dim": 16, "num_layers": 1,
        "num_heads": 2, "intermediate_dim": 32,
    }  # fmt: skip
    models = {
        "classifier": lambda: TextClassifier(
            VOCABULARY, pooling="attention", **classifier
        ),
        "ensemble": lambda: TextClassifierEnsemble(
            [
                TextClassifier(VOCABULARY, name=f"member_{i}", **classifier)
                for i in range(2)
            ]
        ),
        "transformer": lambda: TransformerTranslator(
            VOCABULARY, VOCABULARY, shared_vocabulary=True, **transformer
        ),
        "transformer_untied": lambda: TransformerTranslator(
            VOCABULARY, VOCABULARY, tie_embeddings=False, **transformer
        ),
        "rnn": lambda: RNNTranslator(
            VOCABULARY, VOCABULARY, embedding_dim=16, units=16
        ),
        "language_model": lambda: TransformerLanguageModel(
            VOCABULARY, **language_model
        ),
        "language_model_untied": lambda: TransformerLanguageModel(
            VOCABULARY, tie_embeddings=False, **language_model
        ),
    }
    model = models[name]()
    rng = np.random.default_rng(sorted(models).index(name))
    model.set_weights(
        [rng.normal(0, 0.5, w.shape).astype(w.dtype) for w in model.get_weights()]
    )
    return model


IDS = np.array(
    [
        [5, 17, 42, 8, 99, 120, 7, 3],
        [250, 11, 64, 0, 0, 0, 0, 0],
        [31, 0, 0, 0, 0, 0, 0, 0],
    ],
    "int32",
)


def inputs(name):
    if name.startswith(("transformer", "rnn")):
        return {"encoder_inputs": IDS, "decoder_inputs": IDS}
    return IDS


def outputs(model, name):
    return np.asarray(keras.ops.convert_to_numpy(model(inputs(name))), "float32")


def quantized_paths(model) -> list:
    return sorted(
        layer.path for layer in model._flatten_layers() if layer.quantization_mode
    )


def default_set(model) -> list:
    """What docs/TASKS.md says `quantize(mode)` quantizes: every Dense,
    EinsumDense, Embedding and ReversibleEmbedding but the classifiers'
    one-unit output layer."""
    return sorted(
        layer.path
        for layer in model._flatten_layers()
        if type(layer) in QUANTIZABLE and layer.name != "positive_probability"
    )


def _check_close(got, want, mode):
    assert not np.array_equal(got, want)  # quantizing changed the answer
    largest = float(np.max(np.abs(got - want)))
    assert largest <= BOUND[mode] * float(np.max(np.abs(want))), largest


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", TASKS)
def test_quantize_quantizes_the_default_set_and_the_task_round_trips(
    name, mode, tmp_path
):
    model = build(name)
    float_outputs = outputs(model, name)
    expected = default_set(model)
    model.quantize(mode)
    assert quantized_paths(model) == expected
    if name == "rnn":  # the largest weight: quantized; the GRUs cannot be
        assert {"logits", "attentional"} <= set(expected)
    else:
        assert not any(path.endswith("positive_probability") for path in expected)
        # Everything quantized is in the backbones: the configs are as before.
        assert "dtype" not in model.get_config()
    got = outputs(model, name)
    _check_close(got, float_outputs, mode)
    assert_round_trips(model, name, expected, got, tmp_path)


def assert_round_trips(model, name, paths, got, tmp_path):
    """Saved (`.keras`, and a preset where the task has them) and loaded,
    `model` has the quantized layers `paths` and answers `got` exactly."""
    model.save(tmp_path / "quantized.keras")
    loaded = keras.saving.load_model(tmp_path / "quantized.keras")
    assert quantized_paths(loaded) == paths
    np.testing.assert_array_equal(outputs(loaded, name), got)
    if hasattr(model, "save_to_preset"):
        model.save_to_preset(tmp_path / "preset")
        again = type(model).from_preset(tmp_path / "preset")
        assert quantized_paths(again) == paths
        np.testing.assert_array_equal(outputs(again, name), got)


@pytest.mark.parametrize(
    ("name", "filters", "outside"),
    [
        # A user's filters (a callable, as in Keras) quantize the head too.
        ("classifier", "all", ["positive_probability"]),
        ("ensemble", "all", ["positive_probability", "positive_probability"]),
        ("language_model_untied", "logits", ["logits"]),  # a regex of names
        ("transformer_untied", None, ["logits"]),  # the default set has it
    ],
)
def test_quantized_layers_outside_the_backbones_are_recorded_and_rebuilt(
    name, filters, outside, tmp_path
):
    model = build(name)
    if filters == "all":

        def filters(layer):
            return type(layer) in QUANTIZABLE

    model.quantize("int4", filters=filters)
    paths = quantized_paths(model)
    assert [p for p in paths if "backbone/" not in p] == outside
    if name == "language_model_untied":
        assert paths == ["logits"]
    members = model.members if name == "ensemble" else [model]
    for member in members:  # the config records them, by path
        policy = keras.dtype_policies.get(member.get_config()["dtype"])
        assert isinstance(policy, keras.dtype_policies.DTypePolicyMap)
        assert list(policy.keys()) == outside[:1]
        assert policy.default_policy.name == "float32"
    assert_round_trips(model, name, paths, outputs(model, name), tmp_path)


def test_quantize_refuses_a_bad_mode_and_a_calibration_mode_without_structure():
    model = build("language_model")
    with pytest.raises(ValueError, match="Received: mode=int3"):
        model.quantize("int3")  # Keras's own check
    config = keras.quantizers.GPTQConfig(dataset=["a b"], tokenizer=lambda text: text)
    with pytest.raises(ValueError, match="quantization_layer_structure"):
        model.quantize("gptq", config=config)
    assert quantized_paths(model) == []  # refused before touching a layer


def test_quantize_collects_garbage_once_not_once_per_replaced_variable(
    monkeypatch,
):
    """Keras collects garbage for each variable `quantize` replaces; a task
    collects once, at the end, and Keras's own `gc.collect` is back after."""
    import gc

    calls = []
    monkeypatch.setattr(gc, "collect", lambda *args: calls.append(args) or 0)
    collect = gc.collect
    task = build("language_model")
    expected = default_set(task)
    keras.Model.quantize(build("language_model"), "int8")  # Keras's, per variable
    assert len(calls) > 5
    calls.clear()
    task.quantize("int8")
    assert calls == [()] and gc.collect is collect
    assert quantized_paths(task) == expected


# -- compiled methods, quantized after their first call ------------------------
#
# Each task method is called first (its compiled function kept on the task),
# then the task is quantized and the method called again: it must answer as
# the task quantized before its first call, or as the eager decoding of the
# quantized weights. On TensorFlow through the text methods (TensorFlow Text
# tokenizers), whose compiled functions are the token-id ones; on JAX on
# token ids.


def _text_run() -> bool:
    return keras.backend.backend() == "tensorflow"


def _with_tokenizer(model, tokenizer):
    for name in ("tokenizer", "source_tokenizer", "target_tokenizer"):
        if hasattr(model, name):
            setattr(model, name, tokenizer)
    return model


# The ensemble wraps classifiers; it runs with the slow tests.
@pytest.mark.parametrize(
    "name", ["classifier", pytest.param("ensemble", marks=pytest.mark.slow)]
)
def test_classifying_answers_with_weights_quantized_after_the_first_call(name, request):
    """`classify` and `predict(texts)` (TensorFlow), or their network pass
    `_task.compiled_forward` (token ids)."""
    model, twin = build(name), build(name)
    twin.quantize("int4")
    if _text_run():
        tokenizer = request.getfixturevalue("small_tokenizer")
        _with_tokenizer(model, tokenizer)
        _with_tokenizer(twin, tokenizer)
        float_answer = model.classify(TEXTS)["positive_probability"]
        np.testing.assert_array_equal(model.predict(TEXTS)[:, 0], float_answer)
        model.quantize("int4")
        want = twin.classify(TEXTS)["positive_probability"]
        np.testing.assert_array_equal(
            model.classify(TEXTS)["positive_probability"], want
        )
        np.testing.assert_array_equal(model.predict(TEXTS)[:, 0], want)
    else:
        float_answer = _task.compiled_forward(model, 8)(IDS)
        model.quantize("int4")
        want = _task.compiled_forward(twin, 8)(IDS)
        np.testing.assert_array_equal(_task.compiled_forward(model, 8)(IDS), want)
    _check_close(want, float_answer, "int4")


# The rnn translator shares the translators' compiled decoding; it runs with
# the slow tests.
@pytest.mark.parametrize(
    "name", ["transformer", pytest.param("rnn", marks=pytest.mark.slow)]
)
def test_translating_answers_with_weights_quantized_after_the_first_call(name, request):
    """Beam and greedy decoding (`_compiled_decoding`, and on TensorFlow
    `translate`, which runs the same compiled functions on the tokenized
    texts) decode after `quantize` as the eager decoding of the quantized
    weights."""
    model = build(name)
    max_length, settings = 4, (2, 1)  # beam search, greedy search
    if _text_run():
        from keras_attn.text.preprocessors import detokenized_texts

        tokenizer = request.getfixturevalue("small_tokenizer")
        _with_tokenizer(model, tokenizer)
        # The sources as `translate` pads them: one compiled decoding each.
        sources = _task.padded_ids(tokenizer.tokenize(TEXTS), max_length)
    else:
        sources = IDS[:, :max_length]

    def decode(beam_width):
        compiled = model._compiled_decoding(
            max_length, beam_width, 1.0, None, sources.shape[1]
        )
        return model.run_generate_function(compiled, sources)

    def translate(beam_width):
        return model.translate(TEXTS, beam_width=beam_width, max_length=max_length)

    before = {beam_width: decode(beam_width) for beam_width in settings}
    if _text_run():
        texts_before = {beam_width: translate(beam_width) for beam_width in settings}
    model.quantize("int4")
    texts_after = {}
    for beam_width in settings:
        tokens, scores = decode(beam_width)
        eager_tokens, eager_scores = model.translate_ids(
            sources, max_length, beam_width, 1.0
        )
        eager_tokens = keras.ops.convert_to_numpy(eager_tokens)
        np.testing.assert_array_equal(tokens, eager_tokens)
        np.testing.assert_allclose(
            scores, keras.ops.convert_to_numpy(eager_scores), rtol=1e-5, atol=1e-5
        )
        assert not np.allclose(scores, before[beam_width][1], rtol=1e-3)
        if _text_run():
            texts_after[beam_width] = translate(beam_width)
            assert texts_after[beam_width] == detokenized_texts(tokenizer, eager_tokens)
    if _text_run():
        assert texts_after != texts_before  # int4 changed translations


def test_the_language_model_answers_with_weights_quantized_after_the_first_call(
    request,
):
    """`generate` and `score` (TensorFlow), or `continue_ids` and
    `score_ids` (token ids), after `quantize`, as the task quantized before
    its first call."""
    import tensorflow as tf

    model, twin = build("language_model"), build("language_model")
    twin.quantize("int4")
    if _text_run():
        tokenizer = request.getfixturevalue("small_tokenizer")
        _with_tokenizer(model, tokenizer)
        _with_tokenizer(twin, tokenizer)

        def generate(task):
            return task.generate(TEXTS, max_new_tokens=5)

        def score(task):
            return task.score(TEXTS)["log_likelihood"]

    else:
        prompts = tf.ragged.constant([[5, 6, 7], [8]], dtype=tf.int32)
        rows = np.array([[2, 5, 6, 7, 9, 3], [2, 8, 3, 0, 0, 0]], "int32")

        def generate(task):
            return task.continue_ids(prompts, max_new_tokens=6).to_list()

        def score(task):
            return keras.ops.convert_to_numpy(task.score_ids(rows)["log_likelihood"])

    float_generated, float_scores = generate(model), score(model)
    model.quantize("int4")
    generated = generate(model)
    assert generated == generate(twin)
    assert generated != float_generated
    scores = score(model)
    np.testing.assert_allclose(scores, score(twin), rtol=1e-6)
    assert not np.allclose(scores, float_scores, rtol=1e-3)


FRESH = textwrap.dedent(
    """
    import json, sys
    import keras
    import keras_attn.models
    texts = json.loads(sys.argv[3])
    classifier = keras.saving.load_model(sys.argv[1])
    model = keras_attn.models.TransformerLanguageModel.from_preset(sys.argv[2])
    print(json.dumps({
        "classify": classifier.classify(texts)["positive_probability"].tolist(),
        "score": model.score(texts)["log_likelihood"].tolist(),
    }))
    """
)


@pytest.mark.tf_only
def test_a_fresh_process_loads_a_quantized_classifier_and_language_model_preset(
    small_tokenizer, tmp_path
):
    """A `.keras` classifier quantized with its head (int8) and an int4
    language model preset load in a process that imports only Keras and
    keras-attn, and answer as the quantized tasks."""
    classifier = _with_tokenizer(build("classifier"), small_tokenizer)
    classifier.quantize("int8", filters=lambda layer: type(layer) in QUANTIZABLE)
    classifier.save(tmp_path / "classifier.keras")
    model = _with_tokenizer(build("language_model"), small_tokenizer)
    model.quantize("int4")
    model.save_to_preset(tmp_path / "preset")
    expected = {
        "classify": classifier.classify(TEXTS)["positive_probability"].tolist(),
        "score": model.score(TEXTS)["log_likelihood"].tolist(),
    }
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            FRESH,
            str(tmp_path / "classifier.keras"),
            str(tmp_path / "preset"),
            json.dumps(TEXTS),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": REPO_ROOT},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    np.testing.assert_allclose(got["classify"], expected["classify"], atol=1e-6)
    np.testing.assert_allclose(got["score"], expected["score"], rtol=1e-5)


def test_a_quantized_preset_loads_under_another_dtype_policy(tmp_path):
    """`from_preset(dtype=...)` sets the policy of what is not quantized;
    the quantized layers (backbone and head) stay quantized and load."""
    model = build("language_model_untied")
    model.quantize("int8")
    paths = quantized_paths(model)
    model.save_to_preset(tmp_path)
    loaded = TransformerLanguageModel.from_preset(tmp_path, dtype="bfloat16")
    assert quantized_paths(loaded) == paths
    assert loaded.get_layer("logits").quantization_mode == "int8"
    assert loaded.backbone.final_norm.compute_dtype == "bfloat16"
    np.testing.assert_allclose(
        outputs(loaded, "language_model_untied"),
        outputs(model, "language_model_untied"),
        atol=0.1 * float(np.max(np.abs(outputs(model, "language_model_untied")))),
    )
