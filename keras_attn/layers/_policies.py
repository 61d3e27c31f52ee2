"""The dtype policies a layer's config records after quantization."""

from __future__ import annotations

import keras


def with_quantized_policies(layer, config: dict) -> dict:
    """`config` with `dtype` a `DTypePolicyMap` when sublayers are quantized.

    After `quantize`, a layer's projections have policies that differ from
    the layer's own. Recording them by path (the pattern of Keras's
    `DTypePolicyMap` docstring and of keras-hub's backbones) lets a saved
    quantized model rebuild quantized sublayers and load their weights; the
    layer passes its policy to its sublayers, which look up their own path.
    """
    policy = layer.dtype_policy
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        return config  # already a map: serialized as it is
    policy_map = keras.dtype_policies.DTypePolicyMap(default_policy=policy)
    for sublayer in layer._flatten_layers(include_self=False):
        if sublayer.quantization_mode is not None:
            policy_map[sublayer.path] = sublayer.dtype_policy
    if len(policy_map) > 0:
        config["dtype"] = keras.dtype_policies.serialize(policy_map)
    return config
