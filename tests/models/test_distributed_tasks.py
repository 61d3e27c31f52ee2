"""Each task under `keras.distribution` on JAX with 8 virtual CPU devices:
data parallel (8 x 1), model parallel (1 x 2 and 1 x 4) and both (2 x 4),
with the layout map of `get_layout_map`, and the 2 x 4 mesh of
`make_distribution("data:2,model:4")` (kernels replicated over the batch
axis). Three SGD steps give the losses and
weights of one device, and `generate`, `classify` and `translate` (the text
methods, through their compiled decodings) give its outputs under the
sharded weights. In a fresh process: the device count is fixed when JAX
starts."""

import textwrap

import numpy as np
import pytest

from tests.test_case import run_on_virtual_devices

SCRIPT = textwrap.dedent(
    """
    import json, sys, tempfile

    import numpy as np
    import keras
    from keras_attn.models import (
        TextClassifier, TransformerLanguageModel, TransformerTranslator,
    )
    from keras_attn.text import SubwordTokenizer, train_subword_vocabulary

    kind = sys.argv[1]
    assert len(keras.distribution.list_devices()) == 8
    words = ["big", "small", "red", "old", "new", "green", "blue", "happy"]
    sentences = [f"the cat {w} sat on the mat number {i}"
                 for i, w in enumerate(words * 40)]
    tokenizer = SubwordTokenizer(train_subword_vocabulary(
        sentences, tempfile.mkdtemp() + "/vocabulary.model",
        vocabulary_size=320, lowercase=True))
    size = tokenizer.vocabulary_size  # 320: divides the model axis (2, 4)
    sizes = dict(embedding_dim=32, num_heads=4, intermediate_dim=64, dropout=0.0)

    memory_efficient_calls = []
    if kind == "language_model_memory_efficient":
        # Every attention call on the memory-efficient path (counted), with
        # rotary positions and grouped-query attention (4 key/value heads of
        # 8): `flash_attention=True` on every attention layer takes it at any
        # length where no fused kernel runs (a CPU).
        import importlib
        attention_ops = importlib.import_module("keras_attn.ops.attention")
        original = attention_ops.memory_efficient_attention

        def counted(*args, **kwargs):
            memory_efficient_calls.append(1)
            return original(*args, **kwargs)

        attention_ops.memory_efficient_attention = counted
        sizes.update(num_heads=8, num_key_value_heads=4, position="rotary")

    def make():
        if kind.startswith("language_model"):
            model = TransformerLanguageModel(size, 16, num_layers=2,
                                             tokenizer=tokenizer, **sizes)
            if "efficient" in kind:
                for layer in model._flatten_layers(include_self=False):
                    if hasattr(layer, "flash_attention"):
                        layer.flash_attention = True
            return model
        if kind == "classifier":
            return TextClassifier(size, 16, num_layers=2, tokenizer=tokenizer,
                                  **sizes)
        return TransformerTranslator(
            size, size, sequence_length=16, num_encoder_layers=1,
            num_decoder_layers=1, shared_vocabulary=True,
            source_tokenizer=tokenizer, target_tokenizer=tokenizer, **sizes)

    ids = np.random.RandomState(0).randint(4, size, (8, 16)).astype("int32")
    if kind.startswith("language_model"):
        x, y = ids, np.roll(ids, -1, axis=1)
    elif kind == "classifier":
        x, y = ids, (ids[:, 0] % 2).astype("float32")
    else:
        x = {"encoder_inputs": ids, "decoder_inputs": ids}
        y = np.roll(ids, -1, axis=1)
    texts = ["the cat sat", "the big mat number 3", "green", ""]
    prompt = ids[:3, :5]

    def decode(model):
        if kind.startswith("language_model"):
            return {
                "texts": model.generate(texts, max_new_tokens=6, verbose=0),
                "ids": np.asarray(model.generate_ids(prompt, 12)).tolist(),
                "scores": np.asarray(
                    model.score_ids(ids)["log_likelihood"]).tolist(),
            }
        if kind == "classifier":
            found = model.classify(texts, verbose=0)
            return {"texts": found["label"],
                    "scores": found["positive_probability"].tolist()}
        tokens, scores = model.translate_ids(ids[:3], 8, 3, 0.6)
        return {"texts": model.translate(texts, 3, 0.6, 8, verbose=0),
                "ids": np.asarray(tokens).tolist(),
                "scores": np.asarray(scores).tolist()}

    def run(distribution, initial):
        keras.distribution.set_distribution(distribution)
        keras.utils.set_random_seed(1)
        model = make()
        if initial is not None:
            model.set_weights(initial)
        start = model.get_weights()
        loss = (keras.losses.BinaryCrossentropy() if kind == "classifier"
                else keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        rate = 0.03 if kind == "classifier" else 0.1
        model.compile(optimizer=keras.optimizers.SGD(rate), loss=loss)
        losses = [float(model.train_on_batch(x, y)) for _ in range(3)]
        kernel = next(w for w in model.weights
                      if w.path.endswith("/query/kernel"))
        found = {
            "losses": losses,
            "weights": [w.tolist() for w in model.get_weights()],
            "decoded": decode(model),
            "query_kernel": list(kernel.shape),
            "query_kernel_shards": sorted(
                {str(s.data.shape) for s in kernel.value.addressable_shards}),
        }
        keras.distribution.set_distribution(None)
        return start, found

    initial, one = run(None, None)
    results = {"one_device": one}
    devices = keras.distribution.list_devices()
    for shape in ((8, 1), (1, 2), (1, 4), (2, 4)):
        mesh = keras.distribution.DeviceMesh(
            shape, ["batch", "model"], devices[: shape[0] * shape[1]])
        distribution = keras.distribution.ModelParallel(
            layout_map=type(make()).get_layout_map(mesh), batch_dim_name="batch")
        results[f"{shape[0]}x{shape[1]}"] = run(distribution, initial)[1]
    # What --distribution data:2,model:4 sets: kernels replicated over batch.
    from keras_attn.training import make_distribution
    results["data:2,model:4"] = run(make_distribution("data:2,model:4"), initial)[1]
    results["memory_efficient_calls"] = len(memory_efficient_calls)
    print(json.dumps(results))
    """
)

# Mesh -> the query kernel's (width, heads) splits.
MESHES = {
    "8x1": (8, 1),
    "1x2": (1, 2),
    "1x4": (1, 4),
    "2x4": (2, 4),
    "data:2,model:4": (1, 4),  # fsdp=False: the width is not split
}


def run(kind):
    return run_on_virtual_devices(SCRIPT, kind)


@pytest.mark.large
@pytest.mark.parametrize(
    "kind",
    ["language_model", "language_model_memory_efficient", "classifier", "translator"],
)
def test_each_task_trains_and_decodes_as_on_one_device(kind):
    results = run(kind)
    calls = results.pop("memory_efficient_calls")
    assert (calls > 0) == (kind == "language_model_memory_efficient"), calls
    one = results.pop("one_device")
    assert one["losses"][-1] < one["losses"][0]
    width, heads, head_dim = one["query_kernel"]
    # One device holds the whole query kernel.
    assert one["query_kernel_shards"] == [str((width, heads, head_dim))]
    assert set(results) == set(MESHES)
    for mesh, found in results.items():
        batch, model = MESHES[mesh]
        message = f"{kind} on the {mesh} mesh"
        np.testing.assert_allclose(found["losses"], one["losses"], rtol=1e-5)
        for weight, expected in zip(found["weights"], one["weights"], strict=True):
            np.testing.assert_allclose(weight, expected, atol=1e-5, err_msg=message)
        # The heads are split on the model axis, the model width on the batch
        # axis: the weights were sharded while the task decoded.
        shard = str((width // batch, heads // model, head_dim))
        assert found["query_kernel_shards"] == [shard], message
        decoded, expected = found["decoded"], one["decoded"]
        assert decoded["texts"] == expected["texts"], message
        if "ids" in expected:
            assert decoded["ids"] == expected["ids"], message
        np.testing.assert_allclose(
            decoded["scores"], expected["scores"], rtol=1e-4, atol=1e-5, err_msg=message
        )
