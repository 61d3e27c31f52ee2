"""Mixed-precision training end to end (the layer-level checks are
`tests/test_case.py`'s `run_precision_test`).

- `mixed_float16`: the optimizer is wrapped in a `LossScaleOptimizer`, the
  loss stays finite, variables stay float32, and the saved and exported
  models predict finite float32 probabilities.
- `mixed_bfloat16` (`large`): the sentiment script reaches the float32 test
  accuracy on the real movie-review sentences within 1 point.
"""

import json
import math

import keras
import numpy as np
import pytest

from tests.examples.test_scripts import run_script, write_reviews
from tests.test_case import load_example

pytestmark = pytest.mark.tf_only


def load_sentiment_script():
    return load_example("sentiment")


class TrainingProbe(keras.callbacks.Callback):
    """Records what `fit` actually ran with: optimizer, losses, policy."""

    def __init__(self):
        super().__init__()
        self.losses = []
        self.optimizers = []
        self.policies = []

    def on_train_begin(self, logs=None):
        self.optimizers.append(self.model.optimizer)
        self.policies.append(self.model.dtype_policy.name)

    def on_train_batch_end(self, batch, logs=None):
        # The running mean of the epoch: one NaN batch makes it NaN.
        self.losses.append(float(logs["loss"]))


@pytest.fixture
def reviews_file(tmp_path):
    """640 reviews: `--smoke` keeps 26 train / 7 validation / 6 test."""
    return write_reviews(tmp_path / "reviews.tsv", 320)


def assert_float32_variables_finite(model):
    for variable in model.weights:
        assert variable.dtype == "float32", variable.path
        assert np.isfinite(keras.ops.convert_to_numpy(variable)).all(), variable.path


# Slow: the script end to end; float16's optimizer wrapping and loss scale:
# test_float16_compile_wraps_the_optimizer_and_scales_the_loss,
# test_float16_loss_scale_backs_off_from_overflow
@pytest.mark.slow
def test_sentiment_script_float16_trains_with_loss_scaling(
    reviews_file, tmp_path, monkeypatch
):
    import tensorflow as tf

    from keras_attn.training import fit as fit_module

    probe = TrainingProbe()
    standard_callbacks = fit_module.standard_callbacks
    monkeypatch.setattr(
        fit_module,
        "standard_callbacks",
        lambda *args, **kwargs: [*standard_callbacks(*args, **kwargs), probe],
    )
    out = tmp_path / "run"
    load_sentiment_script().main(
        [
            "--smoke",
            "--pretrained",
            "none",
            "--data",
            str(reviews_file),
            "--out",
            str(out),
            "--mixed-precision",
            "float16",
            "--ensemble",
            "1",
            "--epochs",
            "3",
            "--batch-size",
            "8",
            "--time-budget",
            "0",  # no budget: --epochs only
        ]
    )

    assert probe.policies == ["mixed_float16"]
    (optimizer,) = probe.optimizers
    assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    assert isinstance(optimizer.inner_optimizer, keras.optimizers.AdamW)
    assert int(optimizer.iterations.numpy()) > 0  # not every step skipped
    scale = float(optimizer.dynamic_scale.numpy())
    assert math.isfinite(scale) and scale >= 1.0
    assert len(probe.losses) == 12  # 4 steps x 3 epochs
    assert all(math.isfinite(loss) for loss in probe.losses), probe.losses

    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["environment"]["dtype_policy"] == "mixed_float16"
    assert metrics["config"]["mixed_precision"] == "float16"
    assert 0.0 <= metrics["metrics"]["test_accuracy"] <= 1.0

    model = keras.saving.load_model(out / "model.keras", compile=False)
    assert model.embedding.dtype_policy.name == "mixed_float16"
    assert_float32_variables_finite(model)
    token_ids = np.array([[5, 9, 17, 3, 0, 0], [8, 2, 0, 0, 0, 0]], "int32")
    probabilities = model.predict(token_ids, verbose=0)
    assert probabilities.dtype == np.float32 and probabilities.shape == (2, 1)
    assert np.isfinite(probabilities).all()

    serving = tf.saved_model.load(str(out / "export" / "sentiment" / "1"))
    outputs = serving.signatures["serving_default"](
        text=tf.constant(["a warm and clever film", "", "dull, dull, dull"])
    )
    served = outputs["positive_probability"]
    assert served.dtype == tf.float32 and served.shape == (3,)
    assert np.isfinite(served.numpy()).all()
    assert ((served.numpy() >= 0) & (served.numpy() <= 1)).all()


def sentiment_batches(seed=0, batch_size=16, steps=6, length=12, vocabulary=50):
    rng = np.random.default_rng(seed)
    token_ids = rng.integers(1, vocabulary, (batch_size * steps, length))
    token_ids[:, length // 2 :] *= rng.integers(0, 2, (batch_size * steps, 1))
    labels = (token_ids[:, 0] % 2).astype("float32")[:, None]
    return token_ids.astype("int32"), labels


def float16_classifier():
    from keras_attn.models import TextClassifier

    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    return TextClassifier(
        50, 12, embedding_dim=16, num_layers=1, num_heads=2, intermediate_dim=32
    )


def test_float16_compile_wraps_the_optimizer_and_scales_the_loss():
    model = float16_classifier()
    assert model.encoder_blocks[0].compute_dtype == "float16"
    model.compile(optimizer=keras.optimizers.AdamW(1e-3), loss="binary_crossentropy")
    optimizer = model.optimizer
    assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    token_ids, labels = sentiment_batches()
    history = model.fit(token_ids, labels, batch_size=16, epochs=2, verbose=0)

    assert all(math.isfinite(loss) for loss in history.history["loss"])
    scale = float(optimizer.dynamic_scale.numpy())
    assert math.isfinite(scale) and scale >= 1.0
    # The loss the gradients are taken of is scaled by the current factor.
    assert float(optimizer.scale_loss(keras.ops.ones(()))) == scale
    assert int(optimizer.iterations.numpy()) == 12  # no step was skipped
    assert_float32_variables_finite(model)
    probabilities = model.predict(token_ids[:4], verbose=0)
    assert probabilities.dtype == np.float32 and np.isfinite(probabilities).all()


def test_float16_loss_scale_backs_off_from_overflow():
    """A scale too large for float16 gradients: the overflowing steps are
    skipped (weights untouched, no NaN) and the scale halves until they fit."""
    model = float16_classifier()
    initial = [keras.ops.convert_to_numpy(w).copy() for w in model.trainable_weights]
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.AdamW(1e-3), initial_scale=2.0**40
    )
    model.compile(optimizer=optimizer, loss="binary_crossentropy")
    assert model.optimizer is optimizer
    token_ids, labels = sentiment_batches(steps=2)
    model.fit(token_ids[:16], labels[:16], batch_size=16, epochs=1, verbose=0)
    # float16 overflows at 65504: the first step's gradients are inf.
    assert float(optimizer.dynamic_scale.numpy()) == 2.0**39
    assert int(optimizer.iterations.numpy()) == 0
    for before, after in zip(initial, model.trainable_weights, strict=True):
        np.testing.assert_array_equal(before, keras.ops.convert_to_numpy(after))

    history = model.fit(token_ids, labels, batch_size=16, epochs=30, verbose=0)
    scale = float(optimizer.dynamic_scale.numpy())
    assert 1.0 <= scale < 2.0**30
    steps = int(optimizer.iterations.numpy())
    assert 0 < steps < 60  # some skipped, then training resumed
    assert all(math.isfinite(loss) for loss in history.history["loss"])
    assert_float32_variables_finite(model)
    changed = [
        not np.array_equal(before, keras.ops.convert_to_numpy(after))
        for before, after in zip(initial, model.trainable_weights, strict=True)
    ]
    assert any(changed)


# Test accuracy of one model (5 epochs, seeds 1-6 and 1337), float32 vs
# bfloat16: 0.7505/0.7592, 0.7515/0.7573, 0.7544/0.7534, 0.7621/0.7631,
# 0.7631/0.7718, 0.7621/0.7641, 0.7602/0.7524. A seed moves one model by up to
# 1.3 points and the bfloat16-float32 difference of one seed ranges from -0.8
# to +0.9 points (sd 0.6), too close to the 1-point bound; the mean of two
# seeds halves that variance.
LARGE_SEEDS = (1, 2)


@pytest.mark.large
def test_sentiment_bfloat16_reaches_float32_accuracy(tmp_path):
    """The real movie-review sentences, float32 vs mixed_bfloat16: the same
    seeds and configuration, 5 epochs each (no early stopping, no time
    budget), so both take the same optimizer steps."""
    common = [
        "--pretrained",
        "none",  # the from-scratch classifier, as these figures were measured
        "--ensemble",
        "1",
        "--epochs",
        "5",
        "--patience",
        "5",  # no early stopping
        "--time-budget",
        "0",  # no budget: --epochs only
        "--no-export",
    ]
    accuracy = {"float32": [], "mixed_bfloat16": []}
    for seed in LARGE_SEEDS:
        for mode, policy in (("off", "float32"), ("bfloat16", "mixed_bfloat16")):
            out = tmp_path / f"{mode}_{seed}"
            run_script(
                "sentiment.py",
                *common,
                "--seed",
                seed,
                "--mixed-precision",
                mode,
                "--out",
                out,
                timeout=1800,
            )
            metrics = json.loads((out / "metrics.json").read_text())
            assert metrics["environment"]["dtype_policy"] == policy
            assert metrics["config"]["epochs"] == 5
            assert metrics["metrics"]["stopped_by_time_budget"] is False
            assert metrics["metrics"]["test_examples"] == 1030
            accuracy[policy].append(metrics["metrics"]["test_accuracy"])
    # Well above chance (0.50), or the comparison means nothing.
    assert min(accuracy["float32"] + accuracy["mixed_bfloat16"]) > 0.70, accuracy
    mean = {policy: float(np.mean(values)) for policy, values in accuracy.items()}
    # bfloat16 reaches the float32 accuracy within 1 point (measured: +0.7).
    assert mean["mixed_bfloat16"] >= mean["float32"] - 0.01, accuracy
