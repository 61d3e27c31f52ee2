"""`--ema-momentum`: validation, the best checkpoint, resuming and the end of
training use the optimizer's moving average of the weights, while training
itself goes on with the weights."""

import argparse
import itertools
import json

import keras
import numpy as np
import pytest

from keras_attn import training
from keras_attn.training import fit as fit_module
from tests.test_case import load_example

cli = load_example("_cli")

MOMENTUM = 0.5
STEPS_PER_EPOCH = 4


def run_args(ema_momentum):
    parser = argparse.ArgumentParser()
    cli.add_run_arguments(parser, out="runs/x", epochs=3, time_budget=0.0, batch_size=8)
    parser.add_argument("--learning-rate", type=float, default=0.05)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    return cli.parse_run_args(
        parser, ["--ema-momentum", str(ema_momentum), "--time-budget", "0"]
    )


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8 * STEPS_PER_EPOCH, 3)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5]]) + 0.3).astype("float32")
    return x, y


def compiled_model(args):
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=cli.make_optimizer(args), loss="mse")
    return model


class RecordWeights(keras.callbacks.Callback):
    """The weights after every optimizer step (training's own, not the
    average: no swap happens between a step and its batch end)."""

    def __init__(self):
        super().__init__()
        self.steps = []
        self.initial = None

    def on_train_begin(self, logs=None):
        self.initial = [w.copy() for w in self.model.get_weights()]

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append([w.copy() for w in self.model.get_weights()])


class StopAfterEpoch(keras.callbacks.Callback):
    """Stops at the last batch of epoch `epoch`, as `TimeBudget` does."""

    def __init__(self, epoch):
        super().__init__()
        self.stop_epoch = epoch
        self.epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == self.stop_epoch and batch == STEPS_PER_EPOCH - 1:
            self.model.stop_training = True


class Interrupt(Exception):
    pass


class InterruptAtEpoch(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.interrupt_epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.interrupt_epoch:
            raise Interrupt


def moving_average(steps, momentum=MOMENTUM):
    """Keras' EMA: the weights after the first step, then
    `momentum * average + (1 - momentum) * weights` after each later one."""
    average = [w.copy() for w in steps[0]]
    for weights in steps[1:]:
        average = [
            momentum * a + (1 - momentum) * w
            for a, w in zip(average, weights, strict=True)
        ]
    return average


def fit(model, args, out, extra=(), epochs=3):
    x, y = data()
    budget = training.TimeBudget(None)
    callbacks = training.standard_callbacks(
        out, budget, "val_loss", mode="min", ema=args.ema_momentum > 0
    )
    return model.fit(
        x,
        y,
        validation_data=(x[:8], y[:8]),
        batch_size=8,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[*extra, *callbacks],
    )


def assert_weights_close(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)


def test_an_early_stop_ends_with_the_average_and_checkpoints_it(tmp_path):
    args = run_args(MOMENTUM)
    model = compiled_model(args)
    record = RecordWeights()
    history = fit(model, args, tmp_path, extra=(record, StopAfterEpoch(1)))

    assert len(record.steps) == 2 * STEPS_PER_EPOCH  # stopped before epoch 3 of 3
    average = moving_average(record.steps)
    last = record.steps[-1]
    assert not np.allclose(average[0], last[0])  # the test tells the two apart
    assert_weights_close(model.get_weights(), average)

    checkpoint = compiled_model(args)
    checkpoint.load_weights(tmp_path / "checkpoints" / "best.weights.h5")
    best_epoch = int(np.argmin(history.history["val_loss"]))
    assert best_epoch == 1  # the loss still falls: the best is the last epoch
    assert_weights_close(checkpoint.get_weights(), average)

    # The reported validation loss is the average's.
    x, y = data()
    expected = np.mean((checkpoint.predict(x[:8], verbose=0) - y[:8]) ** 2)
    np.testing.assert_allclose(history.history["val_loss"][-1], expected, rtol=1e-5)


def test_training_itself_is_unchanged_by_the_average(tmp_path):
    """The same steps with and without the average: after each epoch's
    validation and checkpoint, training goes on from its own weights."""
    with_ema, without = RecordWeights(), RecordWeights()
    args = run_args(MOMENTUM)
    model = compiled_model(args)
    fit(model, args, tmp_path / "ema", extra=(with_ema,))
    fit(compiled_model(run_args(0.0)), run_args(0.0), tmp_path / "plain", (without,))

    assert len(with_ema.steps) == 3 * STEPS_PER_EPOCH
    for a, b in zip(with_ema.steps, without.steps, strict=True):
        assert_weights_close(a, b)
    # Every epoch ran: Keras' own hand-back at the last epoch.
    assert_weights_close(model.get_weights(), moving_average(with_ema.steps))


def test_an_interrupted_run_resumes_to_the_same_average(tmp_path):
    args = run_args(MOMENTUM)
    whole = RecordWeights()
    uninterrupted = compiled_model(args)
    fit(uninterrupted, args, tmp_path / "whole", extra=(whole,))

    first = compiled_model(args)
    with pytest.raises(Interrupt):
        fit(first, args, tmp_path / "resumed", extra=(InterruptAtEpoch(2),))
    resumed = compiled_model(args)  # a new process: fresh model and optimizer
    fit(resumed, args, tmp_path / "resumed")

    assert_weights_close(resumed.get_weights(), moving_average(whole.steps))
    assert_weights_close(resumed.get_weights(), uninterrupted.get_weights())


def test_make_optimizer_keeps_an_average_only_when_asked():
    assert not cli.make_optimizer(run_args(0.0)).use_ema
    optimizer = cli.make_optimizer(run_args(0.999))
    assert optimizer.use_ema and optimizer.ema_momentum == 0.999


@pytest.mark.parametrize("value", ["1", "1.5", "-0.1"])
def test_ema_momentum_out_of_range_is_an_error(value, capsys):
    parser = argparse.ArgumentParser()
    cli.add_run_arguments(parser, out="runs/x", epochs=3, time_budget=1.0, batch_size=8)
    with pytest.raises(SystemExit):
        cli.parse_run_args(parser, ["--ema-momentum", value])
    assert f"--ema-momentum must be in [0, 1) (0: off). Received: {float(value)}" in (
        capsys.readouterr().err
    )


def test_float16_keeps_the_average_inside_the_loss_scale_optimizer(tmp_path):
    keras.config.set_dtype_policy("mixed_float16")
    args = run_args(MOMENTUM)
    model = compiled_model(args)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    record = RecordWeights()
    fit(model, args, tmp_path, extra=(record, StopAfterEpoch(1)))

    inner = model.optimizer.inner_optimizer
    assert inner.use_ema
    # A step skipped for an overflowing loss scale moves neither the weights
    # nor their average.
    steps = [record.initial, *record.steps]
    applied = [
        after
        for before, after in itertools.pairwise(steps)
        if not all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    ]
    assert len(applied) == int(inner.iterations.numpy()) >= STEPS_PER_EPOCH
    assert_weights_close(model.get_weights(), moving_average(applied))


# Slow: the script end to end; the average's callbacks:
# test_an_early_stop_ends_with_the_average_and_checkpoints_it
@pytest.mark.slow
def test_sentiment_script_validates_and_stops_with_the_average(tmp_path, monkeypatch):
    """The script's wiring: the optimizer keeps the average, and the swap sits
    after the backup and the early stop and before the best checkpoint."""
    from tests.examples.test_mixed_precision import TrainingProbe, load_sentiment_script
    from tests.examples.test_scripts import write_reviews

    probe = TrainingProbe()
    made = []
    standard_callbacks = training.standard_callbacks

    def recording(*args, **kwargs):
        made.append(standard_callbacks(*args, **kwargs))
        return [*made[-1], probe]

    monkeypatch.setattr(fit_module, "standard_callbacks", recording)
    out = tmp_path / "run"
    load_sentiment_script().main(
        [
            "--smoke",
            "--pretrained",
            "none",
            "--data",
            str(write_reviews(tmp_path / "reviews.tsv", 320)),
            "--out",
            str(out),
            "--ensemble",
            "1",
            "--epochs",
            "2",
            "--ema-momentum",
            "0.9",
            "--no-export",
        ]
    )
    (callbacks,) = made
    (optimizer,) = probe.optimizers
    assert optimizer.use_ema and optimizer.ema_momentum == 0.9
    kinds = [type(callback).__name__ for callback in callbacks]
    assert kinds.index("BackupAndRestore") < kinds.index("SwapEMAWeights")
    assert kinds.index("EarlyStopping") < kinds.index("SwapEMAWeights")
    assert kinds.index("SwapEMAWeights") < kinds.index("ModelCheckpoint")
    member = keras.saving.load_model(out / "model.keras", compile=False)
    assert all(np.isfinite(w).all() for w in member.get_weights())
    run = json.loads((out / "metrics.json").read_text())
    assert run["config"]["ema_momentum"] == 0.9
    assert 0.0 <= run["metrics"]["test_accuracy"] <= 1.0
