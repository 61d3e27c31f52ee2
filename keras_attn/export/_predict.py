"""TF Serving's Predict API around a loaded SavedModel: the part the
servability check needs.

What `tensorflow_model_server` does with a `PredictRequest` before and after
the graph runs, written after its sources at the 2.20.0 tag:
`servables/tensorflow/predict_util.cc` (signature lookup, input checks,
fetching every output or the `output_filter`), TensorFlow's
`saved_model::GetInputValues` (tensor protos fed by input name), the
executor's argument check (a wrong dtype is refused before the graph runs)
and `Tensor::AsProtoField` (the response's tensors); and the digits of
`util/json_tensor.cc` for floats in REST answers (`format_float`, `dumps`).
`check_servable` answers the export's sample requests and replays its
warmup requests through `run_predict`, in a TF1 session opened with the
`serve` tag as the server's loader (and its warmup) does, and writes its
REST examples with `dumps`.

Private: the rest of the server (REST bodies, batching, a server object) is
the tests' and benchmarks' stand-in, `serving_standin/` at the repository
root, which is not installed.

This module imports NumPy, TensorFlow and `tensorflow_serving`'s protos
only, so that `check_servable` can load it by file path in a process where
keras and keras_attn cannot be imported.
"""

from __future__ import annotations

import json
import math

import numpy as np
import tensorflow as tf

DEFAULT_SIGNATURE = "serving_default"
PREDICT_METHOD = "tensorflow/serving/predict"


class PredictError(Exception):
    """A request the server refuses, with its status code and message."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def request_array(values) -> np.ndarray:
    """A request's input of the export's samples or examples as a client
    sends it: texts as a string tensor (UTF-8 bytes), integers (a
    language model's `seed`) as int64."""
    values = list(values)
    if all(isinstance(v, str) for v in values):
        return np.array([v.encode("utf-8") for v in values], dtype=object)
    return np.array(values, dtype=np.int64)


def request_tensor_proto(values):
    """`request_array(values)` as the tensor proto of a `PredictRequest`."""
    array = request_array(values)
    return tf.make_tensor_proto(
        array, dtype=tf.string if array.dtype == object else tf.int64
    )


def signature_for(meta_graph, request):
    """`(name, SignatureDef)` of the request's signature."""
    name = request.model_spec.signature_name or DEFAULT_SIGNATURE
    if name not in meta_graph.signature_def:
        raise PredictError(
            "FAILED_PRECONDITION", f'Serving signature key "{name}" not found.'
        )
    return name, meta_graph.signature_def[name]


def request_feeds(signature, request) -> list:
    """`[(tensor name, array)]` to feed: the request's tensor protos by input
    name, after the server's checks (predict_util.cc's
    VerifyRequestInputsSize, saved_model::GetInputValues, and the dtype
    check the executor makes before the graph runs)."""
    request_inputs = set(request.inputs)
    signature_inputs = set(signature.inputs)
    if len(request_inputs) > len(signature_inputs) or (
        len(request_inputs) < len(signature_inputs) and not signature.defaults
    ):
        extra = sorted(request_inputs - signature_inputs)
        missing = sorted(signature_inputs - request_inputs)
        raise PredictError(
            "INVALID_ARGUMENT",
            f"input size does not match signature: {len(request_inputs)}!="
            f"{len(signature_inputs)} len({{{','.join(sorted(request_inputs))}}}) "
            f"!= len({{{','.join(sorted(signature_inputs))}}}). Sent extra: "
            f"{{{','.join(extra)}}}. Missing but required: {{{','.join(missing)}}}.",
        )
    feeds = []
    for position, alias in enumerate(sorted(signature.inputs)):
        info = signature.inputs[alias]
        if alias not in request.inputs:
            raise PredictError(
                "INVALID_ARGUMENT",
                f"Signature input alias: {alias}(feed name: {info.name}) not found "
                "in request and no default value provided. Inputs expected to be "
                f"in the request {{{','.join(sorted(request_inputs))}}}, or default "
                f"input alias set: {','.join(sorted(signature.defaults))}",
            )
        proto = request.inputs[alias]
        try:
            value = tf.make_ndarray(proto)
        except Exception as error:  # any proto it cannot parse
            raise PredictError(
                "INVALID_ARGUMENT", f"tensor parsing error: {alias}"
            ) from error
        if proto.dtype != info.dtype:
            raise PredictError(
                "INVALID_ARGUMENT",
                f"Expects arg[{position}] to be {_dtype_name(info.dtype)} but "
                f"{_dtype_name(proto.dtype)} is provided",
            )
        feeds.append((info.name, value))
    return feeds


def output_names(signature, request) -> list:
    """The output aliases to fetch: `output_filter`, else all of them."""
    aliases = list(request.output_filter) or sorted(signature.outputs)
    seen = set()
    for alias in aliases:
        if alias not in signature.outputs:
            raise PredictError(
                "INVALID_ARGUMENT",
                f"output tensor alias not found in signature: {alias} Outputs "
                f"expected to be in the set {{{','.join(sorted(signature.outputs))}}}.",
            )
        if alias in seen:
            raise PredictError(
                "INVALID_ARGUMENT", f"duplicate output tensor alias: {alias}"
            )
        seen.add(alias)
    return aliases


def run_predict(session, meta_graph, request, model_version=None, run=None):
    """The server's `RunPredict`: a `PredictResponse` for `request`.

    `session` is a `tf.compat.v1.Session` holding the SavedModel loaded with
    the `serve` tag, `meta_graph` the loader's `MetaGraphDef`. `run`, when
    given, replaces `session.run(fetches, feed_dict)` (the tests' stand-in
    server counts its graph runs with it).
    """
    from tensorflow_serving.apis import predict_pb2

    name, signature = signature_for(meta_graph, request)
    if signature.method_name != PREDICT_METHOD:
        raise PredictError(
            "INTERNAL",
            "Expected prediction signature method_name to be one of "
            f"{{{PREDICT_METHOD}, ...}}. Was: {signature.method_name}",
        )
    feeds = request_feeds(signature, request)
    aliases = output_names(signature, request)
    fetches = [signature.outputs[alias].name for alias in aliases]
    if run is None:
        values = session.run(fetches, feed_dict=dict(feeds))
    else:
        values = run(fetches, dict(feeds))
    response = predict_pb2.PredictResponse()
    response.model_spec.name = request.model_spec.name
    response.model_spec.signature_name = name
    if model_version is not None:
        response.model_spec.version.value = int(model_version)
    for alias, value in zip(aliases, values, strict=True):
        response.outputs[alias].CopyFrom(tensor_proto_as_field(np.asarray(value)))
    return response


def tensor_proto_as_field(value: np.ndarray):
    """A `TensorProto` with the values in its typed field (`float_val`,
    `int_val`, `string_val`...), as the server's `Tensor::AsProtoField`
    writes responses (not `tensor_content`)."""
    proto = tf.make_tensor_proto(value)
    if proto.tensor_content:
        proto.ClearField("tensor_content")
        flat = value.reshape(-1)
        if value.dtype == np.float32:
            proto.float_val.extend(flat.tolist())
        elif value.dtype == np.float64:
            proto.double_val.extend(flat.tolist())
        elif value.dtype in (np.int32, np.int16, np.int8, np.uint8):
            proto.int_val.extend(flat.tolist())
        elif value.dtype == np.int64:
            proto.int64_val.extend(flat.tolist())
        elif value.dtype == np.bool_:
            proto.bool_val.extend(flat.tolist())
        else:
            raise TypeError(f"no proto field for dtype {value.dtype}")
    return proto


def response_arrays(response) -> dict:
    """`{output: array}` of a `PredictResponse` (what a client does)."""
    return {name: tf.make_ndarray(proto) for name, proto in response.outputs.items()}


def _dtype_name(dtype: int) -> str:
    return tf.dtypes.as_dtype(dtype).name


# ---- Floats in JSON (util/json_tensor.cc) ----


def format_float(value, dtype=np.float32) -> str:
    """A float as the server writes it in JSON (json_tensor.cc WriteDecimal):
    printf `%g` (six significant digits) when that reads back as the same
    value, else `%.9g` (float32; `%.17g` for float64), with `.0` added to
    whole numbers; NaN and ±Infinity as such."""
    value = dtype(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "-Infinity" if value < 0 else "Infinity"
    text = f"{float(value):g}"
    if dtype(float(text)) != value:
        digits = 9 if dtype == np.float32 else 17
        text = f"{float(value):.{digits}g}"
    if "." not in text and "e" not in text:
        text += ".0"
    return text


class JsonNumber(float):
    """A float that `dumps` writes as `text` (the server's digits)."""

    def __new__(cls, value, text):
        number = super().__new__(cls, value)
        number.text = text
        return number

    def __repr__(self):
        return self.text


def dumps(body) -> str:
    """`json.dumps` writing floats with the server's digits."""

    def encode(value):
        if isinstance(value, JsonNumber):
            return value.text
        if isinstance(value, dict):
            items = ", ".join(
                f"{json.dumps(k, ensure_ascii=False)}: {encode(v)}"
                for k, v in value.items()
            )
            return "{" + items + "}"
        if isinstance(value, list):
            return "[" + ", ".join(encode(v) for v in value) + "]"
        return json.dumps(value, ensure_ascii=False)

    return encode(body)
