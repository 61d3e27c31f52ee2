"""The example scripts' own options (their shared ones are in `_cli.py`):
`translate_args`, `sentiment_args`, `language_model_args`. Their defaults
are the named configurations of `keras_attn.models.configs`."""

from __future__ import annotations

import argparse

from _cli import (
    HelpFormatter,
    add_pretrained_argument,
    add_run_arguments,
    inherit_run_options,
    number_list,
    parse_run_args,
    pretrained_mode,
)

from keras_attn.models import configs

# --size: the translator configurations trained from scratch ("tiny" is for
# benchmarks and checks).
TRANSLATOR_SIZES = ("small", "base")
# The configurations of --pretrained minilm (or a directory) and of none.
TRANSLATE_CONFIGS = {
    "pretrained": configs.config("translator", "minilm"),
    "scratch": configs.config("translator", "base"),
}
# Defaults that depend on --pretrained, chosen on the validation split.
TRANSLATE_DEFAULTS = {
    mode: {
        "dropout": config["model"]["dropout"],
        "learning_rate": config["training"]["learning_rate"],
        "lr_hold": config["training"]["lr_hold"],
    }
    for mode, config in TRANSLATE_CONFIGS.items()
}
# What --evaluate-only takes from the run it scores.
TRANSLATE_RUN_OPTIONS = ("data", "alternatives", "phrases", "max_length", "smoke")


def translator_config(args) -> dict:
    """The configuration (`keras_attn.models.configs`) of `--model`,
    `--size` and `--pretrained` (a pretrained encoder: "minilm"'s)."""
    if args.model == "rnn":
        return configs.config("rnn_translator", args.size)
    return configs.config("translator", args.size or "minilm")


def translate_args(argv=None):
    """`examples/translate.py`'s options."""
    parser = argparse.ArgumentParser(
        description="Train an English -> German translator.",
        formatter_class=HelpFormatter,
    )
    add = parser.add_argument
    add("--data", default=None, help="english<TAB>german file; default: Ding pairs")
    add(
        "--alternatives",
        choices=["keep", "first", "drop"],
        default="keep",
        help="Ding entries with a/b alternatives (keep: the documented split)",
    )
    add(
        "--phrases",
        action="store_true",
        help="also train on the Ding phrase pairs of the training split",
    )
    add("--model", choices=["transformer", "rnn"], default="transformer")
    add(
        "--attention",
        default="bahdanau",
        choices=["bahdanau", "luong_dot", "luong_general", "luong_concat"],
        help="the RNN translator's attention",
    )
    add_pretrained_argument(
        parser, None, "the Transformer", "minilm for the Transformer, none for the RNN"
    )
    scratch = TRANSLATE_CONFIGS["scratch"]
    add(
        "--size",
        choices=sorted(TRANSLATOR_SIZES),
        default=None,
        help="from scratch only; default: base",
    )
    add(
        "--vocabulary-size",
        type=int,
        default=scratch["data"]["vocabulary_size"],
        help="the shared English+German SentencePiece vocabulary (with "
        "--pretrained: the German one)",
    )
    add(
        "--max-length",
        type=int,
        default=scratch["data"]["max_length"],
        help="tokens per side",
    )
    add(
        "--subword-sampling",
        type=float,
        default=0.0,
        metavar="ALPHA",
        help="train on segmentations sampled with this alpha (0: off)",
    )

    def both(flag):
        pretrained, scratch = (
            TRANSLATE_DEFAULTS["pretrained"][flag],
            TRANSLATE_DEFAULTS["scratch"][flag],
        )
        return f"default: {pretrained} (pretrained), {scratch} (from scratch)"

    add("--dropout", type=float, default=None, help=both("dropout"))
    add("--learning-rate", type=float, default=None, help=both("learning_rate"))
    add("--warmup-steps", type=int, default=scratch["training"]["warmup_steps"])
    add(
        "--lr-hold",
        type=float,
        default=None,
        help="share of the run at the peak learning rate; " + both("lr_hold"),
    )
    add("--weight-decay", type=float, default=scratch["training"]["weight_decay"])
    add(
        "--label-smoothing",
        type=float,
        default=scratch["training"]["label_smoothing"],
    )
    add("--beam-width", type=int, default=4)
    add(
        "--length-penalty",
        type=float,
        default=1.0,
        help="GNMT length penalty of the beam search (0: none)",
    )
    add(
        "--test-sentences",
        type=int,
        default=None,
        help="score only the first N validation and test pairs",
    )
    add(
        "--knn",
        action="store_true",
        help="also decode with kNN-MT (Transformer only): a datastore of the "
        "training pairs' decoder states, the setting chosen on validation "
        "(slow: every decoding step searches the whole datastore)",
    )
    add(
        "--knn-k",
        type=number_list(int, positive=True),
        default="32,64,128",
        metavar="K[,K...]",
        help="neighbours per step tried on validation",
    )
    add(
        "--knn-temperature",
        type=number_list(float, positive=True),
        default="10,30,100",
        metavar="T[,T...]",
        help="temperatures tried",
    )
    add(
        "--knn-lambda",
        type=number_list(float, 0, 1),
        default="0.1,0.2,0.3,0.4,0.5",
        metavar="L[,L...]",
        help="the neighbours' weights in the mixture tried",
    )
    add(
        "--knn-length-penalty",
        type=number_list(float, 0),
        default="1.0,1.5",
        metavar="A[,A...]",
        help="length penalties of the kNN-MT beam search tried "
        "(highest validation BLEU)",
    )
    add(
        "--knn-phrases",
        action="store_true",
        help="put the Ding phrase pairs of the training split in the datastore too",
    )
    add(
        "--knn-key-dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="dtype of the datastore's keys (auto: the compute "
        "dtype of --mixed-precision)",
    )
    add(
        "--export-knn",
        action="store_true",
        help="export with the kNN-MT decoding (the datastore in the export)",
    )
    add(
        "--assistant-layers",
        type=int,
        default=0,
        metavar="N",
        help="train a draft Transformer translator of N encoder and N decoder "
        "blocks beside the model (after it, on the same data and tokenizers, "
        "with a quarter of --time-budget), kept as the translator's "
        "`assistant_model`: greedy decodings (translate with beam_width=1, "
        "length_penalty=0.0, and an export with --beam-width 1 "
        "--length-penalty 0) use it, the same translations in fewer passes of "
        "the translator; model.keras and the preset hold it; 0: none",
    )
    add(
        "--assistant-dim",
        type=int,
        default=None,
        metavar="D",
        help="the draft's width (default: half the translator's decoder "
        "width), with half the heads and a feed-forward of 4 * D",
    )
    add(
        "--assistant-training",
        choices=("data", "distill"),
        default="data",
        help="how the draft learns: from the training pairs' next tokens "
        "(default, chosen on the validation pairs, where its greedy choice "
        "agreed with the translator's more often in the same time) or from "
        "the trained translator's logits (`keras.distillation.Distiller` "
        "with keras_attn.training.LogitsDistillation)",
    )
    add_run_arguments(parser, out="runs/translation", **run_defaults(scratch))
    known, _ = parser.parse_known_args(argv)
    if known.pretrained is None:
        parser.set_defaults(pretrained="none" if known.model == "rnn" else "minilm")
    mode = pretrained_mode(parser, argv)
    parser.set_defaults(**TRANSLATE_DEFAULTS[mode])
    args = parse_run_args(parser, argv)
    inherit_run_options(args, TRANSLATE_RUN_OPTIONS)
    scratch_only = [
        flag
        for flag, given in (
            ("--model rnn", args.model == "rnn"),
            ("--size", args.size is not None),
            ("--subword-sampling", args.subword_sampling > 0),
        )
        if given
    ]
    if mode == "pretrained" and scratch_only:
        parser.error(
            f"{', '.join(scratch_only)} apply to translators trained from scratch: "
            "add --pretrained none. Received: "
            f"{', '.join(scratch_only)} with --pretrained {args.pretrained}"
        )
    if mode == "scratch" and args.size is None:
        args.size = "base"
    for flag, given in (
        ("--phrases", args.phrases),
        ("--knn-phrases", args.knn_phrases),
    ):
        if given and args.data:
            parser.error(
                f"{flag} adds the Ding phrase pairs and needs the default data. "
                f"Received: --data {args.data}"
            )
    if args.length_penalty < 0:
        parser.error(
            f"--length-penalty must be 0 or more. Received: {args.length_penalty}"
        )
    if args.subword_sampling < 0:
        parser.error(
            "--subword-sampling must be 0 (off) or a positive alpha. "
            f"Received: {args.subword_sampling}"
        )
    conflict = [
        flag
        for flag, given in (
            ("no --knn", not args.knn),
            ("--no-export", args.no_export),
            ("--model rnn", args.model == "rnn"),
        )
        if given
    ]
    if args.export_knn and conflict:
        parser.error(
            "--export-knn exports the Transformer's kNN-MT decoding. "
            f"Received: --export-knn with {', '.join(conflict)}"
        )
    if args.knn and args.model == "rnn":
        parser.error("--knn decodes the Transformer. Received: --knn with --model rnn")
    check_assistant_options(parser, args)
    if args.assistant_layers and args.model == "rnn":
        parser.error(
            "--assistant-layers drafts for the Transformer translator (an RNN's "
            "state cannot be rolled back). Received: --assistant-layers "
            f"{args.assistant_layers} with --model rnn"
        )
    if args.smoke:
        args.vocabulary_size, args.max_length, args.warmup_steps = 400, 16, 5
        args.size = args.size and "small"
    return args


def run_defaults(config) -> dict:
    """`add_run_arguments`' defaults from a configuration's training."""
    training = config["training"]
    return {
        "epochs": training["epochs"],
        "time_budget": training["minutes"],
        "batch_size": training["batch_size"],
    }


EXTRA_DOMAINS = ("amazon", "nyt", "tweets")
# The configurations of --pretrained minilm (or a directory) and of none:
# BERT's fine-tuning recipe, and an ensemble of small classifiers.
SENTIMENT_CONFIGS = {
    "pretrained": configs.config("text_classifier", "minilm"),
    "scratch": configs.config("text_classifier", "small"),
}
# The pretrained encoder fixes these.
SCRATCH_ONLY = (
    "vocabulary_size",
    "embedding_dim",
    "num_layers",
    "num_heads",
    "intermediate_dim",
)
# Defaults that depend on --pretrained, chosen on the validation split.
SENTIMENT_DEFAULTS = {
    mode: {
        **{
            name: config["model"][name]
            for name in ("dropout", "pooling", *SCRATCH_ONLY)
            if name in config["model"]
        },
        **{
            name: config["data"][name]
            for name in SCRATCH_ONLY
            if name in config["data"]
        },
        "learning_rate": config["training"]["learning_rate"],
        "ensemble": config["training"]["ensemble"],
        "epochs": config["training"]["epochs"],
    }
    for mode, config in SENTIMENT_CONFIGS.items()
}
# What --evaluate-only takes from the run it scores.
SENTIMENT_RUN_OPTIONS = ("data", "max_length", "smoke")


def sentiment_args(argv=None):
    """`examples/sentiment.py`'s options."""
    parser = argparse.ArgumentParser(
        description="Train the attention-based sentiment classifier.",
        formatter_class=HelpFormatter,
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
    add_pretrained_argument(parser, "minilm", "the classifier")
    scratch = SENTIMENT_DEFAULTS["scratch"]
    pretrained = SENTIMENT_DEFAULTS["pretrained"]
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
        default=SENTIMENT_CONFIGS["scratch"]["data"]["max_length"],
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
    recipe = SENTIMENT_CONFIGS["scratch"]["training"]  # both encoders' alike
    parser.add_argument("--weight-decay", type=float, default=recipe["weight_decay"])
    parser.add_argument(
        "--patience",
        type=int,
        default=recipe["patience"],
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
    parser.add_argument(
        "--label-smoothing", type=float, default=recipe["label_smoothing"]
    )
    add_run_arguments(
        parser,
        out="runs/sentiment",
        **{**run_defaults(SENTIMENT_CONFIGS["scratch"]), "epochs": both("epochs")},
    )
    mode = pretrained_mode(parser, argv)
    defaults = dict(SENTIMENT_DEFAULTS[mode])
    parser.set_defaults(default_epochs=defaults.pop("epochs"), **defaults)
    args = parse_run_args(parser, argv)
    inherit_run_options(args, SENTIMENT_RUN_OPTIONS)
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


# What --evaluate-only takes from the run it scores.
LANGUAGE_MODEL_RUN_OPTIONS = ("data", "sequence_length", "smoke")
LANGUAGE_MODEL_CONFIG = configs.config("language_model", "small")


def language_model_args(argv=None):
    """`examples/language_model.py`'s options."""
    parser = argparse.ArgumentParser(
        description="Train a Transformer language model.",
        formatter_class=HelpFormatter,
    )
    model = LANGUAGE_MODEL_CONFIG["model"]
    recipe = LANGUAGE_MODEL_CONFIG["training"]
    parser.add_argument(
        "--data",
        default=None,
        help="text file or directory; default: Shakespeare's plays",
    )
    parser.add_argument(
        "--vocabulary-size",
        type=int,
        default=LANGUAGE_MODEL_CONFIG["data"]["vocabulary_size"],
        help="lossless SentencePiece vocabulary (chosen on the validation plays; "
        "docs/experiments/2026-quality-trials.md)",
    )
    parser.add_argument(
        "--sequence-length",
        type=int,
        default=model["sequence_length"],
        help="tokens per training window (the model's context); with "
        "--batch-size 64, 8,192 tokens per step",
    )
    for name in ("embedding_dim", "num_layers", "num_heads", "intermediate_dim"):
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=int, default=model[name]
        )
    parser.add_argument(
        "--dropout",
        type=float,
        default=model["dropout"],
        help="dropout rate of the blocks (0: none; chosen on the validation plays)",
    )
    parser.add_argument(
        "--position",
        choices=("learned", "sinusoidal", "rotary", "alibi"),
        default=model["position"],
        help="positions: added to the embeddings (learned, sinusoidal) or "
        f"inside the attention (rotary, alibi); default {model['position']}, "
        "chosen on the validation plays",
    )
    parser.add_argument(
        "--num-key-value-heads",
        type=int,
        default=model["num_key_value_heads"],
        metavar="K",
        help="grouped-query attention: K key/value heads dividing --num-heads "
        f"(default {model['num_key_value_heads']}, chosen on the validation "
        "plays; --num-heads for full multi-head attention)",
    )
    parser.add_argument(
        "--sliding-window",
        type=int,
        default=None,
        metavar="W",
        help="each token attends to the W - 1 tokens before it and itself",
    )
    parser.add_argument(
        "--assistant-layers",
        type=int,
        default=0,
        metavar="N",
        help="train a draft of N blocks beside the model (after it, on the same "
        "data, with a quarter of --time-budget and of --warmup-steps), kept as "
        "the model's `assistant_model`: `generate` and the export decode "
        "speculatively (the same text in fewer passes of the model), "
        "model.keras and the preset hold it; 0: none",
    )
    parser.add_argument(
        "--assistant-training",
        choices=("distill", "data"),
        default="distill",
        help="how the draft learns: from the trained model's logits "
        "(`keras.distillation.Distiller` with keras_attn.training."
        "LogitsDistillation; default, chosen on the validation plays, where "
        "its greedy choice agreed with the model's more often in the same "
        "time) or from the data's next tokens",
    )
    parser.add_argument(
        "--assistant-dim",
        type=int,
        default=None,
        metavar="D",
        help="the draft's width (default: half of --embedding-dim), with "
        "half the heads and an intermediate width of 4 * D",
    )
    parser.add_argument(
        "--learning-rate",
        type=float,
        default=recipe["learning_rate"],
        help="peak learning rate (chosen on the validation plays)",
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
        "not overlap, as in training and in the reported figures",
    )
    parser.add_argument(
        "--cache-theta",
        type=number_list(float),
        default="0.025,0.05,0.1",
        metavar="T[,T...]",
        help="continuous cache (Grave et al. 2017; see docs/TASKS.md): the flatness "
        "values of its softmax to try on the validation text",
    )
    parser.add_argument(
        "--cache-lambda",
        type=number_list(float),
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
        "scores the validation text once per --cache-theta value); the export's "
        "score signature then uses the model alone",
    )
    parser.add_argument(
        "--export-sampler",
        default=None,
        metavar="SAMPLER",
        help="add a `sample` signature to the export (prompt and one seed per "
        "prompt in, a sampled completion out): a sampler's name (top_k, top_p, "
        "random) or its config as JSON, for example "
        '\'{"class_name": "top_k", "config": {"k": 10, "temperature": 0.8}}\' '
        "(keras_attn.generation.get); default: none, `serving_default` only",
    )
    parser.add_argument("--weight-decay", type=float, default=recipe["weight_decay"])
    parser.add_argument("--warmup-steps", type=int, default=recipe["warmup_steps"])
    parser.add_argument(
        "--lr-hold",
        type=float,
        default=recipe["lr_hold"],
        help="share of the run (steps or time budget) at the peak learning "
        "rate before the cosine decay; 0: decay right after the warm-up",
    )
    add_run_arguments(
        parser, out="runs/language_model", **run_defaults(LANGUAGE_MODEL_CONFIG)
    )
    args = parse_run_args(parser, argv)
    inherit_run_options(args, LANGUAGE_MODEL_RUN_OPTIONS)
    if args.smoke:
        args.vocabulary_size, args.sequence_length = 500, 32
        args.embedding_dim, args.num_layers, args.num_heads = 32, 1, 2
        args.intermediate_dim, args.warmup_steps = 64, 5
    check_assistant_options(parser, args)
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
    if args.export_sampler is not None:
        if args.no_export:
            parser.error(
                "--export-sampler adds a signature to the export. Received: "
                "--export-sampler with --no-export"
            )
        try:
            export_sampler(args)
        except ValueError as error:
            parser.error(f"--export-sampler: {error}")
    if args.eval_stride == 0:  # windows that do not overlap
        args.eval_stride = args.sequence_length
    return args


def export_sampler(args):
    """The sampler of `--export-sampler` (a name or a JSON config; checked
    as the export checks it), or None."""
    from keras_attn.export.language_model import sampler_from_text

    return sampler_from_text(args.export_sampler)


def check_assistant_options(parser, args) -> None:
    """`--assistant-layers` (0 or more) and `--assistant-dim` (positive)."""
    if args.assistant_layers < 0:
        parser.error(
            f"--assistant-layers must be 0 or more. Received: {args.assistant_layers}"
        )
    if args.assistant_dim is not None and args.assistant_dim < 1:
        parser.error(
            f"--assistant-dim must be positive. Received: {args.assistant_dim}"
        )
