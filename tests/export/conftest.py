"""Inputs for the export tests (the small tokenizer is in tests/conftest.py)."""

from pathlib import Path

import pytest

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


# Requests a client may send by mistake or malice, as string batches: each
# must be answered with outputs of the right shape in bounded time (or a
# clean error), and leave the next good request's answer unchanged.
BAD_BATCHES = {
    "empty batch": [],
    "empty strings": [b"", b"   \t  "],
    "10,000 characters": [("word " * 2000).encode()],
    "invalid UTF-8": [b"bad bytes \xff\xfe here", b"\xc3\x28", b"\xff"],
    "batch of 256": [b"a good film, where is the station"] * 256,
}
BAD_INPUT_SECONDS = 60  # per request, tiny models on a shared 2-core machine


def assert_bad_requests_leave_no_trace(server, signature, input_name, good):
    """Send `good`, then each of `BAD_BATCHES` followed by `good` again,
    through `server` (a `StandInServer`: the serve-tag loader fed as TF
    Serving feeds it). Bad requests get outputs with one row per input, the
    good request's shapes past the batch axis and finite floats, each within
    `BAD_INPUT_SECONDS`; every good answer equals the first."""
    import time

    import numpy as np

    from keras_attn.export._predict import response_arrays
    from serving_standin import predict_request

    def ask(batch):
        request = predict_request(server.model_name, signature, {input_name: batch})
        started = time.perf_counter()
        outputs = response_arrays(server.predict(request))
        return outputs, time.perf_counter() - started

    before, _ = ask(good)
    for name, batch in BAD_BATCHES.items():
        outputs, seconds = ask(batch)
        assert seconds < BAD_INPUT_SECONDS, (name, seconds)
        assert sorted(outputs) == sorted(before), name
        for output, value in outputs.items():
            assert value.shape == (len(batch), *before[output].shape[1:]), (
                name,
                output,
            )
            if value.dtype.kind == "f":
                assert np.isfinite(value).all(), (name, output)
        after, _ = ask(good)
        for output, value in after.items():
            np.testing.assert_array_equal(value, before[output], err_msg=name)


def nasty_batch():
    """The texts above as bytes, with genuinely invalid UTF-8 in the last."""
    batch = [text.encode("utf-8") for text in NASTY_TEXTS[:-1]]
    batch.append(b"bad bytes \xff\xfe here")
    return batch


# One small export per task, shared by the tests of what surrounds the
# SavedModel (warmup, batching, the REST and gRPC examples).


@pytest.fixture(scope="session")
def small_sentiment_export(small_tokenizer, tmp_path_factory):
    from keras_attn.models import TextClassifier

    model = TextClassifier(
        small_tokenizer.vocabulary_size,
        12,
        embedding_dim=16,
        num_layers=1,
        num_heads=2,
        intermediate_dim=32,
        pooling="attention",
        tokenizer=small_tokenizer,
    )
    base = tmp_path_factory.mktemp("sentiment_export")
    return model.export(base, max_length=12)


@pytest.fixture(scope="session")
def small_translator_export(small_tokenizer, tmp_path_factory):
    from keras_attn.models import TransformerTranslator

    vocabulary = small_tokenizer.vocabulary_size
    model = TransformerTranslator(
        vocabulary,
        vocabulary,
        sequence_length=11,
        embedding_dim=16,
        num_encoder_layers=1,
        num_decoder_layers=1,
        num_heads=2,
        intermediate_dim=32,
        shared_vocabulary=True,
        source_tokenizer=small_tokenizer,
        target_tokenizer=small_tokenizer,
    )
    base = tmp_path_factory.mktemp("translator_export")
    return model.export(base, max_length=10, beam_width=2, length_penalty=0.6)


@pytest.fixture(scope="session")
def small_language_model_export(small_tokenizer, tmp_path_factory):
    from keras_attn.memory import ContinuousCache
    from keras_attn.models import TransformerLanguageModel

    model = TransformerLanguageModel(
        small_tokenizer.vocabulary_size,
        sequence_length=16,
        embedding_dim=16,
        num_layers=1,
        num_heads=2,
        intermediate_dim=32,
        tokenizer=small_tokenizer,
    )
    base = tmp_path_factory.mktemp("language_model_export")
    # With a continuous cache, as examples/language_model.py exports by default.
    return model.export(
        base, max_new_tokens=6, continuous_cache=ContinuousCache(theta=0.5, lam=0.3)
    )
