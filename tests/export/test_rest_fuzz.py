"""The stand-in server's REST port fuzzed: hypothesis-drawn bodies (random
bytes, truncated JSON, JSON of any shape and of wrong types, both the
`instances` and `inputs` forms, wrong signature names, bytes that are not
UTF-8) on drawn URLs and methods, sent over HTTP to the exports of
`tests/export/conftest.py` served by `serving_standin` on 127.0.0.1.

Each answer is the one TF Serving's HTTP port gives (model_servers/
http_server.cc, http_rest_api_handler.cc, util/json_tensor.cc): libevent's
404 page outside `/v1/`; `{"error": ...}` with 400 for a malformed request
(`Malformed request: <method> <path>`, a body that does not parse, is not an
object, has neither or both of `instances` and `inputs`, names a signature
the model lacks, or holds anything but a vector of strings), 404 for a model
or version not served; 200 for a vector of strings, with one answer per
string, the answer the Predict API gives for them. The server answers a
good request as before once they are all done.

Example counts are `tests/property_settings.py`'s.
"""

from __future__ import annotations

import base64
import codecs
import http.client
import json
import re
from urllib.parse import quote, unquote_to_bytes

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from tests.property_settings import property_settings

pytestmark = pytest.mark.tf_only

TIMEOUT = 120  # seconds per request: tiny models on a shared 2-core machine
MODELS = ("sentiment", "translator", "language_model")
GOOD = {
    "sentiment": ("serving_default", "text", ["a witty film", ""]),
    "translator": ("translate_with_alignment", "text", ["Where is it?", "\x00"]),
    "language_model": ("score", "text", ["To be, or not", "\xff"]),
}

# TF Serving's routes (http_rest_api_handler.cc, http_rest_api_util.cc),
# restated here: the test's oracle, not the stand-in's code.
V1 = re.compile(r"/v1/.*", re.I)
PREDICT = re.compile(
    r"/v1/models/([^/:]+)(?:(?:/versions/(\d+))|(?:/labels/([^/:]+)))?"
    r":(classify|regress|predict)",
    re.I,
)
STATUS = re.compile(
    r"/v1/models(?:/([^/:]+))?(?:(?:/versions/(\d+))|(?:/labels/([^/:]+)))?"
    r"(?:/(metadata))?",
    re.I,
)
LIBEVENT_404 = (
    "<HTML><HEAD>\n<TITLE>404 Not Found</TITLE>\n</HEAD><BODY>\n"
    "<H1>Not Found</H1>\n</BODY></HTML>\n"
)


@pytest.fixture(scope="module")
def port(small_sentiment_export, small_translator_export, small_language_model_export):
    """`(address, {model: StandInServer}, {model: good answer})`: the HTTP
    port over the three exports, and each model's answer to a good request
    before any drawn one."""
    from serving_standin import StandInServer
    from serving_standin.http_port import serve

    servers = {
        server.model_name: server
        for server in (
            StandInServer(path)
            for path in (
                small_sentiment_export,
                small_translator_export,
                small_language_model_export,
            )
        )
    }
    assert sorted(servers) == sorted(MODELS)
    with serve(servers.values()) as address:
        good = {model: ask_good(address, model) for model in MODELS}
        yield address, servers, good
    for server in servers.values():
        server.close()


def send(address, method, path, body: bytes):
    connection = http.client.HTTPConnection(*address, timeout=TIMEOUT)
    try:
        connection.request(method, path, body=body)
        response = connection.getresponse()
        return response.status, response.getheader("Content-Type"), response.read()
    finally:
        connection.close()


def ask_good(address, model):
    signature, input_name, texts = GOOD[model]
    body = {"signature_name": signature, "inputs": {input_name: texts}}
    status, _, answer = send(
        address, "POST", f"/v1/models/{model}:predict", json.dumps(body).encode()
    )
    assert status == 200, answer
    return json.loads(answer)


# ---- what is drawn -------------------------------------------------------

strings = st.text(st.characters(exclude_categories=["Cs"]), max_size=20)
b64 = st.binary(max_size=12).map(lambda b: {"b64": base64.b64encode(b).decode()})
json_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**30), 10**30),
    st.floats(),  # NaN and Infinity among them: JSON to both parsers
    strings,
    b64,
)
json_values = st.recursive(
    json_leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.text(max_size=8), children, max_size=3),
    ),
    max_leaves=10,
)
SIGNATURES = (
    "serving_default",
    "translate_with_alignment",
    "score",
    "__saved_model_init_op",
    "Serving_Default",
    "",
    "nope",
)
INPUT_NAMES = ("text", "prompt", "txt")
string_rows = st.lists(st.one_of(strings, b64), max_size=5)
payloads = st.one_of(
    string_rows,
    string_rows,
    json_values,
    st.lists(string_rows, max_size=3),  # [batch, n]
    st.lists(st.one_of(strings, b64, json_values), max_size=4),
)
documents = st.fixed_dictionaries(
    {},
    optional={
        "signature_name": st.one_of(st.sampled_from(SIGNATURES), json_values),
        "instances": st.one_of(
            payloads,
            st.lists(
                st.dictionaries(
                    st.sampled_from(INPUT_NAMES), st.one_of(strings, b64, json_values)
                ),
                max_size=4,
            ),
        ),
        "inputs": st.one_of(
            payloads,
            st.dictionaries(st.sampled_from(INPUT_NAMES), payloads, max_size=2),
        ),
        "other": json_values,
    },
)


def encoded(document) -> bytes:
    return json.dumps(document, ensure_ascii=False).encode("utf-8")


BAD_BYTES = (b"\xff", b"\xc3(", b"\xed\xa0\x80", b"\x80", b"\xf4\x90\x80\x80")


def with_bad_bytes(drawn):
    """Bytes that are not UTF-8 written into the body's first string."""
    body, bad = drawn
    quote_at = body.find(b'"')
    if quote_at < 0:
        return body + bad
    return body[: quote_at + 1] + bad + body[quote_at + 1 :]


bodies = st.one_of(
    documents.map(encoded),
    documents.map(encoded),
    st.tuples(documents.map(encoded), st.integers(0, 10**6)).map(
        lambda drawn: drawn[0][: drawn[1] % max(1, len(drawn[0]))]  # truncated
    ),
    st.binary(max_size=64),
    json_values.map(encoded),
    st.tuples(documents.map(encoded), st.sampled_from(BAD_BYTES)).map(with_bad_bytes),
)
path_text = st.text(st.characters(exclude_categories=["Cs"]), max_size=16).map(
    lambda text: quote(text, safe="/:")
)
paths = st.one_of(
    st.none(),  # the model's own :predict
    st.none(),
    st.sampled_from(
        [
            "/v1/models/{model}/versions/1:predict",
            "/v1/models/{model}/versions/2:predict",
            "/v1/models/{model}/versions/99999999999999999999:predict",
            "/v1/models/{model}/labels/stable:predict",
            "/V1/MODELS/{model}:PREDICT",
            "/v1/models/unknown:predict",
            "/v1/models/{model}:predict/",
            "/v1/models/{model}:predict?signature_name=score",
            "/v1/models/{model}:classify",
            "/v1/models/{model}",
            "/v1/models/{model}/metadata",
            "/v1/models/:predict",
            "/v2/models/{model}:predict",
            "/",
        ]
    ),
    path_text.map(lambda text: "/" + text),
    path_text.map(lambda text: "/v1/" + text),
)
methods = st.sampled_from(["POST"] * 6 + ["GET", "PUT", "DELETE", "PATCH"])


# ---- what TF Serving answers ---------------------------------------------


def _private_use(error):
    """Bytes that are not UTF-8 as characters of plane 15, U+F0000 + byte."""
    bad = error.object[error.start : error.end]
    return "".join(chr(0xF0000 + byte) for byte in bad), error.end


codecs.register_error("rest_fuzz_private_use", _private_use)


def utf8_bytes(text: str) -> bytes:
    """`text` as the bytes the body held (see `parse`)."""
    return b"".join(
        bytes([ord(c) - 0xF0000]) if 0xF0000 <= ord(c) <= 0xF00FF else c.encode()
        for c in text
    )


def has_surrogate(value) -> bool:
    pending = [value]  # no recursion: documents may nest deeper than Python
    while pending:
        value = pending.pop()
        if isinstance(value, str):
            if any(0xD800 <= ord(c) <= 0xDFFF for c in value):
                return True
        elif isinstance(value, list):
            pending.extend(value)
        elif isinstance(value, dict):
            pending.extend(value)
            pending.extend(value.values())
    return False


def parse(body: bytes):
    """The body's JSON document as RapidJSON reads it: strings may hold
    bytes that are not UTF-8 (kept here as plane-15 characters), a lone
    surrogate escape is an error, the first of duplicate keys counts."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        text = body.decode("utf-8", "rest_fuzz_private_use")
    document = json.loads(text, object_pairs_hook=first_of_each_key)
    if has_surrogate(document):  # Python's parser pairs the pairs up
        raise ValueError("The surrogate pair in string is invalid.")
    return document


def first_of_each_key(pairs):
    found = {}
    for key, value in pairs:
        found.setdefault(key, value)
    return found


def texts_of(value):
    """The strings of `value` if it is a list of strings (str, or valid
    `{"b64": ...}`), else None."""
    if not isinstance(value, list):
        return None
    texts = []
    for item in value:
        if isinstance(item, str):
            texts.append(utf8_bytes(item))
        elif isinstance(item, dict) and list(item) == ["b64"]:
            if not isinstance(item["b64"], str):
                return None
            try:
                texts.append(base64.b64decode(item["b64"], validate=True))
            except ValueError:
                return None
        else:
            return None
    return texts


def vector_request(document, input_name):
    """`(form, texts)` when the document asks for a vector of strings (the
    one request a string `[batch]` signature answers), else None."""
    if "instances" in document:
        instances = document["instances"]
        if not isinstance(instances, list) or not instances:
            return None
        if all(isinstance(item, dict) and list(item) != ["b64"] for item in instances):
            if any(sorted(item) != [input_name] for item in instances):
                return None
            texts = texts_of([item[input_name] for item in instances])
        else:
            texts = texts_of(instances)
        return None if texts is None else ("row", texts)
    inputs = document["inputs"]
    if isinstance(inputs, dict) and list(inputs) != ["b64"]:
        if input_name not in inputs:
            return None
        inputs = inputs[input_name]
    texts = texts_of(inputs)
    return None if texts is None else ("columnar", texts)


def check(servers, model, method, path, body, status, content_type, answer):
    """`status`, `content_type` and `answer` are what TF Serving's HTTP port
    answers `method` `path` with `body`."""
    path_only = path.split("?", 1)[0]
    if not V1.fullmatch(path_only):
        assert (status, answer.decode()) == (404, LIBEVENT_404)
        return
    assert content_type == "application/json"
    text = answer.decode("utf-8")  # strict: raises if not UTF-8
    reply = json.loads(text)
    error = None
    if status != 200:
        assert isinstance(reply, dict) and list(reply) == ["error"], reply
        assert isinstance(reply["error"], str)
        error = reply["error"]
    route = None
    if method == "POST":
        route = PREDICT.fullmatch(path_only)
    elif method == "GET":
        route = STATUS.fullmatch(path_only)
    if route is None:
        assert (status, error) == (400, f"Malformed request: {method} {path_only}")
        return
    name, version, label = (
        None
        if part is None
        else unquote_to_bytes(part).decode("utf-8", "backslashreplace")
        for part in route.group(1, 2, 3)
    )
    if version is not None and int(version) > 2**63 - 1:
        assert status == 400 and error.startswith("Failed to convert version")
        return
    if method == "GET" or route.group(4).lower() != "predict":
        assert status == 501  # the stand-in serves :predict only
        return
    try:
        document = parse(body)
    except (ValueError, RecursionError):
        assert status == 400 and error.startswith("JSON Parse error: "), error
        return
    if not isinstance(document, dict):
        assert status == 400
        assert error.startswith("JSON Value: ") and error.endswith(" Is not object")
        return
    signature = document.get("signature_name", "")
    if not isinstance(signature, str):
        assert (status, error) == (400, "'signature_name' key must be a string")
        return
    if label is not None:
        assert (status, error) == (
            400,
            f"Unrecognized servable version label: {label}",
        )
        return
    if name not in servers or version not in (None, "1"):
        which = f"Specific({name}, {int(version)})" if version else f"Latest({name})"
        assert (status, error) == (404, f"Servable not found for request: {which}")
        return
    definitions = servers[name].meta_graph.signature_def
    signature = signature or "serving_default"
    if signature not in definitions:
        assert status == 400 and f'"{signature}" not found' in error, error
        return
    inputs = definitions[signature].inputs
    if not inputs:
        assert (status, error) == (
            400,
            f"Failed to get input map for signature: {signature}",
        )
        return
    if "instances" in document and "inputs" in document:
        assert (
            status == 400 and "expecting only one of 'inputs' or 'instances'" in error
        )
        return
    if "instances" not in document and "inputs" not in document:
        assert (status, error) == (400, "Missing 'inputs' or 'instances' key")
        return
    (input_name,) = inputs
    asked = vector_request(document, input_name)
    if asked is None:
        assert status == 400, (document, reply)
        return
    assert status == 200, (document, reply)
    form, texts = asked
    check_predictions(servers[name], signature, input_name, form, texts, reply)


def check_predictions(server, signature, input_name, form, texts, reply):
    """One answer per text, the Predict API's answer for them."""
    from keras_attn.export._predict import response_arrays
    from serving_standin import predict_request

    request = predict_request(server.model_name, signature, {input_name: texts})
    want = response_arrays(server.predict(request))
    if form == "row":
        assert list(reply) == ["predictions"] and len(reply["predictions"]) == len(
            texts
        )
        rows = reply["predictions"]
        got = (
            {name: [row[name] for row in rows] for name in want}
            if len(want) > 1
            else {next(iter(want)): rows}
        )
    else:
        assert list(reply) == ["outputs"]
        outputs = reply["outputs"]
        got = outputs if len(want) > 1 else {next(iter(want)): outputs}
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        if value.dtype.kind == "O":
            decoded = np.vectorize(lambda b: b.decode("utf-8"), otypes=[object])(value)
            assert np.asarray(got[name], dtype=object).shape == value.shape, name
            assert np.array_equal(np.asarray(got[name], dtype=object), decoded), name
        else:
            np.testing.assert_allclose(
                np.asarray(got[name], dtype=value.dtype).reshape(value.shape),
                value,
                rtol=1e-6,
                err_msg=name,
            )


# ---- the tests ------------------------------------------------------------


@property_settings(60)
@given(model=st.sampled_from(MODELS), method=methods, path=paths, body=bodies)
# Regressions (each crashed the stand-in, or was answered otherwise than by
# the server): a [1, 2] and a [1, 0] string tensor, a scalar (the exports
# flattened them into answers of another batch size); a lone surrogate
# escape; a signature without inputs; nesting deeper than Python recurses;
# bytes that are not UTF-8 inside a string (RapidJSON takes them); a number
# beyond a double; a key given twice (the first counts).
@example(
    model="sentiment", method="POST", path=None, body=b'{"instances": [["a", "b"]]}'
)
@example(model="translator", method="POST", path=None, body=b'{"instances": [[]]}')
@example(model="language_model", method="POST", path=None, body=b'{"inputs": "x"}')
@example(
    model="sentiment", method="POST", path=None, body=b'{"inputs": {"b64": "YQ=="}}'
)
@example(
    model="sentiment", method="POST", path=None, body=b'{"instances": ["\\ud800"]}'
)
@example(
    model="translator",
    method="POST",
    path=None,
    body=b'{"instances": ["\\ud83d\\ude00", "\\\\ud800"]}',
)
@example(
    model="language_model",
    method="POST",
    path=None,
    body=b'{"signature_name": "__saved_model_init_op", "instances": ["a"]}',
)
@example(model="sentiment", method="POST", path=None, body=b"[" * 100_000)
@example(
    model="sentiment",
    method="POST",
    path=None,
    body=b'{"instances": ' + b"[" * 900 + b'"a"' + b"]" * 900 + b"}",
)
@example(
    model="language_model",
    method="POST",
    path=None,
    body=b'{"instances": ["bad \xff\xfe bytes", "\xc3("]}',
)
@example(model="sentiment", method="POST", path=None, body=b'{"instances": [1e400]}')
@example(
    model="translator",
    method="POST",
    path=None,
    body=b'{"instances": ["a"], "instances": 5}',
)
@example(model="sentiment", method="POST", path=None, body=b"")
@example(model="sentiment", method="POST", path="/v1/models/unknown:predict", body=b"{")
def test_drawn_requests(port, model, method, path, body):
    address, servers, _ = port
    path = (path or "/v1/models/{model}:predict").format(model=model)
    status, content_type, answer = send(address, method, path, body)
    check(servers, model, method, path, body, status, content_type, answer)


def test_the_server_answers_as_before_after_the_drawn_requests(port):
    address, _, good = port
    for model in MODELS:
        assert ask_good(address, model) == good[model]
