"""Streamed generation: time to the first piece against one prompt pass.

`TransformerLanguageModel.stream` prefills the prompt and decodes the first
new token in one compiled call before its first piece; the issue's goal
(issue 47) is that piece within 1.2x of one prompt pass (the model's forward
pass over the prompt, compiled: what any answer costs at least). The model is
the language model script's default size (`configs.config("language_model",
"small")`: 4 blocks of 128, 128 positions) with random weights and a
SentencePiece vocabulary of the fixture play; the prompt fills half the
context. Also timed: the whole stream against `generate` of the same tokens
(the cost of decoding in chunks called from Python), for a few `chunk_size`s.

Each figure is the median of `--rounds` alternating rounds after warm-up (the
compiled functions built first), in this one process.

    .venv/bin/python benchmarks/streaming_bench.py [--rounds 15] [--json out.json]

`--quick`: a one-block model, few rounds (a smoke test of the script).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
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

from keras_attn.models import TransformerLanguageModel, _task, configs  # noqa: E402
from keras_attn.text import SubwordTokenizer, train_subword_vocabulary  # noqa: E402

PLAY = ROOT / "tests" / "fixtures" / "play_sample.txt"


def build(quick: bool):
    text = PLAY.read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if line.strip()]
    vocabulary = train_subword_vocabulary(
        lines,
        Path(tempfile.mkdtemp()) / "play.model",
        vocabulary_size=600 if quick else 1000,
    )
    tokenizer = SubwordTokenizer(vocabulary)
    sizes = dict(configs.config("language_model", "small")["model"])
    if quick:
        sizes.update(num_layers=1, embedding_dim=32, num_heads=2, intermediate_dim=64)
    model = TransformerLanguageModel(
        tokenizer.vocabulary_size, tokenizer=tokenizer, **sizes
    )
    # A prompt of about half the context.
    words = text.split()
    prompt = " ".join(words[:10])
    half = sizes["sequence_length"] // 2
    while len(tokenizer.tokenize([prompt]).to_list()[0]) < half:
        prompt = " ".join(words[: len(prompt.split()) + 5])
    return model, tokenizer, prompt


def median_seconds(fn, rounds: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    rounds = 3 if args.quick else args.rounds
    model, tokenizer, prompt = build(args.quick)
    prompt_ids = tokenizer.tokenize([prompt]).to_list()[0]
    width = _task.bucket_length(len(prompt_ids) + 1)
    ids = np.zeros((1, width), "int32")
    ids[0, : len(prompt_ids) + 1] = [2, *prompt_ids]  # the start token first
    forward = _task.compiled_forward(model, width)
    new = args.new_tokens

    def prompt_pass():
        forward(ids)

    def first_piece(chunk_size):
        pieces = model.stream(prompt, max_new_tokens=new, chunk_size=chunk_size)
        next(iter(pieces))
        pieces.close()

    def whole_stream(chunk_size):
        return "".join(model.stream(prompt, max_new_tokens=new, chunk_size=chunk_size))

    def generate():
        return model.generate(prompt, max_new_tokens=new)[0]

    # Every decoding the same text (a check, not a figure).
    text = generate()
    chunks = (1, 8, 32)
    for chunk_size in chunks:
        assert whole_stream(chunk_size) == text, chunk_size
    results = {
        "backend": keras.backend.backend(),
        "machine": machine(),
        "model": {
            "prompt_tokens": len(prompt_ids),
            "prompt_width": width,
            "new_tokens": new,
            "vocabulary_size": tokenizer.vocabulary_size,
            "num_layers": model.num_layers,
            "embedding_dim": model.embedding_dim,
            "sequence_length": model.sequence_length,
        },
        "rounds": rounds,
        "prompt_pass_ms": 1000 * median_seconds(prompt_pass, rounds),
        "first_piece_ms": 1000 * median_seconds(lambda: first_piece(8), rounds),
        "generate_ms": 1000 * median_seconds(generate, rounds),
        "stream_ms": {
            str(c): 1000 * median_seconds(lambda c=c: whole_stream(c), rounds)
            for c in chunks
        },
    }
    results["first_piece_over_prompt_pass"] = (
        results["first_piece_ms"] / results["prompt_pass_ms"]
    )
    print(
        f"backend {results['backend']}, {results['machine']['cpu']} "
        f"({results['machine']['cpus']} CPUs); prompt {len(prompt_ids)} tokens, "
        f"{new} new, {model.num_layers} blocks of {model.embedding_dim}"
    )
    print("| measure | ms (median) |")
    print("|---|---|")
    print(f"| one prompt pass (compiled forward) | {results['prompt_pass_ms']:.2f} |")
    print(
        f"| time to the first streamed piece | {results['first_piece_ms']:.2f} "
        f"({results['first_piece_over_prompt_pass']:.2f}x the prompt pass) |"
    )
    print(f"| generate, {new} new tokens | {results['generate_ms']:.2f} |")
    for chunk_size, ms in results["stream_ms"].items():
        print(f"| whole stream, chunk_size={chunk_size} | {ms:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
