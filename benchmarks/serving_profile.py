"""Where a served request's time goes, and two exports of one task compared.

    .venv/bin/python benchmarks/serving_profile.py profile EXPORT [--batch 1] \
        [--signature serving_default]
    .venv/bin/python benchmarks/serving_profile.py compare BEFORE AFTER [--calls 80]
    .venv/bin/python benchmarks/serving_profile.py floor [--rows 16]
    .venv/bin/python benchmarks/serving_profile.py threads EXPORT \
        [--settings 0:0,1:1,1:2,2:1] [--rounds 3]

`profile` loads a version directory as TF Serving loads it (the TF1 loader,
`serve` tag, one session), calls `serving_default` (or `--signature`; an
integer input, the language model's `sample` seeds, gets 1 to the batch
size) with real sentences (the movie-review test split for a sentiment
export, the translation fixture's English otherwise), then traces 10 calls
(`RunOptions(trace_level=FULL_TRACE)`) and prints the p50 latency, the ops
run per call and the 25 costliest op types with their time per call.

`compare` loads two exports of one task in one process (`tf.saved_model.load`)
and times them alternately, call by call, at batch 1 and 16: p50 and p99 of
each and their ratio, with the same process's 2048² float32 matmul rate.
For a sentiment export it then reports the largest probability difference
and the share of equal labels on the whole test split; for a translator, how
many translations are identical.

`threads` times one export under several session thread settings,
`INTRA:INTER` as tensorflow_model_server's `--tensorflow_intra_op_parallelism`
and `--tensorflow_inter_op_parallelism` set them (0: TensorFlow's choice).
TensorFlow keeps one intra-op pool per process, so each setting runs in a
process of its own (the TF1 loader, `serve` tag), the settings taking turns
over `--rounds` rounds: per setting the median over rounds of the p50 at
batch 1 and 16, its ratio to the first setting's, and whether every answer
equals the first setting's. `profile` takes `--intra-op-threads` and
`--inter-op-threads` too.

`floor` times what the arithmetic alone costs a served call: the matmuls of
an encoder's blocks (per block the query, key, value and output projections
and the two feed-forward products; MiniLM's sizes by default) on `--rows`
token rows, chained in one `tf.function`, with the weights as variables (as
an export reads them), in float32 and bfloat16: the p50 of 200 calls and
the bytes of weights each call reads. At batch 1 these products are bound
by reading the weights, not by the matmul peak.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
from _timing import onednn_enabled

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # serving_standin: test tooling, not installed
FIXTURES = REPO / "tests" / "fixtures"


def task_of(export) -> str:
    metadata = Path(export) / "assets.extra" / "keras_attn.json"
    return json.loads(metadata.read_text())["task"]


def texts_for(task: str) -> list:
    if task == "sentiment":
        from keras_attn.datasets import load_movie_reviews

        return [text for text, _ in load_movie_reviews(verbose=False).test]
    lines = (FIXTURES / "de_en_pairs.tsv").read_text().splitlines()
    return [line.split("\t")[0] for line in lines if line.strip()]


def _session(
    export,
    intra_op_threads: int = 0,
    inter_op_threads: int = 0,
    signature: str = "serving_default",
):
    """`(session, signature_def)`: the export loaded as TF Serving loads it,
    in a session with these thread pools, and its `signature`."""
    import tensorflow as tf
    import tensorflow_text  # noqa: F401  the tokenizers' kernels

    from serving_standin.server import session_config

    tf.compat.v1.disable_eager_execution()
    session = tf.compat.v1.Session(
        config=session_config(intra_op_threads, inter_op_threads)
    )
    graph = tf.compat.v1.saved_model.loader.load(session, ["serve"], str(export))
    served = sorted(name for name in graph.signature_def if not name.startswith("__"))
    if signature not in served:  # not the SavedModel's own `__saved_model_init_op`
        raise SystemExit(
            f"--signature must be one of {served}. Received: {signature!r}"
        )
    return session, graph.signature_def[signature]


def feed_for(signature, texts: list) -> dict:
    """The feed of one request of `texts`: each string input gets the
    texts, an integer input (the language model's `sample` seeds) the
    seeds 1 to the batch size."""
    import tensorflow as tf

    feed = {}
    for info in signature.inputs.values():
        if info.dtype == tf.string.as_datatype_enum:
            feed[info.name] = np.array(texts, dtype=object)
        else:
            feed[info.name] = np.arange(1, len(texts) + 1, dtype=np.int64)
    return feed


def profile(
    export,
    batch: int,
    calls: int = 30,
    intra_op_threads=0,
    inter_op_threads=0,
    signature_name: str = "serving_default",
) -> None:
    import tensorflow as tf

    session, signature = _session(
        export, intra_op_threads, inter_op_threads, signature_name
    )
    outputs = [value.name for value in signature.outputs.values()]
    feed = feed_for(signature, texts_for(task_of(export))[:batch])
    for _ in range(5):
        session.run(outputs, feed)
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        session.run(outputs, feed)
        seconds.append(time.perf_counter() - start)
    print(
        f"{export} ({signature_name}): batch {batch}, "
        f"p50 {np.median(seconds) * 1e3:.1f} ms"
    )
    micros, counts, traced = collections.Counter(), collections.Counter(), 10
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    for _ in range(traced):
        metadata = tf.compat.v1.RunMetadata()
        session.run(outputs, feed, options=options, run_metadata=metadata)
        for device in metadata.step_stats.dev_stats:
            for node in device.node_stats:
                label = node.timeline_label
                op = (
                    label.split("=")[-1].split("(")[0].strip()
                    if "=" in label
                    else node.node_name
                )
                micros[op] += node.op_end_rel_micros - node.op_start_rel_micros
                counts[op] += 1
    print(f"ops per call: {sum(counts.values()) / traced:.0f} (traced)")
    print("| op | ms per call | runs per call |\n|---|---:|---:|")
    for op, total in micros.most_common(25):
        print(f"| {op} | {total / traced / 1e3:.2f} | {counts[op] / traced:.0f} |")


def compare(before, after, calls: int) -> None:
    import tensorflow as tf
    import tensorflow_text  # noqa: F401

    task = task_of(before)
    texts = texts_for(task)
    serve = {
        "before": tf.saved_model.load(str(before)).signatures["serving_default"],
        "after": tf.saved_model.load(str(after)).signatures["serving_default"],
    }
    a = tf.random.normal([2048, 2048])
    matmul = tf.function(lambda x: tf.matmul(x, x))
    matmul(a).numpy()
    times = []
    for _ in range(7):
        start = time.perf_counter()
        matmul(a).numpy()
        times.append(time.perf_counter() - start)
    print(f"2048² float32 matmul: {2 * 2048**3 / np.median(times) / 1e9:.0f} GFLOP/s")
    for batch in (1, 16):
        pool = [texts[(i * batch) % len(texts) :][:batch] for i in range(calls)]
        pool = [texts_ for texts_ in pool if len(texts_) == batch]
        seconds = {"before": [], "after": []}
        for index, texts_ in enumerate(pool):
            x = tf.constant(texts_)
            order = ("before", "after") if index % 2 else ("after", "before")
            for name in order:
                start = time.perf_counter()
                serve[name](text=x)
                if index >= 3:  # after 3 warm-up calls
                    seconds[name].append(time.perf_counter() - start)
        p50 = {name: np.median(found) * 1e3 for name, found in seconds.items()}
        p99 = {name: np.percentile(found, 99) * 1e3 for name, found in seconds.items()}
        print(
            f"batch {batch}: before p50 {p50['before']:.1f} ms (p99 "
            f"{p99['before']:.1f}), after p50 {p50['after']:.1f} ms (p99 "
            f"{p99['after']:.1f}): {p50['before'] / p50['after']:.2f}x"
        )
    if task == "sentiment":
        found = {name: [] for name in serve}
        for start in range(0, len(texts), 16):
            x = tf.constant(texts[start : start + 16])
            for name, fn in serve.items():
                found[name].append(fn(text=x)["positive_probability"].numpy())
        p, q = (np.concatenate(found[name]) for name in ("before", "after"))
        equal = np.mean((p > 0.5) == (q > 0.5))
        print(
            f"{len(texts)} test texts: largest probability difference "
            f"{np.abs(p - q).max():.2e}, labels equal {equal:.2%}"
        )
    elif task == "translation":
        same = 0
        for start in range(0, len(texts), 8):
            x = tf.constant(texts[start : start + 8])
            got = [serve[name](text=x)["translation"].numpy() for name in serve]
            same += int((got[0] == got[1]).sum())
        print(f"identical translations: {same} of {len(texts)}")


def time_session(export, intra_op_threads: int, inter_op_threads: int, calls: int):
    """One setting, in this process: `{"p50_ms": {batch: ms}, "answers": [...]}`
    for batches of 1 and 16 texts, after 3 warm-up calls each."""
    session, signature = _session(export, intra_op_threads, inter_op_threads)
    outputs = sorted(signature.outputs)
    fetches = [signature.outputs[key].name for key in outputs]
    texts = texts_for(task_of(export))
    p50, answers = {}, []
    for batch in (1, 16):
        pool = [
            [texts[(i * batch + j) % len(texts)] for j in range(batch)]
            for i in range(calls + 3)
        ]
        seconds = []
        for index, batch_texts in enumerate(pool):
            feed = feed_for(signature, batch_texts)
            start = time.perf_counter()
            found = session.run(fetches, feed)
            if index >= 3:
                seconds.append(time.perf_counter() - start)
            if index < 8:
                answers.append([np.asarray(value).tolist() for value in found])
        p50[batch] = float(np.median(seconds) * 1e3)
    session.close()
    return {"p50_ms": p50, "answers": json.loads(json.dumps(answers, default=str))}


def parse_settings(text: str) -> list:
    """`"0:0,1:1"` -> `[(0, 0), (1, 1)]`, each `INTRA:INTER` two ints >= 0."""
    settings = []
    for item in text.split(","):
        parts = item.split(":")
        if len(parts) != 2 or not all(part.strip().isdigit() for part in parts):
            raise ValueError(
                "`--settings` takes INTRA:INTER pairs of ints >= 0, comma "
                f"separated (0: TensorFlow's choice). Received: {item!r} in {text!r}"
            )
        settings.append((int(parts[0]), int(parts[1])))
    return settings


def threads(export, settings: list, rounds: int, calls: int) -> dict:
    """Each setting in a process of its own, in turns over `rounds`; prints
    and returns `{setting: {"p50_ms": {batch: median over rounds}, "same":
    bool}}`, `same` whether every answer equalled the first setting's."""
    import subprocess

    found = {setting: [] for setting in settings}
    for round_ in range(rounds):
        # The order turns each round, so no setting always runs first.
        order = settings[round_ % len(settings) :] + settings[: round_ % len(settings)]
        for intra, inter in order:
            command = [
                sys.executable, __file__, "_time", str(export),
                "--intra-op-threads", str(intra), "--inter-op-threads", str(inter),
                "--calls", str(calls),
            ]  # fmt: skip
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(
                    f"timing {export} at {intra}:{inter} failed:\n"
                    + result.stderr[-3000:]
                )
            found[(intra, inter)].append(json.loads(result.stdout.splitlines()[-1]))
    reference = found[settings[0]][0]["answers"]
    summary = {}
    print(
        f"{export}: {rounds} rounds, {calls} calls per batch size, "
        f"{os.cpu_count()} cores"
    )
    print(
        "| intra:inter | batch 1 p50 ms | ratio | batch 16 p50 ms | ratio | answers |"
    )
    print("|---|---:|---:|---:|---:|---|")
    for setting in settings:
        p50 = {
            batch: float(np.median([run["p50_ms"][batch] for run in found[setting]]))
            for batch in ("1", "16")
        }
        same = all(run["answers"] == reference for run in found[setting])
        summary[setting] = {"p50_ms": p50, "same": same}
        first = summary[settings[0]]["p50_ms"]
        label = ":".join(str(n) if n else "auto" for n in setting)
        print(
            f"| {label} | {p50['1']:.1f} | {first['1'] / p50['1']:.2f}x | "
            f"{p50['16']:.1f} | {first['16'] / p50['16']:.2f}x | "
            f"{'equal' if same else 'DIFFERENT'} |"
        )
    return summary


def floor(rows: int, blocks: int, width: int, intermediate: int) -> None:
    import tensorflow as tf

    shapes = [(width, width)] * 4 + [(width, intermediate), (intermediate, width)]
    print(
        f"{blocks} blocks of width {width} and {intermediate}, {rows} rows, "
        f"oneDNN {'on' if onednn_enabled() else 'off'}"
    )
    for dtype in (tf.float32, tf.bfloat16):
        rng = np.random.default_rng(0)
        weights = [
            [
                tf.Variable(tf.cast(rng.normal(size=shape) * 0.05, dtype))
                for shape in shapes
            ]
            for _ in range(blocks)
        ]
        inputs = tf.cast(rng.normal(size=(rows, width)), dtype)

        @tf.function
        def products(x, weights=weights):
            for q, k, v, o, up, down in weights:
                heads = tf.matmul(x, q) + tf.matmul(x, k) + tf.matmul(x, v)
                x = x + 0.01 * tf.matmul(tf.matmul(tf.matmul(heads, o), up), down)
            return x

        products(inputs)
        seconds = []
        for _ in range(200):
            start = time.perf_counter()
            products(inputs).numpy()
            seconds.append(time.perf_counter() - start)
        read = blocks * sum(a * b for a, b in shapes) * dtype.size
        print(
            f"{dtype.name}: p50 {np.median(seconds) * 1e3:.2f} ms, "
            f"{read / 1e6:.1f} MB of weights per call ({read} bytes)"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("profile")
    one.add_argument("export")
    one.add_argument("--batch", type=int, default=1)
    one.add_argument(
        "--signature",
        default="serving_default",
        help="the signature to profile (a language model's `sample`: its "
        "seeds are 1 to the batch size)",
    )
    one.add_argument("--intra-op-threads", type=int, default=0)
    one.add_argument("--inter-op-threads", type=int, default=0)
    two = commands.add_parser("compare")
    two.add_argument("before")
    two.add_argument("after")
    two.add_argument("--calls", type=int, default=80)
    three = commands.add_parser("floor")
    three.add_argument("--rows", type=int, default=16)
    three.add_argument("--blocks", type=int, default=6)
    three.add_argument("--width", type=int, default=384)
    three.add_argument("--intermediate", type=int, default=1536)
    four = commands.add_parser("threads")
    four.add_argument("export")
    four.add_argument("--settings", default="0:0,1:1,1:2,2:1")
    four.add_argument("--rounds", type=int, default=3)
    four.add_argument("--calls", type=int, default=30)
    inner = commands.add_parser("_time")  # one setting, for `threads`
    inner.add_argument("export")
    inner.add_argument("--intra-op-threads", type=int, default=0)
    inner.add_argument("--inter-op-threads", type=int, default=0)
    inner.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    if args.command == "profile":
        profile(
            args.export,
            args.batch,
            intra_op_threads=args.intra_op_threads,
            inter_op_threads=args.inter_op_threads,
            signature_name=args.signature,
        )
    elif args.command == "threads":
        threads(args.export, parse_settings(args.settings), args.rounds, args.calls)
    elif args.command == "_time":
        timed = time_session(
            args.export, args.intra_op_threads, args.inter_op_threads, args.calls
        )
        print(json.dumps(timed))
    elif args.command == "floor":
        floor(args.rows, args.blocks, args.width, args.intermediate)
    else:
        compare(args.before, args.after, args.calls)


if __name__ == "__main__":
    main()
