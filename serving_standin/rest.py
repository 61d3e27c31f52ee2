"""TF Serving's REST `:predict` API, as the server converts it.

A REST `:predict` JSON body turned into the `PredictRequest` the server
builds from it, and a `PredictResponse` or an error turned into the JSON the
server answers with, written after `util/json_tensor.cc` at TF Serving's
2.20.0 tag (row and columnar forms, `{"b64": ...}` strings, float
formatting). Part of the project's stand-in for the server
(`serving_standin.StandInServer`), not the server: re-implementations,
tested against the rules quoted here. The Predict call itself (signature
lookup, input checks, the run) and the float digits are the servability
check's, in `keras_attn.export._predict`.
"""

from __future__ import annotations

import base64
import json
import math
import re

import numpy as np
import tensorflow as tf

from keras_attn.export._predict import (
    JsonNumber,
    PredictError,
    dumps,
    format_float,
    response_arrays,
    signature_for,
)


def rest_to_request(body: str | bytes, model_name: str, meta_graph, find_servable=None):
    """A REST `:predict` JSON body as the `PredictRequest` the server builds
    from it (FillPredictRequestFromJson). Returns `(request, form)` with
    `form` "row" (`instances`) or "columnar" (`inputs`).

    `find_servable()`, when given, is the server's look-up of the model (and
    version) the URL names, made after the body is parsed and before the
    signature is: it raises the `PredictError` of a model not served.

    Like the server's parser (RapidJSON, without encoding validation), bytes
    that are not UTF-8 inside a JSON string are taken as they are (the
    string tensor holds them); a `\\u` escape of a lone surrogate is a
    parse error; of duplicate keys the first counts; NaN and Infinity are
    numbers, and a number beyond a double's range is a parse error.
    """
    from tensorflow_serving.apis import predict_pb2

    document = _parse(body)
    if not isinstance(document, dict):
        raise PredictError(
            "INVALID_ARGUMENT", f"JSON Value: {_debug(document)} Is not object"
        )
    request = predict_pb2.PredictRequest()
    request.model_spec.name = model_name
    if "signature_name" in document:
        if not isinstance(document["signature_name"], str):
            raise PredictError(
                "INVALID_ARGUMENT", "'signature_name' key must be a string"
            )
        request.model_spec.signature_name = document["signature_name"]
    if find_servable is not None:
        find_servable()
    name, signature = signature_for(meta_graph, request)
    infos = dict(signature.inputs)
    if not infos:
        raise PredictError(
            "INVALID_ARGUMENT",
            "Failed to get input map for signature: "
            f"{request.model_spec.signature_name or 'DEFAULT'}",
        )
    if "instances" in document and "inputs" in document:
        raise PredictError(
            "INVALID_ARGUMENT",
            f"JSON Value: {_debug(document)} Not formatted correctly expecting "
            "only one of 'inputs' or 'instances' keys to exist ",
        )
    if "instances" in document:
        instances = document["instances"]
        if not isinstance(instances, list):
            raise PredictError(
                "INVALID_ARGUMENT",
                f"JSON Value: {_debug(document)} Expecting 'instances' to be an "
                "list/array",
            )
        if not instances:
            raise PredictError(
                "INVALID_ARGUMENT",
                f"JSON Value: {_debug(document)} No values in 'instances' array",
            )
        form = "row"
    elif "inputs" in document:
        form = "columnar"
    else:
        raise PredictError("INVALID_ARGUMENT", "Missing 'inputs' or 'instances' key")
    try:
        if form == "row":
            columns = _columns_from_instances(document["instances"], infos)
        else:
            columns = _columns_from_inputs(document["inputs"], infos)
    except RecursionError:
        # Lists nested deeper than Python recurses: the server reads them,
        # into a tensor of more dimensions than a TensorShape holds (254).
        raise PredictError(
            "INVALID_ARGUMENT", f"tensor parsing error: {sorted(infos)[0]}"
        ) from None
    for name, column in columns.items():
        dtype = tf.dtypes.as_dtype(infos[name].dtype)
        try:
            tensor = _tensor_from_json(column, dtype)
        except ValueError:  # more dimensions than a tensor (or NumPy) holds
            raise PredictError(
                "INVALID_ARGUMENT", f"tensor parsing error: {name}"
            ) from None
        request.inputs[name].CopyFrom(tensor)
    return request, form


# A `\\u` escape of a UTF-16 surrogate, or any other escape (consumed whole,
# so that an escaped backslash is not read as the start of one).
_ESCAPE = re.compile(r"\\(?:u([dD][89a-fA-F][0-9a-fA-F]{2})|.)", re.DOTALL)


def _parse(body):
    """The JSON document of `body` (ParseJson)."""
    if isinstance(body, (bytes, bytearray)):
        text = bytes(body).decode("utf-8", "surrogateescape")
    else:
        text = body
    if not text:
        raise PredictError(
            "INVALID_ARGUMENT", "JSON Parse error: The document is empty"
        )
    bad = high = None  # a lone surrogate escape; a high one before its low
    for match in _ESCAPE.finditer(text):
        unit = match.group(1)
        is_high = unit is not None and unit[1].lower() in "89ab"
        is_low = unit is not None and not is_high
        if high is not None:
            if is_low and match.start() == high.end():
                high = None
                continue
            bad = high
            break
        if is_high:
            high = match
        elif is_low:
            bad = match
            break
    bad = bad or high
    if bad is not None:
        offset = len(text[: bad.start()].encode("utf-8", "surrogateescape"))
        raise PredictError(
            "INVALID_ARGUMENT",
            "JSON Parse error: The surrogate pair in string is invalid. "
            f"at offset: {offset}",
        )
    try:
        return json.loads(
            text,
            object_pairs_hook=_first_of_each_key,
            parse_float=_double,
            parse_int=_integer,
        )
    except RecursionError:
        raise PredictError(
            "INVALID_ARGUMENT",
            "JSON Parse error: nested deeper than the stand-in parses (the "
            "server's recursive parser may not survive it)",
        ) from None
    except ValueError as error:
        raise PredictError("INVALID_ARGUMENT", f"JSON Parse error: {error}") from None


def _first_of_each_key(pairs):
    """RapidJSON's FindMember finds a key's first occurrence."""
    found = {}
    for key, value in pairs:
        found.setdefault(key, value)
    return found


def _double(text):
    value = float(text)
    if math.isinf(value):
        raise ValueError("Number too big to be stored in double.")
    return value


def _integer(text):
    value = int(text)
    if abs(value) >= 2**64 and math.isinf(float(text)):
        raise ValueError("Number too big to be stored in double.")
    return value


def _is_b64(value) -> bool:
    return (
        isinstance(value, dict)
        and list(value) == ["b64"]
        and isinstance(value["b64"], str)
    )


def _debug(value) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _json_type(value) -> str:
    if value is None:
        return "Null"
    if value is True or value is False:
        return str(value)
    if isinstance(value, dict):
        return "Object"
    if isinstance(value, list):
        return "Array"
    return "String" if isinstance(value, str) else "Number"


def _columns_from_instances(instances: list, infos: dict) -> dict:
    """FillTensorMapFromInstancesList: `{input: (values, shape)}`."""
    objects = isinstance(instances[0], dict) and not _is_b64(instances[0])
    if not objects and len(infos) > 1:
        raise PredictError(
            "INVALID_ARGUMENT",
            "instances is a plain list, but expecting list of objects as multiple "
            "input tensors required as per tensorinfo_map",
        )
    names = sorted(infos)
    values = {name: [] for name in names}
    shapes: dict = {}

    def add(item, name, index):
        dtype = tf.dtypes.as_dtype(infos[name].dtype)
        shape = _dense_shape(item)
        try:
            flat = _fill(item, 0, shape, dtype)
        except PredictError as error:
            raise PredictError(
                "INVALID_ARGUMENT",
                f"Failed to process element: {index} of 'instances' list. "
                f"Error: {error}",
            ) from None
        if name in shapes and shapes[name] != shape:
            raise PredictError(
                "INVALID_ARGUMENT",
                f"Failed to process element: {index} of 'instances' list. Error: "
                f"INVALID_ARGUMENT: Expecting shape {shapes[name]} but got: {shape}",
            )
        shapes[name] = shape
        values[name].extend(flat)

    for index, instance in enumerate(instances):
        is_object = isinstance(instance, dict) and not _is_b64(instance)
        if objects:
            if not is_object:
                raise PredictError(
                    "INVALID_ARGUMENT",
                    f"Expecting object but got list at item {index} of input list",
                )
            for name, item in instance.items():
                if name not in infos:
                    raise PredictError(
                        "INVALID_ARGUMENT",
                        f"Failed to process element: {index} key: {name} of "
                        "'instances' list. Error: INVALID_ARGUMENT: JSON object: "
                        f"does not have named input: {name}",
                    )
                add(item, name, index)
            if sorted(instance) != names:
                raise PredictError(
                    "INVALID_ARGUMENT",
                    f"Failed to process element: {index} of 'instances' list. "
                    f"JSON object: {_debug(instance)} keys must be equal to: "
                    f"{','.join(names)}",
                )
        else:
            if is_object:
                raise PredictError(
                    "INVALID_ARGUMENT",
                    f"Expecting value/list but got object at item {index} of "
                    "input list",
                )
            add(instance, names[0], index)
    return {name: (values[name], [len(instances), *shapes[name]]) for name in names}


def _columns_from_inputs(inputs, infos: dict) -> dict:
    """FillTensorMapFromInputsMap: `{input: (values, shape)}`."""
    if not isinstance(inputs, dict) or _is_b64(inputs):
        if len(infos) > 1:
            raise PredictError(
                "INVALID_ARGUMENT",
                "inputs is a plain value/list, but expecting an object as "
                "multiple input tensors required as per tensorinfo_map",
            )
        items = {next(iter(infos)): inputs}
    else:
        items = {}
        for name in sorted(infos):
            if name not in inputs:
                raise PredictError(
                    "INVALID_ARGUMENT",
                    f"Missing named input: {name} in 'inputs' object.",
                )
            items[name] = inputs[name]
    columns = {}
    for name, item in items.items():
        shape = _dense_shape(item)
        columns[name] = (
            _fill(item, 0, shape, tf.dtypes.as_dtype(infos[name].dtype)),
            shape,
        )
    return columns


def _dense_shape(value) -> list:
    """GetDenseTensorShape: the sizes of the first element at each level."""
    shape = []
    while isinstance(value, list):
        shape.append(len(value))
        if not value:
            break
        value = value[0]
    return shape


def _fill(value, level: int, shape: list, dtype) -> list:
    """FillTensorProto: the values of `value` in row-major order."""
    if not isinstance(value, list):
        if level != len(shape):
            raise PredictError(
                "INVALID_ARGUMENT",
                f"JSON Value: {_debug(value)} found at incorrect level: "
                f"{level + 1} in the JSON DOM. Expected at level: {len(shape)}",
            )
        return [_value(value, dtype)]
    if level >= len(shape):
        raise PredictError(
            "INVALID_ARGUMENT",
            f"Encountered list at unexpected level: {level} expected < {len(shape)}",
        )
    if len(value) != shape[level]:
        raise PredictError(
            "INVALID_ARGUMENT",
            f"Encountered list at unexpected size: {len(value)} at level: {level} "
            f"expected size: {shape[level]}",
        )
    return [v for item in value for v in _fill(item, level + 1, shape, dtype)]


def _value(value, dtype):
    def type_error():
        return PredictError(
            "INVALID_ARGUMENT",
            f"JSON Value: {_debug(value)} Type: {_json_type(value)} is not of "
            f"expected type: {dtype.name}",
        )

    if isinstance(value, dict):
        if dtype != tf.string:
            raise type_error()
        if not _is_b64(value):
            raise PredictError(
                "INVALID_ARGUMENT",
                f"JSON Value: {_debug(value)} not formatted correctly for base64 data",
            )
        try:
            return base64.b64decode(value["b64"], validate=True)
        except ValueError:
            raise PredictError("INVALID_ARGUMENT", "Unable to base64 decode") from None
    if dtype == tf.string:
        if not isinstance(value, str):
            raise type_error()
        # Bytes that were not UTF-8 in the body come back as they were.
        return value.encode("utf-8", "surrogateescape")
    if dtype == tf.bool:
        if not isinstance(value, bool):
            raise type_error()
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise type_error()
    return value


def _tensor_from_json(column, dtype):
    values, shape = column
    array = np.empty(len(values), dtype=object if dtype == tf.string else None)
    if dtype == tf.string:
        array[:] = values
    else:
        array = np.array(values, dtype=dtype.as_numpy_dtype)
    return tf.make_tensor_proto(array.reshape(shape), dtype=dtype)


def _json_values(value: np.ndarray, as_bytes: bool):
    if value.dtype.kind in "SO":
        flat = [
            {"b64": base64.b64encode(v).decode("ascii")}
            if as_bytes
            else v.decode("utf-8", "replace")
            for v in value.reshape(-1)
        ]
    elif value.dtype.kind == "f":
        flat = [
            JsonNumber(v, format_float(v, value.dtype.type)) for v in value.reshape(-1)
        ]
    elif value.dtype.kind == "b":
        flat = [bool(v) for v in value.reshape(-1)]
    else:
        flat = [int(v) for v in value.reshape(-1)]
    return _nest(flat, value.shape)


def _nest(flat: list, shape: tuple):
    """`flat` (row-major) as nested lists of `shape`."""
    if not shape:
        return flat[0]
    if len(shape) == 1:
        return list(flat)
    step = int(np.prod(shape[1:]))
    return [_nest(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


def response_to_rest(response, form: str) -> str:
    """The JSON text the server answers a REST `:predict` with:
    `{"predictions": ...}` (row form: one object per row, or the bare value
    with one output) or `{"outputs": ...}` (columnar: an object of outputs,
    or the bare value with one output). String outputs whose name ends in
    `_bytes` are written as `{"b64": ...}`."""
    arrays = response_arrays(response)
    if not arrays:
        raise PredictError(
            "INVALID_ARGUMENT", "Cannot convert empty tensor map to JSON"
        )
    columns = {
        name: _json_values(value, name.endswith("_bytes") and value.dtype.kind in "SO")
        for name, value in sorted(arrays.items())
    }
    if form == "row":
        sizes = {
            name: np.shape(value)[0] if np.ndim(value) else None
            for name, value in arrays.items()
        }
        if None in sizes.values():
            name = next(n for n, s in sizes.items() if s is None)
            raise PredictError(
                "INVALID_ARGUMENT", f"Tensor name: {name} has no shape information "
            )
        if len(set(sizes.values())) > 1:
            raise PredictError(
                "INVALID_ARGUMENT", "Tensor name: has inconsistent batch size"
            )
        if len(columns) == 1:
            body = {"predictions": next(iter(columns.values()))}
        else:
            size = next(iter(sizes.values()))
            body = {
                "predictions": [
                    {name: column[i] for name, column in columns.items()}
                    for i in range(size)
                ]
            }
    else:
        body = {
            "outputs": next(iter(columns.values())) if len(columns) == 1 else columns
        }
    return dumps(body)


def error_to_rest(error: PredictError) -> str:
    """The REST body of an error (`{"error": message}`). Bytes of the
    request that were not UTF-8 and appear in the message are written as
    `\\xNN` (the server C-escapes its messages: `\\NNN`)."""
    message = error.message.encode("utf-8", "surrogateescape").decode(
        "utf-8", "backslashreplace"
    )
    return json.dumps({"error": message}, ensure_ascii=False)
