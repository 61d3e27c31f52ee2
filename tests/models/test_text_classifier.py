import keras
import numpy as np
import pytest

from keras_attn.models import TextClassifier, TextClassifierEnsemble
from tests.test_case import to_numpy

TOKENS = np.array([[5, 6, 7, 0, 0], [8, 9, 10, 11, 12]], "int32")


def small_classifier(**kwargs):
    return TextClassifier(
        20, 8, embedding_dim=8, num_heads=2, intermediate_dim=16, **kwargs
    )


@pytest.mark.parametrize("pooling", ["mean", "attention"])
def test_padding_does_not_change_the_prediction(pooling):
    model = small_classifier(num_layers=1, pooling=pooling)
    prob = to_numpy(model(TOKENS))
    assert prob.shape == (2, 1) and prob.dtype == np.float32
    assert np.all((prob > 0) & (prob < 1))
    trimmed = to_numpy(model(TOKENS[:1, :3]))
    np.testing.assert_allclose(prob[:1], trimmed, atol=1e-6)
    maps = model.attention_maps(TOKENS)
    assert ("pooling" in maps) is (pooling == "attention")
    if pooling == "attention":
        weights = to_numpy(maps["pooling"])
        np.testing.assert_array_equal(weights[0, 3:], 0.0)
        np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
        # The pooling weights are those of the pooling layer on the encoder's
        # output, the functional graph's own.
        sequence = model.pooling.input  # the backbone's output, Keras-masked
        encoder = keras.Model(model.input, sequence)
        _, expected = model.pooling(
            encoder(TOKENS), mask=TOKENS != 0, return_attention_scores=True
        )
        np.testing.assert_allclose(weights, to_numpy(expected), atol=1e-6)


@pytest.mark.parametrize("pooling", ["mean", "attention"])
def test_a_text_with_no_token_gets_a_finite_probability(pooling):
    # An empty text tokenizes to padding only; Keras's masked average divides
    # by a zero count there.
    model = small_classifier(num_layers=1, pooling=pooling)
    tokens = np.concatenate([TOKENS, np.zeros((1, 5), "int32")])
    prob = to_numpy(model(tokens))
    assert np.all(np.isfinite(prob))
    # The empty row is the classifier's bias alone: the pooled vector is zero.
    head = model.get_layer("positive_probability")
    bias = to_numpy(head.bias)
    np.testing.assert_allclose(prob[2], 1 / (1 + np.exp(-bias)), atol=1e-6)
    np.testing.assert_allclose(prob[:2], to_numpy(model(TOKENS)), atol=1e-6)


@pytest.mark.parametrize("embedding_norm", [False, True])
def test_self_attention_of_every_encoder_block(embedding_norm):
    model = small_classifier(num_layers=2, embedding_norm=embedding_norm)
    assert (model.embedding_norm is not None) is embedding_norm
    first, last = (to_numpy(w) for w in model.attention_maps(TOKENS)["self_attention"])
    assert last.shape == (2, 2, 5, 5)
    np.testing.assert_allclose(last[0, :, :3].sum(-1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(last[0, :, :, 3:], 0.0)  # padding as keys
    np.testing.assert_array_equal(last[0, :, 3:], 0.0)  # padding as queries
    # The block's own weights on its real input: layer 1 sees layer 0's output.
    below = keras.Model(model.backbone.input, model.encoder_blocks[0].output)
    _, expected = model.encoder_blocks[1](
        below(TOKENS), padding_mask=TOKENS != 0, return_attention_scores=True
    )
    np.testing.assert_allclose(last, to_numpy(expected), atol=1e-6)
    assert not np.allclose(first, last)


def test_learns_a_token_rule_and_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 20, size=(256, 6)).astype("int32")
    labels = (tokens == 5).any(-1).astype("float32")  # positive iff token 5 occurs
    model = TextClassifier(
        20, 6, embedding_dim=16, num_layers=1, num_heads=2, intermediate_dim=32
    )
    model.compile(
        keras.optimizers.Adam(3e-3), "binary_crossentropy", metrics=["accuracy"]
    )
    history = model.fit(tokens, labels, epochs=25, batch_size=32, verbose=0)
    assert history.history["accuracy"][-1] > 0.9
    path = tmp_path / "classifier.keras"
    model.save(path)
    restored = keras.saving.load_model(path)
    assert isinstance(restored, TextClassifier)
    assert restored.get_config() == model.get_config()
    np.testing.assert_allclose(
        to_numpy(restored(tokens[:8])), to_numpy(model(tokens[:8])), atol=1e-6
    )


def test_an_ensemble_averages_its_members_and_round_trips(tmp_path):
    members = [
        small_classifier(num_layers=1, name="member_0"),
        small_classifier(num_layers=1, pooling="attention", name="member_1"),
    ]
    ensemble = TextClassifierEnsemble(members)
    expected = (to_numpy(members[0](TOKENS)) + to_numpy(members[1](TOKENS))) / 2
    np.testing.assert_allclose(to_numpy(ensemble(TOKENS)), expected, atol=1e-7)
    assert len(ensemble.trainable_weights) == sum(
        len(member.trainable_weights) for member in members
    )
    ensemble.save(tmp_path / "ensemble.keras")
    restored = keras.saving.load_model(tmp_path / "ensemble.keras")
    assert isinstance(restored, TextClassifierEnsemble) and len(restored.members) == 2
    np.testing.assert_allclose(to_numpy(restored(TOKENS)), expected, atol=1e-6)
    assert len(restored.attention_maps(TOKENS)["self_attention"]) == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="Received: pooling='max'"):
        TextClassifier(10, 5, pooling="max")
    with pytest.raises(ValueError, match="Received: members=\\[\\]"):
        TextClassifierEnsemble([])
    with pytest.raises(ValueError, match="needs the model's `tokenizer`"):
        small_classifier().classify(["A fine film."])
