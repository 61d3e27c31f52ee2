"""The one exporter: each task says what it serves, `export_task` writes it.

A task model (`TextClassifier`, `TextClassifierEnsemble`, `RNNTranslator`,
`TransformerTranslator`, `TransformerLanguageModel`) describes its TF Serving
export with `serving_spec(**options)`: a `ServingSpec` holding its serving
functions with their input signatures (`Endpoint`s), the objects they use,
a sample request per signature, the task's name (which picks its batching
parameters and warmup requests) and its metadata. `export_task` builds the
`keras.export.ExportArchive` from it, runs the samples and writes TF
Serving's layout (`_common.write_export`). `export_translator`,
`export_sentiment`, `export_language_model` and the tasks' `export` methods
are this exporter with each task's options.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import keras

from keras_attn.export._common import next_version_dir, run_samples, write_export
from keras_attn.export.batching import TASK_BATCHING
from keras_attn.models.precision import check_precision, with_precision
from keras_attn.models.quantization import plain_policy
from keras_attn.ops.serving import serving_mode

# Metadata entries the exporter writes itself (`write_export` adds `serving`).
EXPORTER_METADATA = (
    "task",
    "model_name",
    "version",
    "precision",
    "signatures",
    "samples",
    "sample_outputs",
    "serving",
)


@dataclass(frozen=True)
class Endpoint:
    """One signature of an export.

    Attributes:
        function: the signature's function: string tensors in, a dict of
            tensors out (traced once by `ExportArchive.add_endpoint`).
        input_signature: its `tf.TensorSpec`s, one per argument, each named
            as the signature's input.
        inputs, outputs: `{name: "dtype [shape]"}`: what the metadata records
            of the signature.
        samples: `{input: list of texts (or ints: a seed)}`: the sample
            request, run at export (the outputs are recorded for
            `check_servable` to compare with) and written as the server's
            warmup requests.
    """

    function: Callable
    input_signature: list
    inputs: dict
    outputs: dict
    samples: dict

    def __post_init__(self):
        object.__setattr__(self, "input_signature", list(self.input_signature))
        names = [spec.name for spec in self.input_signature]
        if sorted(names) != sorted(self.inputs) or sorted(names) != sorted(
            self.samples
        ):
            raise ValueError(
                "An endpoint's `input_signature`, `inputs` and `samples` must "
                f"name the same inputs. Received: input_signature names {names}, "
                f"inputs={sorted(self.inputs)}, samples={sorted(self.samples)}"
            )


@dataclass(frozen=True)
class ServingSpec:
    """What a task serves: what its `serving_spec(**options)` returns.

    Attributes:
        task: the task's name, which picks the batching parameters and the
            warmup batch sizes (`keras_attn.export.batching.TASK_BATCHING`:
            `"sentiment"`, `"translation"`, `"language_model"`).
        model_name: the model directory's default name under the base
            directory.
        endpoints: `{signature name: Endpoint}`, `"serving_default"` among
            them; in this order in the metadata and the warmup requests.
        resources: what the endpoints use besides the task (the serving
            tokenizers, a datastore's weights), tracked by the archive.
        metadata: the task's entries of `assets.extra/keras_attn.json` (its
            options and what its outputs are); the exporter adds those of
            `EXPORTER_METADATA`.
        assets: `{file name: write(path)}`: files the export holds under
            `assets/` for reference (a tokenizer's vocabulary).
    """

    task: str
    model_name: str
    endpoints: dict
    resources: tuple = ()
    metadata: dict = field(default_factory=dict)
    assets: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.task not in TASK_BATCHING:
            raise ValueError(
                f"`task` must be one of {sorted(TASK_BATCHING)}. "
                f"Received: task={self.task!r}"
            )
        if "serving_default" not in self.endpoints or not all(
            isinstance(endpoint, Endpoint) for endpoint in self.endpoints.values()
        ):
            raise ValueError(
                "`endpoints` must map signature names, `serving_default` among "
                f"them, to `Endpoint`s. Received: endpoints={self.endpoints!r}"
            )
        reserved = sorted(set(self.metadata) & set(EXPORTER_METADATA))
        if reserved:
            raise ValueError(
                f"`metadata` must leave {list(EXPORTER_METADATA)} to the exporter. "
                f"Received: metadata with {reserved}"
            )
        object.__setattr__(self, "resources", tuple(self.resources))

    def signatures_metadata(self) -> dict:
        """`{signature: {"inputs": ..., "outputs": ...}}`, as recorded."""
        return {
            name: {"inputs": dict(endpoint.inputs), "outputs": dict(endpoint.outputs)}
            for name, endpoint in self.endpoints.items()
        }

    def samples(self) -> dict:
        """`{signature: {input: list of texts}}`: the sample requests."""
        return {
            name: {key: list(texts) for key, texts in endpoint.samples.items()}
            for name, endpoint in self.endpoints.items()
        }


def export_task(
    task, base_dir, model_name: str | None = None, version: int | None = None, **options
) -> Path:
    """Export a task model for TF Serving, as its `serving_spec(**options)`
    describes it.

    Writes `<base_dir>/<model_name>/<version>/` (TF Serving's layout;
    `model_name` defaults to the task's: `"sentiment"`, `"translator"`,
    `"language_model"`; `version=None` takes the next integer, an existing
    version is never overwritten): the SavedModel with one signature per
    endpoint of the spec, the batching parameters and warmup requests of
    the spec's task, and `assets.extra/keras_attn.json` with the spec's
    metadata, the signatures, and the sample requests with their outputs
    computed here (which `check_servable` compares against).

    Args:
        task: a `keras_attn.models` task: `TextClassifier`,
            `TextClassifierEnsemble`, `RNNTranslator`, `TransformerTranslator`
            or `TransformerLanguageModel`, with its tokenizer(s).
        base_dir: the directory holding the model directories.
        model_name: the model directory's name (default: the task's).
        version: the version to write (default: the next one).
        **options: the task's export options, those of its `export` method
            (a translator's `max_length`, `beam_width`, ...), and
            `precision`, every task's: None (default) exports the task as
            it is; `"float32"`, `"bfloat16"`, `"int8"` or `"int4"` exports
            `keras_attn.models.precision.with_precision(task, precision)`
            (a copy: the task is unchanged). The metadata records it.

    Returns:
        The version directory.
    """
    return export_with_options(task, base_dir, model_name, version, options)


def export_with_options(
    task,
    base_dir,
    model_name,
    version,
    options: dict,
    argument: str = "task",
    expected_task: str | None = None,
) -> Path:
    """`export_task` with the task's options as a dict; `export_translator`
    & co. name their argument and the task they export (`expected_task`),
    which a task of another kind is refused for."""
    options = dict(options)
    precision = check_precision(options.pop("precision", None))
    if precision is not None:
        task = with_precision(task, precision)
        if isinstance(options.get("assistant_model"), keras.Model):
            options["assistant_model"] = with_precision(
                options["assistant_model"], precision
            )
    spec = serving_spec(task, options, argument, expected_task)
    if expected_task is not None and spec.task != expected_task:
        raise ValueError(
            f"`{argument}` must be a {expected_task} task (`export_task` exports "
            f"any task). Received: {argument} of type {type(task).__name__}, "
            f"a {spec.task} task"
        )
    model_name = model_name or spec.model_name
    path = next_version_dir(base_dir, model_name, version)
    # Every trace of the signatures (here and in `tf.saved_model.save`) is
    # of an inference graph: TensorFlow's serving layouts.
    with serving_mode():
        return _write_endpoints(task, spec, path, model_name, precision)


def _write_endpoints(task, spec, path, model_name, precision) -> Path:
    """`export_with_options`' archive of `spec`'s endpoints, sample outputs
    and metadata, written to `path`."""
    archive = keras.export.ExportArchive()
    archive.track(task)
    for resource in spec.resources:
        archive.track(resource)
    signatures = {
        name: archive.add_endpoint(
            name, endpoint.function, input_signature=endpoint.input_signature
        )
        for name, endpoint in spec.endpoints.items()
    }
    samples = spec.samples()
    metadata = {
        "task": spec.task,
        "model_name": model_name,
        "version": int(path.name),
        "precision": precision or _precision_of(task),
        **spec.metadata,
        "signatures": spec.signatures_metadata(),
        "samples": samples,
        "sample_outputs": run_samples(signatures, samples),
    }
    return write_export(archive, path, metadata, spec.assets)


def serving_spec(
    task,
    options: dict | None = None,
    argument: str = "task",
    expected_task: str | None = None,
):
    """`task.serving_spec(**options)`, checked: a `ValueError` naming
    `argument` for a model that is not a task and for an option the task
    does not take (with `expected_task`, the task the options are those of:
    a task of another kind)."""
    describe = getattr(task, "serving_spec", None)
    if not callable(describe):
        raise ValueError(
            f"`{argument}` must be a keras_attn task (TextClassifier, "
            "TextClassifierEnsemble, RNNTranslator, TransformerTranslator or "
            "TransformerLanguageModel), whose `serving_spec()` says what it "
            f"serves. Received: {argument} of type {type(task).__name__}"
        )
    options = dict(options or {})
    parameters = inspect.signature(describe).parameters
    unknown = sorted(set(options) - set(parameters))
    if unknown and not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        if expected_task is not None:
            raise ValueError(
                f"`{argument}` must be a {expected_task} task, whose export takes "
                f"the options {list(options)}. Received: {argument} of type "
                f"{type(task).__name__}, whose export takes {list(parameters)}"
            )
        raise ValueError(
            f"{type(task).__name__}'s export takes the options "
            f"{list(parameters)}. Received: "
            + ", ".join(f"{name}={options[name]!r}" for name in unknown)
        )
    spec = describe(**options)
    if not isinstance(spec, ServingSpec):
        raise ValueError(
            f"`{argument}.serving_spec()` must return a "
            "keras_attn.export.ServingSpec. Received: "
            f"{type(spec).__name__} from {type(task).__name__}"
        )
    return spec


def _precision_of(task) -> str:
    """What the metadata records of a task exported as it is: `"int8"` or
    `"int4"` once quantized, else its policy's name (`"float32"`,
    `"mixed_bfloat16"`, ...)."""
    modes = {layer.quantization_mode for layer in task._flatten_layers()} - {None}
    if modes:
        return "+".join(sorted(modes))
    return plain_policy(task.dtype_policy).name
