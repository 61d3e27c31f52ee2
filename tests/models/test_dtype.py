"""`dtype` on every backbone and task, as keras-hub's backbones take it.

Every layer a backbone or task builds gets the policy: the variables are in
its variable dtype, a backbone's outputs in its compute dtype (a task's
probabilities and logits stay float32, as documented); the policy is in the
config, so a saved and loaded model has it again; a task built on a
backbone takes the backbone's; a quantized backbone records its quantized
layers in a `DTypePolicyMap` and rebuilds quantized.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_attn import models

POLICIES = ("float32", "bfloat16", "mixed_bfloat16", "mixed_float16")
SIZES = dict(embedding_dim=8, num_layers=1, num_heads=2, intermediate_dim=16)
# Layers that are float32 under every policy (the tasks' outputs).
FLOAT32_OUTPUTS = ("logits", "positive_probability")


def _build(kind, dtype):
    if kind == "encoder_backbone":
        return models.TransformerEncoderBackbone(50, 16, **SIZES, dtype=dtype)
    if kind == "decoder_backbone":
        return models.TransformerDecoderBackbone(
            50, 16, **SIZES, cross_attention=True, encoder_dim=6, dtype=dtype
        )
    if kind == "classifier":
        return models.TextClassifier(50, 16, **SIZES, pooling="attention", dtype=dtype)
    if kind == "language_model":
        return models.TransformerLanguageModel(
            50, 16, **SIZES, tie_embeddings=False, dtype=dtype
        )
    if kind == "transformer_translator":
        return models.TransformerTranslator(
            50,
            40,
            16,
            embedding_dim=8,
            num_encoder_layers=1,
            num_decoder_layers=1,
            num_heads=2,
            intermediate_dim=16,
            dtype=dtype,
        )
    return models.RNNTranslator(50, 40, embedding_dim=8, units=8, dtype=dtype)


KINDS = (
    "encoder_backbone",
    "decoder_backbone",
    "classifier",
    "language_model",
    "transformer_translator",
    "rnn_translator",
)


def _inputs(kind):
    ids = np.array([[5, 7, 9, 0], [3, 4, 0, 0]], "int32")
    if kind == "decoder_backbone":
        return {
            "token_ids": ids,
            "encoder_sequence_output": np.ones((2, 3, 6), "float32"),
            "encoder_padding_mask": np.array([[1, 1, 0], [1, 0, 0]], bool),
        }
    if kind.endswith("translator"):
        return {"encoder_inputs": ids, "decoder_inputs": ids}
    return ids


def _variable_dtypes(model) -> dict:
    """`{path: dtype}` of the float variables, the float32 outputs left out."""
    return {
        variable.path: keras.backend.standardize_dtype(variable.dtype)
        for variable in model.weights
        if "float" in keras.backend.standardize_dtype(variable.dtype)
        and not any(f"{name}/" in variable.path for name in FLOAT32_OUTPUTS)
    }


def _check_policy(model, kind, policy):
    policy = keras.dtype_policies.get(policy)
    assert model.dtype_policy.name == policy.name
    dtypes = _variable_dtypes(model)
    assert dtypes and set(dtypes.values()) == {policy.variable_dtype}, dtypes
    outputs = model(_inputs(kind), training=False)
    expected = policy.compute_dtype if kind.endswith("backbone") else "float32"
    assert keras.backend.standardize_dtype(outputs.dtype) == expected
    return keras.ops.convert_to_numpy(keras.ops.cast(outputs, "float32"))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kind", KINDS)
def test_every_layer_takes_the_policy(kind, policy):
    model = _build(kind, policy)
    _check_policy(model, kind, policy)
    config = model.get_config()
    if kind.endswith("backbone") or kind == "rnn_translator":
        assert keras.dtype_policies.get(config["dtype"]).name == policy
    else:  # the tasks' policy is their backbones'
        assert keras.dtype_policies.get(config["backbone"]["config"]["dtype"]).name == (
            policy
        )


@pytest.mark.parametrize("policy", ("bfloat16", "mixed_float16"))
@pytest.mark.parametrize("kind", KINDS)
def test_the_policy_is_saved_and_loaded(kind, policy, tmp_path):
    model = _build(kind, policy)
    want = _check_policy(model, kind, policy)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    got = _check_policy(loaded, kind, policy)
    np.testing.assert_array_equal(got, want)


def test_a_task_takes_its_backbones_policy():
    backbone = models.TransformerEncoderBackbone(50, 16, **SIZES, dtype="bfloat16")
    classifier = models.TextClassifier(backbone=backbone)
    _check_policy(classifier, "classifier", "bfloat16")
    # Repeating the backbone's policy is allowed; another one is an error.
    models.TextClassifier(backbone=backbone, dtype="bfloat16")
    with pytest.raises(ValueError, match=r"`dtype` must be the given backbone's"):
        models.TextClassifier(backbone=backbone, dtype="mixed_float16")


def test_from_preset_overrides_the_policy(tmp_path):
    backbone = models.TransformerEncoderBackbone(50, 16, **SIZES)
    backbone.save_to_preset(tmp_path / "preset")
    loaded = models.TransformerEncoderBackbone.from_preset(
        tmp_path / "preset", dtype="mixed_bfloat16"
    )
    _check_policy(loaded, "encoder_backbone", "mixed_bfloat16")
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(loaded(_inputs("encoder_backbone"))).astype(
            "float32"
        ),
        keras.ops.convert_to_numpy(backbone(_inputs("encoder_backbone"))),
        atol=0.1,
    )


def test_a_task_preset_takes_a_policy(tmp_path):
    translator = _build("transformer_translator", None)
    translator.save_to_preset(tmp_path / "preset")
    loaded = models.TransformerTranslator.from_preset(
        tmp_path / "preset", dtype="bfloat16"
    )
    _check_policy(loaded, "transformer_translator", "bfloat16")
    for backbone in loaded.backbones:
        assert backbone.dtype_policy.name == "bfloat16"


def test_a_quantized_backbone_records_its_layers_in_a_dtype_policy_map(tmp_path):
    backbone = models.TransformerEncoderBackbone(
        50, 16, **SIZES, dtype="mixed_bfloat16"
    )
    backbone.quantize("int8")
    config = backbone.get_config()
    policy = keras.dtype_policies.get(config["dtype"])
    assert isinstance(policy, keras.dtype_policies.DTypePolicyMap)
    assert policy.default_policy.name == "mixed_bfloat16"
    quantized = {
        layer.path for layer in backbone._flatten_layers() if layer.quantization_mode
    }
    assert quantized and set(policy.keys()) == quantized
    want = keras.ops.convert_to_numpy(
        keras.ops.cast(backbone(_inputs("encoder_backbone")), "float32")
    )
    path = tmp_path / "quantized.keras"
    backbone.save(path)
    loaded = keras.saving.load_model(path)
    assert {
        layer.path for layer in loaded._flatten_layers() if layer.quantization_mode
    } == quantized
    got = keras.ops.convert_to_numpy(
        keras.ops.cast(loaded(_inputs("encoder_backbone")), "float32")
    )
    np.testing.assert_array_equal(got, want)
