"""`sequence_length_bound`: an unknown length bounded below the switch-over
takes the explicit path alone, where the graph would otherwise hold both
paths and a switch between them; the backbones and the translator enter it
where their positions bound their inputs, with the same answers."""

import numpy as np
import pytest
from keras import ops

import keras_attn.ops.attention as attention_module
from keras_attn.layers import MultiHeadSelfAttention
from keras_attn.models import (
    TransformerDecoderBackbone,
    TransformerEncoderBackbone,
    TransformerTranslator,
)
from keras_attn.ops import attention_path, sequence_length_bound, switch_over_length
from keras_attn.ops.attention_paths import length_bound
from tests.test_case import to_numpy

RNG = np.random.default_rng(41)


@pytest.fixture
def blocked_traces(monkeypatch):
    """How many times the memory-efficient path is built (traced or run)."""
    count = [0]
    function = attention_module.memory_efficient_attention

    def spy(*args, **kwargs):
        count[0] += 1
        return function(*args, **kwargs)

    monkeypatch.setattr(attention_module, "memory_efficient_attention", spy)
    return count


def test_an_unknown_length_under_a_bound_below_the_switch_over_is_explicit():
    unknown = {"query_length": None, "key_length": None}
    assert attention_path(**unknown) == "by_length"
    with sequence_length_bound(switch_over_length("float32") - 1):
        assert attention_path(**unknown) == "explicit"
        assert attention_path(query_length=None, key_length=5000) == "by_length"
        assert attention_path(query_length=8, key_length=5000) == "memory_efficient"
        assert attention_path(flash_attention=True, **unknown) == "memory_efficient"
    with sequence_length_bound(switch_over_length("float32")):
        assert attention_path(**unknown) == "by_length"
        assert attention_path(query_length=8, key_length=None) == "by_length"
    # bfloat16's switch-over is longer: the same bound is below it.
    with sequence_length_bound(switch_over_length("float32")):
        assert attention_path(dtype="bfloat16", **unknown) == "explicit"
    assert attention_path(**unknown) == "by_length"


def test_nested_bounds_keep_the_tightest_and_none_adds_none():
    assert length_bound() is None
    with sequence_length_bound(100):
        with sequence_length_bound(None):
            assert length_bound() == 100
        with sequence_length_bound(500):
            assert length_bound() == 100
        with sequence_length_bound(20):
            assert length_bound() == 20
        assert length_bound() == 100
    assert length_bound() is None


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "64"])
def test_a_bad_bound_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="max_length"):
        with sequence_length_bound(bad):
            pass
    assert length_bound() is None


@pytest.mark.tf_only
def test_a_traced_layer_under_a_bound_holds_the_explicit_path_alone(blocked_traces):
    import tensorflow as tf

    layer = MultiHeadSelfAttention(num_heads=2, causal=True)
    x = RNG.normal(size=(2, 9, 8)).astype("float32")
    eager = to_numpy(layer(x))
    spec = tf.TensorSpec((None, None, 8), "float32")

    def traced():
        return tf.function(lambda x: layer(x), input_signature=[spec])

    unbounded = traced()
    unbounded.get_concrete_function()
    assert blocked_traces[0] == 1  # both paths in the graph
    bounded = traced()
    with sequence_length_bound(64):
        bounded.get_concrete_function()
    assert blocked_traces[0] == 1  # the explicit path alone
    np.testing.assert_allclose(to_numpy(bounded(x)), eager, atol=1e-6)
    np.testing.assert_allclose(to_numpy(unbounded(x)), eager, atol=1e-6)


SIZES = dict(embedding_dim=16, num_layers=1, num_heads=2, intermediate_dim=32)


def _encoder(position):
    return TransformerEncoderBackbone(
        vocabulary_size=50, sequence_length=32, position=position, **SIZES
    )


def _decoder(**options):
    return TransformerDecoderBackbone(
        vocabulary_size=30, sequence_length=24, **SIZES, **options
    )


def test_backbones_are_bounded_where_their_positions_bound_the_input():
    assert _encoder("sinusoidal").longest_input() == 32
    assert _encoder("learned").longest_input() == 32
    assert _encoder("rotary").longest_input() is None
    assert _encoder("alibi").longest_input() is None
    assert _decoder().longest_input() == 24
    # Cross-attention reads the encoder's states: another stack's length.
    assert _decoder(cross_attention=True).longest_input() is None


def _translator(position="sinusoidal", source_sequence_length=None):
    if position == "rotary":  # an encoder backbone of its own
        return TransformerTranslator(
            backbone=_encoder("rotary"),
            decoder_backbone=_decoder(cross_attention=True),
        )
    return TransformerTranslator(
        source_vocabulary_size=40,
        target_vocabulary_size=30,
        sequence_length=20,
        source_sequence_length=source_sequence_length,
        position=position,
        **SIZES,
    )


def test_the_translator_is_bounded_by_its_longer_stack():
    assert _translator().longest_input() == 20
    assert _translator(source_sequence_length=50).longest_input() == 50
    assert _translator(position="rotary").longest_input() is None


@pytest.mark.tf_only
@pytest.mark.parametrize(
    ("position", "blocked"), [("sinusoidal", 0), ("learned", 0), ("rotary", 1)]
)
def test_a_backbone_traced_with_unknown_lengths(position, blocked, blocked_traces):
    import tensorflow as tf

    backbone = _encoder(position)
    ids = RNG.integers(1, 50, size=(2, 11)).astype("int32")
    ids[1, 7:] = 0
    eager = to_numpy(backbone(ids))
    blocked_traces[0] = 0
    encode = tf.function(
        lambda ids: backbone(ids),
        input_signature=[tf.TensorSpec((None, None), "int32")],
    )
    np.testing.assert_allclose(to_numpy(encode(ids)), eager, atol=1e-5)
    assert blocked_traces[0] == blocked


@pytest.mark.tf_only
def test_a_translator_trains_with_unknown_lengths_on_the_explicit_path_alone(
    blocked_traces,
):
    import tensorflow as tf

    model = _translator(source_sequence_length=30)
    source = RNG.integers(1, 40, size=(3, 13)).astype("int32")
    target = RNG.integers(1, 30, size=(3, 9)).astype("int32")
    inputs = {"encoder_inputs": source, "decoder_inputs": target}
    eager = to_numpy(model(inputs))
    blocked_traces[0] = 0
    spec = tf.TensorSpec((None, None), "int32")

    @tf.function(input_signature=[spec, spec])
    def loss_and_gradients(source, target):
        with tf.GradientTape() as tape:
            logits = model(
                {"encoder_inputs": source, "decoder_inputs": target}, training=True
            )
            loss = tf.reduce_mean(tf.square(logits))
        return logits, tape.gradient(loss, model.trainable_variables)

    logits, gradients = loss_and_gradients(source, target)
    assert blocked_traces[0] == 0  # encoder, decoder and cross-attention
    assert all(gradient is not None for gradient in gradients)
    states, _ = model.call_with_states(inputs)
    assert blocked_traces[0] == 0
    np.testing.assert_allclose(to_numpy(model(inputs)), eager, atol=1e-5)
    assert np.isfinite(to_numpy(logits)).all()
    assert ops.shape(states) == (3, 9, 16)


@pytest.mark.tf_only
def test_a_translator_with_a_rotary_encoder_keeps_the_switch_by_length(blocked_traces):
    import tensorflow as tf

    model = _translator(position="rotary")
    spec = tf.TensorSpec((None, None), "int32")
    translate = tf.function(
        lambda source, target: model(
            {"encoder_inputs": source, "decoder_inputs": target}
        ),
        input_signature=[spec, spec],
    )
    translate.get_concrete_function()
    # The encoder's and the decoder's self-attention and the cross-attention
    # (a decoder with cross-attention sets no bound of its own).
    assert blocked_traces[0] == 3
