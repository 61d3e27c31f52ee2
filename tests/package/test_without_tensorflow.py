"""The networks on JAX in a Python where TensorFlow cannot be imported: they
build, train a step, decode token ids and save, as on a GPU machine with JAX
and Keras but no TensorFlow."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.test_case import BLOCK_TENSORFLOW, REPO_ROOT

SCRIPT = BLOCK_TENSORFLOW + textwrap.dedent(
    """
    import json, os, sys, tempfile

    os.environ["KERAS_BACKEND"] = "jax"
    import keras
    import numpy as np

    import keras_attn
    from keras_attn import memory, training
    from keras_attn.models import (
        RNNTranslator, TextClassifier, TextClassifierEnsemble,
        TransformerLanguageModel, TransformerTranslator,
    )

    report = {"backend": keras.backend.backend()}
    rng = np.random.default_rng(0)
    source = rng.integers(4, 30, (4, 6)).astype("int32")
    target = rng.integers(4, 30, (4, 5)).astype("int32")
    target[:, 0] = 2
    labels = np.concatenate([target[:, 1:], np.full((4, 1), 3, "int32")], 1)
    tmp = tempfile.mkdtemp()

    def train_and_save(name, model, x, y, loss):
        # Eager steps: compiling a train step costs more than one step here.
        model.compile(optimizer="adam", loss=loss, run_eagerly=True)
        before = [w.copy() for w in model.get_weights()]
        model.fit(x, y, epochs=1, batch_size=4, verbose=0)
        changed = any(
            not np.array_equal(a, b) for a, b in zip(before, model.get_weights())
        )
        path = os.path.join(tmp, f"{name}.keras")
        model.save(path)
        restored = keras.saving.load_model(path)
        same = np.allclose(np.asarray(restored(x)), np.asarray(model(x)), atol=1e-6)
        report[name] = {"trained": changed, "reloaded": bool(same)}
        return restored

    sparse = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    pairs = {"encoder_inputs": source, "decoder_inputs": target}
    for name, model in (
        ("transformer_translator", TransformerTranslator(
            30, 30, sequence_length=12, embedding_dim=16, num_encoder_layers=1,
            num_decoder_layers=1, num_heads=2, intermediate_dim=32, dropout=0.0)),
        ("rnn_translator", RNNTranslator(30, 30, embedding_dim=8, units=12)),
    ):
        restored = train_and_save(name, model, pairs, labels, sparse)
        tokens, scores = restored.translate_ids(source, max_length=6, beam_width=2)
        report[name]["decoded"] = list(np.asarray(tokens).shape)
    path = os.path.join(tmp, "transformer_translator.keras")
    translator = keras.saving.load_model(path)
    store = memory.translation_datastore(translator, [(pairs, labels)])
    knn = memory.NearestNeighborDecoding(store, k=2, lam=0.5)
    tokens, _ = translator.translate_ids(source, 6, 2, nearest_neighbors=knn)
    report["knn_decoded"] = list(np.asarray(tokens).shape)

    classifier = train_and_save(
        "text_classifier",
        TextClassifier(30, 8, embedding_dim=8, num_layers=1, num_heads=2,
                       intermediate_dim=16, pooling="attention"),
        source, (source[:, 0] % 2).astype("float32"), "binary_crossentropy",
    )
    report["text_classifier"]["maps"] = sorted(classifier.attention_maps(source))
    # Presets (keras-hub's layout) save and load without TensorFlow.
    classifier.save_to_preset(os.path.join(tmp, "preset"))
    again = TextClassifier.from_preset(os.path.join(tmp, "preset"))
    same = np.allclose(np.asarray(again(source)), np.asarray(classifier(source)))
    report["text_classifier"]["preset"] = bool(same)
    ensemble = TextClassifierEnsemble([
        TextClassifier(30, 8, embedding_dim=8, num_layers=1, num_heads=2,
                       intermediate_dim=16, name=f"member_{i}") for i in range(2)
    ])
    path = os.path.join(tmp, "ensemble.keras")
    ensemble.save(path)
    report["ensemble"] = list(np.asarray(keras.saving.load_model(path)(source)).shape)

    lm = train_and_save(
        "language_model",
        TransformerLanguageModel(30, 12, embedding_dim=16, num_layers=1,
                                 num_heads=2, intermediate_dim=32),
        source, source, sparse,
    )
    report["language_model"]["generated"] = list(
        np.asarray(lm.generate_ids(source[:, :3], 10)).shape
    )
    cache = memory.ContinuousCache(theta=0.5, lam=0.2)
    scores = lm.score_ids(np.concatenate([target, labels[:, -1:]], 1), cache)
    scored = np.asarray(scores["log_likelihood"])
    report["language_model"]["scored"] = list(scored.shape)
    report["precision"] = training.resolve_mixed_precision("auto")
    report["tensorflow_imported"] = sorted(  # BLOCK_TENSORFLOW's entries are None
        m
        for m, module in sys.modules.items()
        if m.split(".")[0] in ("tensorflow", "tensorflow_text") and module is not None
    )
    print(json.dumps(report))
    """
)


# the networks on JAX are tested in process by the JAX run; this adds the import without
# TensorFlow
@pytest.mark.slow
def test_networks_build_train_decode_and_save_on_jax_without_tensorflow(tmp_path):
    env = {**os.environ, "KERAS_BACKEND": "jax", "PYTHONPATH": REPO_ROOT}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["backend"] == "jax"
    assert report["tensorflow_imported"] == []
    for name in (
        "transformer_translator",
        "rnn_translator",
        "text_classifier",
        "language_model",
    ):
        assert report[name]["trained"] and report[name]["reloaded"], name
    assert report["transformer_translator"]["decoded"] == [4, 6]
    assert report["rnn_translator"]["decoded"] == [4, 6]
    assert report["knn_decoded"] == [4, 6]
    assert report["text_classifier"]["maps"] == ["pooling", "self_attention"]
    assert report["text_classifier"]["preset"]
    assert report["ensemble"] == [4, 1]
    assert report["language_model"]["generated"] == [4, 10]
    assert report["language_model"]["scored"] == [4]
    assert report["precision"] in ("float32", "mixed_bfloat16")


EXTRAS_SCRIPT = textwrap.dedent(
    """
    import importlib, importlib.abc, json, os, runpy, sys

    BLOCKED = set(sys.argv[1].split(","))

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}")
            return None

    sys.meta_path.insert(0, Blocker())
    import keras_attn  # the core imports with every extra missing

    messages = {}
    for name in sys.argv[3:]:
        try:
            if name.endswith(".py"):
                sys.path.insert(0, os.path.dirname(name))
                sys.argv = [name, "--smoke", "--out", "never-written"]
                runpy.run_path(name, run_name="__main__")
            else:
                importlib.import_module(name)
            messages[name] = None
        except ImportError as error:
            messages[name] = str(error)
    print(json.dumps({
        "messages": messages,
        "blocked_imported": sorted(m for m in sys.modules if m in BLOCKED),
    }))
    """
)


def import_messages(blocked, backend, names, tmp_path):
    """{name: the ImportError's message (None if it imported)} of importing
    each module (or running each example script) where `blocked` cannot be
    imported."""
    env = {**os.environ, "KERAS_BACKEND": backend, "PYTHONPATH": REPO_ROOT}
    result = subprocess.run(
        [sys.executable, "-c", EXTRAS_SCRIPT, ",".join(blocked), backend, *names],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["blocked_imported"] == []
    return report["messages"]


def test_a_missing_extra_is_named_at_the_import(tmp_path):
    """Without TensorFlow, matplotlib and sacrebleu (a JAX-only install),
    the modules that need them raise at their import, naming the extra."""
    examples = os.path.join(REPO_ROOT, "examples")
    messages = import_messages(
        (
            "tensorflow",
            "tensorflow_text",
            "tensorflow_serving",
            "matplotlib",
            "sacrebleu",
        ),
        "jax",
        [
            "keras_attn.text",
            "keras_attn.export",
            "keras_attn.visualize",
            os.path.join(examples, "sentiment.py"),
            "keras_attn.layers",
            "keras_attn.memory",
            "keras_attn.datasets",
            "keras_attn.checkpoints",
            "keras_attn.training",
        ],
        tmp_path,
    )
    expected = {
        "keras_attn.text": "keras_attn.text needs TensorFlow: "
        "pip install 'keras-attn[text]'",
        "keras_attn.export": "keras_attn.export needs TensorFlow: "
        "pip install 'keras-attn[export]'",
        "keras_attn.visualize": "keras_attn.visualize needs matplotlib: "
        "pip install 'keras-attn[visualize]'",
        os.path.join(examples, "sentiment.py"): "This example script needs "
        "TensorFlow: pip install 'keras-attn[examples]'",
    }
    for name, start in expected.items():
        assert messages[name] is not None, name
        assert messages[name].startswith(start), messages[name]
        assert "Received: ModuleNotFoundError(" in messages[name]
    for name in (
        "keras_attn.layers",
        "keras_attn.memory",
        "keras_attn.datasets",
        "keras_attn.checkpoints",
        "keras_attn.training",
    ):
        assert messages[name] is None, (name, messages[name])


def test_an_example_without_sacrebleu_stops_before_training(tmp_path):
    """With TensorFlow but no sacrebleu, the translation script stops at its
    start (it used to fail at the evaluation, after training)."""
    script = os.path.join(REPO_ROOT, "examples", "translate.py")
    messages = import_messages(("sacrebleu",), "tensorflow", [script], tmp_path)
    assert messages[script].startswith(
        "This example script needs sacrebleu: pip install 'keras-attn[examples]'"
    )
    assert not (tmp_path / "never-written").exists()
