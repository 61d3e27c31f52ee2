"""Train an English -> German translator: Transformer or attentional RNN.

Default data: the Ding English-German pairs (fetched on first use, fixed
splits), or `--data FILE` of `english<TAB>german` lines. The Transformer's
encoder starts from all-MiniLM-L6-v2 (`--pretrained`) under a decoder on a
German SentencePiece vocabulary; `--pretrained none` trains it from scratch
on one shared vocabulary, as the RNN always is. Sizes and defaults:
`keras_attn.models.configs`.

    python examples/translate.py --out runs/transformer
    python examples/translate.py --model rnn --attention bahdanau --out runs/rnn
    python examples/translate.py --evaluate-only runs/transformer --knn

Reports test BLEU and chrF with beam search (`--knn`: kNN-MT as well, tuned on
validation). Writes to --out: vocab/, checkpoints/, logs/, model.keras,
preset/, metrics.json, translations*.tsv, plots/ and the TF Serving export
export/translator/<version>/ (docs/TRANSLATION.md).
"""

from __future__ import annotations

import dataclasses
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import _cli
import _options
import keras

from keras_attn import datasets, text, training
from keras_attn.models import RNNTranslator, TransformerTranslator
from keras_attn.visualize import save_alignment_plots

parse_args = _options.translate_args  # the options, with the configs' defaults


def load_data(args):
    if args.data:
        splits = datasets.load_translation_pairs(path=args.data)
    else:
        splits = datasets.load_translation_pairs(
            "de-en", alternatives=args.alternatives
        )
        if args.phrases:
            phrases = datasets.load_training_phrases(splits, args.alternatives)
            print(f"Training on {len(phrases):,} phrase pairs as well.")
            splits = dataclasses.replace(splits, train=splits.train + phrases)
    return _cli.smoke_splits(splits, (600, 40, 40)) if args.smoke else splits


def tokenizers_of(args, splits, out, checkpoint):
    """A SentencePiece vocabulary of the training pairs (German only under
    a pretrained encoder, whose WordPiece reads the English side)."""
    texts = [german for _, german in splits.train]
    path = out / "vocab" / "de.model"
    if checkpoint is None:  # one vocabulary for both languages
        texts = [side for pair in splits.train for side in pair]
        path = out / "vocab" / "en_de.model"
    size = args.vocabulary_size
    vocabulary = text.train_subword_vocabulary(texts, path, vocabulary_size=size)
    source = target = text.SubwordTokenizer(vocabulary)
    if checkpoint is not None:
        source = _cli.pretrained_tokenizer(checkpoint, args.max_length)
    return {"source_tokenizer": source, "target_tokenizer": target}


def build(args, tokenizers, checkpoint=None):
    """The translator of `args` with its tokenizers, compiled for training:
    its configuration's model with the options given."""
    size = tokenizers["target_tokenizer"].vocabulary_size
    config = _options.translator_config(args)["model"]
    config.update(dropout=args.dropout, **tokenizers)
    if args.model == "rnn":
        model = RNNTranslator(size, size, **{**config, "attention": args.attention})
    else:
        config["sequence_length"] = args.max_length + 1
        model = (
            TransformerTranslator(size, size, **config)
            if checkpoint is None
            else TransformerTranslator.from_bert(checkpoint, size, **config)
        )
    model.compile(  # the learning rate is set per batch by BudgetCosineDecay
        optimizer=_cli.make_optimizer(args, clipnorm=1.0),
        loss=training.SmoothedSparseCrossentropy(args.label_smoothing),
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
    )
    return model


def assistant_sizes(args, translator) -> dict:
    """The draft's sizes: `--assistant-layers` encoder and decoder blocks of
    `--assistant-dim` (default half the translator's decoder width), half
    its heads (at least one, dividing the width), a feed-forward of 4 *
    width, the translator's vocabularies and their sharing."""
    width = args.assistant_dim or max(1, translator.embedding_dim // 2)
    heads = max(1, translator.num_heads // 2)
    while width % heads:
        heads -= 1
    return {
        "num_encoder_layers": args.assistant_layers,
        "num_decoder_layers": args.assistant_layers,
        "embedding_dim": width,
        "num_heads": heads,
        "intermediate_dim": 4 * width,
        "shared_vocabulary": translator.shared_vocabulary,
    }


def build_assistant(args, translator):
    """A from-scratch `TransformerTranslator` of `assistant_sizes` on the
    translator's vocabularies and tokenizers, compiled as `build` compiles."""
    draft = TransformerTranslator(
        translator.source_vocabulary_size,
        translator.target_vocabulary_size,
        sequence_length=args.max_length + 1,
        dropout=args.dropout,
        normalize_first=True,
        source_tokenizer=translator.source_tokenizer,
        target_tokenizer=translator.target_tokenizer,
        name="assistant",
        **assistant_sizes(args, translator),
    )
    draft.compile(
        optimizer=_cli.make_optimizer(args, clipnorm=1.0),
        loss=training.SmoothedSparseCrossentropy(args.label_smoothing),
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
    )
    return draft


def main(argv=None) -> dict:
    args = parse_args(argv)
    run = _cli.start_run(args)
    out, strategy = run.out, run.strategy
    splits = load_data(args)

    def dataset(pairs, shuffle=False, drop_remainder=False):
        return text.with_cardinality(
            text.translation_dataset(
                pairs,
                translator.source_tokenizer,
                translator.target_tokenizer,
                batch_size=args.batch_size * run.replicas,
                max_length=args.max_length,
                shuffle=shuffle,
                seed=args.seed,
                sample_weight=True,
                subword_sampling=(args.subword_sampling or None) if shuffle else None,
                drop_remainder=drop_remainder,
            )
        )

    metrics = {}
    if args.evaluate_only:
        translator = keras.saving.load_model(out / "model.keras")
    else:
        checkpoint = _cli.load_pretrained(args.pretrained)
        tokenizers = tokenizers_of(args, splits, out, checkpoint)
        with strategy.scope():
            translator = build(args, tokenizers, checkpoint)
        alpha = _options.translator_config(args)["training"]["decay_alpha"]
        data = (
            dataset(splits.train, True, drop_remainder=run.drop_remainder),
            dataset(splits.validation, drop_remainder=run.drop_remainder),
        )
        metrics = _cli.train(args, translator, *data, out, decay_alpha=alpha)
        if args.assistant_layers:  # a draft, then the translator saved with it
            with strategy.scope():
                draft = build_assistant(args, translator)
                trainee = None
                if args.assistant_training == "distill":
                    trainee = _cli.distiller(
                        translator, draft, draft.optimizer, draft.loss
                    )
            metrics["assistant"] = _cli.train_assistant(
                args, translator, draft, data, out,
                assistant_sizes(args, translator), trainee=trainee,
                decay_alpha=alpha,
            )  # fmt: skip
    decoding = dict(
        beam_width=args.beam_width, max_length=args.max_length, verbose=args.verbose
    )

    def evaluate(split, length_penalty=args.length_penalty, knn=None, label=""):
        return translator.evaluate_translations(
            splits[split][: args.test_sentences],
            length_penalty=length_penalty,
            nearest_neighbors=knn,
            title=f"Translating the {split} split{label}",
            **decoding,
        )

    # Configurations are chosen on validation; test gives the reported figure.
    validation, test = evaluate("validation"), evaluate("test")
    for split, result in (("validation", validation), ("test", test)):
        metrics.update(
            scores(result, split), **{f"{split}_sentences": len(result["sources"])}
        )
    names = ("bleu_signature", "chrf_signature", "decode_ms_per_sentence")
    metrics.update({name: test[name] for name in names})
    _cli.write_translations(out / "translations.tsv", test)
    knn = None
    if args.knn:  # kNN-MT: the datastore of the training pairs' decoder states
        pairs = splits.train
        if args.knn_phrases and not args.phrases:  # else in splits.train already
            phrases = datasets.load_training_phrases(splits, args.alternatives)
            print(f"kNN-MT datastore: {len(phrases):,} phrase pairs as well.")
            pairs = pairs + phrases
        knn, penalty, chosen = training.choose_knn_decoding(
            translator,
            dataset(pairs),
            dataset(splits.validation),
            splits.validation[: args.test_sentences],
            k=args.knn_k,
            temperature=args.knn_temperature,
            lam=args.knn_lambda,
            length_penalty=args.knn_length_penalty,
            key_dtype=args.knn_key_dtype,  # auto: the policy's compute dtype
            **decoding,
        )
        results = chosen.pop("length_penalty_results")
        knn_test = evaluate("test", penalty, knn, " (kNN-MT)")
        _cli.write_translations(out / "translations_knn.tsv", knn_test)
        metrics.update(
            **scores(results[penalty], "validation", "_with_knn"),
            **scores(knn_test, "test", "_with_knn"),
            decode_ms_per_sentence_with_knn=knn_test["decode_ms_per_sentence"],
            knn_validation_trials=chosen.pop("trials"),
            knn={**chosen, "length_penalty": penalty},
            knn_length_penalty_trials=[
                {"length_penalty": alpha, **scores(result, "validation")}
                for alpha, result in results.items()
            ],
        )
    if isinstance(translator.assistant_model, keras.Model):
        # Validation sources: the draft's greedy speed-up, same translations.
        sources = [source for source, _ in splits.validation[:64]]
        greedy = {"beam_width": 1, "length_penalty": 0.0, "verbose": 0}
        metrics.update(
            _cli.assistant_figures(
                lambda assistant: translator.translate(
                    sources, max_length=args.max_length, assistant_model=assistant,
                    **greedy,
                ),
                "translations",
                "translate",
            )
        )  # fmt: skip
    sample = test["sources"][:4], test["hypotheses"][:4]
    plots = save_alignment_plots(translator, *sample, out / "plots", args.max_length)
    export_dir = None
    if not args.no_export:
        export_dir = translator.export(
            _cli.export_base(args, out),
            max_length=args.max_length,
            beam_width=args.beam_width,
            length_penalty=penalty if args.export_knn else args.length_penalty,
            nearest_neighbors=knn if args.export_knn else None,
        )

    def test_figures(copy):  # a copy of the translator in another precision
        result = copy.evaluate_translations(
            splits["test"][: args.test_sentences],
            length_penalty=args.length_penalty,
            title="Translating the test split (cheaper precision)",
            **decoding,
        )
        return {
            **scores(result, "test"),
            "decode_ms_per_sentence": result["decode_ms_per_sentence"],
        }

    def export(copy, model_name):
        return copy.export(
            _cli.export_base(args, out),
            model_name=model_name,
            max_length=args.max_length,
            beam_width=args.beam_width,
            length_penalty=args.length_penalty,
        )

    if args.export_precision:
        metrics["export_precisions"] = _cli.export_precisions(
            args, translator, "translator", test_figures, export
        )
    for row in list(zip(test["sources"], test["hypotheses"], strict=True))[:5]:
        print("  {}  ->  {}".format(*row))
    rows = [("validation BLEU", metrics["validation_bleu"])]
    rows += [(f"test {name}", metrics[f"test_{name.lower()}"]) for name in KEYS]
    rows.append(("decode ms/sentence", metrics["decode_ms_per_sentence"]))
    for name in KEYS if knn else ():
        rows.append((f"test {name} with kNN", metrics[f"test_{name.lower()}_with_knn"]))
    if "assistant_speedup" in metrics:
        same = "same" if metrics["assistant_same_translations"] else "DIFFERENT"
        label = f"greedy translate speed-up with the draft ({same} translations)"
        rows.append((label, metrics["assistant_speedup"]))
    title = f"translation ({args.model})"
    _cli.finish(
        run, args, metrics, splits, rows, title=title, export=export_dir, plots=plots
    )
    return metrics


KEYS = ("BLEU", "chrF")  # the summary's test figures


def scores(result, split, suffix=""):
    """BLEU, chrF and the output length of an `evaluate_translations` result,
    under `metrics.json`'s names."""
    figures = training.translation_scores(result)
    return {f"{split}_{name}{suffix}": value for name, value in figures.items()}


if __name__ == "__main__":
    main(sys.argv[1:])
