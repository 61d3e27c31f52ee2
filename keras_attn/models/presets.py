"""Presets: a task (or a backbone) as a directory in keras-hub's layout.

`task.save_to_preset(directory)` writes, as keras-hub's `Task.save_to_preset`:

```
config.json          the backbone's config (the encoder's, for a translator)
model.weights.h5     the backbone's weights
task.json            the task's config (its backbones' configs inside)
task.weights.h5      the weights outside `backbone` (the head; a
                     translator's decoder), when there are any
preprocessor.json    the task's preprocessor (`task.preprocessor`: strings ->
                     its inputs), its tokenizers' vocabularies in assets/
tokenizer.json       the tokenizer's config (a translator's source tokenizer;
                     target_tokenizer.json holds its target one), which
                     records no vocabulary
assets/tokenizer/    the tokenizer's assets, its vocabulary file (what its
                     `save_assets` writes: vocabulary.spm, a SentencePiece
                     model, or vocabulary.txt, WordPiece's)
metadata.json        versions, the backbone's parameter count, date
```

`Task.from_preset(directory)` (`TextClassifier.from_preset`,
`keras_attn.models.TransformerTranslator.from_preset`, ...) rebuilds the
task and loads its weights; `TransformerEncoderBackbone.from_preset` and
`TransformerDecoderBackbone.from_preset` load the backbone alone, and
`load_preprocessor(directory)` the preprocessor. A
finished run of the example scripts is such a directory (`RUN/preset/`).
keras-attn's presets are local directories: the library ships no weights
to download. Imports no TensorFlow (the tokenizers do, when a preset holds
them).
"""

from __future__ import annotations

import datetime
import json
import shutil
from pathlib import Path

import keras

from keras_attn.models.quantization import rebased_policy_map

CONFIG_FILE = "config.json"
MODEL_WEIGHTS_FILE = "model.weights.h5"
TASK_CONFIG_FILE = "task.json"
TASK_WEIGHTS_FILE = "task.weights.h5"
PREPROCESSOR_CONFIG_FILE = "preprocessor.json"
METADATA_FILE = "metadata.json"
ASSET_DIR = "assets"
# The config keys (and attributes) of a task's tokenizers -> their files in
# the preset; each tokenizer's assets go to `assets/<file name's stem>/`.
TOKENIZER_FILES = {
    "tokenizer": "tokenizer.json",
    "source_tokenizer": "tokenizer.json",
    "target_tokenizer": "target_tokenizer.json",
}


def save_to_preset(task, preset_dir) -> Path:
    """Write `task` (a `TextClassifier`, `TransformerTranslator` or
    `TransformerLanguageModel`) to `preset_dir` in keras-hub's preset layout
    (see the module). Returns the directory."""
    directory = Path(preset_dir).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    save_backbone(task.backbone, directory)
    config = keras.saving.serialize_keras_object(task)
    saved = False  # any tokenizer
    for key, file_name in TOKENIZER_FILES.items():
        tokenizer = config["config"].get(key)
        if key in config["config"]:
            config["config"][key] = None  # in its own file
        if tokenizer is not None:
            _write_json(directory / file_name, tokenizer)
            assets = _asset_dir(directory, file_name)
            if assets.exists():
                shutil.rmtree(assets)  # of an earlier tokenizer saved here
            assets.mkdir(parents=True)
            getattr(task, key).save_assets(str(assets))
            saved = True
    preprocessor = directory / PREPROCESSOR_CONFIG_FILE
    if saved:
        found = keras.saving.serialize_keras_object(task.preprocessor)
        _write_json(preprocessor, found)
    elif preprocessor.exists():
        preprocessor.unlink()  # of an earlier task saved here
    _write_json(directory / TASK_CONFIG_FILE, _without_build_state(config))
    weights = directory / TASK_WEIGHTS_FILE
    if _has_task_weights(task):
        keras.saving.save_weights(
            task, weights, objects_to_skip=_not_task_weights(task)
        )
    elif weights.exists():
        weights.unlink()  # of an earlier task saved here
    return directory


def save_backbone(backbone, preset_dir) -> Path:
    """Write a backbone's `config.json`, `model.weights.h5` and
    `metadata.json` to `preset_dir`."""
    directory = Path(preset_dir).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    config = keras.saving.serialize_keras_object(backbone)
    _write_json(directory / CONFIG_FILE, _without_build_state(config))
    backbone.save_weights(directory / MODEL_WEIGHTS_FILE)
    _write_metadata(backbone, directory)
    return directory


BACKBONE_KEYS = ("backbone", "decoder_backbone")


def load_task(cls, preset, load_weights: bool = True, **kwargs):
    """The task of a preset directory, of class `cls` or a subclass.

    Args:
        cls: the class asked for (`TextClassifier`, ...).
        preset: the directory `save_to_preset` wrote.
        load_weights: load the saved weights (else the task starts from
            fresh initial weights).
        **kwargs: config entries to override (`dtype`, `name`, `dropout`...).
    """
    directory = _preset_dir(preset)
    config = _read_json(directory, TASK_CONFIG_FILE)
    _check_class(config, cls, preset, "The preset holds")
    inner = dict(config["config"])
    for key, file_name in TOKENIZER_FILES.items():
        if key in inner and (directory / file_name).exists():
            inner[key] = _read_tokenizer(directory, file_name)
    dtype = kwargs.pop("dtype", None)
    inner.update(kwargs)
    if dtype is not None:
        # As keras-hub's `Task.from_preset`: the policy is the backbones'
        # (the task takes theirs); a config from before the backbones
        # builds them from the task's own arguments. A quantized task's
        # maps keep their quantized layers, under `dtype`.
        nested = [key for key in BACKBONE_KEYS if isinstance(inner.get(key), dict)]
        for key in nested:
            found = inner[key]["config"].get("dtype")
            inner[key] = {
                **inner[key],
                "config": {**inner[key]["config"], "dtype": _under(found, dtype)},
            }
        if not nested or "dtype" in inner:
            inner["dtype"] = _under(inner.get("dtype"), dtype)
    task = keras.saving.deserialize_keras_object({**config, "config": inner})
    if load_weights:
        task.backbone.load_weights(directory / MODEL_WEIGHTS_FILE)
        if _has_task_weights(task):
            keras.saving.load_weights(
                task,
                directory / TASK_WEIGHTS_FILE,
                objects_to_skip=_not_task_weights(task),
            )
    return task


def _under(found, dtype):
    """`dtype` for a config's `dtype` entry that was `found`: a quantized
    model's `DTypePolicyMap` (serialized) keeps its quantized layers'
    entries, under `dtype` as its default policy."""
    if isinstance(found, dict):
        policy = keras.dtype_policies.get(found)
        if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
            return keras.dtype_policies.serialize(rebased_policy_map(policy, dtype))
    return dtype


def load_backbone(cls, preset, load_weights: bool = True, **kwargs):
    """The backbone of a preset directory (a task's or a backbone's), of
    class `cls` or a subclass; `kwargs` override config entries."""
    directory = _preset_dir(preset)
    config = _read_json(directory, CONFIG_FILE)
    _check_class(config, cls, preset, "The preset's backbone is")
    if kwargs.get("dtype") is not None:
        kwargs["dtype"] = _under(config["config"].get("dtype"), kwargs["dtype"])
    config = {**config, "config": {**config["config"], **kwargs}}
    backbone = keras.saving.deserialize_keras_object(config)
    if load_weights:
        backbone.load_weights(directory / MODEL_WEIGHTS_FILE)
    return backbone


def _check_class(config: dict, cls, preset, holds: str) -> None:
    """A `ValueError` unless the serialized `config` is of `cls` or a subclass."""
    found = keras.saving.get_registered_object(config.get("registered_name"))
    if found is None or not issubclass(found, cls):
        raise ValueError(
            f"{holds} a {config.get('class_name')!r}, not a {cls.__name__}. "
            f"Received: preset={str(preset)!r}"
        )


def _preset_dir(preset) -> Path:
    directory = Path(preset).expanduser()
    if not directory.is_dir():
        raise ValueError(
            "`preset` must be the directory of a preset (what `save_to_preset` "
            "writes; keras-attn ships no presets to download). Received: "
            f"preset={str(preset)!r}"
        )
    return directory


def _not_task_weights(task) -> list:
    """What `task.weights.h5` leaves out: the backbone (in
    `model.weights.h5`) and the optimizer's state (a preset holds weights)."""
    skipped = list(task.backbone._flatten_layers())
    if getattr(task, "optimizer", None) is not None:
        skipped.append(task.optimizer)
    return skipped


def _has_task_weights(task) -> bool:
    """Whether `task.weights.h5` holds anything: weights outside the
    backbone, or a language model's draft (`assistant_model`, not among
    the task's weights but saved with them)."""
    if isinstance(getattr(task, "assistant_model", None), keras.Model):
        return True
    backbone = {id(weight) for weight in task.backbone.weights}
    return any(id(weight) not in backbone for weight in task.weights)


def load_preprocessor(preset):
    """The preprocessor of a task's preset directory (its
    `preprocessor.json`, the vocabularies from `assets/`): a Keras layer
    from strings to the task's inputs."""
    directory = _preset_dir(preset)
    config = _read_json(directory, PREPROCESSOR_CONFIG_FILE)
    import keras_attn.text  # noqa: F401  registers the preprocessor classes

    preprocessor = keras.saving.deserialize_keras_object(config)
    for key, file_name in TOKENIZER_FILES.items():
        if isinstance(config["config"].get(key), dict):
            getattr(preprocessor, key).load_assets(
                str(_asset_dir(directory, file_name))
            )
    return preprocessor


def _read_tokenizer(directory: Path, file_name: str):
    """A tokenizer of the preset: its config, then its assets (its
    vocabulary) through its `load_assets`."""
    import keras_attn.text  # noqa: F401  registers the tokenizer classes

    config = _read_json(directory, file_name)
    tokenizer = keras.saving.deserialize_keras_object(config)
    tokenizer.load_assets(str(_asset_dir(directory, file_name)))
    return tokenizer


def _asset_dir(directory: Path, file_name: str) -> Path:
    """Where the tokenizer of `file_name` keeps its assets (keras-hub's
    layout: `assets/tokenizer/` for `tokenizer.json`)."""
    return directory / ASSET_DIR / file_name.split(".")[0]


def _write_metadata(model, directory: Path) -> None:
    from keras_attn import __version__

    _write_json(
        directory / METADATA_FILE,
        {
            "keras_version": keras.version(),
            "keras_attn_version": __version__,
            "parameter_count": model.count_params(),
            "date_saved": datetime.datetime.now().strftime("%Y-%m-%d@%H:%M:%S"),
        },
    )


def _without_build_state(config):
    """`config` without its `compile_config` and `build_config` entries, at
    any depth (as keras-hub's preset saver writes configs)."""
    if isinstance(config, dict):
        return {
            key: _without_build_state(value)
            for key, value in config.items()
            if key not in ("compile_config", "build_config")
        }
    if isinstance(config, list):
        return [_without_build_state(value) for value in config]
    return config


def _write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value, indent=4) + "\n")


def _read_json(directory: Path, file_name: str) -> dict:
    path = directory / file_name
    if not path.exists():
        raise ValueError(
            f"`preset` has no {file_name}: not a directory `save_to_preset` "
            f"wrote. Received: preset={str(directory)!r}"
        )
    return json.loads(path.read_text())
