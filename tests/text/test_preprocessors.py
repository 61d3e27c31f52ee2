"""The preprocessors (keras-hub's pattern): strings -> a task's inputs as
Keras layers that map a `tf.data.Dataset`, so `fit` and `evaluate` run on raw
strings; each packs what the task's pipeline packs."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_attn.models import (
    TextClassifier,
    TransformerLanguageModel,
    TransformerTranslator,
)
from keras_attn.text import (
    END_ID,
    START_ID,
    LanguageModelPreprocessor,
    TextClassifierPreprocessor,
    TranslatorPreprocessor,
    translation_dataset,
)

pytestmark = pytest.mark.tf_only  # TensorFlow Text

TEXTS = ["the house is big", "where is the station", ""]
SIZES = {"embedding_dim": 16, "num_heads": 2, "intermediate_dim": 32}


def test_classifier_preprocessor_pads_and_maps_a_dataset_for_fit(
    small_tokenizer, tmp_path
):
    preprocessor = TextClassifierPreprocessor(small_tokenizer, 8)
    ids = preprocessor(TEXTS)
    assert ids.shape == (3, 8) and ids.dtype == tf.int32
    ragged = small_tokenizer.tokenize(TEXTS)
    for row, tokens in zip(ids.numpy(), ragged.to_list(), strict=True):
        np.testing.assert_array_equal(row[: len(tokens)], tokens[:8])
        assert not row[len(tokens) :].any()
    classifier = TextClassifier(
        small_tokenizer.vocabulary_size, 8, num_layers=1, tokenizer=small_tokenizer,
        **SIZES,
    )  # fmt: skip
    assert classifier.preprocessor.sequence_length == 8
    assert classifier.preprocessor is classifier.preprocessor  # built once
    dataset = tf.data.Dataset.from_tensor_slices((TEXTS, [1, 0, 1])).batch(2)
    classifier.compile("adam", "binary_crossentropy")
    history = classifier.fit(dataset.map(classifier.preprocessor), verbose=0)
    assert np.isfinite(history.history["loss"][0])
    again = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(preprocessor)
    )
    # The config holds no vocabulary: the tokenizer (and its dense copy)
    # get it from its assets.
    with pytest.raises(ValueError, match="has no vocabulary"):
        again(TEXTS)
    small_tokenizer.save_assets(tmp_path)
    again.tokenizer.load_assets(tmp_path)
    np.testing.assert_array_equal(again(TEXTS).numpy(), ids.numpy())


def test_language_model_preprocessor_shifts_as_keras_hubs(small_tokenizer):
    preprocessor = LanguageModelPreprocessor(small_tokenizer, 6)
    x, y, weights = preprocessor(TEXTS[:2])
    tokens = small_tokenizer.tokenize(TEXTS[:2]).to_list()
    full = [[START_ID, *t, END_ID][:7] for t in tokens]
    for row in range(2):
        n = len(full[row]) - 1
        np.testing.assert_array_equal(x.numpy()[row, :n], full[row][:-1])
        np.testing.assert_array_equal(y.numpy()[row, :n], full[row][1:])
        np.testing.assert_array_equal(weights.numpy()[row], np.arange(6) < n)
    with pytest.raises(ValueError, match="next tokens"):
        preprocessor(TEXTS, [1, 2, 3])
    model = TransformerLanguageModel(
        small_tokenizer.vocabulary_size, 6, num_layers=1, tokenizer=small_tokenizer,
        **SIZES,
    )  # fmt: skip
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    dataset = tf.data.Dataset.from_tensor_slices(TEXTS).batch(2)
    loss = model.evaluate(dataset.map(model.preprocessor), verbose=0)
    assert np.isfinite(loss)


def test_translator_preprocessor_packs_as_the_translation_pipeline(small_tokenizer):
    preprocessor = TranslatorPreprocessor(small_tokenizer, small_tokenizer, 9, 7)
    x, y, weights = preprocessor({"source": TEXTS[:2], "target": TEXTS[1::-1]})
    pipeline = translation_dataset(
        list(zip(TEXTS[:2], TEXTS[1::-1], strict=True)), small_tokenizer,
        small_tokenizer, batch_size=2, max_length=9, target_length=7,
        shuffle=False, bucket_boundaries=None, sample_weight=True,
    )  # fmt: skip
    inputs, targets, pipeline_weights = next(iter(pipeline))
    for ours, theirs in (
        (x["encoder_inputs"], inputs["encoder_inputs"]),
        (x["decoder_inputs"], inputs["decoder_inputs"]),
        (y, targets),
        (weights, pipeline_weights),
    ):
        width = theirs.shape[1]
        np.testing.assert_array_equal(ours.numpy()[:, :width], theirs.numpy())
        assert not ours.numpy()[:, width:].any()
    assert x["encoder_inputs"].shape == (2, 9) and y.shape == (2, 7)
    with pytest.raises(ValueError, match="Received: keys"):
        preprocessor({"source": TEXTS})
    translator = TransformerTranslator(
        small_tokenizer.vocabulary_size, small_tokenizer.vocabulary_size,
        sequence_length=7, num_encoder_layers=1, num_decoder_layers=1,
        shared_vocabulary=True, source_tokenizer=small_tokenizer,
        target_tokenizer=small_tokenizer, **SIZES,
    )  # fmt: skip
    assert translator.preprocessor.target_length == 7
    translator.compile(
        "adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    pairs = tf.data.Dataset.from_tensor_slices({"source": TEXTS, "target": TEXTS})
    loss = translator.evaluate(pairs.batch(2).map(translator.preprocessor), verbose=0)
    assert np.isfinite(loss)
