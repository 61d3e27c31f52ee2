"""The optimizer's variables built before the first training step on
TensorFlow, so that Keras's train function is traced once, not twice."""

from __future__ import annotations

import keras


def build_optimizer(model) -> bool:
    """Build `model.optimizer` for `model.trainable_variables` now, eagerly,
    where Keras would build it inside the first traced training step;
    returns whether it did.

    Keras's TensorFlow trainer (without a distribution strategy) defers the
    optimizer's build to the trace of its train function. The trace then
    creates variables (two slots per weight for Adam), and a `tf.function`
    that creates variables is traced a second time before it runs: the
    model's forward and backward pass are traced twice, and each slot is
    created inside a graph. Built here
    from the same variables Keras would give it at that trace (the model's
    trainable variables when training starts), the optimizer is the same
    and the train function is traced once.

    Does nothing on the other backends (whose trainers build it first
    themselves), under a distribution strategy (Keras builds it in the
    strategy's scope), for a model that is not built or has no optimizer,
    or for one already built.
    """
    optimizer = getattr(model, "optimizer", None)
    if (
        keras.backend.backend() != "tensorflow"
        or optimizer is None
        or optimizer.built
        or not model.built
        or getattr(model, "_distribute_strategy", None) is not None
    ):
        return False
    optimizer.build(model.trainable_variables)
    return True


class BuildsOptimizerFirst:
    """Mixin of the tasks (before `keras.Model` in the bases): `fit` and
    `train_on_batch` build the optimizer before the first training step on
    TensorFlow (`build_optimizer`), so its train function is traced once."""

    def fit(self, *args, **kwargs):
        build_optimizer(self)
        return super().fit(*args, **kwargs)

    def train_on_batch(self, *args, **kwargs):
        build_optimizer(self)
        return super().train_on_batch(*args, **kwargs)
