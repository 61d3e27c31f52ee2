import inspect
import os
import tempfile

import keras
import keras_hub
import numpy as np
import pytest
from absl.testing import parameterized

from keras_attn.layers.transformer_encoder_block import TransformerEncoderBlock
from tests.test_case import TestCase, to_numpy

RNG = np.random.default_rng(5)
INPUTS = RNG.normal(size=(2, 5, 8)).astype("float32")
PADDING_MASK = np.array([[True] * 5, [True, True, True, False, False]])
ATTENTION_MASK = RNG.uniform(size=(2, 5, 5)) > 0.4
ATTENTION_MASK[:, :, 0] = True  # every query keeps a key
IDS = np.array([[3, 4, 5, 6, 7], [8, 9, 2, 0, 0]], "int32")
INIT = {"num_heads": 2, "intermediate_dim": 16}


def copied_keras_hub_encoder(block, inputs=INPUTS):
    reference = keras_hub.layers.TransformerEncoder(
        intermediate_dim=block.intermediate_dim,
        num_heads=block.num_heads,
        dropout=block.dropout,
        activation=block.activation,
        layer_norm_epsilon=block.layer_norm_epsilon,
        normalize_first=block.normalize_first,
    )
    reference(inputs)
    reference.set_weights(block.get_weights())
    return reference


class TransformerEncoderBlockTest(TestCase):
    def test_layer(self):
        self.run_layer_test(
            TransformerEncoderBlock,
            INIT,
            {"inputs": INPUTS},
            expected_output_shape=(2, 5, 8),
            expected_num_trainable_weights=16,
        )
        self.run_layer_test(
            TransformerEncoderBlock,
            {**INIT, "normalize_first": True, "dropout": 0.0},
            {"inputs": INPUTS, "padding_mask": PADDING_MASK},
            expected_output_shape=(2, 5, 8),
        )
        self.run_layer_test(
            TransformerEncoderBlock,
            {**INIT, "key_dim": 3, "activation": "gelu"},
            {"inputs": INPUTS, "attention_mask": ATTENTION_MASK},
            call_kwargs={"return_attention_scores": True},
            expected_output_shape=[(2, 5, 8), (2, 2, 5, 5)],
        )

    def test_takes_keras_hub_arguments_in_keras_hub_order(self):
        for method in ("__init__", "call"):
            ours = inspect.signature(
                getattr(TransformerEncoderBlock, method)
            ).parameters
            theirs = inspect.signature(
                getattr(keras_hub.layers.TransformerEncoder, method)
            ).parameters
            names = [name for name in theirs if name != "kwargs"]
            self.assertEqual(list(ours)[: len(names)], names, method)
            for name in names:
                self.assertEqual(ours[name].default, theirs[name].default, name)
        block = TransformerEncoderBlock(16, 2)  # keras-hub's positional order
        self.assertEqual((block.intermediate_dim, block.num_heads), (16, 2))
        self.assertEqual(block.dropout, 0.0)
        # keras-hub's config loads as it is.
        hub_config = keras_hub.layers.TransformerEncoder(16, 2, 0.1).get_config()
        revived = TransformerEncoderBlock.from_config(hub_config)
        self.assertEqual(
            {k: revived.get_config()[k] for k in hub_config if k != "name"},
            {k: v for k, v in hub_config.items() if k != "name"},
        )

    @parameterized.named_parameters(
        ("float32", "float32", 1e-5), ("mixed_bfloat16", "mixed_bfloat16", 2e-2)
    )
    def test_swapped_into_keras_hub_user_code(self, policy, tolerance):
        """An encoder written with keras-hub's blocks as keras-hub's BERT
        backbone calls them (positional arguments, an explicit padding mask)
        gives the same outputs with keras-attn's block in their place."""

        def encoder(block_class):
            token_ids = keras.Input((None,), dtype="int32")
            padding_mask = keras.Input((None,), dtype="bool")
            x = keras_hub.layers.TokenAndPositionEmbedding(
                vocabulary_size=12, sequence_length=8, embedding_dim=8
            )(token_ids)
            x = block_class(16, 2)(x, padding_mask=padding_mask)
            x = block_class(16, 2, normalize_first=True)(x, padding_mask=padding_mask)
            outputs = keras.layers.Dense(2, dtype="float32")(x)
            return keras.Model([token_ids, padding_mask], outputs)

        keras.config.set_dtype_policy(policy)
        theirs = encoder(keras_hub.layers.TransformerEncoder)
        ours = encoder(TransformerEncoderBlock)
        ours.set_weights(theirs.get_weights())
        real = IDS != 0
        got, want = to_numpy(ours([IDS, real])), to_numpy(theirs([IDS, real]))
        # keras-hub lets padded positions attend; their rows are not compared.
        np.testing.assert_allclose(
            got[real], want[real], atol=tolerance, rtol=tolerance
        )
        self.assertFalse(np.allclose(got[~real], want[~real], atol=tolerance))

    # Slow: int8 attention: test_multi_head_attention.py's
    # test_int8_quantization_reaches_every_projection; quantized tasks:
    # tests/models/test_quantize.py
    @pytest.mark.slow
    def test_int8_quantization_as_keras_hub_and_through_save_and_load(self):
        def encoder(block_class):
            inputs = keras.Input((5, 8))
            x = block_class(16, 2, name="first")(inputs)
            return keras.Model(inputs, block_class(16, 2, normalize_first=True)(x))

        ours, theirs = (
            encoder(TransformerEncoderBlock),
            encoder(keras_hub.layers.TransformerEncoder),
        )
        ours.set_weights(theirs.get_weights())
        ours.quantize("int8")
        theirs.quantize("int8")
        block = ours.get_layer("first")
        self.assertEqual(
            block._self_attention_layer.query_dense.quantization_mode, "int8"
        )
        self.assertEqual(block._feedforward_output_dense.quantization_mode, "int8")
        got = to_numpy(ours(INPUTS))
        np.testing.assert_allclose(got, to_numpy(theirs(INPUTS)), atol=1e-5)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "quantized.keras")
            ours.save(path)
            loaded = keras.saving.load_model(path)
        np.testing.assert_allclose(to_numpy(loaded(INPUTS)), got, atol=0)

    @parameterized.named_parameters(("post_norm", False), ("pre_norm", True))
    def test_matches_keras_hub_with_copied_weights(self, normalize_first):
        block = TransformerEncoderBlock(
            **INIT, dropout=0.0, normalize_first=normalize_first, activation="gelu"
        )
        block(INPUTS)
        reference = copied_keras_hub_encoder(block)
        valid = PADDING_MASK
        for masks in (
            {},
            {"padding_mask": PADDING_MASK},
            {"attention_mask": ATTENTION_MASK},
            {"padding_mask": PADDING_MASK, "attention_mask": ATTENTION_MASK},
        ):
            got, got_weights = block(INPUTS, return_attention_scores=True, **masks)
            want, want_weights = reference(
                INPUTS, return_attention_scores=True, **masks
            )
            # keras-hub lets padded queries attend (it masks keys only); this
            # block gives them zero attention rows: compare real tokens.
            rows = valid if "padding_mask" in masks else np.ones_like(valid)
            np.testing.assert_allclose(
                to_numpy(got)[rows], to_numpy(want)[rows], atol=1e-5, err_msg=str(masks)
            )
            np.testing.assert_allclose(
                to_numpy(got_weights).transpose(0, 2, 1, 3)[rows],
                to_numpy(want_weights).transpose(0, 2, 1, 3)[rows],
                atol=1e-5,
            )
            self.assertAllClose(block(INPUTS, **masks), got, atol=1e-5)

    def test_keras_mask_equals_the_explicit_padding_mask(self):
        embedding = keras.layers.Embedding(12, 8, mask_zero=True)
        first, second = TransformerEncoderBlock(**INIT), TransformerEncoderBlock(**INIT)
        tokens = keras.Input((None,), dtype="int32")
        # The first block passes the Keras mask on to the second.
        model = keras.Model(tokens, second(first(embedding(tokens))))
        embedded, mask = embedding(IDS), IDS != 0
        want = second(first(embedded, padding_mask=mask), padding_mask=mask)
        self.assertAllClose(model(IDS), want, atol=1e-6)
        np.testing.assert_array_equal(
            to_numpy(first.compute_mask(embedded, mask)), mask
        )

        # With an explicit attention mask as a second tensor, Keras fills
        # `inputs_mask` instead of `mask`: still honoured.
        attention = keras.Input((None, None), dtype="bool")
        model = keras.Model(
            [tokens, attention], first(embedding(tokens), attention_mask=attention)
        )
        want = first(embedded, padding_mask=mask, attention_mask=ATTENTION_MASK)
        self.assertAllClose(model([IDS, ATTENTION_MASK]), want, atol=1e-6)

    def test_padded_tokens_do_not_change_the_real_tokens(self):
        block = TransformerEncoderBlock(**INIT, dropout=0.0)
        base = to_numpy(block(INPUTS, padding_mask=PADDING_MASK))
        changed = INPUTS.copy()
        changed[1, 3:] = 100.0
        got = to_numpy(block(changed, padding_mask=PADDING_MASK))
        np.testing.assert_allclose(got[PADDING_MASK], base[PADDING_MASK], atol=1e-5)
        # The same tokens without padding give the same outputs.
        alone = to_numpy(block(INPUTS[1:, :3]))
        np.testing.assert_allclose(base[1, :3], alone[0], atol=1e-5)

    def test_fully_masked_sequence_is_finite_in_every_policy(self):
        mask = np.zeros((2, 5), bool)
        for policy in ("float32", "mixed_float16", "mixed_bfloat16"):
            for normalize_first in (False, True):
                block = TransformerEncoderBlock(
                    **INIT, normalize_first=normalize_first, dtype=policy
                )
                outputs, weights = block(
                    INPUTS * 100.0, padding_mask=mask, return_attention_scores=True
                )
                self.assertAllFinite(keras.ops.cast(outputs, "float32"), policy)
                np.testing.assert_array_equal(
                    to_numpy(keras.ops.cast(weights, "float32")), 0.0
                )

    def test_dropout_only_in_training(self):
        block = TransformerEncoderBlock(**INIT, dropout=0.5, seed=3)
        inference = block(INPUTS)
        self.assertAllClose(block(INPUTS, training=False), inference, atol=0)
        training = to_numpy(block(INPUTS, training=True))
        self.assertFalse(np.allclose(training, to_numpy(inference), atol=1e-3))
        self.assertEqual(block._self_attention_layer.dropout, 0.5)
        no_attention_dropout = TransformerEncoderBlock(**INIT, attention_dropout=0.0)
        no_attention_dropout(INPUTS)
        self.assertEqual(no_attention_dropout._self_attention_layer.dropout, 0.0)

    def test_serialization_and_precision(self):
        init = {
            "num_heads": 2,
            "intermediate_dim": 12,
            "dropout": 0.2,
            "activation": "gelu",
            "normalize_first": True,
            "layer_norm_epsilon": 1e-6,
            "key_dim": 3,
            "attention_dropout": 0.0,
            "kernel_initializer": "he_normal",
            "bias_initializer": "ones",
            "seed": 4,
        }
        self.run_serialization_test(TransformerEncoderBlock, init, {"inputs": INPUTS})
        self.run_serialization_test(
            TransformerEncoderBlock,
            INIT,
            {"inputs": INPUTS, "padding_mask": PADDING_MASK},
            call_kwargs={"return_attention_scores": True},
        )
        self.run_precision_test(
            TransformerEncoderBlock, {**INIT, "dropout": 0.0}, {"inputs": INPUTS}
        )

    @pytest.mark.tf_only
    # Slow: the blocks' SavedModel path is the tasks' exports (tests/export);
    # MultiHeadAttention's round trip runs by default
    @pytest.mark.slow
    def test_saved_model_round_trip(self):
        tokens = keras.Input((None,), dtype="int32", name="tokens")
        x = keras.layers.Embedding(12, 8, mask_zero=True)(tokens)
        x = TransformerEncoderBlock(**INIT)(x)
        x = TransformerEncoderBlock(**INIT, normalize_first=True)(x)
        self.run_saved_model_test(keras.Model(tokens, x), IDS)

    def test_bad_arguments(self):
        for name, value in (
            ("num_heads", 0),
            ("intermediate_dim", 2.5),
            ("dropout", 1.0),
            ("dropout", -0.5),
            ("attention_dropout", -0.1),
            ("normalize_first", "yes"),
            ("layer_norm_epsilon", 0),
            ("key_dim", 0),
            ("seed", "1"),
        ):
            with self.assertRaisesRegex(ValueError, f"Received: {name}="):
                TransformerEncoderBlock(**{**INIT, name: value})
        with self.assertRaisesRegex(ValueError, "Received: activation='nope'"):
            TransformerEncoderBlock(**INIT, activation="nope")
        for name in ("kernel_initializer", "bias_initializer"):
            with self.assertRaisesRegex(ValueError, f"Received: {name}='nope'"):
                TransformerEncoderBlock(**INIT, **{name: "nope"})
        with self.assertRaisesRegex(ValueError, "Received: flash_attention=True"):
            TransformerEncoderBlock(**INIT, dropout=0.1, flash_attention=True)
        with self.assertRaisesRegex(
            ValueError, r"num_heads=3, inputs.shape=\(2, 5, 8\)"
        ):
            TransformerEncoderBlock(num_heads=3, intermediate_dim=4)(INPUTS)
        with self.assertRaisesRegex(ValueError, "`inputs` must have rank 3"):
            TransformerEncoderBlock(**INIT)(INPUTS[0])
        with self.assertRaisesRegex(ValueError, r"Received: attention_mask.shape"):
            TransformerEncoderBlock(**INIT)(
                INPUTS, attention_mask=np.ones((2, 5, 4), bool)
            )
        with self.assertRaisesRegex(ValueError, r"Received: padding_mask.shape"):
            TransformerEncoderBlock(**INIT)(
                keras.Input((5, 8)), padding_mask=keras.Input((4,), dtype="bool")
            )
