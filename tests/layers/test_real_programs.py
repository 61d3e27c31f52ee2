"""The model code of three real programs, run after a class-name swap alone.

Each program below is written the way its public source writes it (keras.io's
"Text classification with Transformer", keras.io's English-to-Spanish
"Sequence-to-sequence Transformer" in its Keras 3 form, and keras.io's
"English-to-Spanish translation with KerasHub"), in backend-neutral
`keras.ops`, with the classes it uses taken from a namespace: Keras's and
keras-hub's, or keras-attn's under the same names. The programs are built
twice, the weights copied across (`set_weights`, and `.weights.h5` files where
the program uses keras-hub's layers), and the outputs compared at the
positions that hold tokens (keras-attn gives a padded query row zeros where
Keras averages the values); then the keras-attn program trains a step.

TensorFlow's NMT tutorial needs two documented edits besides the swap
(`use_bias=True`, `return_attention_scores=True`):
tests/layers/test_nmt_tutorial.py runs it.
"""

from types import SimpleNamespace

import keras
import keras_hub
import numpy as np
from keras import layers, ops

import keras_attn

VOCABULARY = 60
LENGTH = 12
WIDTH = 16
HEADS = 2
FEED_FORWARD = 32

KERAS = SimpleNamespace(
    MultiHeadAttention=keras.layers.MultiHeadAttention,
    TokenAndPositionEmbedding=keras_hub.layers.TokenAndPositionEmbedding,
    TransformerEncoder=keras_hub.layers.TransformerEncoder,
    TransformerDecoder=keras_hub.layers.TransformerDecoder,
)
KERAS_ATTN = SimpleNamespace(
    MultiHeadAttention=keras_attn.layers.MultiHeadAttention,
    TokenAndPositionEmbedding=keras_attn.layers.TokenAndPositionEmbedding,
    TransformerEncoder=keras_attn.layers.TransformerEncoder,
    TransformerDecoder=keras_attn.layers.TransformerDecoder,
)


def token_ids(seed, batch=4, shortest=5):
    """`(batch, LENGTH)` ids in [2, VOCABULARY) followed by 0 padding."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(2, VOCABULARY, size=(batch, LENGTH)).astype("int32")
    lengths = np.linspace(LENGTH, shortest, batch).round().astype(int)
    for row, length in enumerate(lengths):
        ids[row, length:] = 0
    return ids


# -- keras.io: text classification with a Transformer block ----------------------


def classifier_program(api):
    class TransformerBlock(layers.Layer):
        def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
            super().__init__()
            self.att = api.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
            self.ffn = keras.Sequential(
                [layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)]
            )
            self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
            self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
            self.dropout1 = layers.Dropout(rate)
            self.dropout2 = layers.Dropout(rate)

        def call(self, inputs, training=False):
            attn_output = self.att(inputs, inputs)
            attn_output = self.dropout1(attn_output, training=training)
            out1 = self.layernorm1(inputs + attn_output)
            ffn_output = self.dropout2(self.ffn(out1), training=training)
            return self.layernorm2(out1 + ffn_output)

    class TokenAndPositionEmbedding(layers.Layer):
        def __init__(self, maxlen, vocab_size, embed_dim):
            super().__init__()
            self.token_emb = layers.Embedding(
                input_dim=vocab_size, output_dim=embed_dim
            )
            self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

        def call(self, x):
            positions = ops.arange(0, ops.shape(x)[-1])
            return self.token_emb(x) + self.pos_emb(positions)

    inputs = layers.Input(shape=(LENGTH,))
    x = TokenAndPositionEmbedding(LENGTH, VOCABULARY, WIDTH)(inputs)
    x = TransformerBlock(WIDTH, HEADS, FEED_FORWARD)(x)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dropout(0.1)(x)
    x = layers.Dense(20, activation="relu")(x)
    x = layers.Dropout(0.1)(x)
    outputs = layers.Dense(2, activation="softmax")(x)
    return keras.Model(inputs=inputs, outputs=outputs)


# -- keras.io: English-to-Spanish sequence-to-sequence Transformer ---------------


def seq2seq_program(api):
    class TransformerEncoder(layers.Layer):
        def __init__(self, embed_dim, dense_dim, num_heads, **kwargs):
            super().__init__(**kwargs)
            self.attention = api.MultiHeadAttention(
                num_heads=num_heads, key_dim=embed_dim
            )
            self.dense_proj = keras.Sequential(
                [layers.Dense(dense_dim, activation="relu"), layers.Dense(embed_dim)]
            )
            self.layernorm_1 = layers.LayerNormalization()
            self.layernorm_2 = layers.LayerNormalization()
            self.supports_masking = True

        def call(self, inputs, mask=None):
            padding_mask = None
            if mask is not None:  # (B, 1, T): Keras broadcasts it over queries
                padding_mask = ops.cast(mask[:, None, :], dtype="int32")
            attention_output = self.attention(
                query=inputs, value=inputs, key=inputs, attention_mask=padding_mask
            )
            proj_input = self.layernorm_1(inputs + attention_output)
            proj_output = self.dense_proj(proj_input)
            return self.layernorm_2(proj_input + proj_output)

    class PositionalEmbedding(layers.Layer):
        def __init__(self, sequence_length, vocab_size, embed_dim, **kwargs):
            super().__init__(**kwargs)
            self.token_embeddings = layers.Embedding(
                input_dim=vocab_size, output_dim=embed_dim
            )
            self.position_embeddings = layers.Embedding(
                input_dim=sequence_length, output_dim=embed_dim
            )

        def call(self, inputs):
            positions = ops.arange(0, ops.shape(inputs)[-1])
            return self.token_embeddings(inputs) + self.position_embeddings(positions)

        def compute_mask(self, inputs, mask=None):
            return ops.not_equal(inputs, 0)

    class TransformerDecoder(layers.Layer):
        def __init__(self, embed_dim, latent_dim, num_heads, **kwargs):
            super().__init__(**kwargs)
            self.attention_1 = api.MultiHeadAttention(
                num_heads=num_heads, key_dim=embed_dim
            )
            self.attention_2 = api.MultiHeadAttention(
                num_heads=num_heads, key_dim=embed_dim
            )
            self.dense_proj = keras.Sequential(
                [layers.Dense(latent_dim, activation="relu"), layers.Dense(embed_dim)]
            )
            self.layernorm_1 = layers.LayerNormalization()
            self.layernorm_2 = layers.LayerNormalization()
            self.layernorm_3 = layers.LayerNormalization()
            self.supports_masking = True

        def call(self, inputs, encoder_outputs, mask=None):
            causal_mask = self.get_causal_attention_mask(inputs)  # (B, T, T)
            padding_mask = None
            if mask is not None:
                padding_mask = ops.cast(mask[:, None, :], dtype="int32")  # (B, 1, T)
                padding_mask = ops.minimum(padding_mask, causal_mask)
            attention_output_1 = self.attention_1(
                query=inputs, value=inputs, key=inputs, attention_mask=causal_mask
            )
            out_1 = self.layernorm_1(inputs + attention_output_1)
            attention_output_2 = self.attention_2(
                query=out_1,
                value=encoder_outputs,
                key=encoder_outputs,
                attention_mask=padding_mask,
            )
            out_2 = self.layernorm_2(out_1 + attention_output_2)
            proj_output = self.dense_proj(out_2)
            return self.layernorm_3(out_2 + proj_output)

        def get_causal_attention_mask(self, inputs):
            batch_size, sequence_length = ops.shape(inputs)[0], ops.shape(inputs)[1]
            i = ops.arange(sequence_length)[:, None]
            j = ops.arange(sequence_length)
            mask = ops.cast(i >= j, dtype="int32")
            mask = ops.reshape(mask, (1, sequence_length, sequence_length))
            return ops.tile(mask, (batch_size, 1, 1))

    encoder_inputs = keras.Input(shape=(None,), dtype="int32", name="encoder_inputs")
    x = PositionalEmbedding(LENGTH, VOCABULARY, WIDTH)(encoder_inputs)
    encoder_outputs = TransformerEncoder(WIDTH, FEED_FORWARD, HEADS)(x)
    encoder = keras.Model(encoder_inputs, encoder_outputs)

    decoder_inputs = keras.Input(shape=(None,), dtype="int32", name="decoder_inputs")
    encoded_seq_inputs = keras.Input(shape=(None, WIDTH), name="decoder_state_inputs")
    x = PositionalEmbedding(LENGTH, VOCABULARY, WIDTH)(decoder_inputs)
    x = TransformerDecoder(WIDTH, FEED_FORWARD, HEADS)(x, encoded_seq_inputs)
    x = layers.Dropout(0.5)(x)
    decoder_outputs = layers.Dense(VOCABULARY, activation="softmax")(x)
    decoder = keras.Model([decoder_inputs, encoded_seq_inputs], decoder_outputs)

    decoder_outputs = decoder([decoder_inputs, encoder(encoder_inputs)])
    return keras.Model([encoder_inputs, decoder_inputs], decoder_outputs)


# -- keras.io: English-to-Spanish translation with KerasHub ----------------------


def keras_hub_nmt_program(api):
    encoder_inputs = keras.Input(shape=(None,), name="encoder_inputs")
    x = api.TokenAndPositionEmbedding(
        vocabulary_size=VOCABULARY,
        sequence_length=LENGTH,
        embedding_dim=WIDTH,
    )(encoder_inputs)
    encoder_outputs = api.TransformerEncoder(
        intermediate_dim=FEED_FORWARD, num_heads=HEADS
    )(inputs=x)

    decoder_inputs = keras.Input(shape=(None,), name="decoder_inputs")
    encoded_seq_inputs = keras.Input(shape=(None, WIDTH), name="decoder_state_inputs")
    x = api.TokenAndPositionEmbedding(
        vocabulary_size=VOCABULARY,
        sequence_length=LENGTH,
        embedding_dim=WIDTH,
    )(decoder_inputs)
    x = api.TransformerDecoder(intermediate_dim=FEED_FORWARD, num_heads=HEADS)(
        decoder_sequence=x, encoder_sequence=encoded_seq_inputs
    )
    x = keras.layers.Dropout(0.5)(x)
    decoder_outputs = keras.layers.Dense(VOCABULARY, activation="softmax")(x)
    decoder = keras.Model([decoder_inputs, encoded_seq_inputs], decoder_outputs)
    decoder_outputs = decoder([decoder_inputs, encoder_outputs])
    return keras.Model(
        [encoder_inputs, decoder_inputs], decoder_outputs, name="transformer"
    )


def uses_keras_attn(model):
    """The classes of keras-attn that a built program holds."""
    found = set()

    def visit(layer):
        if type(layer).__module__.startswith("keras_attn"):
            found.add(type(layer).__name__)
        for child in layer._flatten_layers(include_self=False, recursive=False):
            visit(child)

    visit(model)
    return found


def train_one_step(model, inputs, targets):
    model.compile("rmsprop", loss="sparse_categorical_crossentropy")
    history = model.fit(inputs, targets, batch_size=len(targets), epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_keras_io_text_classifier():
    reference = classifier_program(KERAS)
    ours = classifier_program(KERAS_ATTN)
    assert uses_keras_attn(ours) == {"MultiHeadAttention"}
    ours.set_weights(reference.get_weights())
    ids = token_ids(0)
    np.testing.assert_allclose(
        ours.predict(ids, verbose=0), reference.predict(ids, verbose=0), atol=1e-6
    )
    train_one_step(ours, ids, np.array([0, 1, 0, 1]))


def test_keras_io_seq2seq_transformer():
    """Its masks are `(B, 1, T)` padding masks and a tiled `(B, T, T)` causal
    mask, combined with `minimum`: int32, broadcast by the layer."""
    reference = seq2seq_program(KERAS)
    ours = seq2seq_program(KERAS_ATTN)
    assert uses_keras_attn(ours) == {"MultiHeadAttention"}
    ours.set_weights(reference.get_weights())
    source, target = token_ids(1), token_ids(2, shortest=6)
    expected = reference.predict([source, target], verbose=0)
    actual = ours.predict([source, target], verbose=0)
    tokens = target != 0
    np.testing.assert_allclose(actual[tokens], expected[tokens], atol=1e-5)
    train_one_step(ours, [source, target], token_ids(3))


def test_keras_hub_nmt_program_and_its_weight_files(tmp_path):
    reference = keras_hub_nmt_program(KERAS)
    ours = keras_hub_nmt_program(KERAS_ATTN)
    assert {
        "TokenAndPositionEmbedding",
        "TransformerEncoder",
        "TransformerDecoder",
    } <= uses_keras_attn(ours)
    assert len(ours.weights) == len(reference.weights)
    source, target = token_ids(4), token_ids(5, shortest=6)
    tokens = target != 0
    # keras-hub's weight file into keras-attn's program, and back.
    reference.save_weights(tmp_path / "keras_hub.weights.h5")
    ours.load_weights(tmp_path / "keras_hub.weights.h5")
    expected = reference.predict([source, target], verbose=0)
    np.testing.assert_allclose(
        ours.predict([source, target], verbose=0)[tokens], expected[tokens], atol=1e-5
    )
    # New values in keras-attn's program, saved, loaded into keras-hub's.
    rng = np.random.default_rng(0)
    for variable in ours.weights:
        variable.assign(
            ops.convert_to_numpy(variable) + 0.05 * rng.normal(size=variable.shape)
        )
    ours.save_weights(tmp_path / "keras_attn.weights.h5")
    reference.load_weights(tmp_path / "keras_attn.weights.h5")
    np.testing.assert_allclose(
        reference.predict([source, target], verbose=0)[tokens],
        ours.predict([source, target], verbose=0)[tokens],
        atol=1e-5,
    )
    train_one_step(ours, [source, target], token_ids(6))
