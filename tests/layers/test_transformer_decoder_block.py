import inspect
import os
import tempfile

import keras
import keras_hub
import numpy as np
import pytest
from absl.testing import parameterized
from keras import ops

from keras_attn.layers.token_and_position_embedding import TokenAndPositionEmbedding
from keras_attn.layers.transformer_decoder_block import TransformerDecoderBlock
from keras_attn.layers.transformer_encoder_block import TransformerEncoderBlock
from tests.test_case import TestCase, to_numpy

RNG = np.random.default_rng(6)
TARGET = RNG.normal(size=(2, 5, 8)).astype("float32")
SOURCE = RNG.normal(size=(2, 6, 8)).astype("float32")
TARGET_MASK = np.array([[True] * 5, [True, True, True, True, False]])
SOURCE_MASK = np.array([[True] * 6, [True, True, True, False, False, False]])
TARGET_IDS = np.array([[1, 4, 5, 6, 7], [1, 9, 2, 3, 0]], "int32")
SOURCE_IDS = np.array([[3, 4, 5, 6, 7, 8], [8, 9, 2, 0, 0, 0]], "int32")
INIT = {"num_heads": 2, "intermediate_dim": 16}


def copied_keras_hub_decoder(block, cross: bool):
    reference = keras_hub.layers.TransformerDecoder(
        intermediate_dim=block.intermediate_dim,
        num_heads=block.num_heads,
        dropout=block.dropout,
        activation=block.activation,
        layer_norm_epsilon=block.layer_norm_epsilon,
        normalize_first=block.normalize_first,
    )
    reference(TARGET, SOURCE if cross else None)
    reference.set_weights(block.get_weights())
    return reference


def built_block(cross: bool, **kwargs):
    block = TransformerDecoderBlock(**{**INIT, "dropout": 0.0, **kwargs})
    block(TARGET, SOURCE if cross else None)
    return block


def decode_step_by_step(block, target, source=None, source_mask=None, prefill=1):
    """Cached decoding: `prefill` tokens at once, then one token per call."""
    batch, length = target.shape[:2]
    cache = block.initial_cache(batch, length)
    kwargs = {}
    if source is not None:
        kwargs["cross_attention_cache"] = block.compute_cross_attention_cache(source)
        kwargs["encoder_padding_mask"] = source_mask
    steps, index = [], 0
    while index < length:
        width = prefill if index == 0 else 1
        step, cache = block(
            target[:, index : index + width],
            self_attention_cache=cache,
            cache_update_index=index,
            **kwargs,
        )
        steps.append(to_numpy(step))
        index += width
    return np.concatenate(steps, axis=1), cache


class DecodingLoop(keras.Model):
    """Decodes a whole target with `ops.while_loop` over one-token cached steps."""

    def __init__(self, block, **kwargs):
        super().__init__(**kwargs)
        self.block = block

    def call(self, inputs):
        target, source = inputs
        batch, length, dim = ops.shape(target)
        cross = self.block.compute_cross_attention_cache(source)
        cache = self.block.initial_cache(batch, length)
        outputs = ops.zeros_like(target)

        def body(index, cache, outputs):
            token = ops.slice(target, (0, index, 0), (batch, 1, dim))
            step, cache = self.block(
                token,
                self_attention_cache=cache,
                cross_attention_cache=cross,
                cache_update_index=index,
            )
            return index + 1, cache, ops.slice_update(outputs, (0, index, 0), step)

        _, _, outputs = ops.while_loop(
            lambda index, cache, outputs: index < length, body, (0, cache, outputs)
        )
        return outputs


class TinyTranslator:
    """Embeddings, an encoder block, two decoder blocks and a vocabulary head,
    with the full pass and the generation contract's cached step."""

    def __init__(self, normalize_first: bool):
        blocks = {
            "num_heads": 2,
            "intermediate_dim": 16,
            "dropout": 0.0,
            "normalize_first": normalize_first,
        }
        self.source_embedding = TokenAndPositionEmbedding(
            12, 16, 8, mask_zero=True, position="sinusoidal"
        )
        self.target_embedding = TokenAndPositionEmbedding(12, 16, 8, mask_zero=True)
        self.encoder = TransformerEncoderBlock(**blocks)
        self.decoders = [TransformerDecoderBlock(**blocks) for _ in range(2)]
        self.head = keras.layers.Dense(12)

    def encode(self, source_ids):
        return self.encoder(self.source_embedding(source_ids))

    def logits(self, target_ids, source_ids):
        encoded = self.encode(source_ids)
        x = self.target_embedding(target_ids)
        for block in self.decoders:
            x = block(x, encoded, encoder_padding_mask=source_ids != 0)
        return self.head(x)

    def initial_cache(self, source_ids, max_length):
        encoded = self.encode(source_ids)
        batch = source_ids.shape[0]
        return {
            "self": tuple(b.initial_cache(batch, max_length) for b in self.decoders),
            "cross": tuple(
                b.compute_cross_attention_cache(encoded) for b in self.decoders
            ),
            "source_mask": ops.convert_to_tensor(source_ids != 0),
        }

    def next_fn(self, token_ids, cache, index):
        """`(token_ids (B, T), cache, index) -> (logits (B, T, V), cache)`."""
        x = self.target_embedding(token_ids, start_index=index)
        new_self = []
        for block, self_cache, cross_cache in zip(
            self.decoders, cache["self"], cache["cross"], strict=True
        ):
            x, self_cache = block(
                x,
                self_attention_cache=self_cache,
                cross_attention_cache=cross_cache,
                encoder_padding_mask=cache["source_mask"],
                cache_update_index=index,
            )
            new_self.append(self_cache)
        return self.head(x), {**cache, "self": tuple(new_self)}


class TransformerDecoderBlockTest(TestCase):
    def test_layer(self):
        self.run_layer_test(
            TransformerDecoderBlock,
            INIT,
            {"decoder_sequence": TARGET},
            expected_output_shape=(2, 5, 8),
            expected_num_trainable_weights=16,
        )
        self.run_layer_test(
            TransformerDecoderBlock,
            INIT,
            {"decoder_sequence": TARGET, "encoder_sequence": SOURCE},
            expected_output_shape=(2, 5, 8),
            expected_num_trainable_weights=26,
        )
        # Outputs and a dict of weights (flattened in key order: cross, self).
        self.run_layer_test(
            TransformerDecoderBlock,
            {**INIT, "normalize_first": True, "key_dim": 3, "activation": "gelu"},
            {"decoder_sequence": TARGET, "encoder_sequence": SOURCE},
            call_kwargs={"return_attention_scores": True},
            expected_output_shape=[(2, 5, 8), (2, 2, 5, 6), (2, 2, 5, 5)],
        )

    def test_takes_keras_hub_arguments_in_keras_hub_order(self):
        for method in ("__init__", "call"):
            ours = inspect.signature(
                getattr(TransformerDecoderBlock, method)
            ).parameters
            theirs = inspect.signature(
                getattr(keras_hub.layers.TransformerDecoder, method)
            ).parameters
            names = [name for name in theirs if name != "kwargs"]
            self.assertEqual(list(ours)[: len(names)], names, method)
            for name in names:
                self.assertEqual(ours[name].default, theirs[name].default, name)
        block = TransformerDecoderBlock(16, 2)  # keras-hub's positional order
        self.assertEqual((block.intermediate_dim, block.num_heads), (16, 2))
        self.assertEqual(block.dropout, 0.0)

    @parameterized.named_parameters(("decoder_only", False), ("cross", True))
    def test_stacked_cache_calls_match_keras_hub(self, cross):
        """keras-hub's cached call (stacked caches, `*_cache_update_index`)
        returns what keras-hub's decoder returns, step by step."""
        block = built_block(cross)
        reference = copied_keras_hub_decoder(block, cross)
        source = SOURCE if cross else None
        full = to_numpy(block(TARGET, source))
        caches = {
            name: [np.zeros((2, 2, 5, 2, 4), "float32")]
            + ([np.zeros((2, 2, 6, 2, 4), "float32")] if cross else [])
            for name in ("ours", "hub")
        }
        for index in range(5):
            token = TARGET[:, index : index + 1]
            for name, layer in (("ours", block), ("hub", reference)):
                kwargs = {
                    "self_attention_cache": caches[name][0],
                    "self_attention_cache_update_index": index,
                }
                if cross:
                    kwargs["cross_attention_cache"] = caches[name][1]
                    kwargs["cross_attention_cache_update_index"] = (
                        0 if index == 0 else None
                    )
                outputs, *caches[name] = layer(token, source, **kwargs)
                caches[name] = [to_numpy(c) for c in caches[name]]
                if name == "ours":
                    step = to_numpy(outputs)
                else:
                    np.testing.assert_allclose(step, to_numpy(outputs), atol=1e-5)
            self.assertLen(caches["ours"], 2 if cross else 1)
            for got, want in zip(caches["ours"], caches["hub"], strict=True):
                np.testing.assert_allclose(got, want, atol=1e-5)
            np.testing.assert_allclose(step[:, 0], full[:, index], atol=1e-5)
        # The tuple form writes the same keys and values.
        _, (keys, values) = block(
            TARGET,
            source if not cross else None,
            **(
                {"cross_attention_cache": block.compute_cross_attention_cache(SOURCE)}
                if cross
                else {}
            ),
            self_attention_cache=block.initial_cache(2, 5),
            cache_update_index=0,
        )
        np.testing.assert_allclose(caches["ours"][0][:, 0], to_numpy(keys), atol=1e-5)
        np.testing.assert_allclose(caches["ours"][0][:, 1], to_numpy(values), atol=1e-5)

    def test_without_the_causal_mask_as_keras_hub(self):
        block = built_block(True)
        reference = copied_keras_hub_decoder(block, True)
        got = block(TARGET, SOURCE, use_causal_mask=False)
        want = reference(TARGET, SOURCE, use_causal_mask=False)
        self.assertAllClose(got, want, atol=1e-5)
        self.assertFalse(np.allclose(to_numpy(got), to_numpy(block(TARGET, SOURCE))))

    @parameterized.named_parameters(
        ("float32", "float32", 1e-5), ("mixed_bfloat16", "mixed_bfloat16", 2e-2)
    )
    def test_swapped_into_keras_hub_user_code(self, policy, tolerance):
        """A GPT-style model written with keras-hub's blocks, with its cached
        generation step as `keras_hub.models.GPT2CausalLM.call_with_cache`
        writes it, gives the same logits with keras-attn's block in place."""

        def language_model(block_class):
            token_ids = keras.Input((None,), dtype="int32")
            embedding = keras_hub.layers.TokenAndPositionEmbedding(
                vocabulary_size=12, sequence_length=8, embedding_dim=8
            )
            blocks = [
                block_class(16, 2, normalize_first=True, activation="gelu")
                for _ in range(2)
            ]
            x = embedding(token_ids)
            for block in blocks:
                x = block(x)
            head = keras.layers.Dense(12, dtype="float32")
            model = keras.Model(token_ids, head(x))

            def call_with_cache(token_ids, cache, index):
                x = embedding.token_embedding(token_ids)
                x = x + embedding.position_embedding(x, start_index=index)
                caches = []
                for i, block in enumerate(blocks):
                    x, next_cache = block(
                        x,
                        self_attention_cache=cache[:, i, ...],
                        self_attention_cache_update_index=index,
                    )
                    caches.append(next_cache)
                return head(x), ops.stack(caches, axis=1)

            return model, call_with_cache

        keras.config.set_dtype_policy(policy)
        theirs, hub_step = language_model(keras_hub.layers.TransformerDecoder)
        ours, our_step = language_model(TransformerDecoderBlock)
        ours.set_weights(theirs.get_weights())
        self.assertAllClose(
            ours(TARGET_IDS), theirs(TARGET_IDS), atol=tolerance, rtol=tolerance
        )
        full = to_numpy(ours(TARGET_IDS))
        dtype = keras.config.dtype_policy().compute_dtype
        our_cache = hub_cache = ops.zeros(
            (2, 2, 2, 5, 2, 4), dtype
        )  # (B, L, 2, T, N, H)
        for index in range(5):
            token = TARGET_IDS[:, index : index + 1]
            got, our_cache = our_step(token, our_cache, index)
            want, hub_cache = hub_step(token, hub_cache, index)
            self.assertAllClose(got, want, atol=tolerance, rtol=tolerance)
            np.testing.assert_allclose(
                to_numpy(got)[:, 0], full[:, index], atol=tolerance, rtol=tolerance
            )

    @pytest.mark.tf_only
    def test_exported_stacked_cache_step_has_no_xla_ops(self):
        """The stacked caches are written with `keras_attn.ops.update_cache`:
        the exported graph holds no `Xla*` op (stock TF Serving has no kernel
        for `XlaDynamicUpdateSlice`, which `ops.slice_update` becomes)."""
        import tensorflow as tf
        from tensorflow.core.protobuf import saved_model_pb2

        def graph_ops(graph_def):
            ops_ = {node.op for node in graph_def.node}
            for function in graph_def.library.function:
                ops_ |= {node.op for node in function.node_def}
            return ops_

        def step_function(block):
            @tf.function(
                input_signature=[
                    tf.TensorSpec((None, 1, 8)),
                    tf.TensorSpec((None, 6, 8)),
                    tf.TensorSpec((None, 2, 5, 2, 4)),
                    tf.TensorSpec((None, 2, 6, 2, 4)),
                    tf.TensorSpec((), tf.int32),
                ]
            )
            def step(token, source, cache, cross_cache, index):
                return block(
                    token,
                    source,
                    self_attention_cache=cache,
                    self_attention_cache_update_index=index,
                    cross_attention_cache=cross_cache,
                    cross_attention_cache_update_index=0,
                )

            return step

        block = built_block(True)
        # The check sees XlaDynamicUpdateSlice where it is: keras-hub's block.
        hub_ops = graph_ops(
            step_function(copied_keras_hub_decoder(block, True))
            .get_concrete_function()
            .graph.as_graph_def()
        )
        self.assertIn("XlaDynamicUpdateSlice", hub_ops)
        module = tf.Module()
        module.block = block
        module.step = step_function(block)
        with tempfile.TemporaryDirectory() as tmp:
            tf.saved_model.save(
                module, tmp, signatures={"serving_default": module.step}
            )
            saved = saved_model_pb2.SavedModel()
            with open(os.path.join(tmp, "saved_model.pb"), "rb") as file:
                saved.ParseFromString(file.read())
        exported_ops = set()
        for meta_graph in saved.meta_graphs:
            exported_ops |= graph_ops(meta_graph.graph_def)
        self.assertIn("SelectV2", exported_ops)  # the cache write
        self.assertFalse(
            {op for op in exported_ops if op.startswith("Xla")}, sorted(exported_ops)
        )

    @parameterized.named_parameters(
        ("post_norm_decoder_only", False, False),
        ("pre_norm_decoder_only", True, False),
        ("post_norm_cross", False, True),
        ("pre_norm_cross", True, True),
    )
    def test_matches_keras_hub_with_copied_weights(self, normalize_first, cross):
        block = built_block(cross, normalize_first=normalize_first, activation="gelu")
        reference = copied_keras_hub_decoder(block, cross)
        source = SOURCE if cross else None
        # Every query keeps key 0: rows with no key at all are zeros here and
        # a uniform average in Keras.
        attention_mask = RNG.uniform(size=(2, 5, 5)) > 0.3
        attention_mask[:, :, 0] = True
        cross_mask = RNG.uniform(size=(2, 5, 6)) > 0.3
        cross_mask[:, :, 0] = True
        for masks in (
            {},
            {"decoder_padding_mask": TARGET_MASK},
            {"decoder_attention_mask": attention_mask},
            *(
                [
                    {"encoder_padding_mask": SOURCE_MASK},
                    {"encoder_attention_mask": cross_mask},
                    {
                        "decoder_padding_mask": TARGET_MASK,
                        "encoder_padding_mask": SOURCE_MASK,
                    },
                ]
                if cross
                else []
            ),
        ):
            got = to_numpy(block(TARGET, source, **masks))
            want = to_numpy(reference(TARGET, source, **masks))
            # keras-hub lets padded queries attend; this block zeroes their
            # attention rows: compare the real target tokens.
            rows = (
                TARGET_MASK if "decoder_padding_mask" in masks else TARGET_MASK | True
            )
            np.testing.assert_allclose(
                got[rows], want[rows], atol=1e-5, err_msg=str(masks)
            )

    @parameterized.named_parameters(("decoder_only", False), ("cross", True))
    def test_outputs_do_not_depend_on_future_tokens(self, cross):
        block = built_block(cross)
        source = SOURCE if cross else None
        base = to_numpy(block(TARGET, source))
        for cut in (1, 3):
            changed = TARGET.copy()
            changed[:, cut:] = RNG.normal(size=changed[:, cut:].shape)
            got = to_numpy(block(changed, source))
            np.testing.assert_allclose(got[:, :cut], base[:, :cut], atol=1e-6)
            self.assertFalse(np.allclose(got[:, cut:], base[:, cut:]))
        _, scores = block(TARGET, source, return_attention_scores=True)
        weights = to_numpy(scores["self_attention"])  # (B, N, T, T)
        np.testing.assert_array_equal(np.triu(weights, k=1), 0.0)
        np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-6)

    def test_padding_masks_are_honoured(self):
        block = built_block(True)
        base, scores = block(
            TARGET,
            SOURCE,
            decoder_padding_mask=TARGET_MASK,
            encoder_padding_mask=SOURCE_MASK,
            return_attention_scores=True,
        )
        base = to_numpy(base)
        cross = to_numpy(scores["cross_attention"])  # (B, N, T, S)
        np.testing.assert_array_equal(cross[1][..., 3:], 0.0)
        np.testing.assert_allclose(cross[1, :, :4].sum(-1), 1.0, atol=1e-6)
        np.testing.assert_array_equal(cross[1, :, 4], 0.0)  # padded query row
        changed_target, changed_source = TARGET.copy(), SOURCE.copy()
        changed_target[1, 4:] = 50.0
        changed_source[1, 3:] = 50.0
        got = to_numpy(
            block(
                changed_target,
                changed_source,
                decoder_padding_mask=TARGET_MASK,
                encoder_padding_mask=SOURCE_MASK,
            )
        )
        np.testing.assert_allclose(got[TARGET_MASK], base[TARGET_MASK], atol=1e-5)
        # A row alone, without its padding, gives the same outputs.
        alone = to_numpy(block(TARGET[1:, :4], SOURCE[1:, :3]))
        np.testing.assert_allclose(base[1, :4], alone[0], atol=1e-5)

    def test_keras_masks_equal_the_explicit_masks(self):
        target_embedding = keras.layers.Embedding(12, 8, mask_zero=True)
        source_embedding = keras.layers.Embedding(12, 8, mask_zero=True)
        encoder = TransformerEncoderBlock(**INIT)
        decoder, decoder_only = (
            TransformerDecoderBlock(**INIT),
            TransformerDecoderBlock(**INIT),
        )
        target_ids = keras.Input((None,), dtype="int32")
        source_ids = keras.Input((None,), dtype="int32")
        encoded = encoder(source_embedding(source_ids))  # carries the source mask
        embedded = target_embedding(target_ids)
        model = keras.Model(
            [target_ids, source_ids],
            [decoder(embedded, encoded), decoder_only(embedded)],
        )
        got, got_decoder_only = model([TARGET_IDS, SOURCE_IDS])
        target_mask, source_mask = TARGET_IDS != 0, SOURCE_IDS != 0
        target_values = target_embedding(TARGET_IDS)
        encoded_values = encoder(source_embedding(SOURCE_IDS), padding_mask=source_mask)
        want = decoder(
            target_values,
            encoded_values,
            decoder_padding_mask=target_mask,
            encoder_padding_mask=source_mask,
        )
        self.assertAllClose(got, want, atol=1e-6)
        self.assertAllClose(
            got_decoder_only,
            decoder_only(target_values, decoder_padding_mask=target_mask),
            atol=1e-6,
        )
        # Without the masks (numpy inputs carry no Keras mask) the padded
        # tokens would change the outputs.
        unmasked = to_numpy(decoder(to_numpy(target_values), to_numpy(encoded_values)))
        self.assertFalse(np.allclose(unmasked[1, :4], to_numpy(want)[1, :4], atol=1e-4))

    @parameterized.named_parameters(
        ("post_norm_decoder_only", False, False),
        ("pre_norm_decoder_only", True, False),
        ("post_norm_cross", False, True),
        ("pre_norm_cross", True, True),
    )
    def test_cached_decoding_equals_the_full_pass(self, normalize_first, cross):
        block = built_block(cross, normalize_first=normalize_first)
        source = SOURCE if cross else None
        source_mask = SOURCE_MASK if cross else None
        full = to_numpy(block(TARGET, source, encoder_padding_mask=source_mask))
        for prefill in (1, 3):
            steps, cache = decode_step_by_step(
                block, TARGET, source, source_mask, prefill
            )
            np.testing.assert_allclose(steps, full, atol=1e-5, err_msg=f"{prefill=}")
            self.assertEqual([tuple(t.shape) for t in cache], [(2, 5, 2, 4)] * 2)

    def test_each_sequence_decodes_as_it_would_alone(self):
        block = built_block(True)
        sources = RNG.normal(size=(3, 6, 8)).astype("float32")
        lengths = [6, 2, 4]
        source_mask = np.arange(6)[None] < np.array(lengths)[:, None]
        targets = RNG.normal(size=(3, 4, 8)).astype("float32")
        batched, _ = decode_step_by_step(block, targets, sources, source_mask)
        for row, length in enumerate(lengths):
            alone, _ = decode_step_by_step(
                block, targets[row : row + 1], sources[row : row + 1, :length]
            )
            np.testing.assert_allclose(batched[row], alone[0], atol=1e-5)

    def test_cache_structure_works_in_a_compiled_while_loop(self):
        block = built_block(True)
        model = DecodingLoop(block)
        want = to_numpy(block(TARGET, SOURCE))
        self.assertAllClose(model((TARGET, SOURCE)), want, atol=1e-5)
        model.compile(jit_compile=True)
        got = model.predict((TARGET, SOURCE), verbose=0, batch_size=2)
        np.testing.assert_allclose(got, want, atol=1e-5)

    @parameterized.named_parameters(("post_norm", False), ("pre_norm", True))
    def test_language_model_logits_of_cached_steps_equal_the_full_pass(
        self, normalize_first
    ):
        model = TinyTranslator(normalize_first)
        full = to_numpy(model.logits(TARGET_IDS, SOURCE_IDS))  # (B, T, V)
        cache = model.initial_cache(SOURCE_IDS, max_length=5)
        for index in range(5):
            logits, cache = model.next_fn(
                TARGET_IDS[:, index : index + 1], cache, ops.convert_to_tensor(index)
            )
            np.testing.assert_allclose(
                to_numpy(logits)[:, 0], full[:, index], atol=1e-5, err_msg=f"{index=}"
            )

    def test_attention_scores_with_a_cache(self):
        block = built_block(True)
        cross = block.compute_cross_attention_cache(SOURCE)
        outputs, scores, cache = block(
            TARGET[:, :2],
            self_attention_cache=block.initial_cache(2, 5),
            cross_attention_cache=cross,
            encoder_padding_mask=SOURCE_MASK,
            cache_update_index=0,
            return_attention_scores=True,
        )
        self.assertEqual(tuple(outputs.shape), (2, 2, 8))
        self.assertEqual(sorted(scores), ["cross_attention", "self_attention"])
        self.assertEqual(tuple(scores["self_attention"].shape), (2, 2, 2, 5))
        self.assertEqual(tuple(scores["cross_attention"].shape), (2, 2, 2, 6))
        np.testing.assert_array_equal(to_numpy(scores["self_attention"])[..., 2:], 0.0)
        _, full_scores = block(
            TARGET,
            SOURCE,
            encoder_padding_mask=SOURCE_MASK,
            return_attention_scores=True,
        )
        self.assertAllClose(
            scores["cross_attention"],
            full_scores["cross_attention"][:, :, :2],
            atol=1e-5,
        )
        self.assertLen(cache, 2)

    def test_symbolic_decoding_step_model(self):
        block = built_block(True)
        token = keras.Input((1, 8))
        keys, values = keras.Input((5, 2, 4)), keras.Input((5, 2, 4))
        cross_keys, cross_values = keras.Input((6, 2, 4)), keras.Input((6, 2, 4))
        index = keras.Input((), dtype="int32", batch_size=1)
        outputs, (new_keys, new_values) = block(
            token,
            self_attention_cache=(keys, values),
            cross_attention_cache=(cross_keys, cross_values),
            cache_update_index=index[0],
        )
        step = keras.Model(
            [token, keys, values, cross_keys, cross_values, index],
            [outputs, new_keys, new_values],
        )
        cache = [to_numpy(t) for t in block.initial_cache(2, 5)]
        cross = [to_numpy(t) for t in block.compute_cross_attention_cache(SOURCE)]
        full = to_numpy(block(TARGET, SOURCE))
        for i in range(5):
            out, *cache = step([TARGET[:, i : i + 1], *cache, *cross, np.array([i])])
            cache = [to_numpy(t) for t in cache]
            np.testing.assert_allclose(to_numpy(out)[:, 0], full[:, i], atol=1e-5)

    def test_fully_masked_rows_are_finite_in_every_policy(self):
        for policy in ("float32", "mixed_float16", "mixed_bfloat16"):
            block = TransformerDecoderBlock(**INIT, dtype=policy)
            outputs, scores = block(
                TARGET * 100.0,
                SOURCE * 100.0,
                decoder_padding_mask=np.zeros((2, 5), bool),
                encoder_padding_mask=np.zeros((2, 6), bool),
                return_attention_scores=True,
            )
            self.assertAllFinite(ops.cast(outputs, "float32"), policy)
            for weights in scores.values():
                np.testing.assert_array_equal(
                    to_numpy(ops.cast(weights, "float32")), 0.0
                )

    def test_cache_helpers_in_mixed_precision(self):
        block = TransformerDecoderBlock(**INIT, key_dim=3, dtype="mixed_bfloat16")
        block(TARGET, SOURCE)
        keys, values = block.initial_cache(2, 7)
        self.assertEqual(tuple(keys.shape), (2, 7, 2, 3))
        self.assertEqual(keras.backend.standardize_dtype(values.dtype), "bfloat16")
        keys, values = block.initial_cache(2, 7, dtype="float32")
        self.assertEqual(keras.backend.standardize_dtype(keys.dtype), "float32")
        cross_keys, cross_values = block.compute_cross_attention_cache(SOURCE)
        self.assertEqual(tuple(cross_values.shape), (2, 6, 2, 3))
        self.assertEqual(keras.backend.standardize_dtype(cross_keys.dtype), "bfloat16")
        steps, _ = decode_step_by_step(block, TARGET, SOURCE)
        full = to_numpy(ops.cast(block(TARGET, SOURCE), "float32"))
        np.testing.assert_allclose(steps.astype("float32"), full, atol=5e-2)

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
        self.run_serialization_test(
            TransformerDecoderBlock, init, {"decoder_sequence": TARGET}
        )
        self.run_serialization_test(
            TransformerDecoderBlock,
            INIT,
            {
                "decoder_sequence": TARGET,
                "encoder_sequence": SOURCE,
                "decoder_padding_mask": TARGET_MASK,
                "encoder_padding_mask": SOURCE_MASK,
            },
            call_kwargs={"return_attention_scores": True},
        )
        self.run_precision_test(
            TransformerDecoderBlock,
            {**INIT, "dropout": 0.0},
            {"decoder_sequence": TARGET, "encoder_sequence": SOURCE},
        )

    @pytest.mark.tf_only
    # Slow: the blocks' SavedModel path is the tasks' exports (tests/export);
    # MultiHeadAttention's round trip runs by default
    @pytest.mark.slow
    def test_saved_model_round_trip(self):
        target_ids = keras.Input((None,), dtype="int32", name="target_ids")
        source_ids = keras.Input((None,), dtype="int32", name="source_ids")
        encoded = TransformerEncoderBlock(**INIT)(
            TokenAndPositionEmbedding(12, 16, 8, mask_zero=True)(source_ids)
        )
        x = TokenAndPositionEmbedding(12, 16, 8, mask_zero=True)(target_ids)
        x = TransformerDecoderBlock(**INIT)(x, encoded)
        x = TransformerDecoderBlock(**INIT, normalize_first=True)(x, encoded)
        model = keras.Model({"target_ids": target_ids, "source_ids": source_ids}, x)
        self.run_saved_model_test(
            model, {"target_ids": TARGET_IDS, "source_ids": SOURCE_IDS}
        )

    def test_bad_arguments(self):
        with self.assertRaisesRegex(ValueError, "Received: num_heads=0"):
            TransformerDecoderBlock(num_heads=0, intermediate_dim=4)
        unbuilt = TransformerDecoderBlock(**INIT)
        with self.assertRaisesRegex(ValueError, "needs a built block"):
            unbuilt.initial_cache(2, 5)
        with self.assertRaisesRegex(ValueError, "Received: kernel_initializer='nope'"):
            TransformerDecoderBlock(**INIT, kernel_initializer="nope")
        with self.assertRaisesRegex(ValueError, r"Received: dropout=1\.0"):
            TransformerDecoderBlock(**INIT, dropout=1.0)
        decoder_only = built_block(False)
        with self.assertRaisesRegex(
            ValueError,
            r"built without cross-attention.*"
            r"Received: encoder_sequence=<tensor of shape \(2, 6, 8\)>",
        ):
            decoder_only(TARGET, SOURCE)
        with self.assertRaisesRegex(ValueError, "Received: cross_attention_cache="):
            decoder_only(TARGET, cross_attention_cache=np.zeros((2, 2, 6, 2, 4)))
        with self.assertRaisesRegex(ValueError, "no cross-attention"):
            decoder_only.compute_cross_attention_cache(SOURCE)
        block = built_block(True)
        cross = block.compute_cross_attention_cache(SOURCE)
        with self.assertRaisesRegex(
            ValueError, "exactly one of.*Received: encoder_sequence=None"
        ):
            block(TARGET)
        stacked = np.zeros((2, 2, 5, 2, 4), "float32")
        with self.assertRaisesRegex(ValueError, "takes `encoder_sequence` too"):
            block(TARGET, self_attention_cache=stacked, cross_attention_cache=stacked)
        with self.assertRaisesRegex(ValueError, "both set or both None"):
            block(
                TARGET,
                SOURCE,
                self_attention_cache=stacked,
                self_attention_cache_update_index=0,
            )
        with self.assertRaisesRegex(ValueError, "one cache form per call"):
            block(
                TARGET,
                SOURCE,
                self_attention_cache=block.initial_cache(2, 5),
                cross_attention_cache=np.zeros((2, 2, 6, 2, 4), "float32"),
            )
        with self.assertRaisesRegex(
            ValueError, "index is `self_attention_cache_update_index`"
        ):
            decoder_only(TARGET, self_attention_cache=stacked, cache_update_index=0)
        with self.assertRaisesRegex(
            ValueError, "`self_attention_cache_update_index` needs a"
        ):
            decoder_only(TARGET, self_attention_cache_update_index=0)
        with self.assertRaisesRegex(ValueError, "exactly one of"):
            block(TARGET, SOURCE, cross_attention_cache=cross)
        with self.assertRaisesRegex(ValueError, "go together"):
            block(TARGET, SOURCE, self_attention_cache=block.initial_cache(2, 5))
        with self.assertRaisesRegex(ValueError, "go together"):
            block(TARGET, SOURCE, cache_update_index=0)
        with self.assertRaisesRegex(ValueError, "`encoder_sequence` must have rank 3"):
            TransformerDecoderBlock(**INIT)(TARGET, SOURCE[0])
        with self.assertRaisesRegex(ValueError, r"Received: value_mask.shape"):
            block(TARGET, SOURCE, encoder_padding_mask=np.ones((2, 5), bool))
        with self.assertRaisesRegex(
            ValueError, r"Received: encoder_padding_mask.shape=\(None, 5\)"
        ):
            block(
                keras.Input((5, 8)),
                keras.Input((6, 8)),
                encoder_padding_mask=keras.Input((5,), dtype="bool"),
            )
