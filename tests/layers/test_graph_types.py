"""The graphs the attention layers trace on TensorFlow type-check.

Traced with `None` lengths (`fit` on batches padded to their longest
sequence, an export's signatures), the attention decides its path when the
graph runs, under a conditional on the lengths. The gradient of a TensorFlow
conditional makes it output each branch's intermediates as optionals paired
by position (`cond_v2._make_intermediates_match`); a pair whose payloads
differ in dtype (one branch's `bfloat16` against the other's `bool`) is a
graph TensorFlow's type inference rejects, and it logs "Type inference
failed. This indicates an invalid graph that escaped type checking" with a
proto dump at the first training step (tensorflow/tensorflow#57052). These
tests look for such pairs in the traced training step of the layers, and for
the message in a fresh process's stderr.
"""

import os
import subprocess
import sys
import textwrap

import keras
import pytest

from keras_attn.layers import MultiHeadAttention
from tests.test_case import REPO_ROOT

pytestmark = pytest.mark.tf_only

CONDITIONALS = ("If", "StatelessIf")


def _payload(function, output_name):
    """The payload dtypes of the optional a branch function returns as
    `output_name`: a tuple of dtype names, `None` for a none optional (it
    pairs with any), or `"tensor"` for an output that is no optional."""
    import tensorflow as tf

    nodes = {node.name: node for node in function.node_def}
    node = nodes.get(function.ret[output_name].split(":")[0])
    while node is not None and node.op == "Identity":
        node = nodes.get(node.input[0].split(":")[0].lstrip("^"))
    if node is None:  # an argument of the function, returned as it is
        return "tensor"
    if node.op == "OptionalNone":
        return None
    if node.op == "OptionalFromValue":
        return tuple(
            tf.dtypes.as_dtype(dtype).name
            for dtype in node.attr["Toutput_types"].list.type
        )
    return "tensor"


def conditional_optionals(graph):
    """`(node name, [(then payload, else payload)])` for each conditional of
    `graph` and of the functions it calls, one pair per output."""
    graph_def = graph.as_graph_def()
    functions = {f.signature.name: f for f in graph_def.library.function}
    nodes = list(graph_def.node)
    for function in functions.values():
        nodes.extend(function.node_def)
    found = []
    for node in nodes:
        if node.op not in CONDITIONALS:
            continue
        branches = [
            functions[node.attr[name].func.name]
            for name in ("then_branch", "else_branch")
        ]
        names = [[arg.name for arg in f.signature.output_arg] for f in branches]
        pairs = [
            (_payload(branches[0], then_name), _payload(branches[1], else_name))
            for then_name, else_name in zip(*names, strict=True)
        ]
        found.append((node.name, pairs))
    return found


def training_step_graph(layer, padding=False, causal=False):
    """The graph of a gradient step of the self-attention `layer` (with
    padding masks, a causal mask), traced with `None` batch and length."""
    import tensorflow as tf

    query = tf.zeros((2, 5, 16))
    layer(query, query)  # builds it

    @tf.function
    def step(inputs, mask):
        with tf.GradientTape() as tape:
            tape.watch(inputs)
            masks = {"query_mask": mask, "value_mask": mask} if padding else {}
            outputs = layer(
                inputs, inputs, training=True, use_causal_mask=causal, **masks
            )
            loss = tf.reduce_sum(tf.cast(outputs, "float32"))
        return tape.gradient(loss, [inputs, *layer.trainable_variables])

    return step.get_concrete_function(
        tf.TensorSpec((None, None, 16)), tf.TensorSpec((None, None), "bool")
    ).graph


@pytest.mark.parametrize(
    "policy, options, padding, causal",
    [
        ("mixed_bfloat16", {"dropout": 0.1}, True, False),
        ("mixed_bfloat16", {}, False, True),
        ("float32", {"dropout": 0.1}, False, False),
        ("mixed_float16", {"num_key_value_heads": 1}, True, True),
    ],
    ids=["bfloat16-dropout-padding", "bfloat16-causal", "float32-dropout", "gqa"],
)
def test_the_by_length_switch_pairs_no_optionals_of_different_dtypes(
    policy, options, padding, causal
):
    keras.config.set_dtype_policy(policy)
    layer = MultiHeadAttention(num_heads=2, key_dim=8, seed=1, **options)
    graph = training_step_graph(layer, padding=padding, causal=causal)
    conditionals = conditional_optionals(graph)
    # Not vacuous: the switch on the length is there, and differentiated
    # (its branches return their intermediates).
    assert conditionals, "no conditional in the traced training step"
    assert any(
        payload not in (None, "tensor")
        for _, pairs in conditionals
        for pair in pairs
        for payload in pair
    ), "no branch intermediates: the switch was not differentiated"
    mismatched = [
        (name, index, then_payload, else_payload)
        for name, pairs in conditionals
        for index, (then_payload, else_payload) in enumerate(pairs)
        if None not in (then_payload, else_payload) and then_payload != else_payload
    ]
    assert not mismatched, mismatched


def test_a_training_step_under_mixed_bfloat16_logs_no_type_inference_failure():
    """The first `fit` step of a small classifier under `mixed_bfloat16` on
    batches of unknown length, as `make demo` runs it, in a fresh process
    that shows TensorFlow's warnings."""
    script = textwrap.dedent("""
        import numpy as np
        import tensorflow as tf
        import keras

        from keras_attn.models import TextClassifier

        keras.config.set_dtype_policy("mixed_bfloat16")
        model = TextClassifier(
            50, 16, embedding_dim=16, num_layers=1, num_heads=2,
            intermediate_dim=16,
        )
        model.compile(optimizer="adam", loss="binary_crossentropy")
        tokens = np.random.default_rng(0).integers(1, 50, size=(4, 12))
        tokens[1, 8:] = 0
        labels = np.array([[0.0], [1.0], [1.0], [0.0]], "float32")
        data = tf.data.Dataset.from_generator(
            lambda: iter([(tokens.astype("int32"), labels)]),
            output_signature=(
                tf.TensorSpec((None, None), "int32"),
                tf.TensorSpec((None, 1), "float32"),
            ),
        )
        model.fit(data, epochs=1, verbose=0)
        print("trained")
    """)
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
        env={
            **os.environ,
            "KERAS_BACKEND": "tensorflow",
            "TF_CPP_MIN_LOG_LEVEL": "0",
            "PYTHONPATH": REPO_ROOT,
        },
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "trained" in result.stdout
    assert "Type inference failed" not in result.stderr, result.stderr[-4000:]
