"""What a keras-hub user relies on when swapping in keras-attn's blocks.

keras-hub's wheel ships no test modules, so these are the project's own: the
`.weights.h5` files of models built on keras-hub's `TransformerEncoder` /
`TransformerDecoder` load into the same models built on keras-attn's, and the
other way, with equal outputs; the blocks have keras-hub's variables, seed
generators, paths and sublayer attribute names; keras-hub's cached decoder
call gives keras-hub's outputs. And the `.keras` files that keras-attn 0.2
saved (blocks named `TransformerEncoderBlock` / `TransformerDecoderBlock`,
sublayers under public attributes) still load.
"""

import os
import re
import tempfile
from pathlib import Path

import h5py
import keras
import keras_hub
import numpy as np
from absl.testing import parameterized

import keras_attn
from keras_attn.layers.transformer_decoder_block import (
    TransformerDecoder,
    TransformerDecoderBlock,
)
from keras_attn.layers.transformer_encoder_block import (
    TransformerEncoder,
    TransformerEncoderBlock,
)
from keras_attn.models import (
    TextClassifier,
    TransformerLanguageModel,
    TransformerTranslator,
)
from tests.test_case import TestCase, to_numpy

FIXTURES = Path(__file__).parents[1] / "fixtures"
RNG = np.random.default_rng(11)
TARGET = RNG.normal(size=(2, 5, 8)).astype("float32")
SOURCE = RNG.normal(size=(2, 4, 8)).astype("float32")

# keras-hub's sublayer attributes, in its creation order.
ENCODER_ATTRIBUTES = (
    "_self_attention_layer",
    "_self_attention_layer_norm",
    "_self_attention_dropout",
    "_feedforward_layer_norm",
    "_feedforward_intermediate_dense",
    "_feedforward_output_dense",
    "_feedforward_dropout",
)
DECODER_ATTRIBUTES = (
    "_self_attention_layer",
    "_self_attention_layer_norm",
    "_self_attention_dropout",
    "_feedforward_intermediate_dense",
    "_feedforward_output_dense",
    "_feedforward_layer_norm",
    "_feedforward_dropout",
)
CROSS_ATTRIBUTES = (
    "_cross_attention_layer",
    "_cross_attention_layer_norm",
    "_cross_attention_dropout",
)

# (name, keras-hub class, keras-attn class, with cross-attention)
KINDS = (
    ("encoder", keras_hub.layers.TransformerEncoder, TransformerEncoder, False),
    ("decoder", keras_hub.layers.TransformerDecoder, TransformerDecoder, False),
    ("cross_decoder", keras_hub.layers.TransformerDecoder, TransformerDecoder, True),
)
KIND_PARAMETERS = [(name, *rest) for name, *rest in KINDS]


def functional_model(block_class, cross: bool, **kwargs):
    """Two blocks in a functional model, as a keras-hub user builds one."""
    target = keras.Input((None, 8))
    if block_class in (keras_hub.layers.TransformerEncoder, TransformerEncoder):
        x = block_class(16, 2, **kwargs)(target)
        return keras.Model(target, block_class(16, 2, normalize_first=True)(x))
    source = keras.Input((None, 8))
    x = block_class(16, 2, **kwargs)(target, source if cross else None)
    y = block_class(16, 2, normalize_first=True)(x, source if cross else None)
    return keras.Model([target, source] if cross else target, y)


def model_inputs(cross: bool):
    return [TARGET, SOURCE] if cross else TARGET


def built(block_class, cross: bool, decoder: bool, **kwargs):
    block = block_class(16, 2, name="block", **kwargs)
    if decoder:
        block(TARGET, SOURCE if cross else None)
    else:
        block(TARGET)
    return block


def structure(block):
    """`(path, shape)` of each variable, seed generators' counters dropped."""
    return [
        (re.sub(r"seed_generator_\d+", "seed_generator", v.path), tuple(v.shape))
        for v in block.variables
    ]


def seed_generator_count(block) -> int:
    return sum("seed_generator_state" in v.path for v in block.variables)


def blocks_of(model):
    return [
        layer
        for layer in model.layers
        if not isinstance(layer, keras.layers.InputLayer)
    ]


def h5_groups(path):
    groups = []
    with h5py.File(path, "r") as file:
        file.visit(groups.append)
    return sorted(groups)


class ClassNamesTest(TestCase):
    def test_classes_are_named_as_keras_hubs_and_the_block_names_are_aliases(self):
        self.assertEqual(TransformerEncoder.__name__, "TransformerEncoder")
        self.assertEqual(TransformerDecoder.__name__, "TransformerDecoder")
        self.assertIs(TransformerEncoderBlock, TransformerEncoder)
        self.assertIs(TransformerDecoderBlock, TransformerDecoder)
        for namespace in (keras_attn, keras_attn.layers):
            self.assertIs(namespace.TransformerEncoderBlock, TransformerEncoder)
            self.assertIs(namespace.TransformerDecoderBlock, TransformerDecoder)
            self.assertIs(namespace.TransformerEncoder, TransformerEncoder)
            self.assertIs(namespace.TransformerDecoder, TransformerDecoder)
            self.assertIn("TransformerEncoder", namespace.__all__)
            self.assertIn("TransformerDecoder", namespace.__all__)
        self.assertEqual(
            keras.saving.get_registered_name(TransformerEncoder),
            "keras_attn>TransformerEncoder",
        )
        self.assertEqual(
            keras.saving.get_registered_name(TransformerDecoder),
            "keras_attn>TransformerDecoder",
        )
        # The names of 0.2's `.keras` files read into subclasses.
        for old, new in (
            ("TransformerEncoderBlock", TransformerEncoder),
            ("TransformerDecoderBlock", TransformerDecoder),
        ):
            legacy = keras.saving.get_registered_object(f"keras_attn>{old}")
            self.assertTrue(issubclass(legacy, new))
            self.assertIsNot(legacy, new)
            self.assertEqual(legacy.__name__, old)

    def test_a_new_block_saves_and_loads_as_its_own_class(self):
        model = functional_model(TransformerEncoderBlock, cross=False)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "model.keras")
            model.save(path)
            loaded = keras.saving.load_model(path)
        blocks = blocks_of(loaded)
        self.assertEqual([type(block) for block in blocks], [TransformerEncoder] * 2)
        self.assertAllClose(loaded(TARGET), model(TARGET), atol=0)


class StructureTest(TestCase):
    @parameterized.named_parameters(
        *[
            (
                f"{name}_dropout_{str(dropout).replace('.', '_')}",
                hub,
                ours,
                cross,
                dropout,
            )
            for name, hub, ours, cross in KINDS
            for dropout in (0.0, 0.1)
        ]
    )
    def test_variables_and_seed_generators_are_keras_hubs(
        self, hub_class, our_class, cross, dropout
    ):
        decoder = our_class is TransformerDecoder
        hub = built(hub_class, cross, decoder, dropout=dropout)
        ours = built(our_class, cross, decoder, dropout=dropout)
        self.assertEqual(structure(ours), structure(hub))
        self.assertEqual(seed_generator_count(ours), seed_generator_count(hub))
        self.assertEqual([v.path for v in ours.weights], [v.path for v in hub.weights])
        # keras-hub's counts, written out (dropout > 0: one seed generator
        # per Dropout, the attention layers' included).
        expected_seed_generators = {
            False: 0 if dropout == 0 else 3,
            True: 0 if dropout == 0 else 5,
        }[cross]
        self.assertEqual(seed_generator_count(hub), expected_seed_generators)

    @parameterized.named_parameters(*KIND_PARAMETERS)
    def test_sublayers_are_held_under_keras_hubs_attribute_names(
        self, hub_class, our_class, cross
    ):
        decoder = our_class is TransformerDecoder
        hub = built(hub_class, cross, decoder)
        ours = built(our_class, cross, decoder)
        names = ENCODER_ATTRIBUTES if not decoder else DECODER_ATTRIBUTES
        if cross:
            names = (*names[:3], *CROSS_ATTRIBUTES, *names[3:])
        for name in names:
            theirs, mine = getattr(hub, name), getattr(ours, name)
            self.assertIsInstance(mine, keras.layers.Layer, name)
            self.assertEqual(mine.name, theirs.name, name)
        if decoder and not cross:
            self.assertIsNone(ours._cross_attention_layer)

    @parameterized.named_parameters(*KIND_PARAMETERS)
    def test_no_public_attribute_holds_a_sublayer(self, hub_class, our_class, cross):
        """Keras's saver names a group after the first attribute (public ones
        first) that holds a sublayer: a public alias would rename it."""
        decoder = our_class is TransformerDecoder
        ours = built(our_class, cross, decoder)
        public = []
        for name in dir(ours):
            if name.startswith("_"):
                continue
            try:
                value = getattr(ours, name)
            except Exception:  # as Keras's saver does
                continue
            if isinstance(value, keras.layers.Layer):
                public.append(name)
        self.assertEqual(public, [])


class WeightsFileTest(TestCase):
    @parameterized.named_parameters(
        *[
            (
                f"{name}_dropout_{str(dropout).replace('.', '_')}",
                hub,
                ours,
                cross,
                dropout,
            )
            for name, hub, ours, cross in KINDS
            for dropout in (0.0, 0.1)
        ]
    )
    def test_weights_files_load_both_ways(self, hub_class, our_class, cross, dropout):
        inputs = model_inputs(cross)
        with tempfile.TemporaryDirectory() as tmp:
            hub_path = os.path.join(tmp, "hub.weights.h5")
            our_path = os.path.join(tmp, "ours.weights.h5")
            hub = functional_model(hub_class, cross, dropout=dropout)
            ours = functional_model(our_class, cross, dropout=dropout)
            hub.save_weights(hub_path)
            ours.save_weights(our_path)
            self.assertEqual(h5_groups(our_path), h5_groups(hub_path))

            # keras-hub -> keras-attn: a fresh keras-attn model (other random
            # weights) gives keras-hub's outputs once it loads the file.
            into_ours = functional_model(our_class, cross, dropout=dropout)
            self.assertFalse(
                np.allclose(to_numpy(into_ours(inputs)), to_numpy(hub(inputs)))
            )
            into_ours.load_weights(hub_path)
            self.assertAllClose(into_ours(inputs), hub(inputs), atol=1e-5)

            # keras-attn -> keras-hub.
            into_hub = functional_model(hub_class, cross, dropout=dropout)
            self.assertFalse(
                np.allclose(to_numpy(into_hub(inputs)), to_numpy(ours(inputs)))
            )
            into_hub.load_weights(our_path)
            self.assertAllClose(into_hub(inputs), ours(inputs), atol=1e-5)


class CachedCallTest(TestCase):
    @parameterized.named_parameters(("decoder_only", False), ("cross", True))
    def test_keras_hubs_cached_calls_give_keras_hubs_outputs(self, cross):
        """keras-hub's loop: prefill two tokens (filling the cross cache with
        index 0), then one token per step reusing it (index None); weights
        from a keras-hub `.weights.h5` file."""
        hub = functional_model(keras_hub.layers.TransformerDecoder, cross)
        ours = functional_model(TransformerDecoder, cross)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "hub.weights.h5")
            hub.save_weights(path)
            ours.load_weights(path)
        hub_block = blocks_of(hub)[0]
        our_block = blocks_of(ours)[0]
        source = SOURCE if cross else None
        results = {}
        for name, block in (("hub", hub_block), ("ours", our_block)):
            self_cache = np.zeros((2, 2, 5, 2, 4), "float32")
            cross_cache = np.zeros((2, 2, 4, 2, 4), "float32") if cross else None
            steps = []
            for start, stop in ((0, 2), (2, 3), (3, 4), (4, 5)):
                kwargs = {
                    "self_attention_cache": self_cache,
                    "self_attention_cache_update_index": start,
                }
                if cross:
                    kwargs["cross_attention_cache"] = cross_cache
                    kwargs["cross_attention_cache_update_index"] = (
                        0 if start == 0 else None
                    )
                result = block(TARGET[:, start:stop], source, **kwargs)
                self.assertIsInstance(result, tuple)
                self.assertLen(result, 3 if cross else 2)
                if cross:
                    outputs, self_cache, cross_cache = result
                else:
                    outputs, self_cache = result
                steps.append(to_numpy(outputs))
            # A read-only call (index None) with the full cache.
            kwargs = {"self_attention_cache": self_cache}
            if cross:
                kwargs["cross_attention_cache"] = cross_cache
            read_only = block(TARGET[:, 4:5], source, **kwargs)
            results[name] = (
                np.concatenate(steps, axis=1),
                to_numpy(self_cache),
                None if not cross else to_numpy(cross_cache),
                to_numpy(read_only[0]),
            )
        for got, want in zip(results["ours"], results["hub"], strict=True):
            if want is None:
                self.assertIsNone(got)
            else:
                np.testing.assert_allclose(got, want, atol=1e-5)
        # The cached steps equal the full pass.
        full = to_numpy(our_block(TARGET, source))
        np.testing.assert_allclose(results["ours"][0], full, atol=1e-5)


class OldKerasFilesTest(TestCase):
    """`.keras` files saved by keras-attn 0.2 (tests/fixtures/keras_attn_0_2_*:
    a functional model with an encoder block, a decoder block with
    cross-attention and one without; a `TransformerLanguageModel`)."""

    def setUp(self):
        super().setUp()
        self.expected = np.load(FIXTURES / "keras_attn_0_2_outputs.npz")

    def test_blocks_of_an_old_file_load_with_their_weights(self):
        model = keras.saving.load_model(FIXTURES / "keras_attn_0_2_blocks.keras")
        inputs = [self.expected["target"], self.expected["source"]]
        blocks = blocks_of(model)
        self.assertEqual(
            [type(block).__name__ for block in blocks],
            [
                "TransformerEncoderBlock",
                "TransformerDecoderBlock",
                "TransformerDecoderBlock",
            ],
        )
        self.assertIsInstance(blocks[0], TransformerEncoder)
        self.assertIsInstance(blocks[1], TransformerDecoder)
        np.testing.assert_allclose(
            to_numpy(model(inputs)), self.expected["blocks_outputs"], atol=1e-5
        )
        # Saved again, the file loads again.
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "again.keras")
            model.save(path)
            again = keras.saving.load_model(path)
        np.testing.assert_allclose(
            to_numpy(again(inputs)), self.expected["blocks_outputs"], atol=1e-5
        )

    def test_an_old_language_model_file_loads_with_its_weights(self):
        model = keras.saving.load_model(
            FIXTURES / "keras_attn_0_2_language_model.keras"
        )
        self.assertEqual(
            [type(block).__name__ for block in model.decoder_blocks],
            ["TransformerDecoderBlock"],
        )
        np.testing.assert_allclose(
            to_numpy(model(self.expected["token_ids"])),
            self.expected["language_model_logits"],
            atol=1e-5,
        )
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "again.keras")
            model.save(path)
            again = keras.saving.load_model(path)
        np.testing.assert_allclose(
            to_numpy(again(self.expected["token_ids"])),
            self.expected["language_model_logits"],
            atol=1e-5,
        )

    @parameterized.named_parameters(
        (
            "language_model",
            TransformerLanguageModel,
            {"vocabulary_size": 50, "num_layers": 1},
        ),
        ("text_classifier", TextClassifier, {"vocabulary_size": 50, "num_layers": 1}),
        (
            "translator",
            TransformerTranslator,
            {
                "source_vocabulary_size": 50,
                "target_vocabulary_size": 50,
                "num_encoder_layers": 1,
                "num_decoder_layers": 1,
            },
        ),
    )
    def test_new_model_configs_build_keras_hubs_structure_old_ones_the_old(
        self, model_class, init
    ):
        sizes = {"embedding_dim": 8, "num_heads": 2, "intermediate_dim": 16}
        model = model_class(sequence_length=8, **sizes, **init)
        config = model.get_config()
        backbone_configs = [
            config[key]["config"]
            for key in ("backbone", "decoder_backbone")
            if key in config
        ]
        for backbone_config in backbone_configs:
            self.assertEqual(backbone_config["block_structure"], "keras_hub")

        def block_class_names(model):
            return {
                type(block).__name__
                for backbone in model.backbones
                for block in backbone.blocks
            }

        new_names = block_class_names(model)
        self.assertTrue(new_names)
        self.assertTrue(new_names <= {"TransformerEncoder", "TransformerDecoder"})
        restored = model_class.from_config(config)
        self.assertEqual(block_class_names(restored), new_names)
        self.assertEqual(restored.get_config(), config)
        # A config of keras-attn 0.2: the sizes at the top, no block structure.
        old_config = {"name": model.name, **init, "sequence_length": 8, **sizes}
        old = model_class.from_config(old_config)
        self.assertEqual(block_class_names(old), {name + "Block" for name in new_names})
        # It saves its blocks as it loaded them, and reloads them so.
        saved = old.get_config()
        for key in ("backbone", "decoder_backbone"):
            if key in saved:
                self.assertNotIn("block_structure", saved[key]["config"])
        self.assertEqual(
            block_class_names(model_class.from_config(saved)), block_class_names(old)
        )
        with self.assertRaisesRegex(
            ValueError, r"block_structure.*Received: block_structure='other'"
        ):
            model_class.from_config({**old_config, "block_structure": "other"})
