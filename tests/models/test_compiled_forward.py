"""`_task.compiled_forward`, the network call of the task methods: the model's
answer for any number of rows, on TensorFlow and on JAX, with the weights of
the moment (this module runs on JAX in `make test-backends`)."""

import keras
import numpy as np
import pytest

from keras_attn import generation
from keras_attn.models import _task


def small_model():
    ids = keras.Input((None,), dtype="int32")
    hidden = keras.layers.Embedding(50, 8, mask_zero=True)(ids)
    pooled = keras.layers.GlobalAveragePooling1D()(hidden)
    return keras.Model(ids, keras.layers.Dense(2)(pooled))


def test_rows_are_padded_to_powers_of_two():
    assert [_task.bucket_rows(n) for n in (1, 2, 3, 5, 64, 65)] == [1, 2, 4, 8, 64, 128]


def test_the_compiled_pass_answers_as_the_model_for_any_rows_and_new_weights():
    model = small_model()
    rng = np.random.default_rng(0)
    forward = _task.compiled_forward(model, 8)
    assert _task.compiled_forward(model, 8) is forward  # kept per width
    assert _task.compiled_forward(model, 16) is not forward
    for rows in (1, 3, 5, 8):
        ids = rng.integers(0, 50, (rows, 8)).astype("int32")
        got = forward(ids)
        assert isinstance(got, np.ndarray) and got.shape == (rows, 2)
        np.testing.assert_allclose(
            got, keras.ops.convert_to_numpy(model(ids)), atol=1e-6
        )
    before = forward(ids)
    model.layers[-1].kernel.assign(np.ones((8, 2), "float32"))
    after = forward(ids)
    np.testing.assert_allclose(after, keras.ops.convert_to_numpy(model(ids)), atol=1e-6)
    assert not np.allclose(after, before)


def test_the_translators_compiled_decoding_reads_new_weights():
    """`translate`'s decoding is compiled once per setting (`tf.function`,
    `jax.jit`) and kept: weights set afterwards are the ones it decodes with,
    as the eager decoding does."""
    from keras_attn.models import TransformerTranslator

    model = TransformerTranslator(
        30, 30, sequence_length=9, embedding_dim=16, num_encoder_layers=1,
        num_decoder_layers=1, num_heads=2, intermediate_dim=32,
        shared_vocabulary=True,
    )  # fmt: skip
    ids = np.array([[5, 6, 7, 8, 0, 0, 0, 0], [9, 10, 0, 0, 0, 0, 0, 0]], "int32")
    decode = model._compiled_decoding(8, 2, 1.0, None, source_width=8)
    first = keras.ops.convert_to_numpy(decode(ids)[0])
    np.testing.assert_array_equal(
        first, keras.ops.convert_to_numpy(model.translate_ids(ids, 8, 2, 1.0)[0])
    )
    rng = np.random.default_rng(0)
    model.set_weights(
        [rng.normal(size=w.shape).astype("float32") for w in model.get_weights()]
    )
    decode = model._compiled_decoding(8, 2, 1.0, None, source_width=8)
    again = keras.ops.convert_to_numpy(decode(ids)[0])
    eager = keras.ops.convert_to_numpy(model.translate_ids(ids, 8, 2, 1.0)[0])
    np.testing.assert_array_equal(again, eager)
    assert not np.array_equal(again, first)  # the new weights decode otherwise


def _tiny_language_model():
    from keras_attn.models import TransformerLanguageModel

    return TransformerLanguageModel(
        40, sequence_length=12, embedding_dim=16, num_layers=1, num_heads=2,
        intermediate_dim=32,
    )  # fmt: skip


def _counting_generate_ids(model):
    """Count the Python runs of `model.generate_ids` (a compiled function
    runs it once per trace)."""
    runs = []
    original = model.generate_ids

    def counted(*args, **kwargs):
        runs.append(1)
        return original(*args, **kwargs)

    object.__setattr__(model, "generate_ids", counted)
    return runs


def test_the_language_models_generation_is_compiled_once_and_reused():
    """`generate`'s decoding loop is compiled once per setting and reused by
    later calls (`tf.function` on TensorFlow, `jax.jit` on JAX; eager on
    PyTorch), and answers as the eager loop."""
    import tensorflow as tf

    model = _tiny_language_model()
    runs = _counting_generate_ids(model)
    prompts = tf.ragged.constant([[5, 6, 7], [8]], dtype=tf.int32)
    first = model.continue_ids(prompts, max_new_tokens=4).to_list()
    again = model.continue_ids(prompts, max_new_tokens=4).to_list()
    # Traced once, then reused; PyTorch runs the loop eagerly each time.
    assert len(runs) == (2 if keras.backend.backend() == "torch" else 1)
    assert first == again and [len(row) for row in first] == [4, 4]
    # The eager loop's answer (the prompt padded as continue_ids pads it).
    prompt = np.array([[2, 5, 6, 7], [2, 8, 0, 0]], "int32")  # START_ID 2
    eager = keras.ops.convert_to_numpy(
        model.generate_ids(prompt, 8, prompt_lengths=np.array([4, 2], "int32"))
    )
    assert first == [eager[0, 4:8].tolist(), eager[1, 2:6].tolist()]


def test_compiled_task_functions_use_the_quantized_weights():
    """After `quantize`, the kept compiled functions are rebuilt: the answers
    are the quantized model's (a trace would keep the float kernels)."""
    import tensorflow as tf

    model = small_model()
    ids = np.random.default_rng(1).integers(1, 50, (3, 8)).astype("int32")
    forward = _task.compiled_forward(model, 8)
    float_answer = forward(ids)
    model.quantize("int8")
    quantized = keras.ops.convert_to_numpy(model(ids))
    assert not np.array_equal(quantized, float_answer)
    np.testing.assert_allclose(
        _task.compiled_forward(model, 8)(ids), quantized, atol=1e-6
    )

    language_model = _tiny_language_model()
    rng = np.random.default_rng(2)
    language_model.set_weights(
        [
            rng.normal(size=w.shape).astype("float32")
            for w in language_model.get_weights()
        ]
    )
    prompts = tf.ragged.constant([[5, 6, 7], [8]], dtype=tf.int32)
    language_model.continue_ids(prompts, max_new_tokens=6)  # compiled, kept
    language_model.quantize("int8")
    runs = _counting_generate_ids(language_model)
    after = language_model.continue_ids(prompts, max_new_tokens=6).to_list()
    assert len(runs) == 1  # compiled again, for the quantized variables
    prompt = np.array([[2, 5, 6, 7], [2, 8, 0, 0]], "int32")  # START_ID 2
    eager = keras.ops.convert_to_numpy(
        language_model.generate_ids(
            prompt, 10, prompt_lengths=np.array([4, 2], "int32")
        )
    )
    assert after == [eager[0, 4:10].tolist(), eager[1, 2:8].tolist()]


def mixed_language_model(**kwargs):
    """A small language model under `mixed_bfloat16` with random weights:
    its float32 variables are cast to bfloat16 at each layer call."""
    from keras_attn.models import TransformerLanguageModel

    model = TransformerLanguageModel(
        40, 16, embedding_dim=16, num_layers=2, num_heads=2, intermediate_dim=32,
        dtype="mixed_bfloat16", **kwargs,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    model.set_weights(
        [rng.normal(0.0, 0.3, w.shape).astype(w.dtype) for w in model.get_weights()]
    )
    return model


def cached_steps(model, ids, steps=3):
    """Logits of a prompt pass and `steps` one-token passes over the cache."""
    cache = model.initial_cache(ids.shape[0], 16)
    logits, cache = model.call_with_cache(ids, cache, 0)
    found = [logits]
    token = ids[:, -1:]
    for step in range(steps):
        logits, cache = model.call_with_cache(token, cache, ids.shape[1] + step)
        found.append(logits)
        token = keras.ops.cast(keras.ops.argmax(logits[:, -1:], axis=-1), "int32")
    return [keras.ops.convert_to_numpy(x) for x in found]


def test_weights_read_once_are_keras_own_reads_bit_for_bit():
    """Inside `WeightsReadOnce` a layer gets the tensors read (and cast to
    its compute dtype) at the scope's start: the same values as Keras' own
    reads, bit for bit, float32 norms and heads included."""
    model = mixed_language_model()
    ids = np.array([[5, 6, 7, 8], [9, 10, 11, 1]], "int32")
    expected = cached_steps(model, ids)
    with generation.WeightsReadOnce([model]) as scope:
        found = cached_steps(model, ids)
    for got, want in zip(found, expected, strict=True):
        np.testing.assert_array_equal(got, want)
    kernel = model.backbone.trainable_variables[1]  # read as bfloat16
    assert (id(kernel), "bfloat16") in scope._values
    assert (id(kernel), "float32") in scope._values


def test_assignments_in_the_scope_reach_the_variables():
    """A layer that updates its state in `call` (a seed generator, a
    counter) assigns the variable itself, and later reads see the update."""

    class Counter(keras.layers.Layer):
        def build(self, input_shape):
            self.count = self.add_weight(shape=(), initializer="zeros", trainable=False)

        def call(self, x):
            self.count.assign(self.count + 1.0)
            return x * self.count

    layer = Counter()
    layer.build((1,))
    model = keras.Sequential([layer])
    model.build((None, 1))
    x = np.ones((1, 1), "float32")
    with generation.WeightsReadOnce([model]):
        first = keras.ops.convert_to_numpy(layer(x))
        second = keras.ops.convert_to_numpy(layer(x))
    assert first[0, 0] == 1.0 and second[0, 0] == 2.0
    assert float(keras.ops.convert_to_numpy(layer.count.value)) == 2.0


def loop_body_nodes(fn, spec):
    """The nodes of the `tf.while_loop` bodies in `fn`'s trace for `spec`."""
    graph = fn.get_concrete_function(spec).graph.as_graph_def()
    library = graph.library.function
    bodies = {
        node.attr["body"].func.name
        for function in [*library, graph]
        for node in getattr(function, "node_def", getattr(function, "node", []))
        if node.op in ("While", "StatelessWhile")
    }
    assert bodies
    return [
        node
        for function in library
        if function.signature.name in bodies
        for node in function.node_def
    ]


def decoding_of(model):
    """A builder of a greedy decoding of 3 steps after a prompt of 4 tokens
    (2 rows) over `model`'s cache, in a `keras.ops.while_loop`."""

    def build():
        def decode(ids):
            cache = model.initial_cache(2, 16)
            _, cache = model.call_with_cache(ids, cache, 0)

            def body(step, token, cache):
                logits, cache = model.call_with_cache(token, cache, 4 + step)
                token = keras.ops.cast(keras.ops.argmax(logits, axis=-1), "int32")
                return step + 1, token, cache

            return keras.ops.while_loop(
                lambda step, token, cache: step < 3, body, (0, ids[:, -1:], cache)
            )[1]

        return decode

    return build


def test_a_compiled_decoding_loop_reads_no_variable_per_step():
    """On TensorFlow a compiled decoding (`_task.compiled`) reads and casts
    the weights once per call: the `tf.while_loop`'s body reads no
    variable, where the same loop without the scope reads them all at
    every step."""
    if keras.backend.backend() != "tensorflow":
        return  # JAX's compiled loops hoist the reads; PyTorch has no graph
    import tensorflow as tf

    model = mixed_language_model()
    build = decoding_of(model)

    def reads_in_loop_bodies(fn):
        nodes = loop_body_nodes(fn, tf.TensorSpec((2, 4), tf.int32))
        return sum(node.op == "ReadVariableOp" for node in nodes)

    compiled = _task.compiled(model, "decode", build)
    assert reads_in_loop_bodies(compiled) == 0
    assert reads_in_loop_bodies(tf.function(build())) > 0
    ids = np.array([[5, 6, 7, 8], [9, 10, 11, 1]], "int32")
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(compiled(ids)),
        keras.ops.convert_to_numpy(build()(ids)),
    )


def test_a_nested_scope_reads_the_outer_scopes_values():
    """Inside another `keras.StatelessScope` (a `stateless_call`), the
    weights read once are the outer scope's values, and so are the other
    layers' weights."""
    model = small_model()
    other = keras.layers.Dense(2)
    other.build((None, 2))
    ids = np.array([[1, 2, 3]], "int32")
    ones = [
        (v, np.ones(v.shape, v.dtype)) for v in [*model.variables, *other.variables]
    ]
    with keras.StatelessScope(state_mapping=ones):
        expected = keras.ops.convert_to_numpy(other(model(ids)))
        with generation.WeightsReadOnce([model]):
            found = keras.ops.convert_to_numpy(other(model(ids)))
    np.testing.assert_array_equal(found, expected)
    assert not np.allclose(found, keras.ops.convert_to_numpy(other(model(ids))))


def test_weights_read_once_refuses_what_is_not_a_layer():
    with pytest.raises(ValueError, match="`layers` must hold Keras layers"):
        generation.WeightsReadOnce([np.ones(3)])


@pytest.mark.parametrize("dtype", ["float32", "mixed_bfloat16"])
def test_the_tied_projection_transposes_its_table_once_per_call(dtype):
    """On TensorFlow a compiled decoding lays out the tied output
    projection's `(d, V)` table once, at the scope's start: the loop body
    multiplies it as it is (no transpose of the table folded into each
    step's product), with the logits of Keras's own `reverse` call."""
    if keras.backend.backend() != "tensorflow":
        return  # the table is laid out on TensorFlow only
    import tensorflow as tf

    from keras_attn.layers.token_and_position_embedding import reverse_table
    from keras_attn.models.precision import with_precision

    model = mixed_language_model()
    if dtype == "float32":
        model = with_precision(model, "float32")
    embedding = model.backbone.embedding.token_embedding
    assert reverse_table(embedding) is None  # outside any scope
    with generation.WeightsReadOnce([model]) as scope:
        table = reverse_table(embedding)
        # Keras's embeddings do not autocast: the table as the variable holds
        # it, float32 under a mixed policy too (whose logits are float32).
        expected = keras.ops.transpose(embedding.embeddings.value)
        assert keras.backend.standardize_dtype(table.dtype) == "float32"
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(table), keras.ops.convert_to_numpy(expected)
        )
        with keras.StatelessScope():  # not the innermost scope: not used
            assert reverse_table(embedding) is None
    assert id(embedding) in scope._tables

    build = decoding_of(model)

    def table_transposes(fn):
        return [
            node.name
            for node in loop_body_nodes(fn, tf.TensorSpec((2, 4), tf.int32))
            if node.op == "Transpose" and "token_embedding" in node.name
        ]

    compiled = _task.compiled(model, "decode", build)
    assert table_transposes(compiled) == []
    assert len(table_transposes(tf.function(build()))) == 1
    ids = np.array([[5, 6, 7, 8], [9, 10, 11, 1]], "int32")
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(compiled(ids)),
        keras.ops.convert_to_numpy(build()(ids)),
    )
    # The logits themselves, in a graph (the products may sum in another
    # order than the folded transpose's).
    hidden = np.random.default_rng(1).normal(size=(3, 1, 16)).astype("float32")

    @tf.function
    def logits(x):
        with generation.WeightsReadOnce([model]):
            return model.backbone.embedding(x, reverse=True)

    found, want = logits(hidden), model.backbone.embedding(hidden, reverse=True)
    assert found.dtype == want.dtype
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(found),
        keras.ops.convert_to_numpy(want),
        rtol=1e-5,
        atol=1e-5,
    )


def test_embeddings_the_scope_does_not_lay_out():
    """Untied, quantized and LoRA tables keep Keras's own reverse call."""
    if keras.backend.backend() != "tensorflow":
        return
    from keras_attn.layers.token_and_position_embedding import reverse_table

    layers = {}
    for name in ("untied", "int8", "lora", "tied"):
        layer = keras.layers.ReversibleEmbedding(
            20, 8, tie_weights=name != "untied", name=name
        )
        layer.build((None, 3))
        if name == "int8":
            layer.quantize("int8")
        if name == "lora":
            layer.enable_lora(2)
        layers[name] = layer
    with generation.WeightsReadOnce(list(layers.values())):
        found = {name: reverse_table(one) is not None for name, one in layers.items()}
    assert found == {"untied": False, "int8": False, "lora": False, "tied": True}
