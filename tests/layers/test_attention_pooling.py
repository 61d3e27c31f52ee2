import keras
import numpy as np
import pytest

from keras_attn.layers.attention_pooling import AttentionPooling
from tests.test_case import TestCase, to_numpy

RNG = np.random.default_rng(5)
INPUTS = RNG.normal(size=(3, 5, 6)).astype("float32")
MASK = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], bool)


class AttentionPoolingTest(TestCase):
    def test_layer(self):
        self.run_layer_test(
            AttentionPooling,
            {"units": 4},
            {"inputs": INPUTS},
            expected_output_shape=(3, 6),
            expected_num_trainable_weights=3,
        )

    def test_matches_the_formula_and_honours_the_mask(self):
        layer = AttentionPooling(units=4)
        pooled, weights = layer(INPUTS, mask=MASK, return_attention_scores=True)
        kernel, bias, context = (to_numpy(w) for w in layer.weights)
        scores = np.tanh(INPUTS @ kernel + bias) @ context
        expected_weights = np.where(MASK, np.exp(scores), 0.0)
        sums = expected_weights.sum(-1, keepdims=True)
        expected_weights = np.divide(
            expected_weights, sums, where=sums > 0, out=np.zeros_like(expected_weights)
        )
        self.assertAllClose(weights, expected_weights, atol=1e-6)
        self.assertAllClose(
            pooled, np.einsum("bt,btd->bd", expected_weights, INPUTS), atol=1e-5
        )
        np.testing.assert_array_equal(to_numpy(pooled)[2], 0.0)  # no valid token

    def test_keras_mask_from_embedding(self):
        tokens = keras.Input((None,), dtype="int32")
        x = keras.layers.Embedding(10, 6, mask_zero=True)(tokens)
        pooled, weights = AttentionPooling(4)(x, return_attention_scores=True)
        model = keras.Model(tokens, [pooled, weights])
        _, weights = model(np.array([[1, 2, 0], [3, 0, 0]]))
        np.testing.assert_array_equal(to_numpy(weights)[[0, 1, 1], [2, 1, 2]], 0.0)

    def test_serialization_precision_and_bad_input(self):
        self.run_serialization_test(AttentionPooling, {"units": 4}, {"inputs": INPUTS})
        self.run_precision_test(AttentionPooling, {"units": 4}, {"inputs": INPUTS})
        with pytest.raises(ValueError, match="Received: units=-1"):
            AttentionPooling(-1)
        with pytest.raises(ValueError, match=r"Received: mask.shape=\(3, 4\)"):
            AttentionPooling(2)(INPUTS, mask=np.ones((3, 4), bool))
