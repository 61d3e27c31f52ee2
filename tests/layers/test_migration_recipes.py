"""The recipes of docs/TF_ADDONS_MIGRATION.md, run for every attention kind.

tests/test_docs.py runs the page as written (a `BahdanauAttention`); here its
beam-search block runs again around decoders of the other attentions, so the
recipe stays one recipe for all of them.
"""

import re

import keras
import numpy as np
from absl.testing import parameterized
from keras import ops

import keras_attn
from keras_attn.layers import (
    BahdanauAttention,
    BahdanauDecoder,
    LuongAttention,
    MultiHeadAttention,
)
from tests.test_case import REPO_ROOT, TestCase, to_numpy

PAGE = f"{REPO_ROOT}/docs/TF_ADDONS_MIGRATION.md"
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)

RNG = np.random.default_rng(0)
MEMORY = RNG.normal(size=(2, 5, 12)).astype("float32")
MASK = np.array([[True] * 5, [True, True, True, False, False]])
TARGETS = np.array([[2, 7, 9, 4], [2, 11, 3, 0]])
VOCABULARY = 40

# (name, attention, cell units): Luong's dot score needs the query (the
# cell's state) as wide as the memory.
KINDS = (
    ("bahdanau", lambda: BahdanauAttention(8), 16),
    ("bahdanau_normalized", lambda: BahdanauAttention(8, normalize=True), 16),
    ("luong_dot", lambda: LuongAttention(score="dot"), 12),
    ("luong_dot_sqrt_dim", lambda: LuongAttention(score="dot", scale="sqrt_dim"), 12),
    ("luong_general", lambda: LuongAttention(score="general"), 16),
    ("luong_general_learned", lambda: LuongAttention("general", scale="learned"), 16),
    ("luong_concat", lambda: LuongAttention(score="concat", units=6), 16),
    ("multi_head", lambda: MultiHeadAttention(num_heads=2, key_dim=4), 16),
)


def page_block(marker: str) -> str:
    """The page's ```python block that contains `marker`."""
    with open(PAGE, encoding="utf-8") as f:
        blocks = [b for b in FENCE.findall(f.read()) if marker in b]
    assert len(blocks) == 1, f"{len(blocks)} blocks of {PAGE} contain {marker!r}"
    return blocks[0]


def teacher_forced_decoder(attention, units):
    """The page's decoder, embedding and output layer, with `attention`."""
    embedding = keras.layers.Embedding(VOCABULARY, 8)
    decoder = BahdanauDecoder(keras.layers.LSTMCell(units), attention)
    output_layer = keras.layers.Dense(VOCABULARY)
    initial_state = [np.zeros((2, units), "float32")] * 2  # an LSTM's [h, c]
    features = decoder(
        embedding(TARGETS), MEMORY, initial_state=initial_state, memory_mask=MASK
    )
    return embedding, decoder, output_layer, initial_state, output_layer(features)


class MigrationRecipesTest(TestCase):
    @parameterized.named_parameters(*KINDS)
    def test_beam_search_recipe_runs_for_every_attention(self, make_attention, units):
        embedding, decoder, output_layer, initial_state, _ = teacher_forced_decoder(
            make_attention(), units
        )
        projected = decoder.project_memory(MEMORY)
        self.assertIsNotNone(projected)
        self.assertEqual(tuple(projected.shape)[:2], (2, 5))
        namespace = {
            "keras": keras,
            "np": np,
            "keras_attn": keras_attn,
            "memory": MEMORY,
            "mask": MASK,
            "embedding": embedding,
            "decoder": decoder,
            "output_layer": output_layer,
            "initial_state": initial_state,
        }
        exec(page_block("keras_attn.generation.beam_search("), namespace)
        tokens, scores = to_numpy(namespace["tokens"]), to_numpy(namespace["scores"])
        self.assertEqual(tokens.shape, (2, 8))
        self.assertEqual(scores.shape, (2,))
        self.assertTrue(np.all(np.isfinite(scores)))
        self.assertTrue(np.all((tokens >= 0) & (tokens < VOCABULARY)))

    @parameterized.named_parameters(*KINDS)
    def test_steps_with_the_projected_memory_repeat_the_teacher_forced_pass(
        self, make_attention, units
    ):
        embedding, decoder, output_layer, initial_state, full = teacher_forced_decoder(
            make_attention(), units
        )
        projected = decoder.project_memory(MEMORY)
        states = list(initial_state)
        for step in range(TARGETS.shape[1]):
            outputs, states, _ = decoder.step(
                embedding(TARGETS[:, step : step + 1])[:, 0],
                states,
                MEMORY,
                MASK,
                projected,
            )
            self.assertAllClose(
                output_layer(outputs), to_numpy(full)[:, step], atol=1e-5
            )

    def test_the_projected_memory_is_what_the_steps_read(self):
        # A zeroed projection changes the Luong general step: it is used, not
        # recomputed from the memory.
        embedding, decoder, _, initial_state, _ = teacher_forced_decoder(
            LuongAttention(score="general"), 16
        )
        inputs = embedding(TARGETS[:, :1])[:, 0]
        projected = decoder.project_memory(MEMORY)
        states = [RNG.normal(size=(2, 16)).astype("float32") for _ in initial_state]
        _, _, weights = decoder.step(inputs, states, MEMORY, MASK, projected)
        _, _, zeroed = decoder.step(
            inputs, states, MEMORY, MASK, ops.zeros_like(projected)
        )
        self.assertGreater(np.abs(to_numpy(weights) - to_numpy(zeroed)).max(), 1e-4)
        np.testing.assert_allclose(to_numpy(zeroed)[1, :3], 1 / 3, atol=1e-6)

    def test_tutorial_unpacking_needs_return_attention_scores(self):
        # The TensorFlow NMT tutorial's `context, weights = attention(query,
        # values)`, as the migration page writes it.
        namespace = {
            "keras_attn": keras_attn,
            "state": np.zeros((2, 16), "float32"),
            "memory": MEMORY,
            "mask": MASK,
        }
        exec(page_block("context_vector, attention_weights = attention("), namespace)
        self.assertEqual(tuple(namespace["attention_weights"].shape), (2, 5))
        self.assertEqual(tuple(namespace["context_vector"].shape), (2, 12))
        # Without the flag the call returns the context alone, one tensor.
        context = namespace["attention"](namespace["state"], MEMORY, value_mask=MASK)
        self.assertEqual(tuple(context.shape), (2, 12))
