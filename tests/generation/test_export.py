"""Decoding under `tf.function` (once traced, once compiled) and in a SavedModel.

TensorFlow only: the export issue serves decoding from a SavedModel, so the
decode must trace inside `tf.function` with an unknown batch size, compile
once with XLA, and run where only TensorFlow is imported.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import textwrap

import keras
import numpy as np
import pytest
from keras import ops

from keras_attn import generation
from tests.generation.test_sampler import LENGTH, _prompts
from tests.generation.tiny_lm import build_lm
from tests.test_case import TestCase, to_numpy

pytestmark = pytest.mark.tf_only

END = 15


def _signature(tf):
    return [
        tf.TensorSpec((None, None), tf.int32, name="prompt"),
        tf.TensorSpec((None,), tf.int32, name="prompt_lengths"),
        tf.TensorSpec((), tf.int32, name="max_length"),
        tf.TensorSpec((), tf.int32, name="seed"),
    ]


def _decoders(lm):
    """Greedy, beam and top-p decoders with the same tensor arguments."""

    def greedy(prompt, prompt_lengths, max_length, seed):
        del seed
        return generation.greedy_search(
            lm.next_fn,
            prompt,
            lm.initial_cache(ops.shape(prompt)[0], LENGTH),
            max_length,
            prompt_lengths=prompt_lengths,
            end_token_id=END,
            output_length=LENGTH,
        )

    def beam(prompt, prompt_lengths, max_length, seed):
        del seed
        return generation.beam_search(
            lm.next_fn,
            prompt,
            lm.initial_cache(ops.shape(prompt)[0], LENGTH),
            max_length,
            beam_width=3,
            length_penalty=0.6,
            prompt_lengths=prompt_lengths,
            end_token_id=END,
            output_length=LENGTH,
        )

    def top_p(prompt, prompt_lengths, max_length, seed):
        return generation.sample(
            lm.next_fn,
            prompt,
            lm.initial_cache(ops.shape(prompt)[0], LENGTH),
            max_length,
            top_p=0.8,
            temperature=1.5,
            seed=seed,
            prompt_lengths=prompt_lengths,
            output_length=LENGTH,
        )

    return {"greedy": greedy, "beam": beam, "top_p": top_p}


# Prepended to the serving script: TensorFlow would import keras on its own;
# block it and our packages (as `tests/test_case.py` does) so that loading
# must work with TensorFlow alone.
_BLOCK_KERAS = textwrap.dedent("""
    import sys
    for blocked in ("keras", "keras_attn", "keras_hub", "keras_nlp", "tf_keras"):
        sys.modules[blocked] = None
""")


def _counted(function, traces):
    """`function`, appending to `traces` each time it is traced."""

    def counted(*args):
        traces.append(1)
        return function(*args)

    return counted


def _canonical_hlo(text: str) -> str:
    """HLO text without metadata, instruction names numbered by first use
    (TensorFlow names some constants differently from one lowering to the
    next)."""
    text = re.sub(r",? ?metadata=\{[^}]*\}", "", text)
    names: dict = {}
    return re.sub(
        r"%[\w.\-]+", lambda m: names.setdefault(m.group(0), f"%v{len(names)}"), text
    )


def _inputs():
    prompt, lengths = _prompts()
    first = (prompt, lengths, np.int32(LENGTH), np.int32(7))
    # Another batch size, prompt width, max length and seed.
    second = (
        np.array([[5, 6, 7, 8], [9, 10, 0, 0]], "int32"),
        np.array([4, 2], "int32"),
        np.int32(9),
        np.int32(8),
    )
    return first, second


class TFFunctionTest(TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.lm = build_lm()

    def test_traces_once_with_unknown_batch(self):
        import tensorflow as tf

        for name, decode in _decoders(self.lm).items():
            traces = []
            function = tf.function(
                _counted(decode, traces), input_signature=_signature(tf)
            )
            for args in _inputs():
                got = function(*[tf.constant(a) for a in args])
                want = decode(*args)
                for g, w in zip(
                    tf.nest.flatten(got), tf.nest.flatten(want), strict=True
                ):
                    np.testing.assert_allclose(
                        to_numpy(g), to_numpy(w), atol=1e-5, err_msg=name
                    )
            self.assertLen(traces, 1, name)
            self.assertEqual(function.experimental_get_tracing_count(), 1, name)

    def test_xla_compiles_once(self):
        """Under `jit_compile=True` new max lengths, prompt lengths and seeds
        reuse the compiled program: the HLO does not depend on their values."""
        import tensorflow as tf

        decode = _decoders(self.lm)["top_p"]
        prompt, lengths = _prompts()
        signature = [
            tf.TensorSpec(prompt.shape, tf.int32),
            tf.TensorSpec(lengths.shape, tf.int32),
            tf.TensorSpec((), tf.int32),
            tf.TensorSpec((), tf.int32),
        ]
        compiled = tf.function(decode, input_signature=signature, jit_compile=True)
        calls = [
            (prompt, lengths, np.int32(LENGTH), np.int32(1)),
            (
                prompt[::-1].copy(),
                np.array([2, 3, 4], "int32"),
                np.int32(8),
                np.int32(2),
            ),
        ]
        hlo = []
        for args in calls:
            tensors = [tf.constant(a) for a in args]
            got = compiled(*tensors)
            np.testing.assert_array_equal(to_numpy(got), to_numpy(decode(*args)))
            hlo.append(
                _canonical_hlo(
                    compiled.experimental_get_compiler_ir(*tensors)(stage="hlo")
                )
            )
        self.assertEqual(compiled.experimental_get_tracing_count(), 1)
        # No argument value folded in as a constant: one program for both.
        self.assertTrue(hlo[0] == hlo[1], "the HLO differs between the calls")

    # Slow: every task export loads with TensorFlow alone in check_servable
    # (tests/export)
    @pytest.mark.slow
    def test_saved_model_runs_with_tensorflow_only(self):
        import tensorflow as tf

        archive = keras.export.ExportArchive()
        archive.track(self.lm)
        decoders = _decoders(self.lm)
        for name, decode in decoders.items():
            archive.add_endpoint(name, decode, input_signature=_signature(tf))
        _, second = _inputs()
        expected = {
            name: [to_numpy(t) for t in tf.nest.flatten(decode(*second))]
            for name, decode in decoders.items()
        }
        with tempfile.TemporaryDirectory() as tmp:
            export_dir = os.path.join(tmp, "decoder")
            archive.write_out(export_dir, verbose=False)
            outputs = os.path.join(tmp, "outputs.npz")
            script = _BLOCK_KERAS + textwrap.dedent(f"""
                import numpy as np
                import tensorflow as tf
                loaded = tf.saved_model.load({export_dir!r})
                args = [tf.constant(a) for a in {[a.tolist() for a in second]!r}]
                arrays = {{}}
                for name in ("greedy", "beam", "top_p"):
                    out = tf.nest.flatten(getattr(loaded, name)(*args))
                    for i, tensor in enumerate(out):
                        arrays[f"{{name}}_{{i}}"] = tensor.numpy()
                np.savez({outputs!r}, **arrays)
                assert not [m for m in sys.modules if m.startswith("keras") and
                            sys.modules[m] is not None]
            """)
            result = subprocess.run(
                [sys.executable, "-c", script],
                capture_output=True,
                text=True,
                env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
                timeout=300,
            )
            self.assertEqual(result.returncode, 0, result.stderr[-3000:])
            got = np.load(outputs)
            for name, arrays in expected.items():
                for i, array in enumerate(arrays):
                    np.testing.assert_allclose(
                        got[f"{name}_{i}"], array, atol=1e-5, err_msg=name
                    )
