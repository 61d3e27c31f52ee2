"""The core wheel's smoke test, run by `make check-package` in a fresh virtual
environment that holds the wheel, Keras and JAX only (no TensorFlow):

    KERAS_BACKEND=jax python tests/package/smoke_core.py

Checks that the install pulled in no TensorFlow; imports keras_attn, builds
one functional model from every public layer of `keras_attn.layers` (still
without importing TensorFlow), fits a step, saves and loads a `.keras` file,
and checks that the reloaded model gives the same outputs. Not collected by
pytest (no `test_` prefix): it needs that environment. Prints one line per
check; exits non-zero on any failure.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile

import keras
import numpy as np

import keras_attn
from keras_attn import layers

# Abstract: the base class of BahdanauAttention and LuongAttention.
NOT_A_LAYER_TO_USE = {"BaseAttention"}


def build_model() -> tuple[keras.Model, set[str]]:
    """A small translation-shaped model with every public layer in it;
    returns it and the names of the layer classes it uses."""
    vocabulary, source_length, target_length, dim = 30, 6, 5, 16
    source = keras.Input((source_length,), dtype="int32", name="source")
    target = keras.Input((target_length,), dtype="int32", name="target")

    encoded = layers.TokenAndPositionEmbedding(
        vocabulary, source_length, dim, mask_zero=True
    )(source)  # (B, S, d), masks the padding id 0
    encoded = layers.TransformerEncoder(32, 2, name="encoder_block")(encoded)
    encoded = layers.MultiHeadSelfAttention(2, name="self_attention")(encoded)

    embedded = keras.layers.Embedding(vocabulary, dim)(target)  # (B, T, d)
    sinusoids = layers.SinusoidalPositionEncoding()(embedded)
    learned = layers.PositionEmbedding(target_length)(embedded)
    rotated = layers.RotaryEmbedding()(embedded)  # (B, T, d) turned by position
    decoded = keras.layers.Add()([embedded, sinusoids, learned, rotated])
    decoded = layers.TransformerDecoder(32, 2, name="decoder_block")(decoded, encoded)
    cross, scores = layers.MultiHeadAttention(2, 8, name="cross_attention")(
        decoded, encoded, return_attention_scores=True
    )  # scores (B, 2, T, S)
    biased = keras.layers.Flatten()(layers.AlibiBias()(scores))  # (B, 2 T S)
    grouped = layers.GroupedQueryAttention(8, 2, 1, name="grouped")(decoded, encoded)
    additive = layers.BahdanauAttention(8, name="bahdanau")(decoded, encoded)
    multiplicative = layers.LuongAttention("general", name="luong")(decoded, encoded)
    recurrent = layers.BahdanauDecoder(12, name="rnn_decoder")(decoded, encoded)
    features = keras.layers.Concatenate()(
        [cross, grouped, additive, multiplicative, recurrent]
    )  # (B, T, 4d + 12 + d)
    pooled = layers.AttentionPooling(8, name="pooling")(features)  # (B, F)
    pooled = keras.layers.Concatenate()([pooled, biased])
    outputs = keras.layers.Dense(1, activation="sigmoid")(pooled)
    model = keras.Model([source, target], outputs, name="every_layer")
    used = {type(layer).__name__ for layer in model.layers}
    return model, used


def tensorflow_modules() -> list[str]:
    return sorted(
        m for m in sys.modules if m.split(".")[0] in ("tensorflow", "tensorflow_text")
    )


def main() -> int:
    installed = [
        name
        for name in ("tensorflow", "tensorflow_text", "keras_hub")
        if importlib.util.find_spec(name) is not None
    ]
    assert not installed, f"the core install pulled in {installed}"
    backend = keras.backend.backend()
    assert backend != "tensorflow", "run it with KERAS_BACKEND=jax (or torch)"
    print(f"keras_attn {keras_attn.__version__}, keras {keras.__version__}, {backend}")
    # Class names, so that a second name of a class (`TransformerEncoderBlock`
    # for `TransformerEncoder`) counts as that class.
    public = {
        getattr(layers, name).__name__
        for name in layers.__all__
        if isinstance(getattr(layers, name), type)
        and issubclass(getattr(layers, name), keras.layers.Layer)
    } - NOT_A_LAYER_TO_USE
    model, used = build_model()
    missing = sorted(public - used)
    assert not missing, f"public layers left out of the smoke model: {missing}"
    assert not tensorflow_modules(), f"TensorFlow was imported: {tensorflow_modules()}"
    print(f"built a functional model from all {len(public)} public layers")

    rng = np.random.default_rng(0)
    x = {
        "source": rng.integers(1, 30, (8, 6)).astype("int32"),
        "target": rng.integers(1, 30, (8, 5)).astype("int32"),
    }
    x["source"][:, -1] = 0  # a padded position
    y = rng.integers(0, 2, (8, 1)).astype("float32")
    model.compile(optimizer="adam", loss="binary_crossentropy")
    before = [w.copy() for w in model.get_weights()]
    history = model.fit(x, y, epochs=1, batch_size=8, verbose=0)
    assert np.isfinite(history.history["loss"][0]), history.history
    changed = sum(
        not np.array_equal(a, b)
        for a, b in zip(before, model.get_weights(), strict=True)
    )
    assert changed, "fit changed no weight"
    print(f"fit one step: loss {history.history['loss'][0]:.4f}")

    expected = np.asarray(model.predict(x, verbose=0))
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "every_layer.keras")
        model.save(path)
        restored = keras.saving.load_model(path)
    got = np.asarray(restored.predict(x, verbose=0))
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    print("saved and loaded a .keras file: the same outputs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
