"""benchmarks/serving_profile.py's `floor` at tiny sizes: both dtypes timed,
with the bytes of weights a call reads. Speed is not asserted."""

import os
import re
import subprocess
import sys

import pytest

from tests.test_case import REPO_ROOT

SCRIPT = os.path.join(REPO_ROOT, "benchmarks", "serving_profile.py")


@pytest.mark.tf_only
@pytest.mark.parametrize(("setting", "state"), [("1", "on"), ("0", "off")])
def test_floor_times_the_products_in_both_dtypes(setting, state):
    # pip's TensorFlow turns oneDNN on by default only on CPUs with AVX-512
    # or AMX; the setting makes the report's first line the same anywhere.
    env = {**os.environ, "TF_ENABLE_ONEDNN_OPTS": setting}
    done = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "floor",
            "--rows",
            "2",
            "--blocks",
            "2",
            "--width",
            "8",
            "--intermediate",
            "16",
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0] == f"2 blocks of width 8 and 16, 2 rows, oneDNN {state}"
    # 2 blocks x (4 x 8 x 8 + 2 x 8 x 16) = 1,024 weights.
    for line, dtype, size in zip(
        lines[1:], ("float32", "bfloat16"), (4, 2), strict=True
    ):
        match = re.fullmatch(
            rf"{dtype}: p50 ([0-9.]+) ms, [0-9.]+ MB of weights per call "
            r"\(([0-9]+) bytes\)",
            line,
        )
        assert match, line
        assert float(match.group(1)) > 0
        assert int(match.group(2)) == 1024 * size
