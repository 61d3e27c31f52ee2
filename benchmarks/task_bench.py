"""Task methods on real text: throughput, flat memory, single-text latency.

Issue 35, in one process (and fresh ones for memory):

1. `TextClassifier.classify(texts)` against keras-hub's
   `BertTextClassifier.predict(texts)`, and against our network alone on the
   ids `classify` pads to (eager `model(ids)`, compiled `predict_on_batch`),
   on the same movie-review sentences (all splits in the loader's order),
   batch 64, at most 128 tokens; alternate rounds, medians. Both models have
   BERT-Mini's layout and sizes (d 256, 4 layers, 4 heads, intermediate
   1024), random weights, one lower-cased WordPiece vocabulary computed from
   the training sentences by keras-hub's `compute_word_piece_vocabulary`.
   keras_attn pads each batch to a bucket of its longest text, keras-hub to 128.
2. Memory of `classify` at each `--texts` size, each in a fresh process after
   a warm-up on one batch per length bucket: the RSS before the timed run, its
   peak during it (`VmHWM` reset), the process's peak (`VmHWM`: not
   `ru_maxrss`, which in a child holds the parent's RSS at the fork).
3. The same (one timed run) for `TransformerTranslator.translate` of
   `--sentences` English test sentences (3+3 pre-norm blocks, d 256, 8 heads,
   shared 8k SentencePiece vocabulary, random weights; beam 4, `max_length`
   40: each sentence decodes 40 steps) and `TransformerLanguageModel.score`
   of `--score-chars` characters of Shakespeare's speeches (d 256, 4 blocks,
   context 256, lossless 4k vocabulary): texts/s and characters/s.
4. `classify([text])` (after a warm-up) against one forward pass on the ids
   `classify` pads that text to (`model(ids)`, `predict_on_batch`).

    .venv/bin/python benchmarks/task_bench.py [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _timing import alternate  # noqa: E402

# The width the task methods pad a batch to.
from keras_attn.models._task import bucket_length  # noqa: E402

BATCH, SEQUENCE = 64, 128
# (d, layers, heads, intermediate) of the classifier, translator (layers per
# side) and language model (+ its context); vocabularies (WordPiece asked for,
# translation, language model); beam width, translation max_length.
FULL = dict(classifier=(256, 4, 4, 1024), translator=(256, 3, 8, 1024))
FULL.update(language_model=(256, 4, 4, 1024, 256), vocabularies=(8000, 8000, 4000))
FULL.update(beam_width=4, max_length=40)
QUICK = dict(classifier=(32, 1, 2, 64), translator=(32, 1, 2, 64))
QUICK.update(language_model=(32, 1, 2, 64, 64), vocabularies=(500, 400, 400))
QUICK.update(beam_width=2, max_length=8)
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "de_en_pairs.tsv")


def status_mib(field: str) -> float:
    """`VmRSS` (now) or `VmHWM` (the peak since `clear_refs`), MiB."""
    with open("/proc/self/status") as file:
        return next(int(x.split()[1]) for x in file if x.startswith(field)) / 1024


def batch_widths(texts, tokenize, cap=None, extra=0):
    """(width, batch) of each batch the task methods form: texts sorted by
    length, longest first, in batches of 64, each padded to its bucket."""
    order = sorted(texts, key=lambda text: -len(text))
    found = []
    for batch in (order[i : i + BATCH] for i in range(0, len(order), BATCH)):
        longest = max(len(row) for row in tokenize(batch).to_list())
        found.append((bucket_length(min(longest, cap or longest) + extra, cap), batch))
    return found


def warmup_texts(texts, tokenize, cap=None, extra=0):
    """One batch of texts per width the run will pad to (what compiles)."""
    return list(dict(batch_widths(texts, tokenize, cap, extra)).values())


def padded(tokenize, texts, width):
    ids = tokenize(texts).to_tensor().numpy().astype("int32")[:, :width]
    return np.pad(ids, [(0, 0), (0, width - ids.shape[1])])


def repeat(texts, count):
    return (list(texts) * -(-count // len(texts)))[:count]


# -- data and models (built alike in this process and in the children) -------


def prepare(args, workdir: str) -> dict:
    """The texts of each task and the vocabularies, written to `workdir`."""
    import keras_hub
    import tensorflow as tf

    from keras_attn import datasets
    from keras_attn.text import train_subword_vocabulary

    if args.quick:  # the test fixture's 50 pairs, repeated: no corpus needed
        splits = datasets.load_translation_pairs(path=FIXTURE, verbose=False)
        pairs = splits.train + splits.validation + splits.test
        sentences = training = test_english = speeches = [e for e, _ in pairs]
        lm_training = ["\n".join(sentences)]
    else:
        reviews = datasets.load_movie_reviews(verbose=False)
        sentences = [t for t, _ in reviews.train + reviews.validation + reviews.test]
        training = [t for t, _ in reviews.train]
        splits = datasets.load_translation_pairs(verbose=False)
        pairs, test_english = splits.train, [e for e, _ in splits.test]
        plays = datasets.load_shakespeare(verbose=False)
        lm_training = [play.text for play in plays.train]
        plays = plays.train + plays.validation + plays.test
        speeches = [p for d in plays for p in d.text.split("\n\n") if p.strip()]
    texts = {
        "classify": repeat(sentences, max(args.texts)),
        "translate": repeat(test_english, args.sentences),
        "score": [],
    }
    total = 0
    while total < args.score_chars:  # speeches in order up to the size
        text = speeches[len(texts["score"]) % len(speeches)]
        texts["score"].append(text[: args.score_chars - total])
        total += len(texts["score"][-1])
    config = QUICK if args.quick else FULL
    wordpiece_size, translate_size, lm_size = config["vocabularies"]
    vocabulary = keras_hub.tokenizers.compute_word_piece_vocabulary(
        tf.data.Dataset.from_tensor_slices(training).batch(1000),
        wordpiece_size,
        lowercase=True,
        strip_accents=True,
    )
    path = os.path.join(workdir, "translate.model")
    train_subword_vocabulary(
        [text for pair in pairs for text in pair], path, vocabulary_size=translate_size
    )
    path = os.path.join(workdir, "score.model")
    train_subword_vocabulary(lm_training, path, vocabulary_size=lm_size, lossless=True)
    setup = {"config": config, "vocabulary": vocabulary, "texts": texts}
    with open(os.path.join(workdir, "setup.json"), "w") as file:
        json.dump(setup, file)
    return setup


def wordpiece(setup):
    from keras_attn.text import WordPieceTokenizer

    return WordPieceTokenizer(setup["vocabulary"], lowercase=True, max_length=SEQUENCE)


def classifier(setup):
    from keras_attn.models import TextClassifier

    keras.utils.set_random_seed(0)
    dim, layers, heads, intermediate = setup["config"]["classifier"]
    return TextClassifier(
        len(setup["vocabulary"]), SEQUENCE, embedding_dim=dim, num_layers=layers,
        num_heads=heads, intermediate_dim=intermediate, position="learned",
        activation="gelu", layer_norm_epsilon=1e-12, embedding_norm=True,
        tokenizer=wordpiece(setup),
    )  # fmt: skip


def task_model(task, setup, workdir):
    """(run(texts), tokenize, cap, extra) of a child's task."""
    from keras_attn.models import TransformerLanguageModel, TransformerTranslator
    from keras_attn.text import SubwordTokenizer

    config = setup["config"]
    if task == "classify":
        model = classifier(setup)
        run = lambda t: model.classify(t, verbose=0)["label"]  # noqa: E731
        return run, wordpiece(setup).tokenize, SEQUENCE, 0
    keras.utils.set_random_seed(0)
    tokenizer = SubwordTokenizer(os.path.join(workdir, f"{task}.model"))
    size = tokenizer.vocabulary_size
    if task == "translate":
        dim, layers, heads, intermediate = config["translator"]
        length, beam = config["max_length"], config["beam_width"]
        model = TransformerTranslator(
            size, size, sequence_length=length + 1, embedding_dim=dim,
            num_encoder_layers=layers, num_decoder_layers=layers, num_heads=heads,
            intermediate_dim=intermediate, shared_vocabulary=True,
            normalize_first=True, source_tokenizer=tokenizer,
            target_tokenizer=tokenizer,
        )  # fmt: skip

        def run(texts):
            return model.translate(texts, beam_width=beam, max_length=length, verbose=0)

        return run, tokenizer.tokenize, length, 0
    dim, layers, heads, intermediate, context = config["language_model"]
    model = TransformerLanguageModel(
        size, context, embedding_dim=dim, num_layers=layers, num_heads=heads,
        intermediate_dim=intermediate, tokenizer=tokenizer,
    )  # fmt: skip
    return (
        lambda t: model.score(t, verbose=0)["num_tokens"],
        tokenizer.tokenize,
        None,
        2,
    )


def child(task, count, workdir, rounds):
    """In a fresh process: warm up, then `rounds` timed runs of `count`
    texts. Memory: the process's peak (imports, warm-up, runs),
    the RSS before the runs and the peak during them."""
    with open(os.path.join(workdir, "setup.json")) as file:
        setup = json.load(file)
    texts = setup["texts"][task][:count]
    run, tokenize, cap, extra = task_model(task, setup, workdir)
    for batch in warmup_texts(texts, tokenize, cap, extra):
        run(batch)
    before, warm_peak, seconds = status_mib("VmRSS"), status_mib("VmHWM"), []
    with open("/proc/self/clear_refs", "w") as file:  # VmHWM := VmRSS (Linux 4+)
        file.write("5")
    for _ in range(rounds):
        start = time.perf_counter()
        assert len(run(texts)) == count
        seconds.append(time.perf_counter() - start)
    seconds, chars = statistics.median(seconds), sum(map(len, texts))
    run_peak = status_mib("VmHWM")
    return dict(
        texts=count, chars=chars, seconds=seconds, texts_per_s=count / seconds,
        chars_per_s=chars / seconds, rss_before_mib=before, run_peak_mib=run_peak,
        peak_mib=max(warm_peak, run_peak),
    )  # fmt: skip


def spawn(task, count, workdir, rounds):
    command = [sys.executable, os.path.abspath(__file__), "--child", task]
    command += ["--count", str(count), "--workdir", workdir, "--rounds", str(rounds)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise RuntimeError(f"{task} of {count} texts failed:\n{done.stderr[-3000:]}")
    print(f"{task} of {count:,} texts: done", file=sys.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- the measurements of this process -----------------------------------------


def keras_hub_classifier(setup):
    import keras_hub

    dim, layers, heads, intermediate = setup["config"]["classifier"]
    vocabulary = setup["vocabulary"]
    tokenizer = keras_hub.models.BertTokenizer(vocabulary=vocabulary, lowercase=True)
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.BertBackbone(
        len(vocabulary), layers, heads, dim, intermediate, max_sequence_length=SEQUENCE
    )
    preprocessor = keras_hub.models.BertTextClassifierPreprocessor(
        tokenizer, sequence_length=SEQUENCE
    )
    return keras_hub.models.BertTextClassifier(backbone, 2, preprocessor=preprocessor)


def classify_side_by_side(setup, rounds, quick):
    texts = setup["texts"]["classify"]
    ours, hub = classifier(setup), keras_hub_classifier(setup)
    tokenize = wordpiece(setup).tokenize
    widths = batch_widths(texts, tokenize, SEQUENCE)
    # The network alone, on the ids classify pads each batch to.
    batches = [padded(tokenize, batch, width) for width, batch in widths]
    for batch in warmup_texts(texts, tokenize, SEQUENCE):
        ours.classify(batch, verbose=0)
    for ids in {ids.shape: ids for ids in batches}.values():
        ours.predict_on_batch(ids)
    hub.predict(texts[: BATCH + 1], batch_size=BATCH, verbose=0)  # both shapes
    seconds = alternate(
        {
            "keras_attn": lambda: ours.classify(texts, verbose=0),
            "keras_hub": lambda: hub.predict(texts, batch_size=BATCH, verbose=0),
            "eager": lambda: [ours(ids, training=False) for ids in batches],
            "compiled": lambda: [ours.predict_on_batch(ids) for ids in batches],
        },
        rounds=rounds, warmup=0, inner=1,
    )  # fmt: skip
    lengths = [len(row) for row in tokenize(texts).to_list()]
    throughput = {f"{name}_texts_per_s": len(texts) / t for name, t in seconds.items()}
    throughput.update(
        texts=len(texts), ratio=seconds["keras_hub"] / seconds["keras_attn"]
    )
    throughput.update(mean_tokens=float(np.mean(lengths)), keras_hub_width=SEQUENCE)
    throughput["mean_padded_width"] = float(np.mean([width for width, _ in widths]))
    # 4. One text: the median-length sentence, and the ids classify gives it.
    text = sorted(texts, key=len)[len(texts) // 2]
    ids = padded(
        tokenize, [text], bucket_length(len(tokenize([text]).to_list()[0]), SEQUENCE)
    )
    single = alternate(
        {
            "classify": lambda: ours.classify([text], verbose=0),
            "forward": lambda: ours(ids, training=False),
            "predict_on_batch": lambda: ours.predict_on_batch(ids),
        },
        rounds=5 if quick else 15, warmup=3, inner=5,
    )  # fmt: skip
    hub_call = {"keras_hub_predict": lambda: hub.predict([text], verbose=0)}
    single.update(alternate(hub_call, rounds=1 if quick else 5, warmup=1, inner=1))
    latency = {f"{name}_ms": 1000 * value for name, value in single.items()}
    latency.update(tokens=int((ids != 0).sum()), width=int(ids.shape[1]))
    latency["ratio_forward"] = single["classify"] / single["forward"]
    latency["ratio_predict_on_batch"] = single["classify"] / single["predict_on_batch"]
    return throughput, latency


def machine() -> dict:
    with open("/proc/cpuinfo") as file:
        lines = (line.split(":", 1) for line in file if ":" in line)
        fields = {key.strip(): value.strip() for key, value in lines}
    flags = fields.get("flags", "")
    info = {"cpu": fields.get("model name", "?"), "cpus": os.cpu_count()}
    info.update({flag: flag in flags.split() for flag in ("avx512_bf16", "amx_bf16")})
    return {**info, "load_average": os.getloadavg()[0]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", default="1000,10000", help="classify sizes")
    parser.add_argument("--sentences", type=int, default=1000, help="to translate")
    parser.add_argument("--score-chars", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a test)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.count, args.workdir, args.rounds)))
        return 0
    if args.quick:
        args.texts, args.sentences, args.score_chars, args.rounds = "40,130", 8, 3000, 1
    args.texts = sorted(int(n) for n in args.texts.split(","))
    import tensorflow as tf

    workdir = tempfile.mkdtemp(prefix="task_bench_")
    atexit.register(shutil.rmtree, workdir, ignore_errors=True)
    versions = {"keras": keras.__version__, "tensorflow": tf.__version__}
    results = {"machine": machine(), "versions": versions, "rounds": args.rounds}
    started = time.perf_counter()
    setup = prepare(args, workdir)
    seconds = time.perf_counter() - started
    pieces = len(setup["vocabulary"])
    results["setup"] = dict(quick=args.quick, wordpiece_pieces=pieces, seconds=seconds)
    print(f"data and vocabularies: {seconds:.0f} s", file=sys.stderr)
    throughput, latency = classify_side_by_side(setup, args.rounds, args.quick)
    results.update(classify=throughput, single_text=latency)
    print("classify side by side: done", file=sys.stderr)
    # Each in a fresh process; one timed run of each after its warm-up.
    memory = {str(n): spawn("classify", n, workdir, 1) for n in args.texts}
    results["classify_memory"] = memory
    peaks = [memory[str(n)]["peak_mib"] for n in args.texts]
    results["classify_memory_ratio"] = peaks[-1] / peaks[0]
    results["translate"] = spawn("translate", args.sentences, workdir, 1)
    results["score"] = spawn("score", len(setup["texts"]["score"]), workdir, 1)
    results["machine"]["load_average_end"] = os.getloadavg()[0]
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=1)
    report(results, args.texts)
    return 0


def report(r, sizes):
    m, c, s = r["machine"], r["classify"], r["single_text"]
    print(
        f"\n{m.get('cpu')}, {m['cpus']} CPUs, avx512_bf16 {m.get('avx512_bf16')}, "
        f"amx_bf16 {m.get('amx_bf16')}; keras {r['versions']['keras']}, tensorflow "
        f"{r['versions']['tensorflow']}; load average {m['load_average']:.1f} at "
        f"the start, {m['load_average_end']:.1f} at the end; medians of "
        f"{r['rounds']} rounds\n"
    )
    memory = [r["classify_memory"][str(n)]["peak_mib"] for n in (sizes[-1], sizes[0])]
    rows = [
        (f"classify {c['texts']:,} texts, texts/s", "keras_attn classify",
         "keras-hub predict", c["keras_attn_texts_per_s"], c["keras_hub_texts_per_s"]),
        ("the same, against its network alone", "classify", "model(ids)",
         c["keras_attn_texts_per_s"], c["eager_texts_per_s"]),
        ("the same, against its network alone", "classify", "predict_on_batch",
         c["keras_attn_texts_per_s"], c["compiled_texts_per_s"]),
        (f"padded width, mean ({c['mean_tokens']:.1f} tokens)", "keras_attn",
         "keras-hub", c["mean_padded_width"], c["keras_hub_width"]),
        ("classify peak RSS, MiB", f"{sizes[-1]:,} texts", f"{sizes[0]:,} texts",
         *memory),
        (f"one text, ms ({s['tokens']} tokens, width {s['width']})",
         "classify([text])", "model(ids)", s["classify_ms"], s["forward_ms"]),
        ("one text, ms", "classify([text])", "predict_on_batch(ids)",
         s["classify_ms"], s["predict_on_batch_ms"]),
        ("one text, ms", "classify([text])", "keras-hub predict([text])",
         s["classify_ms"], s["keras_hub_predict_ms"]),
    ]  # fmt: skip
    print("| measure | a | b | a | b | a/b |\n|---|---|---|---:|---:|---:|")
    for name, a, b, x, y in rows:
        print(f"| {name} | {a} | {b} | {x:,.1f} | {y:,.1f} | {x / y:.2f} |")
    print(
        "\n| fresh process | texts | chars | texts/s | chars/s | RSS before -> ", end=""
    )
    print("run peak (MiB) | process peak (MiB) |\n|---|---:|---:|---:|---:|---|---:|")
    tasks = [(f"classify {n:,}", r["classify_memory"][str(n)]) for n in sizes]
    for name, t in [*tasks, ("translate", r["translate"]), ("score", r["score"])]:
        print(
            f"| {name} | {t['texts']:,} | {t['chars']:,} | {t['texts_per_s']:,.1f} | "
            f"{t['chars_per_s']:,.0f} | {t['rss_before_mib']:,.0f} -> "
            f"{t['run_peak_mib']:,.0f} | {t['peak_mib']:,.0f} |"
        )


if __name__ == "__main__":
    sys.exit(main())
