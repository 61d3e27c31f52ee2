import keras
import numpy as np
import pytest

from keras_attn.layers import MultiHeadAttention, MultiHeadSelfAttention
from tests.test_case import TestCase, to_numpy

RNG = np.random.default_rng(4)
QUERY = RNG.normal(size=(2, 4, 8)).astype("float32")
VALUE = RNG.normal(size=(2, 6, 10)).astype("float32")
VALUE_MASK = np.array([[True] * 6, [True, True, True, True, False, False]])
ATTENTION_MASK = RNG.uniform(size=(2, 4, 6)) > 0.3
ATTENTION_MASK[:, :, 0] = True  # every query keeps at least one key


def copied_keras_mha(layer, **kwargs):
    reference = keras.layers.MultiHeadAttention(
        num_heads=layer.num_heads,
        key_dim=layer.key_dim,
        value_dim=layer.value_dim,
        use_bias=layer.use_bias,
        output_shape=layer.output_dim,
        **kwargs,
    )
    # Keras's own fused path fails for value_dim != key_dim on JAX (jax needs
    # equal head sizes), so the reference always takes its explicit path.
    reference(QUERY, VALUE, return_attention_scores=True)
    reference.set_weights(layer.get_weights())
    return reference


class MultiHeadAttentionTest(TestCase):
    def test_layer(self):
        self.run_layer_test(
            MultiHeadAttention,
            {"num_heads": 2, "key_dim": 3},
            {"query": QUERY, "value": VALUE},
            expected_output_shape=(2, 4, 8),
            expected_num_trainable_weights=8,
        )
        self.run_layer_test(
            MultiHeadAttention,
            {
                "num_heads": 2,
                "key_dim": 3,
                "value_dim": 5,
                "use_bias": False,
                "output_dim": 7,
            },
            {"query": QUERY, "value": VALUE},
            call_kwargs={"return_attention_scores": True},
            expected_output_shape=[(2, 4, 7), (2, 2, 4, 6)],
            expected_num_trainable_weights=4,
        )

    def test_matches_keras_multi_head_attention_with_copied_weights(self):
        for kwargs in ({}, {"value_dim": 5, "output_dim": 7}, {"use_bias": False}):
            layer = MultiHeadAttention(num_heads=2, key_dim=3, **kwargs)
            layer(QUERY, VALUE)
            reference = copied_keras_mha(layer)
            for masks in (
                {},
                {"value_mask": VALUE_MASK},
                {"attention_mask": ATTENTION_MASK},
                {"use_causal_mask": True},
            ):
                got, got_weights = layer(
                    QUERY, VALUE, return_attention_scores=True, **masks
                )
                want, want_weights = reference(
                    QUERY, VALUE, return_attention_scores=True, **masks
                )
                self.assertAllClose(got, want, atol=1e-5, msg=str(masks))
                self.assertAllClose(
                    got_weights, want_weights, atol=1e-5, msg=str(masks)
                )
                self.assertAllClose(layer(QUERY, VALUE, **masks), want, atol=1e-5)

    def test_self_attention_matches_keras_with_keras_mask(self):
        layer = MultiHeadSelfAttention(num_heads=2)
        tokens = keras.Input((None,), dtype="int32")
        embedded = keras.layers.Embedding(20, 8, mask_zero=True)(tokens)
        model = keras.Model(tokens, layer(embedded))
        reference = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
        reference(QUERY, QUERY)
        reference.set_weights(layer.get_weights())
        ids = np.array([[3, 4, 5, 6], [7, 8, 0, 0]])
        embedded_ids = model.layers[1](ids)
        mask = ids != 0
        got = to_numpy(model(ids))
        want = to_numpy(
            reference(embedded_ids, embedded_ids, query_mask=mask, value_mask=mask)
        )
        np.testing.assert_allclose(got[mask], want[mask], atol=1e-5)
        np.testing.assert_array_equal(got[~mask], 0.0)  # padded queries: zeros

    def test_fused_path_equals_explicit_path_including_fully_masked_rows(self):
        layer = MultiHeadAttention(num_heads=2, key_dim=4)
        mask = ATTENTION_MASK.copy()
        mask[1, 2] = False  # a query with nothing to attend to
        fused = to_numpy(layer(QUERY, VALUE, attention_mask=mask))
        explicit, _ = layer(
            QUERY, VALUE, attention_mask=mask, return_attention_scores=True
        )
        np.testing.assert_allclose(fused, to_numpy(explicit), atol=1e-5)
        np.testing.assert_array_equal(fused[1, 2], 0.0)

    def test_masked_value_contents_do_not_change_outputs(self):
        layer = MultiHeadAttention(num_heads=2, key_dim=3)
        base = layer(QUERY, VALUE, value_mask=VALUE_MASK)
        changed = VALUE.copy()
        changed[1, 4:] = 1e3
        self.assertAllClose(
            layer(QUERY, changed, value_mask=VALUE_MASK), base, atol=1e-5
        )

    def test_self_attention_is_permutation_equivariant(self):
        layer = MultiHeadSelfAttention(num_heads=2)
        permutation = np.array([2, 0, 3, 1])
        out = to_numpy(layer(QUERY))
        permuted = to_numpy(layer(QUERY[:, permutation]))
        np.testing.assert_allclose(permuted, out[:, permutation], atol=1e-5)

    def test_causal_outputs_ignore_future_tokens(self):
        layer = MultiHeadSelfAttention(num_heads=2, causal=True)
        out = to_numpy(layer(QUERY))
        changed = QUERY.copy()
        changed[:, 2:] = RNG.normal(size=changed[:, 2:].shape)
        out_changed = to_numpy(layer(changed))
        np.testing.assert_allclose(out_changed[:, :2], out[:, :2], atol=1e-6)
        assert not np.allclose(out_changed[:, 2:], out[:, 2:])

    def test_cached_steps_equal_the_full_causal_pass(self):
        layer = MultiHeadSelfAttention(num_heads=2, causal=True)
        full = to_numpy(layer(QUERY))
        cache = (np.zeros((2, 4, 2, 4), "float32"), np.zeros((2, 4, 2, 4), "float32"))
        for index in range(4):
            step, cache = layer(
                QUERY[:, index : index + 1], cache=cache, cache_update_index=index
            )
            np.testing.assert_allclose(to_numpy(step)[:, 0], full[:, index], atol=1e-5)

    def test_precomputed_cross_attention_cache(self):
        layer = MultiHeadAttention(num_heads=2, key_dim=3)
        full = layer(QUERY, VALUE, value_mask=VALUE_MASK)
        cache = layer.compute_key_value(VALUE)
        cached, same_cache = layer(QUERY, None, value_mask=VALUE_MASK, cache=cache)
        self.assertAllClose(cached, full, atol=1e-6)
        self.assertAllClose(same_cache, cache, atol=0)

    def test_fully_masked_rows_and_large_logits_in_every_policy(self):
        for policy in ("float32", "mixed_float16", "mixed_bfloat16"):
            layer = MultiHeadAttention(num_heads=2, key_dim=3, dtype=policy)
            mask = np.ones((2, 6), bool)
            mask[1] = False
            for weights_wanted in (False, True):
                out = layer(
                    QUERY * 300.0,
                    VALUE * 300.0,
                    value_mask=mask,
                    return_attention_scores=weights_wanted,
                )
                out = to_numpy(
                    keras.ops.cast(out[0] if weights_wanted else out, "float32")
                )
                self.assertAllFinite(out, policy)
                np.testing.assert_array_equal(out[1], 0.0)

    def test_serialization_and_precision(self):
        init = {
            "num_heads": 2,
            "key_dim": 3,
            "value_dim": 5,
            "dropout": 0.1,
            "use_bias": False,
            "output_dim": 6,
            "kernel_initializer": "he_normal",
            "bias_initializer": "ones",
            "kernel_regularizer": "l2",
            "bias_regularizer": "l1",
            "seed": 2,
        }
        self.run_serialization_test(
            MultiHeadAttention, init, {"query": QUERY, "value": VALUE}
        )
        self.run_serialization_test(
            MultiHeadSelfAttention,
            {"num_heads": 2, "causal": True, "dropout": 0.1},
            {"inputs": QUERY},
        )
        self.run_precision_test(
            MultiHeadAttention,
            {"num_heads": 2, "key_dim": 3},
            {"query": QUERY, "value": VALUE},
        )
        self.run_precision_test(
            MultiHeadSelfAttention, {"num_heads": 2, "causal": True}, {"inputs": QUERY}
        )

    @pytest.mark.tf_only
    def test_saved_model_round_trip(self):
        tokens = keras.Input((None,), dtype="int32", name="tokens")
        x = keras.layers.Embedding(20, 8, mask_zero=True)(tokens)
        x = MultiHeadSelfAttention(num_heads=2, causal=True)(x)
        self.run_saved_model_test(
            keras.Model(tokens, x), np.array([[3, 4, 5, 6], [7, 8, 0, 0]], "int32")
        )

    def test_bad_arguments(self):
        with self.assertRaisesRegex(ValueError, r"Received: num_heads=0"):
            MultiHeadAttention(num_heads=0, key_dim=2)
        with self.assertRaisesRegex(ValueError, r"Received: key_dim=2.5"):
            MultiHeadAttention(num_heads=2, key_dim=2.5)
        with self.assertRaisesRegex(ValueError, r"Received: dropout=1.5"):
            MultiHeadAttention(num_heads=2, key_dim=2, dropout=1.5)
        with self.assertRaisesRegex(
            ValueError, r"num_heads=3, inputs.shape=\(2, 4, 8\)"
        ):
            MultiHeadSelfAttention(num_heads=3)(QUERY)
        with self.assertRaisesRegex(ValueError, r"`query` must have rank 3"):
            MultiHeadAttention(num_heads=2, key_dim=2)(QUERY[:, 0], VALUE)
        layer = MultiHeadAttention(num_heads=2, key_dim=2)
        with self.assertRaisesRegex(
            ValueError, r"Received: attention_mask.shape=\(2, 6, 4\)"
        ):
            layer(QUERY, VALUE, attention_mask=np.ones((2, 6, 4), bool))
        with self.assertRaisesRegex(ValueError, r"Received: value_mask.shape=\(2, 4\)"):
            layer(QUERY, VALUE, value_mask=np.ones((2, 4), bool))
        with self.assertRaisesRegex(
            ValueError, r"cache_update_index.*Received: cache=None"
        ):
            layer(QUERY, VALUE, cache_update_index=0)
        with self.assertRaisesRegex(ValueError, r"Received: cache="):
            layer(QUERY, VALUE, cache=np.zeros((2, 6, 2, 2)))
        inputs = keras.Input((5, 8))
        with self.assertRaisesRegex(ValueError, r"Received: attention_mask.shape"):
            MultiHeadSelfAttention(num_heads=2)(
                inputs, attention_mask=keras.Input((3, 3))
            )


def test_self_attention_keeps_the_keras_mask_next_to_an_attention_mask():
    # With a second tensor argument Keras fills `inputs_mask`, not `mask`.
    tokens = keras.Input((None,), dtype="int32")
    pairs = keras.Input((None, None), dtype="bool")
    x = keras.layers.Embedding(20, 8, mask_zero=True)(tokens)
    layer = MultiHeadSelfAttention(num_heads=2)
    model = keras.Model([tokens, pairs], layer(x, attention_mask=pairs))
    ids = np.array([[3, 4, 0, 0]])
    everything = np.ones((1, 4, 4), bool)
    out = to_numpy(model([ids, everything]))
    np.testing.assert_array_equal(out[0, 2:], 0.0)  # padded queries
    trimmed = to_numpy(model([ids[:, :2], everything[:, :2, :2]]))
    np.testing.assert_allclose(out[:, :2], trimmed, atol=1e-5)  # padded keys ignored
