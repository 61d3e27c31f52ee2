"""Translation decoding: our batched beam search against the keras.io loop.

The issue's decoding target: batched beam search (width 4) over the KV cache
at least 10 times faster per sentence than the one-token-per-call greedy loop
of keras.io's "English-to-Spanish translation with a sequence-to-sequence
Transformer" (`decode_sequence`). Both are timed here, in one process, on the
same test sentences of the Ding pairs:

- ours: the trained translator of an `examples/translate.py` run (`--run`,
  its `model.keras`, tokenizers and decoding settings from `metrics.json`),
  decoding the sentences in batches of 64 with `beam_search_fn` as the script
  does (width 4, one trace for every batch);
- the recipe: the tutorial's model (`training_bench.recipe_translation`: 15,000
  words, sequences of 20, d_model 256, the recipe's float32) and its loop,
  written as the tutorial writes it: for each sentence, for each new token,
  vectorize the target so far (`TextVectorization`, adapted on the training
  pairs), call the whole model on source and target, take the argmax of the
  step's row. The recipe's weights are untrained here, so it would never
  emit `[end]`: each sentence gets as many steps as its reference has words
  plus one (the `[end]` a trained model would emit), at most the tutorial's
  20. The time of a step does not depend on the weights.

Medians of alternating rounds in one process; ms per sentence and the ratio.

    .venv/bin/python benchmarks/decoding_bench.py --run RUN [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras
import numpy as np

from benchmarks._timing import alternate
from benchmarks.training_bench import recipe_translation
from keras_attn.datasets import load_translation_pairs

RECIPE_VOCABULARY = 15000  # the tutorial's vocab_size
RECIPE_LENGTH = 20  # its sequence_length and max_decoded_sentence_length
BATCH = 64  # sentences per beam-search call, as examples/translate.py


def recipe_decoder(english, german):
    """The tutorial's `decode_sequence` over its model, and its vectorizers
    adapted on `english` / `german` training sentences."""
    source_vectorization = keras.layers.TextVectorization(
        max_tokens=RECIPE_VOCABULARY, output_sequence_length=RECIPE_LENGTH
    )
    target_vectorization = keras.layers.TextVectorization(
        max_tokens=RECIPE_VOCABULARY, output_sequence_length=RECIPE_LENGTH + 1
    )
    source_vectorization.adapt(english)
    target_vectorization.adapt([f"[start] {text} [end]" for text in german])
    vocabulary = target_vectorization.get_vocabulary()
    transformer = recipe_translation(RECIPE_VOCABULARY, RECIPE_LENGTH)

    def decode_sequence(input_sentence, steps):
        tokenized_input_sentence = source_vectorization([input_sentence])
        decoded_sentence = "[start]"
        for i in range(steps):
            tokenized_target_sentence = target_vectorization([decoded_sentence])[:, :-1]
            predictions = transformer(
                {
                    "encoder_inputs": tokenized_input_sentence,
                    "decoder_inputs": tokenized_target_sentence,
                }
            )
            sampled_token_index = int(np.argmax(predictions[0, i, :]))
            decoded_sentence += " " + vocabulary[sampled_token_index]
        return decoded_sentence

    return decode_sequence


def our_decoder(run: Path):
    """Beam search of a translate.py run, batched as the script batches it."""
    metrics = json.loads((run / "metrics.json").read_text())
    config = {**metrics["config"], **metrics["environment"]}
    translator = keras.saving.load_model(run / "model.keras", compile=False)

    def translate(sources):
        return translator.translate(
            sources,
            beam_width=config["beam_width"],
            length_penalty=config["length_penalty"],
            max_length=config["max_length"],
            batch_size=BATCH,
        )

    return translate, config


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--run", default="runs/transformer", help="a translate.py --out"
    )
    parser.add_argument("--sentences", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    run = Path(args.run)
    if not (run / "model.keras").exists():
        parser.error(
            f"--run must be the --out of a finished examples/translate.py run. "
            f"Received: {args.run} (no model.keras there)"
        )

    splits = load_translation_pairs("de-en")
    test = splits.test[: args.sentences]
    sources = [source for source, _ in test]
    steps = [min(RECIPE_LENGTH, len(target.split()) + 1) for _, target in test]
    translate, config = our_decoder(run)
    decode_sequence = recipe_decoder(
        [source for source, _ in splits.train], [target for _, target in splits.train]
    )

    def recipe():
        for sentence, count in zip(sources, steps, strict=True):
            decode_sequence(sentence, count)

    seconds = alternate(
        {"ours": lambda: translate(sources), "recipe": recipe},
        rounds=args.rounds,
        warmup=1,
        inner=1,
    )
    ours_ms = 1000 * seconds["ours"] / len(sources)
    recipe_ms = 1000 * seconds["recipe"] / len(sources)
    print(
        f"{len(sources)} test sentences; recipe steps per sentence: mean "
        f"{np.mean(steps):.1f}; ours: {run} (beam width {config['beam_width']}, "
        f"length penalty {config['length_penalty']}, {config['dtype_policy']})"
    )
    print(f"{'decoding':<44} {'median ms/sentence':>18}")
    print(f"{'keras.io recipe, one token per model call':<44} {recipe_ms:>18.1f}")
    print(f"{'keras_attn batched beam search (width 4)':<44} {ours_ms:>18.1f}")
    print(f"ratio = recipe / ours: {recipe_ms / ours_ms:.1f}")


if __name__ == "__main__":
    main()
