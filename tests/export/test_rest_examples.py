"""TF Serving's REST and gRPC forms, and the examples of docs/SERVING.md run.

The page's request bodies and client code are executed against small
exports of each task: the export is the real one, loaded as TF Serving
loads it; the REST handler, the Predict conversions and (for the gRPC
client) the service behind a real gRPC channel are the project's stand-in
for the server (`serving_standin.StandInServer`, test tooling outside the
installed package), not the server.
"""

import base64
import json
import re
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from keras_attn.export.check import rest_examples

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "SERVING.md"
MORE = "…"


def test_one_output_signatures_answer_with_bare_values():
    requests = {
        "serving_default": {"text": ["a", "b"]},
        "translate_with_alignment": {"text": ["a", "b"]},
    }
    responses = {
        "serving_default": {"translation": ["x", "y"]},
        "translate_with_alignment": {
            "translation": ["x", "y"],
            "alignment": [[[0.1]], [[1.0]]],
        },
    }
    triples = rest_examples("translator", requests, responses)
    assert [t[0] for t in triples] == ["/v1/models/translator:predict"] * 3
    row, column, aligned = [(json.loads(b), json.loads(r)) for _, b, r in triples]
    assert row == ({"instances": ["a", "b"]}, {"predictions": ["x", "y"]})
    assert column == (
        {"signature_name": "serving_default", "inputs": {"text": ["a", "b"]}},
        {"outputs": ["x", "y"]},
    )
    assert aligned[1] == {
        "outputs": {"translation": ["x", "y"], "alignment": [[[0.1]], [[1.0]]]}
    }


def test_floats_are_written_as_float32():
    responses = {"score": {"log_likelihood": [-41.20000076293945], "num_tokens": [12]}}
    ((_, body, response),) = rest_examples("lm", {"score": {"text": ["t"]}}, responses)
    assert json.loads(body) == {"signature_name": "score", "inputs": {"text": ["t"]}}
    assert json.loads(response) == {
        "outputs": {"log_likelihood": [-41.2], "num_tokens": [12]}
    }
    # The server's digits: %g when it reads back as the same float32, else %.9g.
    ((_, _, response),) = rest_examples(
        "lm", {"score": {"text": ["t"]}}, {"score": {"log_likelihood": [0.99928117]}}
    )
    assert response == '{"outputs": [0.999281168]}'


def page_region(name: str) -> str:
    text = PAGE.read_text(encoding="utf-8")
    match = re.search(
        rf"<!-- serving-examples:{name} -->\n(.*?)<!-- /serving-examples:{name} -->",
        text,
        re.S,
    )
    assert match, f"docs/SERVING.md has no region {name}"
    return match.group(1)


def page_block(marker: str) -> str:
    blocks = re.findall(
        r"^```python[^\n]*\n(.*?)^```", PAGE.read_text(encoding="utf-8"), re.M | re.S
    )
    (block,) = [b for b in blocks if marker in b]
    return block


def documented_curls():
    """`(model, body, shown answer)` of each curl example on the page."""
    regions = "".join(
        page_region(f"rest-{model}")
        for model in ("sentiment", "translator", "language_model")
    )
    examples = re.findall(
        r"curl -s localhost:8501/v1/models/(\w+):predict \\\n  -d '(.*)'\n# (.*)\n",
        regions,
    )
    return [
        (model, json.loads(body), json.loads(answer))
        for model, body, answer in examples
    ]


def same_structure(shown, actual, where="answer"):
    """The documented answer has the structure of the actual one: the same
    keys, nesting and JSON types, and the same list lengths (a list cut with
    "…" holds at least the items shown)."""
    if isinstance(shown, dict):
        assert isinstance(actual, dict) and sorted(shown) == sorted(actual), where
        for key in shown:
            same_structure(shown[key], actual[key], f"{where}.{key}")
    elif isinstance(shown, list):
        assert isinstance(actual, list), where
        cut = bool(shown) and shown[-1] == MORE
        items = shown[:-1] if cut else shown
        if cut:
            assert len(actual) > len(items), where
        else:
            assert len(actual) == len(items), where
        for index, item in enumerate(items):
            same_structure(item, actual[index], f"{where}[{index}]")
    elif isinstance(shown, str):
        assert isinstance(actual, str), where
    else:
        assert isinstance(shown, (int, float)) and isinstance(actual, (int, float)), (
            where
        )


@pytest.fixture(scope="module")
def servers(
    small_sentiment_export, small_translator_export, small_language_model_export
):
    from serving_standin import StandInServer

    servers = {
        "sentiment": StandInServer(small_sentiment_export),
        "translator": StandInServer(small_translator_export),
        "language_model": StandInServer(small_language_model_export),
    }
    yield servers
    for server in servers.values():
        server.close()


@pytest.mark.tf_only
def test_every_documented_rest_body_is_answered_as_shown(servers):
    examples = documented_curls()
    assert sorted({model for model, _, _ in examples}) == sorted(servers)
    assert any("b64" in json.dumps(body) for _, body, _ in examples)
    for model, body, shown in examples:
        status, answer = servers[model].rest(json.dumps(body))
        assert status == 200, (body, answer)
        same_structure(shown, json.loads(answer), f"{model} {body}")


class RestHandler(BaseHTTPRequestHandler):
    """POST /v1/models/<name>:predict -> the stand-in's REST answer."""

    servers: dict = {}

    def do_POST(self):
        name = re.fullmatch(r"/v1/models/(\w+):predict", self.path).group(1)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        status, answer = self.servers[name].rest(body)
        data = answer.encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.mark.tf_only
def test_the_rest_client_of_the_page_over_http(servers):
    from keras_attn.export._predict import response_arrays
    from serving_standin import predict_request

    client = {}
    exec(page_block("def rest_body("), client)
    texts = ["A witty film.", b"bad bytes \xff\xfe", "", "Gr\u00fc\u00dfe!"]
    row = json.loads(client["rest_body"](texts))
    assert row["instances"][1] == {"b64": base64.b64encode(texts[1]).decode()}
    assert row["instances"][3] == "Gr\u00fc\u00dfe!"  # valid UTF-8 goes as text
    RestHandler.servers = servers
    http = ThreadingHTTPServer(("127.0.0.1", 0), RestHandler)
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    host = f"http://127.0.0.1:{http.server_address[1]}"
    try:
        answer = client["rest_predict"]("sentiment", client["rest_body"](texts), host)
        columns = client["rest_predict"](
            "sentiment",
            client["rest_body"](texts, "serving_default", columnar=True),
            host,
        )
        scores = client["rest_predict"](
            "language_model",
            client["rest_body"](["To be", "or not"], "score", columnar=True),
            host,
        )
    finally:
        http.shutdown()
    # The same texts as a gRPC client sends them (bytes, unencoded).
    want = response_arrays(
        servers["sentiment"].predict(predict_request("sentiment", "", {"text": texts}))
    )
    labels = [label.decode() for label in want["label"]]
    assert [p["label"] for p in answer["predictions"]] == labels
    assert columns["outputs"]["label"] == labels
    np.testing.assert_allclose(
        columns["outputs"]["positive_probability"],
        want["positive_probability"],
        rtol=1e-6,
    )
    assert sorted(scores["outputs"]) == [
        "log_likelihood",
        "model_log_likelihood",
        "num_tokens",
    ]


@pytest.mark.tf_only
def test_the_grpc_client_of_the_page_over_a_grpc_channel(servers):
    import grpc
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    from keras_attn.export._predict import (
        PredictError,
        tensor_proto_as_field,
    )

    class Service(prediction_service_pb2_grpc.PredictionServiceServicer):
        def Predict(self, request, context):
            if request.model_spec.name == "large":  # a 5 MB answer
                response = predict_pb2.PredictResponse()
                response.outputs["alignment"].CopyFrom(
                    tensor_proto_as_field(np.zeros((1250, 1000), "float32"))
                )
                return response
            try:
                return servers[request.model_spec.name].predict(request)
            except PredictError as error:
                context.abort(getattr(grpc.StatusCode, error.code), error.message)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(
        Service(), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = {}
    exec(page_block("def translate_with_alignment("), client)
    try:
        stub = client["connect"](f"127.0.0.1:{port}")
        texts = ["Where is the station?", b"bad \xff bytes", ""]
        results = client["translate_with_alignment"](stub, texts)
        # Replies over gRPC's default 4 MB pass the page's channel, not a default one.
        big = predict_pb2.PredictRequest()
        big.model_spec.name = "large"
        assert stub.Predict(big, 30.0).outputs["alignment"].float_val[0] == 0.0
        plain = prediction_service_pb2_grpc.PredictionServiceStub(
            grpc.insecure_channel(f"127.0.0.1:{port}")
        )
        with pytest.raises(grpc.RpcError) as error:
            plain.Predict(big, 30.0)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        server.stop(None)
    assert client["MAX_MESSAGE_BYTES"] > 5_000_000
    # What the client read is what the export answers, token by token.
    loaded = tf.saved_model.load(str(servers["translator"].path))
    outputs = loaded.signatures["translate_with_alignment"](text=tf.constant(texts))
    for row, result in enumerate(results):
        assert result["translation"] == outputs["translation"].numpy()[row].decode()
        source = [t.decode() for t in outputs["source_tokens"].numpy()[row] if t]
        target = [t.decode() for t in outputs["translation_tokens"].numpy()[row] if t]
        weights = outputs["alignment"].numpy()[row]
        assert [token for token, _ in result["aligned"]] == target
        for index, (_, aligned) in enumerate(result["aligned"]):
            want = (
                source[int(weights[index, : len(source)].argmax())] if source else None
            )
            assert aligned == want
    assert results[2]["aligned"] == [] or all(
        a is None for _, a in results[2]["aligned"]
    )


@pytest.mark.tf_only
def test_the_configuration_files_of_the_page_parse_as_the_server_parses_them():
    import tensorflow as tf
    from google.protobuf import text_format
    from tensorflow_serving.config import model_server_config_pb2

    from keras_attn.export.batching import task_batching
    from keras_attn.export.releases import release_for_tensorflow

    text = PAGE.read_text(encoding="utf-8")
    blocks = re.findall(r"^```text\n(.*?)^```", text, re.M | re.S)
    (models,) = [b for b in blocks if b.startswith("model_config_list")]
    config = text_format.Parse(models, model_server_config_pb2.ModelServerConfig())
    translator = config.model_config_list.config[0]
    assert list(translator.model_version_policy.specific.versions) == [1, 2]
    assert dict(translator.version_labels) == {"stable": 1, "canary": 2}
    (monitoring,) = [b for b in blocks if b.startswith("prometheus_config")]
    assert monitoring == (
        "prometheus_config {\n"
        "  enable: true\n"
        '  path: "/monitoring/prometheus/metrics"\n'
        "}\n"
    )
    shown = page_region("batching-translation")
    assert shown == "```text\n" + task_batching("translation").to_text() + "```\n"
    for task, row in (("sentiment", "sentiment"), ("translation", "translation")):
        timeout = task_batching(task).batch_timeout_micros
        assert re.search(
            rf"\| {row} \|[^\n]*batch_timeout_micros \{{ value: {timeout} \}}", text
        )
    image = release_for_tensorflow(tf.__version__).docker_image
    for page in (PAGE, REPO / "README.md"):
        commands = re.findall(
            r"-e MODEL_NAME=\w+ (tensorflow/serving\S*)", page.read_text()
        )
        assert commands and set(commands) == {image}, page.name
