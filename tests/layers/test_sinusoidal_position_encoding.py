import keras
import keras_hub
import numpy as np
import pytest
from absl.testing import parameterized
from keras import ops

from keras_attn.layers.sinusoidal_position_encoding import SinusoidalPositionEncoding
from tests.test_case import TestCase, to_numpy

INPUTS = np.random.default_rng(0).normal(size=(2, 5, 8)).astype("float32")


def formula(positions, dim, max_wavelength=10000.0):
    """`p(t, 2k) = sin(t / w^(2k/d))`, `p(t, 2k+1) = cos(t / w^(2k/d))` in float64."""
    t = np.asarray(positions, dtype="float64")[..., None]
    feature = np.arange(dim)
    angles = t / max_wavelength ** (2 * (feature // 2) / dim)
    return np.where(feature % 2 == 0, np.sin(angles), np.cos(angles))


class SinusoidalPositionEncodingTest(TestCase):
    def test_layer(self):
        self.run_layer_test(
            SinusoidalPositionEncoding,
            {},
            {"inputs": INPUTS},
            expected_output_shape=(2, 5, 8),
            expected_num_trainable_weights=0,
        )

    @parameterized.named_parameters(
        ("float32", "float32"),
        ("mixed_float16", "mixed_float16"),
        ("mixed_bfloat16", "mixed_bfloat16"),
    )
    def test_values_match_the_formula_up_to_position_4096(self, policy):
        positions = np.arange(4097)
        inputs = np.zeros((1, 4097, 256), "float32")
        expected = formula(positions, 256)
        float32_values = to_numpy(SinusoidalPositionEncoding()(inputs))
        # float32 (the value before the final cast) within 1e-3 of the formula.
        self.assertLess(np.abs(float32_values[0] - expected).max(), 1e-3)
        layer = SinusoidalPositionEncoding(dtype=policy)
        values = layer(inputs)
        compute_dtype = keras.dtype_policies.get(policy).compute_dtype
        self.assertEqual(keras.backend.standardize_dtype(values.dtype), compute_dtype)
        # Under a mixed policy the layer computes the same float32 values and
        # only casts the result: exactly the cast of the float32 encoding.
        np.testing.assert_array_equal(
            to_numpy(ops.cast(values, "float32")),
            to_numpy(ops.cast(ops.cast(float32_values, compute_dtype), "float32")),
        )
        # So the final error is the float32 error plus half an ulp of the
        # compute dtype (2**-9 for bfloat16, 2**-12 for float16 near 1).
        half_ulp = {"float32": 0.0, "float16": 2.0**-12, "bfloat16": 2.0**-9}
        error = np.abs(to_numpy(ops.cast(values, "float32"))[0] - expected)
        self.assertLess(error.max(), 1e-3 + half_ulp[compute_dtype])

    def test_keras_hub_drifts_where_this_layer_does_not(self):
        inputs = np.zeros((1, 4097, 64), "float32")
        expected = formula(np.arange(4097), 64)
        ours = SinusoidalPositionEncoding(dtype="mixed_float16")(inputs)
        theirs = keras_hub.layers.SinePositionEncoding(dtype="mixed_float16")(inputs)
        ours_error = np.abs(to_numpy(ops.cast(ours, "float32"))[0] - expected).max()
        theirs_error = np.abs(to_numpy(ops.cast(theirs, "float32"))[0] - expected).max()
        self.assertLess(ours_error, 1e-3)
        self.assertGreater(theirs_error, 0.1)

    def test_matches_keras_hub_in_float32(self):
        inputs = np.zeros((2, 64, 16), "float32")
        self.assertAllClose(
            SinusoidalPositionEncoding()(inputs),
            keras_hub.layers.SinePositionEncoding()(inputs),
            atol=1e-5,
        )

    def test_odd_dimension_ends_with_a_sine(self):
        values = to_numpy(SinusoidalPositionEncoding()(np.zeros((1, 50, 7), "float32")))
        np.testing.assert_allclose(values[0], formula(np.arange(50), 7), atol=1e-5)

    def test_max_wavelength(self):
        values = SinusoidalPositionEncoding(max_wavelength=100)(INPUTS)
        np.testing.assert_allclose(
            to_numpy(values)[0], formula(np.arange(5), 8, 100.0), atol=1e-6
        )

    def test_output_is_the_encoding_broadcast_over_the_batch(self):
        values = to_numpy(SinusoidalPositionEncoding()(INPUTS))
        self.assertEqual(values.shape, INPUTS.shape)
        np.testing.assert_allclose(values[0], values[1])
        np.testing.assert_allclose(values[0], formula(np.arange(5), 8), atol=1e-6)

    def test_start_index_gives_the_positions_of_a_decoding_step(self):
        layer = SinusoidalPositionEncoding()
        full = to_numpy(layer(np.zeros((2, 12, 8), "float32")))
        for index in (0, 3, 11):
            for start in (index, ops.convert_to_tensor(index, "int32")):
                step = layer(np.zeros((2, 1, 8), "float32"), start_index=start)
                np.testing.assert_allclose(to_numpy(step)[:, 0], full[:, index])

    def test_explicit_positions(self):
        layer = SinusoidalPositionEncoding()
        positions = np.array([[0, 1, 2, 3, 4], [0, 0, 0, 1, 2]], "int32")
        values = to_numpy(layer(INPUTS, positions=positions))
        np.testing.assert_allclose(values, formula(positions, 8), atol=1e-6)
        shared = to_numpy(layer(INPUTS, positions=np.array([4, 3, 2, 1, 0])))
        np.testing.assert_allclose(
            shared[1], formula(np.array([4, 3, 2, 1, 0]), 8), atol=1e-6
        )

    def test_start_index_under_jit(self):
        layer = SinusoidalPositionEncoding()
        inputs = keras.Input((1, 8))
        index = keras.Input((), dtype="int32", batch_size=1)
        model = keras.Model([inputs, index], layer(inputs, start_index=index[0]))
        model.compile(jit_compile=True)
        got = model.predict([np.zeros((1, 1, 8), "float32"), np.array([7])], verbose=0)
        np.testing.assert_allclose(got[0, 0], formula([7], 8)[0], atol=1e-6)

    def test_keras_mask_is_passed_on(self):
        tokens = keras.Input((None,), dtype="int32")
        embedded = keras.layers.Embedding(10, 8, mask_zero=True)(tokens)
        encoded = SinusoidalPositionEncoding()(embedded)
        # The mask reaches an attention layer downstream: padded keys ignored.
        attended = keras.layers.Attention()([encoded, encoded])
        model = keras.Model(tokens, attended)
        padded = to_numpy(model(np.array([[1, 2, 0]])))
        unpadded = to_numpy(model(np.array([[1, 2]])))
        np.testing.assert_allclose(padded[:, :2], unpadded, atol=1e-6)
        layer = SinusoidalPositionEncoding()
        mask = np.array([[True, False]])
        self.assertIs(layer.compute_mask(INPUTS[:, :2], mask), mask)

    def test_serialization(self):
        self.run_serialization_test(
            SinusoidalPositionEncoding, {"max_wavelength": 500}, {"inputs": INPUTS}
        )

    @pytest.mark.tf_only
    def test_saved_model_round_trip(self):
        inputs = keras.Input((None, 8), name="inputs")
        outputs = inputs + SinusoidalPositionEncoding()(inputs)
        self.run_saved_model_test(keras.Model(inputs, outputs), INPUTS)

    def test_bad_arguments(self):
        for value in (0, -1.0, "10000", True, None):
            with self.assertRaisesRegex(ValueError, "Received: max_wavelength="):
                SinusoidalPositionEncoding(max_wavelength=value)
        with self.assertRaisesRegex(ValueError, "`inputs` must have rank 3"):
            SinusoidalPositionEncoding()(INPUTS[:, :, 0])
        with self.assertRaisesRegex(ValueError, "`positions` must have rank"):
            SinusoidalPositionEncoding()(INPUTS, positions=np.zeros((2, 5, 1), "int32"))
