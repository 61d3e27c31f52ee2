"""`WordPieceTokenizer`: BERT's tokenization on TensorFlow Text ops."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_attn.text import WordPieceTokenizer, classification_dataset
from tests.test_case import BERT_VOCABULARY

pytestmark = pytest.mark.tf_only

ID = {piece: index for index, piece in enumerate(BERT_VOCABULARY)}
CLS, SEP, UNK = ID["[CLS]"], ID["[SEP]"], ID["[UNK]"]


def ids_of(*pieces):
    return [CLS, *(ID[piece] for piece in pieces), SEP]


@pytest.fixture
def tokenizer():
    return WordPieceTokenizer(BERT_VOCABULARY)


def test_bert_tokenization(tokenizer):
    ids = tokenizer.tokenize(
        ["The film is GREAT!", "Unaffable, Café.", "", "zebra films"]
    ).to_list()
    assert ids[0] == ids_of("the", "film", "is", "great", "!")
    # Lower-cased, accents stripped; greedy longest-match word pieces.
    assert ids[1] == ids_of("un", "##aff", "##able", ",", "cafe", ".")
    assert ids[2] == [CLS, SEP]  # an empty text is valid
    # A word without a segmentation is one [UNK]; "films" = film ##s.
    assert ids[3] == [CLS, UNK, ID["film"], ID["##s"], SEP]
    assert tokenizer.tokenize("a film").numpy().tolist() == ids_of("a", "film")


def test_cased_tokenizer_keeps_case():
    vocabulary = [*BERT_VOCABULARY, "Great"]
    cased = WordPieceTokenizer(vocabulary, lowercase=False)
    assert cased.tokenize(["Great great"]).to_list() == [
        [CLS, len(vocabulary) - 1, ID["great"], SEP]
    ]


def test_max_length_keeps_sep_last_and_sequence_length_pads():
    text = ["the film is a great but dull movie"]
    truncated = WordPieceTokenizer(BERT_VOCABULARY, max_length=5).tokenize(text)
    assert truncated.to_list() == [ids_of("the", "film", "is")]
    dense = WordPieceTokenizer(BERT_VOCABULARY, sequence_length=6).tokenize(
        [*text, "fun"]
    )
    assert dense.shape == (2, 6) and dense.dtype == tf.int32
    assert dense.numpy().tolist() == [
        ids_of("the", "film", "is", "a"),
        [*ids_of("fun"), 0, 0, 0],
    ]


def test_runs_in_graphs_and_datasets_after_seeding(tokenizer):
    texts = ["the plot is not fun", "good acting"]
    eager = tokenizer.tokenize(texts).to_list()
    keras.utils.set_random_seed(3)  # clears TensorFlow's eager kernel caches
    traced = tf.function(lambda t: tokenizer.tokenize(t).to_tensor())
    assert traced(tf.constant(texts)).numpy().tolist() == [
        eager[0],
        eager[1] + [0] * (len(eager[0]) - len(eager[1])),
    ]
    dataset = classification_dataset(
        [(text, 1) for text in texts], tokenizer, batch_size=2, shuffle=False
    )
    (batch, labels), *_ = list(dataset)
    assert sorted(row[row != 0].tolist() for row in batch.numpy()) == sorted(eager)
    assert labels.numpy().tolist() == [1, 1]


def test_detokenize_and_lookups(tokenizer):
    ids = tokenizer.tokenize(["Unaffable films, not fun!"])
    assert tokenizer.detokenize(ids).numpy().tolist() == [
        b"unaffable films , not fun !"
    ]
    assert tokenizer.detokenize(ids.to_tensor(shape=[1, 20])[0]).numpy() == (
        b"unaffable films , not fun !"
    )
    assert tokenizer.vocabulary_size == len(BERT_VOCABULARY)
    assert tokenizer.id_to_token(ID["##aff"]) == "##aff"
    assert tokenizer.token_to_id("film") == ID["film"]
    assert tokenizer.token_to_id("zebra") == UNK
    with pytest.raises(ValueError, match="`id` must be in"):
        tokenizer.id_to_token(len(BERT_VOCABULARY))


def test_config_round_trip_and_vocabulary_file(tmp_path):
    tokenizer = WordPieceTokenizer(BERT_VOCABULARY, max_length=8, sequence_length=8)
    path = tokenizer.save_vocabulary(tmp_path / "vocab.txt")
    from_file = WordPieceTokenizer(path, max_length=8, sequence_length=8)
    config = tokenizer.get_config()
    assert config["vocabulary"] is None  # an asset (`save_assets`)
    restored = WordPieceTokenizer.from_config(config)
    assert not restored.has_vocabulary and restored.vocabulary is None
    texts = ["unaffable plot", "a very very very very very good script"]
    with pytest.raises(ValueError, match=r"has no vocabulary.*set_vocabulary"):
        restored.tokenize(texts)
    with pytest.raises(ValueError, match="has no vocabulary"):
        restored.token_to_id("film")
    tokenizer.save_assets(tmp_path)
    restored.load_assets(tmp_path)
    assert restored.get_vocabulary() == BERT_VOCABULARY
    expected = tokenizer.tokenize(texts).numpy()
    np.testing.assert_array_equal(restored.tokenize(texts).numpy(), expected)
    np.testing.assert_array_equal(from_file.tokenize(texts).numpy(), expected)
    # A config holding the vocabulary inline (saved before it was an asset).
    old = WordPieceTokenizer.from_config({**config, "vocabulary": BERT_VOCABULARY})
    np.testing.assert_array_equal(old.tokenize(texts).numpy(), expected)
    # A copy: other settings, the same vocabulary, no asset of its own.
    copy = tokenizer.copy(sequence_length=None, lowercase=False)
    assert copy.vocabulary is tokenizer.vocabulary and not copy.lowercase
    assert copy.tokenize(["Film"]).to_list() == [[CLS, UNK, SEP]]
    copy.save_assets(tmp_path / "copy")
    assert not (tmp_path / "copy").exists()


def test_the_vocabulary_asset_keeps_every_piece(tmp_path):
    """Pieces that a text reader would split or rewrite (a carriage
    return, a line separator) come back as they were."""
    pieces = [*BERT_VOCABULARY, "a\rb", "\u2028", "\x1c", " "]
    tokenizer = WordPieceTokenizer(pieces)
    tokenizer.save_assets(tmp_path)
    restored = WordPieceTokenizer()
    restored.load_assets(tmp_path)
    assert restored.vocabulary == pieces


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"vocabulary": []}, "non-empty list of strings"),
        ({"vocabulary": ["[PAD]", "[UNK]", "a"]}, r"special tokens \['\[CLS\]'"),
        (
            {"vocabulary": ["[UNK]", "[PAD]", "[CLS]", "[SEP]"]},
            r"\[PAD\] at id 0. Received: '\[UNK\]'",
        ),
        ({"max_length": 2}, "`max_length` must be an int of at least 3"),
        ({"sequence_length": "8"}, "Received: sequence_length='8'"),
        ({"lowercase": "yes"}, "`lowercase` must be a bool"),
        ({"vocabulary": "/no/such/vocab.txt"}, "readable UTF-8 vocab.txt"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WordPieceTokenizer(**{"vocabulary": BERT_VOCABULARY, **kwargs})
