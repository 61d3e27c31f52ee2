"""Prepare the folder that `benchmarks/gpu_check.py` needs on an offline GPU machine.

The GPU machines this project can borrow have Python 3.12, JAX with CUDA,
sentencepiece and sacrebleu, but no Keras, no TensorFlow and no network. Run
this on a machine that has the project installed (`make gpu-check-bundle`):

- `wheels/`: Keras, keras-hub and the small packages Keras needs that such a
  machine lacks (`namex`, `optree`), for CPython 3.12 on manylinux x86-64, at
  the versions installed here (keras-hub is installed there with `--no-deps`:
  the check uses its layers only, not its tokenizers).
- `data/`: the Ding English-German pairs of the fixed split, tokenized here
  with one shared SentencePiece vocabulary (`en_de.model`, trained on the
  training split) into `pairs.npz`, and the test split's source and reference
  texts. The Ding dictionary is GPL-2+: the folder is ignored by git and must
  never be committed.

    .venv/bin/python benchmarks/gpu_check_bundle.py [--out .gpu_bundle]

Then, on the GPU machine, from the repository root (docs/GPU_CHECK.md):

    python3 -m pip install --no-index --no-deps --target /tmp/site \\
        .gpu_bundle/wheels/*.whl
    PYTHONPATH=/tmp/site:. KERAS_BACKEND=jax python3 benchmarks/gpu_check.py \\
        --data .gpu_bundle/data --out gpu_check.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# What the GPU machine lacks, at the versions this project is tested with.
WHEELS = ("keras", "keras-hub", "namex", "optree")
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
)
PAD_ID, START_ID, END_ID = 0, 2, 3
MAX_LENGTH = 40  # tokens per side, as examples/translate.py
VOCABULARY_SIZE = 8000


def download_wheels(folder: Path, python_version: str = "3.12") -> list[str]:
    """Download the wheels of `WHEELS` at the installed versions into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    requirements = [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS]
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        python_version,
        "--implementation",
        "cp",
        *[arg for platform in PLATFORMS for arg in ("--platform", platform)],
        "-d",
        str(folder),
        *requirements,
    ]
    subprocess.run(command, check=True)
    return requirements


def encode_pairs(pairs, processor, max_length: int = MAX_LENGTH):
    """`(encoder_inputs, decoder_inputs, decoder_targets)` int16 arrays.

    The layout of `keras_attn.text.translation_dataset`: the source truncated
    to `max_length`; `[START] target [END]` cut to `max_length + 1` tokens,
    the decoder reading all but the last and predicting all but the first;
    padded with `PAD_ID`.
    """
    count = len(pairs)
    encoder = np.full((count, max_length), PAD_ID, dtype="int16")
    decoder = np.full((count, max_length), PAD_ID, dtype="int16")
    targets = np.full((count, max_length), PAD_ID, dtype="int16")
    for row, (source, target) in enumerate(pairs):
        source_ids = processor.encode(source)[:max_length]
        encoder[row, : len(source_ids)] = source_ids
        target_ids = ([START_ID, *processor.encode(target), END_ID])[: max_length + 1]
        decoder[row, : len(target_ids) - 1] = target_ids[:-1]
        targets[row, : len(target_ids) - 1] = target_ids[1:]
    return encoder, decoder, targets


def prepare_data(
    folder: Path,
    pairs_path: str | None = None,
    vocabulary_size: int = VOCABULARY_SIZE,
) -> dict:
    """Tokenize the fixed split of the Ding pairs (or of `pairs_path`) into `folder`."""
    import sentencepiece

    from keras_attn.datasets import load_translation_pairs
    from keras_attn.text import train_subword_vocabulary

    folder.mkdir(parents=True, exist_ok=True)
    splits = (
        load_translation_pairs(path=pairs_path)
        if pairs_path
        else load_translation_pairs("de-en", alternatives="keep")
    )
    model_path = train_subword_vocabulary(
        [text for pair in splits.train for text in pair],
        folder / "en_de.model",
        vocabulary_size=vocabulary_size,
    )
    processor = sentencepiece.SentencePieceProcessor(model_file=str(model_path))
    arrays = {}
    for name, pairs in (
        ("train", splits.train),
        ("validation", splits.validation),
        ("test", splits.test),
    ):
        encoder, decoder, targets = encode_pairs(list(pairs), processor)
        arrays[f"{name}_encoder_inputs"] = encoder
        arrays[f"{name}_decoder_inputs"] = decoder
        arrays[f"{name}_decoder_targets"] = targets
    arrays["test_sources"] = np.array([source for source, _ in splits.test])
    arrays["test_references"] = np.array([target for _, target in splits.test])
    np.savez_compressed(folder / "pairs.npz", **arrays)
    (folder / "LICENSE-DATA.txt").write_text(
        "pairs.npz holds text of the Ding German-English dictionary (Frank "
        "Richter, TU Chemnitz), GPL-2+, from Debian's trans-de-en package.\n"
        "Do not commit this folder.\n",
        encoding="utf-8",
    )
    return {
        "train": len(splits.train),
        "validation": len(splits.validation),
        "test": len(splits.test),
        "vocabulary_size": processor.get_piece_size(),
        "max_length": MAX_LENGTH,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".gpu_bundle", help="the bundle folder")
    parser.add_argument(
        "--data-file",
        default=None,
        help="english<TAB>german pairs instead of the Ding pairs",
    )
    parser.add_argument(
        "--vocabulary-size",
        type=int,
        default=VOCABULARY_SIZE,
        help="SentencePiece pieces (small for a small --data-file)",
    )
    parser.add_argument(
        "--skip-wheels", action="store_true", help="prepare the data folder only"
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    manifest = {}
    if not args.skip_wheels:
        manifest["wheels"] = download_wheels(out / "wheels")
    manifest["data"] = prepare_data(out / "data", args.data_file, args.vocabulary_size)
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    size = sum(path.stat().st_size for path in out.rglob("*") if path.is_file())
    print(json.dumps(manifest, indent=2))
    print(f"{out}: {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
