import math
import os
import tempfile

import keras
import keras_hub
import numpy as np
import pytest
from absl.testing import parameterized
from keras import ops

from keras_attn.layers.multi_head_self_attention import MultiHeadSelfAttention
from keras_attn.layers.token_and_position_embedding import TokenAndPositionEmbedding
from tests.layers.test_sinusoidal_position_encoding import formula
from tests.test_case import TestCase, to_numpy

IDS = np.array([[3, 4, 5, 6, 7], [8, 9, 2, 0, 0]], "int32")
INIT = {"vocabulary_size": 12, "sequence_length": 8, "embedding_dim": 6}


class TokenAndPositionEmbeddingTest(TestCase):
    @parameterized.named_parameters(
        ("sinusoidal", "sinusoidal", 1), ("learned", "learned", 2)
    )
    def test_layer(self, position, num_weights):
        self.run_layer_test(
            TokenAndPositionEmbedding,
            {**INIT, "position": position},
            {"inputs": IDS},
            expected_output_shape=(2, 5, 6),
            expected_num_trainable_weights=num_weights,
        )

    @parameterized.named_parameters(("unscaled", False), ("scaled", True))
    def test_token_embedding_plus_sinusoids(self, scale):
        layer = TokenAndPositionEmbedding(**INIT, scale_embeddings=scale)
        values = to_numpy(layer(IDS))
        table = to_numpy(layer.token_embedding.embeddings)
        factor = math.sqrt(6) if scale else 1.0
        expected = table[IDS] * factor + formula(np.arange(5), 6)[None]
        np.testing.assert_allclose(values, expected, atol=1e-6)

    def test_start_index_gives_the_step_of_the_full_pass(self):
        for position in ("sinusoidal", "learned"):
            layer = TokenAndPositionEmbedding(**INIT, position=position)
            full = to_numpy(layer(IDS))
            for index in range(5):
                step = layer(IDS[:, index : index + 1], start_index=index)
                np.testing.assert_allclose(to_numpy(step)[:, 0], full[:, index])

    # keras-hub's PositionEmbedding drops the Keras mask (with a warning).
    @pytest.mark.filterwarnings("ignore:Layer 'position_embedding'")
    def test_matches_keras_hub_learned_embedding_with_copied_weights(self):
        layer = TokenAndPositionEmbedding(**INIT, position="learned", mask_zero=True)
        reference = keras_hub.layers.TokenAndPositionEmbedding(
            vocabulary_size=12, sequence_length=8, embedding_dim=6, mask_zero=True
        )
        layer(IDS)
        reference(IDS)
        reference.set_weights(layer.get_weights())
        self.assertAllClose(layer(IDS), reference(IDS), atol=0)

    def test_padding_mask_is_passed_on(self):
        layer = TokenAndPositionEmbedding(**INIT)
        np.testing.assert_array_equal(to_numpy(layer.compute_mask(IDS)), IDS != 0)
        self.assertIsNone(
            TokenAndPositionEmbedding(**INIT, mask_zero=False).compute_mask(IDS)
        )
        # Downstream, self-attention ignores the padded tokens: the real tokens'
        # outputs equal those of the unpadded sequence.
        tokens = keras.Input((None,), dtype="int32")
        outputs = MultiHeadSelfAttention(num_heads=2)(layer(tokens))
        model = keras.Model(tokens, outputs)
        padded = to_numpy(model(IDS))
        unpadded = to_numpy(model(IDS[1:, :3]))
        np.testing.assert_allclose(padded[1, :3], unpadded[0], atol=1e-6)
        np.testing.assert_array_equal(padded[1, 3:], 0.0)

    def test_reverse_projects_onto_the_vocabulary_with_the_tied_embeddings(self):
        layer = TokenAndPositionEmbedding(**INIT, scale_embeddings=True)
        tokens = keras.Input((None,), dtype="int32")
        hidden = keras.layers.Dense(6)(layer(tokens))  # carries the padding mask
        logits = layer(hidden, reverse=True)
        self.assertEqual(tuple(logits.shape), (None, None, 12))
        model = keras.Model(tokens, [hidden, logits])
        hidden_values, logits_values = model(IDS)
        table = to_numpy(layer.token_embedding.embeddings)  # (V, d)
        np.testing.assert_allclose(
            to_numpy(logits_values), to_numpy(hidden_values) @ table.T, atol=1e-5
        )
        self.assertLen(layer.trainable_weights, 1)  # no extra output matrix
        mask = np.array([[True, False]])
        self.assertIs(layer.compute_mask(np.zeros((1, 2, 6), "float32"), mask), mask)
        self.assertEqual(
            layer.compute_output_shape((2, 3, 6), reverse=True), (2, 3, 12)
        )
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "model.keras")
            model.save(path)
            loaded = keras.saving.load_model(path)
        self.assertAllClose(loaded(IDS), model(IDS), atol=0)
        with self.assertRaisesRegex(ValueError, "hidden states of size"):
            layer(np.zeros((2, 3, 5), "float32"), reverse=True)

    def test_serialization_and_precision(self):
        init = {
            **INIT,
            "position": "learned",
            "mask_zero": False,
            "scale_embeddings": True,
            "embeddings_initializer": "he_normal",
            "position_initializer": "ones",
            "max_wavelength": 100,
        }
        self.run_serialization_test(TokenAndPositionEmbedding, init, {"inputs": IDS})
        self.run_serialization_test(
            TokenAndPositionEmbedding,
            {**INIT, "sequence_length": None},
            {"inputs": IDS},
        )
        self.run_precision_test(TokenAndPositionEmbedding, INIT, {"inputs": IDS})

    @pytest.mark.tf_only
    def test_saved_model_round_trip(self):
        tokens = keras.Input((None,), dtype="int32", name="tokens")
        x = TokenAndPositionEmbedding(**INIT)(tokens)
        x = MultiHeadSelfAttention(num_heads=2, causal=True)(x)
        self.run_saved_model_test(keras.Model(tokens, x), IDS)

    def test_built_frozen_keeps_its_tables_out_of_training(self):
        # `trainable=False` at construction covers the tables the layer
        # creates later, as for `keras.layers.Embedding(trainable=False)`.
        layer = TokenAndPositionEmbedding(**INIT, position="learned", trainable=False)
        tokens = keras.Input((None,), dtype="int32")
        model = keras.Model(tokens, layer(tokens))
        self.assertEqual(len(layer.weights), 2)
        self.assertEqual(model.trainable_weights, [])
        restored = TokenAndPositionEmbedding.from_config(layer.get_config())
        restored.build((None, 4))
        self.assertEqual([w.trainable for w in restored.weights], [False, False])
        layer.trainable = True  # and thawed, both train again
        self.assertEqual(len(model.trainable_weights), 2)

    def test_bad_arguments(self):
        with self.assertRaisesRegex(ValueError, "Received: position='rotary'"):
            TokenAndPositionEmbedding(**INIT, position="rotary")
        with self.assertRaisesRegex(ValueError, "Received: sequence_length=None"):
            TokenAndPositionEmbedding(12, None, 6, position="learned")
        with self.assertRaisesRegex(ValueError, "Received: vocabulary_size=0"):
            TokenAndPositionEmbedding(0, 8, 6)
        with self.assertRaisesRegex(ValueError, "Received: mask_zero='yes'"):
            TokenAndPositionEmbedding(**INIT, mask_zero="yes")
        with self.assertRaisesRegex(ValueError, "Received: max_wavelength=0"):
            TokenAndPositionEmbedding(**INIT, max_wavelength=0)
        with self.assertRaisesRegex(ValueError, "start_index=6"):
            TokenAndPositionEmbedding(**INIT)(IDS, start_index=6)
        with self.assertRaisesRegex(ValueError, "`inputs` must have rank 2"):
            TokenAndPositionEmbedding(**INIT)(ops.ones((2, 3, 1), "int32"))
