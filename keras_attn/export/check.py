"""`check_servable`: prove that TF Serving can serve an export.

1. Loads the export in a fresh Python in which keras, keras_hub, keras_attn
   and TensorFlow Text's Python package cannot be imported (TF Serving has
   none of them; TensorFlow Text's kernels are loaded from its shared
   libraries, as TF Serving links them), runs every signature on
   the sample inputs recorded at export time and compares with the outputs
   the in-process model gave then.
2. Loads it as TF Serving's C++ loader does: the TF1 loader with the `serve`
   tag, feeding and fetching the signature's tensors by name.
3. Lists every op in the graph (functions included) and fails on any op that
   is neither a TensorFlow op nor a TensorFlow Text op (TF Serving's stock
   build links those two and nothing else), or that it may not run: an op
   without a CPU kernel, or an `Xla*` op such as `XlaDynamicUpdateSlice`
   (compiled on demand only with `--xla_cpu_compilation_enabled`).
4. Prints the `saved_model_cli show --all` summary of the signatures.
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
# TensorFlow Text's kernels from its shared libraries, as TF Serving links them.
TENSORFLOW_ONLY_PRELUDE = r"""
import glob, importlib.util, json, os, sys
_spec = importlib.util.find_spec("tensorflow_text")
TEXT_OPS_DIR = None
if _spec is not None:
    TEXT_OPS_DIR = os.path.join(os.path.dirname(_spec.origin), "python", "ops")
for blocked in ("keras", "keras_attn", "keras_hub", "keras_nlp", "tensorflow_text"):
    sys.modules[blocked] = None
import numpy as np
import tensorflow as tf


def load_text_ops():
    if TEXT_OPS_DIR is not None:
        for library in sorted(glob.glob(os.path.join(TEXT_OPS_DIR, "*.so"))):
            tf.load_op_library(library)
"""

_CHECK_SCRIPT = (
    TENSORFLOW_ONLY_PRELUDE
    + r"""
from tensorflow.python.framework import op_def_registry

path, samples_path, result_path = sys.argv[1:4]
samples = json.load(open(samples_path))
examples = samples.pop("__examples__", {})

def as_json(value):
    value = np.asarray(value)
    if value.dtype.kind in "SO":
        decode = np.vectorize(lambda b: b.decode("utf-8", "replace"), otypes=[object])
        return decode(value).tolist()
    return value.tolist()

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

load_text_ops()  # as TF Serving links them
text_ops = {op for op in used - tensorflow_ops if op_def_registry.get(op) is not None}
unknown = sorted(used - tensorflow_ops - text_ops)
# Ops TF Serving knows but may not run: no CPU (or device-independent)
# kernel, or an Xla* op, which needs XLA compilation on demand (off by
# default in tensorflow_model_server: --xla_cpu_compilation_enabled).
from tensorflow.python.framework import kernels
no_cpu_kernel = sorted(
    op for op in used - set(unknown)
    if op.startswith("Xla") or not any(
        k.device_type in ("CPU", "DEFAULT")
        for k in kernels.get_registered_kernels_for_op(op).kernel
    )
)

# 1. TF2 loader, every signature on the recorded sample inputs.
loaded = tf.saved_model.load(path)
tf2 = {}
for name, inputs in samples.items():
    fn = loaded.signatures[name]
    outputs = fn(**{k: tf.constant(v) for k, v in inputs.items()})
    tf2[name] = {k: as_json(v.numpy()) for k, v in outputs.items()}

# 2. TF1 loader with the serve tag, tensors fed and fetched by name.
tf.compat.v1.disable_eager_execution()
with tf.compat.v1.Session(graph=tf.Graph()) as session:
    meta = tf.compat.v1.saved_model.loader.load(session, ["serve"], path)

    def serve(requests):
        answers = {}
        for name, inputs in requests.items():
            signature = meta.signature_def[name]
            feed = {signature.inputs[k].name: v for k, v in inputs.items()}
            names = sorted(signature.outputs)
            fetches = [signature.outputs[k].name for k in names]
            values = session.run(fetches, feed_dict=feed)
            answers[name] = {k: as_json(v) for k, v in zip(names, values)}
        return answers

    tf1 = serve(samples)
    # Requests given with --example: answered by the serve-tag loader only.
    answers = serve(examples)

json.dump({
    "tf2": tf2, "tf1": tf1, "examples": answers,
    "unknown_ops": unknown, "no_cpu_kernel": no_cpu_kernel,
    "text_ops": sorted(text_ops), "num_ops": len(used),
    "modules": sorted(
        m for m in sys.modules
        if m.split(".")[0] in ("keras", "keras_attn", "keras_hub")
        and sys.modules[m] is not None
    ),
}, open(result_path, "w"))
"""
)


@dataclass
class ServabilityReport:
    path: str
    ok: bool
    problems: list = field(default_factory=list)
    signatures: list = field(default_factory=list)
    num_ops: int = 0
    text_ops: list = field(default_factory=list)
    cli_summary: str = ""
    rest_examples: list = field(default_factory=list)

    def __str__(self):
        status = "SERVABLE" if self.ok else "NOT SERVABLE"
        lines = [
            f"{status}: {self.path}",
            f"signatures: {', '.join(self.signatures)}",
            f"ops: {self.num_ops} distinct (TensorFlow Text: "
            f"{', '.join(self.text_ops) or 'none'})",
        ]
        lines += [f"problem: {p}" for p in self.problems]
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
    )


def check_servable(
    path, atol: float = 1e-4, verbose: bool = True, examples=None
) -> ServabilityReport:
    """Check that TF Serving can load and serve the export at `path`.

    `path` is a version directory written by one of the `export_*` functions
    (it holds `assets.extra/keras_attn.json` with sample inputs and the
    in-process outputs for them). Returns a `ServabilityReport`; `report.ok`
    is False when a loader fails, an output differs from the in-process one
    by more than `atol`, or the graph uses ops outside TensorFlow and
    TensorFlow Text.

    `examples`: texts (a list of strings) to send to every signature through
    the serve-tag loader; `report.rest_examples` then holds, for each
    signature, the TF Serving REST request for them (`url`, JSON body, in the
    row form `instances` for `serving_default` and the columnar form `inputs`
    for every signature) and the JSON response TF Serving gives.
    """
    from keras_attn.export._common import read_metadata

    path = Path(path)
    metadata = read_metadata(path)
    report = ServabilityReport(
        path=str(path), ok=True, signatures=sorted(metadata["signatures"])
    )
    with tempfile.TemporaryDirectory() as tmp:
        samples_path = Path(tmp) / "samples.json"
        result_path = Path(tmp) / "result.json"
        samples = dict(metadata["samples"])
        if examples is not None:
            examples = _check_examples(examples)
            samples["__examples__"] = {
                name: {key: examples for key in inputs}
                for name, inputs in metadata["samples"].items()
            }
        samples_path.write_text(json.dumps(samples))
        result = subprocess.run(
            [
                sys.executable,
                "-c",
                _CHECK_SCRIPT,
                str(path),
                str(samples_path),
                str(result_path),
            ],
            capture_output=True,
            text=True,
            timeout=900,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""},
        )
        if result.returncode != 0:
            report.ok = False
            report.problems.append(
                "loading in a TensorFlow-only process failed:\n" + result.stderr[-4000:]
            )
            return _finish(report, verbose)
        checked = json.loads(result_path.read_text())
    report.num_ops = checked["num_ops"]
    report.text_ops = checked["text_ops"]
    if checked["unknown_ops"]:
        report.ok = False
        report.problems.append(
            "ops outside TensorFlow and TensorFlow Text: "
            + ", ".join(checked["unknown_ops"])
        )
    if checked["no_cpu_kernel"]:
        report.ok = False
        report.problems.append(
            "ops a stock TF Serving may not run (XLA-only or no CPU kernel): "
            + ", ".join(checked["no_cpu_kernel"])
        )
    if checked["modules"]:
        report.ok = False
        report.problems.append("imported " + ", ".join(checked["modules"]))
    expected = metadata["sample_outputs"]
    for loader in ("tf2", "tf1"):
        for name, outputs in expected.items():
            if not _close(checked[loader].get(name), outputs, atol):
                report.ok = False
                report.problems.append(
                    f"{loader} loader: signature {name!r} gave "
                    f"{checked[loader].get(name)!r}, expected {outputs!r}"
                )
    if examples is not None:
        report.rest_examples = rest_examples(
            metadata["model_name"], samples["__examples__"], checked["examples"]
        )
    report.cli_summary = saved_model_cli_summary(path)
    return _finish(report, verbose)


def _check_examples(examples) -> list:
    if isinstance(examples, str) or not all(isinstance(t, str) for t in examples):
        raise ValueError(
            f"`examples` must be a list of strings. Received: examples={examples!r}"
        )
    return list(examples)


def _json_number(value):
    """Floats as TF Serving writes float32 (shortest round-trip digits)."""
    import numpy as np

    if isinstance(value, list):
        return [_json_number(v) for v in value]
    if isinstance(value, float):
        return float(str(np.float32(value)))
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
    url = f"/v1/models/{model_name}:predict"

    def triple(body, response):
        return (
            url,
            json.dumps(body, ensure_ascii=False),
            json.dumps(response, ensure_ascii=False),
        )

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
