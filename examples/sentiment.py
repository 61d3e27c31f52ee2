"""Train the attention-based sentiment classifier on movie-review sentences.

Default data: the human-rated movie review sentences (vaderSentiment 3.3.2,
fetched on first use), split by the fixed rule of keras_attn.datasets, or
`--data FILE` with `label<TAB>text` lines (label 0/1 or negative/positive).
By default the encoder starts from all-MiniLM-L6-v2 (`--pretrained minilm`,
or a BERT checkpoint directory) and is fine-tuned with its WordPiece
tokenizer; `--pretrained none` trains an ensemble of small classifiers from
scratch on a SentencePiece vocabulary (their probabilities averaged).

    python examples/sentiment.py --out runs/sentiment
    python examples/sentiment.py --smoke --pretrained none --out /tmp/smoke

Writes to --out: vocab/, members/<i>/ (each classifier's checkpoints/,
backup/ and logs/), model.keras (the classifier or ensemble with its
tokenizer: `keras.saving.load_model(path).classify(["..."])`),
metrics.json, plots/ and the TF Serving export under
export/sentiment/<version>/.

Several machines (`--strategy multi-worker`): start the same command on
every worker, each with its own TF_CONFIG; --batch-size is per replica, and
only the chief writes to --out (the others under OUT/workers/).
"""

from __future__ import annotations

import dataclasses
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import _cli
import _options
import keras

from keras_attn import training
from keras_attn.datasets import load_movie_reviews, load_rated_snippets
from keras_attn.models import TextClassifier, TextClassifierEnsemble
from keras_attn.text import (
    SubwordTokenizer,
    classification_dataset,
    train_subword_vocabulary,
    with_cardinality,
)
from keras_attn.visualize import save_classifier_plots


def parse_args(argv=None):
    return _options.sentiment_args(argv)


def load_data(args):
    splits = load_movie_reviews(path=args.data)
    extra = tuple(
        example
        for domain in args.extra_domains
        for example in load_rated_snippets(domain).train
    )
    if extra:
        print(f"Training on {len(extra):,} sentences of other domains as well.")
        splits = dataclasses.replace(splits, train=splits.train + extra)
    if args.smoke:  # strided, so that both labels occur (the file is ordered)
        splits = dataclasses.replace(
            splits,
            train=splits.train[::20][:400],
            validation=splits.validation[::10][:100],
            test=splits.test[::10][:100],
        )
    return splits


def tokenizer_of(args, splits, out, checkpoint):
    """The pretrained encoder's WordPiece tokenizer, or a SentencePiece
    vocabulary trained on the training sentences."""
    if checkpoint is None:
        path = train_subword_vocabulary(
            [text for text, _ in splits.train],
            out / "vocab" / "sentiment.model",
            vocabulary_size=args.vocabulary_size,
            lowercase=True,
        )
        return SubwordTokenizer(path)
    if args.max_length > checkpoint.max_positions:
        raise SystemExit(
            "--max-length must be at most the pretrained encoder's "
            f"{checkpoint.max_positions} positions. Received: --max-length "
            f"{args.max_length}"
        )
    tokenizer = checkpoint.tokenizer(max_length=args.max_length)
    tokenizer.save_vocabulary(out / "vocab" / "vocab.txt")
    return tokenizer


def build_member(args, tokenizer, name, checkpoint):
    """One classifier of the ensemble, compiled for training."""
    if checkpoint is None:
        member = TextClassifier(
            tokenizer.vocabulary_size,
            args.max_length,
            embedding_dim=args.embedding_dim,
            num_layers=args.num_layers,
            num_heads=args.num_heads,
            intermediate_dim=args.intermediate_dim,
            dropout=args.dropout,
            pooling=args.pooling,
            tokenizer=tokenizer,
            name=name,
        )
    else:
        member = TextClassifier.from_bert(
            checkpoint,
            dropout=args.dropout,
            pooling=args.pooling,
            tokenizer=tokenizer,
            name=name,
        )
    member.compile(
        optimizer=_cli.make_optimizer(args),
        loss=keras.losses.BinaryCrossentropy(label_smoothing=args.label_smoothing),
        metrics=["accuracy"],
    )
    return member


def main(argv=None) -> dict:
    args = parse_args(argv)
    out, policy, strategy = _cli.start_run(args)
    splits = load_data(args)

    metrics = {}
    if args.evaluate_only:
        classifier = keras.saving.load_model(out / "model.keras")
        members = getattr(classifier, "members", [classifier])
        tokenizer = classifier.tokenizer
    else:
        checkpoint = _cli.load_pretrained(args.pretrained)
        tokenizer = tokenizer_of(args, splits, out, checkpoint)
    data = {
        split: with_cardinality(
            classification_dataset(
                splits[split],
                tokenizer,
                batch_size=args.batch_size * strategy.num_replicas_in_sync,
                max_length=args.max_length,
                shuffle=split == "train",
                seed=args.seed,
            )
        )
        for split in ("train", "validation", "test")
    }
    if not args.evaluate_only:
        members, fits = [], []
        steps = int(data["train"].cardinality())
        options = _cli.fit_options(args, steps)
        if checkpoint is not None:  # BERT's: warm-up, then a decay to 0
            total = args.steps or steps * args.epochs
            warmup = int(_options.WARMUP_SHARE * total)
            options = _cli.fit_options(args, steps, 0.0, warmup_steps=warmup)
        if args.time_budget is not None:  # an equal share for each member
            options["minutes"] = args.time_budget / args.ensemble
        for index in range(args.ensemble):
            keras.utils.set_random_seed(args.seed + index)
            with strategy.scope():
                member = build_member(args, tokenizer, f"member_{index}", checkpoint)
            stop = keras.callbacks.EarlyStopping(
                "val_accuracy", mode="max", patience=args.patience
            )
            fits.append(
                training.fit_within_budget(
                    member,
                    data["train"],
                    data["validation"],
                    out / "members" / str(index),
                    monitor="val_accuracy",
                    mode="max",
                    stoppers=(stop,),
                    **options,
                )
            )
            members.append(member)
        classifier = members[0]
        if len(members) > 1:
            with strategy.scope():  # also holds the evaluation metrics' variables
                classifier = TextClassifierEnsemble(members, tokenizer=tokenizer)
        metrics.update(
            train_seconds=sum(fit.seconds for fit in fits),
            stopped_by_time_budget=any(fit.stopped_by_time_budget for fit in fits),
            # The training loss of each member's last epoch (the batches' mean).
            final_train_loss=[fit.final_train_loss for fit in fits],
        )
    if classifier is not members[0] or args.evaluate_only:
        with strategy.scope():
            classifier.compile(loss="binary_crossentropy", metrics=["accuracy"])
    for split in ("test", "validation"):
        if args.verbose:
            print(f"Evaluating the ensemble on the {split} split:", flush=True)
        scores = classifier.evaluate(
            data[split], return_dict=True, verbose=args.verbose
        )
        metrics[f"{split}_accuracy"] = float(scores["accuracy"])
    metrics.update(ensemble=len(members), test_examples=len(splits.test))
    if not args.evaluate_only:
        classifier.save(out / "model.keras")
    plots = save_classifier_plots(
        members[0], splits.test[:4], out / "plots", args.max_length
    )
    export_dir = None
    if not args.no_export:
        export_dir = classifier.export(
            _cli.export_base(args, out), max_length=args.max_length
        )
    _cli.write_metrics(
        out,
        metrics,
        vars(args),
        _cli.describe_environment(policy, strategy),
        {"splits": splits.counts()},
    )
    print(
        _cli.summary_table(
            [
                ("test accuracy", metrics["test_accuracy"]),
                ("validation accuracy", metrics["validation_accuracy"]),
                ("training minutes", _cli.training_minutes(metrics)),
                ("dtype policy", policy),
                ("test examples", len(splits.test)),
                ("model", str(out / "model.keras")),
                ("export", str(export_dir or "-")),
                ("plots", ", ".join(plots) or "-"),
            ],
            title="sentiment",
        )
    )
    return metrics


if __name__ == "__main__":
    main(sys.argv[1:])
