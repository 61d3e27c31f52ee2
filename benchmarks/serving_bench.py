"""Serving latency and load of the exports, loaded as TF Serving loads them.

One export per task (sentiment, translator, language model) is loaded with
the TF1 loader and the `serve` tag, in one session, as `tensorflow_model_server`
loads it (`serving_standin.StandInServer`, the tests' stand-in for the
server, at the repository root; requests go in as `PredictRequest`s, answers
come out as `PredictResponse`s, without the server's network layer or
batching queue). Then:

1. Sequential latency: `serving_default` (`sample` for the task
   `language_model_sample`) on batches of 1 and 16 texts, one
   call at a time after 3 warm-up calls: p50 and p99 latency, texts per
   second. The translator's two exports (beam 4 and greedy) take turns,
   call by call, so that both see the same load.
2. Under load: for each number of client threads (1, 4, 16, 64) and batch
   size (1, 8, 32), every thread sends requests back to back for `--seconds`:
   throughput (texts per second), p50 and p99 latency per request, errors
   (must be 0), and every answer compared with the answer to the same
   request sent alone before the load (must be equal).
3. Memory: resident memory after 3 warm-up rounds of 16 threads sending
   every batch size, and after 20 more rounds (must not grow by more than 5%).

With `--precisions float32,bfloat16,int8,int4` and a trained model of a task
(`--sentiment-run`, `--translator-run`, `--language-model-run`: a run
directory of the example script, or its `model.keras`), the task is exported
once per precision (`export(..., precision=...)`) and every export is
measured as above in the same process, the exports taking turns call by
call: p50/p99 at batch 1 and 16, texts per second under 1-16 clients, the
size of each export's variables, and, for the sentiment exports, the useful
work done per second (the matmuls over each text's real tokens, 2 FLOPs per
weight per token, plus attention's 4·T²·d per layer) as a share of a
2048x2048 `tf.matmul`'s rate in the same process (float32, and bfloat16 for
the bfloat16 export).

`--sentiment-texts test` sends the movie-review corpus's test split (real
reviews) to the sentiment exports instead of the fixtures' short texts.

`--kernels eigen` runs TensorFlow's Eigen kernels, as TF Serving's release
binaries do (they are built without oneDNN; `TF_ENABLE_ONEDNN_OPTS=0`, set
before TensorFlow loads); `--kernels onednn` runs oneDNN's, pip
TensorFlow's default on x86. The report names the kernels that ran.

`--intra-op-threads N --inter-op-threads M` give the session the thread
pools that tensorflow_model_server's `--tensorflow_intra_op_parallelism` and
`--tensorflow_inter_op_parallelism` set (0, the default: one per core), set
before anything runs (TensorFlow makes them once per process).

The process exits with status 1 if any of the "must" conditions fails.

The task `language_model_sample` serves the language model export's
`sample` signature (each prompt with its own seed, 1 to the batch size, so
an answer is the same whenever its request is sent): the export of
`--language-model-export` when it has one (else the task is skipped with a
note), or the language model exported with `--sampler` (a sampler's name or
JSON config, `keras_attn.generation.get`; default `top_k`).

The exports: `--sentiment-export`, `--translator-export`,
`--language-model-export` (model or version directories, e.g.
`artifacts/demo/export/sentiment`), or `--translator-run` and
`--sentiment-run` (trained runs of the example scripts, exported here with
their defaults), or, for a task given neither way, the export of the example
script's `--smoke` run (trained for seconds), made in a temporary directory.

    .venv/bin/python benchmarks/serving_bench.py \
        --sentiment-export artifacts/demo/export/sentiment \
        --translator-export artifacts/demo/export/translator
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
from _timing import matmul_peak, onednn_enabled

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # serving_standin: test tooling, not installed
FIXTURES = REPO / "tests" / "fixtures"
TASKS = ("sentiment", "translator", "language_model", "language_model_sample")
INPUT_NAMES = {
    "sentiment": "text",
    "translator": "text",
    "language_model": "prompt",
    "language_model_sample": "prompt",
}
# A task served from another task's export, by another signature.
SOURCES = {"language_model_sample": "language_model"}
SIGNATURES = {"language_model_sample": "sample"}
DEFAULT_SAMPLER = "top_k"


def source(task: str) -> str:
    """The task whose export and options serve `task`."""
    return SOURCES.get(task, task)


def fixture_texts() -> dict:
    """Texts per task: the fixtures' English sentences and movie snippets."""
    english = [
        line.split("\t")[0]
        for line in (FIXTURES / "de_en_pairs.tsv").read_text().splitlines()
        if line.strip()
    ]
    reviews = [
        line.split("\t")[2]
        for line in (FIXTURES / "movie_ground_truth.txt").read_text().splitlines()
        if line.strip()
    ]
    plays = [
        line
        for line in (FIXTURES / "play_sample.txt").read_text().splitlines()
        if len(line) > 20
    ]
    return {
        "sentiment": reviews + english,
        "translator": english,
        "language_model": plays[:40],
        "language_model_sample": plays[:40],
    }


def smoke_export(task: str, root: Path, sampler: str = DEFAULT_SAMPLER) -> Path:
    """The export of `examples/<script>.py --smoke` for `task` (the language
    model's with `--export-sampler sampler`: `language_model_sample` serves
    it too)."""
    reviews = root / "reviews.tsv"
    if not reviews.exists():
        rows = (FIXTURES / "movie_ground_truth.txt").read_text().splitlines()
        labelled = [
            (int(float(rating) > 0), text)
            for _, rating, text in (row.split("\t") for row in rows if row.strip())
            if float(rating) != 0
        ]
        lines = [
            f"{label}\t{text} (take {i})" for i in range(12) for label, text in labelled
        ]
        reviews.write_text("\n".join(lines) + "\n")
        (root / "play.txt").write_text((FIXTURES / "play_sample.txt").read_text() * 20)
    script, args = {
        "sentiment": ("sentiment.py", ["--pretrained", "none", "--data", reviews]),
        "translator": (
            "translate.py",
            ["--pretrained", "none", "--data", FIXTURES / "de_en_pairs.tsv"],
        ),
        "language_model": (
            "language_model.py",
            ["--data", root / "play.txt", "--export-sampler", sampler],
        ),
    }[source(task)]
    out = root / source(task)
    if (out / "export").exists():  # built for another task served from it
        return out / "export" / source(task)
    print(f"building the {task} export: examples/{script} --smoke", flush=True)
    subprocess.run(
        [sys.executable, REPO / "examples" / script, "--smoke", *args, "--out", out],
        check=True,
        capture_output=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    return out / "export" / source(task)


def load_run(run: Path):
    """`(model, config)` of a trained run of an example script (its
    `model.keras` holds its tokenizers; `run` may be the file itself)."""
    import keras

    run = Path(run)
    path = run if run.suffix == ".keras" else run / "model.keras"
    metrics = path.parent / "metrics.json"
    config = json.loads(metrics.read_text())["config"] if metrics.exists() else {}
    return keras.saving.load_model(path, compile=False), config


def run_export(
    task: str,
    run: Path,
    root: Path,
    beam_width: int = 4,
    precision=None,
    sampler=DEFAULT_SAMPLER,
) -> Path:
    """Export a trained run of translate.py, sentiment.py or
    language_model.py, with its defaults (the translator with `beam_width`;
    for `language_model_sample` with `sampler`), in `precision` (None: as it
    is)."""
    model, config = load_run(run)
    suffix = "" if precision is None else f"_{precision}"
    if task == "translator":
        return model.export(
            root,
            model_name=f"translator_{beam_width}{suffix}",
            max_length=40,
            beam_width=beam_width,
            length_penalty=config.get("length_penalty", 1.0),
            precision=precision,
        )
    if task == "language_model":
        return model.export(root, model_name=f"{task}{suffix}", precision=precision)
    if task == "language_model_sample":
        from keras_attn.export.language_model import sampler_from_text

        return model.export(
            root,
            model_name=f"{task}{suffix}",
            precision=precision,
            sampler=sampler_from_text(sampler),  # a name or a JSON config
        )
    return model.export(
        root, model_name=f"{task}{suffix}", max_length=64, precision=precision
    )


def variables_bytes(export: Path) -> int:
    return sum(f.stat().st_size for f in (Path(export) / "variables").iterdir())


def classifier_flops(model, texts: list) -> float:
    """The useful FLOPs of classifying `texts` with `model` (a
    `TextClassifier` or an ensemble): per text of T real tokens, 2 per weight
    of every matmul of the network per token, plus attention's 4·T²·d per
    block (QKᵀ and the weighted sum)."""
    import keras

    members = getattr(model, "members", None) or [model]
    tokenizer = model.dense_tokenizer(64)
    lengths = [
        int(np.count_nonzero(row)) for row in np.asarray(tokenizer.tokenize(texts))
    ]
    total = 0.0
    for member in members:
        weights = sum(
            int(np.prod(layer.kernel.shape))
            for layer in member.backbone._flatten_layers()
            if isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense))
        )
        blocks, width = len(member.backbone.blocks), member.backbone.embedding_dim
        total += sum(2 * weights * t + 4 * t * t * width * blocks for t in lengths)
    return total


def batches(texts: list, size: int, count: int) -> list:
    """`count` batches of `size` texts, cycling through `texts`."""
    return [
        [texts[(start * size + i) % len(texts)] for i in range(size)]
        for start in range(count)
    ]


def ask(server, task: str, batch: list):
    """The answer of `task`'s signature to `batch` (for `sample`, with the
    seeds 1 to the batch size)."""
    from keras_attn.export._predict import response_arrays
    from serving_standin import predict_request

    inputs = {INPUT_NAMES[task]: batch}
    signature = SIGNATURES.get(task, "serving_default")
    if signature == "sample":
        inputs["seed"] = list(range(1, len(batch) + 1))
    request = predict_request(server.model_name, signature, inputs)
    return response_arrays(server.predict(request))


def has_signature(export: Path, name: str) -> bool:
    """Whether the export (a model or version directory) has the signature
    `name`, as its keras_attn metadata says."""
    for metadata in sorted(Path(export).rglob("assets.extra/keras_attn.json")):
        return name in json.loads(metadata.read_text()).get("signatures", {})
    return False


def same(got: dict, want: dict) -> bool:
    for name, value in want.items():
        if got[name].shape != value.shape:
            return False
        if value.dtype.kind == "f":
            if not np.allclose(got[name], value, rtol=1e-5, atol=1e-6):
                return False
        elif not np.array_equal(got[name], value):
            return False
    return True


def sequential(servers, task, texts, batch_size, calls):
    """`{name: (p50 ms, p99 ms, texts/s)}` of one call at a time to each of
    `servers` (`{name: server}`), the servers taking turns call by call (the
    same batch to each in turn) so that a drift of a shared machine's load
    hits them alike."""
    pool = batches(texts, batch_size, calls)
    for batch in pool[:3]:
        for server in servers.values():
            ask(server, task, batch)
    times = {name: [] for name in servers}
    for batch in pool:
        for name, server in servers.items():
            start = time.perf_counter()
            ask(server, task, batch)
            times[name].append(time.perf_counter() - start)
    found = {}
    for name, seconds in times.items():
        p50, p99 = np.percentile(seconds, [50, 99])
        found[name] = (p50 * 1000, p99 * 1000, batch_size / np.median(seconds))
    return found


def under_load(server, task, texts, threads, batch_size, seconds, expected):
    """Every thread sends its own cycle of `expected`'s batches for
    `seconds`; returns (texts/s, p50 ms, p99 ms, errors, mismatches)."""
    pool = expected[batch_size]
    latencies, rows, errors, mismatches = [], [0], [], [0]
    lock = threading.Lock()
    deadline = time.perf_counter() + seconds

    def client(index):
        local_times, local_rows, local_bad, call = [], 0, 0, index
        while time.perf_counter() < deadline:
            batch, want = pool[call % len(pool)]
            call += 1
            start = time.perf_counter()
            try:
                got = ask(server, task, batch)
            except Exception as error:  # counted, not raised: the run goes on
                with lock:
                    errors.append(repr(error))
                continue
            local_times.append(time.perf_counter() - start)
            local_rows += len(batch)
            local_bad += not same(got, want)
        with lock:
            latencies.extend(local_times)
            rows[0] += local_rows
            mismatches[0] += local_bad

    started = time.perf_counter()
    workers = [threading.Thread(target=client, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - started
    p50, p99 = np.percentile(latencies, [50, 99]) if latencies else (np.nan, np.nan)
    return rows[0] / elapsed, p50 * 1000, p99 * 1000, len(errors), mismatches[0]


def resident_bytes() -> int:
    """This process's resident memory (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_rounds(server, task, texts, batch_sizes, warmup_rounds, rounds, threads=16):
    """Resident bytes after `warmup_rounds` and after `rounds` more, each
    round `threads` threads sending one request of every batch size."""

    def one_round():
        def client(index):
            for size in batch_sizes:
                ask(server, task, batches(texts[index:] + texts[:index], size, 1)[0])

        workers = [threading.Thread(target=client, args=(i,)) for i in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()

    for _ in range(warmup_rounds):
        one_round()
    before = resident_bytes()
    for _ in range(rounds):
        one_round()
    return before, resident_bytes()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for task in TASKS:
        flag = task.replace("_", "-")
        parser.add_argument(f"--{flag}-export", help=f"a {task} export")
    parser.add_argument("--translator-run", help="a translate.py run to export")
    parser.add_argument("--sentiment-run", help="a sentiment.py run to export")
    parser.add_argument(
        "--language-model-run", help="a language_model.py run to export"
    )
    parser.add_argument(
        "--precisions",
        default=None,
        help="with a task's --*-run: export it in each of these precisions "
        "(float32,bfloat16,int8,int4) and compare them",
    )
    parser.add_argument("--threads", default="1,4,16,64")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--seconds", type=float, default=10.0, help="per load cell")
    parser.add_argument("--calls", type=int, default=40, help="sequential calls")
    parser.add_argument("--warmup-rounds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--max-memory-growth", type=float, default=0.05)
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument(
        "--sentiment-texts",
        choices=("fixtures", "test"),
        default="fixtures",
        help="the sentiment requests' texts: the fixtures' movie snippets and "
        "English sentences, or the movie-review corpus's test split (real "
        "reviews, about 27 tokens each)",
    )
    parser.add_argument(
        "--sampler",
        default=DEFAULT_SAMPLER,
        help="the sampler of the `sample` signature the language model is "
        "exported with here (a name or a JSON config; "
        "keras_attn.generation.get)",
    )
    parser.add_argument(
        "--intra-op-threads",
        type=int,
        default=0,
        help="the session's intra-op threads, as tensorflow_model_server's "
        "--tensorflow_intra_op_parallelism (0: TensorFlow's choice)",
    )
    parser.add_argument(
        "--inter-op-threads",
        type=int,
        default=0,
        help="the session's inter-op threads, as "
        "--tensorflow_inter_op_parallelism (0: TensorFlow's choice)",
    )
    parser.add_argument(
        "--kernels",
        choices=("onednn", "eigen"),
        default=None,
        help="TensorFlow's CPU kernels: `eigen` sets TF_ENABLE_ONEDNN_OPTS=0 "
        "before TensorFlow loads (what TF Serving's release binaries run, "
        "built without oneDNN), `onednn` sets it to 1 (pip TensorFlow's "
        "default on x86); by default the environment decides",
    )
    args = parser.parse_args()
    if args.kernels is not None:  # read once, when TensorFlow loads
        os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0" if args.kernels == "eigen" else "1"
    import tensorflow as tf

    # The intra-op pool is the process's, made by whatever runs an op first
    # (here the eager matmul below), and sessions share one inter-op pool made
    # by the first: both are set before anything runs, as the server's flags.
    tf.config.threading.set_intra_op_parallelism_threads(args.intra_op_threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.inter_op_threads)
    threads = [int(t) for t in args.threads.split(",")]
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    tasks = args.tasks.split(",")

    from serving_standin import StandInServer

    def serve(path):  # the stand-in server with this run's session threads
        return StandInServer(
            path,
            intra_op_threads=args.intra_op_threads,
            inter_op_threads=args.inter_op_threads,
        )

    texts, sentiment_origin = fixture_texts(), "the fixtures"
    if args.sentiment_texts == "test":
        from keras_attn.datasets import load_movie_reviews

        texts["sentiment"] = [
            text for text, _ in load_movie_reviews(verbose=False).test
        ]
        sentiment_origin = "the movie reviews' test split"
    failures, notes = [], []
    sequential_rows, load_rows, memory_rows, size_rows = [], [], [], []
    work = {}  # batch size -> useful FLOPs of the sentiment batch timed
    peaks = {"float32": matmul_peak("float32") / 1e9}
    if args.precisions and "bfloat16" in args.precisions:
        peaks["bfloat16"] = matmul_peak("bfloat16") / 1e9
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for task in tasks:
            export = getattr(args, f"{source(task)}_export")
            run = getattr(args, f"{source(task)}_run", None)
            exports = {}
            if run is not None and args.precisions:
                for precision in args.precisions.split(","):
                    exports[f"{task} {precision}"] = run_export(
                        task, Path(run), root / "runs", precision=precision,
                        sampler=args.sampler,
                    )  # fmt: skip
                export = next(iter(exports.values()))
            if export is None and run is not None:
                export = run_export(
                    task, Path(run), root / "runs", sampler=args.sampler
                )
            if export is None:
                export = smoke_export(task, root, args.sampler)
            if task in SIGNATURES and not has_signature(export, SIGNATURES[task]):
                notes.append(
                    f"{task} skipped: {export} has no `{SIGNATURES[task]}` "
                    "signature (export the language model with a sampler)"
                )
                print(notes[-1], flush=True)
                continue
            server = serve(export)
            variants = [(task, server)]
            if exports:  # one export per precision
                variants = [
                    (name, server if path == export else serve(path))
                    for name, path in exports.items()
                ]
                for name, path in exports.items():
                    size_rows.append((name, variables_bytes(path)))
            elif task == "translator" and run is not None:  # and its greedy export
                greedy = run_export(task, Path(run), root / "runs", beam_width=1)
                variants = [
                    ("translator, beam 4", server),
                    ("translator, greedy", serve(greedy)),
                ]
            if task == "sentiment" and run is not None:
                model, _ = load_run(Path(run))
                for size in (1, 16):  # the mean work of a batch timed
                    pool = batches(texts[task], size, args.calls)
                    every = [text for batch in pool for text in batch]
                    work[size] = classifier_flops(model, every) / len(pool)
            # The variants (beam 4 and greedy) timed in turns, call by call.
            timings = {
                size: sequential(dict(variants), task, texts[task], size, args.calls)
                for size in (1, 16)
            }
            for name, _ in variants:
                for size in (1, 16):
                    sequential_rows.append((name, size, *timings[size][name]))
            # The answers to each request sent alone, before any load.
            expected = {
                size: [
                    (batch, ask(server, task, batch))
                    for batch in batches(texts[task], size, 8)
                ]
                for size in sizes
            }
            for name, variant in variants if exports else [(task, server)]:
                if variant is not server:  # its own answers, sent alone
                    expected = {
                        size: [
                            (batch, ask(variant, task, batch))
                            for batch in batches(texts[task], size, 8)
                        ]
                        for size in sizes
                    }
                for count in threads:
                    for size in sizes:
                        rate, p50, p99, errors, mismatches = under_load(
                            variant, task, texts[task], count, size, args.seconds,
                            expected,
                        )  # fmt: skip
                        load_rows.append(
                            (name, count, size, rate, p50, p99, errors, mismatches)
                        )
                        if errors or mismatches:
                            failures.append(
                                f"{name}, {count} threads, batch {size}: {errors} "
                                f"errors, {mismatches} answers differing from the "
                                "sequential ones"
                            )
            before, after = memory_rounds(
                server, task, texts[task], sizes, args.warmup_rounds, args.rounds
            )
            growth = after / before - 1
            memory_rows.append((task, before, after, growth))
            if growth > args.max_memory_growth:
                failures.append(
                    f"{task}: resident memory grew {growth:.1%} "
                    f"over {args.rounds} rounds"
                )
            for _, variant in variants:
                variant.close()
    peak_text = ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in peaks.items())
    print(f"\n2048x2048 tf.matmul in this process: {peak_text}")
    onednn = onednn_enabled()
    print("Kernels: " + ("oneDNN" if onednn else "Eigen (TF_ENABLE_ONEDNN_OPTS=0)"))
    print(
        f"Session threads: intra-op {args.intra_op_threads or 'auto'}, "
        f"inter-op {args.inter_op_threads or 'auto'} ({os.cpu_count()} cores)"
    )
    if "sentiment" in tasks:
        print(f"Sentiment texts: {sentiment_origin} ({len(texts['sentiment'])} texts)")
    print(
        "\nSequential (one call at a time, serving_default; "
        "language_model_sample: sample):\n"
    )
    print(
        "| export | batch | p50 ms | p99 ms | texts/s | useful GFLOP/s | "
        "share of the matmul peak |\n|---|---:|---:|---:|---:|---:|---:|"
    )
    for name, size, p50, p99, rate in sequential_rows:
        rate_text = share_text = "-"
        if name.startswith("sentiment") and size in work:
            gflops = work[size] / (size / rate) / 1e9
            peak = peaks["bfloat16" if "bfloat16" in name else "float32"]
            rate_text, share_text = f"{gflops:.1f}", f"{gflops / peak:.1%}"
        print(
            f"| {name} | {size} | {p50:.1f} | {p99:.1f} | {rate:.1f} | "
            f"{rate_text} | {share_text} |"
        )
    if size_rows:
        print("\n| export | variables MB |\n|---|---:|")
        for name, size in size_rows:
            print(f"| {name} | {size / 1e6:.1f} |")
    print(f"\nUnder load ({args.seconds:g} s per row, the same signatures):\n")
    print(
        "| export | threads | batch | texts/s | p50 ms | p99 ms | errors | "
        "differing |\n|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    for task, count, size, rate, p50, p99, errors, mismatches in load_rows:
        print(
            f"| {task} | {count} | {size} | {rate:.1f} | {p50:.1f} | {p99:.1f} | "
            f"{errors} | {mismatches} |"
        )
    print(
        f"\nResident memory after {args.warmup_rounds} warm-up rounds and after "
        f"{args.rounds} more:\n"
    )
    print(
        "| export | after warm-up MB | after rounds MB | growth |\n|---|---:|---:|---:|"
    )
    for task, before, after, growth in memory_rows:
        print(f"| {task} | {before / 1e6:.0f} | {after / 1e6:.0f} | {growth:+.1%} |")
    if notes:
        print("\n" + "\n".join(notes))
    if failures:
        print("\nFAILED:\n" + "\n".join(failures))
        sys.exit(1)


if __name__ == "__main__":
    main()
