"""The tasks' `fit` and `train_on_batch`, and `fit_within_budget`, build the
optimizer before the first training step on TensorFlow: Keras's train
function is traced once (a trace that creates the optimizer's variables is
traced twice), and training is the same."""

import keras
import numpy as np
import pytest

from keras_attn._optimizer import build_optimizer
from keras_attn.models import TextClassifier, TransformerLanguageModel
from keras_attn.training import fit_within_budget
from tests.test_case import to_numpy

pytestmark = pytest.mark.tf_only

RNG = np.random.default_rng(7)
TOKENS = RNG.integers(1, 20, size=(8, 6)).astype("int32")
LABELS = RNG.integers(0, 2, size=(8, 1)).astype("float32")


def _classifier():
    keras.utils.set_random_seed(3)
    model = TextClassifier(
        20, 8, embedding_dim=8, num_heads=2, intermediate_dim=16, num_layers=1
    )
    model.compile(optimizer="adam", loss="binary_crossentropy")
    return model


def _count_traces(model):
    """Counts the calls of `model.train_step`: Python runs it only when
    Keras's train function is traced."""
    traces = [0]
    train_step = model.train_step

    def counted(data):
        traces[0] += 1
        return train_step(data)

    model.train_step = counted
    return traces


def test_fit_traces_the_train_function_once():
    model = _classifier()
    traces = _count_traces(model)
    model.fit(TOKENS, LABELS, batch_size=4, epochs=2, verbose=0)
    assert traces[0] == 1
    assert int(model.optimizer.iterations.numpy()) == 4
    # Adam's two slots per trainable variable, each of its variable's shape.
    slots = {v.path: v for v in model.optimizer.variables}
    for variable in model.trainable_variables:
        name = variable.path.replace("/", "_")
        momentum = [v for path, v in slots.items() if path.endswith(f"{name}_momentum")]
        assert len(momentum) == 1 and momentum[0].shape == variable.shape


def test_train_on_batch_traces_once_and_trains_as_keras_does():
    built_first, deferred = _classifier(), _classifier()
    traces = _count_traces(built_first)
    for _ in range(3):
        built_first.train_on_batch(TOKENS, LABELS)
        # A plain `keras.Model.train_on_batch`: the optimizer built inside the
        # traced step, as Keras does by itself.
        keras.Model.train_on_batch(deferred, TOKENS, LABELS)
    assert traces[0] == 1
    np.testing.assert_allclose(
        to_numpy(built_first(TOKENS)), to_numpy(deferred(TOKENS)), atol=1e-6
    )


def test_only_the_trainable_variables_at_the_start_of_training_get_slots():
    model = _classifier()
    model.backbone.trainable = False
    model.compile(optimizer="adam", loss="binary_crossentropy")
    assert build_optimizer(model)
    assert not build_optimizer(model)  # built once
    count = len(model.trainable_variables)
    assert len(model.optimizer.variables) == 2 + 2 * count  # iterations, rate
    model.fit(TOKENS, LABELS, batch_size=8, epochs=1, verbose=0)


def test_nothing_to_build_without_an_optimizer_or_a_built_model():
    model = _classifier()
    model.optimizer = None
    assert not build_optimizer(model)

    class Unbuilt(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

    unbuilt = Unbuilt()
    unbuilt.compile(optimizer="adam", loss="mse")
    assert not build_optimizer(unbuilt)
    unbuilt.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0)
    assert unbuilt.optimizer.built


def test_fit_within_budget_builds_the_optimizer_of_any_model(tmp_path):
    import tensorflow as tf

    keras.utils.set_random_seed(5)
    model = TransformerLanguageModel(
        vocabulary_size=20,
        sequence_length=8,
        embedding_dim=8,
        num_layers=1,
        num_heads=2,
        intermediate_dim=16,
    )
    # A plain Keras model around the task: not the task's own `fit`.
    wrapper = keras.Model(model.inputs, model.outputs)
    wrapper.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    traces = _count_traces(wrapper)
    ids = RNG.integers(1, 20, size=(8, 8)).astype("int32")
    data = tf.data.Dataset.from_tensor_slices((ids, ids)).batch(4)
    result = fit_within_budget(
        wrapper, data, data, tmp_path, epochs=1, tensorboard=False, verbose=0
    )
    assert traces[0] == 1
    assert result.steps == 2
