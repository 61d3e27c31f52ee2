"""Shared test helpers: one `TestCase` with the checks every layer gets.

Modelled on KerasHub's `tests/test_case.py` (Keras keeps its own in the
private `keras.src`): `run_layer_test`, `run_serialization_test`,
`run_precision_test` and `run_saved_model_test`, called once per layer with
`named_parameters` for the variants.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import textwrap

import keras
import numpy as np
from absl.testing import parameterized
from keras import ops

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Python source that makes TensorFlow unimportable in the process that runs it
# first (prepended to a `python -c` script, or written to a sitecustomize.py):
# a Python like the GPU machines', with JAX and Keras but no TensorFlow.
BLOCK_TENSORFLOW = textwrap.dedent(
    """
    import sys

    # A None entry makes `import tensorflow` (and its submodules) raise
    # ModuleNotFoundError and `importlib.util.find_spec` answer None, as for
    # a package that is not installed (torch._dynamo probes it that way).
    for name in ("tensorflow", "tensorflow_text", "tf_keras"):
        sys.modules[name] = None
    """
)


EXAMPLE_HELPERS = ("_cli", "_options")  # examples/ modules the scripts import


def xla_flags_with_devices(devices: int) -> str:
    """`XLA_FLAGS` for a JAX process on `devices` virtual CPU devices: this
    process's flags (conftest.py's compile level) and the device count."""
    flags = os.environ.get("XLA_FLAGS", "")
    return f"{flags} --xla_force_host_platform_device_count={devices}".strip()


def run_on_virtual_devices(script: str, *args, devices: int = 8, timeout=900):
    """Run `script` (Python source) in a fresh process on JAX with `devices`
    virtual CPU devices (fixed when JAX starts, hence the process) and
    return the JSON its last line of output prints."""
    environment = {
        **os.environ,
        "KERAS_BACKEND": "jax",
        "XLA_FLAGS": xla_flags_with_devices(devices),
        "PYTHONPATH": REPO_ROOT,
        "TF_CPP_MIN_LOG_LEVEL": "3",
    }
    result = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        capture_output=True,
        text=True,
        env=environment,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def fresh_json(code: str, *args, timeout: int = 600):
    """Run `code` with `args` in a fresh Python process (this interpreter,
    the repository as working directory, TensorFlow's logs quiet) as a user
    would, and return the JSON its last line of output prints; fails with
    the process's error output if it exits with an error."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def load_example(name: str):
    """`examples/<name>.py` as a module. The scripts' helper modules
    (`examples/_cli.py`, `_options.py`) are registered under their own names
    first, as the scripts import them (they run with `examples/` on the
    path)."""
    if name in EXAMPLE_HELPERS:
        if name not in sys.modules:
            path = os.path.join(REPO_ROOT, "examples", f"{name}.py")
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        return sys.modules[name]
    for helper in EXAMPLE_HELPERS:
        load_example(helper)
    path = os.path.join(REPO_ROOT, "examples", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"{name}_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def to_numpy(x):
    return np.asarray(ops.convert_to_numpy(x))


def tree_to_numpy(structure):
    if isinstance(structure, dict):
        return {k: tree_to_numpy(v) for k, v in structure.items()}
    if isinstance(structure, (list, tuple)):
        return type(structure)(tree_to_numpy(v) for v in structure)
    return to_numpy(structure)


def flatten(structure):
    if isinstance(structure, dict):
        return [leaf for k in sorted(structure) for leaf in flatten(structure[k])]
    if isinstance(structure, (list, tuple)):
        return [leaf for item in structure for leaf in flatten(item)]
    return [structure]


def outputs_and_gradients(fn, inputs, cotangent, jit: bool = False):
    """`fn(*inputs)` and the gradients of `sum(fn(*inputs) * cotangent)` w.r.t.
    each of `inputs`, as numpy arrays (TensorFlow, JAX or PyTorch backend).
    `jit` compiles the whole computation (`tf.function` / `jax.jit`; on
    PyTorch it runs eagerly, as Keras's torch backend does)."""
    backend = keras.backend.backend()
    cotangent = ops.convert_to_tensor(cotangent, "float32")

    def loss(*args):
        outputs = fn(*args)
        return ops.sum(ops.cast(outputs, "float32") * cotangent), outputs

    if backend == "tensorflow":
        import tensorflow as tf

        def compute(*args):
            with tf.GradientTape() as tape:
                tape.watch(args)
                value, outputs = loss(*args)
            return outputs, tape.gradient(value, args)

        if jit:
            compute = tf.function(compute)
        outputs, grads = compute(*[tf.convert_to_tensor(x) for x in inputs])
    elif backend == "jax":
        import jax

        compute = jax.value_and_grad(
            loss, argnums=tuple(range(len(inputs))), has_aux=True
        )
        if jit:
            compute = jax.jit(compute)
        (_, outputs), grads = compute(*[ops.convert_to_tensor(x) for x in inputs])
    elif backend == "torch":
        import torch

        args = [
            ops.convert_to_tensor(x).detach().clone().requires_grad_(True)
            for x in inputs
        ]
        value, outputs = loss(*args)
        grads = torch.autograd.grad(value, args, allow_unused=True)
        grads = [
            torch.zeros_like(arg) if grad is None else grad
            for arg, grad in zip(args, grads, strict=True)
        ]
        outputs = keras.tree.map_structure(lambda x: x.detach(), outputs)
    else:
        raise NotImplementedError(backend)
    return to_numpy(outputs), [to_numpy(grad) for grad in grads]


def symbolic_inputs(arrays: dict) -> dict:
    """`keras.Input`s matching a dict of arrays (batch dim left free)."""
    return {
        name: keras.Input(shape=array.shape[1:], dtype=str(array.dtype), name=name)
        for name, array in arrays.items()
    }


class TestCase(parameterized.TestCase):
    """Base class of the layer tests."""

    def setUp(self):
        super().setUp()
        keras.config.set_dtype_policy("float32")
        keras.utils.set_random_seed(1337)

    def tearDown(self):
        keras.config.set_dtype_policy("float32")
        super().tearDown()

    # -- assertions ----------------------------------------------------------

    def assertAllClose(self, actual, expected, atol=1e-6, rtol=1e-6, msg=None):
        actual, expected = (
            flatten(tree_to_numpy(actual)),
            flatten(tree_to_numpy(expected)),
        )
        self.assertEqual(len(actual), len(expected), msg)
        for a, e in zip(actual, expected, strict=True):
            np.testing.assert_allclose(
                np.asarray(a, dtype="float64"),
                np.asarray(e, dtype="float64"),
                atol=atol,
                rtol=rtol,
                err_msg=msg or "",
            )

    def assertAllFinite(self, structure, msg=None):
        for leaf in flatten(tree_to_numpy(structure)):
            leaf = np.asarray(leaf, dtype="float64")
            self.assertTrue(np.all(np.isfinite(leaf)), msg or f"non-finite: {leaf}")

    # -- the shared layer checks ----------------------------------------------

    def run_layer_test(
        self,
        layer_cls,
        init_kwargs: dict,
        input_data: dict,
        expected_output_shape,
        call_kwargs: dict | None = None,
        expected_num_trainable_weights: int | None = None,
        run_training_check: bool = True,
    ):
        """Eager call, symbolic (functional) call, `compute_output_shape`,
        jit-compiled call and one gradient step, with consistent results.

        `input_data` maps call argument names to arrays; the first one is
        passed positionally as Keras' "first argument".
        `expected_output_shape` is a shape or a tuple of shapes, matching the
        layer's output structure for `call_kwargs`.
        """
        call_kwargs = call_kwargs or {}
        layer = layer_cls(**init_kwargs)
        eager_out = layer(**input_data, **call_kwargs)
        shapes = [tuple(x.shape) for x in flatten(eager_out)]
        expected = (
            [tuple(expected_output_shape)]
            if isinstance(expected_output_shape[0], (int, type(None)))
            else [tuple(s) for s in expected_output_shape]
        )
        self.assertEqual(shapes, expected)
        self.assertAllFinite(eager_out)
        if expected_num_trainable_weights is not None:
            self.assertLen(layer.trainable_weights, expected_num_trainable_weights)

        # compute_output_shape of the plain output.
        if not call_kwargs:
            shape_args = {f"{k}_shape": v.shape for k, v in input_data.items()}
            try:
                out_shape = layer.compute_output_shape(**shape_args)
            except TypeError:
                out_shape = layer.compute_output_shape(*shape_args.values())
            self.assertEqual(tuple(out_shape), expected[0])

        # Symbolic call in a functional model gives the same values.
        inputs = symbolic_inputs(input_data)
        symbolic_layer = layer_cls(**init_kwargs)
        outputs = symbolic_layer(**inputs, **call_kwargs)
        for sym, want in zip(flatten(outputs), expected, strict=True):
            self.assertEqual(tuple(sym.shape)[1:], tuple(want)[1:])
        model = keras.Model(inputs, outputs)
        symbolic_layer.set_weights(layer.get_weights())
        self.assertAllClose(model(input_data), eager_out, atol=1e-5, rtol=1e-5)

        # A jit-compiled predict agrees with the eager call. On PyTorch,
        # Keras's own layer tests compile with "auto", which is eager there
        # (jit_compile=True is TorchDynamo, whose global guard cache spans
        # tests and which Keras does not test layers with).
        jit_compile = "auto" if keras.backend.backend() == "torch" else True
        model.compile(jit_compile=jit_compile)
        compiled = model.predict(input_data, verbose=0)
        self.assertAllClose(compiled, eager_out, atol=1e-4, rtol=1e-4)

        if run_training_check and layer.trainable_weights:
            self._check_gradients(layer, input_data, call_kwargs)
        return layer

    def _check_gradients(self, layer, input_data, call_kwargs):
        """Every trainable weight gets a finite gradient (TensorFlow, JAX and
        PyTorch backends)."""
        backend = keras.backend.backend()
        weights = layer.trainable_variables

        def loss_of(outputs):
            return sum(
                ops.sum(ops.square(ops.cast(o, "float32"))) for o in flatten(outputs)
            )

        if backend == "tensorflow":
            import tensorflow as tf

            with tf.GradientTape() as tape:
                loss = loss_of(layer(**input_data, **call_kwargs, training=True))
            grads = tape.gradient(loss, weights)
        elif backend == "jax":
            import jax

            values = [w.value for w in weights]

            def fn(vals):
                mapping = list(zip(weights, vals, strict=True))
                with keras.StatelessScope(state_mapping=mapping):
                    return loss_of(layer(**input_data, **call_kwargs, training=True))

            grads = jax.grad(fn)(values)
        elif backend == "torch":
            import torch

            loss = loss_of(layer(**input_data, **call_kwargs, training=True))
            grads = torch.autograd.grad(
                loss, [w.value for w in weights], allow_unused=True
            )
        else:
            raise NotImplementedError(backend)
        for weight, grad in zip(weights, grads, strict=True):
            self.assertIsNotNone(grad, f"no gradient for {weight.path}")
            self.assertAllFinite(grad, f"non-finite gradient for {weight.path}")

    def run_serialization_test(
        self,
        layer_cls,
        init_kwargs: dict,
        input_data: dict,
        call_kwargs: dict | None = None,
    ):
        """`get_config` covers every init argument, `from_config` round-trips,
        and a `.keras` save/load of a functional model gives identical outputs.
        """
        call_kwargs = call_kwargs or {}
        layer = layer_cls(**init_kwargs)
        config = layer.get_config()
        for name in init_kwargs:
            self.assertIn(name, config, f"get_config misses {name!r}")
        revived = layer_cls.from_config(config)
        self.assertEqual(
            json.dumps(revived.get_config(), sort_keys=True, default=str),
            json.dumps(config, sort_keys=True, default=str),
        )
        inputs = symbolic_inputs(input_data)
        outputs = layer(**inputs, **call_kwargs)
        model = keras.Model(inputs, outputs)
        expected = model(input_data)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "model.keras")
            model.save(path)
            loaded = keras.saving.load_model(path)
        self.assertAllClose(loaded(input_data), expected, atol=0, rtol=0)

    def run_precision_test(
        self,
        layer_cls,
        init_kwargs: dict,
        input_data: dict,
        call_kwargs: dict | None = None,
        atol: float | dict | None = None,
    ):
        """Under mixed_float16 and mixed_bfloat16: float32 variables, outputs in
        the compute dtype, finite, and close to the float32 outputs of the
        same weights: `|low - float32| <= t * (1 + |float32|)` elementwise.

        `t` per compute dtype, above the largest difference measured over
        every layer test that calls this (TensorFlow with 7 weight seeds,
        JAX with 3-4, PyTorch with 1; issue 43): float16 1.5e-3 and bfloat16
        9.6e-3 (MultiHeadAttention), so t = 3e-3 and 1.5e-2; the Transformer
        blocks stack more roundings (float16 2.2e-3, bfloat16 1.8e-2
        measured), so t = 6e-3 and 4e-2 for them. Attention logits 1.1 times
        too large in the low-precision call alone move the attention layers'
        outputs by t = 0.017 (BahdanauDecoder, bfloat16) to 0.12 (TensorFlow,
        seed 1337), so such a bug fails both halves. `atol`: a float (both
        dtypes) or `{compute dtype: t}`, for a layer that needs more, its
        measured difference in a comment.
        """
        from keras_attn.layers import TransformerDecoder, TransformerEncoder

        tolerances = {"float16": 3e-3, "bfloat16": 1.5e-2}
        if issubclass(layer_cls, (TransformerEncoder, TransformerDecoder)):
            tolerances = {"float16": 6e-3, "bfloat16": 4e-2}
        if isinstance(atol, dict):
            tolerances.update(atol)
        elif atol is not None:
            tolerances = dict.fromkeys(tolerances, atol)
        call_kwargs = call_kwargs or {}
        reference_layer = layer_cls(**init_kwargs)
        reference = reference_layer(**input_data, **call_kwargs)
        for policy, compute in (
            ("mixed_float16", "float16"),
            ("mixed_bfloat16", "bfloat16"),
        ):
            layer = layer_cls(**init_kwargs, dtype=policy)
            layer(**input_data, **call_kwargs)
            layer.set_weights(reference_layer.get_weights())
            outputs = layer(**input_data, **call_kwargs)
            for weight in layer.weights:
                if weight.trainable:
                    self.assertEqual(weight.dtype, "float32", weight.path)
            float_outputs = [
                o for o in flatten(outputs) if keras.backend.is_float_dtype(o.dtype)
            ]
            for output in float_outputs:
                self.assertEqual(
                    keras.backend.standardize_dtype(output.dtype), compute, policy
                )
            self.assertAllFinite(outputs, policy)
            tolerance = tolerances[compute]
            self.assertAllClose(
                [ops.cast(o, "float32") for o in flatten(outputs)],
                [ops.cast(o, "float32") for o in flatten(reference)],
                atol=tolerance,
                rtol=tolerance,
                msg=policy,
            )

    def run_saved_model_test(self, model: keras.Model, input_data):
        """`model.export()` then `tf.saved_model.load` in a fresh Python in which
        keras, keras_hub and keras_attn cannot be imported: same outputs."""
        if keras.backend.backend() != "tensorflow":
            raise RuntimeError("run_saved_model_test needs the TensorFlow backend")
        expected = flatten(tree_to_numpy(model(input_data)))
        with tempfile.TemporaryDirectory() as tmp:
            export_dir = os.path.join(tmp, "export")
            model.export(export_dir, verbose=False)
            inputs_path = os.path.join(tmp, "inputs.npz")
            flat_inputs = (
                input_data
                if isinstance(input_data, dict)
                else {f"input_{i}": x for i, x in enumerate(flatten(input_data))}
            )
            np.savez(inputs_path, **{k: np.asarray(v) for k, v in flat_inputs.items()})
            outputs_path = os.path.join(tmp, "outputs.npz")
            kind = (
                "dict"
                if isinstance(input_data, dict)
                else "list"
                if isinstance(input_data, (list, tuple))
                else "single"
            )
            script = textwrap.dedent(f"""
                import sys
                # TensorFlow would import keras on its own; block it and our
                # packages so that loading must work with TensorFlow alone.
                for blocked in ("keras", "keras_attn", "keras_hub", "keras_nlp"):
                    sys.modules[blocked] = None
                import numpy as np
                import tensorflow as tf
                loaded = tf.saved_model.load({export_dir!r})
                data = np.load({inputs_path!r})
                names = {list(flat_inputs)!r}
                args = [tf.constant(data[n]) for n in names]
                kind = {kind!r}
                if kind == "dict":
                    out = loaded.serve(dict(zip(names, args)))
                elif kind == "list":
                    out = loaded.serve(args)
                else:
                    out = loaded.serve(args[0])
                flat = tf.nest.flatten(out)
                np.savez({outputs_path!r}, *[np.asarray(t) for t in flat])
            """)
            result = subprocess.run(
                [sys.executable, "-c", script],
                capture_output=True,
                text=True,
                env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
                timeout=600,
            )
            self.assertEqual(result.returncode, 0, result.stderr[-3000:])
            got = np.load(outputs_path)
            got = [got[f"arr_{i}"] for i in range(len(got.files))]
        self.assertEqual(len(got), len(expected))
        for g, e in zip(got, expected, strict=True):
            np.testing.assert_allclose(g, e, atol=1e-5, rtol=1e-5)


# -- tiny BERT checkpoints, in Hugging Face's layout -----------------------------

BERT_VOCABULARY = [
    "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
    "the", "film", "plot", "is", "a", "great", "dull", "and", "but", "not",
    "un", "##aff", "##able", "!", ".", ",", "cafe", "fun", "##ny", "boring",
    "movie", "##s", "very", "good", "bad", "acting", "script",
]  # fmt: skip


def write_safetensors(path, tensors: dict) -> None:
    """A `.safetensors` file, written from the format's specification: an
    8-byte little-endian header size, a JSON header, the raw data."""
    codes = {"float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32"}
    header, chunks, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        data = array.astype(array.dtype.newbyteorder("<")).tobytes()
        header[name] = {
            "dtype": codes[array.dtype.name],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        chunks.append(data)
        offset += len(data)
    encoded = json.dumps(header).encode("utf-8")
    with open(path, "wb") as file:
        file.write(len(encoded).to_bytes(8, "little") + encoded + b"".join(chunks))


def bert_weights(config: dict, seed: int = 0) -> dict:
    """Random weights with BERT's names and PyTorch's (out, in) shapes."""
    rng = np.random.default_rng(seed)
    d, ff = config["hidden_size"], config["intermediate_size"]

    def normal(*shape, scale=0.2):
        return (scale * rng.standard_normal(shape)).astype("float32")

    weights = {
        "embeddings.position_ids": np.arange(
            config["max_position_embeddings"], dtype="int64"
        )[None],
        "embeddings.word_embeddings.weight": normal(config["vocab_size"], d),
        "embeddings.position_embeddings.weight": normal(
            config["max_position_embeddings"], d
        ),
        "embeddings.token_type_embeddings.weight": normal(2, d),
        "embeddings.LayerNorm.weight": 1 + normal(d, scale=0.1),
        "embeddings.LayerNorm.bias": normal(d, scale=0.1),
    }
    for index in range(config["num_hidden_layers"]):
        prefix = f"encoder.layer.{index}."
        for part in ("query", "key", "value"):
            weights[f"{prefix}attention.self.{part}.weight"] = normal(d, d)
            weights[f"{prefix}attention.self.{part}.bias"] = normal(d)
        for part, shape in (
            ("attention.output.dense", (d, d)),
            ("intermediate.dense", (ff, d)),
            ("output.dense", (d, ff)),
        ):
            weights[f"{prefix}{part}.weight"] = normal(*shape)
            weights[f"{prefix}{part}.bias"] = normal(shape[0])
        for part in ("attention.output", "output"):
            weights[f"{prefix}{part}.LayerNorm.weight"] = 1 + normal(d, scale=0.1)
            weights[f"{prefix}{part}.LayerNorm.bias"] = normal(d, scale=0.1)
    return weights


def write_bert_checkpoint(directory, seed: int = 0, **config_overrides):
    """A small random BERT checkpoint directory (config.json, vocab.txt,
    model.safetensors, tokenizer_config.json); returns its path."""
    os.makedirs(directory, exist_ok=True)
    config = {
        "model_type": "bert",
        "hidden_act": "gelu",
        "position_embedding_type": "absolute",
        "hidden_size": 16,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "intermediate_size": 32,
        "max_position_embeddings": 24,
        "vocab_size": len(BERT_VOCABULARY),
        "layer_norm_eps": 1e-12,
        "type_vocab_size": 2,
        **config_overrides,
    }
    with open(os.path.join(directory, "config.json"), "w") as file:
        json.dump(config, file)
    with open(os.path.join(directory, "vocab.txt"), "w", encoding="utf-8") as file:
        file.write("".join(f"{piece}\n" for piece in BERT_VOCABULARY))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as file:
        json.dump({"do_lower_case": True}, file)
    write_safetensors(
        os.path.join(directory, "model.safetensors"), bert_weights(config, seed)
    )
    return directory
