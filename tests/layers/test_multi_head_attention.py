import inspect
import os
import tempfile

import keras
import keras_hub
import numpy as np
import pytest
from absl.testing import parameterized

from keras_attn.layers import MultiHeadAttention, MultiHeadSelfAttention
from tests.test_case import TestCase, to_numpy

RNG = np.random.default_rng(4)
QUERY = RNG.normal(size=(2, 4, 8)).astype("float32")
VALUE = RNG.normal(size=(2, 6, 10)).astype("float32")
KEY = RNG.normal(size=(2, 6, 10)).astype("float32")
QUERY_MASK = np.array([[True] * 4, [True, True, True, False]])
VALUE_MASK = np.array([[True] * 6, [True, True, True, True, False, False]])
KEY_MASK = np.array([[True, False, True, True, True, True], [True] * 6])
ATTENTION_MASK = RNG.uniform(size=(2, 4, 6)) > 0.3
ATTENTION_MASK[:, :, 0] = True  # every query keeps at least one key
ATTENTION_MASK[1, 2] = False  # but this one: no key at all
IMAGES = RNG.normal(size=(2, 3, 5, 8)).astype("float32")  # (B, H, W, C)

MASK_CASES = {
    "none": {},
    "value_mask": {"value_mask": VALUE_MASK},
    "key_and_masks": {"key": KEY, "key_mask": KEY_MASK, "value_mask": VALUE_MASK},
    "attention_mask": {"attention_mask": ATTENTION_MASK},
    "query_mask": {"query_mask": QUERY_MASK},
    "causal": {"use_causal_mask": True},
    "causal_and_value_mask": {"use_causal_mask": True, "value_mask": VALUE_MASK},
}
CONFIGS = {
    "default": {},
    "narrow_values_and_output_shape": {"value_dim": 5, "output_shape": 7},
    "no_bias": {"use_bias": False},
    "gate": {"use_gate": True},
    "sliding_window": {"sliding_window": 2},
    "tuple_output_shape": {"output_shape": (2, 3)},
}


def keras_twin(layer, query=QUERY, value=VALUE, key=None):
    """`keras.layers.MultiHeadAttention` from the layer's config (Keras's names),
    built on the same shapes, with the layer's weights."""
    twin = keras.layers.MultiHeadAttention.from_config(layer.get_config())
    # Keras's fused path fails on JAX when value_dim != key_dim (JAX needs equal
    # head sizes); with the scores it takes its explicit path.
    twin(query, value, key, return_attention_scores=True)
    twin.set_weights(layer.get_weights())
    return twin


def rows_with_keys(case, query_length=4, key_length=6, sliding_window=None):
    """`(B, Tq)`: the query rows with at least one key, and not masked as
    queries (the rows where keras-attn and Keras agree)."""
    pairs = np.ones((2, query_length, key_length), bool)
    for name in ("value_mask", "key_mask"):
        if name in case:
            pairs &= case[name][:, None, :]
    if "attention_mask" in case:
        pairs &= case["attention_mask"]
    positions = np.arange(query_length)[:, None], np.arange(key_length)[None, :]
    if case.get("use_causal_mask"):
        pairs &= positions[1] <= positions[0]
    if sliding_window:
        pairs &= np.abs(positions[0] - positions[1]) < sliding_window
    rows = pairs.any(-1)
    if "query_mask" in case:
        rows &= case["query_mask"]
    return rows


def call_args(case):
    case = dict(case)
    return case.pop("key", None), case


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
                "output_shape": 7,
                "use_gate": True,
            },
            {"query": QUERY, "value": VALUE, "key": KEY},
            call_kwargs={"return_attention_scores": True},
            expected_output_shape=[(2, 4, 7), (2, 2, 4, 6)],
            expected_num_trainable_weights=5,
        )
        self.run_layer_test(
            MultiHeadAttention,
            {"num_heads": 2, "key_dim": 3, "attention_axes": (1, 2)},
            {"query": IMAGES, "value": IMAGES},
            expected_output_shape=(2, 3, 5, 8),
        )

    def test_is_a_keras_multi_head_attention(self):
        layer = MultiHeadAttention(num_heads=2, key_dim=3)
        self.assertIsInstance(layer, keras.layers.MultiHeadAttention)
        layer(QUERY, VALUE)
        self.assertEqual(
            [w.path.split("/", 1)[1] for w in layer.weights],
            [w.path.split("/", 1)[1] for w in keras_twin(layer).weights],
        )

    def test_constructor_and_call_take_keras_arguments_in_keras_order(self):
        # Keras adding an argument fails here: keras-attn's call must then
        # honour it.
        for method in ("__init__", "call"):
            ours = list(
                inspect.signature(getattr(MultiHeadAttention, method)).parameters
            )
            theirs = list(
                inspect.signature(
                    getattr(keras.layers.MultiHeadAttention, method)
                ).parameters
            )
            theirs = [name for name in theirs if name != "kwargs"]
            self.assertEqual(ours[: len(theirs)], theirs, method)
        defaults = {
            name: p.default
            for name, p in inspect.signature(
                keras.layers.MultiHeadAttention.__init__
            ).parameters.items()
        }
        for name, p in inspect.signature(
            MultiHeadAttention.__init__
        ).parameters.items():
            if name in defaults:
                self.assertEqual(p.default, defaults[name], name)

    @parameterized.named_parameters(*CONFIGS.items())
    def test_matches_keras_with_copied_weights(self, config):
        layer = MultiHeadAttention(num_heads=2, key_dim=3, **config)
        layer(QUERY, VALUE, KEY)
        twin = keras_twin(layer, key=KEY)
        for name, case in MASK_CASES.items():
            key, masks = call_args(case)
            rows = rows_with_keys(case, sliding_window=config.get("sliding_window"))
            got, got_weights = layer(
                QUERY, VALUE, key, return_attention_scores=True, **masks
            )
            want, want_weights = twin(
                QUERY, VALUE, key, return_attention_scores=True, **masks
            )
            np.testing.assert_allclose(
                to_numpy(got)[rows], to_numpy(want)[rows], atol=1e-5, err_msg=name
            )
            np.testing.assert_allclose(
                to_numpy(got_weights).transpose(0, 2, 1, 3)[rows],
                to_numpy(want_weights).transpose(0, 2, 1, 3)[rows],
                atol=1e-5,
                err_msg=name,
            )
            # The path without weights (fused where the backend has it).
            fast = to_numpy(layer(QUERY, VALUE, key, **masks))
            np.testing.assert_allclose(fast[rows], to_numpy(want)[rows], atol=1e-5)
            # Where they deliberately differ: no keys, zero output rows.
            np.testing.assert_array_equal(fast[~rows], 0.0)

    def test_matches_keras_in_mixed_bfloat16(self):
        for config in ({}, {"use_gate": True, "value_dim": 5}):
            layer = MultiHeadAttention(2, 3, dtype="mixed_bfloat16", **config)
            layer(QUERY, VALUE)
            twin = keras_twin(layer)
            self.assertEqual(twin.dtype_policy.name, "mixed_bfloat16")
            for name, case in MASK_CASES.items():
                key, masks = call_args(case)
                rows = rows_with_keys(case)
                got = to_numpy(
                    keras.ops.cast(layer(QUERY, VALUE, key, **masks), "float32")
                )
                want, _ = twin(QUERY, VALUE, key, return_attention_scores=True, **masks)
                want = to_numpy(keras.ops.cast(want, "float32"))
                np.testing.assert_allclose(
                    got[rows], want[rows], atol=2e-2, rtol=2e-2, err_msg=name
                )

    @parameterized.named_parameters(
        ("default_axes", None),
        ("last_axis", (2,)),
        ("first_axis", (1,)),
        ("negative", -3),
    )
    def test_higher_rank_inputs_with_attention_axes_match_keras(self, axes):
        layer = MultiHeadAttention(num_heads=2, key_dim=3, attention_axes=axes)
        layer(IMAGES, IMAGES)
        twin = keras_twin(layer, IMAGES, IMAGES)
        got, got_weights = layer(IMAGES, IMAGES, return_attention_scores=True)
        want, want_weights = twin(IMAGES, IMAGES, return_attention_scores=True)
        self.assertEqual(tuple(got_weights.shape), tuple(want_weights.shape))
        self.assertAllClose(got, want, atol=1e-5)
        self.assertAllClose(got_weights, want_weights, atol=1e-5)
        self.assertAllClose(layer(IMAGES, IMAGES), want, atol=1e-5)
        # An attention mask over the attention axes, broadcast as in Keras.
        attention_shape = tuple(to_numpy(want_weights).shape)
        heads_axis = len(attention_shape) - 2 * len(layer.attention_axes) - 1
        mask_shape = attention_shape[:heads_axis] + attention_shape[heads_axis + 1 :]
        mask = RNG.uniform(size=mask_shape) > 0.3
        mask[..., 0] = True  # in every row, the first key of the flattened axes
        got = layer(IMAGES, IMAGES, attention_mask=mask)
        want = twin(IMAGES, IMAGES, attention_mask=mask)
        self.assertAllClose(got, want, atol=1e-5)

    def test_keras_masks_are_honoured_and_an_explicit_query_mask_is_combined(self):
        layer = MultiHeadAttention(num_heads=2, key_dim=4)
        tokens = keras.Input((None,), dtype="int32")
        embedding = keras.layers.Embedding(20, 8, mask_zero=True)
        embedded = embedding(tokens)
        model = keras.Model(tokens, layer(embedded, embedded))
        ids = np.array([[3, 4, 5, 6], [7, 8, 0, 0]])
        values, mask = to_numpy(embedding(ids)), ids != 0
        want = to_numpy(layer(values, values, query_mask=mask, value_mask=mask))
        got = to_numpy(model(ids))
        np.testing.assert_allclose(got, want, atol=1e-6)
        np.testing.assert_array_equal(got[~mask], 0.0)
        twin = keras_twin(layer, values, values)
        reference = to_numpy(twin(values, values, query_mask=mask, value_mask=mask))
        np.testing.assert_allclose(got[mask], reference[mask], atol=1e-5)
        # An explicit query mask next to the Keras mask: both apply (Keras
        # would replace the argument by the Keras mask).
        first_only = np.array([[True, False, False, False]] * 2)
        explicit = keras.Input((None,), dtype="bool")
        model = keras.Model(
            [tokens, explicit], layer(embedded, embedded, query_mask=explicit)
        )
        got = to_numpy(model([ids, first_only]))
        np.testing.assert_array_equal(got[~(mask & first_only)], 0.0)
        np.testing.assert_allclose(got[:, 0], want[:, 0], atol=1e-6)

    def test_fused_and_explicit_paths_agree_including_fully_masked_rows(self):
        layer = MultiHeadAttention(num_heads=2, key_dim=4)
        outputs = {}
        for flash in (None, False):
            layer.flash_attention = flash
            outputs[flash] = to_numpy(
                layer(QUERY, VALUE, attention_mask=ATTENTION_MASK)
            )
        explicit, _ = layer(
            QUERY, VALUE, attention_mask=ATTENTION_MASK, return_attention_scores=True
        )
        np.testing.assert_allclose(outputs[None], outputs[False], atol=1e-5)
        np.testing.assert_allclose(outputs[None], to_numpy(explicit), atol=1e-5)
        np.testing.assert_array_equal(outputs[None][1, 2], 0.0)

    def test_flash_attention_true_takes_a_path_without_the_weights(self):
        # The fused kernel where one runs, else the memory-efficient path (on
        # TensorFlow and on a CPU): tests/layers/test_attention_paths.py.
        layer = MultiHeadAttention(num_heads=2, key_dim=4, flash_attention=True)
        got = to_numpy(layer(QUERY, VALUE, attention_mask=ATTENTION_MASK))
        layer.flash_attention = False
        want = to_numpy(layer(QUERY, VALUE, attention_mask=ATTENTION_MASK))
        np.testing.assert_allclose(got, want, atol=1e-5)
        layer.flash_attention = True
        with self.assertRaisesRegex(
            ValueError, "weights are requested.*Received: flash_attention=True"
        ):
            layer(QUERY, VALUE, return_attention_scores=True)

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
        # The call's use_causal_mask overrides `causal`.
        self.assertFalse(
            np.allclose(
                to_numpy(layer(changed, use_causal_mask=False))[:, :2], out[:, :2]
            )
        )

    def test_cached_steps_equal_the_full_causal_pass(self):
        layer = MultiHeadSelfAttention(num_heads=2, causal=True)
        full = to_numpy(layer(QUERY))
        cache = (np.zeros((2, 4, 2, 4), "float32"), np.zeros((2, 4, 2, 4), "float32"))
        for index in range(4):
            step, cache = layer(
                QUERY[:, index : index + 1], cache=cache, cache_update_index=index
            )
            np.testing.assert_allclose(to_numpy(step)[:, 0], full[:, index], atol=1e-5)

    def test_stacked_cache_matches_keras_hub_cached_attention(self):
        layer = MultiHeadAttention(num_heads=2, key_dim=4)
        layer(QUERY, QUERY)
        hub = keras_hub.layers.CachedMultiHeadAttention(num_heads=2, key_dim=4)
        hub(QUERY, QUERY)
        hub.set_weights(layer.get_weights())
        causal = np.tril(np.ones((4, 4), bool))
        ours_cache = hub_cache = np.zeros((2, 2, 4, 2, 4), "float32")
        full = to_numpy(layer(QUERY, QUERY, use_causal_mask=True))
        for index in range(4):
            token = QUERY[:, index : index + 1]
            step_mask = np.broadcast_to(causal[index : index + 1], (2, 1, 4))
            got, ours_cache = layer(
                token,
                token,
                use_causal_mask=True,
                cache=ours_cache,
                cache_update_index=index,
            )
            want, hub_cache = hub(
                token,
                token,
                attention_mask=step_mask,
                cache=hub_cache,
                cache_update_index=index,
            )
            self.assertEqual(tuple(ours_cache.shape), (2, 2, 4, 2, 4))
            self.assertAllClose(got, want, atol=1e-5)
            self.assertAllClose(ours_cache, hub_cache, atol=1e-6)
            np.testing.assert_allclose(to_numpy(got)[:, 0], full[:, index], atol=1e-5)
        # A stacked cache without an index is used as it is (cross-attention).
        got, same = layer(QUERY, None, cache=ours_cache)
        want, _ = hub(QUERY, QUERY, cache=hub_cache)
        self.assertAllClose(got, want, atol=1e-5)
        self.assertAllClose(same, ours_cache, atol=0)

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

    @parameterized.named_parameters(
        ("query_value", {}, {}),
        ("key", {"key": KEY}, {}),
        ("scores", {}, {"return_attention_scores": True}),
        ("key_and_scores", {"key": KEY}, {"return_attention_scores": True}),
        ("tuple_output_shape", {}, {"return_attention_scores": True}, (2, 3)),
        ("causal_masks", {"value_mask": VALUE_MASK}, {"use_causal_mask": True}),
        ("images", {}, {"return_attention_scores": True}, None, (2,)),
        ("images_all_axes", {}, {"return_attention_scores": True}, None, None),
    )
    def test_compute_output_shape_and_spec(
        self, tensors, flags, output_shape=None, axes="rank3"
    ):
        images = axes != "rank3"
        query, value = (IMAGES, IMAGES) if images else (QUERY, VALUE)
        init = {"num_heads": 2, "key_dim": 3, "output_shape": output_shape}
        if images:
            init["attention_axes"] = axes
        layer = MultiHeadAttention(**init)
        eager = layer(query, value, **tensors, **flags)
        inputs = {
            name: keras.Input(array.shape[1:], dtype=str(array.dtype))
            for name, array in {"query": query, "value": value, **tensors}.items()
        }
        symbolic = layer(**inputs, **flags)
        eager, symbolic = (
            (x,) if not isinstance(x, (tuple, list)) else x for x in (eager, symbolic)
        )
        self.assertEqual(
            [tuple(s.shape)[1:] for s in symbolic], [tuple(e.shape)[1:] for e in eager]
        )
        key = tensors.get("key")
        shape = layer.compute_output_shape(
            query.shape, value.shape, None if key is None else key.shape
        )
        self.assertEqual(tuple(shape), tuple(eager[0].shape))

    def test_compute_output_spec_with_caches(self):
        layer = MultiHeadAttention(num_heads=2, key_dim=4)
        layer(QUERY, QUERY)
        token = keras.Input((1, 8))
        index = keras.Input((), dtype="int32", batch_size=1)
        keys, values = keras.Input((5, 2, 4)), keras.Input((5, 2, 4))
        stacked = keras.Input((2, 5, 2, 4))
        outputs, scores, cache = layer(
            token,
            token,
            cache=(keys, values),
            cache_update_index=index[0],
            return_attention_scores=True,
        )
        self.assertEqual(tuple(scores.shape), (None, 2, 1, 5))
        self.assertEqual([tuple(t.shape) for t in cache], [(None, 5, 2, 4)] * 2)
        outputs, cache = layer(token, token, cache=stacked, cache_update_index=index[0])
        self.assertEqual(tuple(outputs.shape), (None, 1, 8))
        self.assertEqual(tuple(cache.shape), (None, 2, 5, 2, 4))
        causal_outputs, causal_cache = layer(
            token,
            token,
            cache=stacked,
            cache_update_index=index[0],
            use_causal_mask=True,
        )
        step = keras.Model([token, stacked, index], [causal_outputs, causal_cache])
        full = to_numpy(layer(QUERY, QUERY, use_causal_mask=True))
        cache = np.zeros((2, 2, 5, 2, 4), "float32")
        for i in range(4):
            out, cache = step([QUERY[:, i : i + 1], cache, np.array([i])])
            cache = to_numpy(cache)
            np.testing.assert_allclose(to_numpy(out)[:, 0], full[:, i], atol=1e-5)

    @parameterized.named_parameters(
        ("float32", "float32", 1e-5), ("mixed_bfloat16", "mixed_bfloat16", 2e-2)
    )
    def test_swapped_into_keras_user_code(self, policy, tolerance):
        """keras.io's Transformer examples, written with
        `keras.layers.MultiHeadAttention`, give the same outputs with
        `keras_attn.layers.MultiHeadAttention` in its place."""

        def text_classifier(attention_class):
            # "Text classification with Transformer" (keras.io).
            inputs = keras.Input(shape=(6,), dtype="int32")
            x = keras.layers.Embedding(20, 8)(inputs)
            attn_output = attention_class(num_heads=2, key_dim=8)(x, x)
            x = keras.layers.LayerNormalization(epsilon=1e-6)(x + attn_output)
            ffn = keras.Sequential(
                [keras.layers.Dense(16, activation="relu"), keras.layers.Dense(8)]
            )
            x = keras.layers.LayerNormalization(epsilon=1e-6)(x + ffn(x))
            x = keras.layers.GlobalAveragePooling1D()(x)
            outputs = keras.layers.Dense(2, activation="softmax", dtype="float32")(x)
            return keras.Model(inputs, outputs)

        def translation_decoder(attention_class):
            # The decoder of "English-to-Spanish translation with a
            # sequence-to-sequence Transformer" (keras.io).
            target = keras.Input((5,), dtype="int32")
            source = keras.Input((6, 8))
            y = keras.layers.Embedding(20, 8, mask_zero=True)(target)
            a = attention_class(num_heads=2, key_dim=8, dropout=0.1)(
                query=y, value=y, key=y, use_causal_mask=True
            )
            y = keras.layers.LayerNormalization()(y + a)
            b = attention_class(num_heads=2, key_dim=8)(
                query=y, value=source, key=source
            )
            y = keras.layers.LayerNormalization()(y + b)
            logits = keras.layers.Dense(20, dtype="float32")(y)
            return keras.Model([target, source], logits)

        keras.config.set_dtype_policy(policy)
        token_ids = np.array([[3, 4, 5, 6, 7, 8], [7, 8, 9, 10, 11, 12]], "int32")
        target_ids = np.array([[1, 4, 5, 6, 7], [1, 9, 2, 0, 0]], "int32")
        source = RNG.normal(size=(2, 6, 8)).astype("float32")
        for build, inputs, rows in (
            (text_classifier, token_ids, slice(None)),
            (translation_decoder, [target_ids, source], target_ids != 0),
        ):
            theirs = build(keras.layers.MultiHeadAttention)
            ours = build(MultiHeadAttention)
            ours.set_weights(theirs.get_weights())
            got, want = to_numpy(ours(inputs)), to_numpy(theirs(inputs))
            np.testing.assert_allclose(
                got[rows],
                want[rows],
                atol=tolerance,
                rtol=tolerance,
                err_msg=build.__name__,
            )

    def test_lora_on_the_projections_matches_keras(self):
        layer = MultiHeadAttention(num_heads=2, key_dim=3)
        layer(QUERY, VALUE)
        twin = keras_twin(layer)
        before = to_numpy(layer(QUERY, VALUE))
        for attention in (layer, twin):
            attention.query_dense.enable_lora(2)
            attention.value_dense.enable_lora(2)
        # LoRA starts as the identity update (b = 0).
        np.testing.assert_allclose(to_numpy(layer(QUERY, VALUE)), before, atol=1e-6)
        self.assertEqual(
            sorted(w.path.split("/", 1)[1] for w in layer.trainable_weights),
            sorted(w.path.split("/", 1)[1] for w in twin.trainable_weights),
        )
        for ours, theirs in (
            (layer.query_dense, twin.query_dense),
            (layer.value_dense, twin.value_dense),
        ):
            for name in ("lora_kernel_a", "lora_kernel_b"):
                value = RNG.normal(size=getattr(ours, name).shape).astype("float32")
                getattr(ours, name).assign(value)
                getattr(theirs, name).assign(value)
        got = to_numpy(layer(QUERY, VALUE))
        self.assertFalse(np.allclose(got, before, atol=1e-3))
        np.testing.assert_allclose(got, to_numpy(twin(QUERY, VALUE)), atol=1e-5)

    def test_keras_hub_enable_lora_reaches_query_and_value(self):
        inputs = keras.Input((4, 8))
        outputs = MultiHeadAttention(2, 4, name="attention")(inputs, inputs)
        backbone = keras_hub.models.Backbone(inputs=inputs, outputs=outputs)
        backbone.enable_lora(2)
        self.assertEqual(
            sorted(w.path for w in backbone.trainable_weights if "lora" in w.path),
            [
                "attention/query/lora_kernel_a",
                "attention/query/lora_kernel_b",
                "attention/value/lora_kernel_a",
                "attention/value/lora_kernel_b",
            ],
        )

    def test_int8_quantization_reaches_every_projection(self):
        def model(attention_class):
            query, value = keras.Input((4, 8)), keras.Input((6, 10))
            attention = attention_class(2, 3, use_gate=True, name="attention")
            return keras.Model([query, value], attention(query, value))

        ours, theirs = model(MultiHeadAttention), model(keras.layers.MultiHeadAttention)
        theirs.set_weights(ours.get_weights())
        float_outputs = to_numpy(ours([QUERY, VALUE]))
        ours.quantize("int8")
        theirs.quantize("int8")
        attention = ours.get_layer("attention")
        self.assertEqual(
            [
                dense.quantization_mode
                for dense in (
                    attention.query_dense,
                    attention.key_dense,
                    attention.value_dense,
                    attention.output_dense,
                    attention.gate_dense,
                )
            ],
            ["int8"] * 5,
        )
        got = to_numpy(ours([QUERY, VALUE]))
        np.testing.assert_allclose(got, to_numpy(theirs([QUERY, VALUE])), atol=1e-5)
        self.assertFalse(np.array_equal(got, float_outputs))
        np.testing.assert_allclose(got, float_outputs, atol=5e-2)
        # keras-attn records the projections' policies: the quantized model
        # saves and loads (Keras's own layer does not).
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "quantized.keras")
            ours.save(path)
            loaded = keras.saving.load_model(path)
        self.assertEqual(
            loaded.get_layer("attention").query_dense.quantization_mode, "int8"
        )
        np.testing.assert_allclose(to_numpy(loaded([QUERY, VALUE])), got, atol=0)

    def test_dtype_policy_maps_reach_the_sublayers_as_in_keras(self):
        outputs = []
        for attention_class in (MultiHeadAttention, keras.layers.MultiHeadAttention):
            policy = keras.dtype_policies.DTypePolicyMap(default_policy="float32")
            policy["attention/query"] = keras.DTypePolicy("bfloat16")
            layer = attention_class(2, 3, dtype=policy, name="attention")
            layer(QUERY, VALUE)
            self.assertEqual(layer.query_dense.compute_dtype, "bfloat16")
            self.assertEqual(layer.key_dense.compute_dtype, "float32")
            self.assertEqual(layer.query_dense.kernel.dtype, "bfloat16")
            if outputs:
                layer.set_weights(outputs[0][0].get_weights())
            outputs.append((layer, layer(QUERY, VALUE)))
        got, want = (keras.ops.cast(out, "float32") for _, out in outputs)
        self.assertAllClose(got, want, atol=2e-2, rtol=2e-2)

    def test_serialization_and_precision(self):
        init = {
            "num_heads": 2,
            "key_dim": 3,
            "value_dim": 5,
            "dropout": 0.1,
            "use_bias": False,
            "output_shape": (2, 3),
            "attention_axes": (1,),
            "sliding_window": 3,
            "flash_attention": False,
            "kernel_initializer": "he_normal",
            "bias_initializer": "ones",
            "kernel_regularizer": "l2",
            "bias_regularizer": "l1",
            "activity_regularizer": "l2",
            "kernel_constraint": "non_neg",
            "bias_constraint": "max_norm",
            "use_gate": True,
            "seed": 2,
        }
        self.run_serialization_test(
            MultiHeadAttention, init, {"query": QUERY, "value": VALUE}
        )
        # A config written by Keras's layer loads into keras-attn's.
        keras_config = keras.layers.MultiHeadAttention(**init).get_config()
        revived = MultiHeadAttention.from_config(keras_config)
        self.assertEqual(
            {k: v for k, v in revived.get_config().items() if k != "name"},
            {k: v for k, v in keras_config.items() if k != "name"}
            | {"flash_attention": None},
        )
        self.run_serialization_test(
            MultiHeadSelfAttention,
            {"num_heads": 2, "causal": True, "dropout": 0.1, "use_gate": True},
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

    def test_output_dim_is_an_alias_of_an_int_output_shape(self):
        layer = MultiHeadAttention(num_heads=2, key_dim=3, output_dim=6)
        self.assertEqual(layer.output_dim, 6)
        self.assertEqual(layer.get_config()["output_shape"], (6,))
        self.assertNotIn("output_dim", layer.get_config())
        self.assertEqual(tuple(layer(QUERY, VALUE).shape), (2, 4, 6))
        self.assertIsNone(MultiHeadAttention(2, 3, output_shape=(2, 3)).output_dim)

    @pytest.mark.tf_only
    def test_saved_model_round_trip(self):
        tokens = keras.Input((None,), dtype="int32", name="tokens")
        x = keras.layers.Embedding(20, 8, mask_zero=True)(tokens)
        x = MultiHeadSelfAttention(num_heads=2, causal=True, use_gate=True)(x)
        self.run_saved_model_test(
            keras.Model(tokens, x), np.array([[3, 4, 5, 6], [7, 8, 0, 0]], "int32")
        )

    def test_bad_arguments(self):
        for kwargs, received in (
            ({"num_heads": 0}, "num_heads=0"),
            ({"key_dim": 2.5}, "key_dim=2.5"),
            ({"value_dim": 0}, "value_dim=0"),
            ({"dropout": 1.5}, "dropout=1.5"),
            ({"output_shape": (3, 0)}, r"output_shape=\(3, 0\)"),
            ({"output_shape": "wide"}, "output_shape='wide'"),
            ({"output_shape": 4, "output_dim": 5}, "output_shape=4, output_dim=5"),
            ({"attention_axes": "time"}, "attention_axes='time'"),
            ({"sliding_window": 0}, "sliding_window=0"),
            ({"flash_attention": "yes"}, "flash_attention='yes'"),
            (
                {"flash_attention": True, "dropout": 0.1},
                "flash_attention=True, dropout",
            ),
            ({"kernel_initializer": "nope"}, "kernel_initializer='nope'"),
            ({"bias_regularizer": "nope"}, "bias_regularizer='nope'"),
            ({"kernel_constraint": "nope"}, "kernel_constraint='nope'"),
            ({"use_gate": "yes"}, "use_gate='yes'"),
            ({"seed": "1"}, "seed='1'"),
        ):
            with self.assertRaisesRegex(ValueError, "Received: " + received):
                MultiHeadAttention(**{"num_heads": 2, "key_dim": 2, **kwargs})
        with self.assertRaisesRegex(
            ValueError, r"num_heads=3, inputs.shape=\(2, 4, 8\)"
        ):
            MultiHeadSelfAttention(num_heads=3)(QUERY)
        with self.assertRaisesRegex(ValueError, r"Received: query.shape=\(2, 8\)"):
            MultiHeadAttention(num_heads=2, key_dim=2)(QUERY[:, 0], VALUE)
        with self.assertRaisesRegex(
            ValueError,
            r"`value` and `key`, except the last one.*"
            r"Received: value.shape=\(2, 6, 10\), key.shape=\(2, 5, 10\)",
        ):
            MultiHeadAttention(num_heads=2, key_dim=2)(QUERY, VALUE, KEY[:, :5])
        with self.assertRaisesRegex(ValueError, r"Received: attention_axes=\(3,\)"):
            MultiHeadAttention(num_heads=2, key_dim=2, attention_axes=3)(QUERY, VALUE)
        with self.assertRaisesRegex(ValueError, r"Received: use_causal_mask=True"):
            MultiHeadAttention(num_heads=2, key_dim=2)(
                IMAGES, IMAGES, use_causal_mask=True
            )
        with self.assertRaisesRegex(ValueError, "`value_mask` needs rank-3 inputs"):
            MultiHeadAttention(num_heads=2, key_dim=2)(
                IMAGES, IMAGES, value_mask=np.ones((2, 3), bool)
            )
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
        with self.assertRaisesRegex(
            ValueError, "stacked cache needs `value_dim == key_dim`"
        ):
            MultiHeadAttention(num_heads=2, key_dim=2, value_dim=3)(
                QUERY, VALUE, cache=np.zeros((2, 2, 6, 2, 2), "float32")
            )
        with self.assertRaisesRegex(
            ValueError, r"flash_attention=True, return_attention_scores=True"
        ):
            MultiHeadAttention(2, 2, flash_attention=True)(
                QUERY, VALUE, return_attention_scores=True
            )
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
