"""`_task.compiled_forward`, the network call of the task methods: the model's
answer for any number of rows, on TensorFlow and on JAX, with the weights of
the moment (this module runs in `make test-jax` too)."""

import keras
import numpy as np

from keras_attn.models import _task


def small_model():
    ids = keras.Input((None,), dtype="int32")
    hidden = keras.layers.Embedding(50, 8, mask_zero=True)(ids)
    pooled = keras.layers.GlobalAveragePooling1D()(hidden)
    return keras.Model(ids, keras.layers.Dense(2)(pooled))


def test_rows_are_padded_to_powers_of_two():
    assert [_task.bucket_rows(n) for n in (1, 2, 3, 5, 64, 65)] == [1, 2, 4, 8, 64, 128]


def test_the_compiled_pass_answers_as_the_model_for_any_rows_and_new_weights():
    model = small_model()
    rng = np.random.default_rng(0)
    forward = _task.compiled_forward(model, 8)
    assert _task.compiled_forward(model, 8) is forward  # kept per width
    assert _task.compiled_forward(model, 16) is not forward
    for rows in (1, 3, 5, 8):
        ids = rng.integers(0, 50, (rows, 8)).astype("int32")
        got = forward(ids)
        assert isinstance(got, np.ndarray) and got.shape == (rows, 2)
        np.testing.assert_allclose(
            got, keras.ops.convert_to_numpy(model(ids)), atol=1e-6
        )
    before = forward(ids)
    model.layers[-1].kernel.assign(np.ones((8, 2), "float32"))
    after = forward(ids)
    np.testing.assert_allclose(after, keras.ops.convert_to_numpy(model(ids)), atol=1e-6)
    assert not np.allclose(after, before)
