"""`fit_within_budget`: `fit` with a time budget, resumption and the best
checkpoint, as the example scripts train every model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from keras_attn._optimizer import build_optimizer
from keras_attn.training.callbacks import (
    BudgetCosineDecay,
    StopAtStep,
    TimeBudget,
    standard_callbacks,
)

DONE_FILE = "done.json"


@dataclasses.dataclass
class FitResult:
    """What `fit_within_budget` did.

    Attributes:
        seconds: wall-clock seconds of training in this call (by the
            fit's `clock`; 0 when a finished fit was found and skipped).
        steps: optimizer steps of the whole fit, resumed parts included.
        stopped_by_time_budget: the budget ended training before `epochs`.
        final_train_loss: the training loss of the last epoch (the mean
            over its batches), or None.
        budget: the `TimeBudget` of this call.
        skipped: a finished fit was found in `out_dir` and not repeated.
    """

    seconds: float
    steps: int
    stopped_by_time_budget: bool
    final_train_loss: float | None
    budget: TimeBudget
    skipped: bool = False


def fit_within_budget(
    model,
    train_data,
    validation_data,
    out_dir,
    *,
    epochs: int,
    minutes: float | None = None,
    monitor: str = "val_loss",
    mode: str = "min",
    ema: bool = False,
    learning_rate: float | None = None,
    steps_per_epoch: int | None = None,
    warmup_steps: int = 0,
    decay_alpha: float = 0.1,
    lr_hold: float = 0.0,
    max_steps: int | None = None,
    stoppers: tuple = (),
    tensorboard: bool = True,
    verbose: int = 2,
    clock=None,
) -> FitResult:
    """`fit` for at most `epochs` epochs and `minutes` of wall-clock time,
    resumable, then the best checkpoint (by `monitor` on validation) loaded.

    Writes to `out_dir`: `backup/` (resumes an interrupted fit: rerun the
    same call), `budget.json` (the time spent, counted against `minutes` by
    a resumed fit), `checkpoints/best.weights.h5`, `logs/` (TensorBoard) and,
    once training ends, `done.json`: a later call with the same `out_dir`
    then trains nothing and loads the best weights (delete `done.json` or
    the directory to train anew).

    Args:
        model: a compiled model.
        train_data, validation_data: datasets for `fit` (they shuffle
            themselves: `fit` gets `shuffle=False`).
        out_dir: the fit's directory.
        epochs: the most epochs.
        minutes: the time budget, or None.
        monitor, mode: the best checkpoint's criterion.
        ema: the optimizer keeps a moving average of the weights
            (`use_ema=True`): validate, checkpoint and end with it.
        learning_rate: with `steps_per_epoch`, the peak of a
            `BudgetCosineDecay` set before every batch (warm-up over
            `warmup_steps` or the first quarter of the run, whichever ends
            first, held for the share `lr_hold` of the run, cosine
            to `decay_alpha * learning_rate` at the end of the epochs, of
            `max_steps` or of the budget, whichever comes first); the
            optimizer must then have a plain learning rate. None: the
            optimizer's own.
        max_steps: stop after this many optimizer steps (`StopAtStep`).
        stoppers: callbacks that may stop training at an epoch's end
            (`EarlyStopping`).
        tensorboard: write TensorBoard logs.
        verbose: Keras' `verbose` of `fit`.
        clock: the time budget's clock (`TimeBudget`'s `clock`: a function
            returning seconds; default `time.monotonic`), which also times
            `FitResult.seconds`.

    Returns:
        A `FitResult`.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    best = out_dir / "checkpoints" / "best.weights.h5"
    done = out_dir / DONE_FILE
    budget = TimeBudget(minutes, out_dir / "budget.json", clock=clock)
    if done.exists():
        record = json.loads(done.read_text())
        if best.exists():
            model.load_weights(best)
        return FitResult(
            seconds=0.0,
            steps=record["steps"],
            stopped_by_time_budget=record["stopped_by_time_budget"],
            final_train_loss=record["final_train_loss"],
            budget=budget,
            skipped=True,
        )
    callbacks = standard_callbacks(
        out_dir,
        budget,
        monitor,
        mode=mode,
        ema=ema,
        stoppers=stoppers,
        tensorboard=tensorboard,
    )
    if max_steps is not None:
        callbacks.insert(0, StopAtStep(max_steps))
    if learning_rate is not None:
        if not steps_per_epoch:
            raise ValueError(
                "A learning-rate schedule needs `steps_per_epoch`. "
                f"Received: steps_per_epoch={steps_per_epoch!r}"
            )
        total_steps = steps_per_epoch * epochs
        if max_steps is not None:
            total_steps = min(total_steps, max_steps)
        callbacks.insert(
            0,
            BudgetCosineDecay(
                peak=learning_rate,
                warmup_steps=warmup_steps,
                total_steps=max(1, total_steps),
                budget=budget,
                alpha=decay_alpha,
                hold=lr_hold,
            ),
        )
    # On TensorFlow, the optimizer built now: Keras's train function is
    # traced once, not twice (`build_optimizer`), inside the budget's time.
    started = budget.now()
    budget.start()
    build_optimizer(model)
    history = model.fit(
        train_data,
        validation_data=validation_data,
        epochs=epochs,
        callbacks=callbacks,
        verbose=verbose,
        # The datasets shuffle themselves; Keras would warn that it ignores
        # `shuffle=True` (its default) for a `tf.data.Dataset`.
        shuffle=False,
    )
    seconds = budget.now() - started
    losses = history.history.get("loss") or [None]
    result = FitResult(
        seconds=seconds,
        steps=int(model.optimizer.iterations.numpy()),
        stopped_by_time_budget=budget.stopped_early,
        final_train_loss=None if losses[-1] is None else float(losses[-1]),
        budget=budget,
    )
    if best.exists():
        model.load_weights(best)
    done.write_text(
        json.dumps(
            {
                "seconds": budget.seconds,
                "steps": result.steps,
                "stopped_by_time_budget": result.stopped_by_time_budget,
                "final_train_loss": result.final_train_loss,
            }
        )
        + "\n"
    )
    return result
