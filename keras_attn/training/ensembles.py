"""`fit_ensemble`: several models trained one after another within one time
budget, each with its own seed and run directory."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import keras

from keras_attn import _validation as v
from keras_attn.training import fit as fit_module


@dataclasses.dataclass
class EnsembleFit:
    """What `fit_ensemble` did.

    Attributes:
        members: the trained models, each with its best checkpoint loaded.
        fits: each member's `FitResult`, in the same order.
    """

    members: list
    fits: list

    @property
    def seconds(self) -> float:
        """Seconds of training of all members in this call."""
        return sum(fit.seconds for fit in self.fits)

    @property
    def stopped_by_time_budget(self) -> bool:
        """A member's share of the budget ended its training early."""
        return any(fit.stopped_by_time_budget for fit in self.fits)

    @property
    def final_train_losses(self) -> list:
        """Each member's training loss of its last epoch (or None)."""
        return [fit.final_train_loss for fit in self.fits]


def fit_ensemble(
    build_member,
    train_data,
    validation_data,
    out_dir,
    *,
    num_members: int,
    seed: int = 0,
    minutes: float | None = None,
    monitor: str = "val_accuracy",
    mode: str = "max",
    patience: int | None = None,
    strategy=None,
    **fit_options,
) -> EnsembleFit:
    """Train `num_members` models, each with `fit_within_budget`, for an
    ensemble that averages them (`keras_attn.models.TextClassifierEnsemble`).

    Member `i` is built by `build_member(i)` (a compiled model; give each a
    distinct `name`) after `keras.utils.set_random_seed(seed + i)`, so the
    members differ in their initialisation and data order, and it trains
    in `out_dir/<i>/` (resumable: a rerun resumes the interrupted member and
    skips the finished ones). Each member gets an equal share of the
    budget, `minutes / num_members`.

    Args:
        build_member: `build_member(index) -> compiled keras.Model`.
        train_data, validation_data: `fit_within_budget`'s datasets.
        out_dir: the members' directories go under it.
        num_members: how many models, `>= 1`.
        seed: member `i`'s seed is `seed + i`.
        minutes: the time budget of the whole ensemble, or None.
        monitor, mode: the best checkpoint's criterion, and early
            stopping's when `patience` is given.
        patience: stop a member after this many epochs without a better
            `monitor` (`keras.callbacks.EarlyStopping`); None: no early stop.
        strategy: a `tf.distribute` strategy the members are built under
            (its `scope()`), or None.
        **fit_options: the other arguments of `fit_within_budget`
            (`epochs`, `learning_rate`, `steps_per_epoch`, `ema`, ...).

    Returns:
        An `EnsembleFit`.

    Example:

    ```python
    def build_member(index):
        member = TextClassifier(8000, 64, name=f"member_{index}")
        member.compile(
            make_optimizer(1e-3), "binary_crossentropy", metrics=["accuracy"]
        )
        return member

    ensemble = fit_ensemble(build_member, train, validation, "members",
                            num_members=5, epochs=10, patience=2)
    classifier = TextClassifierEnsemble(ensemble.members, tokenizer=tokenizer)
    ```
    """
    v.check_positive_int("num_members", num_members)
    if patience is not None and not (v.is_int(patience) and patience >= 0):
        raise ValueError(
            f"`patience` must be an int >= 0 or None. Received: patience={patience!r}"
        )
    if "stoppers" in fit_options:
        raise ValueError(
            "`fit_ensemble` makes each member's early stop from `patience`. "
            "Received: stoppers="
        )
    share = None if minutes is None else minutes / num_members
    members, fits = [], []
    for index in range(num_members):
        keras.utils.set_random_seed(seed + index)
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            member = build_member(index)
        stoppers = ()
        if patience is not None:
            stoppers = (
                keras.callbacks.EarlyStopping(monitor, mode=mode, patience=patience),
            )
        fits.append(
            fit_module.fit_within_budget(
                member,
                train_data,
                validation_data,
                Path(out_dir) / str(index),
                minutes=share,
                monitor=monitor,
                mode=mode,
                stoppers=stoppers,
                **fit_options,
            )
        )
        members.append(member)
    return EnsembleFit(members, fits)
