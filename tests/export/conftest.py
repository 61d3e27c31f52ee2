"""Small trained-from-scratch models and tokenizers for the export tests."""

from pathlib import Path

import pytest

from keras_attn.datasets import load_translation_pairs
from keras_attn.text import SubwordTokenizer, train_subword_vocabulary

FIXTURES = Path(__file__).parent.parent / "fixtures"

# Inputs a TF Serving client may send: each must give outputs of the right
# shapes, never an error.
NASTY_TEXTS = [
    "",
    "   \t  ",
    "word " * 2000,  # 10,000 characters
    "Grüße aus Köln!",
    "bad bytes \xff\xfe here",
]


def nasty_batch():
    """The texts above as bytes, with genuinely invalid UTF-8 in the last."""
    batch = [text.encode("utf-8") for text in NASTY_TEXTS[:-1]]
    batch.append(b"bad bytes \xff\xfe here")
    return batch


@pytest.fixture(scope="session")
def english_sentences():
    splits = load_translation_pairs(path=FIXTURES / "de_en_pairs.tsv")
    return [english for english, _ in splits.train + splits.validation + splits.test]


@pytest.fixture(scope="session")
def small_tokenizer(english_sentences, tmp_path_factory):
    path = train_subword_vocabulary(
        english_sentences,
        tmp_path_factory.mktemp("vocab") / "en.model",
        vocabulary_size=300,
        lowercase=True,
    )
    return SubwordTokenizer(path)


# One small export per task, shared by the tests of what surrounds the
# SavedModel (warmup, batching, the REST and gRPC examples).


@pytest.fixture(scope="session")
def small_sentiment_export(small_tokenizer, tmp_path_factory):
    from keras_attn.export import export_sentiment
    from keras_attn.models import sentiment_classifier

    model = sentiment_classifier(
        small_tokenizer.vocabulary_size,
        12,
        embedding_dim=16,
        num_layers=1,
        num_heads=2,
        intermediate_dim=32,
        pooling="attention",
    )
    base = tmp_path_factory.mktemp("sentiment_export")
    return export_sentiment(model, small_tokenizer, base, max_length=12)


@pytest.fixture(scope="session")
def small_translator_export(small_tokenizer, tmp_path_factory):
    from keras_attn.export import export_translator
    from keras_attn.models import transformer_translator

    vocabulary = small_tokenizer.vocabulary_size
    model = transformer_translator(
        vocabulary,
        vocabulary,
        sequence_length=11,
        embedding_dim=16,
        num_encoder_layers=1,
        num_decoder_layers=1,
        num_heads=2,
        intermediate_dim=32,
        shared_vocabulary=True,
    )
    base = tmp_path_factory.mktemp("translator_export")
    return export_translator(
        model, small_tokenizer, small_tokenizer, base, max_length=10, beam_width=2
    )


@pytest.fixture(scope="session")
def small_language_model_export(small_tokenizer, tmp_path_factory):
    from keras_attn.export import export_language_model
    from keras_attn.models import transformer_language_model

    model = transformer_language_model(
        small_tokenizer.vocabulary_size,
        sequence_length=16,
        embedding_dim=16,
        num_layers=1,
        num_heads=2,
        intermediate_dim=32,
    )
    base = tmp_path_factory.mktemp("language_model_export")
    return export_language_model(model, small_tokenizer, base, max_new_tokens=6)
