"""One process of `test_jax_two_process.py`'s training job (run as a script,
with KERAS_BACKEND=jax).

Trains a small `TransformerLanguageModel` data parallel over all devices of
all processes, with `fit` on a `tf.data.Dataset` that Keras shards per
process (each process reads the same global batches; Keras rebatches each to
its share and keeps every `num_processes`-th piece). Backs up with
`MultiProcessBackupAndRestore`, and writes `{out}/weights-{process_id}.npz`
and `{out}/run-{process_id}.json` (the epochs this run trained, the number of
processes and devices). `--die-after-epoch N`: after the backup at the end
of epoch N (counted from 1), the processes named in `--die` exit at once
(`os._exit`), as a killed process would.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator")
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--backup-dir", required=True)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--die-after-epoch", type=int, default=0)
    parser.add_argument("--die", default="1", help="comma-separated process ids")
    parser.add_argument("--heartbeat-timeout", type=int, default=10)
    parser.add_argument("--initialization-timeout", type=int, default=60)
    arguments = parser.parse_args(argv)

    from keras_attn.training.multi_process import (
        MultiProcessBackupAndRestore,
        initialize_processes,
    )

    initialize_processes(
        arguments.coordinator,
        arguments.num_processes,
        arguments.process_id,
        initialization_timeout=arguments.initialization_timeout,
        heartbeat_timeout=arguments.heartbeat_timeout,
        shutdown_timeout=15,
    )

    import jax
    import keras
    import numpy as np
    import tensorflow as tf

    from keras_attn.models import TransformerLanguageModel

    keras.config.disable_traceback_filtering()  # whole tracebacks in the logs
    devices = keras.distribution.list_devices()
    if jax.process_count() > 1:
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(devices=devices)
        )

    keras.utils.set_random_seed(7)
    model = TransformerLanguageModel(
        64,
        16,
        embedding_dim=32,
        num_layers=1,
        num_heads=4,
        intermediate_dim=64,
        dropout=0.0,
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.build((None, 16))

    # 32 sequences, global batches of 8: 4 steps an epoch, the same global
    # batches in every process and in every epoch (no shuffling, so that a
    # resumed run sees what the interrupted one would have).
    ids = np.random.RandomState(0).randint(1, 64, (32, 16)).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((ids, np.roll(ids, -1, axis=1)))
    dataset = dataset.batch(8, drop_remainder=True)

    class Record(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.epochs = []

        def on_epoch_end(self, epoch, logs=None):
            self.epochs.append(epoch + 1)
            if epoch + 1 == arguments.die_after_epoch and str(
                arguments.process_id
            ) in arguments.die.split(","):
                print(f"process {arguments.process_id} dies", flush=True)
                os._exit(3)

    record = Record()
    model.fit(
        dataset,
        epochs=arguments.epochs,
        verbose=0,
        # The backup first: a process dies after the epoch's backup.
        callbacks=[MultiProcessBackupAndRestore(arguments.backup_dir), record],
    )

    os.makedirs(arguments.out, exist_ok=True)
    np.savez(
        os.path.join(arguments.out, f"weights-{arguments.process_id}.npz"),
        *model.get_weights(),
    )
    with open(
        os.path.join(arguments.out, f"run-{arguments.process_id}.json"), "w"
    ) as f:
        json.dump(
            {
                "epochs": record.epochs,
                "processes": jax.process_count(),
                "devices": len(devices),
                "local_devices": jax.local_device_count(),
            },
            f,
        )
    print("done", flush=True)


if __name__ == "__main__":
    sys.exit(main())
