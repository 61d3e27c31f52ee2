"""`make_optimizer`: AdamW with decoupled weight decay and, on request, a
moving average of the weights."""

import keras
import numpy as np
import pytest

from keras_attn.training import make_optimizer


def test_adamw_with_its_arguments_and_no_average_by_default():
    optimizer = make_optimizer(3e-4, weight_decay=0.1, clipnorm=1.0)
    assert isinstance(optimizer, keras.optimizers.AdamW)
    assert float(keras.ops.convert_to_numpy(optimizer.learning_rate)) == (
        pytest.approx(3e-4)
    )
    assert optimizer.weight_decay == 0.1 and optimizer.clipnorm == 1.0
    assert not optimizer.use_ema
    assert make_optimizer(1e-3).clipnorm is None


def test_a_momentum_keeps_the_moving_average():
    optimizer = make_optimizer(1e-3, ema_momentum=0.999)
    assert optimizer.use_ema and optimizer.ema_momentum == 0.999


def test_the_decay_is_decoupled_from_the_gradient():
    """With a zero gradient, AdamW shrinks each weight by lr * decay alone."""
    weight = keras.Variable(np.full((3,), 2.0, "float32"))
    optimizer = make_optimizer(0.1, weight_decay=0.5)
    optimizer.apply_gradients([(keras.ops.zeros((3,)), weight)])
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(weight), 2.0 * (1 - 0.1 * 0.5), rtol=1e-6
    )


def test_the_average_follows_the_weights_with_its_momentum():
    weight = keras.Variable(np.zeros((2,), "float32"))
    optimizer = make_optimizer(0.1, weight_decay=0.0, ema_momentum=0.5)
    optimizer.build([weight])
    for _ in range(3):
        optimizer.apply_gradients([(keras.ops.ones((2,)), weight)])
    # Adam's first steps move each weight by -lr: -0.1, -0.2, -0.3. Keras
    # starts the average at the first step's weights, then averages.
    expected = 0.5 * (0.5 * -0.1 + 0.5 * -0.2) + 0.5 * -0.3
    np.testing.assert_allclose(keras.ops.convert_to_numpy(weight), -0.3, rtol=1e-4)
    optimizer.finalize_variable_values([weight])  # what ends a fit: the average
    np.testing.assert_allclose(keras.ops.convert_to_numpy(weight), expected, rtol=1e-4)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"learning_rate": 0.0},
            "`learning_rate` must be > 0. Received: learning_rate=0.0",
        ),
        (
            {"weight_decay": -0.1},
            "`weight_decay` must be >= 0. Received: weight_decay=-0.1",
        ),
        ({"ema_momentum": 1.0}, r"`ema_momentum` must be in \[0, 1\)"),
        ({"ema_momentum": -0.1}, r"`ema_momentum` must be in \[0, 1\)"),
        ({"clipnorm": 0.0}, "`clipnorm` must be > 0 or None"),
        ({"learning_rate": float("nan")}, "`learning_rate` must be > 0"),
        ({"weight_decay": True}, "`weight_decay` must be >= 0"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    arguments = {"learning_rate": 1e-3, **kwargs}
    with pytest.raises(ValueError, match=message):
        make_optimizer(arguments.pop("learning_rate"), **arguments)
