"""`StandInServer`: the project's stand-in for `tensorflow_model_server`.

What it runs is the export itself, loaded as the server loads it (the TF1
loader with the `serve` tag, in a session of its own); what it re-implements
is the server's side around the graph: the Predict API's checks and
conversions (`keras_attn.export._predict`, which the servability check
shares), the REST JSON forms (`rest`) and the merging of requests that
arrive together (`batching.run_batched`).
"""

from __future__ import annotations

import threading

import numpy as np
import tensorflow as tf

from keras_attn.export import _predict
from keras_attn.export._common import read_metadata
from keras_attn.export._predict import PredictError
from keras_attn.export.batching import BATCHING_PARAMS_FILE, BatchingConfig
from keras_attn.export.check import resolve_version_dir
from serving_standin import rest as rest_protocol
from serving_standin.batching import BatchingError, run_batched

# TF Serving's HTTP status for each error code (util/status_util.cc).
HTTP_STATUS = {
    "INVALID_ARGUMENT": 400,
    "FAILED_PRECONDITION": 400,
    "OUT_OF_RANGE": 400,
    "NOT_FOUND": 404,
    "RESOURCE_EXHAUSTED": 429,
    "UNAVAILABLE": 503,
    "INTERNAL": 500,
}


class StandInServer:
    """One export, loaded as TF Serving loads it, answering Predict calls.

    Args:
        path: an export's version directory, or its model directory (the
            highest version is served, as TF Serving does by default).
        model_name: the name requests address; default the export's.
        batching: a `BatchingConfig` for `predict_together` (default: the
            export's own `batching_params.pbtxt`).

    `predict(request)` answers one `PredictRequest` (gRPC);
    `rest(body)` one REST `:predict` body, as `(HTTP status, JSON text)`;
    `predict_together(requests)` requests that arrive together under
    batching; `stub()` an object with `Predict(request, timeout)` like
    `prediction_service_pb2_grpc.PredictionServiceStub`. Calls from several
    threads run concurrently (one TensorFlow session, as in the server).
    """

    def __init__(self, path, model_name: str | None = None, batching=None):
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
        self._session = tf.compat.v1.Session(graph=self._graph)
        with self._graph.as_default():
            self.meta_graph = tf.compat.v1.saved_model.loader.load(
                self._session, ["serve"], str(self.path)
            )
        self._lock = threading.Lock()
        self.graph_runs = 0  # calls of the graph (merged batches count once)

    def close(self):
        self._session.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _run(self, fetches, feed_dict):
        with self._lock:
            self.graph_runs += 1
        return self._session.run(fetches, feed_dict=feed_dict)

    def _check_model(self, request):
        if request.model_spec.name and request.model_spec.name != self.model_name:
            raise PredictError(
                "NOT_FOUND",
                f"Servable not found for request: Latest({request.model_spec.name})",
            )

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
        try:
            request, form = rest_protocol.rest_to_request(
                body, self.model_name, self.meta_graph
            )
            return 200, rest_protocol.response_to_rest(self.predict(request), form)
        except PredictError as error:
            return HTTP_STATUS.get(error.code, 500), rest_protocol.error_to_rest(error)

    def stub(self):
        """A `PredictionServiceStub` look-alike answering through `predict`."""
        server = self

        class Stub:
            def Predict(self, request, timeout=None, metadata=None):
                return server.predict(request)

        return Stub()


def predict_request(model_name: str, signature_name: str, inputs: dict):
    """A `PredictRequest` with `inputs` (`{name: list of str or bytes}`) as
    string tensor protos, as a client builds it."""
    from tensorflow_serving.apis import predict_pb2

    request = predict_pb2.PredictRequest()
    request.model_spec.name = model_name
    request.model_spec.signature_name = signature_name
    for name, values in inputs.items():
        rows = [v.encode("utf-8") if isinstance(v, str) else v for v in values]
        request.inputs[name].CopyFrom(
            tf.make_tensor_proto(
                np.array(rows, dtype=object).reshape(len(rows)), dtype=tf.string
            )
        )
    return request
