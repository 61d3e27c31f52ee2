"""Train an English -> German translator: Transformer or attentional RNN.

Default data: the English-German pairs of Debian's `trans-de-en` (fetched
on first use), split by the fixed rule of keras_attn.datasets, or `--data
FILE` with `english<TAB>german` lines. The Transformer's encoder starts
from all-MiniLM-L6-v2 (`--pretrained minilm`, or a BERT checkpoint) under a
decoder trained on a German SentencePiece vocabulary; `--pretrained none`
trains it from scratch on one shared vocabulary, as the RNN always is.

    python examples/translate.py --out runs/transformer
    python examples/translate.py --model rnn --attention bahdanau --out runs/rnn
    python examples/translate.py --evaluate-only runs/transformer --knn

Reports BLEU and chrF (sacrebleu) on the test split with beam search, and
with `--knn` once more with kNN-MT (a datastore of the training pairs'
decoder states; its setting and length penalty chosen on validation).
Writes to --out: vocab/, checkpoints/, backup/, logs/, model.keras (the
translator with its tokenizers: `keras.saving.load_model(path).translate(
["..."])`), metrics.json, translations.tsv (and translations_knn.tsv),
plots/ and the TF Serving export under export/translator/<version>/.
"""

from __future__ import annotations

import dataclasses
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import _cli
import _options
import keras

from keras_attn import memory, training
from keras_attn.datasets import load_training_phrases, load_translation_pairs
from keras_attn.models import RNNTranslator, TransformerTranslator
from keras_attn.text import (
    SubwordTokenizer,
    train_subword_vocabulary,
    translation_dataset,
    with_cardinality,
)
from keras_attn.visualize import save_alignment_plots


def parse_args(argv=None):
    return _options.translate_args(argv)


def load_data(args):
    if args.data:
        splits = load_translation_pairs(path=args.data)
    else:
        splits = load_translation_pairs("de-en", alternatives=args.alternatives)
        if args.phrases:
            phrases = load_training_phrases(splits, args.alternatives)
            print(f"Training on {len(phrases):,} phrase pairs as well.")
            splits = dataclasses.replace(splits, train=splits.train + phrases)
    if args.smoke:
        splits = dataclasses.replace(
            splits,
            train=splits.train[:600],
            validation=splits.validation[:40],
            test=splits.test[:40],
        )
    return splits


def tokenizers_of(args, splits, out, checkpoint):
    """A SentencePiece vocabulary of the training pairs (German only under
    a pretrained encoder, whose WordPiece reads the English side)."""
    texts = [german for _, german in splits.train]
    if checkpoint is None:  # one vocabulary for both languages
        texts = [text for pair in splits.train for text in pair]
    target = SubwordTokenizer(
        train_subword_vocabulary(
            texts,
            out / "vocab" / ("de.model" if checkpoint else "en_de.model"),
            vocabulary_size=args.vocabulary_size,
        )
    )
    if checkpoint is None:
        return {"source_tokenizer": target, "target_tokenizer": target}
    if args.max_length > checkpoint.max_positions:
        raise SystemExit(
            "--max-length must be at most the pretrained encoder's "
            f"{checkpoint.max_positions} positions. Received: {args.max_length}"
        )
    source = checkpoint.tokenizer(max_length=args.max_length)
    return {"source_tokenizer": source, "target_tokenizer": target}


def build(args, tokenizers, checkpoint=None):
    """The translator of `args` with its tokenizers, compiled for training."""
    size = tokenizers["target_tokenizer"].vocabulary_size
    if checkpoint is not None:
        model = TransformerTranslator.from_bert(
            checkpoint,
            size,
            sequence_length=args.max_length + 1,
            dropout=args.dropout,
            **tokenizers,
        )
    elif args.model == "rnn":
        dim = _options.TRANSLATOR_SIZES[args.size][0]
        model = RNNTranslator(
            size,
            size,
            embedding_dim=dim,
            units=2 * dim,
            attention=args.attention,
            dropout=args.dropout,
            **tokenizers,
        )
    else:
        dim, layers, heads, intermediate = _options.TRANSLATOR_SIZES[args.size]
        model = TransformerTranslator(
            size,
            size,
            sequence_length=args.max_length + 1,
            embedding_dim=dim,
            num_encoder_layers=layers,
            num_decoder_layers=layers,
            num_heads=heads,
            intermediate_dim=intermediate,
            dropout=args.dropout,
            shared_vocabulary=True,
            tie_embeddings=True,
            normalize_first=True,
            **tokenizers,
        )
    model.compile(  # the learning rate is set per batch by BudgetCosineDecay
        optimizer=_cli.make_optimizer(args, clipnorm=1.0),
        loss=training.SmoothedSparseCrossentropy(args.label_smoothing),
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
    )
    return model


def main(argv=None) -> dict:
    args = parse_args(argv)
    out, policy, strategy = _cli.start_run(args)
    splits = load_data(args)

    def dataset(pairs, shuffle, batch=args.batch_size * strategy.num_replicas_in_sync):
        return with_cardinality(
            translation_dataset(
                pairs,
                translator.source_tokenizer,
                translator.target_tokenizer,
                batch_size=batch,
                max_length=args.max_length,
                shuffle=shuffle,
                seed=args.seed,
                sample_weight=True,
                subword_sampling=(args.subword_sampling or None) if shuffle else None,
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
        train_data = dataset(splits.train, True)
        steps = int(train_data.cardinality())
        fit = training.fit_within_budget(
            translator,
            train_data,
            dataset(splits.validation, False),
            out,
            **_cli.fit_options(args, steps, decay_alpha=0.05),
        )
        translator.save(out / "model.keras")
        metrics.update(_cli.fit_metrics(fit, steps))

    def evaluate(split, length_penalty=args.length_penalty, knn=None, label=""):
        return translator.evaluate_translations(
            splits[split][: args.test_sentences],
            beam_width=args.beam_width,
            length_penalty=length_penalty,
            max_length=args.max_length,
            nearest_neighbors=knn,
            verbose=args.verbose,
            title=f"Translating the {split} split{label}",
        )

    # Configurations are chosen on validation; test gives the reported figure.
    validation, test = evaluate("validation"), evaluate("test")
    metrics.update(
        **scores(validation, "validation"),
        **scores(test, "test"),
        bleu_signature=test["bleu_signature"],
        chrf_signature=test["chrf_signature"],
        test_sentences=len(test["sources"]),
        validation_sentences=len(validation["sources"]),
        decode_ms_per_sentence=test["decode_ms_per_sentence"],
    )
    write_translations(out / "translations.tsv", test)
    knn = None
    if args.knn:  # kNN-MT: the datastore of the training pairs' decoder states
        pairs = splits.train
        if args.knn_phrases and not args.phrases:  # else in splits.train already
            phrases = load_training_phrases(splits, args.alternatives)
            print(f"kNN-MT datastore: {len(phrases):,} phrase pairs as well.")
            pairs = pairs + phrases
        store = memory.translation_datastore(translator, dataset(pairs, False))
        key_dtype = args.knn_key_dtype
        if key_dtype == "auto":
            key_dtype = keras.config.dtype_policy().compute_dtype
        knn, chosen = memory.choose_knn(
            translator,
            store,
            dataset(splits.validation, False),
            k=args.knn_k,
            temperature=args.knn_temperature,
            lam=args.knn_lambda,
            key_dtype=key_dtype,
        )
        results = {}  # the validation decoding under each length penalty

        def negative_bleu(length_penalty):
            label = f" (kNN-MT, length penalty {length_penalty:g})"
            results[length_penalty] = evaluate("validation", length_penalty, knn, label)
            return -results[length_penalty]["bleu"].score

        penalties = tuple(dict.fromkeys(args.knn_length_penalty))
        penalty = memory.grid_search(negative_bleu, length_penalty=penalties)[0]
        penalty = penalty["length_penalty"]
        knn_test = evaluate("test", penalty, knn, " (kNN-MT)")
        write_translations(out / "translations_knn.tsv", knn_test)
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
    plots = save_alignment_plots(
        translator,
        test["sources"][:4],
        test["hypotheses"][:4],
        out / "plots",
        args.max_length,
    )
    export_dir = None
    if not args.no_export:
        export_dir = translator.export(
            _cli.export_base(args, out),
            max_length=args.max_length,
            beam_width=args.beam_width,
            length_penalty=metrics["knn"]["length_penalty"]
            if args.export_knn
            else args.length_penalty,
            nearest_neighbors=knn if args.export_knn else None,
        )
    _cli.write_metrics(
        out,
        metrics,
        vars(args),
        _cli.describe_environment(policy, strategy),
        {"splits": splits.counts()},
    )
    for source, hypothesis in list(
        zip(test["sources"], test["hypotheses"], strict=True)
    )[:5]:
        print(f"  {source}  ->  {hypothesis}")
    print(
        _cli.summary_table(
            [
                ("validation BLEU", metrics["validation_bleu"]),
                ("test BLEU", metrics["test_bleu"]),
                ("test chrF", metrics["test_chrf"]),
                ("decode ms/sentence", metrics["decode_ms_per_sentence"]),
                *(
                    [
                        ("test BLEU with kNN", metrics["test_bleu_with_knn"]),
                        ("test chrF with kNN", metrics["test_chrf_with_knn"]),
                    ]
                    if knn
                    else []
                ),
                ("training minutes", _cli.training_minutes(metrics)),
                ("dtype policy", policy),
                ("model", str(out / "model.keras")),
                ("export", str(export_dir or "-")),
                ("plots", ", ".join(plots)),
            ],
            title=f"translation ({args.model})",
        )
    )
    return metrics


def scores(result, split, suffix=""):
    """BLEU, chrF and the output length of an `evaluate_translations` result."""
    bleu = result["bleu"]
    return {
        f"{split}_bleu{suffix}": bleu.score,
        f"{split}_chrf{suffix}": result["chrf"].score,
        f"{split}_length_ratio{suffix}": bleu.sys_len / max(1, bleu.ref_len),
    }


def write_translations(path, results):
    """`source<TAB>reference<TAB>hypothesis` lines."""
    with open(path, "w", encoding="utf-8") as handle:
        for row in zip(
            results["sources"],
            results["references"],
            results["hypotheses"],
            strict=True,
        ):
            handle.write("\t".join(row) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
