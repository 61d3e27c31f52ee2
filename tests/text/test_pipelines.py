"""`tf.data` pipelines: shapes, special tokens, truncation, bucketing, windows."""

import collections
import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_attn.datasets import Document
from keras_attn.text import END_ID, PAD_ID, START_ID
from keras_attn.text.pipelines import (
    auto_bucket_boundaries,
    classification_dataset,
    language_model_dataset,
    translation_dataset,
    with_cardinality,
)
from tests.text.conftest import TRICKY_TEXT

LONG_SENTENCE = " ".join(["Das ist ein sehr langer Satz mit vielen Wörtern."] * 40)


def strip_padding(row):
    row = list(np.asarray(row))
    while row and row[-1] == PAD_ID:
        row.pop()
    return row


def all_batches(dataset):
    return list(dataset.as_numpy_iterator())


def test_translation_batches(pairs, english_tokenizer, german_tokenizer):
    dataset = translation_dataset(
        pairs, english_tokenizer, german_tokenizer, batch_size=8, shuffle=False
    )
    inputs, targets = dataset.element_spec
    assert set(inputs) == {"encoder_inputs", "decoder_inputs"}
    assert inputs["encoder_inputs"].dtype == tf.int32 and targets.dtype == tf.int32
    seen = collections.Counter()
    for batch_inputs, batch_targets in all_batches(dataset):
        encoder, decoder = (
            batch_inputs["encoder_inputs"],
            batch_inputs["decoder_inputs"],
        )
        assert decoder.shape == batch_targets.shape
        assert encoder.shape[1] in auto_bucket_boundaries(64)
        for source, decoder_in, decoder_out in zip(
            encoder, decoder, batch_targets, strict=True
        ):
            decoder_in, decoder_out = (
                strip_padding(decoder_in),
                strip_padding(decoder_out),
            )
            assert decoder_in[0] == START_ID and decoder_out[-1] == END_ID
            assert decoder_in[1:] == decoder_out[:-1]  # shifted by one
            assert START_ID not in strip_padding(source)
            english = english_tokenizer.detokenize(strip_padding(source)).numpy()
            german = german_tokenizer.detokenize(decoder_out).numpy()
            seen[(english.decode(), german.decode())] += 1
    assert seen == collections.Counter(pairs)  # every pair once, nothing dropped


def test_translation_truncation_keeps_every_example(
    english_tokenizer, german_tokenizer
):
    pairs = [("Short one.", "Kurz."), (LONG_SENTENCE, LONG_SENTENCE)]
    dataset = translation_dataset(
        pairs,
        english_tokenizer,
        german_tokenizer,
        batch_size=4,
        max_length=12,
        target_length=10,
        shuffle=False,
        bucket_boundaries=None,
    )
    [(inputs, targets)] = all_batches(dataset)
    assert inputs["encoder_inputs"].shape == (2, 12)
    assert targets.shape == inputs["decoder_inputs"].shape == (2, 10)
    long_target = targets[1]
    assert PAD_ID not in long_target and END_ID not in long_target  # cut, no end
    assert inputs["decoder_inputs"][1][0] == START_ID
    np.testing.assert_array_equal(inputs["decoder_inputs"][1][1:], long_target[:-1])
    assert PAD_ID not in inputs["encoder_inputs"][1]
    short = strip_padding(targets[0])
    assert short[-1] == END_ID


def test_translation_shuffle_seed_and_sample_weight(
    pairs, english_tokenizer, german_tokenizer
):
    def first_targets(seed):
        dataset = translation_dataset(
            pairs,
            english_tokenizer,
            german_tokenizer,
            batch_size=50,
            seed=seed,
            bucket_boundaries=None,
            sample_weight=True,
        )
        epochs = [all_batches(dataset)[0] for _ in range(2)]
        for _, targets, weights in epochs:
            np.testing.assert_array_equal(
                weights, (targets != PAD_ID).astype("float32")
            )
        return [e[1] for e in epochs]

    one, other = first_targets(seed=3), first_targets(seed=3)
    np.testing.assert_array_equal(one[0], other[0])  # reproducible
    assert not np.array_equal(one[0], one[1])  # reshuffled every epoch


def test_custom_bucket_boundaries(pairs, english_tokenizer, german_tokenizer):
    dataset = translation_dataset(
        pairs,
        english_tokenizer,
        german_tokenizer,
        batch_size=4,
        max_length=30,
        bucket_boundaries=[10, 20],
    )
    lengths = {inputs["encoder_inputs"].shape[1] for inputs, _ in all_batches(dataset)}
    assert lengths <= {10, 20, 30}
    assert auto_bucket_boundaries(64) == [8, 16, 32, 64]
    assert auto_bucket_boundaries(50) == [8, 16, 32, 50]
    with pytest.raises(ValueError, match="bucket_boundaries"):
        translation_dataset(
            pairs, english_tokenizer, german_tokenizer, bucket_boundaries="some"
        )


def test_translation_bad_arguments(english_tokenizer, german_tokenizer):
    with pytest.raises(ValueError, match="`pairs` is empty"):
        translation_dataset([], english_tokenizer, german_tokenizer)
    with pytest.raises(ValueError, match="max_length"):
        translation_dataset(
            [("a", "b")], english_tokenizer, german_tokenizer, max_length=0
        )
    with pytest.raises(ValueError, match="source, target"):
        translation_dataset([("only one",)], english_tokenizer, german_tokenizer)
    with pytest.raises(ValueError, match="source, target"):
        translation_dataset([(b"bytes", "str")], english_tokenizer, german_tokenizer)


def test_classification_batches(english_tokenizer):
    examples = [("A fine film.", 1), ("Dull.", 0), (LONG_SENTENCE, 1)] * 5
    dataset = classification_dataset(
        examples, english_tokenizer, batch_size=4, max_length=16, seed=0
    )
    batches = all_batches(dataset)
    labels = sorted(label for _, batch_labels in batches for label in batch_labels)
    assert labels == sorted(label for _, label in examples)
    for ids, batch_labels in batches:
        assert ids.dtype == np.int32 and batch_labels.dtype == np.int32
        assert ids.shape[1] in (8, 16) and ids.shape[0] == batch_labels.shape[0]
    longest = max(batches, key=lambda b: b[0].shape[1])[0]
    assert longest.shape[1] == 16 and (longest != PAD_ID).all(axis=1).any()
    with pytest.raises(ValueError, match="empty"):
        classification_dataset([], english_tokenizer)
    with pytest.raises(ValueError, match="integer label"):
        classification_dataset([("text", "positive")], english_tokenizer)
    with pytest.raises(ValueError, match="integer label"):
        classification_dataset([(3, 1)], english_tokenizer)


def stream(dataset):
    inputs, targets = zip(*all_batches(dataset), strict=True)
    return np.concatenate(inputs).reshape(-1), np.concatenate(targets).reshape(-1)


@pytest.mark.parametrize("sequence_length", [1, 7, 16])
def test_language_model_windows_cover_the_stream(
    lossless_tokenizer, play_text, sequence_length
):
    texts = [Document("play", play_text), TRICKY_TEXT]
    tokens = lossless_tokenizer.tokenize(play_text + TRICKY_TEXT).numpy()
    dataset = language_model_dataset(
        texts,
        lossless_tokenizer,
        sequence_length=sequence_length,
        batch_size=5,
        shuffle=False,
    )
    assert dataset.element_spec[0].shape.as_list() == [None, sequence_length]
    inputs, targets = stream(dataset)
    count = len(tokens) - 1  # every token but the first is a target once
    np.testing.assert_array_equal(inputs[:count], tokens[:-1])
    np.testing.assert_array_equal(targets[:count], tokens[1:])
    assert (inputs[count:] == PAD_ID).all() and (targets[count:] == PAD_ID).all()
    assert len(inputs) - count < sequence_length  # only the last window padded
    text = lossless_tokenizer.detokenize(tokens[:1]).numpy().decode()
    text += lossless_tokenizer.detokenize(targets[:count]).numpy().decode()
    assert text == play_text + TRICKY_TEXT


def test_language_model_shuffle_and_weights(lossless_tokenizer, play_text):
    dataset = language_model_dataset(
        play_text * 3,
        lossless_tokenizer,
        sequence_length=8,
        batch_size=4,
        seed=1,
        sample_weight=True,
    )
    ordered = language_model_dataset(
        play_text * 3,
        lossless_tokenizer,
        sequence_length=8,
        batch_size=4,
        shuffle=False,
    )
    shuffled = [row.tobytes() for b in all_batches(dataset) for row in b[0]]
    in_order = [row.tobytes() for b in all_batches(ordered) for row in b[0]]
    assert sorted(shuffled) == sorted(in_order) and shuffled != in_order
    for _, targets, weights in all_batches(dataset):
        np.testing.assert_array_equal(weights, (targets != PAD_ID).astype("float32"))


def test_language_model_bad_input(lossless_tokenizer):
    with pytest.raises(ValueError, match="no text"):
        language_model_dataset(["", "\n\n  "], lossless_tokenizer)
    with pytest.raises(TypeError, match="strings or Documents"):
        language_model_dataset([1, 2], lossless_tokenizer)
    with pytest.raises(ValueError, match="sequence_length"):
        language_model_dataset("text", lossless_tokenizer, sequence_length=0)


def windows(dataset):
    """Every window of `dataset`, in order: `(inputs, targets)`, each `[W, L]`."""
    inputs, targets = zip(*all_batches(dataset), strict=True)
    return np.concatenate(inputs), np.concatenate(targets)


# The stream below has 354 targets: 354 - L is not a multiple of S in most
# of these, S == L in three, and L = 512 is longer than the whole stream.
@pytest.mark.parametrize(
    ("sequence_length", "stride"),
    [(8, 8), (8, 3), (8, 1), (7, 2), (16, 5), (16, 16), (1, 1), (512, 128)],
)
def test_language_model_stride_scores_every_target_once_with_context(
    lossless_tokenizer, play_text, sequence_length, stride
):
    length = sequence_length
    texts = [Document("play", play_text), TRICKY_TEXT]
    tokens = lossless_tokenizer.tokenize(play_text + TRICKY_TEXT).numpy()
    count = len(tokens) - 1
    # The windows' inputs: the stream but its last token, then padding.
    padded_inputs = np.concatenate([tokens[:-1], np.full(length, PAD_ID)])
    dataset = language_model_dataset(
        texts,
        lossless_tokenizer,
        sequence_length=length,
        batch_size=3,
        shuffle=False,
        stride=stride,
    )
    assert dataset.element_spec[0].shape.as_list() == [None, length]
    assert dataset.element_spec[1].dtype == tf.int32
    inputs, targets = windows(dataset)
    assert inputs.dtype == targets.dtype == np.int32
    scored_positions, scored_targets = [], []
    for index, (window_inputs, window_targets) in enumerate(
        zip(inputs, targets, strict=True)
    ):
        start = index * stride  # window k starts at stream position kS
        np.testing.assert_array_equal(
            window_inputs, padded_inputs[start : start + length]
        )
        offsets = np.flatnonzero(window_targets != PAD_ID)
        assert offsets.size > 0  # no window without a target to score
        for offset in offsets:
            position = start + offset  # the target is tokens[position + 1]
            scored_positions.append(position)
            scored_targets.append(window_targets[offset])
            # Its context in the window: the stream up to its input token.
            context = window_inputs[: offset + 1]
            np.testing.assert_array_equal(context, tokens[start : position + 1])
            if index > 0:
                assert (context != PAD_ID).sum() > length - stride
    # Every target exactly once, in the stream's order.
    assert scored_positions == list(range(count))
    np.testing.assert_array_equal(scored_targets, tokens[1:])
    if stride == length:
        default_inputs, default_targets = windows(
            language_model_dataset(
                texts,
                lossless_tokenizer,
                sequence_length=length,
                batch_size=3,
                shuffle=False,
            )
        )
        np.testing.assert_array_equal(inputs, default_inputs)
        np.testing.assert_array_equal(targets, default_targets)


def test_language_model_stride_keeps_the_other_options(lossless_tokenizer, play_text):
    texts = [Document("play", play_text), TRICKY_TEXT]
    stream = [
        START_ID,
        *lossless_tokenizer.tokenize(play_text).numpy().tolist(),
        END_ID,
        START_ID,
        *lossless_tokenizer.tokenize(TRICKY_TEXT).numpy().tolist(),
        END_ID,
    ]

    def strided(**options):
        return language_model_dataset(
            texts,
            lossless_tokenizer,
            sequence_length=12,
            batch_size=4,
            stride=5,
            document_tokens=True,
            **options,
        )

    ordered = strided(shuffle=False, cache=False)
    inputs, targets = windows(ordered)
    scored = targets[targets != PAD_ID]  # row by row: in the stream's order
    assert scored.tolist() == stream[1:]

    def rows(batches):
        return [row.tobytes() for b in batches for row in np.concatenate(b[:2], axis=1)]

    in_order = rows([(inputs, targets)])
    shuffled = all_batches(strided(seed=1, sample_weight=True))
    for _, batch_targets, weights in shuffled:
        np.testing.assert_array_equal(
            weights, (batch_targets != PAD_ID).astype("float32")
        )
    assert sorted(rows(shuffled)) == sorted(in_order) and rows(shuffled) != in_order

    dropped = all_batches(strided(shuffle=False, drop_remainder=True))
    assert len(in_order) % 4 and {b[0].shape for b in dropped} == {(4, 12)}
    assert rows(dropped) == in_order[: len(in_order) // 4 * 4]

    counted = with_cardinality(strided(seed=1))
    assert int(counted.cardinality()) == len(all_batches(counted)) > 1


@pytest.mark.parametrize("stride", [0, 9, -1, 2.0, True, "4"])
def test_language_model_refuses_a_bad_stride(lossless_tokenizer, stride):
    received = re.escape(f"Received: stride={stride!r}")
    with pytest.raises(ValueError, match=rf"`stride` must be .*{received}"):
        language_model_dataset(
            "Some text.\n", lossless_tokenizer, sequence_length=8, stride=stride
        )


def test_pipelines_feed_model_fit(pairs, english_tokenizer, german_tokenizer):
    """A masked toy model trains on the translation batches (padding ignored),
    fed as docs/TRAINING.md shows: counted, and not reshuffled by `fit`, with no warning
    from Keras."""
    dataset = with_cardinality(
        translation_dataset(
            pairs, english_tokenizer, german_tokenizer, batch_size=16, max_length=16
        )
    )
    vocabulary = german_tokenizer.vocabulary_size
    encoder = keras.Input(shape=(None,), dtype="int32", name="encoder_inputs")
    decoder = keras.Input(shape=(None,), dtype="int32", name="decoder_inputs")
    embedded = keras.layers.Embedding(vocabulary, 8, mask_zero=True)(decoder)
    context = keras.layers.GlobalAveragePooling1D()(
        keras.layers.Embedding(english_tokenizer.vocabulary_size, 8, mask_zero=True)(
            encoder
        )
    )
    hidden = embedded + keras.layers.Reshape((1, 8))(context)
    logits = keras.layers.Dense(vocabulary)(hidden)
    model = keras.Model({"encoder_inputs": encoder, "decoder_inputs": decoder}, logits)
    model.compile(
        "adam",
        keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "ran out of data", "shuffle=True ignored"
        history = model.fit(dataset, epochs=2, verbose=0, shuffle=False)
    assert np.isfinite(history.history["loss"]).all()


def test_fit_knows_the_epoch_length_of_a_counted_pipeline(english_tokenizer):
    """Without a known cardinality, Keras warns that the input 'ran out of
    data' at the end of the first epoch (and counts one optimizer iteration
    too many per epoch); `with_cardinality` states the count."""
    examples = [(f"review number {i} was {'good' * (i % 3)}", i % 2) for i in range(40)]
    raw = classification_dataset(examples, english_tokenizer, batch_size=8)
    batches = len(all_batches(raw))

    def fitted_model(dataset):
        model = keras.Sequential(
            [
                keras.layers.Embedding(english_tokenizer.vocabulary_size, 4),
                keras.layers.GlobalAveragePooling1D(),
                keras.layers.Dense(1, activation="sigmoid"),
            ]
        )
        model.compile("adam", "binary_crossentropy")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(dataset, epochs=2, verbose=0, shuffle=False)
        ran_out = any("ran out of data" in str(w.message) for w in caught)
        return ran_out, int(model.optimizer.iterations.numpy())

    assert fitted_model(raw)[0]
    assert fitted_model(with_cardinality(raw)) == (False, 2 * batches)


def test_with_cardinality_counts_each_pipeline(
    pairs, english_tokenizer, german_tokenizer, lossless_tokenizer, play_text
):
    """The count is stated, equals what every (reshuffled) pass yields, and the
    elements are the pipeline's own."""
    pipelines = {
        "translation": translation_dataset(
            pairs, english_tokenizer, german_tokenizer, batch_size=8, seed=1
        ),
        "classification": classification_dataset(
            [(english, i % 2) for i, (english, _) in enumerate(pairs)],
            english_tokenizer,
            batch_size=8,
            seed=1,
        ),
        "language model": language_model_dataset(
            play_text, lossless_tokenizer, sequence_length=32, batch_size=4, seed=1
        ),
    }
    for name, raw in pipelines.items():
        assert int(raw.cardinality()) == tf.data.UNKNOWN_CARDINALITY, name
        counted = with_cardinality(raw)
        first, second = all_batches(counted), all_batches(counted)
        assert int(counted.cardinality()) == len(first) == len(second) > 1, name
        assert len(all_batches(raw)) == len(first), name
        assert counted.options().autotune.enabled is False, name

        def rows(batches):
            inputs = [
                b[0]["encoder_inputs"] if isinstance(b[0], dict) else b[0]
                for b in batches
            ]
            return sorted(
                tuple(strip_padding(row)) for batch in inputs for row in batch
            )

        assert rows(first) == rows(second) == rows(all_batches(raw)), name


def test_subword_sampling_draws_new_segmentations_every_epoch(
    pairs, english_tokenizer, german_tokenizer
):
    """Every epoch holds every pair once, segmented anew, in the same number
    of batches (the bucket follows the most likely segmentation's length)."""
    dataset = with_cardinality(
        translation_dataset(
            pairs,
            english_tokenizer,
            german_tokenizer,
            batch_size=8,
            seed=3,
            subword_sampling=0.1,
        )
    )
    plain = all_batches(
        translation_dataset(
            pairs, english_tokenizer, german_tokenizer, batch_size=8, seed=3
        )
    )

    def texts_and_pieces(batches):
        texts, pieces = [], []
        for inputs, targets in batches:
            for source, decoder_in, decoder_out in zip(
                inputs["encoder_inputs"], inputs["decoder_inputs"], targets, strict=True
            ):
                source, decoder_in = strip_padding(source), strip_padding(decoder_in)
                decoder_out = strip_padding(decoder_out)
                assert decoder_in[0] == START_ID and decoder_out[-1] == END_ID
                assert decoder_in[1:] == decoder_out[:-1]
                texts.append(
                    (
                        english_tokenizer.detokenize(source).numpy().decode(),
                        german_tokenizer.detokenize(decoder_out).numpy().decode(),
                    )
                )
                pieces.append((tuple(source), tuple(decoder_out)))
        return sorted(texts), sorted(pieces)

    first_texts, first_pieces = texts_and_pieces(all_batches(dataset))
    second_texts, second_pieces = texts_and_pieces(all_batches(dataset))
    plain_texts, plain_pieces = texts_and_pieces(plain)
    assert first_texts == second_texts == plain_texts
    assert first_pieces != second_pieces and first_pieces != plain_pieces

    # Sampled segmentations have more, shorter pieces than the most likely.
    def count(pieces):
        return sum(len(source) + len(target) for source, target in pieces)

    assert count(first_pieces) > count(plain_pieces)
    assert int(dataset.cardinality()) == len(plain)


@pytest.mark.parametrize("alpha", [0, -1.0, True, "0.1"])
def test_subword_sampling_refuses_a_bad_alpha(pairs, english_tokenizer, alpha):
    with pytest.raises(
        ValueError, match=r"`subword_sampling` must be None or a positive"
    ):
        translation_dataset(
            pairs, english_tokenizer, english_tokenizer, subword_sampling=alpha
        )


def test_with_cardinality_keeps_a_known_count_and_refuses_an_endless_dataset():
    known = tf.data.Dataset.range(5).batch(2)
    assert with_cardinality(known) is known
    with pytest.raises(ValueError, match=r"`dataset` is infinite.*steps_per_epoch"):
        with_cardinality(known.repeat())


def test_language_model_document_tokens_mark_each_text(german_tokenizer):

    texts = ["Guten Tag.\nWie geht es?\n", "Danke.\n"]
    plain = language_model_dataset(
        texts, german_tokenizer, sequence_length=64, batch_size=4, shuffle=False
    )
    marked = language_model_dataset(
        texts,
        german_tokenizer,
        sequence_length=64,
        batch_size=4,
        shuffle=False,
        document_tokens=True,
    )
    ((plain_inputs, plain_targets),) = list(plain.as_numpy_iterator())
    ((inputs, targets),) = list(marked.as_numpy_iterator())
    stream = np.concatenate([inputs[0, :1], targets[0][targets[0] != 0]])
    first = german_tokenizer.tokenize(texts[0]).numpy().tolist()
    second = german_tokenizer.tokenize(texts[1]).numpy().tolist()
    assert stream.tolist() == [START_ID, *first, END_ID, START_ID, *second, END_ID]
    plain_stream = np.concatenate(
        [plain_inputs[0, :1], plain_targets[0][plain_targets[0] != 0]]
    )
    assert plain_stream.tolist() == first + second


def test_pipelines_turn_off_the_autotuning_thread(
    pairs, english_tokenizer, lossless_tokenizer, play_text
):
    """Waiting for it delayed epochs of translate.py by up to 33 s."""
    datasets = [
        translation_dataset(pairs, english_tokenizer, english_tokenizer, batch_size=4),
        classification_dataset([("a good film", 1)], english_tokenizer, batch_size=4),
        language_model_dataset(play_text, lossless_tokenizer, sequence_length=8),
    ]
    for dataset in datasets:
        assert dataset.options().autotune.enabled is False
        assert len(all_batches(dataset)) >= 1
