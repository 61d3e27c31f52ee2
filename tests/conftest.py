"""Pytest configuration shared by every test."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# XLA's LLVM code generation at -O0 for the JAX runs: the tests compile
# thousands of small programs and run each a few times, so compiling is most
# of their time (-O0 cuts the JAX run by about 30%). The HLO passes (fusion,
# layout, what decides the numerics) are unchanged; the benchmarks and
# users' programs run at XLA's default level. An XLA_FLAGS that sets the
# level already is left as it is.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()

import gc
from pathlib import Path

import keras
import pytest

FIXTURES = Path(__file__).parent / "fixtures"

# What the imports above created (TensorFlow's or JAX's modules: about
# 400,000 objects) lives as long as the process: keep it out of the cyclic
# collector's full passes, which Keras also starts by hand (`gc.collect()` on
# each variable `quantize` replaces).
gc.collect()
gc.freeze()


def pytest_collection_modifyitems(config, items):
    """Tests marked `tf_only` / `jax_only` / `torch_only` cannot run on the
    other backends: deselect them there (that backend's run covers them),
    rather than skipping inside the test."""
    backend = keras.backend.backend()
    wrong = {
        "tf_only": backend != "tensorflow",
        "jax_only": backend != "jax",
        "torch_only": backend != "torch",
    }
    kept, deselected = [], []
    for item in items:
        other_backend = any(
            item.get_closest_marker(marker) and is_wrong
            for marker, is_wrong in wrong.items()
        )
        (deselected if other_backend else kept).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


@pytest.fixture(autouse=True)
def _float32_policy():
    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_dtype_policy("float32")


@pytest.fixture(scope="session")
def english_sentences():
    from keras_attn.datasets import load_translation_pairs

    splits = load_translation_pairs(path=FIXTURES / "de_en_pairs.tsv")
    return [english for english, _ in splits.train + splits.validation + splits.test]


@pytest.fixture(scope="session")
def small_tokenizer(english_sentences, tmp_path_factory):
    """A 300-piece SentencePiece tokenizer of the fixture's English side
    (TensorFlow Text: TensorFlow-only tests)."""
    from keras_attn.text import SubwordTokenizer, train_subword_vocabulary

    path = train_subword_vocabulary(
        english_sentences,
        tmp_path_factory.mktemp("vocab") / "en.model",
        vocabulary_size=300,
        lowercase=True,
    )
    return SubwordTokenizer(path)
