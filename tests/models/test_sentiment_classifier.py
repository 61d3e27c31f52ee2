import keras
import numpy as np
import pytest

from keras_attn.models.sentiment_classifier import (
    sentiment_classifier,
    sentiment_self_attention,
    sentiment_token_weights,
)
from tests.test_case import to_numpy

TOKENS = np.array([[5, 6, 7, 0, 0], [8, 9, 10, 11, 12]], "int32")


@pytest.mark.parametrize("pooling", ["mean", "attention"])
def test_padding_does_not_change_the_prediction(pooling):
    model = sentiment_classifier(
        20,
        8,
        embedding_dim=8,
        num_layers=1,
        num_heads=2,
        intermediate_dim=16,
        pooling=pooling,
    )
    prob = to_numpy(model(TOKENS))
    assert prob.shape == (2, 1) and prob.dtype == np.float32
    assert np.all((prob > 0) & (prob < 1))
    trimmed = to_numpy(model(TOKENS[:1, :3]))
    np.testing.assert_allclose(prob[:1], trimmed, atol=1e-6)
    if pooling == "attention":
        weights = to_numpy(sentiment_token_weights(model)(TOKENS))
        np.testing.assert_array_equal(weights[0, 3:], 0.0)
        np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
    else:
        with pytest.raises(ValueError, match="pooling='attention'"):
            sentiment_token_weights(model)


@pytest.mark.parametrize("embedding_norm", [False, True])
def test_self_attention_of_an_encoder_block(embedding_norm):
    model = sentiment_classifier(
        20,
        8,
        embedding_dim=8,
        num_layers=2,
        num_heads=2,
        intermediate_dim=16,
        embedding_norm=embedding_norm,
    )
    assert ("embedding_norm" in [layer.name for layer in model.layers]) is (
        embedding_norm
    )
    last = to_numpy(sentiment_self_attention(model)(TOKENS))
    assert last.shape == (2, 2, 5, 5)
    np.testing.assert_allclose(last[0, :, :3].sum(-1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(last[0, :, :, 3:], 0.0)  # padding as keys
    np.testing.assert_array_equal(last[0, :, 3:], 0.0)  # padding as queries
    # The block's own weights on its real input: layer 1 sees layer 0's output.
    below = keras.Model(model.input, model.get_layer("encoder_0").output)
    _, expected = model.get_layer("encoder_1")(
        below(TOKENS), padding_mask=TOKENS != 0, return_attention_scores=True
    )
    np.testing.assert_allclose(last, to_numpy(expected), atol=1e-6)
    first = to_numpy(sentiment_self_attention(model, layer=0)(TOKENS))
    assert not np.allclose(first, last)
    for layer in (2, -3):
        with pytest.raises(ValueError, match="one of the model's 2 encoder blocks"):
            sentiment_self_attention(model, layer=layer)


def test_learns_a_token_rule_and_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 20, size=(256, 6)).astype("int32")
    labels = (tokens == 5).any(-1).astype("float32")  # positive iff token 5 occurs
    model = sentiment_classifier(
        20,
        6,
        embedding_dim=16,
        num_layers=1,
        num_heads=2,
        intermediate_dim=32,
        dropout=0.0,
    )
    model.compile(
        keras.optimizers.Adam(3e-3), "binary_crossentropy", metrics=["accuracy"]
    )
    history = model.fit(tokens, labels, epochs=25, batch_size=32, verbose=0)
    assert history.history["accuracy"][-1] > 0.9
    path = tmp_path / "classifier.keras"
    model.save(path)
    restored = keras.saving.load_model(path)
    np.testing.assert_allclose(
        to_numpy(restored(tokens[:8])), to_numpy(model(tokens[:8])), atol=1e-6
    )


def test_bad_arguments():
    with pytest.raises(ValueError, match="Received: pooling='max'"):
        sentiment_classifier(10, 5, pooling="max")
