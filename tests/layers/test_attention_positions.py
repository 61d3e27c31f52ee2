"""Rotary positions and ALiBi inside `MultiHeadAttention` and the blocks,
with grouped-query attention, the KV cache and `sliding_window`.

References are computed independently: keras-hub's `RotaryEmbedding` and
`AlibiBias` on heads projected with the layer's own weights, then attention
in NumPy."""

import keras
import numpy as np
import pytest
from keras import ops

from keras_attn.layers import (
    AlibiBias,
    MultiHeadAttention,
    MultiHeadSelfAttention,
    RotaryEmbedding,
    TransformerDecoderBlock,
    TransformerEncoderBlock,
)

BATCH, LENGTH, WIDTH, HEADS, HEAD_DIM = 2, 7, 32, 4, 8


def inputs(seed=0, length=LENGTH):
    return (
        np.random.RandomState(seed)
        .normal(size=(BATCH, length, WIDTH))
        .astype("float32")
    )


def numpy(x):
    return np.asarray(ops.convert_to_numpy(x), dtype="float64")


def reference(layer, x, causal, rotary=False, alibi=False, window=None):
    """Self-attention of `layer` over `x` in NumPy, positions by keras-hub."""
    import keras_hub

    query = layer.query_dense(x)  # (B, T, N, H)
    key = layer.key_dense(x)  # (B, T, K, H)
    value = numpy(layer.value_dense(x))
    if rotary:
        rope = keras_hub.layers.RotaryEmbedding()
        query, key = rope(query), rope(key)
    query, key = numpy(query), numpy(key)
    groups = HEADS // key.shape[2]
    key, value = np.repeat(key, groups, axis=2), np.repeat(value, groups, axis=2)
    scores = np.einsum("bqnh,bknh->bnqk", query, key) / np.sqrt(HEAD_DIM)
    if alibi:
        scores = numpy(keras_hub.layers.AlibiBias()(ops.convert_to_tensor(scores)))
    positions = np.arange(x.shape[1])
    allowed = np.ones((x.shape[1],) * 2, bool)
    if causal:
        allowed &= positions[None, :] <= positions[:, None]
    if window is not None:
        allowed &= np.abs(positions[:, None] - positions[None, :]) < window
    scores = np.where(allowed, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    attended = np.einsum("bnqk,bknh->bqnh", weights, value)
    return numpy(layer.output_dense(ops.convert_to_tensor(attended, "float32")))


@pytest.mark.parametrize("key_value_heads", [None, 2, 1])
@pytest.mark.parametrize("position", ["rotary", "alibi"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("flash_attention", [False, True])
def test_equals_keras_hub_positions_on_projected_heads(
    key_value_heads, position, causal, flash_attention
):
    """Explicit and memory-efficient paths, full and grouped heads."""
    layer = MultiHeadSelfAttention(
        HEADS,
        causal=causal,
        flash_attention=flash_attention,
        num_key_value_heads=key_value_heads,
        **(
            {"rotary_embedding": RotaryEmbedding()}
            if position == "rotary"
            else {"alibi_bias": AlibiBias()}
        ),
    )
    x = inputs()
    got = numpy(layer(x))
    want = reference(
        layer, x, causal, rotary=position == "rotary", alibi=position == "alibi"
    )
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("position", ["rotary", "alibi"])
def test_with_a_sliding_window(position):
    layer = MultiHeadSelfAttention(
        HEADS,
        causal=True,
        sliding_window=3,
        num_key_value_heads=2,
        **(
            {"rotary_embedding": RotaryEmbedding()}
            if position == "rotary"
            else {"alibi_bias": AlibiBias()}
        ),
    )
    x = inputs(1)
    got = numpy(layer(x))
    want = reference(
        layer,
        x,
        True,
        rotary=position == "rotary",
        alibi=position == "alibi",
        window=3,
    )
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("position", ["rotary", "alibi"])
@pytest.mark.parametrize("cache_form", ["tuple", "stacked"])
def test_cached_decoding_equals_the_whole_sequence(position, cache_form):
    """One token at a time, and a prompt of 3 then one at a time: the
    positions follow `cache_update_index`."""
    block = TransformerDecoderBlock(
        64, HEADS, num_key_value_heads=2, position=position, sliding_window=4
    )
    x = inputs(2)
    full = numpy(block(x))
    for chunks in ([1] * LENGTH, [3] + [1] * (LENGTH - 3)):
        shape = (BATCH, LENGTH, 2, HEAD_DIM)
        if cache_form == "tuple":
            cache = (np.zeros(shape, "float32"), np.zeros(shape, "float32"))
        else:
            cache = np.zeros((BATCH, 2, *shape[1:]), "float32")
        outputs, start = [], 0
        for size in chunks:
            index = {
                "tuple": {"cache_update_index": start},
                "stacked": {"self_attention_cache_update_index": start},
            }[cache_form]
            output, cache = block(
                x[:, start : start + size], self_attention_cache=cache, **index
            )
            outputs.append(numpy(output))
            start += size
        np.testing.assert_allclose(np.concatenate(outputs, 1), full, atol=2e-5)


def test_the_cache_holds_rotated_keys_of_the_key_value_heads():
    layer = MultiHeadAttention(
        HEADS, HEAD_DIM, num_key_value_heads=2, rotary_embedding=RotaryEmbedding()
    )
    x = inputs(3)
    cache = (
        np.zeros((BATCH, LENGTH, 2, HEAD_DIM), "float32"),
        np.zeros((BATCH, LENGTH, 2, HEAD_DIM), "float32"),
    )
    _, (keys, values) = layer(
        x[:, 2:5], x[:, 2:5], cache=cache, cache_update_index=2, use_causal_mask=True
    )
    rotated = layer.rotary_embedding(layer.key_dense(x[:, 2:5]), start_index=2)
    np.testing.assert_allclose(numpy(keys)[:, 2:5], numpy(rotated), atol=1e-6)
    np.testing.assert_allclose(numpy(keys)[:, :2], 0.0)
    np.testing.assert_allclose(
        numpy(values)[:, 2:5], numpy(layer.value_dense(x[:, 2:5])), atol=1e-6
    )
    # `compute_key_value` (cross-attention keys) rotates from position 0.
    keys, _ = layer.compute_key_value(x)
    np.testing.assert_allclose(
        numpy(keys), numpy(layer.rotary_embedding(layer.key_dense(x))), atol=1e-6
    )


def test_config_round_trip_and_keras_loadable_without_positions():
    layer = MultiHeadAttention(
        HEADS, HEAD_DIM, rotary_embedding=RotaryEmbedding(max_wavelength=500)
    )
    config = layer.get_config()
    restored = MultiHeadAttention.from_config(config)
    assert isinstance(restored.rotary_embedding, RotaryEmbedding)
    assert restored.rotary_embedding.max_wavelength == 500
    assert restored.alibi_bias is None
    x = inputs(4)
    layer(x, x)
    restored(x, x)
    restored.set_weights(layer.get_weights())
    np.testing.assert_allclose(numpy(restored(x, x)), numpy(layer(x, x)), atol=1e-6)
    plain = MultiHeadAttention(HEADS, HEAD_DIM).get_config()
    assert "rotary_embedding" not in plain and "alibi_bias" not in plain
    keras.layers.MultiHeadAttention.from_config(plain)  # Keras's class reads it
    alibi = MultiHeadAttention(HEADS, HEAD_DIM, alibi_bias=AlibiBias(4))
    restored = MultiHeadAttention.from_config(alibi.get_config())
    assert restored.alibi_bias.alibi_bias_max == 4


def test_bad_arguments_name_what_was_received():
    with pytest.raises(ValueError, match=r"`rotary_embedding` must be None.*'yes'"):
        MultiHeadAttention(HEADS, HEAD_DIM, rotary_embedding="yes")
    with pytest.raises(ValueError, match="`alibi_bias` must be None"):
        MultiHeadAttention(HEADS, HEAD_DIM, alibi_bias=RotaryEmbedding())
    with pytest.raises(ValueError, match="Pass one of"):
        MultiHeadAttention(
            HEADS, HEAD_DIM, rotary_embedding=RotaryEmbedding(), alibi_bias=AlibiBias()
        )
    layer = MultiHeadAttention(HEADS, 7, rotary_embedding=RotaryEmbedding())
    with pytest.raises(ValueError, match=r"even `key_dim`.*key_dim=7"):
        layer(inputs(), inputs())
    layer = MultiHeadAttention(
        HEADS, HEAD_DIM, rotary_embedding=RotaryEmbedding(), attention_axes=(1, 2)
    )
    x = np.zeros((BATCH, 3, 3, WIDTH), "float32")
    with pytest.raises(ValueError, match="`rotary_embedding` needs rank-3 inputs"):
        layer(x, x)
    layer = MultiHeadAttention(HEADS, HEAD_DIM, alibi_bias=AlibiBias())
    x = inputs()
    heads = np.zeros((BATCH, LENGTH, HEADS, HEAD_DIM), "float32")
    layer(x, x)
    with pytest.raises(ValueError, match="pass `cache_update_index`"):
        layer(x, None, cache=(heads, heads))
    with pytest.raises(ValueError, match=r"`position` must be one of.*'relative'"):
        TransformerEncoderBlock(64, HEADS, position="relative")
    with pytest.raises(ValueError, match=r"`sliding_window` must be.*0"):
        TransformerDecoderBlock(64, HEADS, sliding_window=0)


@pytest.mark.parametrize(
    "block_class", [TransformerEncoderBlock, TransformerDecoderBlock]
)
def test_blocks_record_the_options_only_when_set(block_class):
    plain = block_class(64, HEADS).get_config()
    for name in ("position", "sliding_window", "num_key_value_heads"):
        assert name not in plain
    block = block_class(
        64, HEADS, position="alibi", sliding_window=5, num_key_value_heads=2
    )
    x = inputs(5)
    want = numpy(block(x))
    config = block.get_config()
    assert (config["position"], config["sliding_window"]) == ("alibi", 5)
    restored = block_class.from_config(config)
    restored(x)
    restored.set_weights(block.get_weights())
    np.testing.assert_allclose(numpy(restored(x)), want, atol=1e-6)
    attention = restored._self_attention_layer
    assert isinstance(attention.alibi_bias, AlibiBias)
    assert attention.sliding_window == 5 and attention.key_value_heads == 2


@pytest.mark.parametrize("position", ["learned", "sinusoidal"])
def test_absolute_positions_leave_the_block_as_it_is(position):
    """`"learned"` and `"sinusoidal"` belong to the embedding: the block
    computes what the default block computes with the same weights."""
    x = inputs(6)
    default = TransformerDecoderBlock(64, HEADS)
    named = TransformerDecoderBlock(64, HEADS, position=position)
    default(x)
    named(x)
    named.set_weights(default.get_weights())
    np.testing.assert_allclose(numpy(named(x)), numpy(default(x)), atol=1e-6)
    assert named._self_attention_layer.rotary_embedding is None


def test_rotary_block_weights_are_the_default_blocks():
    """The positions add no variables: weight files load both ways."""
    default = TransformerEncoderBlock(64, HEADS)
    rotary = TransformerEncoderBlock(64, HEADS, position="rotary")
    x = inputs(7)
    default(x)
    rotary(x)
    assert [w.path.split("/", 1)[1] for w in rotary.weights] == [
        w.path.split("/", 1)[1] for w in default.weights
    ]


def test_a_float32_rotary_layer_keeps_the_heads_in_the_compute_dtype():
    """`RotaryEmbedding()` made under the float32 policy, in a
    mixed_bfloat16 attention layer: the heads stay bfloat16."""
    rotary = RotaryEmbedding()
    layer = MultiHeadAttention(
        HEADS, HEAD_DIM, rotary_embedding=rotary, dtype="mixed_bfloat16"
    )
    x = inputs(8)
    outputs = layer(x, x)
    assert keras.backend.standardize_dtype(outputs.dtype) == "bfloat16"
    assert rotary.compute_dtype == "float32"
    heads = layer._rotate(layer.query_dense(x), 0)
    assert keras.backend.standardize_dtype(heads.dtype) == "bfloat16"
