"""`check_servable`: prove that TF Serving can serve an export.

1. Loads the export in a fresh Python in which keras, keras_hub, keras_attn
   and TensorFlow Text's Python package cannot be imported (TF Serving has
   none of them; TensorFlow Text's kernels are loaded from its shared
   libraries, as TF Serving links them), runs every signature on
   the sample inputs recorded at export time and compares with the outputs
   the in-process model gave then. That Python is this one, or with
   `serving_release=` the runtime of a TF Serving release: its TensorFlow
   and its TensorFlow Text (`keras_attn.export.releases`).
2. Loads it as TF Serving's C++ loader does: the TF1 loader with the `serve`
   tag, and answers the same samples as the server answers a Predict call
   (tensor protos fed by input name, after the server's checks:
   `keras_attn.export._predict`);
   reports the export's size and the time this load took.
3. Parses `assets.extra/tf_serving_warmup_requests` as the server does at
   load (at most 1,000 `PredictionLog` records) and replays every request
   through that loader; fails on any error, or on a response whose batch
   size is not the request's.
4. Lists every op in the graph (functions included) and fails on any op that
   is neither a TensorFlow op nor a TensorFlow Text op of that runtime (TF
   Serving's stock build links those two and nothing else), or that it may
   not run: an op without a CPU kernel, or an `Xla*` op such as
   `XlaDynamicUpdateSlice` (compiled on demand only with
   `--xla_cpu_compilation_enabled`).
5. Prints the `saved_model_cli show --all` summary of the signatures.

What it proves is the export's side: the graph, its ops and its signatures
in that TensorFlow. It does not run `tensorflow_model_server` (no package
registry ships it): the REST conversions and the batching around the graph
are imitated by the tests' stand-in for the server (`serving_standin/` at
the repository root, not installed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

# Run before loading an export "as TF Serving would": keras, keras_hub,
# keras_attn and TensorFlow Text's Python package cannot be imported (that
# package imports keras through tf.keras); `load_text_ops()` registers
# TensorFlow Text's kernels from its shared libraries, as TF Serving links them
# (those of `$KERAS_ATTN_TEXT_OPS_DIR` when set: a TF Serving release's
# runtime, see `keras_attn.export.releases`).
TENSORFLOW_ONLY_PRELUDE = r"""
import glob, importlib.util, json, os, sys
TEXT_OPS_DIRS = []
if os.environ.get("KERAS_ATTN_TEXT_OPS_DIR"):
    TEXT_OPS_DIRS = [os.environ["KERAS_ATTN_TEXT_OPS_DIR"]]
else:
    _spec = importlib.util.find_spec("tensorflow_text")
    if _spec is not None:
        _root = os.path.join(os.path.dirname(_spec.origin), "python")
        TEXT_OPS_DIRS = [os.path.join(_root, "ops"), os.path.join(_root, "metrics")]
for blocked in ("keras", "keras_attn", "keras_hub", "keras_nlp", "tensorflow_text"):
    sys.modules[blocked] = None
import numpy as np
import tensorflow as tf


def load_text_ops():
    # Loads every op library; returns {library: error} of those that did not.
    failures = {}
    for directory in TEXT_OPS_DIRS:
        for library in sorted(glob.glob(os.path.join(directory, "*.so"))):
            try:
                tf.load_op_library(library)
            except Exception as error:
                failures[os.path.basename(library)] = str(error)[-300:]
    return failures
"""

_CHECK_SCRIPT = (
    TENSORFLOW_ONLY_PRELUDE
    + r"""
import time
from tensorflow.python.framework import op_def_registry

path, config_path, result_path = sys.argv[1:4]
config = json.load(open(config_path))
samples, examples = config["samples"], config["examples"]
_spec = importlib.util.spec_from_file_location("_predict", config["protocol"])
protocol = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(protocol)
from tensorflow_serving.apis import predict_pb2, prediction_log_pb2

def as_json(value):
    value = np.asarray(value)
    if value.dtype.kind in "SO":
        decode = np.vectorize(lambda b: b.decode("utf-8", "replace"), otypes=[object])
        return decode(value).tolist()
    return value.tolist()

result = {"tensorflow": tf.__version__, "problems": [], "unverified": []}

# 3a. Ops known to TensorFlow alone, before TensorFlow Text registers its own.
from tensorflow.core.protobuf import saved_model_pb2
proto = saved_model_pb2.SavedModel()
proto.ParseFromString(open(path + "/saved_model.pb", "rb").read())
graph = proto.meta_graphs[0].graph_def
functions = {f.signature.name for f in graph.library.function}
used = {n.op for n in graph.node}
for function in graph.library.function:
    used |= {n.op for n in function.node_def}
used -= functions
tensorflow_ops = {op for op in used if op_def_registry.get(op) is not None}
result["library_failures"] = load_text_ops()  # as TF Serving links them
others = used - tensorflow_ops
registered = {op for op in others if op_def_registry.get(op) is not None}
result["text_ops"] = sorted(registered)
if config["linked_text_ops_dir"] is None:
    # The runtime loads the server's own TensorFlow Text: the registry answers.
    result["unknown_ops"] = sorted(others - registered)
    missing_kernels = []
else:
    # The server's TensorFlow Text cannot load here: its op libraries say
    # which ops it has; the runtime's wheel supplies kernels where it can.
    data = b"".join(
        open(library, "rb").read()
        for library in sorted(glob.glob(config["linked_text_ops_dir"] + "/*.so"))
    )
    in_server = {op for op in others if op.encode() + b"\x00" in data}
    result["unknown_ops"] = sorted(others - in_server)
    missing_kernels = sorted(in_server - registered)
    result["text_ops"] = sorted(in_server)
if missing_kernels:
    result["unverified"].append(
        "no TensorFlow Text library of this runtime registers "
        + ", ".join(missing_kernels)
        + " (the server has them); libraries that did not load: "
        + "; ".join(f"{k}: {v}" for k, v in sorted(result["library_failures"].items()))
    )
# Ops TF Serving knows but may not run: no CPU (or device-independent)
# kernel, or an Xla* op, which needs XLA compilation on demand (off by
# default in tensorflow_model_server: --xla_cpu_compilation_enabled).
from tensorflow.python.framework import kernels
result["no_cpu_kernel"] = sorted(
    op for op in (tensorflow_ops | registered)
    if op.startswith("Xla") or not any(
        k.device_type in ("CPU", "DEFAULT")
        for k in kernels.get_registered_kernels_for_op(op).kernel
    )
)
result["num_ops"] = len(used)

def predict_request(name, inputs):
    request = predict_pb2.PredictRequest()
    request.model_spec.name = config["model_name"]
    request.model_spec.signature_name = name
    for key, value in inputs.items():
        request.inputs[key].CopyFrom(protocol.request_tensor_proto(value))
    return request

if not result["unverified"] and not result["unknown_ops"]:
    # 1. TF2 loader, every signature on the recorded sample inputs.
    loaded = tf.saved_model.load(path)
    result["tf2"] = {}
    for name, inputs in samples.items():
        fn = loaded.signatures[name]
        outputs = fn(
            **{k: tf.constant(protocol.request_array(v)) for k, v in inputs.items()}
        )
        result["tf2"][name] = {k: as_json(v.numpy()) for k, v in outputs.items()}
    del loaded

    # 2. The TF1 loader with the serve tag, requests turned into feeds as the
    # server does (tensor protos by input name) and answered with the
    # PredictResponse it builds.
    tf.compat.v1.disable_eager_execution()
    with tf.compat.v1.Session(graph=tf.Graph()) as session:
        started = time.perf_counter()
        meta = tf.compat.v1.saved_model.loader.load(session, ["serve"], path)
        result["load_seconds"] = time.perf_counter() - started

        def serve(requests):
            answers = {}
            for name, inputs in requests.items():
                request = predict_request(name, inputs)
                response = protocol.run_predict(session, meta, request)
                answers[name] = {
                    k: as_json(v) for k, v in protocol.response_arrays(response).items()
                }
            return answers

        result["tf1"] = serve(samples)
        # Requests given with --example: answered by the serve-tag loader only.
        result["examples"] = serve(examples)

        # 3. The warmup requests, replayed as the server replays them at load.
        warmup_path = os.path.join(path, "assets.extra", "tf_serving_warmup_requests")
        warmup = {"records": 0, "signatures": {}, "errors": []}
        if os.path.exists(warmup_path):
            started = time.perf_counter()
            for record in tf.compat.v1.io.tf_record_iterator(warmup_path):
                log = prediction_log_pb2.PredictionLog()
                log.ParseFromString(record)
                warmup["records"] += 1
                if warmup["records"] > 1000:
                    warmup["errors"].append(
                        "Number of warmup records exceeds the maximum (1000)"
                    )
                    break
                if log.WhichOneof("log_type") != "predict_log":
                    kind = log.WhichOneof("log_type")
                    warmup["errors"].append(
                        f"record {warmup['records']}: a {kind}, not a predict_log"
                    )
                    continue
                request = log.predict_log.request
                name = request.model_spec.signature_name or "serving_default"
                sizes = {p.tensor_shape.dim[0].size for p in request.inputs.values()}
                try:
                    response = protocol.run_predict(session, meta, request)
                except Exception as error:
                    where = f"record {warmup['records']} ({name})"
                    warmup["errors"].append(f"{where}: {error}")
                    continue
                arrays = protocol.response_arrays(response)
                rows = {value.shape[0] for value in arrays.values()}
                if rows != sizes:
                    warmup["errors"].append(
                        f"record {warmup['records']} ({name}): "
                        f"{sorted(sizes)} rows in, {sorted(rows)} out"
                    )
                warmup["signatures"].setdefault(name, []).extend(sorted(sizes))
            warmup["seconds"] = time.perf_counter() - started
        result["warmup"] = warmup

result["modules"] = sorted(
    m for m in sys.modules
    if m.split(".")[0] in ("keras", "keras_attn", "keras_hub")
    and sys.modules[m] is not None
)
with open(result_path, "w") as result_file:
    json.dump(result, result_file)
# TensorFlow's teardown at exit takes seconds and decides nothing here.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""
)


@dataclass
class ServabilityReport:
    """What `check_servable` found.

    `ok` is True when every check ran and passed; `problems` lists what
    failed, `unverified` what could not be run in the runtime checked (the
    export may still be servable: see the message), `notes` what a TF Serving
    operator would miss without failing (an export without warmup requests).
    """

    path: str
    ok: bool
    problems: list = field(default_factory=list)
    unverified: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    signatures: list = field(default_factory=list)
    num_ops: int = 0
    text_ops: list = field(default_factory=list)
    rest_examples: list = field(default_factory=list)
    serving_release: str | None = None
    tensorflow: str = ""
    size_bytes: int = 0
    load_seconds: float | None = None
    warmup: dict = field(default_factory=dict)
    # "" where the check stopped before loading the export; None until
    # `cli_summary` is first read.
    _cli_summary: str | None = field(default="", repr=False)

    @property
    def cli_summary(self) -> str:
        """`saved_model_cli show --all` for the export ("" where the check
        could not load it). Run on first access: it starts another TensorFlow
        process, which a caller that never reads it should not wait for."""
        if self._cli_summary is None:
            self._cli_summary = saved_model_cli_summary(self.path)
        return self._cli_summary

    @property
    def status(self) -> str:
        if self.problems:
            return "NOT SERVABLE"
        return "NOT VERIFIED" if self.unverified else "SERVABLE"

    def __str__(self):
        runtime = f"TensorFlow {self.tensorflow}"
        if self.serving_release:
            runtime = f"the runtime of TF Serving {self.serving_release} ({runtime})"
        lines = [
            f"{self.status}: {self.path}",
            f"checked in {runtime}",
            f"signatures: {', '.join(self.signatures)}",
            f"ops: {self.num_ops} distinct (TensorFlow Text: "
            f"{', '.join(self.text_ops) or 'none'})",
            f"size: {self.size_bytes / 1e6:.1f} MB"
            + (
                f"; serve-tag load: {self.load_seconds:.2f} s"
                if self.load_seconds is not None
                else ""
            ),
        ]
        if self.warmup:
            sizes = ", ".join(
                f"{name} {sorted(set(batch_sizes))}"
                for name, batch_sizes in sorted(self.warmup["signatures"].items())
            )
            lines.append(
                f"warmup: {self.warmup['records']} requests replayed "
                f"({sizes or 'none'})"
                + (
                    f" in {self.warmup['seconds']:.2f} s"
                    if "seconds" in self.warmup
                    else ""
                )
            )
        lines += [f"problem: {p}" for p in self.problems]
        lines += [f"not verified: {p}" for p in self.unverified]
        lines += [f"note: {p}" for p in self.notes]
        if self.rest_examples:
            lines.append(
                "REST requests and the responses TF Serving returns for them "
                "(outputs of the serve-tag loader):"
            )
            for url, body, response in self.rest_examples:
                lines += [f"POST {url}", f"  {body}", f"  -> {response}"]
        return "\n".join(lines)


def _close(got, want, atol) -> bool:
    import numpy as np

    if isinstance(want, dict):
        return (
            isinstance(got, dict)
            and set(got) == set(want)
            and all(_close(got[k], want[k], atol) for k in want)
        )
    got_array, want_array = (
        np.asarray(got, dtype=object),
        np.asarray(want, dtype=object),
    )
    if got_array.shape != want_array.shape:
        return False
    if want_array.size and isinstance(want_array.flat[0], str):
        return got == want
    return np.allclose(
        np.asarray(got, dtype="float64"),
        np.asarray(want, dtype="float64"),
        atol=atol,
        rtol=atol,
        equal_nan=True,  # NaN is reported on its own, by _non_finite
    )


def _non_finite(outputs: dict, samples: dict) -> list:
    """Problems for float outputs that are NaN or infinite on a sample."""
    import numpy as np

    problems = []
    for name, arrays in sorted(outputs.items()):
        for output, values in sorted(arrays.items()):
            values = np.asarray(values, dtype=object)
            if not values.size or not isinstance(values.flat[0], float):
                continue
            bad = ~np.isfinite(np.asarray(values, dtype="float64"))
            rows = sorted({int(i) for i in np.argwhere(bad)[:, 0]}) if bad.ndim else []
            if rows:
                inputs = next(iter(samples[name].values()))
                problems.append(
                    f"signature {name!r} returns NaN or infinite {output!r} for "
                    f"the sample inputs {[inputs[i] for i in rows]!r}"
                )
    return problems


def resolve_version_dir(path) -> Path:
    """`path` itself when it is an export's version directory; for a model
    directory (`<base>/<model_name>`), its highest version, the one TF
    Serving serves by default."""
    path = Path(path)
    if (path / "saved_model.pb").is_file():
        return path
    versions = [p for p in path.glob("*") if p.name.isdigit() and p.is_dir()]
    if not versions:
        raise ValueError(
            "`path` must be an export's version directory (holding "
            "saved_model.pb) or a model directory of numbered versions. "
            f"Received: path={str(path)!r}"
        )
    return max(versions, key=lambda p: int(p.name))


def check_servable(
    path,
    atol: float = 1e-4,
    verbose: bool = True,
    examples=None,
    serving_release=None,
) -> ServabilityReport:
    """Check that TF Serving can load and serve the export at `path`.

    `path` is a version directory written by one of the `export_*` functions
    (it holds `assets.extra/keras_attn.json` with sample inputs and the
    in-process outputs for them), or its model directory (the highest version
    is checked). Returns a `ServabilityReport`; `report.ok` is False when a
    loader fails, an output differs from the in-process one by more than
    `atol`, the graph uses ops the server does not have, or a warmup request
    fails.

    `serving_release` (e.g. `"2.20.0"`, see `keras_attn.export.releases`):
    run the check in a virtual environment holding that TF Serving release's
    TensorFlow and TensorFlow Text (built on first use under the cache
    directory: a TensorFlow installation, from PyPI) instead of this
    process's.
    Where the release's TensorFlow Text cannot be loaded there (the 2.18 and
    2.19 releases link 2.12.1), its ops are matched by name against that
    release's op libraries, and the kernels are those of the TensorFlow Text
    wheel built for the release's TensorFlow; ops whose kernels no such wheel
    provides make the report "NOT VERIFIED" (`report.unverified`) rather than
    failed.

    `examples`: texts (a list of strings) to send to every signature through
    the serve-tag loader; `report.rest_examples` then holds, for each
    signature, the TF Serving REST request for them (`url`, JSON body, in the
    row form `instances` for `serving_default` and the columnar form `inputs`
    for every signature) and the JSON response TF Serving gives.
    """
    from keras_attn.export import _predict
    from keras_attn.export._common import read_metadata

    path = resolve_version_dir(path)
    metadata = read_metadata(path)
    python, env, linked_dir = sys.executable, dict(os.environ), None
    if serving_release is not None:
        from keras_attn.export.releases import runtime_environment, serving_runtime

        runtime = serving_runtime(serving_release, verbose=verbose)
        python, env = str(runtime.python), runtime_environment(runtime)
        if not runtime.release.exact_text_ops:
            linked_dir = str(runtime.linked_text_ops_dir)
        serving_release = runtime.release.version
    report = ServabilityReport(
        path=str(path),
        ok=True,
        signatures=sorted(metadata["signatures"]),
        serving_release=serving_release,
        size_bytes=sum(f.stat().st_size for f in path.rglob("*") if f.is_file()),
    )
    if examples is not None:
        examples = _check_examples(examples)
    requests = (
        {}
        if examples is None
        else {
            name: {
                key: examples
                if isinstance(sample[0], str)
                else list(range(1, len(examples) + 1))  # a seed per example
                for key, sample in inputs.items()
            }
            for name, inputs in metadata["samples"].items()
        }
    )
    with tempfile.TemporaryDirectory() as tmp:
        config_path = Path(tmp) / "config.json"
        result_path = Path(tmp) / "result.json"
        config_path.write_text(
            json.dumps(
                {
                    "samples": metadata["samples"],
                    "examples": requests,
                    "model_name": metadata["model_name"],
                    "protocol": _predict.__file__,
                    "linked_text_ops_dir": linked_dir,
                }
            )
        )
        result = subprocess.run(
            [
                python,
                "-c",
                _CHECK_SCRIPT,
                str(path),
                str(config_path),
                str(result_path),
            ],
            capture_output=True,
            text=True,
            timeout=1800,
            env={**env, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""},
        )
        if result.returncode != 0:
            report.ok = False
            report.problems.append(
                "loading in a TensorFlow-only process failed:\n" + result.stderr[-4000:]
            )
            return _finish(report, verbose)
        checked = json.loads(result_path.read_text())
    report.tensorflow = checked["tensorflow"]
    report.num_ops = checked["num_ops"]
    report.text_ops = checked["text_ops"]
    report.unverified = checked["unverified"]
    report.load_seconds = checked.get("load_seconds")
    report.warmup = checked.get("warmup", {})
    if checked["unknown_ops"]:
        report.problems.append(
            "ops outside the server's TensorFlow and TensorFlow Text: "
            + ", ".join(checked["unknown_ops"])
        )
    if checked["no_cpu_kernel"]:
        report.problems.append(
            "ops a stock TF Serving may not run (XLA-only or no CPU kernel): "
            + ", ".join(checked["no_cpu_kernel"])
        )
    if checked["modules"]:
        report.problems.append("imported " + ", ".join(checked["modules"]))
    if "tf1" in checked:
        expected = metadata["sample_outputs"]
        for loader in ("tf2", "tf1"):
            for name, outputs in expected.items():
                if not _close(checked[loader].get(name), outputs, atol):
                    report.problems.append(
                        f"{loader} loader: signature {name!r} gave "
                        f"{checked[loader].get(name)!r}, expected {outputs!r}"
                    )
        report.problems += _non_finite(checked["tf1"], metadata["samples"])
        report.problems += [f"warmup: {e}" for e in report.warmup["errors"]]
        if not report.warmup["records"]:
            report.notes.append(
                "no warmup requests (assets.extra/tf_serving_warmup_requests): TF "
                "Serving then answers the first requests slowly; exports written "
                "by this version of keras_attn have them"
            )
        if examples is not None:
            report.rest_examples = rest_examples(
                metadata["model_name"], requests, checked["examples"]
            )
    report.ok = not report.problems and not report.unverified
    report._cli_summary = None  # read on first access
    return _finish(report, verbose)


def _check_examples(examples) -> list:
    if isinstance(examples, str) or not all(isinstance(t, str) for t in examples):
        raise ValueError(
            f"`examples` must be a list of strings. Received: examples={examples!r}"
        )
    return list(examples)


def _json_number(value):
    """Floats with the digits TF Serving writes for a float32."""
    from keras_attn.export._predict import JsonNumber, format_float

    if isinstance(value, list):
        return [_json_number(v) for v in value]
    if isinstance(value, float):
        return JsonNumber(value, format_float(value))
    return value


def _rows(columns: dict):
    """Named columns as TF Serving's row form: one object per row, or the
    bare values when there is a single column."""
    if len(columns) == 1:
        return next(iter(columns.values()))
    size = len(next(iter(columns.values())))
    return [{k: v[i] for k, v in columns.items()} for i in range(size)]


def rest_examples(model_name: str, requests: dict, responses: dict) -> list:
    """`(url, body, response)` triples in TF Serving's REST predict format.

    Row form (`instances`, answered with `predictions`: one object per input,
    or the bare value when a signature has one output) for `serving_default`;
    columnar form (`inputs`, answered with `outputs`) for every signature.
    """
    from keras_attn.export._predict import dumps

    url = f"/v1/models/{model_name}:predict"

    def triple(body, response):
        return (url, dumps(body), dumps(response))

    triples = []
    for name, inputs in requests.items():
        outputs = {k: _json_number(v) for k, v in responses[name].items()}
        if name == "serving_default":
            triples.append(
                triple({"instances": _rows(inputs)}, {"predictions": _rows(outputs)})
            )
        columns = outputs if len(outputs) > 1 else next(iter(outputs.values()))
        triples.append(
            triple({"signature_name": name, "inputs": inputs}, {"outputs": columns})
        )
    return triples


def saved_model_cli_summary(path) -> str:
    """`saved_model_cli show --dir PATH --all`, as text."""
    cli = Path(sys.executable).with_name("saved_model_cli")
    command = (
        [str(cli)]
        if cli.exists()
        else [sys.executable, "-m", "tensorflow.python.tools.saved_model_cli"]
    )
    result = subprocess.run(
        [*command, "show", "--dir", str(path), "--all"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    return result.stdout if result.returncode == 0 else result.stderr[-2000:]


def _finish(report: ServabilityReport, verbose: bool) -> ServabilityReport:
    if verbose:
        if report.cli_summary:
            print(report.cli_summary)
        print(report)
    return report
