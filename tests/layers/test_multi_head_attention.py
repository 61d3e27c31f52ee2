import inspect
import os
import re
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


# -- Keras's attention masks, `_compute_attention`, structure ---------------------

HEAD_MASK_RNG = np.random.default_rng(34)


def _mask(shape, keep_first_key=True):
    mask = HEAD_MASK_RNG.uniform(size=shape) > 0.4
    if keep_first_key:
        mask[..., 0] = True  # every row keeps a key, in every head
    return mask


# Every attention-mask form Keras takes with rank-3 inputs (B=2, N=2, Tq=4,
# Tk=6): rank 2 is (Tq, Tk), rank 3 broadcasts to (B, Tq, Tk), rank 4 to
# (B, N, Tq, Tk).
ATTENTION_MASK_FORMS = {
    "query_key": _mask((4, 6)),
    "key_padding_rank3": np.array([[[True] * 6], [[True] * 3 + [False] * 3]]),
    "shared_rank3": _mask((1, 4, 6)),
    "batch_rank3": _mask((2, 4, 6)),
    "query_rows_rank3": np.array([[[True]] * 4, [[True], [False], [True], [True]]]),
    "key_padding_rank4": np.array(
        [[[[True] * 5 + [False]]], [[[True] * 2 + [False] * 4]]]
    ),
    "shared_rank4": _mask((1, 1, 4, 6)),
    "batch_rank4": _mask((2, 1, 4, 6)),
    "per_head": _mask((2, 2, 4, 6)),
    "per_head_shared": _mask((1, 2, 4, 6)),
}


def _rows_of(mask):
    """`(B, Tq)`: rows with a key in some head, for a mask of any form."""
    mask = np.asarray(mask)
    if mask.ndim == 2:
        mask = mask[None, None]
    elif mask.ndim == 3:
        mask = mask[:, None]
    mask = np.broadcast_to(mask, (2, 2, 4, 6))
    return mask.any(-1).any(1)


@pytest.mark.parametrize("form", list(ATTENTION_MASK_FORMS))
@pytest.mark.parametrize(
    "flash, scores",
    [(None, False), (True, False), (False, False), (None, True), (False, True)],
    ids=["flash_none", "flash_true", "flash_false", "scores", "scores_explicit"],
)
def test_every_keras_attention_mask_form_on_every_path_matches_keras(
    form, flash, scores
):
    mask = ATTENTION_MASK_FORMS[form]
    layer = MultiHeadAttention(num_heads=2, key_dim=3)
    layer(QUERY, VALUE)
    twin = keras_twin(layer)
    layer.flash_attention = flash
    rows = _rows_of(mask)
    want, want_weights = twin(
        QUERY, VALUE, attention_mask=mask, return_attention_scores=True
    )
    got = layer(QUERY, VALUE, attention_mask=mask, return_attention_scores=scores)
    if scores:
        got, got_weights = got
        np.testing.assert_allclose(
            to_numpy(got_weights).transpose(0, 2, 1, 3)[rows],
            to_numpy(want_weights).transpose(0, 2, 1, 3)[rows],
            atol=1e-5,
        )
    got = to_numpy(got)
    np.testing.assert_allclose(got[rows], to_numpy(want)[rows], atol=1e-5)
    np.testing.assert_array_equal(got[~rows], 0.0)  # no key: a zero row
    if form == "query_rows_rank3":
        assert (~rows).any()
    # And with the padding masks on top, in the functional API.
    query_in, value_in = keras.Input((4, 8)), keras.Input((6, 10))
    mask_in = keras.Input(mask.shape[1:], dtype="bool", batch_size=None)
    if mask.shape[0] == 1 and mask.ndim > 2:  # a shared mask: no batch axis
        mask_in = keras.Input(batch_shape=mask.shape, dtype="bool")
    if mask.ndim == 2:
        mask_in = keras.Input(batch_shape=mask.shape, dtype="bool")
    model = keras.Model(
        [query_in, value_in, mask_in],
        layer(query_in, value_in, attention_mask=mask_in, value_mask=None),
    )
    np.testing.assert_allclose(
        to_numpy(model([QUERY, VALUE, mask]))[rows], to_numpy(want)[rows], atol=1e-5
    )


@pytest.mark.parametrize("flash", [None, True, False])
def test_a_key_padding_mask_as_keras_io_translation_passes_it(flash):
    # keras.io's English-to-Spanish Transformer: a (B, 1, T) padding mask.
    tokens = np.array([[3, 4, 5, 0, 0, 0], [7, 8, 9, 1, 2, 0]])
    padding = (tokens != 0)[:, None, :]  # (B, 1, Tk)
    layer = MultiHeadAttention(num_heads=2, key_dim=3)
    layer(QUERY, VALUE)
    want = to_numpy(keras_twin(layer)(QUERY, VALUE, attention_mask=padding))
    layer.flash_attention = flash
    got = to_numpy(layer(QUERY, VALUE, attention_mask=padding))
    np.testing.assert_allclose(got, want, atol=1e-5)
    same = to_numpy(layer(QUERY, VALUE, value_mask=tokens != 0))
    np.testing.assert_allclose(got, same, atol=1e-6)


def test_masks_keras_refuses_are_refused_with_the_shape_received():
    layer = MultiHeadAttention(num_heads=2, key_dim=3)
    keras_layer = keras.layers.MultiHeadAttention(num_heads=2, key_dim=3)
    for shape in ((2, 6), (6,), (3, 4, 6), (2, 3, 4, 6), (2, 2, 2, 4, 6)):
        mask = np.ones(shape, bool)
        try:
            keras_layer(QUERY, VALUE, attention_mask=mask)
        except Exception:  # Keras fails on it too (its error type varies)
            pass
        else:
            raise AssertionError(f"Keras takes an attention mask of {shape}")
        pattern = r"Received: attention_mask.shape=" + re.escape(str(shape))
        with pytest.raises(ValueError, match=pattern):
            layer(QUERY, VALUE, attention_mask=mask)
    # A (B, Tk) padding mask: the error says what a rank-2 mask is.
    with pytest.raises(ValueError, match=r"rank-2 mask is \(Tq, Tk\)"):
        layer(QUERY, VALUE, attention_mask=np.ones((2, 6), bool))


@pytest.mark.parametrize("scores", [False, True])
def test_causal_mask_with_attention_over_axis_one_of_higher_rank_inputs(scores):
    images = IMAGES.transpose(0, 2, 1, 3)  # (B, 5, 3, C): attend over the 5
    layer = MultiHeadAttention(num_heads=2, key_dim=3, attention_axes=(1,))
    layer(images, images)
    twin = keras_twin(layer, images, images)
    want, want_weights = twin(
        images, images, use_causal_mask=True, return_attention_scores=True
    )
    got = layer(images, images, use_causal_mask=True, return_attention_scores=scores)
    if scores:
        got, got_weights = got
        np.testing.assert_allclose(
            to_numpy(got_weights), to_numpy(want_weights), atol=1e-5
        )
        future = np.triu(np.ones((5, 5), bool), k=1)
        assert to_numpy(got_weights)[..., future].max() == 0.0
    np.testing.assert_allclose(to_numpy(got), to_numpy(want), atol=1e-5)
    # With an attention mask over the same axes, and on the blocks.
    mask = _mask((2, 3, 5, 5))  # (B, <other>, Tq, Tk)
    want = twin(images, images, use_causal_mask=True, attention_mask=mask)
    layer.flash_attention = True
    got = layer(images, images, use_causal_mask=True, attention_mask=mask)
    np.testing.assert_allclose(to_numpy(got), to_numpy(want), atol=1e-5)
    for axes in ((2,), (1, 2), None):
        other = MultiHeadAttention(num_heads=2, key_dim=3, attention_axes=axes)
        with pytest.raises(
            ValueError, match=r"attention over axis 1 alone.*use_causal_mask=True"
        ):
            other(images, images, use_causal_mask=True)


class _RecordingAttention(MultiHeadAttention):
    """Overrides `_compute_attention` with Keras's signature, as keras-hub's
    models do, and records what it gets."""

    def _compute_attention(
        self,
        query,
        key,
        value,
        attention_mask=None,
        training=None,
        return_attention_scores=False,
    ):
        self.seen = {
            "query": query,
            "mask": None if attention_mask is None else to_numpy(attention_mask),
        }
        return super()._compute_attention(
            query, key, value, attention_mask, training, return_attention_scores
        )


class _UniformAttention(MultiHeadAttention):
    """Replaces the attention by the mean of the values."""

    def _compute_attention(
        self,
        query,
        key,
        value,
        attention_mask=None,
        training=None,
        return_attention_scores=False,
    ):
        mean = keras.ops.mean(value, axis=1, keepdims=True)  # (B, 1, N, H)
        outputs = keras.ops.broadcast_to(
            mean, (*keras.ops.shape(query)[:3], value.shape[-1])
        )
        return outputs, None


def test_a_subclass_overriding_compute_attention_takes_over():
    layer = _UniformAttention(num_heads=2, key_dim=3)
    got = to_numpy(layer(QUERY, VALUE))
    values = to_numpy(layer.value_dense(VALUE)).mean(1, keepdims=True)
    want = to_numpy(layer.output_dense(np.repeat(values, 4, axis=1)))
    np.testing.assert_allclose(got, want, atol=1e-5)
    # Keras's subclass of its own layer does the same.
    base = MultiHeadAttention(num_heads=2, key_dim=3)
    base(QUERY, VALUE)
    base.set_weights(layer.get_weights())
    assert not np.allclose(to_numpy(base(QUERY, VALUE)), got, atol=1e-3)


@pytest.mark.parametrize("flash", [None, True, False])
def test_an_override_with_keras_signature_gets_every_mask_combined(flash):
    layer = _RecordingAttention(
        num_heads=2, key_dim=3, sliding_window=3, flash_attention=flash
    )
    plain = MultiHeadAttention(num_heads=2, key_dim=3, sliding_window=3)
    layer(QUERY, VALUE)
    plain(QUERY, VALUE)
    plain.set_weights(layer.get_weights())
    masks = {
        "value_mask": VALUE_MASK,
        "query_mask": QUERY_MASK,
        "attention_mask": ATTENTION_MASK_FORMS["shared_rank3"],
        "use_causal_mask": True,
    }
    got = to_numpy(layer(QUERY, VALUE, **masks))
    np.testing.assert_allclose(got, to_numpy(plain(QUERY, VALUE, **masks)), atol=1e-5)
    # Keras's form: (B, Tq, Tk), the AND of every mask; the query unscaled.
    positions = np.arange(4)[:, None], np.arange(6)[None]
    want_mask = (
        ATTENTION_MASK_FORMS["shared_rank3"]
        & VALUE_MASK[:, None, :]
        & QUERY_MASK[:, :, None]
        & (positions[1] <= positions[0])
        & (np.abs(positions[0] - positions[1]) < 3)
    )
    np.testing.assert_array_equal(layer.seen["mask"], want_mask)
    np.testing.assert_allclose(
        to_numpy(layer.seen["query"]), to_numpy(layer.query_dense(QUERY)), atol=1e-6
    )
    # Causal alone: Keras gives an override the causal mask (not None).
    layer(QUERY, VALUE, use_causal_mask=True)
    np.testing.assert_array_equal(
        layer.seen["mask"],
        ((positions[1] <= positions[0]) & (np.abs(positions[0] - positions[1]) < 3))[
            None
        ],
    )


class _CachedAttention(MultiHeadAttention):
    """keras-hub's `CachedMultiHeadAttention`, written the same way on ours:
    its own `call` (the very function) around `self._compute_attention`."""

    call = keras_hub.layers.CachedMultiHeadAttention.call


def test_keras_hub_cached_attention_written_on_ours_matches_keras_hub():
    inputs = RNG.normal(size=(2, 5, 8)).astype("float32")
    ours = _CachedAttention(num_heads=2, key_dim=4)
    hub = keras_hub.layers.CachedMultiHeadAttention(num_heads=2, key_dim=4)
    hub(inputs, inputs)
    ours.build(inputs.shape, inputs.shape)
    ours.set_weights(hub.get_weights())
    causal = np.tril(np.ones((5, 5), bool))[None].repeat(2, 0)  # (B, T, T)
    full = to_numpy(hub(inputs, inputs, attention_mask=causal))
    np.testing.assert_allclose(
        to_numpy(ours(inputs, inputs, attention_mask=causal)), full, atol=1e-5
    )
    cache = np.zeros((2, 2, 5, 2, 4), "float32")
    for index in range(5):
        step = inputs[:, index : index + 1]
        out, cache = ours(
            step,
            step,
            attention_mask=causal[:, index : index + 1],
            cache=cache,
            cache_update_index=index,
        )
        np.testing.assert_allclose(to_numpy(out)[:, 0], full[:, index], atol=1e-5)


def _seed_generators(layer):
    found = {}
    for sublayer in layer._flatten_layers(include_self=True):
        for generator in sublayer._seed_generators:
            found[id(generator)] = generator
    return list(found.values())


def _relative_paths(layer):
    # Seed generators are numbered per session ("seed_generator_3"): the name
    # without the number is Keras's.
    return [
        re.sub(r"seed_generator(_\d+)?/", "seed_generator/", w.path.split("/", 1)[1])
        for w in layer.variables
    ]


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"dropout": 0.3},
        {"dropout": 0.3, "use_bias": False, "use_gate": True, "value_dim": 5},
        {"use_gate": True, "output_shape": (2, 3)},
        {"dropout": 0.1, "attention_axes": (1, 2)},
    ],
    ids=["default", "dropout", "dropout_gate_no_bias", "gate_output_shape", "axes"],
)
def test_variables_and_seed_generators_are_keras_s(config):
    query = IMAGES if "attention_axes" in config else QUERY
    value = IMAGES if "attention_axes" in config else VALUE
    layer = MultiHeadAttention(num_heads=2, key_dim=3, seed=7, **config)
    layer(query, value, training=True)
    twin = keras.layers.MultiHeadAttention.from_config(layer.get_config())
    twin(query, value, training=True)
    assert len(layer.variables) == len(twin.variables)
    assert _relative_paths(layer) == _relative_paths(twin)
    assert len(_seed_generators(layer)) == len(_seed_generators(twin))
    assert len(_seed_generators(layer)) == (1 if config.get("dropout") else 0)
    if config.get("dropout"):
        assert _seed_generators(layer)[0] is layer._dropout_layer.seed_generator


def test_dropout_draws_from_keras_dropout_layer():
    # The explicit path draws as Keras's layer does (the same seed, the same
    # generator): equal outputs in training.
    layer = MultiHeadAttention(num_heads=2, key_dim=3, dropout=0.5, seed=3)
    twin = keras.layers.MultiHeadAttention(num_heads=2, key_dim=3, dropout=0.5, seed=3)
    layer(QUERY, VALUE)
    twin(QUERY, VALUE)
    twin.set_weights(layer.get_weights())
    got = to_numpy(layer(QUERY, VALUE, training=True, return_attention_scores=True)[0])
    want = to_numpy(twin(QUERY, VALUE, training=True, return_attention_scores=True)[0])
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert not np.allclose(got, to_numpy(layer(QUERY, VALUE)), atol=1e-3)
    # The memory-efficient path draws from the same generator.
    layer.flash_attention = True  # the blocks here (refused at construction)
    generator = layer._dropout_layer.seed_generator
    before = to_numpy(generator.state)
    first = to_numpy(layer(QUERY, VALUE, training=True))
    assert not np.array_equal(to_numpy(generator.state), before)
    second = to_numpy(layer(QUERY, VALUE, training=True))
    assert not np.allclose(first, second, atol=1e-3)  # a new draw each call
    assert _seed_generators(layer) == [generator]
