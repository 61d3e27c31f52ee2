"""Each task's TF Serving batching parameters, and what batching does to the
exports' answers.

The parameters are checked against TF Serving's own `BatchingParameters`
schema and validation rules. `run_batched` and `StandInServer`
(`serving_standin/`, test tooling outside the installed package) are the
project's stand-in for the server's BatchingSession (merge, pad to an allowed
size, split): the tests on them check that the exports' outputs survive that
merging, not the server itself.
"""

import re

import numpy as np
import pytest
import tensorflow as tf
from google.protobuf import text_format

from keras_attn.export.batching import (
    BATCHING_PARAMS_FILE,
    TASK_BATCHING,
    BatchingConfig,
    task_batching,
)
from serving_standin.batching import BatchingError, run_batched

CONFIG = BatchingConfig(
    max_batch_size=64,
    max_execution_batch_size=8,
    allowed_batch_sizes=(2, 8, 64),
    batch_timeout_micros=1000,
    max_enqueued_batches=8,
)


@pytest.mark.parametrize("task", sorted(TASK_BATCHING))
def test_task_parameters_are_valid_batching_parameters_text(task):
    config = task_batching(task)
    text = config.to_text()
    assert BatchingConfig.from_text(text) == config
    # TF Serving's rule: the last allowed batch size is max_batch_size; the
    # queue has room for the largest request; large requests are split.
    assert config.allowed_batch_sizes[-1] == config.max_batch_size
    assert "enable_large_batch_splitting {\n  value: true\n}" in text
    assert re.search(r"max_execution_batch_size \{\n  value: 32\n\}", text)
    assert config.execution_batch_sizes == (1, 8, 32)


def test_unknown_fields_and_invalid_values_fail_as_in_the_server():
    with pytest.raises(text_format.ParseError, match="max_batch_sizes"):
        BatchingConfig.from_text("max_batch_sizes { value: 8 }")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Last entry in allowed_batch_sizes must match max_batch_size; last "
            "entry was 32; expected 64"
        ),
    ):
        BatchingConfig(64, 32, (1, 32), 0, 4)
    with pytest.raises(ValueError, match="max_enqueued_batches"):
        BatchingConfig(256, 32, (1, 32, 256), 0, 4)  # 4 * 32 < 256
    with pytest.raises(ValueError, match="max_execution_batch_size"):
        BatchingConfig(64, 16, (1, 8, 64), 0, 8)
    with pytest.raises(ValueError, match="allowed_batch_sizes"):
        BatchingConfig(64, 8, (8, 1, 64), 0, 8)
    with pytest.raises(ValueError, match="Received: task='summary'"):
        task_batching("summary")


def recording_run(calls):
    """A graph stand-in: doubles its input and returns a per-row width that
    is fixed, recording the merged batches it is called on."""

    def run(feeds):
        calls.append(feeds["x"].copy())
        x = feeds["x"]
        return {"y": x * 2, "rows": np.tile(x[:, None], (1, 3))}

    return run


def test_requests_are_merged_padded_and_split_as_the_batching_session_does():
    calls = []
    requests = [
        {"x": np.arange(n, dtype="float32") + 10 * i} for i, n in enumerate((3, 1, 13))
    ]
    answers = run_batched(recording_run(calls), requests, CONFIG)
    # Batches of at most 8 rows in arrival order; the 13-row request is split
    # over the rest of the first batch (4 rows) and a second one (8 rows), and
    # one more row; each merged batch is padded to an allowed size with its
    # last request's first row.
    assert [len(c) for c in calls] == [8, 8, 2]
    np.testing.assert_array_equal(calls[0], [0, 1, 2, 10, 20, 21, 22, 23])
    np.testing.assert_array_equal(calls[1], np.arange(24, 32))
    np.testing.assert_array_equal(calls[2], [32, 32])  # 1 row + 1 padding row
    for request, answer in zip(requests, answers, strict=True):
        np.testing.assert_array_equal(answer["y"], request["x"] * 2)
        assert answer["rows"].shape == (len(request["x"]), 3)


def test_what_the_server_refuses():
    run = recording_run([])
    with pytest.raises(
        BatchingError, match="Task size 65 is larger than maximum input batch size 64"
    ):
        run_batched(run, [{"x": np.zeros(65, "float32")}], CONFIG)
    with pytest.raises(BatchingError, match="0 rows"):
        run_batched(run, [{"x": np.zeros(0, "float32")}], CONFIG)

    def batch_dependent_width(feeds):  # like an output padded to the batch's longest
        width = int(feeds["x"].max()) + 1
        return {"y": np.zeros((len(feeds["x"]), width), "float32")}

    # A split request whose parts come back with different widths: TF
    # Serving's tensor::Concat would garble or abort; the stand-in refuses.
    with pytest.raises(BatchingError, match="past the batch axis"):
        run_batched(
            batch_dependent_width, [{"x": np.arange(12, dtype="float32")}], CONFIG
        )


@pytest.mark.tf_only
def test_export_answers_do_not_depend_on_the_merged_batch(small_translator_export):
    """Every output of `translate_with_alignment` has a fixed width
    (`max_length` tokens), so a request's answer under batching is its
    answer alone: same shapes, same strings, floats to rounding, also for a
    request split over several merged batches."""
    from serving_standin import StandInServer, predict_request

    path = small_translator_export
    written = (path / BATCHING_PARAMS_FILE).read_text()
    assert written == task_batching("translation").to_text()
    texts = ["Where is the station?", "", "I am very tired today.", b"bad \xff bytes"]
    sizes = (1, 3, 40, 2)  # 40 rows: over max_execution_batch_size, split
    with StandInServer(path) as server:
        requests = [
            predict_request(
                "translator",
                "translate_with_alignment",
                {"text": [texts[(i + j) % len(texts)] for j in range(size)]},
            )
            for i, size in enumerate(sizes)
        ]
        alone = [server.predict(request) for request in requests]
        runs = server.graph_runs
        together = server.predict_together(requests)
        assert server.graph_runs - runs == 2  # 46 rows: batches of 32 and 14->32
    for one, merged in zip(alone, together, strict=True):
        for name in one.outputs:
            want = tf.make_ndarray(one.outputs[name])
            got = tf.make_ndarray(merged.outputs[name])
            assert got.shape == want.shape, name
            if want.dtype.kind == "f":
                np.testing.assert_allclose(got, want, atol=1e-5)
            else:
                np.testing.assert_array_equal(got, want)
