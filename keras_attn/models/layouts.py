"""Layout maps for `keras.distribution.ModelParallel`: how the backbones'
variables are split over a device mesh.

keras-hub publishes `get_layout_map(device_mesh, model_parallel_dim_name,
data_parallel_dim_name)` as a static method on its larger backbones; keras-attn's
backbones and tasks have the same method (`layout_map` below), written for
the kernel shapes of Keras's layers, Megatron-style (Shoeybi et al. 2019):

| variables | shape | axes |
|---|---|---|
| query, key, value kernels | `(d, heads, head_dim)` | `(batch, model, None)` |
| their biases | `(heads, head_dim)` | `(model, None)` |
| attention output kernel | `(heads, head_dim, d)` | `(model, None, batch)` |
| feed-forward intermediate kernel | `(d, ff)` | `(batch, model)` |
| its bias | `(ff,)` | `(model,)` |
| feed-forward output kernel | `(ff, d)` | `(model, batch)` |
| token embeddings | `(vocabulary, d)` | `(model, batch)` |
| position table, layer norms, output biases | | replicated |

The heads and the feed-forward width are split on the `model` axis, so each
block's attention and feed-forward run on local shards and need one
all-reduce each, forward and backward. The `batch` axis also splits the
other axis of each kernel (fully sharded data parallelism, as keras-hub's
layout maps do), or with `fsdp=False` replicates the kernels (data
parallelism times Megatron's: the plan with the fewest collectives, see
BENCHMARKS.md); a mesh of `(1, M)` is pure model parallelism. Keras leaves a
variable that no key matches replicated without a word, and a size that the
mesh does not divide fails only deep inside the compiler:
`check_layout_map(model, layout_map)` names each such variable first.
"""

from __future__ import annotations

import logging

import keras

logger = logging.getLogger("keras_attn.models")

_ATTENTION = r".*attention[^/]*"

# (pattern, axes by role): "model" / "batch" stand for the mesh's axis names.
_LAYOUT = (
    (_ATTENTION + r"/(query|key|value)/kernel", ("batch", "model", None)),
    (_ATTENTION + r"/(query|key|value)/bias", ("model", None)),
    (_ATTENTION + r"/attention_output/kernel", ("model", None, "batch")),
    (_ATTENTION + r"/attention_output/bias", (None,)),
    (r".*feedforward_intermediate_dense/kernel", ("batch", "model")),
    (r".*feedforward_intermediate_dense/bias", ("model",)),
    (r".*feedforward_output_dense/kernel", ("model", "batch")),
    (r".*feedforward_output_dense/bias", (None,)),
    (r".*token_embedding/embeddings", ("model", "batch")),
    (r".*position_embedding/embeddings", (None, None)),
    (r".*(layer_norm|_norm)/(gamma|beta)", (None,)),
)


def layout_map(
    device_mesh,
    model_parallel_dim_name: str = "model",
    data_parallel_dim_name: str = "batch",
    *,
    fsdp: bool = True,
):
    """A `keras.distribution.LayoutMap` of keras-attn's Transformer
    backbones and tasks over `device_mesh` (see the module's table).

    Args:
        device_mesh: a `keras.distribution.DeviceMesh` with both axes below.
        model_parallel_dim_name: the mesh axis that splits heads, the
            feed-forward width and the vocabulary.
        data_parallel_dim_name: the mesh axis of the batch, which also
            splits the other axis of each kernel unless `fsdp=False`.
        fsdp: split the other axis of each kernel (the model width) on the
            batch axis, as keras-hub's layout maps do. `False`: the kernels
            are replicated over the batch axis, data parallelism times
            Megatron's (Keras's partitioner, given the batch split of the
            kernels and no layout for the activations, splits the
            activations along the model width over the batch axis instead of
            the batch, with many more collectives per step: BENCHMARKS.md,
            "Collectives per step").

    Returns:
        A `LayoutMap` for `keras.distribution.ModelParallel(layout_map=...,
        batch_dim_name=data_parallel_dim_name)`.

    Raises:
        ValueError: `device_mesh` is not a `DeviceMesh`, or lacks one of the
            axes.
    """
    if not isinstance(device_mesh, keras.distribution.DeviceMesh):
        raise ValueError(
            "`device_mesh` must be a keras.distribution.DeviceMesh. "
            f"Received: device_mesh={device_mesh!r}"
        )
    names = {"model": model_parallel_dim_name, "batch": data_parallel_dim_name}
    for argument, name in (
        ("model_parallel_dim_name", model_parallel_dim_name),
        ("data_parallel_dim_name", data_parallel_dim_name),
    ):
        if name not in device_mesh.axis_names:
            raise ValueError(
                f"`{argument}` must name an axis of `device_mesh` "
                f"{list(device_mesh.axis_names)}. Received: {argument}={name!r}"
            )
    if not isinstance(fsdp, bool):
        raise ValueError(f"`fsdp` must be True or False. Received: fsdp={fsdp!r}")
    if not fsdp:
        names["batch"] = None
    layouts = keras.distribution.LayoutMap(device_mesh)
    for pattern, axes in _LAYOUT:
        layouts[pattern] = tuple(None if axis is None else names[axis] for axis in axes)
    return layouts


def check_layout_map(model, layout_map) -> None:
    """Check that `layout_map`'s mesh divides every axis it splits.

    Args:
        model: a built Keras model (a backbone or a task).
        layout_map: a `keras.distribution.LayoutMap`, e.g. from
            `model.get_layout_map(mesh)`.

    Raises:
        ValueError: naming the first variable whose axis the mesh does not
            divide, its shape, the layout and the mesh.
    """
    for variable in model.weights:
        _check_divides(variable.path, tuple(variable.shape), layout_map[variable.path])


def mesh_sizes(device_mesh) -> dict:
    """`{axis name: size}` of a `keras.distribution.DeviceMesh`."""
    return dict(zip(device_mesh.axis_names, device_mesh.shape, strict=True))


def _indivisible_axes(shape, layout) -> list[int]:
    """The axes of `shape` that `layout` (a `TensorLayout` or None) splits
    over a mesh axis that does not divide them."""
    if layout is None:
        return []
    sizes = mesh_sizes(layout.device_mesh)
    return [
        index
        for index, (size, axis) in enumerate(zip(shape, layout.axes, strict=False))
        if axis is not None and size % sizes[axis]
    ]


def _check_divides(path, shape, layout) -> None:
    """Refuse a `layout` whose mesh does not divide an axis of the variable
    `path` of `shape` that it splits."""
    axes = _indivisible_axes(shape, layout)
    if axes:
        sizes = mesh_sizes(layout.device_mesh)
        size, axis = shape[axes[0]], layout.axes[axes[0]]
        raise ValueError(
            f"The mesh does not divide `{path}`: its shape "
            f"{shape} is split as {tuple(layout.axes)} over the mesh "
            f"{sizes}, and {size} is not a multiple of {sizes[axis]}. "
            "Choose sizes (heads, key/value heads, feed-forward width, "
            "vocabulary) that the mesh divides, or another mesh."
        )


class CheckedModelParallel(keras.distribution.ModelParallel):
    """`keras.distribution.ModelParallel` that checks, as each variable is
    created, that its layout's mesh divides the axes it splits (JAX's own
    error names neither the variable nor the mesh).

    Args:
        layout_map, batch_dim_name, auto_shard_dataset: as Keras's.
        indivisible: `"error"` (default): refuse such a variable, naming it,
            its shape and the mesh; `"replicate"`: keep that axis whole (the
            variable's other axes stay split) and log a warning naming it,
            e.g. for a character vocabulary whose size is prime.
    """

    def __init__(self, *, indivisible: str = "error", **kwargs):
        if indivisible not in ("error", "replicate"):
            raise ValueError(
                "`indivisible` must be 'error' or 'replicate'. Received: "
                f"indivisible={indivisible!r}"
            )
        super().__init__(**kwargs)
        self.indivisible = indivisible

    def get_variable_layout(self, variable):
        layout = super().get_variable_layout(variable)
        shape = tuple(variable.shape)
        if self.indivisible == "error":
            _check_divides(variable.path, shape, layout)
            return layout
        axes = _indivisible_axes(shape, layout)
        if not axes:
            return layout
        kept = [None if index in axes else a for index, a in enumerate(layout.axes)]
        logger.warning(
            "The mesh does not divide `%s` %s as %s: axes %s are kept whole (%s).",
            variable.path,
            shape,
            tuple(layout.axes),
            axes,
            tuple(kept),
        )
        return keras.distribution.TensorLayout(kept, layout.device_mesh)
