"""Attributes set before `keras.Model.__init__` on the PyTorch backend.

The backbones and tasks are functional models that build their layers, and
keep them as attributes, before calling `super().__init__(inputs, outputs)`.
On PyTorch a Keras layer is a `torch.nn.Module`, whose `__setattr__` refuses
a module-valued attribute before `Module.__init__` ("cannot assign module
before Module.__init__() call"). keras-hub's `Backbone` and `Task` route
around it the same way: on torch, an attribute set before the model is
initialised, or through a property, is set on the object directly. The
functional graph tracks every layer that carries state, so nothing is lost
from the weights or the `.keras` file.
"""

from __future__ import annotations

import keras


class SetattrBeforeInit:
    """Mixin (before `keras.Model` in the bases) giving keras-hub's torch
    `__setattr__` route."""

    def __setattr__(self, name, value):
        if keras.config.backend() == "torch":
            initialised = "_modules" in self.__dict__  # torch.nn.Module.__init__ ran
            is_property = isinstance(getattr(type(self), name, None), property)
            if is_property or not initialised:
                return object.__setattr__(self, name, value)
        return super().__setattr__(name, value)
