"""The stand-in's Predict API and REST conversions against the rules of TF
Serving's sources they follow (predict_util.cc, saved_model::GetInputValues,
json_tensor.cc). These test the project's stand-in for the server
(`serving_standin/`, test tooling outside the installed package), which the
REST and gRPC examples of docs/SERVING.md run against, and the Predict
checks and float digits it shares with `check_servable`
(`keras_attn.export._predict`); the requests it refuses are refused before
the graph runs, as in the server, and a good request afterwards is answered
as before."""

import base64
import json

import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2

from keras_attn.export._predict import (
    PredictError,
    format_float,
    response_arrays,
    tensor_proto_as_field,
)
from serving_standin import StandInServer, predict_request

pytestmark = pytest.mark.tf_only


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0.2, "0.2"),  # %g reads back as the same float32
        (1.0, "1.0"),  # whole numbers get ".0"
        (9000000.0, "9e+06"),
        (0.00003, "3e-05"),
        (0.99928117, "0.999281168"),  # %g does not read back: %.9g
        (float("nan"), "NaN"),
        (float("-inf"), "-Infinity"),
    ],
)
def test_floats_are_written_as_the_server_writes_them(value, text):
    assert format_float(value) == text


def test_responses_hold_values_in_typed_fields():
    proto = tensor_proto_as_field(np.array([[0.5, 1.0]], "float32"))
    assert not proto.tensor_content and list(proto.float_val) == [0.5, 1.0]
    assert list(tensor_proto_as_field(np.array([3, 4], "int32")).int_val) == [3, 4]


@pytest.fixture(scope="module")
def server(small_sentiment_export):
    with StandInServer(small_sentiment_export) as server:
        yield server


def good_answer(server):
    request = predict_request("sentiment", "serving_default", {"text": ["a film"]})
    return response_arrays(server.predict(request))


def refused(server, request, message):
    """`request` is refused with `message`, before any graph run, and the
    next good request is answered as before."""
    before = good_answer(server)
    runs = server.graph_runs
    with pytest.raises(PredictError) as error:
        server.predict(request)
    assert error.value.message == message
    assert server.graph_runs == runs  # only the good request ran the graph
    after = good_answer(server)
    for name, value in before.items():
        np.testing.assert_array_equal(after[name], value)


def test_wrong_input_names_and_dtypes_are_refused_before_the_graph_runs(server):
    request = predict_pb2.PredictRequest()
    request.inputs["txt"].CopyFrom(tf.make_tensor_proto([b"a film"]))
    refused(
        server,
        request,
        "Signature input alias: text(feed name: serving_default_text:0) not found "
        "in request and no default value provided. Inputs expected to be in the "
        "request {txt}, or default input alias set: ",
    )
    request.inputs["text"].CopyFrom(tf.make_tensor_proto([b"a film"]))
    refused(
        server,
        request,
        "input size does not match signature: 2!=1 len({text,txt}) != len({text}). "
        "Sent extra: {txt}. Missing but required: {}.",
    )
    request = predict_pb2.PredictRequest()
    request.inputs["text"].CopyFrom(tf.make_tensor_proto([1, 2], dtype=tf.int32))
    refused(server, request, "Expects arg[0] to be string but int32 is provided")
    request.model_spec.signature_name = "classify"
    refused(server, request, 'Serving signature key "classify" not found.')
    request = predict_request("sentiment", "", {"text": ["a film"]})
    request.output_filter.append("score")
    refused(
        server,
        request,
        "output tensor alias not found in signature: score Outputs expected to "
        "be in the set {label,positive_probability}.",
    )


def test_output_filter_and_default_signature(server):
    request = predict_request("sentiment", "", {"text": ["a film", "a dull film"]})
    request.output_filter.append("label")
    response = server.predict(request)
    assert response.model_spec.signature_name == "serving_default"
    assert response.model_spec.version.value == 1
    assert list(response.outputs) == ["label"]


def rest(server, body):
    status, text = server.rest(json.dumps(body))
    return status, json.loads(text)


def test_rest_row_and_columnar_forms_with_b64_strings(server):
    texts = [b"a witty film", b"bad bytes \xff\xfe", b""]
    want = response_arrays(
        server.predict(predict_request("sentiment", "", {"text": texts}))
    )
    probabilities = want["positive_probability"].tolist()
    labels = [label.decode() for label in want["label"]]
    values = ["a witty film", {"b64": base64.b64encode(texts[1]).decode()}, ""]
    status, row = rest(server, {"instances": values})
    assert status == 200
    assert [p["label"] for p in row["predictions"]] == labels
    np.testing.assert_allclose(
        [p["positive_probability"] for p in row["predictions"]], probabilities
    )
    status, column = rest(
        server, {"signature_name": "serving_default", "inputs": {"text": values}}
    )
    assert status == 200 and column["outputs"]["label"] == labels
    # The one-input shorthand and the named-object rows give the same answer.
    assert rest(server, {"inputs": values}) == (200, column)
    assert rest(server, {"instances": [{"text": v} for v in values]}) == (200, row)
    # Floats are written with the server's digits.
    _, text = server.rest(json.dumps({"inputs": values}))
    assert f'"positive_probability": [{format_float(probabilities[0])}, ' in text


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (
            {"instances": []},
            400,
            """JSON Value: {"instances":[]} No values in 'instances' array""",
        ),
        ({"text": ["a"]}, 400, "Missing 'inputs' or 'instances' key"),
        (
            {"inputs": {"txt": ["a"]}},
            400,
            "Missing named input: text in 'inputs' object.",
        ),
        (
            {"instances": [1]},
            400,
            "Failed to process element: 0 of 'instances' list. Error: "
            "INVALID_ARGUMENT: JSON Value: 1 Type: Number is not of expected "
            "type: string",
        ),
        (
            {"inputs": [{"b64": "not base64!"}]},
            400,
            "Unable to base64 decode",
        ),
        (
            {"signature_name": "nope", "inputs": ["a"]},
            400,
            'Serving signature key "nope" not found.',
        ),
    ],
)
def test_rest_errors(server, body, status, message):
    before = good_answer(server)
    assert rest(server, body) == (status, {"error": message})
    after = good_answer(server)
    np.testing.assert_array_equal(
        after["positive_probability"], before["positive_probability"]
    )


def test_rest_empty_columnar_batch_and_answers_of_arrays(small_translator_export):
    with StandInServer(small_translator_export) as server:
        status, body = rest(server, {"inputs": {"text": []}})
        assert (status, body) == (200, {"outputs": []})
        status, body = rest(
            server,
            {"signature_name": "translate_with_alignment", "instances": ["Where?", ""]},
        )
        assert status == 200 and len(body["predictions"]) == 2
        first = body["predictions"][0]
        assert sorted(first) == [
            "alignment",
            "source_tokens",
            "translation",
            "translation_tokens",
        ]
        assert np.shape(first["alignment"]) == (10, 10)  # max_length x max_length
