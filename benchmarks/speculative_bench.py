"""Speculative decoding against plain greedy decoding, on trained runs.

    .venv/bin/python benchmarks/speculative_bench.py \\
        [--language-model-run RUN] [--translator-run RUN] \\
        [--prompts 8] [--new-tokens 64] [--rounds 3] [--jit-compile] \\
        [--json out.json]

`--language-model-run`: a `language_model.py` run trained with
`--assistant-layers` (its `model.keras` holds the draft). Prompts: 200
characters from each of `--prompts` evenly spaced places of the test split's
first play (the fixed split of `keras_attn.datasets.load_shakespeare`), each
continued by `--new-tokens` tokens with greedy decoding: plain (no
assistant), speculative with the model's own draft, and prompt lookup
(guesses copied from n-gram matches in the row's own tokens), at batch 1
(one prompt per call) and batch 8 (all in one call). Each row gives the new
tokens per second (the median of `--rounds` rounds, the methods timed in
turns after a compiling round), the speed-up over plain decoding, whether the
texts are the same as plain decoding's, and the acceptance rate: tokens
gained per guess made, `sum(new - rounds) / (k * sum(rounds))` over the
rows (from `keras_attn.generation`'s `return_stats`, in a separate
uncounted call; rounds cut short by the end token or the length count
against it).

`--translator-run`: a `translate.py` run with `--assistant-layers`: the
first `--prompts` sources of the test split (`load_translation_pairs`, the
run's `--alternatives`), greedy (beam 1, no length penalty) with and without
the draft, at batch 1 and 8: sentences per second, the speed-up, and whether
the translations are the same.

`--jit-compile` (TensorFlow): sets the tasks' `jit_compile = True`, so their
decodings compile with XLA (`tf.function(jit_compile=True)`) as they do by
default on a machine with a GPU; the compiling round takes longer.

Speed is the machine's: the CPU's flags are printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _timing import machine  # noqa: E402

LM_METHODS = {"plain": False, "draft": None, "prompt_lookup": "prompt_lookup"}
TRANSLATOR_METHODS = {"plain": False, "draft": None}


JIT_COMPILE = False  # --jit-compile


def load(run: Path):
    import keras_attn.models  # noqa: F401  registers the classes

    model = keras.saving.load_model(Path(run) / "model.keras", compile=False)
    if JIT_COMPILE:
        model.jit_compile = True
    config = json.loads((Path(run) / "metrics.json").read_text())["config"]
    if not isinstance(model.assistant_model, keras.Model):
        raise SystemExit(
            f"{run}: the model has no draft (`assistant_model`); train it with "
            "--assistant-layers"
        )
    return model, config


def lm_prompts(count: int) -> list[str]:
    from keras_attn.datasets import load_shakespeare

    text = load_shakespeare(verbose=False).test[0].text
    step = max(1, (len(text) - 200) // count)
    return [text[i * step : i * step + 200] for i in range(count)]


def timed_rounds(calls: dict, rounds: int) -> tuple[dict, dict]:
    """`calls[name]()` once each to compile, then `rounds` rounds in turns:
    the median seconds and the last outputs of each."""
    outputs = {name: call() for name, call in calls.items()}
    seconds = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            outputs[name] = call()
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in seconds.items()}, outputs


def acceptance_rate(model, assistant, prompts, new_tokens, k) -> float:
    """Tokens gained per guess, over `prompts` decoded as one batch (the
    task's own speculative call with `return_stats`, compiled on
    TensorFlow): `sum(new - rounds) / (k * sum(rounds))` over the rows, 1.0
    when every guess is kept and no round is cut short by the end token or
    the length."""
    from keras_attn.generation import GreedySampler
    from keras_attn.models.language_model import END_ID, START_ID

    # The prompts as `continue_ids` makes them: the start token, then the
    # last tokens that leave room for the new ones.
    keep = model.prompt_room(new_tokens, model.sequence_length)
    ids = model.preprocessor.generate_preprocess(prompts).to_list()
    rows = [[START_ID] + (row[-keep:] if keep > 0 else []) for row in ids]
    lengths = np.asarray([len(row) for row in rows], "int32")
    prompt = np.zeros((len(rows), int(lengths.max())), "int32")
    for index, row in enumerate(rows):
        prompt[index, : len(row)] = row
    total = int(lengths.max()) + new_tokens

    def stats(prompt, lengths):
        return model._speculative_ids(
            prompt, total, GreedySampler(), lengths, END_ID, None, assistant, k,
            stop=total, return_stats=True,
        )[1]  # fmt: skip

    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        stats = tf.function(stats)
    counts = stats(prompt, lengths)
    calls = np.asarray(counts["row_calls"], "float64")
    new = np.asarray(counts["new_tokens"], "float64")
    return float(np.sum(new - calls) / (k * np.sum(calls)))


def language_model_rows(run, count, new_tokens, rounds, k) -> list[dict]:
    model, _ = load(run)
    prompts = lm_prompts(count)
    # Each method's acceptance over all the prompts: the same at any batch.
    acceptance = {
        name: acceptance_rate(
            model,
            model.assistant_model if name == "draft" else assistant,
            prompts,
            new_tokens,
            k,
        )
        for name, assistant in LM_METHODS.items()
        if name != "plain"
    }
    rows = []
    for batch in (1, count):
        calls = {
            name: lambda assistant=assistant, batch=batch: model.generate(
                prompts, new_tokens, assistant_model=assistant, batch_size=batch,
                num_speculative_tokens=k, verbose=0,
            )
            for name, assistant in LM_METHODS.items()
        }  # fmt: skip
        seconds, texts = timed_rounds(calls, rounds)
        for name in LM_METHODS:
            tokens = sum(
                len(model.preprocessor.tokenizer.tokenize(text)) for text in texts[name]
            )
            rows.append(
                {
                    "task": "language_model",
                    "batch": batch,
                    "method": name,
                    "seconds": seconds[name],
                    "new_tokens": tokens,
                    "tokens_per_second": tokens / seconds[name],
                    "speedup": seconds["plain"] / seconds[name],
                    "same_as_plain": texts[name] == texts["plain"],
                    "acceptance_rate": acceptance.get(name),
                }
            )
    return rows


def translator_rows(run, count, rounds, k) -> list[dict]:
    from keras_attn.datasets import load_translation_pairs

    model, config = load(run)
    pairs = load_translation_pairs(
        "de-en", alternatives=config.get("alternatives"), verbose=False
    ).test
    sources = [source for source, _ in pairs[:count]]
    greedy = {"beam_width": 1, "length_penalty": 0.0, "verbose": 0}
    rows = []
    for batch in (1, count):
        calls = {
            name: lambda assistant=assistant, batch=batch: model.translate(
                sources, assistant_model=assistant, batch_size=batch,
                num_speculative_tokens=k, **greedy,
            )
            for name, assistant in TRANSLATOR_METHODS.items()
        }  # fmt: skip
        seconds, texts = timed_rounds(calls, rounds)
        for name in TRANSLATOR_METHODS:
            rows.append(
                {
                    "task": "translator",
                    "batch": batch,
                    "method": name,
                    "seconds": seconds[name],
                    "sentences_per_second": count / seconds[name],
                    "speedup": seconds["plain"] / seconds[name],
                    "same_as_plain": texts[name] == texts["plain"],
                }
            )
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--language-model-run", type=Path)
    parser.add_argument("--translator-run", type=Path)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--jit-compile", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    global JIT_COMPILE
    JIT_COMPILE = args.jit_compile
    if args.language_model_run is None and args.translator_run is None:
        parser.error("give --language-model-run, --translator-run or both")
    info = machine()
    flags = [name for name, present in info.items() if present is True]
    print(f"CPU: {info['cpu']} ({info['cpus']} cores); {' '.join(flags)}")
    print(f"backend: {keras.backend.backend()}; jit_compile: {args.jit_compile}")
    rows = []
    if args.language_model_run is not None:
        rows += language_model_rows(
            args.language_model_run, args.prompts, args.new_tokens, args.rounds,
            args.num_speculative_tokens,
        )  # fmt: skip
    if args.translator_run is not None:
        rows += translator_rows(
            args.translator_run, args.prompts, args.rounds, args.num_speculative_tokens
        )
    print(
        "| task | batch | method | seconds | per second | speed-up | same as plain "
        "| acceptance |\n|---|---:|---|---:|---:|---:|---|---:|"
    )
    for row in rows:
        rate = row.get("tokens_per_second", row.get("sentences_per_second"))
        accepted = row.get("acceptance_rate")
        print(
            f"| {row['task']} | {row['batch']} | {row['method']} | "
            f"{row['seconds']:.3f} | {rate:.1f} | {row['speedup']:.2f} | "
            f"{row['same_as_plain']} | "
            f"{'' if accepted is None else f'{accepted:.2f}'} |"
        )
    if args.json:
        found = {"machine": info, "jit_compile": args.jit_compile, "rows": rows}
        args.json.write_text(json.dumps(found, indent=2))
    return rows


if __name__ == "__main__":
    main()
