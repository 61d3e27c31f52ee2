"""TF Serving's REST predict formats, as `check --example` prints them."""

import json

from keras_attn.export.check import rest_examples


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
