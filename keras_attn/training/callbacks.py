"""Training callbacks: a wall-clock budget, the budget-aware learning-rate
schedule, the moving average of the weights, and the standard set."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import keras

from keras_attn import _validation as v


class TimeBudget(keras.callbacks.Callback):
    """Stops training once `minutes` of wall-clock training time are spent.

    Time already spent before an interruption (recorded in `state_path` by a
    resumed run) counts against the budget. The clock starts at `start()`
    (call it just before `fit`: `fit`'s set-up, the first shuffle buffer and
    the first trace count) or else at `on_train_begin`. Stopping keeps the
    close of the epoch inside the budget: training stops once the time spent
    plus the longest close seen so far (`reserve`) reaches the budget. An
    epoch's close runs from its last training batch to the next epoch's
    first (the validation pass, checkpoints, logs, a new data iterator); the
    longest validation pass stands in for it until a whole close has been
    timed. The longest, not the last: the machine's speed varies between
    epochs.

    The spent time belongs to the interrupted run that the backup resumes:
    `standard_callbacks` calls `forget()` when no backup is left (a new run,
    or one whose training state was cleared), so such a run gets the whole
    budget.

    `clock`: a function that returns the time in seconds (default:
    `time.monotonic`, read at every call); tests and examples pass one of
    their own, so that what they show does not depend on the machine's
    speed.
    """

    def __init__(
        self,
        minutes: float | None,
        state_path: str | os.PathLike | None = None,
        clock=None,
    ):
        super().__init__()
        self.budget = None if minutes is None else float(minutes) * 60.0
        self.clock = clock
        self.state_path = Path(state_path) if state_path else None
        self.spent_before = 0.0
        if self.state_path and self.state_path.exists():
            self.spent_before = json.loads(self.state_path.read_text())["seconds"]
        self.started = None
        self.stopped_early = False
        self.validation_seconds = 0.0  # the longest validation pass
        self.closing_seconds = 0.0  # the longest close of an epoch
        self._validation_started = None
        self._last_batch_end = None
        self._closing_since = None

    def now(self) -> float:
        """The clock's time in seconds."""
        return (self.clock or time.monotonic)()

    @property
    def seconds(self) -> float:
        if self.started is None:
            return self.spent_before
        return self.spent_before + self.now() - self.started

    @property
    def reserve(self) -> float:
        """Seconds kept for the close of the epoch under way."""
        return max(self.validation_seconds, self.closing_seconds)

    def forget(self) -> None:
        """Drop the time of an earlier run: this run starts with none spent."""
        self.spent_before = 0.0
        if self.state_path:
            self.state_path.unlink(missing_ok=True)

    def start(self) -> None:
        """Start the clock (once; later calls keep the first start)."""
        if self.started is None:
            self.started = self.now()

    def on_train_begin(self, logs=None):
        self.start()

    def on_test_begin(self, logs=None):
        self._validation_started = self.now()

    def on_test_end(self, logs=None):
        if self._validation_started is not None:
            self.validation_seconds = max(
                self.validation_seconds, self.now() - self._validation_started
            )
            self._validation_started = None

    def on_epoch_begin(self, epoch, logs=None):
        # The close runs on to this epoch's first training batch.
        self._closing_since = self._last_batch_end
        self._last_batch_end = None

    def on_train_batch_begin(self, batch, logs=None):
        if self._closing_since is not None:
            self.closing_seconds = max(
                self.closing_seconds, self.now() - self._closing_since
            )
            self._closing_since = None

    def on_train_batch_end(self, batch, logs=None):
        self._last_batch_end = self.now()
        if self.budget is not None and self.seconds + self.reserve >= self.budget:
            self.model.stop_training = True
            self.stopped_early = True

    def on_epoch_end(self, epoch, logs=None):
        if self.state_path:
            self.state_path.write_text(json.dumps({"seconds": self.seconds}))


class BudgetCosineDecay(keras.callbacks.Callback):
    """Linear warm-up, then cosine decay that ends with the time budget.

    A step-based schedule decays over `--epochs`; under a time budget a run
    may stop long before, with the learning rate still near its peak. Here
    the decay follows the *progress* of the run: the larger of the share of
    `total_steps` done and the share of the budget spent (`budget.seconds`,
    resumed parts included, plus `budget.reserve`, the close the budget
    keeps for after the last step), so the rate reaches `alpha * peak` when
    either runs out, on any machine. The optimizer's learning rate must be a plain
    value (not a schedule); this sets it before every training batch.

    The warm-up is counted in steps, but it also ends once the run's
    progress reaches `max_warmup_share`, whichever comes first (the rate
    climbs along the faster of the two ramps): a budget that runs out
    before `warmup_steps` (a slower machine, a shorter budget) still
    reaches `peak` and decays to `alpha * peak` by its end.

    Args:
        peak: learning rate after warm-up.
        warmup_steps: optimizer steps of linear warm-up from 0.
        total_steps: steps of the whole run (`epochs * steps_per_epoch`).
        budget: the run's `TimeBudget` (`None` or no budget: steps only).
        alpha: the final rate as a share of `peak`.
        hold: share of the run's progress spent at `peak` before the cosine
            starts (warm-up, stable, decay); `0`: the cosine starts after
            the warm-up. A run far from convergence, as most time-budgeted
            runs on a CPU are, learns more at the peak and needs only the
            last part of the run to decay.
        max_warmup_share: the most of the run's progress the warm-up takes,
            in `(0, 1]`; None: `warmup_steps` alone, however long the run.
    """

    def __init__(
        self,
        peak: float,
        warmup_steps: int,
        total_steps: int,
        budget: TimeBudget | None = None,
        alpha: float = 0.1,
        hold: float = 0.0,
        max_warmup_share: float | None = 0.25,
    ):
        super().__init__()
        if not peak > 0:
            raise ValueError(f"`peak` must be positive. Received: peak={peak}")
        if warmup_steps < 0 or total_steps < 1:
            raise ValueError(
                "`warmup_steps` must be >= 0 and `total_steps` >= 1. Received: "
                f"warmup_steps={warmup_steps}, total_steps={total_steps}"
            )
        if not 0 <= alpha <= 1:
            raise ValueError(f"`alpha` must be in [0, 1]. Received: alpha={alpha}")
        if not 0 <= hold < 1:
            raise ValueError(f"`hold` must be in [0, 1). Received: hold={hold}")
        if max_warmup_share is not None and not 0 < max_warmup_share <= 1:
            raise ValueError(
                "`max_warmup_share` must be in (0, 1]. Received: "
                f"max_warmup_share={max_warmup_share}"
            )
        self.hold = float(hold)
        self.max_warmup_share = (
            None if max_warmup_share is None else float(max_warmup_share)
        )
        self.peak = float(peak)
        self.warmup_steps = int(warmup_steps)
        self.total_steps = int(total_steps)
        self.budget = budget
        self.alpha = float(alpha)

    def progress(self, step: int) -> float:
        """Share of the run done, in [0, 1]."""
        done = step / self.total_steps
        if self.budget is not None and self.budget.budget:
            spent = self.budget.seconds + self.budget.reserve
            done = max(done, spent / self.budget.budget)
        return min(1.0, done)

    def rate(self, step: int) -> float:
        if step < self.warmup_steps:
            warmed = (step + 1) / (self.warmup_steps + 1)
            if self.max_warmup_share is not None:
                warmed = max(warmed, self.progress(step) / self.max_warmup_share)
            if warmed < 1.0:
                return self.peak * warmed
        decayed = max(0.0, self.progress(step) - self.hold) / (1.0 - self.hold)
        cosine = 0.5 * (1.0 + math.cos(math.pi * decayed))
        return self.peak * (self.alpha + (1.0 - self.alpha) * cosine)

    def on_train_batch_begin(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
        self.model.optimizer.learning_rate = self.rate(step)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["learning_rate"] = float(
                keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)
            )


class StopAtStep(keras.callbacks.Callback):
    """Stops training once the optimizer has made `steps` steps.

    Counts `optimizer.iterations`, so the steps of a resumed run's earlier
    part count too: a run of a fixed number of steps ends at the same step
    whether or not it was interrupted.
    """

    def __init__(self, steps: int):
        super().__init__()
        self.steps = v.check_positive_int("steps", steps)

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) >= self.steps:
            self.model.stop_training = True


class SwapEMAWeights(keras.callbacks.SwapEMAWeights):
    """Validate and checkpoint the optimizer's moving average of the weights.

    Keras' `SwapEMAWeights(swap_on_epoch=True)`: the validation pass and the
    callbacks after this one at an epoch's end (`ModelCheckpoint`) see the
    average, training goes on with the weights themselves. Keras' callback
    hands the average back to `fit` only after the last of `epochs`; when
    training stops earlier (`TimeBudget`, `EarlyStopping`), `fit` would end
    with the raw weights of the last step instead. This one also hands it back
    at an early stop, so the model always ends with the average. Callbacks that
    set `stop_training` at an epoch's end must come before it.
    """

    def __init__(self):
        super().__init__(swap_on_epoch=True)

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if self.model.stop_training and epoch != self.params["epochs"] - 1:
            # The average is in the model; `fit` ends by copying the
            # optimizer's copy into it, so that copy must hold it too.
            self._finalize_ema_values()


def standard_callbacks(
    out_dir: Path,
    budget: TimeBudget,
    monitor: str,
    mode: str = "auto",
    ema: bool = False,
    stoppers: tuple = (),
    tensorboard: bool = True,
) -> list:
    """Resume (BackupAndRestore), best checkpoint, TensorBoard, budget.

    `ema`: the optimizer keeps a moving average of the weights (an optimizer
    built with `use_ema=True`); validation, the best checkpoint and the end of
    training use the average, the backup for resuming the weights
    themselves. `stoppers`: callbacks that may stop training at an epoch's
    end (`EarlyStopping`), placed where the average still sees that stop.
    `tensorboard`: write TensorBoard logs to `out_dir/logs` (Keras'
    callback needs TensorFlow's summaries).

    Without a backup to resume (a new run, or a rerun of one that finished:
    `BackupAndRestore` deletes its backup at the end of training) the
    budget forgets the time an earlier run recorded in `out_dir`.
    """
    out_dir = Path(out_dir)
    backup_dir = out_dir / "backup"
    if not backup_dir.exists():
        budget.forget()
    backup = keras.callbacks.BackupAndRestore(str(backup_dir), save_freq="epoch")
    return [
        backup,  # before the swap: the backup holds the weights, not the average
        *stoppers,
        *([SwapEMAWeights()] if ema else []),
        keras.callbacks.ModelCheckpoint(
            str(out_dir / "checkpoints" / "best.weights.h5"),
            monitor=monitor,
            mode=mode,
            save_best_only=True,
            save_weights_only=True,
        ),
        *([keras.callbacks.TensorBoard(str(out_dir / "logs"))] if tensorboard else []),
        budget,
    ]
