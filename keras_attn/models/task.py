"""`BackboneTask`: what the Transformer tasks share as keras-hub-style tasks.

A task is a functional `keras.Model` with a head on a backbone
(`keras_attn.models.backbones`), reachable as `task.backbone`, and the text
methods of its kind. This module gives the tasks:

- the two ways to build one: from a backbone (`TextClassifier(backbone=...)`,
  as keras-hub's tasks) or from the sizes, which build the backbone;
- `save_to_preset(directory)` / `from_preset(directory)` in keras-hub's
  preset layout (`keras_attn.models.presets`);
- the loading of files saved before the backbones (keras-attn 0.2 and
  earlier), through `keras_attn._compat_0_2.FilesBeforeBackbones`.

Imports no TensorFlow.
"""

from __future__ import annotations

import inspect

import keras

from keras_attn._compat_0_2 import FilesBeforeBackbones, blocks_of_config
from keras_attn.models import _task
from keras_attn.models._saving import ExplicitSignatures
from keras_attn.models._setattr import SetattrBeforeInit
from keras_attn.models.layouts import layout_map
from keras_attn.models.quantization import (
    deserialize_dtype,
    head_policy_config,
    plain_policy,
    quantized_policy_map,
)


class BackboneTask(FilesBeforeBackbones, SetattrBeforeInit, ExplicitSignatures):
    """Mixin of the tasks built on backbones (put first in the bases).

    Subclasses set `backbone` (and any other backbone, listed by
    `backbones`) before calling `keras.Model.__init__`.
    """

    @property
    def backbones(self) -> tuple:
        """The task's backbones (`backbone` first)."""
        return (self.backbone,)

    # keras-hub's static `get_layout_map(device_mesh, model_parallel_dim_name,
    # data_parallel_dim_name)`, with `fsdp`: `keras_attn.models.layouts`.
    get_layout_map = staticmethod(layout_map)

    # -- construction ----------------------------------------------------------

    @staticmethod
    def check_backbone(name: str, backbone, cls):
        if not isinstance(backbone, cls):
            raise ValueError(
                f"`{name}` must be a {cls.__name__}. Received: {name}={backbone!r}"
            )
        return backbone

    @staticmethod
    def check_dtype(dtype, backbones):
        """`dtype` for building the task's backbones (None: the global
        policy). With backbones given they carry their own policy: a `dtype`
        given too must be theirs (a task's layers share one policy)."""
        if dtype is None:
            return None
        policy = keras.dtype_policies.get(dtype)
        for backbone in backbones:
            if backbone is not None and isinstance(backbone, keras.Model):
                theirs = backbone.dtype_policy
                if _policy_name(theirs) != _policy_name(policy):
                    raise ValueError(
                        "`dtype` must be the given backbone's policy "
                        f"({_policy_name(theirs)!r}), or left out. Received: "
                        f"dtype={_policy_name(policy)!r}"
                    )
        return policy

    def _adopt_dtype_policy(self, backbone):
        """Give the task its backbone's policy (the default policy of a
        quantized backbone's `DTypePolicyMap`)."""
        self.dtype_policy = plain_policy(backbone.dtype_policy)

    @staticmethod
    def check_sizes_unset(init, given: dict, backbone_name: str = "backbone"):
        """A `ValueError` naming the size arguments of `given` (arguments of
        `init`) that differ from their defaults: with a backbone given, the
        sizes are the backbone's, and an argument would be silently ignored."""
        parameters = inspect.signature(init).parameters
        changed = [
            name
            for name, value in given.items()
            if value is not parameters[name].default
            and value != parameters[name].default
        ]
        if changed:
            shown = ", ".join(f"{name}={given[name]!r}" for name in changed)
            raise ValueError(
                f"With `{backbone_name}` given, the sizes are the backbone's: "
                f"leave {', '.join(f'`{n}`' for n in changed)} out. Received: {shown}"
            )

    def head_policy_config(self) -> dict:
        """`{"dtype": map}` for `get_config` when layers outside the
        backbones are quantized (a `DTypePolicyMap` of them, which the
        constructor's `dtype` takes back), else `{}`."""
        return head_policy_config(self)

    @classmethod
    def from_config(cls, config):
        """The task of a config with one `tokenizer` (the translator, with
        two and a second backbone, has its own)."""
        config = deserialize_dtype(dict(config))  # a quantized head's map
        config["tokenizer"] = _task.deserialize_tokenizer(config.get("tokenizer"))
        if "backbone" in config:
            config["backbone"] = deserialize_backbone(config["backbone"])
            return cls(**config)
        # A config saved before the backbones (keras-attn 0.2, and this
        # version until the backbones).
        with blocks_of_config(config):  # 0.2's: blocks of that structure
            return cls(**config)

    # -- presets ---------------------------------------------------------------

    def save_to_preset(self, preset_dir):
        """Save the task as a keras-hub preset directory (see
        `keras_attn.models.presets.save_to_preset`)."""
        from keras_attn.models.presets import save_to_preset

        return save_to_preset(self, preset_dir)

    @classmethod
    def from_preset(cls, preset, load_weights: bool = True, **kwargs):
        """The task of a preset directory written by `save_to_preset` (a
        finished run of the example scripts is one). See
        `keras_attn.models.presets.load_task`."""
        from keras_attn.models.presets import load_task

        return load_task(cls, preset, load_weights=load_weights, **kwargs)


def _policy_name(policy) -> str:
    return plain_policy(policy).name


def serialize_dtype_policy(model) -> dict:
    """`model`'s dtype policy serialized as keras-hub's `Backbone.get_config`
    does: a `DTypePolicyMap` of the quantized layers' policies (under the
    model's policy) once any is quantized, else the policy itself. A model
    built from such a map (a quantized model loaded) records its map, with
    the layers quantized since then added."""
    policy = model.dtype_policy
    layers = list(model._flatten_layers())
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        missing = [
            layer
            for layer in layers
            if layer.quantization_mode is not None and layer.path not in policy
        ]
        if missing:
            policy = quantized_policy_map(policy.default_policy, missing, start=policy)
    else:
        policy = quantized_policy_map(policy, layers) or policy
    return keras.dtype_policies.serialize(policy)


def deserialize_backbone(config, **extra):
    """A backbone from its serialized config (`extra`: constructor arguments
    that are not part of it, such as a shared embedding)."""
    if isinstance(config, keras.Model):
        return config
    if extra:
        config = {**config, "config": {**config["config"], **extra}}
    return keras.saving.deserialize_keras_object(config)
