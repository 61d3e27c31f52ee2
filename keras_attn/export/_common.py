"""What the exporter and the tasks' serving functions share: TF Serving's
directory layout, input cleaning, metadata and sample requests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

METADATA_FILE = "keras_attn.json"
TEXT_SPEC = tf.TensorSpec([None], tf.string, name="text")
SAMPLE_TEXTS = (
    "A gripping, beautifully acted film.",
    "",
    "   ",
    "The plot is dull and the jokes fall flat!",
)


def next_version_dir(base_dir, model_name: str, version: int | None) -> Path:
    """`<base>/<model_name>/<version>`: TF Serving's layout.

    `version=None` takes the next integer after the versions already there
    (TF Serving serves the highest). An existing version is never overwritten.
    """
    model_dir = Path(base_dir) / model_name
    if version is None:
        existing = [int(p.name) for p in model_dir.glob("*") if p.name.isdigit()]
        version = max(existing, default=0) + 1
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(
            f"`version` must be a positive int. Received: version={version!r}"
        )
    path = model_dir / str(version)
    if path.exists():
        raise ValueError(
            f"{path} exists already; TF Serving versions are immutable. "
            f"Received: version={version}"
        )
    return path


def clean_text(text, max_chars: int):
    """Strings safe to tokenize: invalid UTF-8 replaced by U+FFFD, at most
    `max_chars` characters (longer inputs are truncated, never rejected).

    `text` must be a vector (`[batch]`), checked when the graph runs: TF
    Serving feeds a request's tensor whatever its shape (a REST body of
    `[["a", "b"]]` is `[1, 2]`, `{"inputs": "a"}` a scalar), which the
    tokenizers would flatten into an answer of another batch size; such a
    request is refused (INVALID_ARGUMENT, HTTP 400)."""
    text = tf.ensure_shape(text, [None])
    text = tf.strings.unicode_transcode(
        text, "UTF-8", "UTF-8", errors="replace", replacement_char=0xFFFD
    )
    return tf.strings.substr(text, 0, max_chars, unit="UTF8_CHAR")


def valid_utf8(text):
    """Strings out, valid UTF-8: a byte sequence that is not (a byte-level
    vocabulary's tokens can decode to one) replaced by U+FFFD, as the eager
    task methods decode their text."""
    return tf.strings.unicode_transcode(
        text, "UTF-8", "UTF-8", errors="replace", replacement_char=0xFFFD
    )


def write_export(
    archive, path: Path, metadata: dict, assets: dict | None = None
) -> Path:
    """Write a `keras.export.ExportArchive` at `path`, with metadata and
    `assets` (`{file name: write(path)}`, written under `assets/`).

    The archive (rather than a bare `tf.Module` holding the Keras model) keeps
    the variables loadable by TF Serving's TF1-style C++ loader. Written to a
    temporary sibling first and renamed, so TF Serving (which polls the model
    directory) never sees a half-written version.

    Next to the SavedModel it writes what a TF Serving operator uses: the
    task's batching parameters (`batching_params.pbtxt`, read with
    `--enable_batching --enable_per_model_batching_parameters`) and the
    warmup requests (`assets.extra/tf_serving_warmup_requests`: each
    signature at each batch size the graph runs on under that batching),
    recorded under `serving` in the metadata with the TensorFlow and
    TensorFlow Text versions the export was written with and the TF Serving
    image that matches them.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.parent / f".{path.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        _track_variables_once(archive)
        archive.write_out(str(partial), verbose=False)
        extra = partial / "assets.extra"
        extra.mkdir(exist_ok=True)
        metadata = {**metadata, "serving": _write_serving_files(partial, metadata)}
        (extra / METADATA_FILE).write_text(
            json.dumps(metadata, indent=2, sort_keys=True, default=_jsonable) + "\n"
        )
        for name, write in (assets or {}).items():
            (partial / "assets").mkdir(exist_ok=True)
            write(partial / "assets" / name)
        partial.rename(path)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return path


def _write_serving_files(version_dir: Path, metadata: dict) -> dict:
    """Batching parameters and warmup requests for `metadata["task"]`;
    returns what the metadata records of them."""
    from keras_attn.export.batching import BATCHING_PARAMS_FILE, task_batching
    from keras_attn.export.releases import release_for_tensorflow
    from keras_attn.export.warmup import WARMUP_FILE, warmup_logs, write_warmup

    batching = task_batching(metadata["task"])
    (version_dir / BATCHING_PARAMS_FILE).write_text(batching.to_text())
    logs = warmup_logs(
        metadata["model_name"], metadata["samples"], batching.execution_batch_sizes
    )
    write_warmup(version_dir / "assets.extra" / WARMUP_FILE, logs)
    release = release_for_tensorflow(tf.__version__)
    return {
        "tensorflow": tf.__version__,
        "tensorflow_text": _tensorflow_text_version(),
        "docker_image": release.docker_image,
        "batching_parameters": BATCHING_PARAMS_FILE,
        "warmup_requests": {
            "file": f"assets.extra/{WARMUP_FILE}",
            "records": len(logs),
            "batch_sizes": list(batching.execution_batch_sizes),
        },
    }


def _tensorflow_text_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("tensorflow-text")
    except metadata.PackageNotFoundError:
        return None


def _track_variables_once(archive) -> None:
    """Make the archive save each variable once, not twice.

    `ExportArchive.track(model)` lists the model's Keras variables, and
    writing the archive adds the `tf.Variable`s its endpoints use; on the
    TensorFlow backend a Keras variable saves its `tf.Variable`'s value as a
    checkpoint entry of its own, so every weight was written twice (Keras
    3.15: a 22.7M-parameter classifier exported 173 MB of variables instead
    of 87 MB). Tracking the `tf.Variable`s themselves leaves one object per
    weight.
    """
    trackable = archive._tf_trackable
    for name in ("variables", "trainable_variables", "non_trainable_variables"):
        tracked = [
            variable.value if isinstance(variable, keras.Variable) else variable
            for variable in getattr(trackable, name)
        ]
        setattr(trackable, name, tracked)


def read_metadata(path) -> dict:
    return json.loads((Path(path) / "assets.extra" / METADATA_FILE).read_text())


def run_samples(signatures: dict, samples: dict) -> dict:
    """`{signature: {output: list}}` for the sample inputs, as plain JSON."""
    from keras_attn.export._predict import request_array

    results = {}
    for name, inputs in samples.items():
        outputs = signatures[name](
            **{k: tf.constant(request_array(v)) for k, v in inputs.items()}
        )
        results[name] = {k: _jsonable(v.numpy()) for k, v in outputs.items()}
    return results


def _jsonable(value):
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "SO":
            return np.vectorize(
                lambda b: b.decode("utf-8", "replace"), otypes=[object]
            )(value).tolist()
        return value.tolist()
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, (np.generic,)):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value)}")
