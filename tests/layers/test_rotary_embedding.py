import inspect
import json
import math

import keras
import keras_hub
import numpy as np
import pytest
from absl.testing import parameterized
from keras import ops

from keras_attn.layers.rotary_embedding import RotaryEmbedding
from tests.test_case import TestCase, outputs_and_gradients, to_numpy

RNG = np.random.default_rng(3)
INPUTS = RNG.normal(size=(2, 6, 3, 16)).astype("float32")  # (batch, T, heads, d)
POSITIONS_2D = np.array([[0, 4, 5, 9, 17, 40], [31, 30, 2, 7, 7, 63]])

# The arguments of each scaling, with values away from the defaults.
ROPE_CONFIGS = (
    ("linear", {}),
    ("linear_scaled", {"scaling_factor": 4.0, "max_wavelength": 500}),
    ("dynamic", {"rope_type": "dynamic", "scaling_factor": 2.5}),
    (
        "yarn",
        {
            "rope_type": "yarn",
            "scaling_factor": 8.0,
            "original_max_position_embeddings": 64,
        },
    ),
    (
        "yarn_betas_no_truncate",
        {
            "rope_type": "yarn",
            "scaling_factor": 4.0,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "original_max_position_embeddings": 128,
            "truncate": False,
        },
    ),
    ("denominator_dim", {"denominator_dim": 24, "scaling_factor": 2.0}),
)


# -- an independent float64 reference ------------------------------------------


def reference_frequencies(
    dim,
    max_wavelength=10000,
    scaling_factor=1.0,
    rope_type="linear",
    beta_fast=32.0,
    beta_slow=1.0,
    original_max_position_embeddings=4096,
    truncate=True,
    denominator_dim=None,
):
    """The `d/2` angular frequencies and the cos/sin factor, pair by pair.

    RoFormer: `theta_k = base^(-2k/d)`. Linear: `theta_k / s`. keras-hub's
    "dynamic": `theta_k / s^(d/(d-2))`. YaRN: pair `k` has the wavelength
    `2 pi base^(2k/d)`, which fits `L / (2 pi base^(2k/d))` times into the
    original context `L`; the pair that fits `b` times is
    `k(b) = d ln(L / (2 pi b)) / (2 ln base)`. Pairs below `k(beta_fast)` keep
    `theta_k`, pairs above `k(beta_slow)` get `theta_k / s`, a linear ramp in
    `k` between; cos and sin are scaled by `0.1 ln s + 1`.
    """
    half = dim // 2
    if rope_type == "yarn":

        def pair_fitting(rotations):
            return (
                dim
                * math.log(original_max_position_embeddings / (2 * math.pi * rotations))
                / (2 * math.log(max_wavelength))
            )

        low, high = pair_fitting(beta_fast), pair_fitting(beta_slow)
        if truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        frequencies = []
        for k in range(half):
            theta = max_wavelength ** (-2.0 * k / dim)
            interpolated = min(max((k - low) / max(high - low, 0.001), 0.0), 1.0)
            frequencies.append(
                theta * (1 - interpolated) + theta / scaling_factor * interpolated
            )
        return np.array(frequencies), 0.1 * math.log(scaling_factor) + 1
    denominator = denominator_dim or dim
    theta = np.array([max_wavelength ** (-2.0 * k / denominator) for k in range(half)])
    if rope_type == "linear":
        return theta / scaling_factor, 1.0
    return theta / scaling_factor ** (dim / (dim - 2)), 1.0


def reference_rope(x, positions, frequencies, factor=1.0):
    """RoPE of `x` `(batch, T, ..., d)` at `positions` `(T,)` or `(batch, T)`,
    in float64: the pair `(x_k, x_{k+d/2})` as the complex number
    `x_k + i x_{k+d/2}`, multiplied by `factor * exp(i t theta_k)`."""
    x = np.asarray(x, dtype="float64")
    half = x.shape[-1] // 2
    pairs = x[..., :half] + 1j * x[..., half:]
    positions = np.asarray(positions, dtype="float64")
    positions = np.broadcast_to(positions, (x.shape[0], x.shape[1]))
    angles = positions[:, :, None] * frequencies  # (batch, T, d/2)
    angles = angles.reshape(angles.shape[:2] + (1,) * (x.ndim - 3) + (half,))
    rotated = pairs * factor * np.exp(1j * angles)
    return np.concatenate([rotated.real, rotated.imag], axis=-1)


def reference(x, positions, sequence_axis=1, feature_axis=-1, **config):
    """`reference_rope` for any layout: the sequence axis to 1, the features
    last (the first remaining axis is then the batch)."""
    frequencies, factor = reference_frequencies(x.shape[feature_axis], **config)
    moved = np.moveaxis(x, (sequence_axis, feature_axis), (1, -1))
    out = reference_rope(moved, positions, frequencies, factor)
    return np.moveaxis(out, (1, -1), (sequence_axis, feature_axis))


def bfloat16_rounded(x):
    return to_numpy(ops.cast(ops.cast(x, "bfloat16"), "float32"))


def compiled(fn):
    """`fn` compiled by XLA (`tf.function(jit_compile=True)` / `jax.jit`); on
    PyTorch, which has no XLA, `fn` itself (a tensor start index, eagerly)."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.function(fn, jit_compile=True)
    if keras.backend.backend() == "torch":
        return fn
    import jax

    return jax.jit(fn)


class RotaryEmbeddingTest(TestCase):
    @parameterized.named_parameters(
        ("heads", INPUTS, {}),
        ("rank_3", INPUTS[:, :, 0], {}),
        ("start_index", INPUTS, {"start_index": 5}),
    )
    def test_layer(self, inputs, call_kwargs):
        self.run_layer_test(
            RotaryEmbedding,
            {"rope_type": "yarn", "scaling_factor": 4.0},
            {"inputs": inputs},
            expected_output_shape=inputs.shape,
            call_kwargs=call_kwargs,
            expected_num_trainable_weights=0,
        )

    def test_signature_and_config_keys_are_keras_hub(self):
        ours = inspect.signature(RotaryEmbedding.__init__).parameters
        theirs = inspect.signature(keras_hub.layers.RotaryEmbedding.__init__).parameters
        self.assertEqual(
            [(p.name, p.default) for p in ours.values()],
            [(p.name, p.default) for p in theirs.values()],
        )
        ours = RotaryEmbedding(name="rope").get_config()
        theirs = keras_hub.layers.RotaryEmbedding(name="rope").get_config()
        self.assertEqual(ours, theirs)

    @parameterized.named_parameters(*ROPE_CONFIGS)
    def test_matches_the_float64_reference(self, config):
        # Small positions, then positions up to 4096.
        self.assertAllClose(
            RotaryEmbedding(**config)(INPUTS),
            reference(INPUTS, np.arange(6), **config),
            atol=1e-5,
            rtol=1e-5,
        )
        self.assertAllClose(
            RotaryEmbedding(**config)(INPUTS, start_index=4091),
            reference(INPUTS, np.arange(4091, 4097), **config),
            atol=2e-3,
            rtol=0,
        )

    @parameterized.named_parameters(
        (f"{name}_{call}", config, call)
        for name, config in ROPE_CONFIGS
        for call in (
            "none",
            "start_index",
            "start_index_tensor",
            "positions_rank_1",
            "positions_rank_2",
        )
    )
    def test_matches_keras_hub(self, config, call):
        call_kwargs = {
            "none": {},
            "start_index": {"start_index": 7},
            "start_index_tensor": {"start_index": ops.convert_to_tensor(7, "int32")},
            "positions_rank_1": {"positions": POSITIONS_2D[1]},
            "positions_rank_2": {"positions": POSITIONS_2D},
        }[call]
        expected = keras_hub.layers.RotaryEmbedding(**config)(INPUTS, **call_kwargs)
        self.assertAllClose(
            RotaryEmbedding(**config)(INPUTS, **call_kwargs),
            expected,
            atol=5e-5,
            rtol=1e-5,
        )
        # And keras-hub is the formula (the reference is not off on its own).
        positions = {
            "none": np.arange(6),
            "start_index": np.arange(7, 13),
            "start_index_tensor": np.arange(7, 13),
            "positions_rank_1": POSITIONS_2D[1],
            "positions_rank_2": POSITIONS_2D,
        }[call]
        self.assertAllClose(
            expected, reference(INPUTS, positions, **config), atol=5e-5, rtol=1e-5
        )

    @parameterized.named_parameters(
        ("heads_before_sequence", (2, 3, 6, 16), 2, -1),  # (batch, heads, T, d)
        ("features_before_sequence", (2, 16, 6), 2, 1),  # (batch, d, T)
        ("sequence_first", (6, 2, 16), 0, 2),  # (T, batch, d)
        ("negative_axes", (2, 6, 3, 16), -3, -1),
        ("features_first", (16, 2, 3, 6), 3, 0),  # (d, batch, heads, T)
    )
    def test_sequence_and_feature_axes(self, shape, sequence_axis, feature_axis):
        x = RNG.normal(size=shape).astype("float32")
        axes = {"sequence_axis": sequence_axis, "feature_axis": feature_axis}
        config = {"rope_type": "yarn", "scaling_factor": 4.0, **axes}
        # Every layout has a batch of 2 on its first other axis.
        positions = RNG.integers(0, 50, size=(2, 6))
        for call_kwargs, at in (
            ({"start_index": 3}, np.arange(3, 9)),
            ({"positions": positions}, positions),
        ):
            out = RotaryEmbedding(**config)(x, **call_kwargs)
            self.assertEqual(tuple(out.shape), shape)
            self.assertAllClose(out, reference(x, at, **config), atol=2e-5, rtol=1e-5)
            self.assertAllClose(
                out,
                keras_hub.layers.RotaryEmbedding(**config)(x, **call_kwargs),
                atol=2e-5,
                rtol=1e-5,
            )

    @parameterized.named_parameters(
        ("mixed_bfloat16", "mixed_bfloat16"), ("bfloat16", "bfloat16")
    )
    def test_bfloat16_angles_are_float32(self, policy):
        # At positions near 4096, bfloat16 steps by 16: angles computed in it
        # would be off by up to 8 radians. In float32 they err by < 3e-4, and
        # the outputs are within a few bfloat16 roundings of the exact values.
        x = RNG.normal(size=(2, 5, 2, 32)).astype("float32")
        bound = 4 * 2**-9 * 2 * np.abs(x).max()  # 4 roundings of |x1|+|x2|
        positions = np.array([4000, 4001, 4091, 4093, 4095])
        float_positions = positions + np.float32(0.25)
        for name, config in ROPE_CONFIGS:
            layer = RotaryEmbedding(**config, dtype=policy)
            for call_kwargs, at in (
                ({"start_index": 4091}, np.arange(4091, 4096)),
                ({"positions": positions}, positions),
                ({"positions": float_positions.astype("float32")}, float_positions),
                (
                    {"start_index": ops.convert_to_tensor(4090.5, "float32")},
                    np.arange(5) + 4090.5,
                ),
            ):
                out = layer(x, **call_kwargs)
                self.assertEqual(keras.backend.standardize_dtype(out.dtype), "bfloat16")
                expected = reference(bfloat16_rounded(x), at, **config)
                self.assertAllClose(
                    ops.cast(out, "float32"), expected, atol=bound, rtol=0, msg=name
                )
                # The check has teeth: bfloat16 positions miss by far more.
                wrong = reference(bfloat16_rounded(x), bfloat16_rounded(at), **config)
                self.assertGreater(np.abs(wrong - expected).max(), 4 * bound)

    @parameterized.named_parameters(*ROPE_CONFIGS)
    def test_mixed_bfloat16_matches_keras_hub_within_rounding(self, config):
        # The same up to one bfloat16 rounding (keras-hub rounds YaRN's factor
        # and the cosines to bfloat16 before multiplying them).
        bound = 2 * 2**-8 * 2 * np.abs(INPUTS).max()
        for call_kwargs in ({}, {"start_index": 1000}, {"positions": POSITIONS_2D}):
            ours = RotaryEmbedding(**config, dtype="mixed_bfloat16")(
                INPUTS, **call_kwargs
            )
            theirs = keras_hub.layers.RotaryEmbedding(**config, dtype="mixed_bfloat16")(
                INPUTS, **call_kwargs
            )
            self.assertEqual(ours.dtype, theirs.dtype)
            self.assertAllClose(
                ops.cast(ours, "float32"),
                ops.cast(theirs, "float32"),
                atol=bound,
                rtol=0,
            )

    def test_start_index_tensor_under_xla(self):
        layer = RotaryEmbedding(rope_type="dynamic", scaling_factor=2.0)
        step = compiled(lambda x, start: layer(x, start_index=start))
        for start in (0, 9, 300):
            self.assertAllClose(
                step(INPUTS[:, :2], ops.convert_to_tensor(start, "int32")),
                reference(
                    INPUTS[:, :2],
                    np.arange(start, start + 2),
                    rope_type="dynamic",
                    scaling_factor=2.0,
                ),
                atol=1e-4,
                rtol=1e-5,
            )

    @parameterized.named_parameters(*ROPE_CONFIGS)
    def test_gradient_is_the_inverse_rotation(self, config):
        # RoPE is `factor * R(t)`, R orthogonal: the gradient of
        # `sum(out * g)` is `factor * R(-t) g`, the layer at negated positions.
        layer = RotaryEmbedding(**config)
        cotangent = RNG.normal(size=INPUTS.shape).astype("float32")
        _, (grad,) = outputs_and_gradients(
            lambda x: layer(x, start_index=3), [INPUTS], cotangent, jit=True
        )
        self.assertAllClose(
            grad,
            layer(cotangent, positions=-np.arange(3, 9)),
            atol=1e-5,
            rtol=1e-5,
        )

    def test_scores_depend_on_relative_positions(self):
        layer = RotaryEmbedding()
        query, key = INPUTS, RNG.normal(size=INPUTS.shape).astype("float32")

        def scores(start):
            q = layer(query, start_index=start)
            k = layer(key, start_index=start)
            return ops.einsum("bqhd,bkhd->bhqk", q, k)

        self.assertAllClose(scores(37), scores(0), atol=1e-4, rtol=1e-4)
        self.assertGreater(
            np.abs(
                to_numpy(scores(0)) - np.einsum("bqhd,bkhd->bhqk", query, key)
            ).max(),
            0.1,
        )

    def test_yarn_keeps_fast_pairs_and_interpolates_slow_pairs(self):
        # d=16, base 10000, L=64: k(32) = -0.99 -> 0, k(1) = 2.02 -> 3. Pair 0
        # keeps frequency 1; pairs 3..7 get base^(-2k/16) / 8; all * 1.2079.
        layer = RotaryEmbedding(
            rope_type="yarn", scaling_factor=8.0, original_max_position_embeddings=64
        )
        x = np.zeros((1, 1, 16), "float32")
        x[..., :8] = 1.0
        out = to_numpy(layer(x, start_index=100))[0, 0]
        factor = 0.1 * math.log(8.0) + 1
        for k, frequency in (
            (0, 1.0),
            (3, 10000 ** (-6 / 16) / 8),
            (7, 1e4**-0.875 / 8),
        ):
            self.assertAlmostEqual(out[k], factor * math.cos(100 * frequency), 4)
            self.assertAlmostEqual(out[k + 8], factor * math.sin(100 * frequency), 4)

    def test_dynamic_sequence_length_and_positions_input(self):
        x = keras.Input((None, 3, 16))
        positions = keras.Input((None,), dtype="int32")
        layer = RotaryEmbedding(scaling_factor=2.0)
        model = keras.Model([x, positions], layer(x, positions=positions))
        for length in (2, 6):
            at = POSITIONS_2D[:, :length]
            self.assertAllClose(
                model([INPUTS[:, :length], at]),
                reference(INPUTS[:, :length], at, scaling_factor=2.0),
                atol=2e-5,
                rtol=1e-5,
            )

    @parameterized.named_parameters(*ROPE_CONFIGS)
    def test_config_round_trip_with_keras_hub(self, config):
        config = {**config, "sequence_axis": -3, "dtype": "mixed_bfloat16"}
        for source_cls, target_cls in (
            (keras_hub.layers.RotaryEmbedding, RotaryEmbedding),
            (RotaryEmbedding, keras_hub.layers.RotaryEmbedding),
        ):
            source = source_cls(**config)
            target = target_cls.from_config(source.get_config())
            self.assertIsInstance(target, target_cls)
            self.assertEqual(
                json.dumps(target.get_config(), sort_keys=True),
                json.dumps(source.get_config(), sort_keys=True),
            )
            self.assertAllClose(
                ops.cast(target(INPUTS, start_index=3), "float32"),
                ops.cast(source(INPUTS, start_index=3), "float32"),
                atol=2 * 2**-8 * 2 * np.abs(INPUTS).max(),
                rtol=0,
            )

    def test_serialization_and_precision(self):
        init = {
            "rope_type": "yarn",
            "scaling_factor": 4.0,
            "beta_fast": 16.0,
            "original_max_position_embeddings": 128,
            "truncate": False,
            "sequence_axis": 2,
        }
        inputs = {"inputs": np.swapaxes(INPUTS, 1, 2)}  # (batch, heads, T, d)
        self.run_serialization_test(
            RotaryEmbedding, init, inputs, call_kwargs={"start_index": 3}
        )
        self.run_precision_test(RotaryEmbedding, init, inputs)
        config = keras.saving.serialize_keras_object(RotaryEmbedding(**init))
        self.assertEqual(config["registered_name"], "keras_attn>RotaryEmbedding")

    @pytest.mark.tf_only
    def test_saved_model_round_trip(self):
        inputs = keras.Input((6, 3, 16), name="inputs")
        outputs = RotaryEmbedding(rope_type="yarn", scaling_factor=4.0)(inputs)
        self.run_saved_model_test(keras.Model(inputs, outputs), INPUTS)

    def test_keras_mask_is_passed_on(self):
        # A masked mean after the layer averages the unmasked steps only.
        x = RNG.normal(size=(1, 3, 4)).astype("float32")
        x[0, 2] = 0.0
        inputs = keras.Input((3, 4))
        rotated = RotaryEmbedding()(keras.layers.Masking()(inputs))
        pooled = keras.layers.GlobalAveragePooling1D()(rotated)
        model = keras.Model(inputs, [rotated, pooled])
        rotated, pooled = model(x)
        self.assertAllClose(pooled, to_numpy(rotated)[:, :2].mean(axis=1), atol=1e-6)

    def test_bad_arguments(self):
        for name, values in (
            ("max_wavelength", (0, -1.0, "10000", None, float("inf"))),
            ("scaling_factor", (0.0, -2.0, None, True)),
            ("beta_fast", (0.0, -1.0)),
            ("beta_slow", (0, None)),
            ("original_max_position_embeddings", (0, 2.5, None)),
            ("denominator_dim", (0, 16.0)),
        ):
            for value in values:
                with self.assertRaisesRegex(
                    ValueError, f"`{name}` must be a positive .*Received: {name}="
                ):
                    RotaryEmbedding(**{name: value})
        for rope_type in ("ntk", "default", None):
            with self.assertRaisesRegex(
                ValueError,
                r"`rope_type` must be one of \['linear', 'dynamic', 'yarn'\]. "
                f"Received: rope_type={rope_type!r}",
            ):
                RotaryEmbedding(rope_type=rope_type)
        with self.assertRaisesRegex(ValueError, "Received: truncate='yes'"):
            RotaryEmbedding(truncate="yes")
        with self.assertRaisesRegex(ValueError, "Received: sequence_axis=1.0"):
            RotaryEmbedding(sequence_axis=1.0)
        with self.assertRaisesRegex(ValueError, "Received: feature_axis=None"):
            RotaryEmbedding(feature_axis=None)
        with self.assertRaisesRegex(
            ValueError, "more than 1 for rope_type='yarn'.*Received: max_wavelength=1"
        ):
            RotaryEmbedding(rope_type="yarn", max_wavelength=1)

    def test_bad_inputs(self):
        layer = RotaryEmbedding()
        with self.assertRaisesRegex(
            ValueError, r"known, even size.*Received: inputs.shape=\(2, 6, 3, 15\)"
        ):
            layer(INPUTS[..., :15])
        with self.assertRaisesRegex(
            ValueError, r"known, even size.*Received: inputs.shape=\(None, 6, None\)"
        ):
            layer(keras.Input((6, None)))
        with self.assertRaisesRegex(
            ValueError, r"even size.*inputs.shape=\(2, 15, 6\), feature_axis=1"
        ):
            RotaryEmbedding(sequence_axis=2, feature_axis=1)(
                np.swapaxes(INPUTS[:, :, 0, :15], 1, 2)
            )
        with self.assertRaisesRegex(ValueError, r"rank 3 or more.*\(6, 16\)"):
            layer(INPUTS[0, :, 0])
        with self.assertRaisesRegex(
            ValueError, "`sequence_axis` is out of range.*Received: sequence_axis=4"
        ):
            RotaryEmbedding(sequence_axis=4)(INPUTS)
        with self.assertRaisesRegex(
            ValueError, "`feature_axis` is out of range.*Received: feature_axis=-5"
        ):
            RotaryEmbedding(feature_axis=-5)(INPUTS)
        with self.assertRaisesRegex(
            ValueError, "must be different.*sequence_axis=3, feature_axis=-1"
        ):
            RotaryEmbedding(sequence_axis=3)(INPUTS)
        with self.assertRaisesRegex(
            ValueError, r"`positions` must have rank 1 or 2.*\(2, 6, 1\)"
        ):
            layer(INPUTS, positions=POSITIONS_2D[..., None])
        with self.assertRaisesRegex(
            ValueError, r"size of the sequence axis.*positions.shape=\(2, 3\)"
        ):
            layer(INPUTS, positions=POSITIONS_2D[:, :3])
