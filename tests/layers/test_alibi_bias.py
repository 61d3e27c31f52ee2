import keras
import keras_hub
import numpy as np
import pytest
from absl.testing import parameterized
from keras import ops

from keras_attn.layers.alibi_bias import AlibiBias, alibi_bias, alibi_slopes
from tests.test_case import TestCase, to_numpy

SCORES = np.random.default_rng(1).normal(size=(2, 4, 3, 5)).astype("float32")


def paper_slopes(num_heads, alibi_bias_max=8):
    """Press et al. 2022, section 3, for a power-of-two number of heads `n`:
    the geometric sequence starting at `2^(-max/n)` with that ratio."""
    return 2.0 ** (-alibi_bias_max * np.arange(1, num_heads + 1) / num_heads)


def numpy_softmax(x):
    x = np.asarray(x, "float64")
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


class AlibiBiasTest(TestCase):
    def test_layer(self):
        self.run_layer_test(
            AlibiBias,
            {"alibi_bias_max": 8},
            {"attention_scores": SCORES},
            expected_output_shape=SCORES.shape,
            expected_num_trainable_weights=0,
        )

    def test_slopes_of_power_of_two_heads_follow_the_paper(self):
        np.testing.assert_array_equal(
            to_numpy(alibi_slopes(8)), [1 / 2**k for k in range(1, 9)]
        )
        for num_heads in (1, 2, 4, 8, 16, 32):
            for alibi_bias_max in (8, 4, 16, 5):
                slopes = alibi_slopes(num_heads, alibi_bias_max)
                self.assertEqual(
                    keras.backend.standardize_dtype(slopes.dtype), "float32"
                )
                np.testing.assert_allclose(
                    to_numpy(slopes),
                    paper_slopes(num_heads, alibi_bias_max),
                    rtol=1e-7,
                    err_msg=f"{num_heads} heads, alibi_bias_max={alibi_bias_max}",
                )

    def test_slopes_of_other_head_counts(self):
        # The power of two P below H, then every other slope of 2P heads.
        expected = {
            3: [2**-4, 2**-8, 2**-2],
            6: [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3],
            12: [2.0**-k for k in range(1, 9)] + [2**-0.5, 2**-1.5, 2**-2.5, 2**-3.5],
        }
        for num_heads, slopes in expected.items():
            np.testing.assert_allclose(
                to_numpy(alibi_slopes(num_heads)), slopes, rtol=1e-7
            )

    def test_layer_adds_the_bias_of_the_key_distance_to_the_last_key(self):
        scores = np.zeros((1, 8, 2, 6), "float32")
        bias = to_numpy(AlibiBias()(scores))
        keys = np.arange(6)
        expected = paper_slopes(8)[:, None] * (keys - 5)[None, :]  # (H, Tk)
        for query in range(2):
            np.testing.assert_allclose(bias[0, :, query], expected, rtol=1e-7)

    @parameterized.named_parameters(
        ("float32", "float32", "float32"),
        ("mixed_bfloat16", "mixed_bfloat16", "float32"),
        ("bfloat16", "bfloat16", "float32"),
        ("bfloat16_inputs", "float32", "bfloat16"),
    )
    def test_matches_keras_hub(self, policy, input_dtype):
        rng = np.random.default_rng(2)
        # 300 keys: past 256, where bfloat16 no longer holds every integer.
        for num_heads in (1, 2, 3, 4, 8, 12):
            for alibi_bias_max in (8, 4, 16, 5):
                scores = ops.cast(
                    rng.normal(size=(2, num_heads, 3, 300)).astype("float32"),
                    input_dtype,
                )
                got = AlibiBias(alibi_bias_max, dtype=policy)(scores)
                want = keras_hub.layers.AlibiBias(alibi_bias_max, dtype=policy)(scores)
                self.assertEqual(
                    keras.backend.standardize_dtype(got.dtype),
                    keras.backend.standardize_dtype(want.dtype),
                )
                np.testing.assert_array_equal(
                    to_numpy(ops.cast(got, "float32")),
                    to_numpy(ops.cast(want, "float32")),
                    err_msg=f"{policy}, {num_heads} heads, max {alibi_bias_max}",
                )

    def test_unknown_batch_and_lengths(self):
        inputs = keras.Input((4, None, None))
        model = keras.Model(inputs, AlibiBias(alibi_bias_max=6)(inputs))
        reference = keras_hub.layers.AlibiBias(alibi_bias_max=6)
        for shape in ((1, 4, 3, 7), (3, 4, 1, 2)):
            scores = np.random.default_rng(3).normal(size=shape).astype("float32")
            self.assertAllClose(model(scores), reference(scores), atol=0, rtol=0)

    def test_alibi_bias_of_a_block(self):
        slopes = np.array([0.5, 0.25, 0.125], "float32")
        keys = np.array([4, 5, 6, 7], "int32")
        key_only = to_numpy(alibi_bias(slopes, keys))
        self.assertEqual(key_only.shape, (3, 1, 4))
        np.testing.assert_array_equal(key_only[:, 0], slopes[:, None] * keys)
        queries = np.array([5, 9], "int32")
        relative = to_numpy(alibi_bias(slopes, keys, query_positions=queries))
        self.assertEqual(relative.shape, (3, 2, 4))
        np.testing.assert_array_equal(
            relative, slopes[:, None, None] * (keys[None, None, :] - queries[:, None])
        )
        one_query = to_numpy(alibi_bias(slopes, keys, query_positions=7))
        np.testing.assert_array_equal(one_query, slopes[:, None, None] * (keys - 7))
        half = alibi_bias(ops.cast(slopes, "bfloat16"), keys)
        self.assertEqual(keras.backend.standardize_dtype(half.dtype), "bfloat16")

    @parameterized.named_parameters(("4_heads", 4), ("12_heads", 12))
    def test_blockwise_bias_gives_the_layers_softmax(self, num_heads):
        rng = np.random.default_rng(4)
        scores = rng.normal(size=(2, num_heads, 5, 10)).astype("float32")
        want = numpy_softmax(to_numpy(AlibiBias()(scores)))
        slopes = alibi_slopes(num_heads)
        bounds = ((0, 4), (4, 8), (8, 10))  # key blocks of 4, the last one short

        def blockwise(query_positions=None, mask=None):
            blocks = []
            for start, stop in bounds:
                bias = alibi_bias(
                    slopes, np.arange(start, stop), query_positions=query_positions
                )
                blocks.append(scores[..., start:stop] + to_numpy(bias)[None])
            logits = np.concatenate(blocks, axis=-1)
            return numpy_softmax(
                logits if mask is None else np.where(mask, logits, -1e9)
            )

        np.testing.assert_allclose(blockwise(), want, atol=1e-6)
        # The relative form slope * (key - query) gives the same weights.
        np.testing.assert_allclose(blockwise(np.arange(5)), want, atol=1e-6)
        # With a causal mask (queries at positions 5..9), as in the paper.
        causal = np.arange(10)[None, :] <= np.arange(5, 10)[:, None]
        masked = numpy_softmax(np.where(causal, to_numpy(AlibiBias()(scores)), -1e9))
        np.testing.assert_allclose(
            blockwise(np.arange(5, 10), mask=causal), masked, atol=1e-6
        )

    def test_config_round_trip_with_keras_hub(self):
        ours = AlibiBias(alibi_bias_max=5, name="alibi")
        theirs = keras_hub.layers.AlibiBias(alibi_bias_max=5, name="alibi")
        self.assertEqual(ours.get_config(), theirs.get_config())
        from_ours = keras_hub.layers.AlibiBias.from_config(ours.get_config())
        from_theirs = AlibiBias.from_config(theirs.get_config())
        self.assertEqual(from_ours.alibi_bias_max, 5)
        self.assertEqual(from_theirs.alibi_bias_max, 5)
        self.assertAllClose(from_ours(SCORES), ours(SCORES), atol=0, rtol=0)
        self.assertAllClose(from_theirs(SCORES), theirs(SCORES), atol=0, rtol=0)

    def test_serialization_and_precision(self):
        init = {"alibi_bias_max": 4}
        data = {"attention_scores": SCORES}
        self.run_serialization_test(AlibiBias, init, data)
        self.run_precision_test(AlibiBias, init, data)
        self.assertEqual(
            keras.saving.get_registered_name(AlibiBias), "keras_attn>AlibiBias"
        )

    @pytest.mark.tf_only
    def test_saved_model_round_trip(self):
        inputs = keras.Input((4, 3, 5), name="scores")
        outputs = AlibiBias()(inputs)
        self.run_saved_model_test(keras.Model(inputs, outputs), SCORES)

    def test_bad_arguments(self):
        for value in (0, -1, 0.0, None, "8", True, float("inf")):
            with self.assertRaisesRegex(ValueError, "Received: alibi_bias_max="):
                AlibiBias(alibi_bias_max=value)
            with self.assertRaisesRegex(ValueError, "Received: alibi_bias_max="):
                alibi_slopes(4, alibi_bias_max=value)
        with self.assertRaisesRegex(ValueError, "`attention_scores` must have rank 4"):
            AlibiBias()(SCORES[0])
        with self.assertRaisesRegex(ValueError, "Received: attention_scores.shape="):
            AlibiBias()(SCORES[..., None])
        with self.assertRaisesRegex(ValueError, "number of heads"):
            AlibiBias()(keras.Input((None, 3, 5)))
        with self.assertRaisesRegex(ValueError, "Received: num_heads=0"):
            alibi_slopes(0)
        slopes = alibi_slopes(4)
        with self.assertRaisesRegex(ValueError, "`key_positions` must hold integers"):
            alibi_bias(slopes, np.arange(3, dtype="float32"))
        with self.assertRaisesRegex(ValueError, "`key_positions` must have rank 1"):
            alibi_bias(slopes, np.zeros((2, 3), "int32"))
        with self.assertRaisesRegex(ValueError, "`query_positions` must have rank"):
            alibi_bias(slopes, np.arange(3), query_positions=np.zeros((2, 3), "int32"))
        with self.assertRaisesRegex(ValueError, "`slopes` must have rank 1"):
            alibi_bias(ops.reshape(slopes, (2, 2)), np.arange(3))
