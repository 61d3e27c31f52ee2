"""Two JAX processes on localhost train one model data parallel
(`initialize_processes`, `keras.distribution.DataParallel`, `fit` on a
`tf.data.Dataset` that Keras shards per process) and resume with
`MultiProcessBackupAndRestore` after a process dies (large: seven
processes, about two minutes on 2 cores); and, fast, the checks of
`initialize_processes`'s arguments and the callback in one process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import keras
import numpy as np
import pytest

from keras_attn.training.multi_process import (
    MultiProcessBackupAndRestore,
    initialize_processes,
    resolve_process_arguments,
)
from tests.test_case import REPO_ROOT, xla_flags_with_devices

WORKER = os.path.join(REPO_ROOT, "tests", "training", "two_process_worker.py")
TIMEOUT = 240  # seconds a run may take: a safety net, asserted not reached
HEARTBEAT = 10  # seconds: JAX's heartbeat timeout in the workers


# ---------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    "arguments, message",
    [
        (("127.0.0.1:1234", 0, 0), "`num_processes` must be a positive int"),
        (("127.0.0.1:1234", "2", 0), "Received: num_processes='2'"),
        (("127.0.0.1:1234", True, 0), "Received: num_processes=True"),
        (("127.0.0.1:1234", None, 0), "Received: num_processes=None"),
        (("127.0.0.1:1234", 2, 2), "Received: process_id=2"),
        (("127.0.0.1:1234", 2, -1), "Received: process_id=-1"),
        (("127.0.0.1:1234", 2, None), "Received: process_id=None"),
        ((None, 2, 0), "Received: coordinator_address=None"),
        (("127.0.0.1", 2, 0), "Received: coordinator_address='127.0.0.1'"),
        (("127.0.0.1:0", 2, 0), "port from 1 to 65535"),
        (("127.0.0.1:http", 2, 0), "Received: coordinator_address='127.0.0.1:http'"),
        (("a:1,b:2,c:3", 2, 0), "3 addresses for num_processes=2"),
    ],
)
def test_bad_arguments_are_named(monkeypatch, arguments, message):
    for variable in (
        "KERAS_DISTRIBUTION_JOB_ADDRESSES",
        "KERAS_DISTRIBUTION_NUM_PROCESSES",
        "KERAS_DISTRIBUTION_PROCESS_ID",
    ):
        monkeypatch.delenv(variable, raising=False)
    with pytest.raises(ValueError) as error:
        initialize_processes(*arguments)
    assert message in str(error.value)


@pytest.mark.parametrize(
    "name", ["initialization_timeout", "heartbeat_timeout", "shutdown_timeout"]
)
@pytest.mark.parametrize("value", [0, -5, 2.5, None, True])
def test_bad_timeouts_are_named(name, value):
    with pytest.raises(ValueError) as error:
        initialize_processes("127.0.0.1:1234", 2, 0, **{name: value})
    assert f"`{name}` must be a positive whole number of seconds" in str(error.value)
    assert f"Received: {name}={value!r}" in str(error.value)


def test_arguments_from_keras_environment_variables(monkeypatch):
    monkeypatch.setenv("KERAS_DISTRIBUTION_JOB_ADDRESSES", "10.0.0.1:1234,10.0.0.2:99")
    monkeypatch.setenv("KERAS_DISTRIBUTION_NUM_PROCESSES", "2")
    monkeypatch.setenv("KERAS_DISTRIBUTION_PROCESS_ID", "1")
    assert resolve_process_arguments() == ("10.0.0.1:1234", 2, 1)
    # Arguments win over the variables.
    assert resolve_process_arguments("h:5", 3, 2) == ("h:5", 3, 2)
    monkeypatch.setenv("KERAS_DISTRIBUTION_PROCESS_ID", "one")
    with pytest.raises(ValueError, match="KERAS_DISTRIBUTION_PROCESS_ID gives 'one'"):
        resolve_process_arguments()


def test_one_process_starts_nothing(monkeypatch):
    for variable in (
        "KERAS_DISTRIBUTION_JOB_ADDRESSES",
        "KERAS_DISTRIBUTION_NUM_PROCESSES",
        "KERAS_DISTRIBUTION_PROCESS_ID",
    ):
        monkeypatch.delenv(variable, raising=False)
    assert resolve_process_arguments() == (None, 1, 0)  # nothing given or set
    initialize_processes(None, 1, 0)  # on any backend
    initialize_processes()
    if keras.backend.backend() == "jax":
        import jax

        assert jax.process_count() == 1
    else:
        with pytest.raises(ValueError, match="needs the JAX backend"):
            initialize_processes("127.0.0.1:1234", 2, 0)


# ------------------------------------------------- the callback, one process


def test_backup_resumes_from_the_last_epoch_in_one_process(tmp_path):
    """Interrupted at the start of epoch 3: the backup holds epoch 2 (one
    weights file, named in the metadata); a second `fit` runs epochs 3 and 4
    from it, to the uninterrupted run's weights, and deletes the backup."""
    x = np.random.RandomState(0).normal(size=(16, 3)).astype("float32")
    y = x @ np.array([[1.0], [-2.0], [0.5]], dtype="float32")

    def model():
        keras.utils.set_random_seed(3)
        built = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        built.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return built

    expected = model()
    expected.fit(x, y, batch_size=4, epochs=4, shuffle=False, verbose=0)

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                raise RuntimeError("interrupted")

    backup = tmp_path / "backup"
    interrupted = model()
    with pytest.raises(RuntimeError, match="interrupted"):
        interrupted.fit(
            x,
            y,
            batch_size=4,
            epochs=4,
            shuffle=False,
            verbose=0,
            callbacks=[MultiProcessBackupAndRestore(backup), Interrupt()],
        )
    metadata = json.loads((backup / "training_metadata.json").read_text())
    assert metadata["epoch"] == 2
    assert sorted(os.listdir(backup)) == sorted(
        ["training_metadata.json", metadata["weights"]]
    )

    resumed = model()
    history = resumed.fit(
        x,
        y,
        batch_size=4,
        epochs=4,
        shuffle=False,
        verbose=0,
        callbacks=[MultiProcessBackupAndRestore(backup)],
    )
    assert history.epoch == [2, 3]
    assert not backup.exists()
    for found, wanted in zip(
        resumed.get_weights(), expected.get_weights(), strict=True
    ):
        np.testing.assert_allclose(found, wanted, atol=1e-6)


# ------------------------------------------------------------ two processes


@dataclass
class Run:
    process_id: int
    returncode: int | None
    ended: float | None  # time.monotonic() when it ended; None: killed
    log: str

    @property
    def timed_out(self) -> bool:
        return self.ended is None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(
    directory: Path,
    name: str,
    num_processes: int,
    devices: int,
    *options: str,
    only: list[int] | None = None,
):
    """Starts the worker's processes (those in `only`, or all); returns them
    with their log files."""
    environment = {
        key: value
        for key, value in os.environ.items()
        # A proxy can hold up the processes' gRPC connections (JAX's warning).
        if "_proxy" not in key.lower() and not key.startswith("KERAS_DISTRIBUTION")
    }
    environment.update(
        KERAS_BACKEND="jax",
        PYTHONPATH=REPO_ROOT,
        XLA_FLAGS=xla_flags_with_devices(devices),
        TF_CPP_MIN_LOG_LEVEL="2",
        PYTHONUNBUFFERED="1",
    )
    coordinator = f"127.0.0.1:{free_port()}"
    started = []
    for process_id in range(num_processes) if only is None else only:
        log = directory / f"{name}-{process_id}.log"
        command = [
            sys.executable,
            WORKER,
            "--num-processes",
            str(num_processes),
            "--process-id",
            str(process_id),
            "--heartbeat-timeout",
            str(HEARTBEAT),
            *options,
        ]
        if num_processes > 1:
            command += ["--coordinator", coordinator]
        with open(log, "w") as output:
            process = subprocess.Popen(
                command,
                stdout=output,
                stderr=subprocess.STDOUT,
                env=environment,
                cwd=directory,
            )
        started.append((process_id, process, log))
    return started


def finish(started, timeout: float = TIMEOUT) -> list[Run]:
    """Waits for the processes (killing any left after `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    ended = {}
    while len(ended) < len(started) and time.monotonic() < deadline:
        for process_id, process, _ in started:
            if process_id not in ended and process.poll() is not None:
                ended[process_id] = time.monotonic()
        time.sleep(0.2)
    runs = []
    for process_id, process, log in started:
        if process_id not in ended:
            process.kill()
        process.wait()
        runs.append(
            Run(process_id, process.returncode, ended.get(process_id), log.read_text())
        )
    return runs


def outputs(runs: list[Run]) -> str:
    """The end of each process's output, without JAX's and TF's info lines."""
    parts = []
    for run in runs:
        lines = [
            line
            for line in run.log.splitlines()
            if not line.startswith(("I0000", "W0000", "    @ "))
        ]
        parts.append(
            f"--- process {run.process_id}: returncode {run.returncode}"
            f"{' (timed out)' if run.timed_out else ''}\n" + "\n".join(lines)[-3000:]
        )
    return "\n".join(parts)


def weights(directory: Path, process_id: int) -> list[np.ndarray]:
    with np.load(directory / f"weights-{process_id}.npz") as saved:
        return [saved[f"arr_{index}"] for index in range(len(saved.files))]


def assert_close(found, wanted, what):
    assert len(found) == len(wanted), what
    for index, (a, b) in enumerate(zip(found, wanted, strict=True)):
        np.testing.assert_allclose(a, b, atol=1e-5, err_msg=f"{what}: weight {index}")


def assert_finished(runs, directory: Path, epochs: list[int], devices: int):
    report = outputs(runs)
    for run in runs:
        assert not run.timed_out and run.returncode == 0, report
        record = json.loads((directory / f"run-{run.process_id}.json").read_text())
        assert record["epochs"] == epochs, (record, report)
        assert record["processes"] == len(runs), (record, report)
        assert record["devices"] == devices, (record, report)


def die_after_epoch_2(directory: Path, name: str, dying: int) -> Path:
    """Runs both processes; `dying` exits after the backup of epoch 2. The
    other must end by itself, in bounded time (its next collective fails, or
    JAX's heartbeat timeout ends it), with no backup of a later epoch.
    Returns the backup's directory."""
    backup = directory / f"{name}_backup"
    options = ("--die-after-epoch", "2", "--die", str(dying))
    runs = finish(
        start(
            directory, name, 2, 2, "--out", name, "--backup-dir", backup.name, *options
        )
    )
    report = outputs(runs)
    dead, survivor = runs[dying], runs[1 - dying]
    assert dead.returncode == 3 and f"process {dying} dies" in dead.log, report
    assert not survivor.timed_out, report
    assert survivor.returncode != 0, report
    assert survivor.ended - dead.ended < HEARTBEAT + 30, report
    assert not (directory / name / f"run-{survivor.process_id}.json").exists()
    metadata = json.loads((backup / "training_metadata.json").read_text())
    assert metadata["epoch"] == 2, (metadata, report)
    assert (backup / metadata["weights"]).is_file(), report
    return backup


@pytest.mark.large
def test_two_processes_train_and_resume_after_one_dies(tmp_path):
    # 1. Uninterrupted: two processes with 2 CPU devices each (DataParallel on
    # 4 devices), and one process on one device (no distribution) alongside:
    # global batches of 8 in both.
    two = start(tmp_path, "two", 2, 2, "--out", "two", "--backup-dir", "two_backup")
    one = start(tmp_path, "one", 1, 1, "--out", "one", "--backup-dir", "one_backup")
    runs = finish(two)
    single = finish(one)
    assert_finished(runs, tmp_path / "two", [1, 2, 3, 4], devices=4)
    assert_finished(single, tmp_path / "one", [1, 2, 3, 4], devices=1)
    uninterrupted = weights(tmp_path / "two", 0)
    for found, wanted in zip(weights(tmp_path / "two", 1), uninterrupted, strict=True):
        assert np.array_equal(found, wanted), "the processes' weights differ"
    assert_close(uninterrupted, weights(tmp_path / "one", 0), "2 processes vs 1")
    assert not (tmp_path / "two_backup").exists()  # deleted at the end of fit

    # 2. Process 1 dies after the backup of epoch 2; process 0 ends by itself.
    backup = die_after_epoch_2(tmp_path, "die", dying=1)

    # 3. Both again, on the same backup: epochs 3 and 4 only, to the weights of
    # the uninterrupted run; the backup deleted at the end.
    runs = finish(
        start(tmp_path, "resume", 2, 2, "--out", "resume", "--backup-dir", backup.name)
    )
    assert_finished(runs, tmp_path / "resume", [3, 4], devices=4)
    resumed = weights(tmp_path / "resume", 0)
    for found, wanted in zip(weights(tmp_path / "resume", 1), resumed, strict=True):
        assert np.array_equal(found, wanted), "the resumed processes' weights differ"
    assert_close(resumed, uninterrupted, "resumed vs uninterrupted")
    assert not backup.exists()


@pytest.mark.large
def test_the_other_process_ends_when_the_coordinator_dies(tmp_path):
    """Process 0 runs JAX's coordination service: when it dies, process 1
    ends too (at once: its connection to the service breaks)."""
    die_after_epoch_2(tmp_path, "die", dying=0)


@pytest.mark.large
def test_a_missing_peer_ends_the_process_in_bounded_time(tmp_path):
    """Process 0 of 2, alone: JAX ends it once `initialization_timeout`
    (5 seconds) runs out, instead of waiting for process 1."""
    begun = time.monotonic()
    started = start(
        tmp_path,
        "alone",
        2,
        1,
        "--out",
        "alone",
        "--backup-dir",
        "backup",
        "--initialization-timeout",
        "5",
        only=[0],
    )
    (run,) = finish(started, timeout=90)
    report = outputs([run])
    assert not run.timed_out and run.returncode != 0, report
    assert run.ended - begun < 60, report
    assert "Terminating process" in run.log or "DEADLINE_EXCEEDED" in run.log, report
    assert not (tmp_path / "alone").exists(), report
