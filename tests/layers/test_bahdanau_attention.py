import tempfile

import keras
import numpy as np
import pytest

from keras_attn.layers import BahdanauAttention
from tests.test_case import TestCase, to_numpy

RNG = np.random.default_rng(2)
STATE = RNG.normal(size=(2, 6)).astype("float32")  # one decoder state (B, dq)
QUERY = RNG.normal(size=(2, 3, 6)).astype("float32")  # (B, Tq, dq)
VALUE = RNG.normal(size=(2, 5, 4)).astype("float32")  # (B, Tv, dv)
VALUE_MASK = np.array([[True] * 5, [True, True, True, False, False]])


def numpy_bahdanau(query, value, w_q, w_k, v, g=None, b=None):
    """The paper's formulas, one pair at a time, in float64."""
    if g is not None:
        v = g * v / np.linalg.norm(v)
    b = np.zeros_like(v) if b is None else b
    scores = np.array(
        [
            [
                [v @ np.tanh(w_q.T @ q + w_k.T @ k + b) for k in value[n]]
                for q in query[n]
            ]
            for n in range(len(query))
        ]
    )
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("nqk,nkd->nqd", weights, value), weights


class BahdanauAttentionTest(TestCase):
    def test_layer_with_a_single_state_and_a_sequence(self):
        self.run_layer_test(
            BahdanauAttention,
            {"units": 7},
            {"query": STATE, "value": VALUE},
            expected_output_shape=(2, 4),
            expected_num_trainable_weights=3,
        )
        self.run_layer_test(
            BahdanauAttention,
            {"units": 7, "normalize": True},
            {"query": QUERY, "value": VALUE},
            expected_output_shape=[(2, 3, 4), (2, 3, 5)],
            call_kwargs={"return_attention_scores": True},
            expected_num_trainable_weights=5,
        )
        self.run_layer_test(
            BahdanauAttention,
            {"units": 7, "use_bias": True},
            {"query": QUERY, "value": VALUE},
            expected_output_shape=[(2, 3, 4), (2, 3, 5)],
            call_kwargs={"return_attention_scores": True},
            expected_num_trainable_weights=4,
        )

    def test_matches_the_paper_formula(self):
        for normalize in (False, True):
            layer = BahdanauAttention(units=7, normalize=normalize)
            context, weights = layer(QUERY, VALUE, return_attention_scores=True)
            extra = {}
            if normalize:
                extra = {
                    "g": to_numpy(layer.score_scale),
                    "b": RNG.normal(size=(7,)).astype("float32"),
                }
                layer.score_bias.assign(extra["b"])
                context, weights = layer(QUERY, VALUE, return_attention_scores=True)
            expected_context, expected_weights = numpy_bahdanau(
                QUERY.astype("float64"),
                VALUE.astype("float64"),
                to_numpy(layer.query_kernel),
                to_numpy(layer.key_kernel),
                to_numpy(layer.score_vector),
                **extra,
            )
            self.assertAllClose(weights, expected_weights, atol=1e-5)
            self.assertAllClose(context, expected_context, atol=1e-5)

    def test_use_bias_matches_the_formula_with_a_bias(self):
        layer = BahdanauAttention(units=7, use_bias=True)
        layer(QUERY, VALUE)  # builds
        bias = RNG.normal(size=(7,)).astype("float32")
        layer.score_bias.assign(bias)
        expected_context, expected_weights = numpy_bahdanau(
            QUERY.astype("float64"),
            VALUE.astype("float64"),
            to_numpy(layer.query_kernel),
            to_numpy(layer.key_kernel),
            to_numpy(layer.score_vector),
            b=bias.astype("float64"),
        )
        context, weights = layer(QUERY, VALUE, return_attention_scores=True)
        self.assertAllClose(weights, expected_weights, atol=1e-5)
        self.assertAllClose(context, expected_context, atol=1e-5)
        # A precomputed key projection takes the bias too (a decoder loop).
        context, weights = layer(
            QUERY,
            VALUE,
            return_attention_scores=True,
            projected_key=layer.project_key(VALUE),
        )
        self.assertAllClose(weights, expected_weights, atol=1e-5)
        self.assertAllClose(context, expected_context, atol=1e-5)
        # The bias matters: without it the weights are the bias-free formula's.
        layer.score_bias.assign(np.zeros((7,), "float32"))
        self.assertGreater(
            np.abs(to_numpy(layer(QUERY, VALUE)) - expected_context).max(), 1e-3
        )

    def test_weight_layout(self):
        # The default keeps the paper's three weights, in the order weight
        # files record them; `use_bias=True` appends `score_bias`.
        names = {}
        for use_bias in (False, True):
            layer = BahdanauAttention(units=10, use_bias=use_bias)
            layer(STATE, VALUE)
            names[use_bias] = [w.path.split("/")[-1] for w in layer.weights]
            self.assertEqual(layer.count_params(), 6 * 10 + 4 * 10 + 10 + use_bias * 10)
        self.assertEqual(names[False], ["query_kernel", "key_kernel", "score_vector"])
        self.assertEqual(names[True], [*names[False], "score_bias"])

    def test_single_state_equals_a_length_one_sequence(self):
        layer = BahdanauAttention(units=7)
        single, single_weights = layer(STATE, VALUE, return_attention_scores=True)
        seq, seq_weights = layer(STATE[:, None], VALUE, return_attention_scores=True)
        self.assertAllClose(single, to_numpy(seq)[:, 0], atol=1e-6)
        self.assertAllClose(single_weights, to_numpy(seq_weights)[:, 0], atol=1e-6)

    def test_key_differs_from_value(self):
        key = RNG.normal(size=(2, 5, 3)).astype("float32")
        layer = BahdanauAttention(units=7)
        context, weights = layer(QUERY, VALUE, key=key, return_attention_scores=True)
        _, expected_weights = numpy_bahdanau(
            QUERY,
            key,
            to_numpy(layer.query_kernel),
            to_numpy(layer.key_kernel),
            to_numpy(layer.score_vector),
        )
        self.assertAllClose(weights, expected_weights, atol=1e-5)
        self.assertAllClose(
            context, np.einsum("nqk,nkd->nqd", expected_weights, VALUE), atol=1e-5
        )

    def test_masked_values_do_not_change_unmasked_outputs(self):
        layer = BahdanauAttention(units=7)
        base = layer(QUERY, VALUE, value_mask=VALUE_MASK)
        changed = VALUE.copy()
        changed[1, 3:] = 100.0
        self.assertAllClose(
            layer(QUERY, changed, value_mask=VALUE_MASK), base, atol=1e-6
        )
        truncated = layer(QUERY[1:], VALUE[1:, :3])
        self.assertAllClose(to_numpy(base)[1:], truncated, atol=1e-6)

    def test_keras_mask_from_embedding_masks_the_keys(self):
        tokens = keras.Input((None,), dtype="int32")
        state = keras.Input((6,))
        embedded = keras.layers.Embedding(10, 4, mask_zero=True)(tokens)
        layer = BahdanauAttention(units=7)
        context, weights = layer(state, embedded, return_attention_scores=True)
        model = keras.Model([state, tokens], [context, weights])
        token_ids = np.array([[1, 2, 3, 0, 0], [4, 5, 0, 0, 0]])
        _, weights = model([STATE, token_ids])
        weights = to_numpy(weights)
        np.testing.assert_array_equal(weights[token_ids == 0], 0.0)
        np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-6)

    def test_fully_masked_rows_give_zeros(self):
        for policy in ("float32", "mixed_float16", "mixed_bfloat16"):
            layer = BahdanauAttention(units=7, dtype=policy)
            mask = np.zeros((2, 5), bool)
            mask[0] = True
            context, weights = layer(
                QUERY, VALUE, value_mask=mask, return_attention_scores=True
            )
            context = to_numpy(keras.ops.cast(context, "float32"))
            self.assertAllFinite(context)
            np.testing.assert_array_equal(context[1], 0.0)
            np.testing.assert_array_equal(
                to_numpy(keras.ops.cast(weights, "float32"))[1], 0.0
            )

    def test_serialization_and_precision(self):
        self.run_serialization_test(
            BahdanauAttention,
            {"units": 7, "normalize": True, "dropout": 0.1, "seed": 3},
            {"query": QUERY, "value": VALUE},
        )
        self.run_serialization_test(
            BahdanauAttention,
            {"units": 7, "use_bias": True},
            {"query": QUERY, "value": VALUE},
        )
        self.run_precision_test(
            BahdanauAttention,
            {"units": 7, "use_bias": True},
            {"query": QUERY, "value": VALUE},
        )
        self.run_precision_test(
            BahdanauAttention, {"units": 7}, {"query": QUERY, "value": VALUE}
        )

    def test_use_bias_saves_its_bias(self):
        state = keras.Input((6,))
        value = keras.Input((None, 4))
        layer = BahdanauAttention(units=7, use_bias=True)
        model = keras.Model([state, value], layer(state, value))
        layer.score_bias.assign(RNG.normal(size=(7,)).astype("float32"))
        expected = to_numpy(model([STATE, VALUE]))
        with tempfile.TemporaryDirectory() as tmp:
            model.save(f"{tmp}/model.keras")
            loaded = keras.saving.load_model(f"{tmp}/model.keras")
        self.assertTrue(loaded.layers[-1].use_bias)
        np.testing.assert_array_equal(to_numpy(loaded([STATE, VALUE])), expected)
        # A config written before `use_bias` existed loads as the default.
        config = layer.get_config()
        del config["use_bias"]
        self.assertFalse(BahdanauAttention.from_config(config).use_bias)

    @pytest.mark.tf_only
    def test_saved_model_round_trip(self):
        state = keras.Input((6,), name="state")
        value = keras.Input((None, 4), name="value")
        model = keras.Model([state, value], BahdanauAttention(units=7)(state, value))
        self.run_saved_model_test(model, [STATE, VALUE])

    def test_dropout_is_active_only_in_training(self):
        layer = BahdanauAttention(units=7, dropout=0.5, seed=1)
        inference = layer(QUERY, VALUE)
        self.assertAllClose(layer(QUERY, VALUE, training=False), inference)
        self.assertFalse(
            np.allclose(
                to_numpy(layer(QUERY, VALUE, training=True)), to_numpy(inference)
            )
        )

    def test_precomputed_key_projection(self):
        layer = BahdanauAttention(units=7)
        expected = layer(
            STATE, VALUE, value_mask=VALUE_MASK, return_attention_scores=True
        )
        projected = layer.project_key(VALUE)  # (B, Tv, units), once per source
        self.assertEqual(tuple(projected.shape), (2, 5, 7))
        got = layer(
            STATE,
            VALUE,
            value_mask=VALUE_MASK,
            return_attention_scores=True,
            projected_key=projected,
        )
        for want, have in zip(expected, got, strict=True):
            np.testing.assert_allclose(to_numpy(have), to_numpy(want), atol=1e-6)
        # The scores come from the projection passed in, not from the key.
        other = layer(
            STATE, VALUE, return_attention_scores=True, projected_key=projected * 0.0
        )[1]
        np.testing.assert_allclose(to_numpy(other), np.full((2, 5), 0.2), atol=1e-6)
        # Symbolic: the output spec ignores the projection.
        symbolic = layer(
            keras.Input((6,)), keras.Input((None, 4)), projected_key=projected
        )
        self.assertEqual(tuple(symbolic.shape), (None, 4))
        with self.assertRaisesRegex(
            ValueError, r"projected_key.*Received: projected_key.shape=\(2, 5, 4\)"
        ):
            layer(STATE, VALUE, projected_key=VALUE)

    def test_bad_arguments(self):
        with self.assertRaisesRegex(ValueError, r"Received: units=0"):
            BahdanauAttention(units=0)
        with self.assertRaisesRegex(ValueError, r"Received: dropout=1.0"):
            BahdanauAttention(units=3, dropout=1.0)
        with self.assertRaisesRegex(ValueError, r"Received: normalize='yes'"):
            BahdanauAttention(units=3, normalize="yes")
        for bad in ("yes", 1, None):
            with self.assertRaisesRegex(
                ValueError, rf"`use_bias` must be a bool. Received: use_bias={bad!r}"
            ):
                BahdanauAttention(units=3, use_bias=bad)
        with self.assertRaisesRegex(
            ValueError, r"normalize=True.*Received: use_bias=True, normalize=True"
        ):
            BahdanauAttention(units=3, use_bias=True, normalize=True)
        layer = BahdanauAttention(units=3)
        with self.assertRaisesRegex(ValueError, r"`query` must have rank 2 or 3"):
            layer(np.zeros((2, 3, 4, 5), "float32"), VALUE)
        with self.assertRaisesRegex(ValueError, r"`value` must have rank 3"):
            BahdanauAttention(units=3)(QUERY, VALUE[:, 0])
        with self.assertRaisesRegex(
            ValueError, r"value_mask.*Received: value_mask.shape=\(2, 4\)"
        ):
            BahdanauAttention(units=3)(QUERY, VALUE, value_mask=np.ones((2, 4), bool))
        with self.assertRaisesRegex(ValueError, r"same number of time steps"):
            BahdanauAttention(units=3)(QUERY, VALUE, key=VALUE[:, :2])
