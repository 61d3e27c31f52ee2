"""Loading what keras-attn 0.2 and earlier saved, in one place.

Until 0.2 the Transformer blocks were classes named `TransformerEncoderBlock`
/ `TransformerDecoderBlock` holding their sublayers in public attributes,
and the tasks held their layers directly instead of on backbones. Their
`.keras` files, configs and weight files still load (and save again in
their own layout) through what is here:

- `legacy_block_class` and the two classes it registers under the old names
  (`keras_attn>TransformerEncoderBlock`, `keras_attn>TransformerDecoderBlock`);
- `block_structure_config` / `blocks_of_config` / `block_class`: a model
  config records that its blocks have keras-hub's structure; one saved
  before (without the entry) builds blocks of the old structure;
- `FilesBeforeBackbones`, the tasks' mixin that reads a weight file whose
  task group holds the embedding itself (saved before the backbones).

The model classes only call these hooks; nothing else in the package knows
the old layouts.
"""

from __future__ import annotations

import contextlib
import contextvars

import keras

from keras_attn.layers.transformer_decoder_block import TransformerDecoder
from keras_attn.layers.transformer_encoder_block import TransformerEncoder

# A model config records this entry when its blocks have keras-hub's
# structure; model configs saved by keras-attn 0.2 and earlier lack it.
BLOCK_STRUCTURE_KEY = "block_structure"
_KERAS_HUB_STRUCTURE = "keras_hub"
_old_structure = contextvars.ContextVar("keras_attn_old_block_structure", default=False)
_LEGACY_CLASSES: dict = {}  # block class -> the class of the old structure


def block_structure_config(blocks) -> dict:
    """The entry of a model's config that says its `blocks` are keras-hub's;
    none (the old configs' form) when they are of the old structure (a model
    loaded from an old file saves in its old layout again)."""
    legacy_classes = tuple(_LEGACY_CLASSES.values())
    if any(isinstance(block, legacy_classes) for block in blocks):
        return {}
    return {BLOCK_STRUCTURE_KEY: _KERAS_HUB_STRUCTURE}


@contextlib.contextmanager
def blocks_of_config(config: dict):
    """Build a model's blocks in the structure its (saved) `config` names.

    Pops the `block_structure` entry from `config`; inside the context,
    `block_class` gives the classes of the old structure when the entry is
    missing (a model saved by keras-attn 0.2 or earlier), so the weights of
    that model's `.keras` file load.
    """
    structure = config.pop(BLOCK_STRUCTURE_KEY, None)
    if structure not in (None, _KERAS_HUB_STRUCTURE):
        raise ValueError(
            f"`{BLOCK_STRUCTURE_KEY}` must be {_KERAS_HUB_STRUCTURE!r} (or absent "
            f"in configs saved by keras-attn 0.2). Received: "
            f"{BLOCK_STRUCTURE_KEY}={structure!r}"
        )
    token = _old_structure.set(structure is None)
    try:
        yield
    finally:
        _old_structure.reset(token)


def block_class(cls):
    """`cls`, or its class of the old structure inside `blocks_of_config` of
    an old config."""
    return _LEGACY_CLASSES[cls] if _old_structure.get() else cls


def legacy_block_class(current_class, name: str, attributes: dict):
    """The class that loads `.keras` files saved before keras-hub's structure.

    Until keras-attn 0.2 the blocks were classes named `name`
    (`TransformerEncoderBlock`, `TransformerDecoderBlock`) that held their
    sublayers in public attributes; their `.keras` files name
    `keras_attn>{name}` and store the weights in groups named after that
    class and those attributes. The returned subclass of `current_class` is
    registered under that name, is named `name` (the group of a layer in a
    functional model) and has the old public attributes as read-only
    properties (Keras's saver visits public attributes first), so such
    files load, and save again, in their own layout. New code uses
    `current_class` (the public `TransformerEncoderBlock` and
    `TransformerDecoderBlock` are aliases of it).

    Args:
        current_class: the block class.
        name: the old class name.
        attributes: old public attribute name -> current private one.
    """

    def alias(private_name):
        return property(
            lambda self: getattr(self, private_name, None),
            doc=f"The sublayer `{private_name}` (layout of old `.keras` files).",
        )

    namespace = {old: alias(private) for old, private in attributes.items()}
    namespace["__doc__"] = (
        f"`{current_class.__name__}` in the layout of the `.keras` files that "
        f"keras-attn 0.2 and earlier saved (class `{name}`)."
    )
    namespace["__module__"] = current_class.__module__
    legacy = type(name, (current_class,), namespace)
    legacy.__qualname__ = f"_Legacy{name}"
    _LEGACY_CLASSES[current_class] = legacy
    return keras.saving.register_keras_serializable(package="keras_attn", name=name)(
        legacy
    )


# Reads the `.keras` files that name `keras_attn>TransformerEncoderBlock`.
_LegacyTransformerEncoderBlock = legacy_block_class(
    TransformerEncoder,
    "TransformerEncoderBlock",
    {
        "self_attention": "_self_attention_layer",
        "self_attention_layer_norm": "_self_attention_layer_norm",
        "self_attention_dropout": "_self_attention_dropout",
        "feedforward_layer_norm": "_feedforward_layer_norm",
        "feedforward_intermediate_dense": "_feedforward_intermediate_dense",
        "feedforward_output_dense": "_feedforward_output_dense",
        "feedforward_dropout": "_feedforward_dropout",
    },
)

# Reads the `.keras` files that name `keras_attn>TransformerDecoderBlock`.
_LegacyTransformerDecoderBlock = legacy_block_class(
    TransformerDecoder,
    "TransformerDecoderBlock",
    {
        "self_attention": "_self_attention_layer",
        "self_attention_layer_norm": "_self_attention_layer_norm",
        "self_attention_dropout": "_self_attention_dropout",
        "cross_attention": "_cross_attention_layer",
        "cross_attention_layer_norm": "_cross_attention_layer_norm",
        "cross_attention_dropout": "_cross_attention_dropout",
        "feedforward_intermediate_dense": "_feedforward_intermediate_dense",
        "feedforward_output_dense": "_feedforward_output_dense",
        "feedforward_layer_norm": "_feedforward_layer_norm",
        "feedforward_dropout": "_feedforward_dropout",
    },
)


class FilesBeforeBackbones:
    """Mixin of the tasks (put before `keras.Model`): a weight file saved
    before the backbones (keras-attn 0.2, whose task group holds the
    embedding and blocks itself) loads, its layers read in the task's old
    order. Subclasses have `backbones`."""

    def load_own_variables(self, store):
        super().load_own_variables(store)
        # Keras's loader calls this on the task first, then walks `layers`:
        # a file with the embedding at its top level was saved before the
        # backbones, so that walk gets the backbones' layers in their place.
        object.__setattr__(self, "_flat_file", _is_flat_file(store))

    @property
    def layers(self):
        layers = super().layers
        if not self.__dict__.get("_flat_file"):
            return layers
        object.__setattr__(self, "_flat_file", False)
        return _flattened(layers, self.backbones)


def _is_flat_file(store) -> bool:
    """Whether the task's group in a weights file (Keras's `H5IOStore`, at
    the task's path: the root, or a member's group in an ensemble) holds the
    embedding itself, not a backbone's group."""
    h5_file = getattr(store, "h5_file", None)
    if h5_file is None:
        return False
    path = getattr(store, "_h5_entry_path", None) or ""
    group = h5_file[path] if path and path in h5_file else h5_file
    if path and path not in h5_file:
        return False
    return "layers" in group and "token_and_position_embedding" in group["layers"]


def _flattened(layers, backbones) -> list:
    """`layers` with each backbone replaced by its own layers (its inputs
    left out), each layer once: the task's layers as a task built without
    backbones had them, class by class in the same order."""
    found, seen = [], set()
    for layer in layers:
        inner = [layer]
        if any(layer is backbone for backbone in backbones):
            inner = [
                sublayer
                for sublayer in layer.layers
                if not isinstance(sublayer, keras.layers.InputLayer)
            ]
        for sublayer in inner:
            if id(sublayer) not in seen:
                seen.add(id(sublayer))
                found.append(sublayer)
    return found
