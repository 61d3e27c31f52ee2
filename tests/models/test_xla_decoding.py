"""The tasks' compiled decodings under XLA on TensorFlow: with
`task.jit_compile = True` (Keras's own default on a machine with a GPU, as
keras-hub's `generate` takes it) `generate`, `stream`, `translate` and
`stream_translate`, with and without a draft, compile with
`tf.function(jit_compile=True)` and give the tokens of the default
compilation; setting it back recompiles without XLA. TensorFlow only: JAX
always compiles with XLA, PyTorch runs eagerly."""

import pytest

from tests.models.test_language_model_assistant import PROMPTS, language_model
from tests.models.test_speculative_translation import translator
from tests.models.test_translator_assistant import TEXTS, with_draft

# XLA compiles each shape (about 140 worker-seconds on a 2-core AVX2
# machine): `make test-large` runs these (CI ran past its 90 minutes with
# them); tests/generation/test_export.py compiles a decoding with XLA in the
# default run.
pytestmark = [pytest.mark.tf_only, pytest.mark.slow, pytest.mark.large]


def compiled_with_xla(task):
    """Whether each decoding compiled on `task` is XLA's (`_task.compiled`
    keeps them on the task)."""
    return [found[1]._jit_compile for found in task.__dict__["_task_cache"].values()
            if hasattr(found[1], "_jit_compile")]  # fmt: skip


def answers(model, options):
    return [model.generate(PROMPTS, max_new_tokens=8, **option) for option in options]


def test_the_language_models_decodings_under_xla_give_the_same_tokens(small_tokenizer):
    from keras_attn.generation import TopKSampler

    draft = language_model(small_tokenizer, 1, 8, seed=2)
    model = language_model(small_tokenizer, 2, 16, seed=1, assistant_model=draft)
    assert model.jit_compile is False  # Keras's default without a GPU
    options = [
        {"assistant_model": False},
        {},  # the model's own draft
        {"assistant_model": False, "sampler": TopKSampler(k=5, seed=3)},
        {"sampler": TopKSampler(k=5, seed=3)},  # speculative sampling
    ]
    want = answers(model, options)
    streamed = "".join(model.stream(PROMPTS[0], max_new_tokens=8))
    assert compiled_with_xla(model) and not any(compiled_with_xla(model))
    assert len(set(want[0])) > 1

    model.jit_compile = True
    model.__dict__.pop("_task_cache")  # every decoding compiles afresh
    assert answers(model, options) == want
    assert "".join(model.stream(PROMPTS[0], max_new_tokens=8)) == streamed
    assert streamed == want[1][0]
    assert compiled_with_xla(model) and all(compiled_with_xla(model))

    model.jit_compile = False  # the setting is part of what is kept
    assert answers(model, options[:1]) == want[:1]
    assert not all(compiled_with_xla(model))


def test_the_translators_decodings_under_xla_give_the_same_translations(
    small_tokenizer,
):
    draft = translator(1, 16, seed=4, tokenizer=small_tokenizer)
    model = with_draft(small_tokenizer, 3, draft)
    options = [
        {"beam_width": 1, "length_penalty": 0.0},  # with the draft
        {"beam_width": 1, "length_penalty": 0.0, "assistant_model": False},
        {"beam_width": 2, "length_penalty": 1.0},
    ]

    def translations():
        found = [model.translate(TEXTS, verbose=0, **option) for option in options]
        streamed = "".join(model.stream_translate(TEXTS[0]))
        return found, streamed

    want = translations()
    assert want[1] == want[0][0][0] and len(set(want[0][0])) > 1
    model.jit_compile = True
    model.__dict__.pop("_task_cache")
    assert translations() == want
    assert all(compiled_with_xla(model))


def test_the_rnn_translators_decodings_under_xla_give_the_same_ids():
    """Beam and greedy search over the RNN translator's cell states."""
    import numpy as np

    from keras_attn.models import RNNTranslator

    model = RNNTranslator(30, 20, embedding_dim=8, units=12, dropout=0.0)
    rng = np.random.default_rng(0)
    model.set_weights([rng.normal(0, 0.5, w.shape).astype(w.dtype)
                       for w in model.get_weights()])  # fmt: skip
    ids = np.array([[5, 6, 7, 8, 0], [9, 10, 0, 0, 0]], "int32")

    def decoded():  # `translate`'s compiled decodings, kept on the task
        return [
            np.asarray(model._compiled_decoding(8, width, penalty, None, 5)(ids)[0])
            for width, penalty in ((1, 0.0), (3, 1.0))
        ]

    want = decoded()
    model.jit_compile = True
    found = decoded()
    for got, expected in zip(found, want, strict=True):
        np.testing.assert_array_equal(got, expected)
    assert all(compiled_with_xla(model))
