"""Train the attention-based sentiment classifier on movie-review sentences.

Default data: the human-rated movie review sentences (vaderSentiment 3.3.2,
fetched on first use), split by the fixed rule of keras_attn.datasets. Or pass
`--data FILE` with `label<TAB>text` lines (label 0/1 or negative/positive).

    python examples/sentiment.py --out runs/sentiment            # default run
    python examples/sentiment.py --smoke --out /tmp/smoke         # seconds

Writes to --out: vocab/ (SentencePiece model), checkpoints/, backup/ (resume
after an interruption), logs/ (TensorBoard), model.keras, metrics.json (test
accuracy, each member's final training loss and the exact configuration),
plots/ (per-token attention of a few test reviews) and, unless --no-export,
the TF Serving export under export/sentiment/<version>/.

Several machines (`--strategy multi-worker`, data parallel, synchronous): start
the same command on every worker, each with its own TF_CONFIG, e.g. on the
second of two workers

    TF_CONFIG='{"cluster": {"worker": ["host0:12345", "host1:12345"]},
                "task": {"type": "worker", "index": 1}}' \
        python examples/sentiment.py --strategy multi-worker --out runs/mw

--batch-size is per replica (one per worker on CPUs: the global batch is N
times larger). Each worker reads the whole data file (same seed, same
shuffling) and takes its share of every global batch. Only the chief (worker
0, or the `chief` task if the cluster has one) writes to --out and
--export-dir; every other worker writes the same files under
OUT/workers/worker_<index>/, so all may share one --out. The run matches one
process on the global batch (tests/examples/test_multi_worker.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np

from keras_attn import training
from keras_attn.datasets import load_movie_reviews, load_rated_snippets
from keras_attn.models import sentiment_classifier, sentiment_token_weights
from keras_attn.text import (
    SubwordTokenizer,
    classification_dataset,
    train_subword_vocabulary,
    with_cardinality,
)

EXTRA_DOMAINS = ("amazon", "nyt", "tweets")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Train the attention-based sentiment classifier.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--data", default=None, help="label<TAB>text file; default: the movie sentences"
    )
    parser.add_argument(
        "--extra-domains",
        default="",
        help="comma-separated rated sentences of other domains to train on as "
        "well (their training splits): amazon, nyt, tweets; validation and "
        "test stay the movie sentences",
    )
    parser.add_argument("--vocabulary-size", type=int, default=8000)
    parser.add_argument(
        "--max-length",
        type=int,
        default=64,
        help="tokens per sentence (longer ones are truncated)",
    )
    parser.add_argument("--embedding-dim", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=1)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--intermediate-dim", type=int, default=256)
    parser.add_argument("--dropout", type=float, default=0.3)
    parser.add_argument("--pooling", choices=["mean", "attention"], default="attention")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument(
        "--patience",
        type=int,
        default=2,
        help="early stopping patience (epochs without a better validation accuracy)",
    )
    parser.add_argument(
        "--ensemble",
        type=int,
        default=5,
        help="train this many classifiers (seeds seed..seed+N-1) "
        "within the budget and average their probabilities",
    )
    parser.add_argument("--label-smoothing", type=float, default=0.0)
    training.add_run_arguments(
        parser, out="runs/sentiment", epochs=10, time_budget=10.0, batch_size=32
    )
    args = training.parse_run_args(parser, argv)
    args.extra_domains = [d for d in args.extra_domains.split(",") if d.strip()]
    unknown = sorted(set(args.extra_domains) - set(EXTRA_DOMAINS))
    if unknown:
        parser.error(
            f"--extra-domains takes {', '.join(EXTRA_DOMAINS)}. Received: {unknown}"
        )
    if args.extra_domains and args.data:
        parser.error(
            "--extra-domains adds rated sentences to the default movie data. "
            f"Received: --data {args.data}"
        )
    if args.smoke:
        args.vocabulary_size = min(args.vocabulary_size, 400)
        args.embedding_dim, args.num_heads, args.intermediate_dim = 16, 2, 32
        args.max_length = 32
    return args


def load_data(args):
    splits = load_movie_reviews(path=args.data)
    extra = tuple(
        example
        for domain in args.extra_domains
        for example in load_rated_snippets(domain).train
    )
    if extra:
        print(
            f"Training on {len(extra):,} sentences of "
            f"{', '.join(args.extra_domains)} as well."
        )
        splits = dataclasses.replace(splits, train=splits.train + extra)
    if args.smoke:
        splits = type(splits)(
            # Strided, so that both labels occur (the file is ordered).
            train=splits.train[::20][:400],
            validation=splits.validation[::10][:100],
            test=splits.test[::10][:100],
            stats=splits.stats,
        )
    return splits


def main(argv=None) -> dict:
    args = parse_args(argv)
    out, policy, strategy = training.start_run(args)

    splits = load_data(args)
    vocab_path = train_subword_vocabulary(
        [text for text, _ in splits.train],
        out / "vocab" / "sentiment.model",
        vocabulary_size=args.vocabulary_size,
        lowercase=True,
    )
    tokenizer = SubwordTokenizer(vocab_path)
    global_batch = args.batch_size * strategy.num_replicas_in_sync

    def dataset(examples, shuffle):
        return with_cardinality(
            classification_dataset(
                examples,
                tokenizer,
                batch_size=global_batch,
                max_length=args.max_length,
                shuffle=shuffle,
                seed=args.seed,
            )
        )

    train_data = dataset(splits.train, True)
    validation_data = dataset(splits.validation, False)
    test_data = dataset(splits.test, False)

    members, budgets, final_losses = [], [], []
    started = time.monotonic()
    for index in range(args.ensemble):
        member_dir = out / "members" / str(index)
        keras.utils.set_random_seed(args.seed + index)
        with strategy.scope():
            member = build_member(args, tokenizer.vocabulary_size, f"member_{index}")
        # Each member gets an equal share of the budget; a resumed run counts
        # the time it had already spent.
        budget = training.TimeBudget(
            None if args.time_budget is None else args.time_budget / args.ensemble,
            member_dir / "budget.json",
        )
        member_dir.mkdir(parents=True, exist_ok=True)
        early_stopping = keras.callbacks.EarlyStopping(
            "val_accuracy", mode="max", patience=args.patience
        )
        callbacks = training.standard_callbacks(
            member_dir,
            budget,
            "val_accuracy",
            mode="max",
            ema=args.ema_momentum > 0,
            stoppers=(early_stopping,),
        )
        done = member_dir / "done.json"
        if not done.exists():  # a rerun after an interruption skips finished members
            budget.start()
            history = member.fit(
                train_data,
                validation_data=validation_data,
                epochs=args.epochs,
                callbacks=callbacks,
                verbose=args.verbose,
                shuffle=False,  # the dataset shuffles itself
            )
            losses = history.history.get("loss") or [None]
            done.write_text(
                json.dumps({"seconds": budget.seconds, "final_train_loss": losses[-1]})
            )
        final_losses.append(json.loads(done.read_text()).get("final_train_loss"))
        member.load_weights(member_dir / "checkpoints" / "best.weights.h5")
        members.append(member)
        budgets.append(budget)
    train_seconds = time.monotonic() - started
    with strategy.scope():  # also holds the evaluation metrics' variables
        model = average_ensemble(members)
        if model is not members[0]:  # a lone member keeps its trained optimizer
            model.compile(loss="binary_crossentropy", metrics=["accuracy"])
    accuracies = {}
    for split, data in (("test", test_data), ("validation", validation_data)):
        if args.verbose:
            print(f"Evaluating the ensemble on the {split} split:", flush=True)
        scores = model.evaluate(data, return_dict=True, verbose=args.verbose)
        accuracies[split] = float(scores["accuracy"])
    test_accuracy, validation_accuracy = accuracies["test"], accuracies["validation"]
    model.save(out / "model.keras")

    plots = []
    if args.pooling == "attention":
        plots = write_token_attention_plots(
            members[0], tokenizer, splits.test[:4], out / "plots", args.max_length
        )

    export_dir = None
    if not args.no_export:
        from keras_attn.export import export_sentiment

        export_dir = export_sentiment(
            model,
            tokenizer,
            training.export_base(args, out),
            max_length=args.max_length,
        )

    metrics = {
        "test_accuracy": test_accuracy,
        "validation_accuracy": validation_accuracy,
        "train_seconds": train_seconds,
        "stopped_by_time_budget": any(b.stopped_early for b in budgets),
        "ensemble": args.ensemble,
        # The training loss of each member's last epoch (mean over its batches).
        "final_train_loss": final_losses,
        "test_examples": len(splits.test),
    }
    environment = training.describe_environment(policy, strategy)
    training.write_metrics(
        out, metrics, vars(args), environment, {"splits": splits.counts()}
    )
    print(
        training.summary_table(
            [
                ("test accuracy", test_accuracy),
                ("validation accuracy", validation_accuracy),
                ("training minutes", train_seconds / 60),
                ("dtype policy", policy),
                ("test examples", len(splits.test)),
                ("model", str(out / "model.keras")),
                ("export", str(export_dir) if export_dir else "-"),
                ("plots", ", ".join(str(p) for p in plots) or "-"),
            ],
            title="sentiment",
        )
    )
    return metrics


def build_member(args, vocabulary_size, name=None):
    """One classifier of the ensemble, compiled for training."""
    member = sentiment_classifier(
        vocabulary_size,
        args.max_length,
        embedding_dim=args.embedding_dim,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        intermediate_dim=args.intermediate_dim,
        dropout=args.dropout,
        pooling=args.pooling,
        **({"name": name} if name else {}),
    )
    member.compile(
        optimizer=training.make_optimizer(args),
        loss=keras.losses.BinaryCrossentropy(label_smoothing=args.label_smoothing),
        metrics=["accuracy"],
    )
    return member


def average_ensemble(members):
    """One model averaging the members' probabilities (exports as one graph)."""
    if len(members) == 1:
        return members[0]
    token_ids = keras.Input((None,), dtype="int32", name="token_ids")
    probabilities = [member(token_ids) for member in members]
    average = keras.layers.Average(dtype="float32", name="positive_probability")(
        probabilities
    )
    return keras.Model(token_ids, average, name="sentiment_ensemble")


def write_token_attention_plots(model, tokenizer, examples, plot_dir, max_length):
    """Per-token attention-pooling weights of a few reviews, as PNG heatmaps."""
    from keras_attn.visualize import save_attention_plot

    plot_dir.mkdir(parents=True, exist_ok=True)
    texts = [text for text, _ in examples]
    ids = np.asarray(tokenizer.tokenize(texts).to_tensor()[:, :max_length])
    probabilities = model.predict(ids, verbose=0)[:, 0]
    token_weights = np.asarray(sentiment_token_weights(model)(ids))
    paths = []
    for index, (_, label) in enumerate(examples):
        length = int((ids[index] != 0).sum())
        pieces = [tokenizer.id_to_token(int(t)) for t in ids[index, :length]]
        weights = token_weights[index, :length][None, :]
        probability = float(probabilities[index])
        paths.append(
            save_attention_plot(
                plot_dir / f"review_{index}.png",
                weights,
                pieces,
                ["attention"],
                title=f"p(positive)={probability:.2f} (label {label})",
            )
        )
    return paths


if __name__ == "__main__":
    main(sys.argv[1:])
