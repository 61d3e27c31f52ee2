"""`tf.distribute` strategies for `fit`, and the multi-worker workaround.

TensorFlow is imported by the functions that need it, not by this module.
"""

from __future__ import annotations

import logging
import os

from keras_attn._extras import missing_extra_error

logger = logging.getLogger("keras_attn.training")

STRATEGY_CHOICES = ("auto", "mirrored", "multi-worker", "none")


def make_strategy(name: str):
    """A `tf.distribute` strategy for `--strategy NAME`.

    `auto`: `MirroredStrategy` over every GPU when there are several, else the
    default strategy. `multi-worker` reads the cluster from `TF_CONFIG` (and
    applies `patch_keras_for_multi_worker`, without which Keras 3's `fit`
    fails under that strategy).

    Raises:
        ImportError: TensorFlow is not installed (the `text` extra).
    """
    try:
        import tensorflow as tf
    except ImportError as error:
        raise missing_extra_error(
            "make_strategy", "text", "tensorflow", error
        ) from error

    if name not in STRATEGY_CHOICES:
        raise ValueError(
            f"`strategy` must be one of {list(STRATEGY_CHOICES)}. "
            f"Received: strategy={name!r}"
        )
    if name == "multi-worker":
        if "TF_CONFIG" not in os.environ:
            raise ValueError(
                "strategy='multi-worker' reads the cluster from the TF_CONFIG "
                "environment variable, which is not set."
            )
        patch_keras_for_multi_worker()
        return tf.distribute.MultiWorkerMirroredStrategy()
    if name == "mirrored" or (
        name == "auto" and len(tf.config.list_physical_devices("GPU")) > 1
    ):
        return tf.distribute.MirroredStrategy()
    return tf.distribute.get_strategy()


def _in_multi_worker_mode(strategy) -> bool:
    """A `MultiWorkerMirroredStrategy` with a cluster (not a local one)."""
    import tensorflow as tf

    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return False
    return bool(strategy.cluster_resolver.cluster_spec().as_dict())


def patch_keras_for_multi_worker() -> bool:
    """Make Keras 3's `fit`/`evaluate` work under `MultiWorkerMirroredStrategy`.

    Keras 3 (checked with 3.15 on TensorFlow 2.21; keras-team/keras#20585,
    tensorflow/tensorflow#72388) fails twice with more than one worker:

    1. `fit` and `evaluate` build the model state (metrics, optimizer) from
       a first batch, averaged over the replicas with `strategy.reduce("MEAN",
       (x, y))`, which the collective strategy rejects: "ValueError: Attempt
       to convert a value (PerReplica:{...}) with an unsupported type". Only
       the shapes and dtypes of that batch matter, so the patched build uses
       the dataset's `element_spec`. It also reads no batch: Keras opened an
       extra iterator for it, which advanced the shuffling of a
       `Dataset.shuffle(seed=..., reshuffle_each_iteration=True)`, so that a
       distributed run saw other batches than a run without a strategy.
    2. Every train/test step averages the (scalar) metric results over the
       workers with `strategy.reduce("MEAN", value, axis=0)`: "ValueError:
       Invalid reduction dimension 0 for input with 0 dimensions". The patch
       averages scalars over the replicas (`axis=None`) instead; these are
       only the per-step progress values, the epoch logs (History,
       callbacks) are read from the metric variables, summed over all
       workers.

    Both patches change behaviour only under a multi-worker
    `MultiWorkerMirroredStrategy`. Private Keras functions are wrapped, so a
    Keras without them leaves everything as it is (with a warning). Returns
    whether the patches are in place; calling it again is harmless.
    """
    try:
        import tensorflow as tf
        from keras.src.backend.tensorflow import trainer as tf_trainer

        trainer_class = tf_trainer.TensorFlowTrainer
        original_build = trainer_class._maybe_symbolic_build
        original_reduce = tf_trainer.reduce_per_replica
    except (ImportError, AttributeError) as error:
        logger.warning("Cannot patch Keras for MultiWorkerMirroredStrategy: %s", error)
        return False
    if getattr(original_reduce, "_keras_attn_patch", False):
        return True

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if iterator is None or not _in_multi_worker_mode(strategy):
            return original_build(self, iterator=iterator, data_batch=data_batch)
        # TensorSpecs: `_symbolic_build` needs only `shape` and `dtype`.
        data_batch = iterator.data_adapter.get_tf_dataset().element_spec
        with strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    def reduce_per_replica(values, strategy, reduction):
        if reduction not in ("auto", "mean") or not _in_multi_worker_mode(strategy):
            return original_reduce(values, strategy, reduction)

        def reduce(value):
            if getattr(value, "shape", None) is not None and value.shape.rank == 0:
                return strategy.reduce("MEAN", value, axis=None)
            return original_reduce(value, strategy, reduction)

        return tf.nest.map_structure(reduce, values)

    reduce_per_replica._keras_attn_patch = True
    trainer_class._maybe_symbolic_build = _maybe_symbolic_build
    tf_trainer.reduce_per_replica = reduce_per_replica
    return True


def is_chief(strategy) -> bool:
    """Whether this process writes the shared outputs of a run.

    Always true except under a multi-worker `MultiWorkerMirroredStrategy`,
    where the chief is the `chief` task of `TF_CONFIG` or, when the cluster
    has none, worker 0.
    """
    if not _in_multi_worker_mode(strategy):
        return True
    resolver = strategy.cluster_resolver
    if resolver.task_type == "chief":
        return True
    has_chief = "chief" in resolver.cluster_spec().as_dict()
    return resolver.task_type == "worker" and resolver.task_id == 0 and not has_chief


def make_distribution(spec: str, devices=None, indivisible: str = "error"):
    """A `keras.distribution` for `--distribution SPEC` (JAX).

    - `"none"`: None (one device, or whatever `--strategy` sets up on
      TensorFlow).
    - `"data"`: `keras.distribution.DataParallel` over every device (of
      every process); `"data:D"` over the first `D`.
    - `"model:M"`: model parallel over the first `M` devices, a `(1, M)`
      mesh.
    - `"data:D,model:M"`: both, a `(D, M)` mesh over the first `D * M`
      devices.

    The meshes name their axes `batch` and `model`, and the variables are
    laid out by `keras_attn.models.layouts.layout_map` (what every
    backbone's and task's `get_layout_map` returns) with `fsdp=False`:
    heads, feed-forward width and vocabulary on `model`, the batch on
    `batch`, the kernels replicated over `batch` (keras-hub's split of the
    model width over `batch` compiles, on Keras's partitioner, to a plan
    with many more collectives; BENCHMARKS.md, "Collectives per step").
    A variable the mesh does not divide is refused when it is created, with
    its path, shape and the mesh in the message (JAX's own error names
    neither), or with `indivisible="replicate"` kept whole along that axis
    with a warning (`keras_attn.models.layouts.CheckedModelParallel`).

    Args:
        spec: the specification above.
        devices: the devices to lay the mesh over (default
            `keras.distribution.list_devices()`).
        indivisible: `"error"` or `"replicate"`, as above.

    Returns:
        A `keras.distribution.Distribution`, or None for `"none"`; set it
        with `keras.distribution.set_distribution` before building the
        model.

    Raises:
        ValueError: a malformed `spec`, or more devices than there are.
    """
    import keras

    if not isinstance(spec, str):
        raise ValueError(
            "`distribution` must be a string such as 'data', 'model:4' or "
            f"'data:2,model:4'. Received: distribution={spec!r}"
        )
    if spec == "none":
        return None
    sizes = _distribution_sizes(spec)
    devices = list(keras.distribution.list_devices() if devices is None else devices)
    if sizes is None:  # "data": every device
        return keras.distribution.DataParallel(devices=devices)
    data, model = sizes
    if data * model > len(devices):
        raise ValueError(
            f"`distribution` {spec!r} needs {data * model} devices and there "
            f"are {len(devices)}. Received: distribution={spec!r}"
        )
    devices = devices[: data * model]
    if model == 1:
        return keras.distribution.DataParallel(devices=devices)
    from keras_attn.models.layouts import CheckedModelParallel, layout_map

    mesh = keras.distribution.DeviceMesh((data, model), ["batch", "model"], devices)
    return CheckedModelParallel(
        layout_map=layout_map(mesh, fsdp=False),
        batch_dim_name="batch",
        indivisible=indivisible,
    )


def _distribution_sizes(spec: str):
    """`(data, model)` axis sizes of a `--distribution` spec; None for
    `"data"` (every device)."""
    if spec == "data":
        return None
    sizes = {}
    for part in spec.split(","):
        name, _, size = part.partition(":")
        if name not in ("data", "model") or name in sizes or not size.isdigit():
            sizes = None
            break
        sizes[name] = int(size)
    if not sizes or any(size < 1 for size in sizes.values()):
        raise ValueError(
            "`distribution` must be 'none', 'data', 'data:D', 'model:M' or "
            "'data:D,model:M' with positive integers D and M. Received: "
            f"distribution={spec!r}"
        )
    return sizes.get("data", 1), sizes.get("model", 1)


def data_parallel_size(distribution) -> int:
    """How many ways `distribution` splits a batch (1 for None): the
    global batch is this many times a per-replica batch."""
    if distribution is None:
        return 1
    from keras_attn.models.layouts import mesh_sizes

    mesh = distribution.device_mesh
    axis = getattr(distribution, "batch_dim_name", None) or mesh.axis_names[0]
    return mesh_sizes(mesh)[axis]
