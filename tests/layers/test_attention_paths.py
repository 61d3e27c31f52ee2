"""The layers on each attention path: the memory-efficient path equals the
explicit one (outputs and gradients, every mask kind, the cache offset), the
automatic switch takes it from the switch-over length on, and half precision
runs on every backend.

`flash_attention=True` forces the memory-efficient path where no fused kernel
runs (TensorFlow; JAX on a CPU; here on PyTorch too, where the CPU flash
kernel that would take some of these calls is set aside: its own tests are
tests/ops/test_torch_cpu_kernel.py), `False` the explicit path; the same layer
(same weights) is called both ways. Lengths span two query blocks (the
default query block is 256 rows), and the left padding leaves rows with no
key at all.
"""

import keras
import numpy as np
import pytest
from keras import ops

import keras_attn.ops.attention as attention_module
from keras_attn.layers import (
    MultiHeadAttention,
    MultiHeadSelfAttention,
    TransformerDecoderBlock,
    TransformerEncoderBlock,
)
from keras_attn.ops import switch_over_length
from tests.test_case import outputs_and_gradients, to_numpy

B, TQ, TK, D = 2, 260, 300, 8
RNG = np.random.default_rng(25)
QUERY = RNG.normal(size=(B, TQ, D)).astype("float32")
VALUE = RNG.normal(size=(B, TK, D)).astype("float32")
KEY = RNG.normal(size=(B, TK, D)).astype("float32")
COTANGENT = RNG.normal(size=(B, TQ, D)).astype("float32")
VALUE_MASK = np.ones((B, TK), bool)
VALUE_MASK[0, 250:] = False  # right padding
VALUE_MASK[1, :5] = False  # left padding: causal rows 0..4 see no key
KEY_MASK = RNG.uniform(size=(B, TK)) > 0.1
QUERY_MASK = np.ones((B, TQ), bool)
QUERY_MASK[1, 200:] = False
ATTENTION_MASK = RNG.uniform(size=(B, TQ, TK)) > 0.3
ATTENTION_MASK[0, 7] = False  # a row with no key at all

CASES = {
    "none": {},
    "value_mask": {"value_mask": VALUE_MASK},
    "key_and_key_mask": {"key": KEY, "key_mask": KEY_MASK, "value_mask": VALUE_MASK},
    "query_mask": {"query_mask": QUERY_MASK},
    "attention_mask": {"attention_mask": ATTENTION_MASK},
    "causal": {"use_causal_mask": True},
    "causal_and_left_padding": {"use_causal_mask": True, "value_mask": VALUE_MASK},
    "everything": {
        "use_causal_mask": True,
        "query_mask": QUERY_MASK,
        "value_mask": VALUE_MASK,
        "attention_mask": ATTENTION_MASK,
    },
}
CONFIGS = {
    "default": {},
    "sliding_window": {"sliding_window": 20},
    "gate_narrow_values_and_output_shape": {
        "use_gate": True,
        "value_dim": 3,
        "output_shape": 5,
    },
}


def expected_rows(arguments, sliding_window=None):
    """`(B, Tq)`: the query rows with a key to attend to, in NumPy."""
    pairs = np.ones((B, TQ, TK), bool)
    for name in ("value_mask", "key_mask"):
        if name in arguments:
            pairs &= arguments[name][:, None, :]
    if "attention_mask" in arguments:
        pairs &= arguments["attention_mask"]
    query_positions, key_positions = np.arange(TQ)[:, None], np.arange(TK)[None]
    if arguments.get("use_causal_mask"):
        pairs &= key_positions <= query_positions
    if sliding_window:
        pairs &= np.abs(query_positions - key_positions) < sliding_window
    rows = pairs.any(-1)
    if "query_mask" in arguments:
        rows &= arguments["query_mask"]
    return rows


@pytest.fixture
def paths_taken(monkeypatch):
    """Counts the calls of each attention path (at trace time under a jit),
    with no fused kernel claimed (PyTorch's CPU flash kernel set aside)."""
    taken = {"memory_efficient": 0, "explicit": 0}
    monkeypatch.setattr(attention_module, "fused_kernel_runs", lambda *a, **k: False)

    def spy(name, function):
        def wrapper(*args, **kwargs):
            taken[name] += 1
            return function(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(
        attention_module,
        "memory_efficient_attention",
        spy("memory_efficient", attention_module.memory_efficient_attention),
    )
    monkeypatch.setattr(
        attention_module,
        "_explicit_attention",
        spy("explicit", attention_module._explicit_attention),
    )
    return taken


def both_paths(layer, call, inputs, cotangent, paths_taken):
    """Outputs and input gradients of `call(*inputs)` with
    `flash_attention=True` (the memory-efficient path here) and `False`."""
    results = {}
    for flash in (True, False):
        for sublayer in _attention_layers(layer):
            sublayer.flash_attention = flash
        before = dict(paths_taken)
        results[flash] = outputs_and_gradients(call, inputs, cotangent, jit=True)
        took = "memory_efficient" if flash else "explicit"
        other = "explicit" if flash else "memory_efficient"
        assert paths_taken[took] > before[took], f"{took} not taken"
        assert paths_taken[other] == before[other], f"{other} taken"
    return results[True], results[False]


def _attention_layers(layer):
    return [
        sublayer
        for sublayer in layer._flatten_layers(include_self=True)
        if isinstance(sublayer, MultiHeadAttention)
    ]


def assert_same(got, want, atol=1e-5):
    np.testing.assert_allclose(got[0], want[0], atol=atol)
    for got_grad, want_grad in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(got_grad, want_grad, atol=atol)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("case", list(CASES))
def test_memory_efficient_path_equals_the_explicit_path(case, config, paths_taken):
    layer = MultiHeadAttention(num_heads=2, key_dim=4, **CONFIGS[config])
    arguments = dict(CASES[case])
    key = arguments.pop("key", None)
    layer(QUERY, VALUE, key)
    inputs = (QUERY, VALUE) if key is None else (QUERY, VALUE, key)
    cotangent = COTANGENT[..., : CONFIGS[config].get("output_shape", D)]

    def call(*tensors):
        return layer(*tensors, **arguments)

    efficient, explicit = both_paths(layer, call, inputs, cotangent, paths_taken)
    assert_same(efficient, explicit)
    rows = expected_rows(arguments, CONFIGS[config].get("sliding_window"))
    if case in ("query_mask", "attention_mask", "causal_and_left_padding"):
        assert (~rows).any()  # rows that must come out as zeros
    for batch, position in zip(*np.nonzero(~rows), strict=True):
        np.testing.assert_array_equal(efficient[0][batch, position], 0.0)
    assert (np.abs(efficient[0][rows]).sum(-1) > 0).all()


@pytest.mark.parametrize("sliding_window", [None, 20])
@pytest.mark.parametrize("stacked", [False, True], ids=["tuple", "stacked"])
def test_cache_offset_on_the_memory_efficient_path(
    stacked, sliding_window, paths_taken
):
    # 200 new tokens written at position 40 of a 300-position cache: the
    # causal mask and the window are offset by the cache index (a tensor).
    layer = MultiHeadAttention(num_heads=2, key_dim=4, sliding_window=sliding_window)
    new_tokens = QUERY[:, :200]
    layer(new_tokens, new_tokens)
    prefix = RNG.normal(size=(B, TK, 2, 4)).astype("float32")

    def call(tokens, key_cache, value_cache):
        cache = (
            ops.stack((key_cache, value_cache), axis=1)
            if stacked
            else (key_cache, value_cache)
        )
        outputs, _ = layer(
            tokens,
            tokens,
            cache=cache,
            cache_update_index=ops.convert_to_tensor(40, "int32"),
            use_causal_mask=True,
        )
        return outputs

    efficient, explicit = both_paths(
        layer, call, (new_tokens, prefix, -prefix), COTANGENT[:, :200], paths_taken
    )
    assert_same(efficient, explicit)


def test_higher_rank_inputs_with_attention_axes(paths_taken):
    images = RNG.normal(size=(2, 4, 70, 8)).astype("float32")  # (B, H, W, C)
    mask = RNG.uniform(size=(2, 4, 70, 70)) > 0.2  # attention over W, per row
    layer = MultiHeadAttention(num_heads=2, key_dim=4, attention_axes=(2,))
    layer(images, images)

    def call(x):
        return layer(x, x, attention_mask=mask)

    efficient, explicit = both_paths(
        layer, call, (images,), np.ones_like(images), paths_taken
    )
    assert_same(efficient, explicit)


# Every attention-mask form Keras takes, and what of it reaches the blocks:
# a key (or query) padding mask in disguise becomes the padding component,
# a shared mask keeps its batch of 1; none is broadcast to (B, Tq, Tk).
PER_HEAD_MASK = RNG.uniform(size=(B, 2, TQ, TK)) > 0.3
PER_HEAD_MASK[0, 1, 9] = False  # a row with no key in one head only
MASK_FORMS = {
    "query_key": (ATTENTION_MASK[0], {"attention_mask": (1, 1, TQ, TK)}),
    "key_padding_rank3": (
        VALUE_MASK[:, None, :],
        {"attention_mask": None, "key_padding_mask": (B, TK)},
    ),
    "shared_rank3": (ATTENTION_MASK[:1], {"attention_mask": (1, 1, TQ, TK)}),
    "batch_rank3": (ATTENTION_MASK, {"attention_mask": (B, 1, TQ, TK)}),
    "query_rows_rank3": (
        QUERY_MASK[:, :, None],
        {"attention_mask": None, "query_padding_mask": (B, TQ)},
    ),
    "key_padding_rank4": (
        VALUE_MASK[:, None, None, :],
        {"attention_mask": None, "key_padding_mask": (B, TK)},
    ),
    "shared_rank4": (ATTENTION_MASK[:1, None], {"attention_mask": (1, 1, TQ, TK)}),
    "per_head": (PER_HEAD_MASK, {"attention_mask": (B, 2, TQ, TK)}),
}


@pytest.mark.parametrize("form", list(MASK_FORMS))
def test_every_attention_mask_form_on_the_memory_efficient_path(
    form, paths_taken, monkeypatch
):
    mask, reaching = MASK_FORMS[form]
    received = []
    blocks = attention_module.memory_efficient_attention

    def record(*args, **kwargs):
        received.append(
            {
                name: None if kwargs.get(name) is None else tuple(kwargs[name].shape)
                for name in reaching
            }
        )
        return blocks(*args, **kwargs)

    monkeypatch.setattr(attention_module, "memory_efficient_attention", record)
    layer = MultiHeadAttention(num_heads=2, key_dim=4)
    layer(QUERY, VALUE)

    def call(query, value):
        return layer(query, value, attention_mask=mask, use_causal_mask=True)

    efficient, explicit = both_paths(
        layer, call, (QUERY, VALUE), COTANGENT, paths_taken
    )
    assert_same(efficient, explicit)
    assert received and all(shapes == reaching for shapes in received)


def test_causal_mask_over_axis_one_of_higher_rank_inputs_on_the_blocks(paths_taken):
    images = RNG.normal(size=(2, 70, 3, 8)).astype("float32")  # attend over 70
    mask = RNG.uniform(size=(2, 3, 70, 70)) > 0.2  # (B, <other>, Tq, Tk)
    layer = MultiHeadAttention(
        num_heads=2, key_dim=4, attention_axes=(1,), sliding_window=9
    )
    layer(images, images)

    def call(x):
        return layer(x, x, attention_mask=mask, use_causal_mask=True)

    efficient, explicit = both_paths(
        layer, call, (images,), np.ones_like(images), paths_taken
    )
    assert_same(efficient, explicit)


def test_self_attention_with_keras_mask_and_the_blocks(paths_taken):
    decoder_padding = VALUE_MASK[:, :TQ]
    self_attention = MultiHeadSelfAttention(num_heads=2, causal=True)
    encoder = TransformerEncoderBlock(16, 2)
    decoder = TransformerDecoderBlock(16, 2)
    cases = [
        (self_attention, lambda x: self_attention(x, mask=decoder_padding), (QUERY,)),
        (encoder, lambda x: encoder(x, padding_mask=decoder_padding), (QUERY,)),
        (
            decoder,
            lambda x, source: decoder(
                x,
                source,
                decoder_padding_mask=decoder_padding,
                encoder_padding_mask=VALUE_MASK,
            ),
            (QUERY, VALUE),
        ),
    ]
    for layer, call, inputs in cases:
        call(*inputs)  # build
        efficient, explicit = both_paths(layer, call, inputs, COTANGENT, paths_taken)
        assert_same(efficient, explicit)


def test_blocks_take_the_flash_attention_argument(paths_taken):
    encoder = TransformerEncoderBlock(16, 2, flash_attention=True)
    encoder(VALUE)
    assert paths_taken == {"memory_efficient": 1, "explicit": 0}
    encoder = TransformerEncoderBlock(16, 2, flash_attention=False)
    encoder(VALUE)
    assert paths_taken == {"memory_efficient": 1, "explicit": 1}


def test_cached_decoding_steps_equal_the_full_pass_with_flash_attention(paths_taken):
    # One query per step: the memory-efficient path at Tq = 1 too.
    layer = MultiHeadSelfAttention(num_heads=2, causal=True, flash_attention=True)
    tokens = QUERY[:, :12]
    full = to_numpy(layer(tokens))
    cache = (np.zeros((B, 12, 2, 4), "float32"),) * 2
    steps = []
    for index in range(12):
        step, cache = layer(
            tokens[:, index : index + 1], cache=cache, cache_update_index=index
        )
        steps.append(to_numpy(step))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5)
    assert paths_taken["explicit"] == 0


# -- the automatic switch --------------------------------------------------------------


@pytest.mark.parametrize(
    ("length", "expected"), [(1023, "explicit"), (1024, "memory_efficient")]
)
def test_automatic_switch_at_the_switch_over_length(length, expected, paths_taken):
    assert switch_over_length("float32") == 1024
    layer = MultiHeadSelfAttention(num_heads=1, key_dim=4)
    inputs = RNG.normal(size=(1, length, 4)).astype("float32")
    layer(inputs)
    assert paths_taken[expected] == 1
    assert sum(paths_taken.values()) == 1


def test_automatic_switch_needs_more_than_one_query_and_no_weights(paths_taken):
    layer = MultiHeadAttention(num_heads=1, key_dim=4)
    long_value = RNG.normal(size=(1, 1500, 4)).astype("float32")
    layer(long_value[:, :1], long_value)  # one query: a (1, Tk) row of weights
    layer(long_value[:, :2], long_value, return_attention_scores=True)
    assert paths_taken == {"memory_efficient": 0, "explicit": 2}
    layer(long_value[:, :2], long_value)
    assert paths_taken == {"memory_efficient": 1, "explicit": 2}


def test_dropout_takes_the_memory_efficient_path_on_long_sequences(paths_taken):
    layer = MultiHeadSelfAttention(num_heads=1, key_dim=4, dropout=0.5, seed=1)
    inputs = RNG.normal(size=(1, 1100, 4)).astype("float32")
    inference = to_numpy(layer(inputs))
    trained = to_numpy(layer(inputs, training=True))
    assert paths_taken == {"memory_efficient": 2, "explicit": 0}
    assert np.isfinite(trained).all()
    assert not np.allclose(trained, inference)


@pytest.mark.tf_only
def test_unknown_lengths_are_switched_when_the_graph_runs(monkeypatch):
    import tensorflow as tf

    # The memory-efficient path replaced by a marker: zeros.
    monkeypatch.setattr(
        attention_module,
        "memory_efficient_attention",
        lambda query, key, value, **kwargs: ops.zeros(
            (*ops.shape(query)[:3], ops.shape(value)[3]), value.dtype
        ),
    )
    layer = MultiHeadSelfAttention(num_heads=2, use_bias=False)
    layer(QUERY[:, :4])

    @tf.function(input_signature=[tf.TensorSpec((None, None, D), "float32")])
    def attend(x):
        return layer(x)

    threshold = switch_over_length("float32")
    long = RNG.normal(size=(1, threshold, D)).astype("float32")
    assert not np.any(to_numpy(attend(long[:, : threshold - 1])) == 0.0)
    np.testing.assert_array_equal(to_numpy(attend(long)), 0.0)
    np.testing.assert_array_equal(to_numpy(attend(long[:, :1])) == 0.0, False)


@pytest.mark.tf_only
def test_unknown_lengths_give_the_explicit_outputs_and_gradients_on_both_sides():
    import tensorflow as tf

    layer = MultiHeadSelfAttention(num_heads=2, causal=True)
    layer(QUERY[:, :4])
    spec = tf.TensorSpec((None, None, D), "float32")

    @tf.function(input_signature=[spec, spec])
    def attend(x, cotangent):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(layer(x) * cotangent)
        return layer(x), tape.gradient(loss, x)

    threshold = switch_over_length("float32")
    for length in (threshold - 24, threshold + 24):
        x = RNG.normal(size=(1, length, D)).astype("float32")
        cotangent = RNG.normal(size=(1, length, D)).astype("float32")
        got = [to_numpy(t) for t in attend(x, cotangent)]
        layer.flash_attention = False
        want = outputs_and_gradients(layer, (x,), cotangent)
        layer.flash_attention = None
        np.testing.assert_allclose(got[0], want[0], atol=1e-5)
        np.testing.assert_allclose(got[1], want[1][0], atol=1e-5)


# -- half precision --------------------------------------------------------------------


@pytest.mark.parametrize("flash", [None, True], ids=["default", "memory_efficient"])
@pytest.mark.parametrize("kind", ["mha", "mhsa", "encoder", "decoder"])
def test_mixed_float16_runs_compiled_and_matches_float32(kind, flash):
    # On JAX on a CPU, XLA's dot_general cannot accumulate float16 into
    # float32: the fused keras.ops.dot_product_attention does not compile
    # there, so the layers must not take it.
    x = RNG.normal(size=(2, 40, 16)).astype("float32")
    source = RNG.normal(size=(2, 30, 16)).astype("float32")

    def build(policy):
        inputs = keras.Input((None, 16))
        sources = keras.Input((None, 16))
        kwargs = {"dtype": policy, "flash_attention": flash}
        if kind == "mha":
            outputs = MultiHeadAttention(4, 4, **kwargs)(inputs, sources)
        elif kind == "mhsa":
            outputs = MultiHeadSelfAttention(4, causal=True, **kwargs)(inputs)
        elif kind == "encoder":
            outputs = TransformerEncoderBlock(32, 4, **kwargs)(inputs)
        else:
            outputs = TransformerDecoderBlock(32, 4, **kwargs)(inputs, sources)
        if kind in ("mhsa", "encoder"):
            return keras.Model(inputs, outputs)
        return keras.Model([inputs, sources], outputs)

    data = x if kind in ("mhsa", "encoder") else [x, source]
    reference = build("float32")
    model = build("mixed_float16")
    model.set_weights(reference.get_weights())
    model.compile(jit_compile=keras.backend.backend() == "jax")
    got = model.predict(data, verbose=0)
    assert got.dtype == np.float16
    want = reference.predict(data, verbose=0)
    np.testing.assert_allclose(got.astype("float32"), want, atol=2e-2, rtol=2e-2)


# -- export ---------------------------------------------------------------------


def saved_model_op_types(export_dir) -> set:
    """Op types of a SavedModel's graph and of every function in it (loop
    bodies, conditionals, gradients)."""
    import os

    from tensorflow.core.protobuf import saved_model_pb2

    saved = saved_model_pb2.SavedModel()
    with open(os.path.join(export_dir, "saved_model.pb"), "rb") as file:
        saved.ParseFromString(file.read())
    graph_def = saved.meta_graphs[0].graph_def
    return {node.op for node in graph_def.node} | {
        node.op for function in graph_def.library.function for node in function.node_def
    }


@pytest.mark.tf_only
def test_export_switches_by_length_and_loads_with_tensorflow_alone(tmp_path):
    import os
    import subprocess
    import sys
    import textwrap

    tokens = keras.Input((None,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(50, 8, mask_zero=True)(tokens)
    x = MultiHeadSelfAttention(num_heads=2, causal=True)(x)
    model = keras.Model(tokens, x)
    short = RNG.integers(1, 50, size=(2, 12)).astype("int32")
    short[1, 9:] = 0
    long = RNG.integers(1, 50, size=(2, switch_over_length("float32") + 76))
    long = long.astype("int32")
    long[1, 1000:] = 0
    expected = [to_numpy(model(short)), to_numpy(model(long))]

    export_dir = str(tmp_path / "export")
    model.export(export_dir, verbose=False)
    types = saved_model_op_types(export_dir)
    assert not [t for t in types if t.startswith("Xla")], sorted(types)
    assert types & {"If", "StatelessIf"}, "no switch on the length in the graph"
    assert types & {"While", "StatelessWhile"}, "no memory-efficient block loop"

    np.savez(tmp_path / "inputs.npz", short=short, long=long)
    script = textwrap.dedent(f"""
        import sys
        for blocked in ("keras", "keras_attn", "keras_hub", "keras_nlp"):
            sys.modules[blocked] = None
        import numpy as np
        import tensorflow as tf
        loaded = tf.saved_model.load({export_dir!r})
        data = np.load({str(tmp_path / "inputs.npz")!r})
        outputs = [loaded.serve(data[name]).numpy() for name in ("short", "long")]
        np.savez({str(tmp_path / "outputs.npz")!r}, *outputs)
    """)
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = np.load(tmp_path / "outputs.npz")
    for index, want in enumerate(expected):
        np.testing.assert_allclose(loaded[f"arr_{index}"], want, atol=1e-5)


def test_fit_on_long_sequences_with_attention_dropout(paths_taken):
    # Lengths unknown when Keras traces the train step on TensorFlow (a
    # switch by length in the graph); known on JAX.
    length = switch_over_length("float32") + 76
    tokens = keras.Input((None, 8))
    x = TransformerEncoderBlock(16, 2, dropout=0.1, seed=3)(tokens)
    model = keras.Model(tokens, keras.layers.Dense(1)(x))
    model.compile(optimizer="adam", loss="mse")
    data = RNG.normal(size=(2, length, 8)).astype("float32")
    kernels = [w for w in model.trainable_weights if "kernel" in w.path]
    before = [to_numpy(w) for w in kernels]
    history = model.fit(data, data[..., :1], epochs=1, batch_size=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert paths_taken["memory_efficient"] > 0
    for weight, value in zip(kernels, before, strict=True):
        assert not np.array_equal(to_numpy(weight), value), weight.path


@pytest.mark.parametrize("flash_attention", [None, True])
def test_inside_a_layer_without_output_spec_in_the_functional_api(flash_attention):
    """Keras infers the output spec of a custom layer that has no
    `compute_output_spec` by tracing its call; on JAX with symbolic lengths,
    which cannot be compared with the switch-over length or padded into
    blocks. The model builds, and its outputs are the explicit path's."""

    class Wrapper(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.attention = MultiHeadAttention(
                num_heads=2, key_dim=4, flash_attention=flash_attention
            )

        def call(self, inputs):
            padding = ops.ones_like(inputs[:, None, :, 0], dtype="int32")  # (B,1,T)
            return self.attention(inputs, inputs, attention_mask=padding)

    inputs = keras.Input((None, 8))
    model = keras.Model(inputs, Wrapper()(inputs))
    assert model.output.shape == (None, None, 8)
    data = RNG.normal(size=(2, switch_over_length("float32") + 3, 8)).astype("float32")
    reference = MultiHeadAttention(num_heads=2, key_dim=4, flash_attention=False)
    reference(data, data)
    reference.set_weights(model.layers[-1].attention.get_weights())
    np.testing.assert_allclose(
        to_numpy(model(data)), to_numpy(reference(data, data)), atol=1e-5
    )
