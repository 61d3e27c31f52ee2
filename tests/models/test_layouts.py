"""`get_layout_map` on the backbones and tasks: every variable's layout, the
divisibility check, and a few training steps under `ModelParallel` on 8
virtual CPU devices equal to one device (JAX, in a fresh process: the device
count is fixed when JAX starts)."""

import textwrap

import pytest

from tests.test_case import run_on_virtual_devices

SCRIPT = textwrap.dedent(
    """
    import json, re, sys

    import numpy as np
    import keras
    from keras_attn.models import (
        TextClassifier, TransformerDecoderBackbone, TransformerEncoderBackbone,
        TransformerLanguageModel, TransformerTranslator,
    )
    from keras_attn.models.layouts import check_layout_map

    assert len(keras.distribution.list_devices()) == 8
    results = {}
    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"])

    models = {
        "encoder": TransformerEncoderBackbone(
            64, 16, embedding_dim=32, num_layers=2, num_heads=4,
            intermediate_dim=64, position="learned", embedding_norm=True,
            normalize_first=True),
        "decoder": TransformerDecoderBackbone(
            64, 16, embedding_dim=32, num_layers=1, num_heads=8,
            intermediate_dim=64, cross_attention=True, num_key_value_heads=4),
        "language_model": TransformerLanguageModel(
            64, 16, embedding_dim=32, num_layers=1, num_heads=4,
            intermediate_dim=64, position="rotary"),
        "classifier": TextClassifier(64, 16, embedding_dim=32, num_layers=1,
                                     num_heads=4, intermediate_dim=64),
        "translator": TransformerTranslator(
            64, 64, sequence_length=16, embedding_dim=32, num_encoder_layers=1,
            num_decoder_layers=1, num_heads=4, intermediate_dim=64),
    }
    for name, model in models.items():
        layouts = type(model).get_layout_map(mesh)
        check_layout_map(model, layouts)
        results[name] = {
            w.path: [list(w.shape), None if layouts[w.path] is None
                     else list(layouts[w.path].axes)]
            for w in model.weights
        }

    # fsdp=False: the kernels replicated over the batch axis.
    model = models["language_model"]
    replicated = type(model).get_layout_map(mesh, fsdp=False)
    results["no_fsdp"] = {
        w.path: None if replicated[w.path] is None
        else list(replicated[w.path].axes)
        for w in model.weights
    }
    try:
        TransformerLanguageModel.get_layout_map(mesh, fsdp="no")
    except ValueError as error:
        results["fsdp_error"] = str(error)

    # Sizes the mesh does not divide: named before anything is compiled.
    two_heads = TransformerLanguageModel(64, 16, embedding_dim=32, num_layers=1,
                                         num_heads=4, num_key_value_heads=2)
    try:
        check_layout_map(two_heads, two_heads.get_layout_map(mesh))
    except ValueError as error:
        results["error"] = str(error)
    try:
        TransformerLanguageModel.get_layout_map(mesh, model_parallel_dim_name="x")
    except ValueError as error:
        results["axis_error"] = str(error)

    def train():
        # A few steps of SGD, one device against each mesh: the same losses.
        ids = np.random.RandomState(0).randint(1, 64, (8, 16)).astype("int32")
        targets = np.roll(ids, -1, axis=1)

        def losses(distribution):
            keras.distribution.set_distribution(distribution)
            keras.utils.set_random_seed(1)
            model = TransformerLanguageModel(
                64, 16, embedding_dim=32, num_layers=2, num_heads=4,
                intermediate_dim=64, dropout=0.0, position="rotary",
                num_key_value_heads=4)
            model.compile(optimizer=keras.optimizers.SGD(0.5),
                          loss=keras.losses.SparseCategoricalCrossentropy(
                              from_logits=True))
            found = [float(model.train_on_batch(ids, targets)) for _ in range(4)]
            sharding = str(model.backbone.blocks[0]._self_attention_layer
                           .query_dense.kernel.value.sharding)
            keras.distribution.set_distribution(None)
            return found, sharding

        results = {"one_device": losses(None)}
        for shape in ((2, 4), (8, 1)):  # model and data parallel; data alone
            grid = keras.distribution.DeviceMesh(shape, ["batch", "model"])
            distribution = keras.distribution.ModelParallel(
                layout_map=TransformerLanguageModel.get_layout_map(grid),
                batch_dim_name="batch")
            results[f"mesh_{shape[0]}x{shape[1]}"] = losses(distribution)
        return results

    if sys.argv[1] == "train":
        results.update(train())
    print(json.dumps(results))
    """
)


def run(mode):
    return run_on_virtual_devices(SCRIPT, mode)


@pytest.fixture(scope="module")
def results():
    return run("layouts")


def expected_axes(path, shape):
    """The layout each variable should get, from its path and rank alone."""
    *_, layer, variable = path.split("/")
    if layer in ("query", "key", "value"):
        return ["batch", "model", None] if variable == "kernel" else ["model", None]
    if layer == "attention_output":
        return ["model", None, "batch"] if variable == "kernel" else [None]
    if layer == "feedforward_intermediate_dense":
        return ["batch", "model"] if variable == "kernel" else ["model"]
    if layer == "feedforward_output_dense":
        return ["model", "batch"] if variable == "kernel" else [None]
    if layer == "token_embedding":
        return ["model", "batch"]
    if layer == "position_embedding":
        return [None, None]
    if variable in ("gamma", "beta"):
        return [None]
    return None  # task heads: replicated


@pytest.mark.parametrize(
    "name", ["encoder", "decoder", "language_model", "classifier", "translator"]
)
def test_every_variable_gets_its_layout(results, name):
    layouts = results[name]
    assert layouts
    for path, (shape, axes) in layouts.items():
        assert axes == expected_axes(path, shape), path
        assert axes is None or len(axes) == len(shape), path
    kernels = [path for path in layouts if path.endswith("/kernel")]
    blocks = [p for p in kernels if "feedforward" in p or "attention" in p]
    assert blocks and all(layouts[p][1] is not None for p in blocks)


def test_without_fsdp_the_kernels_are_replicated_over_the_batch_axis(results):
    layouts = results["no_fsdp"]
    fsdp = results["language_model"]
    for path, axes in layouts.items():
        expected = fsdp[path][1]
        if expected is not None:  # every "batch" replaced by None, "model" kept
            expected = [None if axis == "batch" else axis for axis in expected]
        assert axes == expected, path
    assert any(axes and "model" in axes for axes in layouts.values())
    assert "Received: fsdp='no'" in results["fsdp_error"]


def test_sizes_the_mesh_does_not_divide_are_named(results):
    error = results["error"]
    assert "/key/kernel" in error and "(32, 2, 8)" in error
    assert "{'batch': 2, 'model': 4}" in error
    assert "model_parallel_dim_name='x'" in results["axis_error"]
    assert "['batch', 'model']" in results["axis_error"]


@pytest.mark.large
def test_training_steps_equal_one_device():
    """Model and data parallel (2 x 4) and data parallel (8 x 1): the losses
    of 4 SGD steps equal one device's, with the kernels sharded."""
    results = run("train")
    one, _ = results["one_device"]
    for mesh in ("mesh_2x4", "mesh_8x1"):
        found, sharding = results[mesh]
        assert len(found) == 4 and found[-1] < found[0]
        for a, b in zip(found, one, strict=True):
            assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), (mesh, found, one)
        assert "NamedSharding" in sharding and "'model'" in sharding
