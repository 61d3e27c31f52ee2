import keras
import numpy as np
from keras import ops

from keras_attn.layers import (
    BahdanauAttention,
    BahdanauDecoder,
    LuongAttention,
    MultiHeadAttention,
)
from tests.test_case import TestCase, to_numpy

RNG = np.random.default_rng(4)
INPUTS = RNG.normal(size=(2, 4, 3)).astype("float32")  # (B, T, E)
MEMORY = RNG.normal(size=(2, 5, 6)).astype("float32")  # (B, S, dm)
STATE = RNG.normal(size=(2, 8)).astype("float32")  # (B, units)
MEMORY_MASK = np.array([[True] * 5, [True, True, True, False, False]])


def lstm_luong(**kwargs):
    return BahdanauDecoder(
        keras.layers.LSTMCell(8), LuongAttention(score="general"), **kwargs
    )


def gru_multi_head(**kwargs):
    return BahdanauDecoder(
        keras.layers.GRUCell(8), MultiHeadAttention(num_heads=2, key_dim=4), **kwargs
    )


def numpy_gru(x, h, kernel, recurrent, bias):
    """Keras' GRUCell (reset_after=True) in NumPy."""
    sigmoid = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
    units = h.shape[-1]
    inner = x @ kernel + bias[0]
    recurrent_inner = h @ recurrent + bias[1]
    z = sigmoid(inner[:, :units] + recurrent_inner[:, :units])
    r = sigmoid(inner[:, units : 2 * units] + recurrent_inner[:, units : 2 * units])
    candidate = np.tanh(inner[:, 2 * units :] + r * recurrent_inner[:, 2 * units :])
    return z * h + (1 - z) * candidate


class BahdanauDecoderTest(TestCase):
    def test_layer_gru_and_additive_attention(self):
        self.run_layer_test(
            BahdanauDecoder,
            {"cell": 8},
            {"inputs": INPUTS, "memory": MEMORY, "initial_state": STATE},
            expected_output_shape=(2, 4, 8 + 6),
        )

    def test_layer_lstm_and_luong_attention_with_weights(self):
        self.run_layer_test(
            lstm_luong,
            {},
            {"inputs": INPUTS, "memory": MEMORY},
            expected_output_shape=[(2, 4, 8 + 6), (2, 4, 5)],
            call_kwargs={"return_attention_scores": True},
        )

    def test_layer_multi_head_attention(self):
        self.run_layer_test(
            gru_multi_head,
            {},
            {"inputs": INPUTS, "memory": MEMORY},
            expected_output_shape=[(2, 4, 8 + 8), (2, 4, 5)],
            call_kwargs={"return_attention_scores": True},
        )

    def test_serialization(self):
        self.run_serialization_test(
            BahdanauDecoder,
            {"cell": 8, "attention": BahdanauAttention(5)},
            {"inputs": INPUTS, "memory": MEMORY, "initial_state": STATE},
        )

    def test_precision(self):
        self.run_precision_test(
            BahdanauDecoder,
            {"cell": 8},
            {"inputs": INPUTS, "memory": MEMORY, "initial_state": STATE},
        )

    def test_equals_the_paper_equations_step_by_step(self):
        decoder = BahdanauDecoder(8, BahdanauAttention(7))
        outputs, weights = decoder(
            INPUTS, MEMORY, STATE, MEMORY_MASK, return_attention_scores=True
        )
        w_q, w_k, v = (to_numpy(w) for w in decoder.attention.weights)
        kernel, recurrent, bias = (to_numpy(w) for w in decoder.cell.weights)
        state = STATE.astype("float64")
        for step in range(INPUTS.shape[1]):
            # c_i from s_{i-1}, masked softmax over the memory.
            scores = np.einsum(
                "bsu,u->bs",
                np.tanh((state @ w_q)[:, None] + MEMORY @ w_k),
                v,
            )
            scores = np.where(MEMORY_MASK, scores, -np.inf)
            expected_weights = np.exp(scores - scores.max(-1, keepdims=True))
            expected_weights /= expected_weights.sum(-1, keepdims=True)
            context = np.einsum("bs,bsd->bd", expected_weights, MEMORY)
            # s_i = GRU([y_{i-1}; c_i], s_{i-1}); the output is [s_i; c_i].
            state = numpy_gru(
                np.concatenate([INPUTS[:, step], context], -1),
                state,
                kernel,
                recurrent,
                bias,
            )
            self.assertAllClose(
                to_numpy(weights)[:, step], expected_weights, atol=1e-5, rtol=1e-5
            )
            self.assertAllClose(
                to_numpy(outputs)[:, step],
                np.concatenate([state, context], -1),
                atol=1e-5,
                rtol=1e-5,
            )

    def test_step_repeats_the_teacher_forced_pass(self):
        for make in (lambda: BahdanauDecoder(8), lstm_luong, gru_multi_head):
            decoder = make()
            full, full_weights = decoder(
                INPUTS, MEMORY, memory_mask=MEMORY_MASK, return_attention_scores=True
            )
            states = decoder.initial_state(2)
            projected = decoder.project_memory(MEMORY)
            for step in range(INPUTS.shape[1]):
                outputs, states, weights = decoder.step(
                    ops.convert_to_tensor(INPUTS[:, step]),
                    states,
                    MEMORY,
                    MEMORY_MASK,
                    projected,
                )
                self.assertAllClose(outputs, to_numpy(full)[:, step], atol=1e-5)
                self.assertAllClose(weights, to_numpy(full_weights)[:, step], atol=1e-5)
            lstm = isinstance(decoder.cell, keras.layers.LSTMCell)
            self.assertLen(states, 2 if lstm else 1)

    def test_the_memory_mask_comes_from_a_keras_mask(self):
        source = keras.Input((None,), dtype="int32")
        target = keras.Input((None, 3))
        memory = keras.layers.Embedding(20, 6, mask_zero=True)(source)
        decoder = BahdanauDecoder(8)
        outputs, weights = decoder(target, memory, return_attention_scores=True)
        model = keras.Model([source, target], [outputs, weights])
        ids = np.array([[4, 5, 6, 0, 0]])
        _, got = model([ids, INPUTS[:1]])
        np.testing.assert_array_equal(to_numpy(got)[0, :, 3:], 0.0)
        # Trimming the padding changes nothing.
        trimmed, _ = model([ids[:, :3], INPUTS[:1]])
        padded, _ = model([ids, INPUTS[:1]])
        self.assertAllClose(trimmed, padded, atol=1e-6)

    def test_loads_the_config_of_keras_attn_0_1(self):
        decoder = BahdanauDecoder.from_config(
            {"name": "decoder", "units": 8, "attention_units": 5, "trainable": True}
        )
        self.assertIsInstance(decoder.cell, keras.layers.GRUCell)
        self.assertEqual(decoder.attention.units, 5)
        outputs = decoder(INPUTS, MEMORY, STATE)
        self.assertEqual(tuple(outputs.shape), (2, 4, 8 + 6))

    def test_bad_arguments(self):
        with self.assertRaisesRegex(ValueError, "Received: cell='gru'"):
            BahdanauDecoder("gru")
        with self.assertRaisesRegex(ValueError, "Received: cell=0"):
            BahdanauDecoder(0)
        with self.assertRaisesRegex(ValueError, "Received: attention='additive'"):
            BahdanauDecoder(8, "additive")
        with self.assertRaisesRegex(ValueError, r"Received: inputs.shape=\(2, 3\)"):
            BahdanauDecoder(8)(INPUTS[:, 0], MEMORY)
