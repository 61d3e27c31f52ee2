"""Text streamed as it is decoded: `TransformerLanguageModel.stream` and
`Translator.stream_translate` yield pieces of whole characters that join to
`generate`'s / greedy `translate`'s text, from a decoding compiled once per
shape and reused, rebuilt after `quantize`, and from a model loaded in a
fresh process. On TensorFlow and JAX (the tokenizers run TensorFlow Text on
either backend)."""

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

from keras_attn import generation
from keras_attn.models import (
    RNNTranslator,
    TransformerLanguageModel,
    TransformerTranslator,
    _task,
)
from keras_attn.models.streaming import TextPieces
from tests.test_case import REPO_ROOT

CONTEXT = 48
PROMPTS = ["Where is the station?", "", "I am very tired today. " * 6]


def random_weights(model, seed):
    """Weights drawn normal (standard deviation 0.5): the decodings vary
    from token to token (and int4 changes them)."""
    rng = np.random.default_rng(seed)
    model.set_weights(
        [rng.normal(0, 0.5, w.shape).astype(w.dtype) for w in model.get_weights()]
    )
    return model


def language_model(tokenizer, seed=0, **kwargs):
    model = TransformerLanguageModel(
        tokenizer.vocabulary_size, CONTEXT, embedding_dim=16, num_layers=1,
        num_heads=2, intermediate_dim=32, tokenizer=tokenizer, **kwargs,
    )  # fmt: skip
    return random_weights(model, seed)


def translator(tokenizer, seed=1, kind="transformer"):
    if kind == "rnn":
        model = RNNTranslator(
            tokenizer.vocabulary_size, tokenizer.vocabulary_size, embedding_dim=8,
            units=12, source_tokenizer=tokenizer, target_tokenizer=tokenizer,
        )  # fmt: skip
        return random_weights(model, seed)
    model = TransformerTranslator(
        tokenizer.vocabulary_size, tokenizer.vocabulary_size, sequence_length=24,
        embedding_dim=16, num_encoder_layers=1, num_decoder_layers=1,
        num_heads=2, intermediate_dim=32, shared_vocabulary=True,
        source_tokenizer=tokenizer, target_tokenizer=tokenizer,
    )  # fmt: skip
    return random_weights(model, seed)


@pytest.fixture(scope="module")
def lm(small_tokenizer):
    return language_model(small_tokenizer)


# TensorFlow and JAX compile the decoding (`tf.function`, `jax.jit`) and
# reuse it; PyTorch runs it eagerly, one Python call per step.
COMPILES = keras.backend.backend() != "torch"


class CountingCalls:
    """`call_with_cache` wrapped: counts its Python calls, which a compiled
    decoding makes only while it is traced (an eager one at every step)."""

    def __init__(self, monkeypatch, cls):
        self.count = 0
        original = cls.call_with_cache

        def counted(model, *args, **kwargs):
            self.count += 1
            return original(model, *args, **kwargs)

        monkeypatch.setattr(cls, "call_with_cache", counted)


def joined(pieces) -> str:
    pieces = list(pieces)
    for piece in pieces:
        assert isinstance(piece, str) and piece
        piece.encode("utf-8")  # no lone surrogates: whole characters
    return "".join(pieces)


# -- the language model --------------------------------------------------------


@pytest.mark.parametrize("max_new_tokens", [None, 1, 20])
def test_greedy_pieces_join_to_generate(lm, max_new_tokens):
    for prompt in PROMPTS:
        pieces = list(lm.stream(prompt, max_new_tokens=max_new_tokens, chunk_size=3))
        want = lm.generate(prompt, max_new_tokens=max_new_tokens)[0]
        assert joined(pieces) == want
        if max_new_tokens != 1 and len(want) > 10:
            # Decoded and yielded piece by piece, not all at the end.
            assert len(pieces) > 1


@pytest.mark.parametrize(
    "sampler",
    [
        generation.TopKSampler(k=30, temperature=1.5),
        generation.TopPSampler(p=0.9, seed=11),
        generation.RandomSampler(temperature=2.0),
    ],
    ids=["top_k", "top_p_own_seed", "random"],
)
def test_sampled_pieces_join_to_generate_with_the_same_seed(lm, sampler):
    seed = None if sampler.seed is not None else 1234
    for prompt in PROMPTS[:2]:
        got = joined(lm.stream(prompt, sampler=sampler, seed=seed, chunk_size=5))
        assert got == lm.generate(prompt, sampler=sampler, seed=seed)[0]
    other = joined(lm.stream(PROMPTS[0], sampler=sampler, seed=99, chunk_size=5))
    assert other == lm.generate(PROMPTS[0], sampler=sampler, seed=99)[0]
    assert other != got or sampler.seed is not None  # the seed is read


def byte_ids(tokenizer, text):
    """The byte pieces of `text`'s UTF-8 (`<0xC3>`, ...)."""
    return [tokenizer.token_to_id(f"<0x{byte:02X}>") for byte in text.encode()]


@pytest.mark.parametrize("known_bytes", [True, False], ids=["bytes", "no_bytes"])
def test_text_pieces_hold_back_a_character_until_its_bytes_have_come(
    small_tokenizer, known_bytes
):
    from keras_attn.models.streaming import byte_pieces, compiled_detokenizer
    from keras_attn.text.preprocessors import detokenized_texts

    def detokenize(ids):  # what `generate` and `translate` answer
        return detokenized_texts(small_tokenizer, np.asarray([ids], "int32"))[0]

    def stream(ids):
        pieces = TextPieces(compiled_detokenizer(small_tokenizer), table)
        # Token by token, and the same in one chunk.
        got = [pieces.add(i) for i in ids] + [pieces.close()]
        chunked = TextPieces(compiled_detokenizer(small_tokenizer), table)
        assert [*chunked.extend(ids), chunked.close()] == got
        return got

    table = byte_pieces(small_tokenizer) if known_bytes else None
    text = "the café costs 5€ 日本 😀 end"
    ids = small_tokenizer.tokenize([text]).to_list()[0]
    # Characters outside the vocabulary come as byte pieces, several each.
    assert sum(small_tokenizer.id_to_token(i).startswith("<0x") for i in ids) > 8
    got = stream(ids)
    assert "".join(got) == detokenize(ids) == text
    assert "" in got[:-1]  # held back while a character was incomplete
    assert not any("\ufffd" in piece for piece in got)
    # An invalid sequence is U+FFFD once a later token shows it, as the whole
    # text has it; a trailing incomplete one at the end.
    ab = small_tokenizer.tokenize(["ab"]).to_list()[0]
    for ids in (
        [*byte_ids(small_tokenizer, "é")[:1], *ab],
        [*ab, *byte_ids(small_tokenizer, "€")[:2]],
        [*byte_ids(small_tokenizer, "€")[:2], *byte_ids(small_tokenizer, "é")],
    ):
        got = stream(ids)
        assert "".join(got) == detokenize(ids)
        assert "\ufffd" in detokenize(ids)
    # Bytes that cannot begin a character: each one U+FFFD at once, with the
    # vocabulary's byte pieces known (else when a character follows them).
    continuation = byte_ids(small_tokenizer, "é")[1:] * 3
    got = stream([*continuation, *ab])
    assert "".join(got) == detokenize([*continuation, *ab])
    assert got[:3] == (["\ufffd"] * 3 if known_bytes else ["", "", ""])


def test_ids_the_detokenizer_drops_do_not_split_a_character(small_tokenizer):
    """SentencePiece leaves `<s>` out of the text, so the byte pieces on
    either side of it join into one character: the piece before it is held
    back, not given as U+FFFD (a model with random weights can draw `<s>`).
    Then random id sequences, every id drawn (byte pieces more often),
    streamed in random chunks, join to the whole text."""
    from keras_attn.models.streaming import (
        byte_pieces,
        compiled_detokenizer,
        dropped_ids,
    )
    from keras_attn.text.preprocessors import detokenized_texts

    detokenize = compiled_detokenizer(small_tokenizer)
    table = byte_pieces(small_tokenizer)
    size = small_tokenizer.vocabulary_size
    dropped = dropped_ids(detokenize, table, size)
    assert dropped == {_task.PAD_ID, _task.START_ID}  # the text ends at END_ID
    assert dropped_ids(detokenize, None, size) == frozenset()

    def streamed(ids, chunks):
        pieces = TextPieces(detokenize, table, dropped)
        got, at = [], 0
        for n in chunks:
            got += pieces.extend(ids[at : at + n])
            at += n
        return [*got, pieces.close()]

    e_acute = byte_ids(small_tokenizer, "é")  # <0xC3>, <0xA9>
    ids = [*small_tokenizer.tokenize(["ab"]).to_list()[0], e_acute[0]]
    ids += [_task.START_ID, e_acute[1]]
    got = streamed(ids, [1] * len(ids))
    assert "".join(got) == "abé" == detokenized_texts(small_tokenizer, [ids])[0]
    assert "\ufffd" not in "".join(got)

    rng = np.random.default_rng(0)
    byte_ids_all = np.array(sorted(table))
    for _ in range(200):
        length = int(rng.integers(1, 24))
        ids = np.where(
            rng.random(length) < 0.6,
            rng.choice(byte_ids_all, length),
            rng.integers(0, size, length),
        ).tolist()
        chunks = rng.integers(1, 5, length).tolist()
        assert "".join(streamed(ids, chunks)) == detokenize([ids])[0], ids


def test_multi_byte_text_streams_as_whole_characters(small_tokenizer):
    """A model whose output projection favours the byte pieces of `é`, `ä`,
    `ö`, `ü` (lead byte 0xC3) draws valid two-byte characters and invalid
    sequences among them: the pieces are whole characters and join to
    `generate`'s text, U+FFFD where it has one and nowhere else."""
    model = language_model(small_tokenizer, seed=2, tie_embeddings=False)
    favoured = sorted(set(byte_ids(small_tokenizer, "éäöü")))
    bias = np.zeros(small_tokenizer.vocabulary_size, "float32")
    bias[favoured] = 12.0
    kernel, _ = model.logits_layer.get_weights()
    model.logits_layer.set_weights([kernel * 0.1, bias])
    sampler = generation.RandomSampler()
    for seed in (1, 2, 3):
        pieces = list(model.stream("KING:", sampler=sampler, seed=seed, chunk_size=4))
        want = model.generate("KING:", sampler=sampler, seed=seed)[0]
        assert joined(pieces) == want
        assert set("éäöü") & set(want)  # two-byte characters were drawn
        held = [piece for piece in pieces if "\ufffd" in piece]
        assert sum(p.count("\ufffd") for p in held) == want.count("\ufffd")
        assert len(pieces) > 1


def test_the_decoding_is_traced_once_and_reused(small_tokenizer, monkeypatch):
    counting = CountingCalls(monkeypatch, TransformerLanguageModel)
    model = language_model(small_tokenizer, seed=3)
    prompts = ["Where is the station?", "The cat sat.", "Where is the bus stop?"]
    first = [list(model.stream(p, max_new_tokens=30, chunk_size=2)) for p in prompts]
    traced = counting.count
    # Per prompt width (`generate`'s buckets): the prefill and the loop's
    # step in `start`, the step in `advance`.
    widths = {
        _task.bucket_length(len(ids) + 1)
        for ids in small_tokenizer.tokenize(prompts).to_list()
    }
    if COMPILES:
        assert 0 < traced <= 3 * len(widths)
    else:  # eager: a call per prompt pass and per generated token
        assert traced >= sum(len(pieces) for pieces in first)
    for chunk_size in (1, 3, 7):
        again = [
            list(model.stream(p, max_new_tokens=30, chunk_size=chunk_size))
            for p in prompts
        ]
        assert again == first
    if COMPILES:
        assert counting.count == traced  # 9 more calls, over 100 chunks: no trace
        # More pieces than traces: the steps ran from compiled code.
        assert sum(len(pieces) for pieces in first) > traced
    else:
        assert counting.count == 4 * traced  # the same calls, three times more


# Slow: quantizing after the first call: test_quantize.py; streaming:
# test_greedy_pieces_join_to_generate
@pytest.mark.slow
def test_a_quantized_model_streams_with_its_quantized_weights(small_tokenizer):
    model = language_model(small_tokenizer, seed=4)
    twin = language_model(small_tokenizer, seed=4)
    twin.quantize("int4")
    float_text = joined(model.stream(PROMPTS[0], max_new_tokens=20))
    model.quantize("int4")
    text = joined(model.stream(PROMPTS[0], max_new_tokens=20))
    assert text == twin.generate(PROMPTS[0], max_new_tokens=20)[0]
    assert text == model.generate(PROMPTS[0], max_new_tokens=20)[0]
    assert text != float_text


def test_stream_refuses_bad_arguments(lm):
    with pytest.raises(ValueError, match=r"`prompt` must be one string.*list of 2"):
        lm.stream(["a", "b"])
    with pytest.raises(ValueError, match=r"beam search.*cannot stream"):
        lm.stream("a", sampler=generation.BeamSampler(beam_width=2))
    with pytest.raises(ValueError, match="`sampler` must be 'greedy', a keras_attn"):
        lm.stream("a", sampler=0.5)
    with pytest.raises(ValueError, match=r"beam search.*cannot stream"):
        lm.stream("a", sampler="beam")
    with pytest.raises(ValueError, match=r"`chunk_size`.*Received: chunk_size=0"):
        lm.stream("a", chunk_size=0)
    with pytest.raises(ValueError, match="`seed` must be an int or None"):
        lm.stream("a", sampler=generation.RandomSampler(), seed="7")
    with pytest.raises(ValueError, match="`max_new_tokens` must be at most 47"):
        lm.stream("a", max_new_tokens=CONTEXT)
    untokenized = TransformerLanguageModel(30, 8, embedding_dim=8, num_layers=1,
                                           num_heads=2, intermediate_dim=8)  # fmt: skip
    with pytest.raises(ValueError, match="`stream` works on text"):
        untokenized.stream("a")


FRESH = textwrap.dedent(
    """
    import json, sys
    import keras
    import keras_attn

    model = keras.saving.load_model(sys.argv[1])
    prompts = json.loads(sys.argv[2])
    print(json.dumps({
        "backend": keras.backend.backend(),
        "pieces": [list(model.stream(p, max_new_tokens=20, chunk_size=4))
                   for p in prompts],
        "generated": model.generate(prompts, max_new_tokens=20),
    }))
    """
)


def test_a_model_loaded_in_a_fresh_process_streams(lm, tmp_path):
    path = tmp_path / "model.keras"
    lm.save(path)
    found = subprocess.run(
        [sys.executable, "-c", FRESH, str(path), json.dumps(PROMPTS)],
        capture_output=True, text=True, cwd=REPO_ROOT, check=True,
        env={**os.environ, "PYTHONPATH": REPO_ROOT},
    )  # fmt: skip
    report = json.loads(found.stdout.strip().splitlines()[-1])
    assert report["backend"] == keras.backend.backend()
    texts = ["".join(pieces) for pieces in report["pieces"]]
    assert texts == report["generated"]
    assert texts == lm.generate(PROMPTS, max_new_tokens=20)
    assert max(len(pieces) for pieces in report["pieces"]) > 1


# -- the translator ------------------------------------------------------------


# The rnn translator streams through the same loop; it runs with the slow tests.
@pytest.mark.parametrize(
    "kind", ["transformer", pytest.param("rnn", marks=pytest.mark.slow)]
)
def test_streamed_translations_join_to_greedy_translate(
    small_tokenizer, monkeypatch, kind
):
    model = translator(small_tokenizer, kind=kind)
    counting = CountingCalls(monkeypatch, type(model))
    texts = ["Where is the station?", "", "I am very tired today."]
    for max_length in (None, 5):
        for text in texts:
            pieces = list(
                model.stream_translate(text, max_length=max_length, chunk_size=3)
            )
            want = model.translate(
                text, beam_width=1, length_penalty=0.0, max_length=max_length
            )[0]
            assert joined(pieces) == want
            if len(want) > 10:
                assert len(pieces) > 1
    traced = counting.count
    # Same source widths and lengths again: no new trace.
    for text in texts:
        list(model.stream_translate(text, chunk_size=2))
    if COMPILES:
        assert counting.count == traced
    else:  # eager: every step calls the decoder again
        assert counting.count > traced


def test_stream_translate_refuses_beam_search_and_a_batch(small_tokenizer):
    model = translator(small_tokenizer)
    with pytest.raises(ValueError, match=r"greedy search only.*beam_width=4"):
        model.stream_translate("a", beam_width=4)
    with pytest.raises(ValueError, match=r"length_penalty=1.0"):
        model.stream_translate("a", length_penalty=1.0)
    with pytest.raises(ValueError, match=r"`text` must be one string.*list of 1"):
        model.stream_translate(["a"])
    with pytest.raises(ValueError, match="`max_length` must be at most 23"):
        model.stream_translate("a", max_length=30)
