"""`examples/sentiment.py --strategy multi-worker` (`large`, about a minute):
two worker processes on localhost (MultiWorkerMirroredStrategy, TF_CONFIG
with 127.0.0.1 ports) train exactly like one process on the same global
batch.

Deterministic setup: dropout 0, one seed, float32, one ensemble member, the
same shuffling on every worker (seeded), 32 training sentences cut to 8
tokens (one length bucket, so every global batch of 8 is full and splits
4 + 4: the workers average their per-worker mean gradients, which equals the
global mean only for equal halves). No `--smoke`: it keeps every 20th
training sentence and fixes its own sizes, so the sizes are passed instead.

Compared: every array of `best.weights.h5` (model weights and optimizer
state, after 2 epochs = 8 optimizer steps) and the final training loss. A
single process on half the batch (what a worker training alone would do)
is run too, to show that the tolerances tell the two apart.
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.examples.test_scripts import NEGATIVE, POSITIVE

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.tf_only

WORKERS = 2
PER_WORKER_BATCH = 4
GLOBAL_BATCH = WORKERS * PER_WORKER_BATCH
TRAIN_SENTENCES = 32  # 4 full global batches per epoch
TIMEOUT = 300  # seconds, for all the runs together

COMMON = [
    "--pretrained", "none",
    "--ensemble", 1, "--dropout", 0, "--mixed-precision", "off", "--no-export",
    "--epochs", 2, "--seed", 1337, "--vocabulary-size", 300,
    "--embedding-dim", 16, "--num-heads", 2, "--intermediate-dim", 32,
    "--max-length", 8, "--time-budget", 30,
]  # fmt: skip


def write_reviews(path):
    """`TRAIN_SENTENCES` training sentences (the split is a hash of the
    text) and 2 each for validation and test."""
    from keras_attn.datasets import assign_split

    wanted = {"train": TRAIN_SENTENCES, "validation": 2, "test": 2}
    counts = dict.fromkeys(wanted, 0)
    lines = []
    index = 0
    while counts != wanted:
        label, texts = (1, POSITIVE) if index % 2 == 0 else (0, NEGATIVE)
        text = f"{texts[index // 2 % len(texts)]}, take {index}"
        index += 1
        split = assign_split(text)
        if counts[split] < wanted[split]:
            counts[split] += 1
            lines.append(f"{label}\t{text}")
    path.write_text("\n".join(lines) + "\n")
    return path


def free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def start(name, args, log, tf_config=None):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("TF_CONFIG", None)
    if tf_config is not None:
        env["TF_CONFIG"] = json.dumps(tf_config)
    command = [sys.executable, str(REPO / "examples" / "sentiment.py")]
    with open(log, "w") as stream:
        process = subprocess.Popen(
            command + [str(arg) for arg in args],
            stdout=stream,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=env,
        )
    process.log, process.name = log, name
    return process


def wait_all(processes, timeout):
    """Wait for every process; kill all of them on a timeout or a failure."""
    deadline = time.monotonic() + timeout
    try:
        for process in processes:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{process.name} ran past {timeout}s\n{tail(process)}")
            if process.returncode != 0:
                pytest.fail(
                    f"{process.name} exited {process.returncode}\n{tail(process)}"
                )
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def tail(process, chars=4000):
    return f"--- {process.log} ---\n" + Path(process.log).read_text()[-chars:]


def weights(run_dir):
    """Every array of the member's checkpoint (model and optimizer state)."""
    import h5py

    arrays = {}
    path = run_dir / "members" / "0" / "checkpoints" / "best.weights.h5"
    with h5py.File(path, "r") as file:
        file.visititems(
            lambda name, item: (
                arrays.__setitem__(name, item[()])
                if isinstance(item, h5py.Dataset)
                else None
            )
        )
    assert arrays, path
    return arrays


def max_difference(a, b, floats_only=False):
    assert a.keys() == b.keys()
    names = [k for k in a if a[k].dtype.kind == "f" or not floats_only]
    return max(
        float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64))))
        for k in names
    )


def test_keras_still_has_what_the_multi_worker_patch_wraps():
    """Default run: a Keras upgrade that moves the private functions
    `training.patch_keras_for_multi_worker` wraps shows up here."""
    import tensorflow as tf

    from keras_attn import training

    assert training.patch_keras_for_multi_worker()
    assert training.patch_keras_for_multi_worker()  # again: a no-op
    assert training.is_chief(tf.distribute.get_strategy())


@pytest.mark.large
def test_two_workers_train_like_one_process_on_the_global_batch(tmp_path):
    data = write_reviews(tmp_path / "reviews.tsv")
    common = ["--data", data, *COMMON]
    ports = free_ports(WORKERS)
    cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    shared_out = tmp_path / "multi_worker"  # one --out for both workers
    worker_args = [*common, "--strategy", "multi-worker", "--out", shared_out]
    processes = [
        start(
            f"worker {index}",
            [*worker_args, "--batch-size", PER_WORKER_BATCH],
            tmp_path / f"worker_{index}.log",
            {"cluster": cluster, "task": {"type": "worker", "index": index}},
        )
        for index in range(WORKERS)
    ]
    for batch in (GLOBAL_BATCH, PER_WORKER_BATCH):
        out = tmp_path / f"single_{batch}"
        processes.append(
            start(
                f"single process, batch {batch}",
                [*common, "--strategy", "none", "--batch-size", batch, "--out", out],
                tmp_path / f"single_{batch}.log",
            )
        )
    wait_all(processes, TIMEOUT)

    # Only the chief (worker 0) wrote to --out; worker 1 to its own folder.
    worker_dirs = [shared_out, shared_out / "workers" / "worker_1"]
    assert sorted(p.name for p in (shared_out / "workers").iterdir()) == ["worker_1"]
    reports = [json.loads((d / "metrics.json").read_text()) for d in worker_dirs]
    for report in reports:
        assert report["environment"]["replicas"] == WORKERS  # one cluster
        assert report["config"]["strategy"] == "multi-worker"
    assert reports[1]["config"]["out"] == str(worker_dirs[1])

    single, half = (
        json.loads((tmp_path / f"single_{b}" / "metrics.json").read_text())
        for b in (GLOBAL_BATCH, PER_WORKER_BATCH)
    )
    assert single["environment"]["replicas"] == 1
    (want_loss,) = single["metrics"]["final_train_loss"]
    (half_loss,) = half["metrics"]["final_train_loss"]
    got_losses = [r["metrics"]["final_train_loss"][0] for r in reports]
    want_weights = weights(tmp_path / f"single_{GLOBAL_BATCH}")
    got_weights = [weights(d) for d in worker_dirs]
    half_weights = weights(tmp_path / f"single_{PER_WORKER_BATCH}")

    # The workers hold the same weights, bit for bit.
    assert got_weights[0].keys() == got_weights[1].keys()
    for name in got_weights[0]:
        np.testing.assert_array_equal(got_weights[0][name], got_weights[1][name])
    # ... and trained like one process on the global batch.
    assert got_losses[0] == got_losses[1]
    np.testing.assert_allclose(got_losses[0], want_loss, rtol=1e-5)
    assert max_difference(got_weights[0], want_weights) < 1e-5
    # A worker training alone on its half batch would be told apart.
    assert abs(half_loss - want_loss) > 100 * 1e-5 * abs(want_loss)
    # (Float arrays only: the step counters differ anyway.)
    assert max_difference(half_weights, want_weights, floats_only=True) > 100 * 1e-5
