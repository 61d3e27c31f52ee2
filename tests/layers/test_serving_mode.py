"""`keras_attn.layers.serving_mode`: the encoder blocks' real-token rows and
the heads moved as integers, against the same calls outside the scope.

On TensorFlow (the scope changes nothing on the other backends, which the
last test checks wherever it runs)."""

from __future__ import annotations

import threading

import keras
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import keras_attn
from keras_attn.ops import serving
from tests.property_settings import property_settings

TENSORFLOW = keras.backend.backend() == "tensorflow"
# The serving layouts are TensorFlow's: deselected on the other backends.
needs_tensorflow = pytest.mark.tf_only


def _nodes(graph_def):
    """The nodes of a `GraphDef`, its library's functions' included (the
    attention path is chosen by a `cond` on the length: its branches)."""
    yield from graph_def.node
    for function in graph_def.library.function:
        yield from function.node_def


def serving_layouts(graph_def) -> set:
    """Which serving layouts a `GraphDef` holds: `"rows"`, the encoder's
    real-token rows (`padding_rows.real_rows`'s name scope), and
    `"bitcast"`, the heads moved as integers."""
    found = set()
    for node in _nodes(graph_def):
        if "real_rows/" in node.name:
            found.add("rows")
        if node.op == "Bitcast":
            found.add("bitcast")
    return found


def _block(seed=0, dtype="float32", **kwargs):
    options = dict(intermediate_dim=24, num_heads=2, dropout=0.0)
    options.update(kwargs)
    block = keras_attn.layers.TransformerEncoder(seed=seed, dtype=dtype, **options)
    block.build((None, None, 8))
    rng = np.random.default_rng(seed)
    block.set_weights(
        [
            rng.normal(scale=0.3, size=w.shape).astype("float32")
            for w in block.get_weights()
        ]
    )
    return block


def _inputs(batch, length, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, length, 8)).astype("float32")
    lengths = rng.integers(0, length + 1, size=batch)
    mask = np.arange(length)[None] < lengths[:, None]
    return x, mask


@needs_tensorflow
@pytest.mark.parametrize("normalize_first", [False, True])
def test_real_tokens_equal_the_plain_call_and_padding_is_zero(normalize_first):
    block = _block(normalize_first=normalize_first, activation="gelu")
    x, mask = _inputs(4, 7)
    mask[0] = True  # one full row, one row of no token at all
    mask[1] = False
    plain = np.asarray(block(x, padding_mask=mask))
    with keras_attn.layers.serving_mode():
        served = np.asarray(block(x, padding_mask=mask))
    np.testing.assert_allclose(served[mask], plain[mask], rtol=1e-5, atol=1e-5)
    assert np.all(served[~mask] == 0.0)
    assert np.any(plain[~mask] != 0.0)  # outside the scope: not zeros


@needs_tensorflow
@pytest.mark.parametrize(
    "options",
    [
        dict(position="rotary"),
        dict(position="alibi", sliding_window=2),
        dict(num_heads=4, num_key_value_heads=2, position="rotary"),
        dict(normalize_first=True, with_attention_mask=True),
    ],
    ids=["rotary", "alibi-window", "grouped-rotary", "pre-norm-attention-mask"],
)
def test_positions_windows_and_masks_on_the_rows(options):
    """Rotary and ALiBi positions, a window, grouped key/value heads and an
    attention mask: the attention reads the `(B, T)` grid as outside the
    scope, the per-token sublayers the real rows."""
    options = dict(options)
    with_attention_mask = options.pop("with_attention_mask", False)
    block = _block(seed=3, activation="gelu", **options)
    x, mask = _inputs(4, 9, seed=3)
    mask[0] = True
    attention_mask = None
    if with_attention_mask:
        attention_mask = np.random.default_rng(3).random((4, 9, 9)) < 0.6
    plain = np.asarray(block(x, padding_mask=mask, attention_mask=attention_mask))
    with keras_attn.layers.serving_mode():
        served = np.asarray(block(x, padding_mask=mask, attention_mask=attention_mask))
    np.testing.assert_allclose(served[mask], plain[mask], rtol=1e-5, atol=1e-5)
    assert np.all(served[~mask] == 0.0)


@needs_tensorflow
@pytest.mark.parametrize("rows", [1, 28, 300])
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("epsilon", [1e-12, 1e-3])
def test_layer_norm_of_rows_as_keras(rows, policy, epsilon):
    """`padding_rows.layer_norm` in a graph (as an export runs it), under
    each policy and a tiny epsilon: Keras's layer norm of the same rows."""
    import tensorflow as tf

    from keras_attn.layers import padding_rows

    layer = keras.layers.LayerNormalization(epsilon=epsilon, dtype=policy)
    layer.build((None, 64))
    rng = np.random.default_rng(rows)
    layer.set_weights(
        [
            rng.normal(1.0, 0.2, 64).astype("float32"),
            rng.normal(0, 0.2, 64).astype("float32"),
        ]
    )
    x = rng.normal(3.0, 2.0, (rows, 64)).astype("float32")
    x = tf.cast(x, layer.compute_dtype)
    plain = np.asarray(tf.cast(layer(x), "float32"))
    with keras_attn.layers.serving_mode():
        served = tf.function(lambda x: padding_rows.layer_norm(layer, x))(x)
    assert served.dtype == layer.compute_dtype
    tolerance = 1e-5 if policy == "float32" else 1e-2
    np.testing.assert_allclose(
        np.asarray(tf.cast(served, "float32")), plain, rtol=tolerance, atol=tolerance
    )


@needs_tensorflow
@pytest.mark.filterwarnings("ignore:You passed `rms_scaling=True`")
@pytest.mark.parametrize(
    "options", [dict(rms_scaling=True), dict(center=False), dict(scale=False)]
)
def test_other_layer_norms_of_rows_are_their_own_call(options):
    import tensorflow as tf

    from keras_attn.layers import padding_rows

    layer = keras.layers.LayerNormalization(**options)
    layer.build((None, 16))
    x = tf.constant(np.random.default_rng(0).normal(size=(200, 16)), tf.float32)
    with keras_attn.layers.serving_mode():
        served = padding_rows.layer_norm(layer, x)
    np.testing.assert_array_equal(np.asarray(served), np.asarray(layer(x)))


@needs_tensorflow
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
@pytest.mark.parametrize("normalize_first", [False, True])
def test_a_served_batch_of_many_rows(policy, normalize_first):
    """A batch of a few hundred real tokens (a served batch of reviews), in
    a `tf.function` as an export traces it."""
    import tensorflow as tf

    block = _block(seed=5, dtype=policy, normalize_first=normalize_first)
    x, mask = _inputs(12, 40, seed=5)
    mask[:8] = True
    assert mask.sum() >= 300
    plain = np.asarray(block(x, padding_mask=mask), dtype="float32")
    serve = tf.function(lambda x, m: block(x, padding_mask=m, training=False))
    with keras_attn.layers.serving_mode():
        served = np.asarray(serve(x, mask), dtype="float32")
    tolerance = 1e-5 if policy == "float32" else 3e-2
    np.testing.assert_allclose(
        served[mask], plain[mask], rtol=tolerance, atol=tolerance
    )
    assert np.all(served[~mask] == 0.0)


@needs_tensorflow
def test_in_a_tf_function_and_with_the_keras_mask():
    import tensorflow as tf

    tokens = keras.Input((None,), dtype="int32")
    x = keras_attn.layers.TokenAndPositionEmbedding(50, 16, 8, mask_zero=True)(tokens)
    x = _block(activation="gelu")(x)
    encoder = keras.Model(tokens, x)
    ids = np.array([[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4]], dtype="int32")
    plain = np.asarray(encoder(ids))

    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.int32)])
    def serve(ids):
        return encoder(ids, training=False)

    with keras_attn.layers.serving_mode():
        served = serve(ids).numpy()
    graph = serve.get_concrete_function().graph.as_graph_def()
    assert serving_layouts(graph) == {"rows", "bitcast"}
    plain_graph = tf.function(serve.python_function).get_concrete_function(
        tf.TensorSpec([None, None], tf.int32)
    )
    assert serving_layouts(plain_graph.graph.as_graph_def()) == set()
    real = ids != 0
    np.testing.assert_allclose(served[real], plain[real], rtol=1e-5, atol=1e-5)
    assert np.all(served[~real] == 0.0)


@needs_tensorflow
def test_training_calls_and_calls_without_a_mask_are_unchanged():
    block = _block()
    x, mask = _inputs(3, 5, seed=1)
    plain_training = np.asarray(block(x, padding_mask=mask, training=True))
    plain_unmasked = np.asarray(block(x))
    with keras_attn.layers.serving_mode():
        training = np.asarray(block(x, padding_mask=mask, training=True))
        unmasked = np.asarray(block(x))
    np.testing.assert_array_equal(training, plain_training)
    np.testing.assert_allclose(unmasked, plain_unmasked, rtol=1e-6, atol=1e-6)


@needs_tensorflow
def test_attention_scores_and_mixed_bfloat16():
    block = _block(dtype="mixed_bfloat16", activation="gelu")
    x, mask = _inputs(3, 6, seed=2)
    plain, plain_weights = block(x, padding_mask=mask, return_attention_scores=True)
    with keras_attn.layers.serving_mode():
        served, weights = block(x, padding_mask=mask, return_attention_scores=True)
    served, plain = (np.asarray(t, dtype="float32") for t in (served, plain))
    assert served.dtype == plain.dtype
    np.testing.assert_allclose(served[mask], plain[mask], rtol=2e-2, atol=2e-2)
    np.testing.assert_array_equal(np.asarray(weights), np.asarray(plain_weights))


@needs_tensorflow
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_transpose_moves_the_same_values(dtype):
    import tensorflow as tf

    x = tf.cast(np.random.default_rng(0).normal(size=(2, 3, 4, 5)), dtype)
    with keras_attn.layers.serving_mode():
        moved = serving.transpose(x, (0, 2, 1, 3))
        integers = serving.transpose(tf.range(120, dtype=tf.int32), (0,))
    assert moved.dtype == x.dtype
    np.testing.assert_array_equal(
        tf.bitcast(moved, tf.uint8).numpy(),
        tf.bitcast(tf.transpose(x, (0, 2, 1, 3)), tf.uint8).numpy(),
    )
    np.testing.assert_array_equal(integers.numpy(), np.arange(120))


def test_a_functional_model_builds_in_the_scope():
    with keras_attn.layers.serving_mode():
        tokens = keras.Input((None,), dtype="int32")
        x = keras_attn.layers.TokenAndPositionEmbedding(50, 16, 8, mask_zero=True)(
            tokens
        )
        x = keras_attn.layers.TransformerEncoder(intermediate_dim=16, num_heads=2)(x)
        encoder = keras.Model(tokens, x)
    assert encoder.output.shape == (None, None, 8)


def test_the_scope_nests_restores_and_stays_in_its_thread():
    assert not serving.in_serving_mode()
    seen = []
    with pytest.raises(RuntimeError):
        with keras_attn.layers.serving_mode():
            with keras_attn.ops.serving_mode():
                assert serving.in_serving_mode() == TENSORFLOW
            assert serving.in_serving_mode() == TENSORFLOW
            thread = threading.Thread(
                target=lambda: seen.append(serving.in_serving_mode())
            )
            thread.start()
            thread.join()
            raise RuntimeError("leaves the scope")
    assert not serving.in_serving_mode()
    assert seen == [False]


@needs_tensorflow
@given(
    data=st.data(),
    normalize_first=st.booleans(),
    activation=st.sampled_from(["relu", "gelu"]),
    num_heads=st.sampled_from([1, 2, 4]),
    policy=st.sampled_from(["float32", "mixed_bfloat16"]),
    position=st.sampled_from([None, "rotary", "alibi"]),
    grouped=st.booleans(),
    sliding_window=st.sampled_from([None, 1, 3]),
)
@property_settings(12, deadline=None)
def test_property_real_tokens_as_the_plain_call(
    data, normalize_first, activation, num_heads, policy, position, grouped,
    sliding_window,
):  # fmt: skip
    """Random blocks (heads, key/value heads, positions, window) under random
    padding and attention masks: the real tokens as outside the scope."""
    batch = data.draw(st.integers(1, 4), label="batch")
    length = data.draw(st.integers(1, 12), label="length")
    mask = np.array(
        data.draw(
            st.lists(
                st.lists(st.booleans(), min_size=length, max_size=length),
                min_size=batch,
                max_size=batch,
            ),
            label="mask",
        )
    )
    attention_mask = None
    if data.draw(st.booleans(), label="with an attention mask"):
        attention_mask = np.random.default_rng(batch).random((batch, length, length))
        attention_mask = attention_mask < 0.7
    block = _block(
        seed=batch * 13 + length,
        dtype=policy,
        normalize_first=normalize_first,
        activation=activation,
        num_heads=num_heads,
        num_key_value_heads=1 if grouped else None,
        position=position,
        sliding_window=sliding_window,
    )
    x = np.random.default_rng(length).normal(size=(batch, length, 8)).astype("float32")
    masks = dict(padding_mask=mask, attention_mask=attention_mask)
    plain = np.asarray(block(x, **masks), dtype="float32")
    with keras_attn.layers.serving_mode():
        served = np.asarray(block(x, **masks), dtype="float32")
    tolerance = 1e-5 if policy == "float32" else 3e-2
    np.testing.assert_allclose(
        served[mask], plain[mask], rtol=tolerance, atol=tolerance
    )
    assert np.all(served[~mask] == 0.0)
    assert np.all(np.isfinite(served))


@needs_tensorflow
def test_classify_is_traced_in_serving_mode(small_tokenizer):
    """`TextClassifier.classify`'s compiled forward is the export's graph:
    traced in serving mode, and a batch of mixed lengths answers as each
    text alone."""
    from keras_attn.models import TextClassifier

    model = TextClassifier(
        small_tokenizer.vocabulary_size,
        16,
        embedding_dim=16,
        num_layers=2,
        num_heads=2,
        intermediate_dim=32,
        activation="gelu",
        tokenizer=small_tokenizer,
    )
    texts = ["a", "the plot is thin and the acting slow", "", "a gorgeous witty film"]
    together = model.classify(texts, batch_size=4)["positive_probability"]
    alone = [model.classify([t])["positive_probability"][0] for t in texts]
    np.testing.assert_allclose(together, alone, atol=1e-5)
    # The kept forward of the 16-token bucket: NumPy around a `tf.function`.
    _, kept = model.__dict__["_task_cache"][("compiled_forward", 16)]
    (cell,) = kept.__closure__
    function = cell.cell_contents
    graph_def = function.get_concrete_function().graph.as_graph_def()
    assert serving_layouts(graph_def) == {"rows", "bitcast"}
