"""Train the attention-based sentiment classifier on movie-review sentences.

Default data: the human-rated movie review sentences (vaderSentiment 3.3.2,
fetched on first use), split by the fixed rule of keras_attn.datasets, or
`--data FILE` with `label<TAB>text` lines (label 0/1 or negative/positive).
By default the encoder starts from all-MiniLM-L6-v2 (`--pretrained minilm`,
or a BERT checkpoint directory) and is fine-tuned with its WordPiece
tokenizer; `--pretrained none` trains an ensemble of small classifiers from
scratch on a SentencePiece vocabulary (their probabilities averaged). Sizes
and defaults: `keras_attn.models.configs` ("text_classifier").

    python examples/sentiment.py --out runs/sentiment
    python examples/sentiment.py --smoke --pretrained none --out /tmp/smoke

Writes to --out: vocab/, members/<i>/ (each classifier's checkpoints/,
backup/ and logs/), model.keras (the classifier or ensemble with its
tokenizer: `keras.saving.load_model(path).classify(["..."])`), preset/
(a single classifier's, keras-hub's layout), metrics.json, plots/ and the
TF Serving export under export/sentiment/<version>/.

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

from keras_attn import text, training
from keras_attn.datasets import load_movie_reviews, load_rated_snippets
from keras_attn.models import TextClassifier, TextClassifierEnsemble
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
        splits = _cli.smoke_splits(splits, (400, 100, 100), (20, 10, 10))
    return splits


def tokenizer_of(args, splits, out, checkpoint):
    """The pretrained encoder's WordPiece tokenizer, or a SentencePiece
    vocabulary trained on the training sentences."""
    if checkpoint is None:
        path = text.train_subword_vocabulary(
            [sentence for sentence, _ in splits.train],
            out / "vocab" / "sentiment.model",
            vocabulary_size=args.vocabulary_size,
            lowercase=True,
        )
        return text.SubwordTokenizer(path)
    tokenizer = _cli.pretrained_tokenizer(checkpoint, args.max_length)
    tokenizer.save_vocabulary(out / "vocab" / "vocab.txt")
    return tokenizer


def build_member(args, tokenizer, name, checkpoint):
    """One classifier of the ensemble, compiled for training: the
    configuration's model with the options given."""
    options = {"dropout": args.dropout, "pooling": args.pooling, "name": name}
    if checkpoint is None:
        sizes = ("embedding_dim", "num_layers", "num_heads", "intermediate_dim")
        options.update({size: getattr(args, size) for size in sizes})
        member = TextClassifier(
            tokenizer.vocabulary_size, args.max_length, tokenizer=tokenizer, **options
        )
    else:
        member = TextClassifier.from_bert(checkpoint, tokenizer=tokenizer, **options)
    member.compile(
        optimizer=_cli.make_optimizer(args),
        loss=keras.losses.BinaryCrossentropy(label_smoothing=args.label_smoothing),
        metrics=["accuracy"],
    )
    return member


def main(argv=None) -> dict:
    args = parse_args(argv)
    run = _cli.start_run(args)
    out, strategy = run.out, run.strategy
    splits = load_data(args)

    metrics = {}
    if args.evaluate_only:
        classifier = keras.saving.load_model(out / "model.keras")
        members = getattr(classifier, "members", [classifier])
        tokenizer = classifier.tokenizer
    else:
        checkpoint = _cli.load_pretrained(args.pretrained)
        tokenizer = tokenizer_of(args, splits, out, checkpoint)

    def dataset(split, drop_remainder=False):
        return text.with_cardinality(
            text.classification_dataset(
                splits[split],
                tokenizer,
                batch_size=args.batch_size * run.replicas,
                max_length=args.max_length,
                shuffle=split == "train",
                seed=args.seed,
                drop_remainder=drop_remainder,
            )
        )

    # fit's batches are split over the replicas of a --distribution: a last
    # partial batch is dropped there, never from the test figures.
    data = {s: dataset(s, run.drop_remainder) for s in ("train", "validation")}
    evaluation_data = {"test": dataset("test")}
    evaluation_data["validation"] = (
        dataset("validation") if run.drop_remainder else data["validation"]
    )
    if not args.evaluate_only:
        _cli.check_batches(args, **data)
        steps = int(data["train"].cardinality())
        options = _cli.fit_options(args, steps)
        if checkpoint is not None:  # BERT's: warm-up, then a decay to 0
            recipe = _options.SENTIMENT_CONFIGS["pretrained"]["training"]
            warmup = int(recipe["warmup_share"] * (args.steps or steps * args.epochs))
            options = _cli.fit_options(
                args, steps, recipe["decay_alpha"], warmup_steps=warmup
            )
        ensemble = training.fit_ensemble(
            lambda index: build_member(args, tokenizer, f"member_{index}", checkpoint),
            data["train"],
            data["validation"],
            out / "members",
            num_members=args.ensemble,
            seed=args.seed,
            patience=args.patience,
            strategy=strategy,
            **options,  # its minutes are the whole ensemble's
        )
        members = ensemble.members
        classifier = members[0]
        if len(members) > 1:
            with strategy.scope():  # also holds the evaluation metrics' variables
                classifier = TextClassifierEnsemble(members, tokenizer=tokenizer)
        metrics.update(
            train_seconds=ensemble.seconds,
            stopped_by_time_budget=ensemble.stopped_by_time_budget,
            # The training loss of each member's last epoch (the batches' mean).
            final_train_loss=ensemble.final_train_losses,
        )
    if classifier is not members[0] or args.evaluate_only:
        with strategy.scope():
            classifier.compile(loss="binary_crossentropy", metrics=["accuracy"])
    for split in ("test", "validation"):
        if args.verbose:
            print(f"Evaluating the ensemble on the {split} split:", flush=True)
        with _cli.whole_batches():  # every example, a last partial batch too
            scores = classifier.evaluate(
                evaluation_data[split], return_dict=True, verbose=args.verbose
            )
        metrics[f"{split}_accuracy"] = float(scores["accuracy"])
    metrics.update(ensemble=len(members), test_examples=len(splits.test))
    if not args.evaluate_only:
        _cli.save_model(classifier, out)
    plots = save_classifier_plots(
        members[0], splits.test[:4], out / "plots", args.max_length
    )
    export_dir = None
    if not args.no_export:
        export_dir = classifier.export(
            _cli.export_base(args, out), max_length=args.max_length
        )

    def test_figures(copy):  # a copy of the classifier in another precision
        copy.compile(loss="binary_crossentropy", metrics=["accuracy"])
        with _cli.whole_batches():
            scores = copy.evaluate(evaluation_data["test"], return_dict=True, verbose=0)
        return {"test_accuracy": float(scores["accuracy"])}

    def export(copy, model_name):
        base = _cli.export_base(args, out)
        return copy.export(base, model_name=model_name, max_length=args.max_length)

    if args.export_precision:
        metrics["export_precisions"] = _cli.export_precisions(
            args, classifier, "sentiment", test_figures, export
        )
    rows = [
        ("test accuracy", metrics["test_accuracy"]),
        ("validation accuracy", metrics["validation_accuracy"]),
        ("test examples", len(splits.test)),
    ]
    _cli.finish(
        run,
        args,
        metrics,
        splits,
        rows,
        title="sentiment",
        export=export_dir,
        plots=plots,
    )
    return metrics


if __name__ == "__main__":
    main(sys.argv[1:])
