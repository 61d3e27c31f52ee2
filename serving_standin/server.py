"""`StandInServer`: the project's stand-in for `tensorflow_model_server`.

What it runs is the export itself, loaded as the server loads it (the TF1
loader with the `serve` tag, in a session of its own); what it re-implements
is the server's side around the graph: the Predict API's checks and
conversions (`keras_attn.export._predict`, which the servability check
shares), the REST JSON forms (`rest`) and the merging of requests that
arrive together (`batching.run_batched`).
"""

from __future__ import annotations

import re
import threading
from urllib.parse import unquote_to_bytes

import numpy as np
import tensorflow as tf

from keras_attn.export import _predict
from keras_attn.export._common import read_metadata
from keras_attn.export._predict import PredictError
from keras_attn.export.batching import BATCHING_PARAMS_FILE, BatchingConfig
from keras_attn.export.check import resolve_version_dir
from serving_standin import rest as rest_protocol
from serving_standin.batching import BatchingError, run_batched

# TF Serving's HTTP status for each error code (model_servers/http_server.cc,
# ToHTTPStatusCode); a code not listed is 500.
HTTP_STATUS = {
    "CANCELLED": 499,
    "INVALID_ARGUMENT": 400,
    "FAILED_PRECONDITION": 400,
    "OUT_OF_RANGE": 400,
    "DEADLINE_EXCEEDED": 504,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "ABORTED": 409,
    "PERMISSION_DENIED": 403,
    "UNAUTHENTICATED": 401,
    "RESOURCE_EXHAUSTED": 429,
    "UNAVAILABLE": 503,
    "UNIMPLEMENTED": 501,
    "INTERNAL": 500,
}

# The HTTP server's routing (model_servers/http_server.cc,
# http_rest_api_util.cc): paths under /v1/ go to the REST handler, which
# answers POST `:predict` (and `:classify`, `:regress`) and GET model status
# and metadata; any other path is libevent's 404 page.
REST_PATH = re.compile(r"/v1/.*", re.IGNORECASE)
PREDICT_PATH = re.compile(
    r"/v1/models/([^/:]+)(?:(?:/versions/(\d+))|(?:/labels/([^/:]+)))?"
    r":(classify|regress|predict)",
    re.IGNORECASE,
)
STATUS_PATH = re.compile(
    r"/v1/models(?:/([^/:]+))?(?:(?:/versions/(\d+))|(?:/labels/([^/:]+)))?"
    r"(?:/(metadata))?",
    re.IGNORECASE,
)
NOT_FOUND_PAGE = (
    "<HTML><HEAD>\n<TITLE>404 Not Found</TITLE>\n</HEAD><BODY>\n"
    "<H1>Not Found</H1>\n</BODY></HTML>\n"
)
INT64_MAX = 2**63 - 1


def _op_error_code(error) -> str:
    """The status code name of a `tf.errors.OpError` (`InvalidArgumentError`
    -> "INVALID_ARGUMENT")."""
    name = type(error).__name__.removesuffix("Error")
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper() or "UNKNOWN"


def session_config(intra_op_threads: int = 0, inter_op_threads: int = 0):
    """The `ConfigProto` TF Serving gives its session from
    `--tensorflow_intra_op_parallelism` and `--tensorflow_inter_op_parallelism`
    (server_core's `SessionBundleConfig.session_config`)."""
    for name, value in (
        ("intra_op_threads", intra_op_threads),
        ("inter_op_threads", inter_op_threads),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"`{name}` must be an int >= 0 (0: TensorFlow's choice). "
                f"Received: {name}={value!r}"
            )
    return tf.compat.v1.ConfigProto(
        intra_op_parallelism_threads=intra_op_threads,
        inter_op_parallelism_threads=inter_op_threads,
    )


class StandInServer:
    """One export, loaded as TF Serving loads it, answering Predict calls.

    Args:
        path: an export's version directory, or its model directory (the
            highest version is served, as TF Serving does by default).
        model_name: the name requests address; default the export's.
        batching: a `BatchingConfig` for `predict_together` (default: the
            export's own `batching_params.pbtxt`).
        intra_op_threads, inter_op_threads: the session's thread pools, as
            the server's `--tensorflow_intra_op_parallelism` and
            `--tensorflow_inter_op_parallelism` set them (0, their default,
            lets TensorFlow choose: one thread per core). TensorFlow keeps
            one intra-op pool per process, made by whatever runs first (the
            first session, or an eager op), and one inter-op pool for its
            sessions, made by the first: in a process that has run anything
            before, set `tf.config.threading` the same way first.

    `predict(request)` answers one `PredictRequest` (gRPC);
    `rest(body)` one REST `:predict` body, as `(HTTP status, JSON text)`;
    `predict_together(requests)` requests that arrive together under
    batching; `stub()` an object with `Predict(request, timeout)` like
    `prediction_service_pb2_grpc.PredictionServiceStub`. Calls from several
    threads run concurrently (one TensorFlow session, as in the server).
    """

    def __init__(
        self,
        path,
        model_name: str | None = None,
        batching=None,
        intra_op_threads: int = 0,
        inter_op_threads: int = 0,
    ):
        import tensorflow_text  # noqa: F401 - registers the tokenizers' ops

        self.path = resolve_version_dir(path)
        self.version = int(self.path.name)
        self.metadata = read_metadata(self.path)
        self.model_name = model_name or self.metadata["model_name"]
        if batching is None and (self.path / BATCHING_PARAMS_FILE).is_file():
            batching = BatchingConfig.from_text(
                (self.path / BATCHING_PARAMS_FILE).read_text()
            )
        self.batching = batching
        self._graph = tf.Graph()
        self._session = tf.compat.v1.Session(
            graph=self._graph,
            config=session_config(intra_op_threads, inter_op_threads),
        )
        with self._graph.as_default():
            self.meta_graph = tf.compat.v1.saved_model.loader.load(
                self._session, ["serve"], str(self.path)
            )
        self._lock = threading.Lock()
        self._callables: dict = {}
        self.graph_runs = 0  # calls of the graph (merged batches count once)

    def close(self):
        self._callables.clear()
        self._session.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _run(self, fetches, feed_dict):
        """One run of the graph, as the server's `Session::Run`: no check of
        the fed shapes against the placeholders' (TF1's Python `Session.run`
        refuses a `[batch, n]` or scalar string where `[None]` is declared;
        the server feeds it, and the graph's ops answer), and an op's error
        is a `PredictError` with its status code."""
        from tensorflow.core.protobuf import config_pb2

        with self._lock:
            self.graph_runs += 1
            key = (tuple(feed_dict), tuple(fetches))
            run = self._callables.get(key)
            if run is None:
                options = config_pb2.CallableOptions(
                    feed=list(feed_dict), fetch=list(fetches)
                )
                run = self._session._make_callable_from_options(options)
                self._callables[key] = run
        try:
            return run(*feed_dict.values())
        except tf.errors.OpError as error:
            raise PredictError(_op_error_code(error), error.message) from None

    def _check_model(self, request):
        """ServerCore::GetServableHandle: the model by name, at the version
        asked for (default the one served) or by a version label (this
        stand-in serves none)."""
        spec = request.model_spec
        if spec.version_label:
            raise PredictError(
                "INVALID_ARGUMENT",
                f"Unrecognized servable version label: {spec.version_label}",
            )
        asked = spec.HasField("version")
        if (spec.name and spec.name != self.model_name) or (
            asked and spec.version.value != self.version
        ):
            which = (
                f"Specific({spec.name}, {spec.version.value})"
                if asked
                else f"Latest({spec.name})"
            )
            raise PredictError("NOT_FOUND", f"Servable not found for request: {which}")

    def predict(self, request):
        """The `PredictResponse` for `request`; raises `PredictError`."""
        self._check_model(request)
        return _predict.run_predict(
            self._session, self.meta_graph, request, self.version, run=self._run
        )

    def predict_together(self, requests: list) -> list:
        """Requests arriving together, merged as the server's batching merges
        them (`batching.run_batched`, one merged run per signature and set
        of outputs). Returns, per request, its `PredictResponse`, or the
        `PredictError` / `BatchingError` the server would answer it with."""
        if self.batching is None:
            raise ValueError(
                "`predict_together` needs a batching configuration. Received: "
                "batching=None"
            )
        answers: list = [None] * len(requests)
        groups: dict = {}
        for index, request in enumerate(requests):
            try:
                self._check_model(request)
                name, signature = _predict.signature_for(self.meta_graph, request)
                feeds = _predict.request_feeds(signature, request)
                aliases = _predict.output_names(signature, request)
            except PredictError as error:
                answers[index] = error
                continue
            key = (name, tuple(aliases))
            groups.setdefault(key, []).append((index, dict(feeds)))
        for (name, aliases), members in groups.items():
            signature = self.meta_graph.signature_def[name]
            fetches = [signature.outputs[alias].name for alias in aliases]

            def run(feeds, fetches=fetches, aliases=aliases):
                values = self._run(fetches, feeds)
                return dict(zip(aliases, values, strict=True))

            try:
                outputs = run_batched(
                    run, [feeds for _, feeds in members], self.batching
                )
            except BatchingError as error:
                for index, _ in members:
                    answers[index] = error
                continue
            for (index, _), arrays in zip(members, outputs, strict=True):
                answers[index] = self._response(requests[index], name, arrays)
        return answers

    def _response(self, request, signature_name, arrays):
        from tensorflow_serving.apis import predict_pb2

        response = predict_pb2.PredictResponse()
        response.model_spec.name = request.model_spec.name
        response.model_spec.signature_name = signature_name
        response.model_spec.version.value = self.version
        for alias, value in arrays.items():
            response.outputs[alias].CopyFrom(
                _predict.tensor_proto_as_field(np.asarray(value))
            )
        return response

    def rest(self, body) -> tuple[int, str]:
        """`(HTTP status, JSON text)` for a REST `:predict` body."""
        return self._rest_predict(body, self.model_name)

    def _rest_predict(self, body, model_name: str, version=None, label=None):
        from tensorflow_serving.apis import predict_pb2

        spec = predict_pb2.PredictRequest().model_spec
        spec.name = model_name
        if version is not None:
            spec.version.value = version
        if label is not None:
            spec.version_label = label
        try:
            request, form = rest_protocol.rest_to_request(
                body,
                model_name,
                self.meta_graph,
                find_servable=lambda: self._check_model(_with_spec(spec)),
            )
            if version is not None:
                request.model_spec.version.value = version
            return 200, rest_protocol.response_to_rest(self.predict(request), form)
        except PredictError as error:
            return HTTP_STATUS.get(error.code, 500), rest_protocol.error_to_rest(error)

    def http(self, method: str, path: str, body=b"") -> tuple[int, str, str]:
        """`(HTTP status, content type, body text)` the server's HTTP port
        answers `method` on `path` (a URL's path; a query is ignored) with
        `body`: what `http_server.cc` and `HttpRestApiHandler::ProcessRequest`
        do. POST `/v1/models/<name>[/versions/<n>]:predict` is `rest`; other
        paths under `/v1/` and other methods are refused with
        `Malformed request: <method> <path>` (400); paths outside `/v1/`
        get libevent's 404 page (HTML). The model status, metadata,
        `:classify` and `:regress` resources of the server are not served
        here: 501 with a JSON error that says so."""
        path = path.split("?", 1)[0].split("#", 1)[0]
        if not REST_PATH.fullmatch(path):
            return 404, "text/html", NOT_FOUND_PAGE
        try:
            return self._http(method, path, body)
        except PredictError as error:
            status = HTTP_STATUS.get(error.code, 500)
            return status, "application/json", rest_protocol.error_to_rest(error)

    def _http(self, method, path, body):
        match = None
        if method == "POST":
            match = PREDICT_PATH.fullmatch(path)
        elif method == "GET":
            match = STATUS_PATH.fullmatch(path)
        if match is None:
            raise PredictError(
                "INVALID_ARGUMENT", f"Malformed request: {method} {path}"
            )
        name = unquote_to_bytes(match.group(1) or "").decode("utf-8", "surrogateescape")
        version = match.group(2)
        if version is not None:
            if int(version) > INT64_MAX:
                raise PredictError(
                    "INVALID_ARGUMENT",
                    f"Failed to convert version: {version} to numeric.",
                )
            version = int(version)
        label = match.group(3)
        if method == "GET" or match.group(4).lower() != "predict":
            raise PredictError(
                "UNIMPLEMENTED",
                f"the stand-in answers POST :predict only, not {method} {path}",
            )
        if label is not None:
            label = unquote_to_bytes(label).decode("utf-8", "surrogateescape")
        status, text = self._rest_predict(body, name, version, label)
        return status, "application/json", text

    def stub(self):
        """A `PredictionServiceStub` look-alike answering through `predict`."""
        server = self

        class Stub:
            def Predict(self, request, timeout=None, metadata=None):
                return server.predict(request)

        return Stub()


def _with_spec(spec):
    from tensorflow_serving.apis import predict_pb2

    request = predict_pb2.PredictRequest()
    request.model_spec.CopyFrom(spec)
    return request


def predict_request(model_name: str, signature_name: str, inputs: dict):
    """A `PredictRequest` with `inputs` (`{name: list of str or bytes}`, or
    of ints: an int64 tensor proto, a language model's seeds) as string
    tensor protos, as a client builds it."""
    from tensorflow_serving.apis import predict_pb2

    request = predict_pb2.PredictRequest()
    request.model_spec.name = model_name
    request.model_spec.signature_name = signature_name
    for name, values in inputs.items():
        if values and all(isinstance(v, int) for v in values):
            request.inputs[name].CopyFrom(
                tf.make_tensor_proto(np.array(values, np.int64), dtype=tf.int64)
            )
            continue
        rows = [v.encode("utf-8") if isinstance(v, str) else v for v in values]
        request.inputs[name].CopyFrom(
            tf.make_tensor_proto(
                np.array(rows, dtype=object).reshape(len(rows)), dtype=tf.string
            )
        )
    return request
