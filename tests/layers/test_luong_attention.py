import keras
import numpy as np
import pytest
from keras import ops

from keras_attn.layers import LuongAttention
from tests.test_case import TestCase, to_numpy

RNG = np.random.default_rng(3)
STATE = RNG.normal(size=(2, 4)).astype("float32")
QUERY = RNG.normal(size=(2, 3, 4)).astype("float32")
VALUE = RNG.normal(size=(2, 5, 4)).astype("float32")
VALUE6 = RNG.normal(size=(2, 5, 6)).astype("float32")
VALUE_MASK = np.array([[True] * 5, [True, True, True, False, False]])

VARIANTS = (
    ("dot", {"score": "dot"}, 0),
    ("dot_sqrt_dim", {"score": "dot", "scale": "sqrt_dim"}, 0),
    ("general", {"score": "general"}, 1),
    ("general_learned", {"score": "general", "scale": "learned"}, 2),
    ("concat", {"score": "concat", "units": 5}, 2),
)


def numpy_luong(query, value, score, kernel=None, v=None, scale=1.0):
    """Luong et al.'s scores, one pair at a time, in float64."""

    def one(q, k):
        if score == "dot":
            return q @ k
        if score == "general":
            return q @ kernel @ k
        return v @ np.tanh(np.concatenate([q, k]) @ kernel)

    scores = scale * np.array(
        [[[one(q, k) for k in value[n]] for q in query[n]] for n in range(len(query))]
    )
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("nqk,nkd->nqd", weights, value), weights


class LuongAttentionTest(TestCase):
    def test_layer(self):
        for _, kwargs, num_weights in VARIANTS:
            self.run_layer_test(
                LuongAttention,
                kwargs,
                {"query": QUERY, "value": VALUE},
                expected_output_shape=(2, 3, 4),
                expected_num_trainable_weights=num_weights,
            )
        self.run_layer_test(
            LuongAttention,
            {"score": "general"},
            {"query": STATE, "value": VALUE6},
            expected_output_shape=[(2, 6), (2, 5)],
            call_kwargs={"return_attention_scores": True},
        )

    def test_dot_matches_keras_attention(self):
        ours = LuongAttention(score="dot")
        reference = keras.layers.Attention(score_mode="dot")
        got, got_weights = ours(
            QUERY, VALUE, value_mask=VALUE_MASK, return_attention_scores=True
        )
        want, want_weights = reference(
            [QUERY, VALUE], mask=[None, VALUE_MASK], return_attention_scores=True
        )
        self.assertAllClose(got, want, atol=1e-6)
        self.assertAllClose(got_weights, want_weights, atol=1e-6)

    def test_matches_the_paper_formulas(self):
        for name, kwargs, _ in VARIANTS:
            value = VALUE6 if kwargs["score"] != "dot" else VALUE
            layer = LuongAttention(**kwargs)
            layer(QUERY, value)
            if kwargs.get("scale") == "learned":
                layer.scale_factor.assign(1.7)
            context, weights = layer(QUERY, value, return_attention_scores=True)
            scale = {
                None: 1.0,
                "sqrt_dim": 1 / np.sqrt(value.shape[-1]),
                "learned": 1.7,
            }[kwargs.get("scale")]
            expected_context, expected_weights = numpy_luong(
                QUERY.astype("float64"),
                value.astype("float64"),
                kwargs["score"],
                kernel=None if kwargs["score"] == "dot" else to_numpy(layer.kernel),
                v=to_numpy(layer.score_vector) if kwargs["score"] == "concat" else None,
                scale=scale,
            )
            self.assertAllClose(weights, expected_weights, atol=1e-5, msg=name)
            self.assertAllClose(context, expected_context, atol=1e-5, msg=name)

    def test_query_mask_zeroes_padded_queries_and_masked_keys_are_ignored(self):
        layer = LuongAttention(score="general")
        query_mask = np.array([[True, True, False], [True, False, False]])
        context = to_numpy(
            layer(QUERY, VALUE, query_mask=query_mask, value_mask=VALUE_MASK)
        )
        np.testing.assert_array_equal(context[~query_mask], 0.0)
        changed = VALUE.copy()
        changed[1, 3:] = -50.0
        self.assertAllClose(
            layer(QUERY, changed, query_mask=query_mask, value_mask=VALUE_MASK),
            context,
            atol=1e-6,
        )

    def test_keras_masks_propagate(self):
        source = keras.Input((None,), dtype="int32")
        target = keras.Input((None,), dtype="int32")
        embedding = keras.layers.Embedding(10, 4, mask_zero=True)
        context = LuongAttention(score="dot")(embedding(target), embedding(source))
        model = keras.Model([target, source], context)
        source_ids = np.array([[1, 2, 3, 0], [4, 0, 0, 0]])
        target_ids = np.array([[5, 6, 0], [7, 8, 9]])
        out = to_numpy(model([target_ids, source_ids]))
        np.testing.assert_array_equal(out[0, 2], 0.0)  # padded query position
        truncated = to_numpy(model([target_ids[1:], source_ids[1:, :1]]))
        self.assertAllClose(out[1:], truncated, atol=1e-6)

    def test_fully_masked_rows_give_zeros_in_every_policy(self):
        for policy in ("float32", "mixed_float16", "mixed_bfloat16"):
            layer = LuongAttention(score="dot", dtype=policy)
            mask = np.zeros((2, 5), bool)
            mask[0, :2] = True
            context = to_numpy(
                keras.ops.cast(layer(QUERY, VALUE, value_mask=mask), "float32")
            )
            self.assertAllFinite(context)
            np.testing.assert_array_equal(context[1], 0.0)

    def test_large_logits_under_mixed_float16_stay_finite(self):
        layer = LuongAttention(score="dot", dtype="mixed_float16")
        big = np.full((1, 2, 64), 40.0, "float32")  # q·k = 102400 > float16 max
        context, weights = layer(big, big, return_attention_scores=True)
        self.assertAllFinite(context)
        self.assertAllFinite(weights)

    def test_serialization_and_precision(self):
        self.run_serialization_test(
            LuongAttention,
            {
                "score": "concat",
                "units": 3,
                "scale": "learned",
                "dropout": 0.2,
                "seed": 1,
            },
            {"query": QUERY, "value": VALUE6},
        )
        for _, kwargs, _ in VARIANTS:
            self.run_precision_test(
                LuongAttention, kwargs, {"query": QUERY, "value": VALUE}
            )

    @pytest.mark.tf_only
    def test_saved_model_round_trip(self):
        query = keras.Input((None, 4), name="query")
        value = keras.Input((None, 6), name="value")
        context = LuongAttention(score="concat", units=5)(query, value)
        self.run_saved_model_test(keras.Model([query, value], context), [QUERY, VALUE6])

    def test_precomputed_key_projection(self):
        # (variant, the last dimension of `project_key(key)`: dk, dq or units)
        for (name, kwargs, _), projected_dim in zip(
            VARIANTS, (4, 4, 4, 4, 5), strict=True
        ):
            value = VALUE if kwargs["score"] == "dot" else VALUE6
            layer = LuongAttention(**kwargs)
            for query in (STATE, QUERY):
                expected = layer(
                    query, value, value_mask=VALUE_MASK, return_attention_scores=True
                )
                if kwargs.get("scale") == "learned":
                    layer.scale_factor.assign(1.7)
                    expected = layer(
                        query,
                        value,
                        value_mask=VALUE_MASK,
                        return_attention_scores=True,
                    )
                projected = layer.project_key(value)  # once per source
                self.assertEqual(tuple(projected.shape), (2, 5, projected_dim), name)
                got = layer(
                    query,
                    value,
                    value_mask=VALUE_MASK,
                    return_attention_scores=True,
                    projected_key=projected,
                )
                self.assertAllClose(got, expected, atol=1e-5, msg=name)
            # The scores come from the projection passed in, not from the key.
            if kwargs["score"] != "concat":
                weights = layer(
                    QUERY,
                    value,
                    return_attention_scores=True,
                    projected_key=0 * projected,
                )[1]
                self.assertAllClose(weights, np.full((2, 3, 5), 0.2), msg=name)
            with self.assertRaisesRegex(
                ValueError, r"projected_key.*Received: projected_key.shape=\(2, 5, 7\)"
            ):
                layer(QUERY, value, projected_key=np.zeros((2, 5, 7), "float32"))

    def test_precomputed_key_projection_under_mixed_float16(self):
        large = (VALUE6 * 300).astype("float32")
        layer = LuongAttention(score="general", dtype="mixed_float16")
        expected = layer(QUERY * 300, large, return_attention_scores=True)
        got = layer(
            QUERY * 300,
            large,
            return_attention_scores=True,
            projected_key=layer.project_key(ops.cast(large, "float16")),
        )
        self.assertAllFinite(got)
        self.assertAllClose(
            ops.cast(got[1], "float32"), ops.cast(expected[1], "float32"), atol=2e-2
        )

    def test_bad_arguments(self):
        with self.assertRaisesRegex(ValueError, r"Received: score='bilinear'"):
            LuongAttention(score="bilinear")
        with self.assertRaisesRegex(ValueError, r"Received: scale='sqrt'"):
            LuongAttention(scale="sqrt")
        with self.assertRaisesRegex(ValueError, r"Received: units=None"):
            LuongAttention(score="concat")
        with self.assertRaisesRegex(ValueError, r"Received: units=3 with score='dot'"):
            LuongAttention(score="dot", units=3)
        with self.assertRaisesRegex(ValueError, r"Received: dropout=-0.1"):
            LuongAttention(dropout=-0.1)
        with self.assertRaisesRegex(ValueError, r"query_dim=4, key_dim=6"):
            LuongAttention(score="dot")(QUERY, VALUE6)
        with self.assertRaisesRegex(
            ValueError, r"query_mask.*Received: query_mask.shape=\(2, 5\)"
        ):
            LuongAttention()(QUERY, VALUE, query_mask=np.ones((2, 5), bool))
