"""Several JAX processes training one model: start-up with bounded timeouts,
and a backup that one process writes and every process restores.

`initialize_processes` stands in for `keras.distribution.initialize` on the
JAX backend: it calls `jax.distributed.initialize` with explicit timeouts
(Keras's function passes none, so a peer that never starts leaves the others
waiting JAX's 5 minutes, and a dead peer is noticed after 100 seconds) and then
makes the processes agree on Keras's random seed as Keras's does.
`MultiProcessBackupAndRestore` is `keras.callbacks.BackupAndRestore` for
several processes.

JAX is imported by the functions that need it, not by this module, and
TensorFlow by neither (only a `tf.data` input pipeline needs it: Keras's
`DataParallel` shards a `tf.data.Dataset` per process).
"""

from __future__ import annotations

import json
import os
import shutil

import keras

JOB_ADDRESSES_VARIABLE = "KERAS_DISTRIBUTION_JOB_ADDRESSES"
NUM_PROCESSES_VARIABLE = "KERAS_DISTRIBUTION_NUM_PROCESSES"
PROCESS_ID_VARIABLE = "KERAS_DISTRIBUTION_PROCESS_ID"


def _positive_seconds(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"`{name}` must be a positive whole number of seconds. "
            f"Received: {name}={value!r}"
        )
    return value


def _from_environment(name: str, value, variable: str):
    """`value`, or else the environment variable's (as Keras reads it)."""
    if value is not None or variable not in os.environ:
        return value
    text = os.environ[variable]
    if name == "coordinator_address":
        return text
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"`{name}` must be a whole number; the environment variable "
            f"{variable} gives {text!r}."
        ) from None


def resolve_process_arguments(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> tuple[str | None, int, int]:
    """The checked `(coordinator_address, num_processes, process_id)`.

    An argument left `None` is read from Keras's environment variable
    (`KERAS_DISTRIBUTION_JOB_ADDRESSES`, `KERAS_DISTRIBUTION_NUM_PROCESSES`,
    `KERAS_DISTRIBUTION_PROCESS_ID`). Of a comma-separated list of job
    addresses, as `keras.distribution.initialize` takes, the first is the
    coordinator's (process 0's), and the list's length must be
    `num_processes`. One process may go without an address (`None`), and
    nothing given or set at all means one process.

    Raises:
        ValueError: an argument is missing or out of range.
    """
    coordinator_address = _from_environment(
        "coordinator_address", coordinator_address, JOB_ADDRESSES_VARIABLE
    )
    num_processes = _from_environment(
        "num_processes", num_processes, NUM_PROCESSES_VARIABLE
    )
    process_id = _from_environment("process_id", process_id, PROCESS_ID_VARIABLE)
    if (coordinator_address, num_processes, process_id) == (None, None, None):
        return None, 1, 0  # nothing given, nothing set: one process

    if isinstance(num_processes, bool) or not isinstance(num_processes, int):
        raise ValueError(
            "`num_processes` must be a positive int (or set "
            f"{NUM_PROCESSES_VARIABLE}). Received: num_processes={num_processes!r}"
        )
    if num_processes < 1:
        raise ValueError(
            "`num_processes` must be a positive int. "
            f"Received: num_processes={num_processes!r}"
        )
    if isinstance(process_id, bool) or not isinstance(process_id, int):
        raise ValueError(
            "`process_id` must be an int from 0 to num_processes - 1 (or set "
            f"{PROCESS_ID_VARIABLE}). Received: process_id={process_id!r}"
        )
    if not 0 <= process_id < num_processes:
        raise ValueError(
            f"`process_id` must be from 0 to num_processes - 1 = "
            f"{num_processes - 1}. Received: process_id={process_id!r}"
        )
    if num_processes == 1 and coordinator_address is None:
        return None, 1, 0  # a single process needs no coordinator
    if not isinstance(coordinator_address, str) or not coordinator_address:
        raise ValueError(
            "`coordinator_address` must be a 'host:port' string (or set "
            f"{JOB_ADDRESSES_VARIABLE}). "
            f"Received: coordinator_address={coordinator_address!r}"
        )
    addresses = [part.strip() for part in coordinator_address.split(",")]
    if len(addresses) > 1 and len(addresses) != num_processes:
        raise ValueError(
            "`coordinator_address` lists one address per process, or only the "
            f"coordinator's: {len(addresses)} addresses for num_processes="
            f"{num_processes}. Received: coordinator_address="
            f"{coordinator_address!r}"
        )
    host, _, port = addresses[0].rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            "`coordinator_address` must be 'host:port' with a port from 1 to "
            f"65535. Received: coordinator_address={coordinator_address!r}"
        )
    return addresses[0], num_processes, process_id


def initialize_processes(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    initialization_timeout: int = 300,
    heartbeat_timeout: int = 60,
    shutdown_timeout: int = 60,
) -> None:
    """Joins this process to a multi-process JAX job, with bounded waits.

    Call it first, before anything that starts JAX's backend (creating a
    model or a tensor, `keras.distribution.list_devices()`), in each of the
    `num_processes` processes, then set a distribution over all the
    processes' devices, e.g.
    `keras.distribution.set_distribution(keras.distribution.DataParallel())`.

    What `keras.distribution.initialize` does on JAX, with the timeouts it
    leaves at JAX's defaults (300, 100 and 300 seconds) set. When one runs
    out, JAX ends the process: it prints "Terminating process because the JAX
    distributed service detected fatal errors" and the reason, and aborts
    (exit status 134, SIGABRT; no Python exception, no `finally`):

    - `initialization_timeout`: seconds to wait for every process to join
      (a peer that never started, a wrong address or port).
    - `heartbeat_timeout`: seconds without a heartbeat after which a process
      counts as dead, and the others are ended. A peer's death usually ends
      the others sooner: the next collective fails with a Python error
      (Gloo's "Connection closed by peer" on CPU), and at exit the shutdown
      barrier fails after at most this long; if process 0 (which runs the
      coordination service) dies, the others end at once.
    - `shutdown_timeout`: seconds a finishing process waits at exit for the
      others to finish too.

    Arguments left `None` are read from the environment variables
    `keras.distribution.initialize` reads: `KERAS_DISTRIBUTION_JOB_ADDRESSES`
    (`host:port` of process 0, or a comma-separated list whose first entry
    is), `KERAS_DISTRIBUTION_NUM_PROCESSES`, `KERAS_DISTRIBUTION_PROCESS_ID`.

    With one process (also when no argument is given and none of the
    variables is set), nothing is started, on any backend (a single-process
    run needs no coordinator). Keras's random seed is made the same in every process, as
    `keras.distribution.initialize` does, unless `keras.utils.set_random_seed`
    set one already.

    Raises:
        ValueError: an argument is missing or out of range; or the backend
            is not JAX.
        RuntimeError: JAX's backend already started, or `jax.distributed` was
            initialized already.
    """
    coordinator_address, num_processes, process_id = resolve_process_arguments(
        coordinator_address, num_processes, process_id
    )
    timeouts = {
        "initialization_timeout": _positive_seconds(
            "initialization_timeout", initialization_timeout
        ),
        "heartbeat_timeout_seconds": _positive_seconds(
            "heartbeat_timeout", heartbeat_timeout
        ),
        "shutdown_timeout_seconds": _positive_seconds(
            "shutdown_timeout", shutdown_timeout
        ),
    }
    if num_processes == 1:
        return
    if keras.backend.backend() != "jax":
        raise ValueError(
            "initialize_processes starts JAX's multi-process runtime and needs "
            "the JAX backend (KERAS_BACKEND=jax). "
            f"Received: backend={keras.backend.backend()!r}"
        )
    import jax

    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        **timeouts,
    )
    # Keras's own step after `jax.distributed.initialize` (private, as Keras
    # exposes it only inside `keras.distribution.initialize`): unless a seed
    # is set, one summed over the processes, the same everywhere.
    from keras.src.backend.jax import distribution_lib

    distribution_lib.initialize_rng()


def process_index() -> int:
    """This process's index (0 alone, or without JAX's runtime started)."""
    if keras.backend.backend() != "jax":
        return 0
    import jax

    return jax.process_index()


def process_count() -> int:
    """The number of processes in the job (1 without JAX's runtime)."""
    if keras.backend.backend() != "jax":
        return 1
    import jax

    return jax.process_count()


def barrier(name: str) -> None:
    """Waits until every process reaches the barrier `name` (all must call it
    with the same name, in the same order). Nothing with one process."""
    if process_count() == 1:
        return
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def _same_everywhere(value, what: str) -> None:
    """Raises unless every process passes the same int `value`."""
    if process_count() == 1:
        return
    import numpy as np
    from jax.experimental import multihost_utils

    multihost_utils.assert_equal(
        np.asarray(value, dtype="int32"),
        f"The processes differ in {what}",
    )


class MultiProcessBackupAndRestore(keras.callbacks.BackupAndRestore):
    """`keras.callbacks.BackupAndRestore` for several processes.

    `BackupAndRestore` is not multi-process aware: each process writes the
    same `latest.weights.h5` and `training_metadata.json`, so on a shared
    file system the processes overwrite each other's files, and a process can
    read a file another is still writing (or a weights file from one epoch
    with another epoch's count). Here only process 0 writes, and every process
    waits for it:

    - At the end of each epoch (or every `save_freq` batches) process 0 writes
      the weights (model and optimizer) to a new file, then the epoch count
      and that file's name to `training_metadata.json` (written aside and
      renamed into place: the step that commits the backup), then deletes the
      older weights. A process killed at any point leaves a whole backup,
      the old or the new. All processes meet at a barrier before going on.
    - At the start of `fit`, all processes read the same files and restore
      the weights and the epoch counter, so `fit` continues with the epoch
      after the backup's. They first check that they found the same backup
      (a `backup_dir` that not all processes share is an error, not a silent
      divergence).
    - At the end of a finished `fit`, process 0 deletes the backup (unless
      `delete_checkpoint=False`), and all processes wait for that, so that a
      following `fit` starts afresh in each.

    Needs: the JAX backend's multi-process runtime started
    (`initialize_processes` or `keras.distribution.initialize`) before
    `fit`; `backup_dir` on a file system that every process sees at the same
    path; the model built before `fit` (as `BackupAndRestore`); the same
    model, optimizer and `fit` arguments when resuming (a `tf.data` pipeline
    starts afresh: one that shuffles differently each epoch does not repeat
    the interrupted run's order); and variables whose full value each process
    holds, the case under `keras.distribution.DataParallel` (replicated
    weights: Keras's `save_weights` converts a replicated global array with
    numpy, from this process's copy; the distribution is unset while process
    0 saves, as `save_weights` may create a variable, which under the
    distribution is a collective the other processes would not join).
    Weights sharded across processes (`keras.distribution.ModelParallel`
    with the model axis spanning processes) raise a `ValueError` when saving.

    The barriers are collectives (`jax.experimental.multihost_utils.
    sync_global_devices`), as are the training steps: if a process dies, the
    others fail in the next one (on CPU, Gloo's "Connection closed by
    peer"), or JAX ends them after its heartbeat timeout
    (`initialize_processes(heartbeat_timeout=...)`); the backup of the last
    whole epoch stays for the relaunched processes.

    With one process it behaves as `BackupAndRestore` (without
    `double_checkpoint`: a backup is never left half-written).
    """

    def __init__(self, backup_dir, save_freq="epoch", delete_checkpoint=True):
        super().__init__(
            backup_dir, save_freq=save_freq, delete_checkpoint=delete_checkpoint
        )
        self._saves = 0

    def _read_metadata(self) -> dict | None:
        if not os.path.exists(self._training_metadata_path):
            return None
        with open(self._training_metadata_path) as file:
            return json.load(file)

    def on_train_begin(self, logs=None):
        barrier("keras_attn_backup_begin")
        metadata = self._read_metadata()
        _same_everywhere(
            -1 if metadata is None else metadata["epoch"],
            f"the backup they find in backup_dir={self.backup_dir!r} (the "
            "epoch it ends): it must be a directory that all processes share",
        )
        self._load_model()

    def _load_model(self):
        if not self.model.built:
            raise ValueError(
                "To use MultiProcessBackupAndRestore, the model must be built "
                f"before `fit`. Model {self.model} is unbuilt: call it on a "
                "batch, or `model.build(...)`."
            )
        metadata = self._read_metadata()
        if metadata is None:
            return
        if self.model.optimizer is not None and not self.model.optimizer.built:
            self.model.optimizer.build(self.model.trainable_variables)
        weights = metadata.get("weights", os.path.basename(self._weights_path))
        self.model.load_weights(os.path.join(self.backup_dir, weights))
        self.model._initial_epoch = metadata["epoch"]

    def _check_savable(self):
        import jax

        optimizer = self.model.optimizer
        for variable in self.model.variables + (
            optimizer.variables if optimizer is not None else []
        ):
            value = variable.value
            if (
                isinstance(value, jax.Array)
                and not value.is_fully_addressable
                and not value.is_fully_replicated
            ):
                raise ValueError(
                    "MultiProcessBackupAndRestore saves weights that every "
                    "process holds whole (DataParallel); this variable is "
                    f"sharded across processes: {variable.path} with sharding "
                    f"{value.sharding}."
                )

    def _save_model(self):
        self._saves += 1
        if process_count() > 1:
            self._check_savable()
        if process_index() == 0:
            os.makedirs(self.backup_dir, exist_ok=True)
            previous = self._read_metadata()
            # A name no earlier backup used (a resumed run counts from 1 too).
            weights = f"epoch-{self._current_epoch}-batch-{self._last_batch_seen}"
            weights = f"{weights}-{os.getpid()}-{self._saves}.weights.h5"
            # Without the distribution: `save_weights` may create a variable
            # (Keras's reference `Optimizer(1.0)`, the first time), which
            # under a multi-process distribution is a collective that the
            # other processes, not saving, never join.
            distribution = keras.distribution.distribution()
            keras.distribution.set_distribution(None)
            try:
                self.model.save_weights(
                    filepath=os.path.join(self.backup_dir, weights),
                    overwrite=True,
                )
            finally:
                keras.distribution.set_distribution(distribution)
            partial = self._training_metadata_path + ".partial"
            with open(partial, "w") as file:
                json.dump(
                    {
                        "epoch": self._current_epoch,
                        "batch": self._last_batch_seen,
                        "weights": weights,
                    },
                    file,
                )
            os.replace(partial, self._training_metadata_path)
            if previous is not None and previous.get("weights") != weights:
                old = os.path.join(self.backup_dir, previous.get("weights", ""))
                if os.path.isfile(old):
                    os.remove(old)
        barrier(f"keras_attn_backup_saved_{self._saves}")

    def on_train_end(self, logs=None):
        if process_index() == 0 and self.delete_checkpoint:
            shutil.rmtree(self.backup_dir, ignore_errors=True)
        barrier("keras_attn_backup_end")
