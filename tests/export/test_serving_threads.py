"""Session thread pools as tensorflow_model_server sets them
(`--tensorflow_intra_op_parallelism`, `--tensorflow_inter_op_parallelism`):
the stand-in server takes them, and `benchmarks/serving_profile.py threads`
times an export under several settings, each in a process of its own, and
checks the answers. Speed is not asserted."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.test_case import REPO_ROOT

pytestmark = pytest.mark.tf_only

SCRIPT = os.path.join(REPO_ROOT, "benchmarks", "serving_profile.py")


def run_script(script, *arguments):
    """`python script arguments...` from the repository root, its output
    captured (10 minutes at most)."""
    return subprocess.run(
        [sys.executable, script, *arguments],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=600,
    )


def test_session_config_is_the_servers_and_refuses_bad_counts():
    from serving_standin.server import session_config

    config = session_config(intra_op_threads=1, inter_op_threads=2)
    assert config.intra_op_parallelism_threads == 1
    assert config.inter_op_parallelism_threads == 2
    default = session_config()
    assert default.intra_op_parallelism_threads == 0  # TensorFlow's choice
    assert default.inter_op_parallelism_threads == 0
    for name, value in (
        ("intra_op_threads", -1),
        ("inter_op_threads", 1.5),
        ("intra_op_threads", True),
    ):
        with pytest.raises(ValueError, match=rf"`{name}` must be an int >= 0.*"):
            session_config(**{name: value})


def test_a_server_with_one_thread_answers_as_the_default(small_translator_export):
    from keras_attn.export._predict import response_arrays
    from serving_standin import StandInServer, predict_request

    batch = ["Where is the station?", "I am tired.", "a good film"]
    answers = []
    for threads in ({}, {"intra_op_threads": 1, "inter_op_threads": 1}):
        with StandInServer(small_translator_export, **threads) as server:
            request = predict_request(
                server.model_name, "serving_default", {"text": batch}
            )
            answers.append(response_arrays(server.predict(request)))
    assert sorted(answers[0]) == sorted(answers[1])
    for name, value in answers[0].items():
        np.testing.assert_array_equal(answers[1][name], value, err_msg=name)


def test_threads_times_each_setting_in_its_own_process(small_translator_export):
    done = run_script(
        SCRIPT, "threads", str(small_translator_export),
        "--settings", "0:0,1:1", "--rounds", "1", "--calls", "1",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| intra:inter |")
    labels = []
    for row in rows[1:]:
        match = re.fullmatch(
            r"\| (\S+) \| ([0-9.]+) \| ([0-9.]+)x \| ([0-9.]+) \| ([0-9.]+)x \| "
            r"(equal|DIFFERENT) \|",
            row,
        )
        assert match, row
        labels.append(match.group(1))
        # Thread counts do not change what the graph computes.
        assert match.group(6) == "equal", row
    assert labels == ["auto:auto", "1:1"]
    assert rows[1].split("|")[3].strip() == "1.00x"  # the first is the reference


def test_one_setting_reports_latencies_and_the_answers(small_translator_export):
    done = run_script(
        SCRIPT, "_time", str(small_translator_export),
        "--intra-op-threads", "1", "--calls", "2",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    timed = json.loads(done.stdout.splitlines()[-1])
    assert sorted(timed["p50_ms"]) == ["1", "16"]
    assert all(value > 0 for value in timed["p50_ms"].values())
    # Up to 8 calls' answers per batch size, here every call: 3 warm-up and 2
    # timed at batch 1, then at 16; each the signature's outputs sorted by
    # name (`translation` alone here).
    assert [len(answer[0]) for answer in timed["answers"]] == [1] * 5 + [16] * 5


def test_bad_settings_are_refused_with_what_was_received():
    sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
    try:
        import serving_profile
    finally:
        sys.path.pop(0)
    assert serving_profile.parse_settings("0:0,1:2") == [(0, 0), (1, 2)]
    for text in ("1", "1:x", "1:2:3", "-1:1"):
        with pytest.raises(ValueError, match=r"INTRA:INTER.*Received: '"):
            serving_profile.parse_settings(text)


def test_serving_bench_serves_with_the_threads_it_is_given(small_sentiment_export):
    done = run_script(
        os.path.join(REPO_ROOT, "benchmarks", "serving_bench.py"),
        "--tasks", "sentiment",
        "--sentiment-export", str(small_sentiment_export),
        "--threads", "2", "--batch-sizes", "1",
        "--seconds", "0.5", "--calls", "2",
        "--rounds", "1", "--warmup-rounds", "1",
        "--intra-op-threads", "1", "--inter-op-threads", "2",
        "--sentiment-texts", "test",
        "--kernels", "eigen",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Session threads: intra-op 1, inter-op 2 (" in done.stdout
    # TensorFlow's own answer in the benchmark's process: the kernels of TF
    # Serving's release binaries, whatever the test process runs.
    assert "Kernels: Eigen (TF_ENABLE_ONEDNN_OPTS=0)" in done.stdout
    assert "Sentiment texts: the movie reviews' test split (1030 texts)" in done.stdout
    load = [
        line
        for line in done.stdout.splitlines()
        if re.match(r"\| sentiment \| 2 \| 1 \|", line)
    ]
    assert len(load) == 1, done.stdout
    # Two clients at once: no errors, every answer the one it got alone.
    assert load[0].rstrip().endswith("| 0 | 0 |"), load[0]
