"""2,000 (and, marked `large`, 10,000) texts through every task method in
flat memory.

Each method runs in a fresh process on small models built there: first on
200 texts (which compiles what it needs and reaches every length bucket the
texts have), then on 2,000 (10,000) texts drawn from the same sentences. The process's
peak resident memory (`VmHWM`) after each is compared: in batches, the
2,000 texts need only their answers more (kilobytes), so the peak hardly
moves; one pass over the whole list (what `classify` did before it batched)
grows with the number of texts: the control below shows that growth is well
above the bound, so the bound tells flat from linear.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.test_case import REPO_ROOT

pytestmark = pytest.mark.tf_only  # the tokenizers run TensorFlow Text

SMALL, LARGE, LARGEST = 200, 2000, 10_000
# Flat: the peak moves by the answers and the allocator's noise (measured on
# machine B of BENCHMARKS.md: 1 to 3 MiB for every method, at 2,000 and at
# 10,000 texts). Linear: one eager pass over the whole list (the control)
# grew the peak by 2.4 GiB for 1,800 more texts on machine B and by 326 MiB
# on a CI machine (its allocator holds fewer of the intermediate tensors at
# once). 100 MiB sits far from both, with the control above twice the bound.
BOUND_MIB = 100

SCRIPT = textwrap.dedent(
    """
    import json, sys

    import numpy as np
    from keras_attn.models import (
        TextClassifier, TransformerLanguageModel, TransformerTranslator,
    )
    from keras_attn.text import SubwordTokenizer

    method, vocabulary, texts_file, control, count = sys.argv[1:6]
    texts = json.load(open(texts_file))[: int(count)]
    tokenizer = SubwordTokenizer(vocabulary)
    size = tokenizer.vocabulary_size
    blocks = dict(num_heads=4, intermediate_dim=128, dropout=0.0)
    if method == "classify":
        model = TextClassifier(size, 128, embedding_dim=64, num_layers=1,
                               tokenizer=tokenizer, **blocks)
        run = lambda texts, **kw: model.classify(texts, **kw)["label"]
    elif method == "predict":  # raw strings, as keras-hub's classifiers
        model = TextClassifier(size, 128, embedding_dim=64, num_layers=1,
                               tokenizer=tokenizer, **blocks)
        run = lambda texts, **kw: model.predict(texts, **kw)
    elif method == "translate":
        model = TransformerTranslator(
            size, size, sequence_length=129, embedding_dim=64,
            num_encoder_layers=1, num_decoder_layers=1, shared_vocabulary=True,
            source_tokenizer=tokenizer, target_tokenizer=tokenizer, **blocks)
        run = lambda texts, **kw: model.translate(
            texts, beam_width=1, max_length=4, **kw)
    else:
        model = TransformerLanguageModel(size, 128, embedding_dim=64,
                                         num_layers=1, tokenizer=tokenizer, **blocks)
        if method == "generate":
            run = lambda texts, **kw: model.generate(texts, max_new_tokens=2, **kw)
        else:
            run = lambda texts, **kw: model.score(texts, **kw)["num_tokens"]

    def peak_mib():
        # VmHWM, this process's own peak: `ru_maxrss` would start from the
        # pytest worker's resident size at the fork, hiding growth below it.
        with open("/proc/self/status") as status:
            line = next(x for x in status if x.startswith("VmHWM:"))
        return int(line.split()[1]) / 1024  # kB

    if control == "1":  # what classify did before it batched: one eager
        # pass over the whole list, padded to `sequence_length`
        dense = model.dense_tokenizer()
        run = lambda texts, **kw: np.asarray(
            model(np.asarray(dense.tokenize(texts)), training=False))

    small = texts[:SMALL]
    assert len(run(small, verbose=0)) == len(small)
    before = peak_mib()
    assert len(run(texts, verbose=0)) == len(texts)
    print(json.dumps({"before": before, "after": peak_mib()}))
    """
).replace("SMALL", str(SMALL))


@pytest.fixture(scope="module")
def inputs(english_sentences, small_tokenizer, tmp_path_factory):
    """The tokenizer's file and 10,000 texts of 3 sentences each (up to ~128
    tokens), every sentence among the first 200 texts."""
    directory = tmp_path_factory.mktemp("scale")
    vocabulary = small_tokenizer.save_proto(directory / "vocabulary.model")
    pool = sorted(set(english_sentences))
    texts = [
        " ".join(pool[(index + step * 7) % len(pool)] for step in range(3))
        for index in range(LARGEST)
    ]
    assert len(pool) <= SMALL
    path = directory / "texts.json"
    path.write_text(json.dumps(texts))
    return vocabulary, path


def peak_growth(method, inputs, tmp_path, control=False, count=LARGE):
    """MiB the peak resident memory grew from 200 to `count` texts."""
    vocabulary, texts = inputs
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, method, str(vocabulary), str(texts),
         "1" if control else "0", str(count)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": REPO_ROOT},
        timeout=1800,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    print(method, "control" if control else "batched", found)  # shown with -s
    return Growth(found["after"] - found["before"], method, control, found)


class Growth(float):
    """MiB of peak growth that names, in an assertion's message, the method
    and the peaks it was measured from."""

    def __new__(cls, value, method, control, found):
        growth = super().__new__(cls, value)
        growth.label = (
            f"{method} ({'control' if control else 'batched'}): peak "
            f"{found['before']:.0f} -> {found['after']:.0f} MiB"
        )
        return growth

    def __repr__(self):
        return f"{float(self):.1f} [{self.label}]"


METHODS = ["classify", "translate", "generate", "score"]


# The language model's `generate` at scale runs with the slow tests; its
# batching runs by default in test_task_batching.py.
@pytest.mark.parametrize(
    "method",
    [
        pytest.param(method, marks=pytest.mark.slow) if method == "generate" else method
        for method in METHODS
    ],
)
def test_memory_stays_flat_from_200_to_2000_texts(method, inputs, tmp_path):
    assert peak_growth(method, inputs, tmp_path) < BOUND_MIB


# `predict` on raw strings is `classify`'s path: checked at 10,000 only.
@pytest.mark.large
@pytest.mark.parametrize("method", [*METHODS, "predict"])
def test_memory_stays_flat_from_200_to_10000_texts(method, inputs, tmp_path):
    assert peak_growth(method, inputs, tmp_path, count=LARGEST) < BOUND_MIB


def test_the_bound_tells_one_pass_over_every_text_from_batches(inputs, tmp_path):
    """The control: the classifier's network called eagerly on the whole list
    at once, padded to `sequence_length` (what `classify` did before it
    batched), grows far beyond the bound. (`classify` with `batch_size` the
    whole list no longer does: its compiled pass over 2,000 texts did not grow
    the peak on TensorFlow.)"""
    assert peak_growth("classify", inputs, tmp_path, control=True) > 2 * BOUND_MIB
