"""Backbones and the tasks made of them (keras-hub's pattern): one place
builds each stack, a task built from a backbone equals the task built from
the sizes, and files saved before the backbones load with their weights."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import keras
import numpy as np
import pytest

from keras_attn.models import (
    TextClassifier,
    TransformerDecoderBackbone,
    TransformerEncoderBackbone,
    TransformerLanguageModel,
    TransformerTranslator,
)
from tests.test_case import to_numpy

FIXTURES = Path(__file__).parents[1] / "fixtures"
SIZES = {"embedding_dim": 8, "num_heads": 2, "intermediate_dim": 16}
NORMAL_002 = {"class_name": "RandomNormal", "config": {"stddev": 0.02}}
IDS = np.array([[5, 9, 3, 0, 0], [4, 7, 8, 6, 2]], dtype="int32")


def weights_of(model):
    return [to_numpy(weight) for weight in model.weights]


def assert_same_weights(first, second):
    first, second = weights_of(first), weights_of(second)
    assert len(first) == len(second)
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)


def test_encoder_backbone_outputs_masked_states_and_its_config():
    backbone = TransformerEncoderBackbone(40, 6, num_layers=2, **SIZES)
    states = backbone(IDS)
    assert tuple(states.shape) == (2, 5, 8)
    # Padding changes nothing of the real tokens' states.
    trimmed = backbone(IDS[:1, :3])
    np.testing.assert_allclose(to_numpy(states)[0, :3], to_numpy(trimmed)[0], atol=1e-6)
    # `encode` (outside the graph) equals the functional call.
    np.testing.assert_allclose(
        to_numpy(backbone.encode(IDS)), to_numpy(states), atol=1e-6
    )
    config = backbone.get_config()
    assert config["block_structure"] == "keras_hub"
    again = TransformerEncoderBackbone.from_config(config)
    assert again.get_config() == config
    assert backbone.num_heads == 2 and backbone.token_embedding is backbone.embedding
    # Variable paths start with the backbone's name.
    assert all(w.path.startswith("encoder_backbone/") for w in backbone.weights)


def test_decoder_backbone_is_causal_and_attends_to_the_encoder():
    decoder = TransformerDecoderBackbone(30, 6, num_layers=1, **SIZES)
    states = to_numpy(decoder(IDS))
    # A later token does not change an earlier position's state.
    changed = IDS.copy()
    changed[1, 4] = 11
    np.testing.assert_allclose(
        to_numpy(decoder(changed))[1, :4], states[1, :4], atol=1e-6
    )
    cross = TransformerDecoderBackbone(
        30, 6, num_layers=1, cross_attention=True, encoder_dim=12, **SIZES
    )
    memory = np.random.default_rng(0).normal(size=(2, 4, 12)).astype("float32")
    inputs = {
        "token_ids": IDS,
        "encoder_sequence_output": memory,
        "encoder_padding_mask": np.array([[1, 1, 0, 0], [1, 1, 1, 1]], bool),
    }
    out = to_numpy(cross(inputs))
    # Masked encoder positions are not attended to.
    memory[0, 2:] = 99.0
    np.testing.assert_allclose(
        to_numpy(cross({**inputs, "encoder_sequence_output": memory}))[0],
        out[0],
        atol=1e-5,
    )
    with pytest.raises(ValueError, match="token_embedding"):
        TransformerDecoderBackbone(30, 6, token_embedding=keras.layers.Dense(2))


@pytest.mark.parametrize(
    "task, backbone",
    [
        (
            lambda: TextClassifier(50, 8, num_layers=1, pooling="attention", **SIZES),
            lambda: TransformerEncoderBackbone(50, 8, num_layers=1, **SIZES),
        ),
        (
            lambda: TransformerLanguageModel(50, 8, num_layers=1, **SIZES),
            lambda: TransformerDecoderBackbone(
                50, 8, num_layers=1, **SIZES, embeddings_initializer=NORMAL_002
            ),
        ),
    ],
)  # fmt: skip
def test_a_task_from_its_backbone_equals_the_task_from_sizes(task, backbone):
    keras.utils.set_random_seed(3)
    from_sizes = task()
    keras.utils.set_random_seed(3)
    built = backbone()
    head = {"pooling": "attention"} if isinstance(from_sizes, TextClassifier) else {}
    from_backbone = type(from_sizes)(backbone=built, **head)
    assert from_backbone.backbone is built
    assert_same_weights(from_sizes, from_backbone)
    assert from_sizes.get_config() == from_backbone.get_config()


def test_a_task_refuses_sizes_beside_a_backbone_and_a_wrong_backbone():
    encoder = TransformerEncoderBackbone(50, 8, num_layers=1, **SIZES)
    with pytest.raises(ValueError, match=r"leave `num_layers` out.*num_layers=3"):
        TextClassifier(backbone=encoder, num_layers=3)
    with pytest.raises(
        ValueError, match="`backbone` must be a TransformerEncoderBackbone"
    ):
        TextClassifier(backbone=TransformerDecoderBackbone(50, 8, **SIZES))
    cross = TransformerDecoderBackbone(50, 8, cross_attention=True, **SIZES)
    with pytest.raises(ValueError, match="no cross-attention"):
        TransformerLanguageModel(backbone=cross)
    decoder = TransformerDecoderBackbone(50, 8, **SIZES)
    with pytest.raises(ValueError, match="cross_attention=False"):
        TransformerTranslator(backbone=encoder, decoder_backbone=decoder)
    wide = TransformerDecoderBackbone(
        50, 8, cross_attention=True, encoder_dim=12, **SIZES
    )
    with pytest.raises(ValueError, match="encoder_dim=12"):
        TransformerTranslator(backbone=encoder, decoder_backbone=wide)
    with pytest.raises(ValueError, match="shared_vocabulary=True"):
        TransformerTranslator(
            backbone=encoder, decoder_backbone=cross, shared_vocabulary=True
        )


def test_a_translator_of_two_backbones_shares_its_embedding_and_round_trips():
    model = TransformerTranslator(
        40, 40, sequence_length=10, num_encoder_layers=1, num_decoder_layers=1,
        shared_vocabulary=True, **SIZES,
    )  # fmt: skip
    assert model.decoder_backbone.embedding is model.backbone.embedding
    assert model.source_embedding is model.target_embedding
    paths = [w.path for w in model.weights]
    assert len(paths) == len(set(paths))  # the two stacks' paths differ
    config = model.get_config()
    again = TransformerTranslator.from_config(config)
    assert again.target_embedding is again.source_embedding
    assert again.get_config() == config


FILES = [
    "classifier_attention_prenorm",
    "classifier_bert",
    "language_model_untied_postnorm",
    "translator",
    "translator_shared_prenorm",
    "translator_bert",
    "ensemble",  # of two classifiers: each member's layout read from its group
]


def fixture_inputs(expected, name):
    if name.startswith("translator"):
        return {
            key: expected[f"{name}/{key}"]
            for key in ("encoder_inputs", "decoder_inputs")
        }
    return expected[f"{name}/token_ids"]


@pytest.mark.parametrize("name", FILES)
def test_a_file_saved_before_the_backbones_loads_and_saves_in_the_new_layout(
    name, tmp_path
):
    """tests/fixtures/tasks_before_backbones_*: each task kind saved by the
    code before the backbones (commit 6612ebe; their weights in the task's
    own groups), with its outputs on the inputs stored beside them."""
    expected = np.load(FIXTURES / "tasks_before_backbones_outputs.npz")
    inputs, want = fixture_inputs(expected, name), expected[f"{name}/output"]
    model = keras.saving.load_model(FIXTURES / f"tasks_before_backbones_{name}.keras")
    np.testing.assert_allclose(to_numpy(model(inputs)), want, atol=1e-5)
    assert '"backbone"' in json.dumps(model.get_config())
    model.save(tmp_path / "again.keras")
    with zipfile.ZipFile(tmp_path / "again.keras") as archive:
        assert '"backbone"' in archive.read("config.json").decode()
    again = keras.saving.load_model(tmp_path / "again.keras")
    np.testing.assert_allclose(to_numpy(again(inputs)), want, atol=1e-5)
    # An old weights file loads into a task built in code.
    with zipfile.ZipFile(FIXTURES / f"tasks_before_backbones_{name}.keras") as archive:
        (tmp_path / "old.weights.h5").write_bytes(archive.read("model.weights.h5"))
    fresh = type(model).from_config(model.get_config())
    fresh.load_weights(tmp_path / "old.weights.h5")
    np.testing.assert_allclose(to_numpy(fresh(inputs)), want, atol=1e-5)


def test_an_old_file_loads_in_a_fresh_process_with_only_keras_and_keras_attn():
    code = (
        "import keras, numpy as np, keras_attn, sys\n"
        "name = sys.argv[1]\n"
        "e = np.load(sys.argv[2])\n"
        "m = keras.saving.load_model(sys.argv[3])\n"
        "x = {k: e[f'{name}/{k}'] for k in ('encoder_inputs', 'decoder_inputs')}\n"
        "np.testing.assert_allclose(np.asarray(m(x)), e[f'{name}/output'], atol=1e-5)\n"
        "print(type(m.backbone).__name__, type(m.decoder_backbone).__name__)\n"
    )
    name = "translator_bert"
    found = subprocess.run(
        [
            sys.executable, "-c", code, name,
            str(FIXTURES / "tasks_before_backbones_outputs.npz"),
            str(FIXTURES / f"tasks_before_backbones_{name}.keras"),
        ],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""},
        cwd=Path(__file__).parents[2], check=False,
    )  # fmt: skip
    assert found.returncode == 0, found.stderr[-3000:]
    assert "TransformerEncoderBackbone TransformerDecoderBackbone" in found.stdout
