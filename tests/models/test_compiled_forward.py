"""`_task.compiled_forward`, the network call of the task methods: the model's
answer for any number of rows, on TensorFlow and on JAX, with the weights of
the moment (this module runs on JAX in `make test-backends`)."""

import keras
import numpy as np

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
