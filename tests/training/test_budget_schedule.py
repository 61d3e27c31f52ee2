"""`BudgetCosineDecay`: warm-up, then cosine decay to the end of the steps or
of the time budget, whichever comes first."""

import itertools
import math

import keras
import numpy as np
import pytest

from keras_attn.training import BudgetCosineDecay, TimeBudget
from keras_attn.training import callbacks as callbacks_module
from tests.test_case import load_example


def cli():
    return load_example("_cli")


class FakeBudget(TimeBudget):
    def __init__(self, minutes, seconds):
        super().__init__(minutes)
        self._seconds = seconds

    @property
    def seconds(self):
        return self._seconds


def test_warmup_then_cosine_over_the_steps():
    schedule = BudgetCosineDecay(1e-3, warmup_steps=9, total_steps=110, alpha=0.1)
    rates = [schedule.rate(step) for step in range(110)]
    np.testing.assert_allclose(rates[:9], 1e-3 * np.arange(1, 10) / 10)
    # After warm-up, the cosine of the share of the steps done.
    cosine = 0.5 * (1 + math.cos(math.pi * 9 / 110))
    assert math.isclose(rates[9], 1e-3 * (0.1 + 0.9 * cosine))
    # Half-way through the steps: the cosine's mid-point.
    assert math.isclose(schedule.rate(55), 1e-3 * (0.1 + 0.9 * 0.5))
    assert math.isclose(schedule.rate(110), 1e-4)
    assert all(a >= b for a, b in itertools.pairwise(rates[9:]))


def test_the_time_budget_ends_the_decay_first():
    budget = FakeBudget(minutes=10, seconds=300.0)  # half the budget spent
    schedule = BudgetCosineDecay(1e-3, 0, total_steps=10_000, budget=budget)
    assert math.isclose(schedule.progress(100), 0.5)
    assert math.isclose(schedule.rate(100), 1e-3 * (0.1 + 0.9 * 0.5))
    budget._seconds = 600.0
    assert math.isclose(schedule.rate(100), 1e-4)
    # The close the budget keeps for after the last step counts as spent:
    # the decay ends with the last step, not at the budget's end.
    budget._seconds, budget.validation_seconds = 540.0, 60.0
    assert math.isclose(schedule.progress(100), 1.0)
    assert math.isclose(schedule.rate(100), 1e-4)
    # Steps run out before the budget: the steps decide.
    budget._seconds = 60.0
    assert math.isclose(schedule.progress(5_000), 0.5)
    # No budget at all: steps only.
    assert math.isclose(
        BudgetCosineDecay(1e-3, 0, 100, budget=TimeBudget(None)).progress(25), 0.25
    )


def test_sets_the_optimizer_rate_in_fit():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.5), "mse")
    schedule = BudgetCosineDecay(0.2, warmup_steps=0, total_steps=4, alpha=0.0)
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(
                float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))
            )

    x, y = np.ones((8, 2), "float32"), np.zeros((8, 1), "float32")
    history = model.fit(
        x, y, batch_size=2, epochs=1, callbacks=[schedule, Record()], verbose=0
    )
    expected = [0.2 * 0.5 * (1 + math.cos(math.pi * s / 4)) for s in range(4)]
    np.testing.assert_allclose(seen, expected, rtol=1e-6)
    assert history.history["learning_rate"][0] == pytest.approx(expected[-1], rel=1e-6)


def test_a_budget_shorter_than_the_warm_up_still_peaks_and_decays():
    # A slow machine: 10 minutes run out long before 400 warm-up steps.
    budget = FakeBudget(minutes=10, seconds=0.0)
    schedule = BudgetCosineDecay(1e-3, 400, 10_000, budget=budget, alpha=0.1)
    budget._seconds = 60.0  # a tenth of the run, step 20
    assert math.isclose(schedule.rate(20), 1e-3 * 0.1 / 0.25)  # the faster ramp
    budget._seconds = 150.0  # a quarter: the warm-up is over
    assert math.isclose(
        schedule.rate(50), 1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    )
    budget._seconds = 600.0  # the end of the budget, at step 200 of 400
    assert math.isclose(schedule.rate(200), 1e-4)
    # Steps alone: `--steps` shorter than the warm-up.
    short = BudgetCosineDecay(1e-3, 400, total_steps=100, alpha=0.1)
    assert math.isclose(short.rate(0), 1e-3 / 401)
    assert math.isclose(short.rate(10), 1e-3 * 10 / 25)
    assert math.isclose(
        short.rate(25), 1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    )
    assert math.isclose(short.rate(100), 1e-4)
    # `max_warmup_share=None`: the warm-up in steps only.
    steps_only = BudgetCosineDecay(1e-3, 400, 100, alpha=0.1, max_warmup_share=None)
    assert math.isclose(steps_only.rate(99), 1e-3 * 100 / 401)
    # `1`: the warm-up may take the whole run, and ends with it.
    whole = BudgetCosineDecay(1e-3, 400, 100, alpha=0.1, max_warmup_share=1.0)
    assert math.isclose(whole.rate(50), 1e-3 * 0.5)


def test_a_warm_up_within_its_share_is_the_steps_ramp():
    budget = FakeBudget(minutes=10, seconds=100.0)  # a sixth of the run
    schedule = BudgetCosineDecay(1e-3, 400, 10_000, budget=budget)
    assert math.isclose(schedule.rate(299), 1e-3 * 300 / 401)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(peak=1e-3, warmup_steps=0, total_steps=1, max_warmup_share=0.0),
            r"`max_warmup_share` must be in \(0, 1\]. Received: max_warmup_share=0.0",
        ),
        (dict(peak=0.0, warmup_steps=0, total_steps=1), "peak"),
        (dict(peak=1e-3, warmup_steps=-1, total_steps=1), "warmup_steps"),
        (dict(peak=1e-3, warmup_steps=0, total_steps=0), "total_steps"),
        (dict(peak=1e-3, warmup_steps=0, total_steps=1, alpha=2.0), "alpha"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BudgetCosineDecay(**kwargs)


def run_parser():
    import argparse

    parser = argparse.ArgumentParser()
    cli().add_run_arguments(
        parser, out="runs/x", epochs=7, time_budget=10.0, batch_size=8
    )
    return parser


def test_time_budget_zero_means_no_budget():
    parse_run_args = cli().parse_run_args

    assert parse_run_args(run_parser(), []).time_budget == 10.0
    args = parse_run_args(run_parser(), ["--time-budget", "0"])
    assert args.time_budget is None and args.epochs == 7
    assert TimeBudget(args.time_budget).budget is None


def test_negative_time_budget_is_an_error(capsys):
    parse_run_args = cli().parse_run_args

    with pytest.raises(SystemExit):
        parse_run_args(run_parser(), ["--time-budget", "-1"])
    assert "--time-budget must be >= 0" in capsys.readouterr().err


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def budget_on_a_fake_clock(monkeypatch, seconds):
    """A `TimeBudget` of `seconds` on a clock the test moves, and its model."""
    import types

    clock = Clock()
    monkeypatch.setattr(callbacks_module.time, "monotonic", clock)
    budget = TimeBudget(minutes=seconds / 60)
    model = types.SimpleNamespace(stop_training=False)
    budget.set_model(model)
    return budget, clock, model


def test_time_budget_counts_from_start_and_keeps_validation_inside(monkeypatch):
    budget, clock, model = budget_on_a_fake_clock(monkeypatch, 10)
    budget.start()  # before fit: its set-up counts
    clock.now += 1.0
    budget.on_train_begin()  # does not restart the clock
    assert budget.seconds == 1.0
    clock.now += 1.0
    budget.on_test_begin()
    clock.now += 3.0  # a 3-second validation pass
    budget.on_test_end()
    assert budget.validation_seconds == 3.0
    clock.now += 1.0  # 6 s spent + 3 s of validation to come < 10 s
    budget.on_train_batch_end(0)
    assert not model.stop_training
    clock.now += 1.0  # 7 s + 3 s: the next validation would end past the budget
    budget.on_train_batch_end(1)
    assert model.stop_training and budget.stopped_early


def test_time_budget_keeps_the_longest_epoch_close_inside(monkeypatch):
    budget, clock, model = budget_on_a_fake_clock(monkeypatch, 20)
    budget.start()
    budget.on_epoch_begin(0)
    clock.now += 1.0
    budget.on_train_batch_end(0)  # the epoch's last batch, 1 s spent
    budget.on_test_begin()
    clock.now += 3.0  # a 3-second validation pass
    budget.on_test_end()
    clock.now += 2.0  # then 2 s of checkpoints and logs
    budget.on_epoch_begin(1)
    clock.now += 1.0  # and 1 s until the new epoch's first batch
    budget.on_train_batch_begin(0)
    assert budget.validation_seconds == 3.0 and budget.closing_seconds == 6.0
    assert budget.reserve == 6.0
    clock.now += 6.0
    budget.on_train_batch_end(0)  # 13 s + a 6-second close < 20 s
    assert not model.stop_training
    clock.now += 1.0
    budget.on_train_batch_begin(1)  # later batches are not part of a close
    assert budget.closing_seconds == 6.0
    budget.on_train_batch_end(1)  # 14 s + 6 s: the close would end at 20 s
    assert model.stop_training and budget.stopped_early


def test_a_quicker_close_does_not_shrink_the_reserve(monkeypatch):
    budget, clock, model = budget_on_a_fake_clock(monkeypatch, 20)
    budget.start()
    budget.on_epoch_begin(0)
    budget.on_train_batch_end(0)
    budget.on_test_begin()
    clock.now += 3.0  # a 3-second validation pass
    budget.on_test_end()
    clock.now += 2.0  # in a 5-second close
    budget.on_epoch_begin(1)
    budget.on_train_batch_begin(0)
    clock.now += 1.0
    budget.on_train_batch_end(0)
    budget.on_test_begin()
    clock.now += 1.0  # a faster validation pass and close
    budget.on_test_end()
    budget.on_epoch_begin(2)
    budget.on_train_batch_begin(0)
    assert budget.validation_seconds == 3.0
    assert budget.closing_seconds == 5.0 and budget.reserve == 5.0
    clock.now += 7.5
    budget.on_train_batch_end(0)  # 14.5 s + 5 s < 20 s
    assert not model.stop_training
    clock.now += 0.5
    budget.on_train_batch_end(1)  # 15 s + 5 s: the close would end past 20 s
    assert model.stop_training and budget.stopped_early


def test_time_budget_without_start_counts_from_train_begin(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(callbacks_module.time, "monotonic", clock)
    budget = TimeBudget(minutes=1)
    assert budget.seconds == 0.0
    clock.now += 5.0
    budget.on_train_begin()
    clock.now += 2.0
    assert budget.seconds == 2.0


def test_hold_keeps_the_peak_then_decays_over_the_rest():
    schedule = BudgetCosineDecay(1e-3, 10, total_steps=110, alpha=0.1, hold=0.5)
    assert schedule.rate(10) == 1e-3 and schedule.rate(55) == 1e-3  # held
    # Three quarters through: half-way through the decay.
    assert math.isclose(schedule.rate(82.5), 1e-3 * (0.1 + 0.9 * 0.5))
    assert math.isclose(schedule.rate(110), 1e-4)
    budget = FakeBudget(minutes=10, seconds=450.0)  # the budget decides first
    timed = BudgetCosineDecay(1e-3, 0, 10_000, budget=budget, alpha=0, hold=0.5)
    assert math.isclose(timed.rate(20), 1e-3 * 0.5)
    with pytest.raises(ValueError, match=r"`hold` must be in \[0, 1\)"):
        BudgetCosineDecay(1e-3, 0, 100, hold=1.0)


def test_lr_hold_out_of_range_is_an_error(capsys):
    parse_run_args = cli().parse_run_args

    parser = run_parser()
    parser.add_argument("--lr-hold", type=float, default=0.0)
    assert parse_run_args(parser, ["--lr-hold", "0.8"]).lr_hold == 0.8
    with pytest.raises(SystemExit):
        parse_run_args(parser, ["--lr-hold", "1.5"])
    assert "--lr-hold must be in [0, 1)" in capsys.readouterr().err


def fit_tiny_model(out, epochs, callbacks=(), minutes=10.0, **kwargs):
    """`fit_within_budget` on a tiny regression; `callbacks` run first."""
    import tensorflow as tf

    from keras_attn import training

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.1), "mse")
    fit, extra_callbacks = model.fit, list(callbacks)
    model.fit = lambda data, callbacks, **fit_kwargs: fit(
        data, callbacks=[*extra_callbacks, *callbacks], **fit_kwargs
    )
    x, y = np.ones((8, 2), "float32"), np.zeros((8, 1), "float32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    return training.fit_within_budget(
        model, data, data, out, epochs=epochs, minutes=minutes, verbose=0, **kwargs
    )


def recorded_seconds(out):
    import json

    return json.loads((out / "budget.json").read_text())["seconds"]


class BatchClock(keras.callbacks.Callback):
    """A clock that stands still except for one second per training batch
    (moved before the budget sees the batch), so a fit's time is exact: two
    batches per epoch of `fit_tiny_model` are two seconds."""

    def __init__(self):
        super().__init__()
        self.now = 1000.0

    def __call__(self):
        return self.now

    def on_train_batch_begin(self, batch, logs=None):
        self.now += 1.0


@pytest.mark.tf_only
def test_a_finished_fit_is_not_repeated(tmp_path):
    clock = BatchClock()
    first = fit_tiny_model(tmp_path, epochs=2, callbacks=[clock], clock=clock)
    assert not (tmp_path / "backup").exists()  # the fit finished
    assert first.steps == 4 and not first.skipped
    # Two epochs of two batches: four seconds, recorded and returned.
    assert recorded_seconds(tmp_path) == 4.0 and first.seconds == 4.0
    # The same directory again: the finished fit is found, nothing trains.
    again = fit_tiny_model(tmp_path, epochs=2, callbacks=[clock], clock=clock)
    assert again.skipped and again.steps == 4 and again.seconds == 0.0
    assert again.final_train_loss == first.final_train_loss
    assert recorded_seconds(tmp_path) == 4.0
    # Without its record the directory trains anew, with the whole budget:
    # the four seconds of the first fit are not counted again.
    (tmp_path / "done.json").unlink()
    fresh = fit_tiny_model(tmp_path, epochs=2, callbacks=[clock], clock=clock)
    assert fresh.budget.spent_before == 0.0 and fresh.steps == 4
    assert recorded_seconds(tmp_path) == 4.0
    assert fresh.budget.seconds == 4.0 and fresh.seconds == 4.0


@pytest.mark.tf_only
def test_a_resumed_run_counts_the_time_the_interrupted_run_spent(tmp_path):
    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                raise KeyboardInterrupt  # after epoch 0's backup and budget

    clock = BatchClock()
    with pytest.raises(KeyboardInterrupt):
        fit_tiny_model(tmp_path, epochs=2, callbacks=[clock, Interrupt()], clock=clock)
    assert (tmp_path / "backup").exists()
    assert recorded_seconds(tmp_path) == 2.0  # epoch 0's two batches
    result = fit_tiny_model(tmp_path, epochs=2, callbacks=[clock], clock=clock)
    assert result.budget.spent_before == 2.0
    assert result.steps == 4  # epoch 0 restored from the backup, epoch 1 trained
    assert not (tmp_path / "backup").exists()
    # This call trained one epoch (2 s); the record holds both calls' time.
    assert result.seconds == 2.0
    assert recorded_seconds(tmp_path) == 4.0 and result.budget.seconds == 4.0


@pytest.mark.tf_only
def test_max_steps_stops_mid_epoch_and_ends_the_schedule_there(tmp_path):
    rates = []

    class Rates(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            rates.append(
                float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
            )

    result = fit_tiny_model(
        tmp_path,
        epochs=5,
        callbacks=[Rates()],
        max_steps=3,
        learning_rate=1.0,
        steps_per_epoch=2,
        decay_alpha=0.0,
    )
    assert result.steps == 3  # not the 10 of 5 epochs, nor the 4 of 2
    # The cosine runs over the 3 steps: 1, cos(pi / 3) share, cos(2 pi / 3).
    np.testing.assert_allclose(rates, [1.0, 0.75, 0.25], atol=1e-6)


class TickingClock:
    """A clock that moves `step` seconds every time it is read."""

    def __init__(self, step):
        self.now, self.step = 0.0, step

    def __call__(self):
        self.now += self.step
        return self.now


def test_the_budget_reads_the_clock_it_is_given(monkeypatch):
    # The machine's clock is not read at all.
    monkeypatch.setattr(callbacks_module.time, "monotonic", lambda: 1 / 0)
    clock = Clock()
    budget = TimeBudget(minutes=1.0, clock=clock)
    budget.start()
    clock.now += 30
    assert budget.seconds == 30.0 and budget.now() == clock.now


@pytest.mark.tf_only
def test_fit_within_budget_stops_by_the_given_clock_on_any_machine(tmp_path):
    """A clock that moves a minute at every reading ends a one-minute fit
    after its first step; a stopped clock never ends one. Neither depends
    on how fast the machine trains."""
    hurried = fit_tiny_model(
        tmp_path / "a", epochs=5, minutes=1.0, clock=TickingClock(60.0)
    )
    assert hurried.stopped_by_time_budget and hurried.steps == 1
    assert hurried.seconds > 0  # timed by the same clock
    stopped = fit_tiny_model(tmp_path / "b", epochs=2, minutes=1e-6, clock=lambda: 0.0)
    assert not stopped.stopped_by_time_budget and stopped.steps == 4
    assert stopped.seconds == 0.0
