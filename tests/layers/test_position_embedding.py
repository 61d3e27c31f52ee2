import keras
import keras_hub
import numpy as np
import pytest
from keras import ops

from keras_attn.layers.position_embedding import PositionEmbedding
from tests.test_case import TestCase, to_numpy

INPUTS = np.random.default_rng(1).normal(size=(2, 5, 4)).astype("float32")


class PositionEmbeddingTest(TestCase):
    def test_layer(self):
        self.run_layer_test(
            PositionEmbedding,
            {"sequence_length": 8},
            {"inputs": INPUTS},
            expected_output_shape=(2, 5, 4),
            expected_num_trainable_weights=1,
        )

    def test_rows_of_the_table_broadcast_over_the_batch(self):
        layer = PositionEmbedding(sequence_length=8)
        values = to_numpy(layer(INPUTS))
        table = to_numpy(layer.position_embeddings)
        self.assertEqual(table.shape, (8, 4))
        np.testing.assert_array_equal(values[0], table[:5])
        np.testing.assert_array_equal(values[1], table[:5])

    def test_start_index_and_positions(self):
        layer = PositionEmbedding(sequence_length=8)
        layer(INPUTS)
        table = to_numpy(layer.position_embeddings)
        for start in (3, ops.convert_to_tensor(3, "int32")):
            step = to_numpy(layer(INPUTS[:, :2], start_index=start))
            np.testing.assert_array_equal(step[0], table[3:5])
        positions = np.array([[0, 0, 1, 2, 3], [7, 6, 5, 4, 3]])
        np.testing.assert_array_equal(
            to_numpy(layer(INPUTS, positions=positions)), table[positions]
        )

    def test_matches_keras_hub_with_copied_weights(self):
        layer = PositionEmbedding(sequence_length=8)
        reference = keras_hub.layers.PositionEmbedding(sequence_length=8)
        layer(INPUTS)
        reference(INPUTS)
        reference.set_weights(layer.get_weights())
        self.assertAllClose(layer(INPUTS), reference(INPUTS), atol=0)
        self.assertAllClose(
            layer(INPUTS[:, :1], start_index=6),
            reference(INPUTS[:, :1], start_index=6),
            atol=0,
        )

    def test_keras_mask_is_passed_on(self):
        layer = PositionEmbedding(sequence_length=8)
        mask = np.array([[True, False]])
        self.assertIs(layer.compute_mask(INPUTS[:, :2], mask), mask)

    def test_serialization_and_precision(self):
        init = {"sequence_length": 6, "initializer": "he_normal"}
        self.run_serialization_test(PositionEmbedding, init, {"inputs": INPUTS})
        self.run_precision_test(PositionEmbedding, init, {"inputs": INPUTS})

    @pytest.mark.tf_only
    def test_saved_model_round_trip(self):
        inputs = keras.Input((5, 4), name="inputs")
        outputs = inputs + PositionEmbedding(sequence_length=8)(inputs)
        self.run_saved_model_test(keras.Model(inputs, outputs), INPUTS)

    def test_bad_arguments(self):
        for value in (0, None, 2.5, "8"):
            with self.assertRaisesRegex(ValueError, "Received: sequence_length="):
                PositionEmbedding(sequence_length=value)
        layer = PositionEmbedding(sequence_length=4)
        with self.assertRaisesRegex(ValueError, "start_index=0"):
            layer(INPUTS)
        with self.assertRaisesRegex(ValueError, "start_index=3"):
            layer(INPUTS[:, :2], start_index=3)
        with self.assertRaisesRegex(ValueError, "`inputs` must have rank 3"):
            PositionEmbedding(sequence_length=4)(INPUTS[:, :, 0])
