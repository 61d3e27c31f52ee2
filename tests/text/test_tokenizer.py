"""Subword vocabularies and the `SubwordTokenizer` layer."""

import base64
import subprocess
import sys
import unicodedata

import keras
import numpy as np
import pytest
import sentencepiece as spm
import tensorflow as tf

from keras_attn.text import (
    END_ID,
    PAD_ID,
    START_ID,
    UNK_ID,
    SubwordTokenizer,
    train_subword_vocabulary,
)
from tests.text.conftest import TRICKY_TEXT

GERMAN = [
    "Grüße aus Köln \u2013 die Straße ist schön!",
    "Wie viel kostet das? 12,50 €, bitte.",
    "Er sagte: „Ich komme gleich.“",
    "Übermorgen fährt der Zug um 7:45 Uhr ab.",
    "ÄÖÜ äöü ß: Maß, Fuß, Öl; (Klammern) [eckig] & Co.",
    "Ærø und 😀 kamen im Training nie vor.",
]


def decode(strings):
    return [s.decode("utf-8") for s in np.asarray(strings).reshape(-1)]


def normalised(text):
    return " ".join(unicodedata.normalize("NFKC", text).split())


def test_special_ids_and_vocabulary_files(german_tokenizer, vocab_dir):
    assert (PAD_ID, UNK_ID, START_ID, END_ID) == (0, 1, 2, 3)
    vocabulary = german_tokenizer.get_vocabulary()
    assert vocabulary[:4] == ["<pad>", "<unk>", "<s>", "</s>"]
    assert vocabulary[4:6] == ["<0x00>", "<0x01>"]  # byte fallback pieces
    assert len(vocabulary) == german_tokenizer.vocabulary_size <= 400
    listed = (vocab_dir / "de.vocab").read_text(encoding="utf-8").splitlines()
    assert [line.split("\t")[0] for line in listed] == vocabulary
    assert german_tokenizer.token_to_id("</s>") == END_ID
    assert german_tokenizer.id_to_token(START_ID) == "<s>"
    assert german_tokenizer.token_to_id("no such piece") == UNK_ID


def test_round_trip_german_sentences(german_tokenizer, pairs):
    sentences = [german for _, german in pairs] + GERMAN
    ids = german_tokenizer.tokenize(sentences)
    assert isinstance(ids, tf.RaggedTensor) and ids.dtype == tf.int32
    assert UNK_ID not in ids.flat_values.numpy()  # unseen characters -> bytes
    assert decode(german_tokenizer.detokenize(ids)) == [
        normalised(s) for s in sentences
    ]
    assert normalised("„Ich komme gleich.“") == "„Ich komme gleich.“"


def test_sentence_mode_normalises_spaces(english_tokenizer):
    ids = english_tokenizer.tokenize("  Hello   there,\tfriend!  ")
    assert english_tokenizer.detokenize(ids).numpy().decode() == "Hello there, friend!"


@pytest.mark.parametrize("text", [TRICKY_TEXT, "", "\n", "  ", "a\n\n b \n"])
def test_lossless_round_trip(lossless_tokenizer, text):
    ids = lossless_tokenizer.tokenize(text)
    assert lossless_tokenizer.detokenize(ids).numpy().decode("utf-8") == text


def test_lossless_round_trip_play(lossless_tokenizer, play_text):
    ids = lossless_tokenizer.tokenize(play_text)
    assert lossless_tokenizer.detokenize(ids).numpy().decode("utf-8") == play_text
    assert len(ids) < 0.75 * len(play_text)  # pieces longer than characters


def test_lossless_line_by_line_equals_whole(lossless_tokenizer, play_text):
    text = play_text + TRICKY_TEXT
    lines = [line + "\n" for line in text.split("\n")[:-1]] + [text.split("\n")[-1]]
    by_line = lossless_tokenizer.tokenize(lines).flat_values.numpy()
    whole = lossless_tokenizer.tokenize(text).numpy()
    np.testing.assert_array_equal(by_line, whole)
    newline = lossless_tokenizer.token_to_id("\n")
    assert newline > END_ID and (whole == newline).sum() == text.count("\n")


def test_sequence_length_truncates_and_pads(german_model):
    tokenizer = SubwordTokenizer(german_model, sequence_length=5)
    ids = tokenizer.tokenize(["Ja.", " ".join(["Das ist ein sehr langer Satz."] * 50)])
    assert ids.shape == (2, 5) and ids.dtype == tf.int32
    short = ids.numpy()[0]
    assert (short[short == PAD_ID].size > 0) and short[0] != PAD_ID
    assert PAD_ID not in ids.numpy()[1]
    assert tokenizer.tokenize("Ja.").shape == (5,)


def test_scalar_and_list_inputs(german_tokenizer):
    one = german_tokenizer.tokenize("Guten Morgen!")
    assert one.shape.rank == 1
    assert german_tokenizer.detokenize(one).numpy().decode() == "Guten Morgen!"
    assert german_tokenizer.detokenize(one.numpy().tolist()).numpy() == b"Guten Morgen!"


def test_detokenize_drops_specials_and_stops_at_end(german_tokenizer):
    ids = german_tokenizer.tokenize(["Guten Morgen!", "Gute Nacht."]).numpy()
    first, second = list(ids[0]), list(ids[1])
    batch = [
        [START_ID, *first, END_ID, *second, PAD_ID],  # the end stops decoding
        [START_ID, *second, PAD_ID, PAD_ID] + [PAD_ID] * len(first),
    ]
    assert decode(german_tokenizer.detokenize(tf.constant(batch))) == [
        "Guten Morgen!",
        "Gute Nacht.",
    ]
    ragged = tf.ragged.constant([[START_ID, *second, END_ID], []], dtype=tf.int64)
    assert decode(german_tokenizer.detokenize(ragged)) == ["Gute Nacht.", ""]


def test_inside_tf_function_and_tf_data(german_tokenizer):
    @tf.function(input_signature=[tf.TensorSpec([None], tf.string)])
    def round_trip(texts):
        return german_tokenizer.detokenize(german_tokenizer.tokenize(texts))

    assert decode(round_trip(tf.constant(GERMAN[:2]))) == GERMAN[:2]
    dataset = tf.data.Dataset.from_tensor_slices(GERMAN[:3]).batch(2)
    dataset = dataset.map(german_tokenizer.tokenize).map(german_tokenizer.detokenize)
    assert [s for batch in dataset for s in decode(batch)] == GERMAN[:3]


def test_sample_draws_other_segmentations_of_the_same_text(german_tokenizer, pairs):
    """Subword regularization: each call draws anew; the text never changes."""
    sentences = [german for _, german in pairs][:50]
    best = german_tokenizer.tokenize(sentences).to_list()
    draws = [german_tokenizer.sample(sentences, alpha=0.1) for _ in range(3)]
    for ids in draws:
        assert decode(german_tokenizer.detokenize(ids)) == decode(
            german_tokenizer.detokenize(german_tokenizer.tokenize(sentences))
        )
        assert ids.to_list() != best  # alpha 0.1: far from the most likely
    assert draws[0].to_list() != draws[1].to_list()

    # A high alpha concentrates on the most likely segmentation: fewer pieces.
    def pieces(alpha):
        return int(german_tokenizer.sample(sentences, alpha).flat_values.shape[0])

    assert sum(map(len, best)) <= pieces(100.0) < pieces(0.1)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string)])
    def sampled_round_trip(texts):
        return german_tokenizer.detokenize(german_tokenizer.sample(texts, 0.5))

    assert decode(sampled_round_trip(tf.constant(GERMAN[:2]))) == GERMAN[:2]


@pytest.mark.parametrize("alpha", [0, -0.5, True, "0.5", None])
def test_sample_refuses_a_bad_alpha(german_tokenizer, alpha):
    with pytest.raises(
        ValueError, match=r"`alpha` must be a positive float\. Received: alpha="
    ):
        german_tokenizer.sample(["Guten Tag."], alpha)


def test_config_and_keras_serialization(german_model, tmp_path):
    tokenizer = SubwordTokenizer(german_model, sequence_length=7, name="de")
    config = tokenizer.get_config()
    # The model is an asset (`save_assets`), not a config entry.
    assert config["sequence_length"] == 7 and config["proto"] is None
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(tokenizer)
    )
    assert isinstance(restored, SubwordTokenizer) and restored.name == "de"
    assert not restored.has_vocabulary and restored.proto is None
    for use in (
        lambda: restored.tokenize(GERMAN),
        lambda: restored.vocabulary_size,
        lambda: restored.detokenize([[5, 6]]),
        lambda: restored.save_proto(tmp_path / "none.model"),
    ):
        with pytest.raises(ValueError, match=r"'de' has no vocabulary.*set_proto"):
            use()
    tokenizer.save_assets(tmp_path)
    assert (tmp_path / "vocabulary.spm").read_bytes() == tokenizer.proto
    restored.load_assets(tmp_path)
    np.testing.assert_array_equal(
        restored.tokenize(GERMAN).numpy(), tokenizer.tokenize(GERMAN).numpy()
    )
    # A config holding the model inline (saved before it was an asset) loads.
    inline = {**config, "proto": base64.b64encode(tokenizer.proto).decode("ascii")}
    old = SubwordTokenizer.from_config(inline)
    np.testing.assert_array_equal(
        old.tokenize(GERMAN).numpy(), tokenizer.tokenize(GERMAN).numpy()
    )
    old.load_assets(tmp_path / "no_such_directory")  # keeps its model
    old.load_assets(None)  # Keras' path with no assets
    assert old.proto == tokenizer.proto
    saved = tokenizer.save_proto(tmp_path / "copy" / "de.model")
    assert saved.read_bytes() == german_model.read_bytes()
    assert (
        SubwordTokenizer.from_file(saved).vocabulary_size == tokenizer.vocabulary_size
    )


@pytest.mark.tf_only  # string layer calls need TensorFlow
def test_layer_call_in_functional_model(german_model):
    tokenizer = SubwordTokenizer(german_model, sequence_length=6)
    texts = keras.Input(shape=(), dtype="string")
    model = keras.Model(texts, tokenizer(texts))
    assert model.output.shape == (None, 6)
    ids = model(tf.constant(GERMAN[:2]))
    np.testing.assert_array_equal(ids, tokenizer.tokenize(GERMAN[:2]))


def test_bad_models_are_refused(tmp_path):
    with pytest.raises(ValueError, match="not a SentencePiece model"):
        SubwordTokenizer(b"definitely not a model")
    with pytest.raises(ValueError, match="must be the bytes"):
        SubwordTokenizer(12)
    # A model trained with SentencePiece's default ids (unk=0, <s>=1, </s>=2).
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("ein kleiner Satz\nnoch ein Satz\n" * 20)
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(tmp_path / "other"),
        vocab_size=30,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    with pytest.raises(ValueError, match="ids 0-3 are"):
        SubwordTokenizer(tmp_path / "other.model")
    with pytest.raises(ValueError, match="sequence_length"):
        SubwordTokenizer(tmp_path / "other.model", sequence_length=0)


def test_training_arguments(tmp_path):
    with pytest.raises(ValueError, match="No training text"):
        train_subword_vocabulary(["", "  \n"], tmp_path / "x.model")
    with pytest.raises(ValueError, match="lossless"):
        train_subword_vocabulary(
            ["a"], tmp_path / "x.model", lossless=True, lowercase=True
        )
    with pytest.raises(ValueError, match="at least 264"):
        train_subword_vocabulary(["a"], tmp_path / "x.model", vocabulary_size=100)
    with pytest.raises(ValueError, match="model_type"):
        train_subword_vocabulary(["a"], tmp_path / "x.model", model_type="word")
    with pytest.raises(TypeError, match="must hold strings"):
        train_subword_vocabulary([b"bytes"], tmp_path / "x.model")


def test_training_is_deterministic_and_lowercases(pairs, tmp_path):
    english = [english for english, _ in pairs]
    first = train_subword_vocabulary(english, tmp_path / "a.model", vocabulary_size=400)
    second = train_subword_vocabulary(english, tmp_path / "b.spm", vocabulary_size=400)
    assert second.name == "b.spm"
    # Same pieces with the same scores (the model files differ in the prefix
    # they record).
    assert (tmp_path / "a.vocab").read_text() == (tmp_path / "b.vocab").read_text()
    np.testing.assert_array_equal(
        SubwordTokenizer(first).tokenize(english).flat_values,
        SubwordTokenizer(second).tokenize(english).flat_values,
    )
    lower = SubwordTokenizer(
        train_subword_vocabulary(
            english, tmp_path / "l.model", vocabulary_size=400, lowercase=True
        )
    )
    assert lower.detokenize(lower.tokenize("Where IS it?")).numpy() == b"where is it?"


SERVING_CHECK = """
import sys
import tensorflow as tf
import tensorflow_text  # registers the SentencePiece ops, as TF Serving links them

loaded = tf.saved_model.load(sys.argv[1])
ids = loaded.tokenize(tf.constant(["Grüße aus Köln!", "Die Straße ist schön."]))
print(ids.shape[0], ids.dtype.name)
for text in loaded.detokenize(ids).numpy():
    print(text.decode("utf-8"))
print(sorted(m for m in ("keras_attn", "keras_hub", "sentencepiece")
             if m in sys.modules))
"""


def test_saved_model_needs_only_tensorflow_and_tensorflow_text(
    german_tokenizer, tmp_path
):
    class Serving(tf.Module):
        def __init__(self, tokenizer):
            super().__init__()
            self.tokenizer = tokenizer

        @tf.function(input_signature=[tf.TensorSpec([None], tf.string)])
        def tokenize(self, texts):
            return self.tokenizer.tokenize(texts).to_tensor()

        @tf.function(input_signature=[tf.TensorSpec([None, None], tf.int32)])
        def detokenize(self, ids):
            return self.tokenizer.detokenize(ids)

    export_dir = str(tmp_path / "tokenizer")
    tf.saved_model.save(Serving(german_tokenizer), export_dir)
    graph_ops = set()
    loaded = tf.saved_model.load(export_dir)
    for function in (loaded.tokenize, loaded.detokenize):
        graph = function.get_concrete_function().graph.as_graph_def()
        graph_ops |= {node.op for node in graph.node}
        for library_function in graph.library.function:
            graph_ops |= {node.op for node in library_function.node_def}
    assert {"SentencepieceTokenizeOp", "SentencepieceDetokenizeOp"} <= graph_ops
    result = subprocess.run(
        [sys.executable, "-c", SERVING_CHECK, export_dir],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,  # not the repository: keras_attn is not importable by path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        "2 int32",
        "Grüße aus Köln!",
        "Die Straße ist schön.",
        "[]",
    ]


def test_survives_seed_reset_and_clear_session(german_model):
    """tf.random.set_seed and clear_session empty the eager kernel cache, which
    holds TensorFlow Text's SentencePiece resource (tensorflow/text#570)."""
    tokenizer = SubwordTokenizer(german_model)
    dataset = tf.data.Dataset.from_tensor_slices(GERMAN[:4]).batch(2)
    dataset = dataset.map(tokenizer.tokenize).map(tokenizer.detokenize)

    @tf.function
    def round_trip(texts):
        return tokenizer.detokenize(tokenizer.tokenize(texts))

    expected = [s for batch in dataset for s in decode(batch)]
    for reset in (
        lambda: tf.random.set_seed(1),
        lambda: keras.utils.set_random_seed(2),
        keras.backend.clear_session,
    ):
        reset()
        assert [s for batch in dataset for s in decode(batch)] == expected
        assert decode(round_trip(tf.constant(GERMAN[:2]))) == GERMAN[:2]
        ids = tokenizer.tokenize(GERMAN[:2])  # eager
        assert decode(tokenizer.detokenize(ids)) == GERMAN[:2]
        assert tokenizer.get_vocabulary()[:2] == ["<pad>", "<unk>"]


def test_a_copy_shares_the_vocabulary_and_saves_none(german_model, tmp_path):
    tokenizer = SubwordTokenizer(german_model, name="de")
    copy = tokenizer.copy(sequence_length=5)
    assert copy.sequence_length == 5 and tokenizer.sequence_length is None
    assert copy.name == "de" and copy.proto is tokenizer.proto
    np.testing.assert_array_equal(
        copy.tokenize(GERMAN).numpy(),
        tokenizer.tokenize(GERMAN)[:, :5].to_tensor(shape=[None, 5]).numpy(),
    )
    copy.save_assets(tmp_path)
    assert list(tmp_path.iterdir()) == []  # the original saves the vocabulary
    # A copy of a tokenizer without a vocabulary gets the one it loads.
    bare = SubwordTokenizer.from_config(tokenizer.get_config())
    dense = bare.copy(sequence_length=5)
    tokenizer.save_assets(tmp_path)
    bare.load_assets(tmp_path)
    np.testing.assert_array_equal(dense.tokenize(GERMAN), copy.tokenize(GERMAN))
    with pytest.raises(ValueError, match="sequence_length"):
        tokenizer.copy(sequence_length=0)


def test_a_saved_model_holds_the_vocabulary_as_an_asset(german_model, tmp_path):
    import json
    import zipfile

    tokenizer = SubwordTokenizer(german_model, sequence_length=6)
    texts = keras.Input(shape=(), dtype="string")
    model = keras.Model(texts, tokenizer(texts))
    model.save(tmp_path / "model.keras")
    with zipfile.ZipFile(tmp_path / "model.keras") as archive:
        config = archive.read("config.json").decode()
        assets = [n for n in archive.namelist() if n.startswith("assets/")]
        [asset] = assets
        assert archive.read(asset) == tokenizer.proto
    assert '"proto": null' in json.dumps(json.loads(config))
    assert len(config) < 5_000
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    np.testing.assert_array_equal(
        loaded(tf.constant(GERMAN[:2])), tokenizer.tokenize(GERMAN[:2])
    )
