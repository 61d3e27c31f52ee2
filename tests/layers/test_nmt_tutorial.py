"""TensorFlow's NMT tutorial, run with keras-attn's `BahdanauAttention`.

The program is the model code of TensorFlow's tutorial "Neural machine
translation with attention" (tensorflow/docs,
site/en/tutorials/text/nmt_with_attention.ipynb, the TF 2 revision of
2019-2021 with the hand-written `BahdanauAttention(tf.keras.layers.Layer)`,
the GRU `Encoder` and the one-step `Decoder`, before the tutorial was
rewritten around `tf.keras.layers.AdditiveAttention`), written in
backend-neutral `keras.ops` as tests/layers/test_real_programs.py writes its
programs. Unlike those, it needs two edits besides the class swap, the two
that docs/TF_ADDONS_MIGRATION.md documents: `use_bias=True` (the tutorial's
`Dense` layers have biases) and `return_attention_scores=True` (the tutorial
unpacks `context_vector, attention_weights = attention(query, values)`).
With the tutorial's weights copied (`W1.bias + W2.bias` into the one bias,
`V.bias` dropped: it cancels in the softmax) the outputs are the tutorial's.
"""

import re
from types import SimpleNamespace

import keras
import numpy as np
import pytest
from keras import layers, ops

import keras_attn
from tests.test_case import REPO_ROOT, to_numpy

VOCABULARY = 30
EMBEDDING = 8
UNITS = 16  # the encoder's and decoder's GRU units, and the attention's
BATCH = 3
SOURCE_LENGTH = 7
TARGET_LENGTH = 5
START = 1


# -- the tutorial's code ---------------------------------------------------------


class TutorialBahdanauAttention(layers.Layer):
    """The tutorial's layer (`tf.expand_dims` -> `ops.expand_dims`, ...)."""

    def __init__(self, units):
        super().__init__()
        self.W1 = layers.Dense(units)
        self.W2 = layers.Dense(units)
        self.V = layers.Dense(1)

    def call(self, query, values):
        # query hidden state shape == (batch_size, hidden size)
        # query_with_time_axis shape == (batch_size, 1, hidden size)
        # values shape == (batch_size, max_len, hidden size)
        query_with_time_axis = ops.expand_dims(query, 1)

        # score shape == (batch_size, max_length, 1)
        score = self.V(ops.tanh(self.W1(query_with_time_axis) + self.W2(values)))

        # attention_weights shape == (batch_size, max_length, 1)
        attention_weights = ops.softmax(score, axis=1)

        # context_vector shape after sum == (batch_size, hidden_size)
        context_vector = attention_weights * values
        context_vector = ops.sum(context_vector, axis=1)

        return context_vector, attention_weights


# The tutorial's program, and keras-attn's class swapped in with the two edits
# the migration page documents: the layer's `use_bias=True` and the call's
# `return_attention_scores=True`.
TUTORIAL = SimpleNamespace(
    BahdanauAttention=TutorialBahdanauAttention, layer_edits={}, call_edits={}
)
KERAS_ATTN = SimpleNamespace(
    BahdanauAttention=keras_attn.layers.BahdanauAttention,
    layer_edits={"use_bias": True},
    call_edits={"return_attention_scores": True},
)
# The swap without `use_bias=True`: the control.
KERAS_ATTN_WITHOUT_BIAS = SimpleNamespace(
    BahdanauAttention=keras_attn.layers.BahdanauAttention,
    layer_edits={},
    call_edits={"return_attention_scores": True},
)


def nmt_tutorial_program(api, batch_sz=BATCH):
    class Encoder(keras.Model):
        def __init__(self, vocab_size, embedding_dim, enc_units, batch_sz):
            super().__init__()
            self.batch_sz = batch_sz
            self.enc_units = enc_units
            self.embedding = layers.Embedding(vocab_size, embedding_dim)
            self.gru = layers.GRU(
                self.enc_units,
                return_sequences=True,
                return_state=True,
                recurrent_initializer="glorot_uniform",
            )

        def call(self, x, hidden):
            x = self.embedding(x)
            output, state = self.gru(x, initial_state=hidden)
            return output, state

        def initialize_hidden_state(self):
            return ops.zeros((self.batch_sz, self.enc_units))

    class Decoder(keras.Model):
        def __init__(self, vocab_size, embedding_dim, dec_units, batch_sz):
            super().__init__()
            self.batch_sz = batch_sz
            self.dec_units = dec_units
            self.embedding = layers.Embedding(vocab_size, embedding_dim)
            self.gru = layers.GRU(
                self.dec_units,
                return_sequences=True,
                return_state=True,
                recurrent_initializer="glorot_uniform",
            )
            self.fc = layers.Dense(vocab_size)

            # used for attention
            self.attention = api.BahdanauAttention(self.dec_units, **api.layer_edits)

        def call(self, x, hidden, enc_output):
            # enc_output shape == (batch_size, max_length, hidden_size)
            context_vector, attention_weights = self.attention(
                hidden, enc_output, **api.call_edits
            )

            # x shape after passing through embedding == (batch_size, 1, embedding_dim)
            x = self.embedding(x)

            # x shape after concatenation == (batch_size, 1, embedding_dim +
            # hidden_size)
            x = ops.concatenate([ops.expand_dims(context_vector, 1), x], axis=-1)

            # passing the concatenated vector to the GRU
            output, state = self.gru(x)

            # output shape == (batch_size * 1, hidden_size)
            output = ops.reshape(output, (-1, output.shape[2]))

            # output shape == (batch_size, vocab)
            x = self.fc(output)

            return x, state, attention_weights

    encoder = Encoder(VOCABULARY, EMBEDDING, UNITS, batch_sz)
    decoder = Decoder(VOCABULARY, EMBEDDING, UNITS, batch_sz)
    return encoder, decoder


def teacher_forced(encoder, decoder, inp, targ):
    """The tutorial's `train_step` forward pass: the encoder once, then the
    decoder one target step at a time. Per step: (predictions, dec_hidden,
    attention_weights)."""
    enc_hidden = encoder.initialize_hidden_state()
    enc_output, enc_hidden = encoder(inp, enc_hidden)
    dec_hidden = enc_hidden
    dec_input = ops.expand_dims(ops.convert_to_tensor([START] * len(inp)), 1)
    steps = []
    for t in range(1, targ.shape[1]):
        predictions, dec_hidden, attention_weights = decoder(
            dec_input, dec_hidden, enc_output
        )
        steps.append((predictions, dec_hidden, attention_weights))
        dec_input = ops.expand_dims(targ[:, t], 1)
    return enc_output, steps


# -- the comparison --------------------------------------------------------------


def data(seed):
    rng = np.random.default_rng(seed)
    inp = rng.integers(2, VOCABULARY, size=(BATCH, SOURCE_LENGTH)).astype("int32")
    targ = rng.integers(2, VOCABULARY, size=(BATCH, TARGET_LENGTH)).astype("int32")
    targ[:, 0] = START
    return inp, targ


def build(encoder, decoder):
    teacher_forced(encoder, decoder, *data(0))


def as_trained(model, seed):
    """New values in every weight, biases included (a trained model's; the
    tutorial's `Dense` biases start at zero)."""
    rng = np.random.default_rng(seed)
    for variable in model.weights:
        variable.assign(
            ops.convert_to_numpy(variable) + 0.3 * rng.normal(size=variable.shape)
        )


def copy_tutorial_weights(tutorial_decoder, decoder):
    """The tutorial's weights into the swapped program: every layer as it is,
    and the attention's `W1`, `W2`, `V` into `W_q`, `W_k`, `v` and, with
    `use_bias=True`, `W1.bias + W2.bias` into the one bias inside the tanh;
    `V.bias` adds the same number to every score and cancels in the softmax."""
    for name in ("embedding", "gru", "fc"):
        getattr(decoder, name).set_weights(
            getattr(tutorial_decoder, name).get_weights()
        )
    source = tutorial_decoder.attention
    (w1, b1), (w2, b2), (v, _) = (
        source.W1.get_weights(),
        source.W2.get_weights(),
        source.V.get_weights(),
    )
    weights = [w1, w2, v[:, 0]]
    if decoder.attention.use_bias:
        weights.append(b1 + b2)
    decoder.attention.set_weights(weights)


def programs(api):
    """The tutorial's program with trained weights, and `api`'s with them
    copied."""
    tutorial_encoder, tutorial_decoder = nmt_tutorial_program(TUTORIAL)
    encoder, decoder = nmt_tutorial_program(api)
    build(tutorial_encoder, tutorial_decoder)
    build(encoder, decoder)
    as_trained(tutorial_encoder, 1)
    as_trained(tutorial_decoder, 2)
    encoder.set_weights(tutorial_encoder.get_weights())
    copy_tutorial_weights(tutorial_decoder, decoder)
    return (tutorial_encoder, tutorial_decoder), (encoder, decoder)


def test_the_tutorial_runs_after_the_swap_and_the_documented_edits():
    (tutorial_encoder, tutorial_decoder), (encoder, decoder) = programs(KERAS_ATTN)
    assert type(decoder.attention) is keras_attn.layers.BahdanauAttention
    # The tutorial's attention has 2 * units + 1 parameters more than the
    # bias-free layer; `use_bias=True` takes `units` of them (the V bias is
    # the one left out).
    tutorial_params = tutorial_decoder.attention.count_params()
    assert tutorial_params == 2 * UNITS * UNITS + 3 * UNITS + 1
    assert decoder.attention.count_params() == tutorial_params - UNITS - 1

    inp, targ = data(3)
    expected_output, expected_steps = teacher_forced(
        tutorial_encoder, tutorial_decoder, inp, targ
    )
    enc_output, steps = teacher_forced(encoder, decoder, inp, targ)
    np.testing.assert_allclose(to_numpy(enc_output), to_numpy(expected_output))
    for (predictions, hidden, weights), (
        expected_predictions,
        expected_hidden,
        expected_weights,
    ) in zip(steps, expected_steps, strict=True):
        # The tutorial's weights are (batch, T, 1); keras-attn's (batch, T).
        np.testing.assert_allclose(
            to_numpy(weights), to_numpy(expected_weights)[..., 0], atol=1e-6
        )
        np.testing.assert_allclose(
            to_numpy(predictions), to_numpy(expected_predictions), atol=1e-5
        )
        np.testing.assert_allclose(
            to_numpy(hidden), to_numpy(expected_hidden), atol=1e-5
        )

    # The attention layer alone, as the tutorial's sample calls it:
    # `attention_result, attention_weights = attention_layer(sample_hidden,
    # sample_output)`.
    sample_hidden = to_numpy(expected_steps[-1][1])
    sample_output = to_numpy(expected_output)
    expected_result, expected_weights = tutorial_decoder.attention(
        sample_hidden, sample_output
    )
    attention_result, attention_weights = decoder.attention(
        sample_hidden, sample_output, return_attention_scores=True
    )
    np.testing.assert_allclose(
        to_numpy(attention_result), to_numpy(expected_result), atol=1e-5
    )
    np.testing.assert_allclose(
        to_numpy(attention_weights), to_numpy(expected_weights)[..., 0], atol=1e-6
    )


def test_without_use_bias_the_outputs_differ():
    """The control: the same swap and copy without `use_bias=True` loses the
    tutorial's biases inside the tanh, and the context is another."""
    (_, tutorial_decoder), (_, decoder) = programs(KERAS_ATTN_WITHOUT_BIAS)
    assert not decoder.attention.use_bias
    assert decoder.attention.count_params() == 2 * UNITS * UNITS + UNITS
    rng = np.random.default_rng(4)
    hidden = rng.normal(size=(BATCH, UNITS)).astype("float32")
    values = rng.normal(size=(BATCH, SOURCE_LENGTH, UNITS)).astype("float32")
    expected_context, expected_weights = tutorial_decoder.attention(hidden, values)
    context, weights = decoder.attention(hidden, values, return_attention_scores=True)
    assert np.abs(to_numpy(context) - to_numpy(expected_context)).max() > 0.05
    assert np.abs(to_numpy(weights) - to_numpy(expected_weights)[..., 0]).max() > 0.01


def test_the_migration_page_documents_the_edits():
    """The edits applied above are the ones docs/TF_ADDONS_MIGRATION.md gives
    for the tutorial (tests/test_docs.py runs its blocks)."""
    with open(f"{REPO_ROOT}/docs/TF_ADDONS_MIGRATION.md", encoding="utf-8") as f:
        page = f.read()
    blocks = re.findall(r"^```python[^\n]*\n(.*?)^```", page, re.M | re.S)
    tutorial_blocks = "".join(b for b in blocks if "NMT tutorial" in b)
    assert "BahdanauAttention(8, use_bias=True)" in tutorial_blocks
    assert "return_attention_scores=True" in tutorial_blocks
    assert "b1 + b2" in tutorial_blocks


@pytest.mark.tf_only
def test_the_tutorials_train_step_runs():
    """The tutorial's `@tf.function` `train_step` (its masked loss, Adam) on
    the swapped program: the loss is the tutorial program's, and every weight
    gets a gradient; the one bias's is each of `W1.bias` and `W2.bias`'s."""
    import tensorflow as tf

    def train_step_fn(encoder, decoder):
        optimizer = keras.optimizers.Adam()
        loss_object = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="none"
        )

        def loss_function(real, pred):
            mask = tf.math.logical_not(tf.math.equal(real, 0))
            loss_ = loss_object(real, pred)
            mask = tf.cast(mask, dtype=loss_.dtype)
            loss_ *= mask
            return tf.reduce_mean(loss_)

        @tf.function
        def train_step(inp, targ, enc_hidden):
            loss = 0
            with tf.GradientTape() as tape:
                enc_output, enc_hidden = encoder(inp, enc_hidden)
                dec_hidden = enc_hidden
                dec_input = tf.expand_dims([START] * BATCH, 1)
                # Teacher forcing - feeding the target as the next input
                for t in range(1, targ.shape[1]):
                    # passing enc_output to the decoder
                    predictions, dec_hidden, _ = decoder(
                        dec_input, dec_hidden, enc_output
                    )
                    loss += loss_function(targ[:, t], predictions)
                    # using teacher forcing
                    dec_input = tf.expand_dims(targ[:, t], 1)
            batch_loss = loss / int(targ.shape[1])
            variables = encoder.trainable_variables + decoder.trainable_variables
            gradients = tape.gradient(loss, variables)
            optimizer.apply_gradients(zip(gradients, variables, strict=True))
            return batch_loss, gradients

        return train_step

    (tutorial_encoder, tutorial_decoder), (encoder, decoder) = programs(KERAS_ATTN)
    inp, targ = data(5)
    targ[0, 3:] = 0  # padding, which the loss masks
    hidden = encoder.initialize_hidden_state()
    expected_loss, expected_gradients = train_step_fn(
        tutorial_encoder, tutorial_decoder
    )(inp, targ, hidden)
    loss, gradients = train_step_fn(encoder, decoder)(inp, targ, hidden)
    np.testing.assert_allclose(loss.numpy(), expected_loss.numpy(), rtol=1e-5)
    assert all(gradient is not None for gradient in gradients)

    def gradient_of(encoder, decoder, gradients, variable):
        variables = encoder.trainable_variables + decoder.trainable_variables
        (index,) = [i for i, found in enumerate(variables) if found is variable]
        return gradients[index].numpy()

    ours, theirs = decoder.attention, tutorial_decoder.attention
    for our_variable, their_variable in (
        (ours.query_kernel, theirs.W1.kernel),
        (ours.key_kernel, theirs.W2.kernel),
        (ours.score_bias, theirs.W1.bias),
        (ours.score_bias, theirs.W2.bias),
    ):
        np.testing.assert_allclose(
            gradient_of(encoder, decoder, gradients, our_variable),
            gradient_of(
                tutorial_encoder, tutorial_decoder, expected_gradients, their_variable
            ),
            atol=1e-5,
        )
