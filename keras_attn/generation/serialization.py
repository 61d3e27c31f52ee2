"""Samplers by name or config: `get`, `serialize`, `deserialize`.

keras-hub's `keras_hub.samplers.get` / `serialize` / `deserialize` for
keras-attn's samplers: `get("top_k")` is `TopKSampler()`, `get({"class_name":
"top_k", "config": {"k": 10}})` is `TopKSampler(k=10)`, and
`deserialize(serialize(sampler))` rebuilds `sampler`. The tasks' `sampler`
arguments take any of these.
"""

from __future__ import annotations

import json

import keras

from keras_attn.generation.beam_sampler import BeamSampler
from keras_attn.generation.greedy_sampler import GreedySampler
from keras_attn.generation.random_sampler import RandomSampler
from keras_attn.generation.sampler import Sampler
from keras_attn.generation.top_k_sampler import TopKSampler
from keras_attn.generation.top_p_sampler import TopPSampler

# keras-hub's names, and the class names `serialize` writes.
SAMPLERS = {
    "beam": BeamSampler,
    "greedy": GreedySampler,
    "random": RandomSampler,
    "top_k": TopKSampler,
    "top_p": TopPSampler,
}
_OBJECTS = {**SAMPLERS, **{cls.__name__: cls for cls in SAMPLERS.values()}}


def serialize(sampler: Sampler) -> dict:
    """`sampler`'s Keras config (`keras.saving.serialize_keras_object`)."""
    if not isinstance(sampler, Sampler):
        raise ValueError(
            "`sampler` must be a keras_attn.generation sampler. "
            f"Received: sampler={sampler!r}"
        )
    return keras.saving.serialize_keras_object(sampler)


def deserialize(config, custom_objects=None) -> Sampler:
    """The sampler of `config`: a name (`"top_k"`) or a dict with
    `class_name` (`"top_k"`, `"TopKSampler"`) and `config`."""
    try:
        sampler = keras.saving.deserialize_keras_object(
            config,
            module_objects=_OBJECTS,
            custom_objects=custom_objects,
            printable_module_name="sampler",
        )
    except TypeError as error:  # an unknown class, arguments it does not take
        raise ValueError(
            f"`config` must describe a keras_attn.generation sampler ({error}). "
            f"Received: config={config!r}"
        ) from None
    if not isinstance(sampler, Sampler):
        raise ValueError(
            "`config` must describe a keras_attn.generation sampler. "
            f"Received: config={config!r}"
        )
    return sampler


def get(identifier) -> Sampler | None:
    """A sampler from `identifier`, as `keras_hub.samplers.get`: None; a
    sampler (returned as is); a lowercase name of `SAMPLERS` (`"greedy"`,
    `"top_k"`, ...: the class with its defaults); a dict config
    (`deserialize`); a `Sampler` subclass (a new instance)."""
    if identifier is None or isinstance(identifier, Sampler):
        return identifier
    if isinstance(identifier, str):
        if identifier not in SAMPLERS:
            raise ValueError(
                f"`sampler` must be one of {sorted(SAMPLERS)} as a string. "
                f"Received: sampler={identifier!r}"
            )
        return SAMPLERS[identifier]()
    if isinstance(identifier, dict):
        return deserialize(identifier)
    if isinstance(identifier, type) and issubclass(identifier, Sampler):
        return identifier()
    raise ValueError(
        "`sampler` must be a keras_attn.generation sampler, its name or its "
        f"config. Received: sampler={identifier!r}"
    )


def compile_key(sampler) -> tuple:
    """`(key, depends)` that a task's compiled decodings are kept under for
    `sampler`: a sampler of keras-attn's own classes by its class and config
    (without the seed, an input of the decodings), so equal samplers made
    anew at every call share one compiled function instead of tracing and
    keeping one each; any other object by its identity (a class of one's
    own may hold more than its config says), kept alive in `depends`."""
    if type(sampler) in SAMPLERS.values():
        config = {k: v for k, v in sampler.get_config().items() if k != "seed"}
        return (type(sampler).__name__, json.dumps(config, sort_keys=True)), ()
    return ("id", id(sampler)), (sampler,)
