import inspect
import math
import os
import tempfile

import h5py
import keras
import keras_hub
import numpy as np
import pytest
from absl.testing import parameterized
from keras import ops

from keras_attn.layers.multi_head_self_attention import MultiHeadSelfAttention
from keras_attn.layers.position_embedding import PositionEmbedding
from keras_attn.layers.sinusoidal_position_encoding import SinusoidalPositionEncoding
from keras_attn.layers.token_and_position_embedding import TokenAndPositionEmbedding
from tests.layers.test_sinusoidal_position_encoding import formula
from tests.test_case import TestCase, to_numpy

IDS = np.array([[3, 4, 5, 6, 7], [8, 9, 2, 0, 0]], "int32")
INIT = {"vocabulary_size": 12, "sequence_length": 8, "embedding_dim": 6}
SINUSOIDAL = {**INIT, "position": "sinusoidal"}

# keras-hub's PositionEmbedding drops the Keras mask of its input (with a
# warning); the tests that run keras-hub's layer silence it.
KERAS_HUB_MASK_WARNING = "ignore:Layer 'position_embedding'"

# `get_config()` of `TokenAndPositionEmbedding(12, 8, 6)` as keras-attn 0.x
# (before the keras-hub defaults) wrote it: the old defaults were the paper's
# sinusoids and `mask_zero=True`, both written out.
OLD_DEFAULT_CONFIG = {
    "name": "token_and_position_embedding",
    "trainable": True,
    "dtype": {
        "module": "keras",
        "class_name": "DTypePolicy",
        "config": {"name": "float32"},
        "registered_name": None,
    },
    "vocabulary_size": 12,
    "sequence_length": 8,
    "embedding_dim": 6,
    "position": "sinusoidal",
    "mask_zero": True,
    "scale_embeddings": False,
    "embeddings_initializer": {
        "module": "keras.initializers",
        "class_name": "RandomUniform",
        "config": {"seed": None, "minval": -0.05, "maxval": 0.05},
        "registered_name": None,
    },
    "position_initializer": {
        "module": "keras.initializers",
        "class_name": "GlorotUniform",
        "config": {"seed": None, "input_axes": None, "output_axes": None},
        "registered_name": None,
    },
    "max_wavelength": 10000,
}

# The datasets of `keras.Model(tokens, TokenAndPositionEmbedding(...)(tokens))`
# `.weights.h5` files as the previous version wrote them (a plain `Embedding`
# then), by position kind.
OLD_WEIGHT_FILE_LAYOUT = {
    "sinusoidal": [
        ("layers/token_and_position_embedding/token_embedding/vars/0", (12, 6))
    ],
    "learned": [
        ("layers/token_and_position_embedding/position_embedding/vars/0", (8, 6)),
        ("layers/token_and_position_embedding/token_embedding/vars/0", (12, 6)),
    ],
}


def embedding_model(layer):
    """`tokens -> layer(tokens)` as a functional model."""
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    return keras.Model(tokens, layer(tokens))


def weight_file_datasets(path):
    datasets = []
    with h5py.File(path, "r") as f:
        f.visititems(
            lambda name, item: (
                datasets.append((name, item.shape))
                if isinstance(item, h5py.Dataset)
                else None
            )
        )
    return sorted(datasets)


def keras_mask(x):
    """The Keras mask attached to `x` (Keras 3 keeps it as `_keras_mask`)."""
    mask = getattr(x, "_keras_mask", None)
    return None if mask is None else to_numpy(mask)


class TokenAndPositionEmbeddingTest(TestCase):
    @parameterized.named_parameters(
        ("learned", {}, 2),
        ("sinusoidal", {"position": "sinusoidal"}, 1),
        ("untied", {"tie_weights": False}, 3),
        ("masked", {"mask_zero": True}, 2),
    )
    def test_layer(self, extra, num_weights):
        self.run_layer_test(
            TokenAndPositionEmbedding,
            {**INIT, **extra},
            {"inputs": IDS},
            expected_output_shape=(2, 5, 6),
            expected_num_trainable_weights=num_weights,
            # The untied reverse matrix gets no gradient from the forward call.
            run_training_check="tie_weights" not in extra,
        )

    # -- keras-hub parity ------------------------------------------------------

    def test_arguments_match_keras_hub(self):
        ours = inspect.signature(TokenAndPositionEmbedding.__init__).parameters
        theirs = inspect.signature(
            keras_hub.layers.TokenAndPositionEmbedding.__init__
        ).parameters

        def described(parameters):
            return [(p.name, p.kind, p.default) for p in parameters.values()]

        positional = [
            p for p in ours.values() if p.kind != inspect.Parameter.KEYWORD_ONLY
        ]
        # keras-hub's arguments, order, kinds and defaults; keras-attn's extras
        # only after them, keyword-only.
        self.assertEqual(
            described(dict((p.name, p) for p in positional)), described(theirs)
        )
        extras = [
            p.name for p in ours.values() if p.kind == inspect.Parameter.KEYWORD_ONLY
        ]
        self.assertEqual(
            extras,
            ["position", "scale_embeddings", "position_initializer", "max_wavelength"],
        )
        self.assertEqual(ours["position"].default, "learned")

        ours_call = list(
            inspect.signature(TokenAndPositionEmbedding.call).parameters.values()
        )
        theirs_call = list(
            inspect.signature(
                keras_hub.layers.TokenAndPositionEmbedding.call
            ).parameters.values()
        )
        self.assertEqual(
            [(p.name, p.default) for p in ours_call[: len(theirs_call)]],
            [(p.name, p.default) for p in theirs_call],
        )
        self.assertEqual([p.name for p in ours_call[len(theirs_call) :]], ["reverse"])

    def test_defaults_build_keras_hub_layer(self):
        layer = TokenAndPositionEmbedding(12, 8, 6, name="embedding")
        reference = keras_hub.layers.TokenAndPositionEmbedding(
            12, 8, 6, name="embedding"
        )
        self.assertIsInstance(layer.token_embedding, keras.layers.ReversibleEmbedding)
        self.assertIsInstance(layer.position_embedding, PositionEmbedding)
        self.assertTrue(layer.token_embedding.tie_weights)
        self.assertFalse(layer.token_embedding.mask_zero)
        self.assertIsNone(keras_mask(layer(IDS)))  # id 0 is a token like any other
        reference(IDS)
        self.assertEqual(
            [(w.path, tuple(w.shape)) for w in layer.weights],
            [(w.path, tuple(w.shape)) for w in reference.weights],
        )
        # The position table is drawn like keras-hub's: from (a copy of) the
        # token embeddings' initializer.
        table = to_numpy(layer.position_embedding.position_embeddings)
        self.assertLessEqual(np.abs(table).max(), 0.05)
        self.assertEqual(
            {
                k: v
                for k, v in layer.get_config().items()
                if k in reference.get_config()
            },
            {
                **reference.get_config(),
                "name": layer.name,
            },
        )

    @parameterized.named_parameters(
        ("defaults", {}),
        ("masked", {"mask_zero": True}),
        ("untied", {"tie_weights": False}),
        ("initializer", {"embeddings_initializer": "he_normal"}),
    )
    @pytest.mark.filterwarnings(KERAS_HUB_MASK_WARNING)
    def test_matches_keras_hub_with_copied_weights(self, extra):
        layer = TokenAndPositionEmbedding(**INIT, **extra, name="embedding")
        reference = keras_hub.layers.TokenAndPositionEmbedding(
            **INIT, **extra, name="embedding"
        )
        outputs = layer(IDS)
        reference(IDS)
        self.assertEqual(
            [w.path for w in layer.weights], [w.path for w in reference.weights]
        )
        reference.set_weights(layer.get_weights())
        expected = reference(IDS)
        self.assertAllClose(outputs, expected, atol=0)
        if extra.get("mask_zero"):
            np.testing.assert_array_equal(keras_mask(outputs), IDS != 0)
            np.testing.assert_array_equal(keras_mask(expected), IDS != 0)
        else:
            self.assertIsNone(keras_mask(outputs))
            self.assertIsNone(keras_mask(expected))
        # Cached decoding's one-token steps and explicit positions.
        for index in (0, 3):
            self.assertAllClose(
                layer(IDS[:, index : index + 1], start_index=index),
                reference(IDS[:, index : index + 1], start_index=index),
                atol=0,
            )
        positions = np.array([[4, 0, 7, 1, 1], [2, 2, 3, 5, 6]], "int32")
        self.assertAllClose(
            layer(IDS, positions=positions),
            reference(IDS, positions=positions),
            atol=0,
        )
        self.assertAllClose(
            layer(IDS, positions=positions[0]),
            reference(IDS, positions=positions[0]),
            atol=0,
        )
        # The reverse projection of the token embedding.
        hidden = np.random.default_rng(0).normal(size=(2, 5, 6)).astype("float32")
        self.assertAllClose(
            layer.token_embedding(hidden, reverse=True),
            reference.token_embedding(hidden, reverse=True),
            atol=0,
        )

    @parameterized.named_parameters(("tied", True), ("untied", False))
    @pytest.mark.filterwarnings(KERAS_HUB_MASK_WARNING)
    def test_keras_hub_weight_files_load_both_ways(self, tie_weights):
        init = {**INIT, "tie_weights": tie_weights, "mask_zero": True}
        ours = embedding_model(TokenAndPositionEmbedding(**init))
        theirs = embedding_model(keras_hub.layers.TokenAndPositionEmbedding(**init))
        with tempfile.TemporaryDirectory() as tmp:
            for seed, (source, target) in enumerate(((theirs, ours), (ours, theirs))):
                path = os.path.join(tmp, f"{source.layers[1].__module__}.weights.h5")
                # Fresh values in the source, so a load that does nothing fails.
                rng = np.random.default_rng(seed)
                source.set_weights([rng.uniform(size=w.shape) for w in source.weights])
                source.save_weights(path)
                target.load_weights(path)
                self.assertAllClose(target(IDS), source(IDS), atol=0)
                self.assertAllClose(
                    target.layers[1].token_embedding(
                        np.ones((1, 2, 6), "float32"), reverse=True
                    ),
                    source.layers[1].token_embedding(
                        np.ones((1, 2, 6), "float32"), reverse=True
                    ),
                    atol=0,
                )

    # -- reverse ---------------------------------------------------------------

    def test_reverse_projects_onto_the_vocabulary_with_the_tied_embeddings(self):
        layer = TokenAndPositionEmbedding(
            **SINUSOIDAL, mask_zero=True, scale_embeddings=True
        )
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
        # The layer's `reverse=True` is its token embedding's.
        self.assertAllClose(
            layer(hidden_values, reverse=True),
            layer.token_embedding(hidden_values, reverse=True),
            atol=0,
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

    def test_untied_reverse_uses_its_own_matrix(self):
        layer = TokenAndPositionEmbedding(**INIT, tie_weights=False)
        hidden = np.random.default_rng(1).normal(size=(2, 5, 6)).astype("float32")
        logits = to_numpy(layer(hidden, reverse=True))
        reverse_table = to_numpy(layer.token_embedding.reverse_embeddings)  # (d, V)
        self.assertEqual(reverse_table.shape, (6, 12))
        np.testing.assert_allclose(logits, hidden @ reverse_table, atol=1e-5)
        table = to_numpy(layer.token_embedding.embeddings)
        self.assertGreater(np.abs(logits - hidden @ table.T).max(), 1e-3)
        self.assertEqual(
            [w.path.split("/")[-1] for w in layer.weights],
            ["embeddings", "reverse_embeddings", "embeddings"],
        )
        restored = TokenAndPositionEmbedding.from_config(layer.get_config())
        self.assertFalse(restored.token_embedding.tie_weights)

    # -- the keras-attn extras ---------------------------------------------------

    @parameterized.named_parameters(("unscaled", False), ("scaled", True))
    def test_token_embedding_plus_sinusoids(self, scale):
        layer = TokenAndPositionEmbedding(**SINUSOIDAL, scale_embeddings=scale)
        self.assertIsInstance(layer.position_embedding, SinusoidalPositionEncoding)
        values = to_numpy(layer(IDS))
        table = to_numpy(layer.token_embedding.embeddings)
        factor = math.sqrt(6) if scale else 1.0
        expected = table[IDS] * factor + formula(np.arange(5), 6)[None]
        np.testing.assert_allclose(values, expected, atol=1e-6)
        self.assertLen(layer.weights, 1)

    def test_position_initializer(self):
        layer = TokenAndPositionEmbedding(**INIT, position_initializer="ones")
        layer.build((None, 5))
        np.testing.assert_array_equal(
            to_numpy(layer.position_embedding.position_embeddings), np.ones((8, 6))
        )

    def test_start_index_gives_the_step_of_the_full_pass(self):
        for position in ("sinusoidal", "learned"):
            layer = TokenAndPositionEmbedding(**INIT, position=position)
            full = to_numpy(layer(IDS))
            for index in range(5):
                step = layer(IDS[:, index : index + 1], start_index=index)
                np.testing.assert_allclose(to_numpy(step)[:, 0], full[:, index])

    def test_padding_mask_is_passed_on(self):
        layer = TokenAndPositionEmbedding(**INIT, mask_zero=True)
        np.testing.assert_array_equal(to_numpy(layer.compute_mask(IDS)), IDS != 0)
        self.assertIsNone(TokenAndPositionEmbedding(**INIT).compute_mask(IDS))
        # Downstream, self-attention ignores the padded tokens: the real tokens'
        # outputs equal those of the unpadded sequence. (keras-hub's layer
        # loses its mask in the functional API; this one keeps it.)
        tokens = keras.Input((None,), dtype="int32")
        embedded = layer(tokens)
        self.assertIsNotNone(getattr(embedded, "_keras_mask", None))
        outputs = MultiHeadSelfAttention(num_heads=2)(embedded)
        model = keras.Model(tokens, outputs)
        padded = to_numpy(model(IDS))
        unpadded = to_numpy(model(IDS[1:, :3]))
        np.testing.assert_allclose(padded[1, :3], unpadded[0], atol=1e-6)
        np.testing.assert_array_equal(padded[1, 3:], 0.0)

    # -- configs and files of the previous version --------------------------------

    def test_previous_version_config_builds_the_same_layer(self):
        layer = TokenAndPositionEmbedding.from_config(OLD_DEFAULT_CONFIG)
        self.assertEqual(layer.position, "sinusoidal")
        self.assertTrue(layer.mask_zero)
        self.assertTrue(layer.tie_weights)
        outputs = layer(IDS)
        np.testing.assert_array_equal(keras_mask(outputs), IDS != 0)
        table = to_numpy(layer.token_embedding.embeddings)
        np.testing.assert_allclose(
            to_numpy(outputs), table[IDS] + formula(np.arange(5), 6)[None], atol=1e-6
        )
        self.assertLen(layer.weights, 1)

    @parameterized.named_parameters(
        ("sinusoidal", "sinusoidal"), ("learned", "learned")
    )
    def test_weight_files_keep_the_previous_layout(self, position):
        # The datasets the previous version wrote, under the same names and
        # shapes: its `.weights.h5` and `.keras` files load into this version.
        model = embedding_model(
            TokenAndPositionEmbedding(**INIT, position=position, mask_zero=True)
        )
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "model.weights.h5")
            model.save_weights(path)
            self.assertEqual(
                weight_file_datasets(path), sorted(OLD_WEIGHT_FILE_LAYOUT[position])
            )

    def test_serialization_and_precision(self):
        init = {
            **INIT,
            "tie_weights": False,
            "position": "learned",
            "mask_zero": True,
            "scale_embeddings": True,
            "embeddings_initializer": "he_normal",
            "position_initializer": "ones",
            "max_wavelength": 100,
        }
        self.run_serialization_test(TokenAndPositionEmbedding, init, {"inputs": IDS})
        self.run_serialization_test(
            TokenAndPositionEmbedding,
            {**SINUSOIDAL, "sequence_length": None},
            {"inputs": IDS},
        )
        self.run_precision_test(TokenAndPositionEmbedding, INIT, {"inputs": IDS})
        self.run_precision_test(TokenAndPositionEmbedding, SINUSOIDAL, {"inputs": IDS})

    @pytest.mark.tf_only
    def test_saved_model_round_trip(self):
        tokens = keras.Input((None,), dtype="int32", name="tokens")
        x = TokenAndPositionEmbedding(**INIT, mask_zero=True)(tokens)
        x = MultiHeadSelfAttention(num_heads=2, causal=True)(x)
        self.run_saved_model_test(keras.Model(tokens, x), IDS)

    def test_built_frozen_keeps_its_tables_out_of_training(self):
        # `trainable=False` at construction covers the tables the layer
        # creates later, as for `keras.layers.Embedding(trainable=False)`.
        layer = TokenAndPositionEmbedding(**INIT, trainable=False)
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
            TokenAndPositionEmbedding(12, None, 6)
        with self.assertRaisesRegex(ValueError, "Received: vocabulary_size=0"):
            TokenAndPositionEmbedding(0, 8, 6)
        with self.assertRaisesRegex(ValueError, "Received: mask_zero='yes'"):
            TokenAndPositionEmbedding(**INIT, mask_zero="yes")
        # The previous version's fourth positional argument was `position`.
        with self.assertRaisesRegex(ValueError, "Received: tie_weights='learned'"):
            TokenAndPositionEmbedding(12, 8, 6, "learned")
        with self.assertRaises(TypeError):  # the extras are keyword-only
            TokenAndPositionEmbedding(12, 8, 6, True, "uniform", False, "sinusoidal")
        with self.assertRaisesRegex(ValueError, "Received: max_wavelength=0"):
            TokenAndPositionEmbedding(**SINUSOIDAL, max_wavelength=0)
        with self.assertRaisesRegex(ValueError, "start_index=6"):
            TokenAndPositionEmbedding(**INIT)(IDS, start_index=6)
        with self.assertRaisesRegex(ValueError, "`inputs` must have rank 2"):
            TokenAndPositionEmbedding(**INIT)(ops.ones((2, 3, 1), "int32"))
