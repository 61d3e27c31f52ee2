"""The language model's `sample` signature (`export(..., sampler=...)`):
`prompt` and one int64 `seed` per prompt -> `completion`, what
`model.generate(prompts, sampler=sampler, seed=seeds)` answers; each row
from its own seed, so a request's completion does not depend on the
requests it is batched with; servable (its int64 input in the sample and
warmup requests and the REST examples); speculative sampling with a draft."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from keras_attn import generation
from keras_attn.export import check_servable
from keras_attn.models import TransformerLanguageModel
from tests.test_case import REPO_ROOT

pytestmark = pytest.mark.tf_only

PROMPTS = ["where is the house", "", "the station is near the", "where is the house"]
SEEDS = [5, 6, 7, 2**40 + 5]  # the last is the first modulo 2**32


def language_model(tokenizer, width=16, seed=0, **kwargs):
    """Weights drawn normal (standard deviation 0.5): the draws vary."""
    model = TransformerLanguageModel(
        tokenizer.vocabulary_size, sequence_length=16, embedding_dim=width,
        num_layers=1, num_heads=2, intermediate_dim=2 * width, tokenizer=tokenizer,
        **kwargs,
    )  # fmt: skip
    rng = np.random.default_rng(seed)
    model.set_weights(
        [rng.normal(0, 0.5, w.shape).astype(w.dtype) for w in model.get_weights()]
    )
    return model


def sampler():
    return generation.TopKSampler(k=20, temperature=1.5)


@pytest.fixture(scope="module")
def exported(small_tokenizer, tmp_path_factory):
    model = language_model(small_tokenizer)
    path = model.export(
        tmp_path_factory.mktemp("export"), max_new_tokens=6, sampler=sampler()
    )
    return model, path


def served(path, prompts, seeds):
    sample = tf.saved_model.load(str(path)).signatures["sample"]
    outputs = sample(prompt=tf.constant(prompts), seed=tf.constant(seeds, tf.int64))
    return [c.decode("utf-8") for c in outputs["completion"].numpy()]


# Slow (a TensorFlow process of its own): the signature's answers in
# test_sample_answers_generate_with_a_seed_per_prompt, its metadata in
# test_the_sample_signature_is_described, a greedy export's servability and
# warmup in test_language_model_export.py and tests/export/test_check.py.
@pytest.mark.slow
def test_the_sample_signature_is_servable(exported):
    _, path = exported
    report = check_servable(path, examples=["where is", "the"], verbose=False)
    assert report.ok, str(report)
    assert report.signatures == ["sample", "score", "serving_default"]
    assert report.warmup["signatures"]["sample"]  # int64 seeds, replayed
    assert (
        report.warmup["signatures"]["sample"]
        == report.warmup["signatures"]["serving_default"]
    )
    bodies = [json.loads(body) for _, body, _ in report.rest_examples]
    sample_body = next(b for b in bodies if b.get("signature_name") == "sample")
    assert sample_body["inputs"] == {"prompt": ["where is", "the"], "seed": [1, 2]}


def test_the_sample_signature_is_described(exported):
    _, path = exported
    metadata = json.loads((path / "assets.extra" / "keras_attn.json").read_text())
    assert metadata["sampler"] == {
        "class": "TopKSampler",
        "config": {"k": 20, "temperature": 1.5},
    }
    assert metadata["signatures"]["sample"]["inputs"] == {
        "prompt": "string [batch]",
        "seed": "int64 [batch]",
    }


def test_sample_answers_generate_with_a_seed_per_prompt(exported):
    model, path = exported
    got = served(path, PROMPTS, SEEDS)
    assert got == model.generate(PROMPTS, 6, sampler=sampler(), seed=SEEDS)
    # Each row from its own seed: alone, or batched in another order.
    for prompt, seed, text in zip(PROMPTS, SEEDS, got, strict=True):
        assert served(path, [prompt], [seed]) == [text]
    assert served(path, PROMPTS[::-1], SEEDS[::-1]) == got[::-1]
    # Seeds are taken modulo 2**32; another seed draws another completion.
    assert got[3] == got[0]
    others = served(path, [PROMPTS[0]] * 4, [11, 12, 13, 14])
    assert len({got[0], *others}) > 1


def test_a_seed_per_prompt_is_required(exported):
    _, path = exported
    sample = tf.saved_model.load(str(path)).signatures["sample"]
    for seeds in ([1], [1, 2, 3]):
        with pytest.raises(tf.errors.InvalidArgumentError, match="one seed per prompt"):
            sample(prompt=tf.constant(["a", "b"]), seed=tf.constant(seeds, tf.int64))
    empty = sample(prompt=tf.zeros([0], tf.string), seed=tf.zeros([0], tf.int64))
    assert empty["completion"].shape == (0,)


def test_requests_batched_by_the_server_get_their_own_completions(exported):
    """TF Serving merges requests into one batch (the export's batching
    parameters): each request's completion is the one it gets alone, over
    gRPC's tensor protos and REST's JSON alike."""
    from serving_standin import StandInServer, predict_request

    _, path = exported
    rows = [(PROMPTS[:2], SEEDS[:2]), (PROMPTS[2:], SEEDS[2:]), ([""], [5])]
    with StandInServer(path) as server:
        requests = [
            predict_request("language_model", "sample", {"prompt": p, "seed": s})
            for p, s in rows
        ]
        alone = [server.predict(request) for request in requests]
        runs = server.graph_runs
        together = server.predict_together(requests)
        assert server.graph_runs - runs == 1  # one merged batch
        status, answer = server.rest(
            json.dumps({"signature_name": "sample", "inputs": {
                "prompt": PROMPTS[2:], "seed": SEEDS[2:]}})
        )  # fmt: skip
    for one, merged in zip(alone, together, strict=True):
        np.testing.assert_array_equal(
            tf.make_ndarray(merged.outputs["completion"]),
            tf.make_ndarray(one.outputs["completion"]),
        )
    assert status == 200
    assert json.loads(answer)["outputs"] == [
        c.decode("utf-8") for c in tf.make_ndarray(alone[1].outputs["completion"])
    ]


def test_without_a_sampler_there_is_no_sample_signature(small_tokenizer, tmp_path):
    model = language_model(small_tokenizer)
    path = model.export(tmp_path, max_new_tokens=3)
    metadata = json.loads((path / "assets.extra" / "keras_attn.json").read_text())
    assert sorted(metadata["signatures"]) == ["score", "serving_default"]
    assert metadata["sampler"] is None


@pytest.mark.parametrize(
    "bad",
    [
        "greedy",
        "beam",
        {"class_name": "beam", "config": {"beam_width": 2}},
        generation.GreedySampler(),
        generation.BeamSampler(2),
    ],
)
def test_a_sampler_that_does_not_draw_is_refused(small_tokenizer, tmp_path, bad):
    model = language_model(small_tokenizer)
    with pytest.raises(ValueError, match=r"`sampler` must be a keras_attn\.generation"):
        model.export(tmp_path, max_new_tokens=3, sampler=bad)
    with pytest.raises(ValueError, match=r"one of \['beam'.*Received: sampler='bean'"):
        model.export(tmp_path, max_new_tokens=3, sampler="bean")
    assert not any(tmp_path.iterdir())


@pytest.mark.slow  # a benchmark run in a process of its own
def test_serving_bench_times_the_sample_signature(exported, tmp_path):
    """`serving_bench.py`'s `language_model_sample` task: the export's
    `sample` signature under load, every answer the one its request got
    alone (the seeds are part of the request)."""
    _, path = exported
    done = subprocess.run(
        [
            sys.executable, os.path.join(REPO_ROOT, "benchmarks", "serving_bench.py"),
            "--tasks", "language_model_sample",
            "--language-model-export", str(path),
            "--threads", "2", "--batch-sizes", "1,4",
            "--seconds", "0.5", "--calls", "2",
            "--rounds", "1", "--warmup-rounds", "1",
        ],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for size in (1, 16):  # sequential
        assert re.search(
            rf"\| language_model_sample \| {size} \| [0-9.]+ \|", done.stdout
        )
    for size in (1, 4):  # two clients at once: no errors, the answers sent alone
        row = re.search(
            rf"^\| language_model_sample \| 2 \| {size} \| .*$", done.stdout, re.M
        )
        assert row and row.group(0).rstrip().endswith("| 0 | 0 |"), done.stdout


def test_serving_bench_skips_sample_without_the_signature(exported, tmp_path):
    sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
    try:
        import serving_bench
    finally:
        sys.path.pop(0)
    _, path = exported
    assert serving_bench.has_signature(path, "sample")
    assert serving_bench.has_signature(path.parent, "sample")  # the model directory
    other = tmp_path / "1" / "assets.extra"
    other.mkdir(parents=True)
    (other / "keras_attn.json").write_text(
        json.dumps({"signatures": {"serving_default": {}, "score": {}}})
    )
    assert not serving_bench.has_signature(tmp_path, "sample")


# Slow (about a minute: the export traces speculative sampling): the greedy
# draft export runs by default (test_language_model_export.py) and
# speculative sampling in process on every backend (tests/generation).
@pytest.mark.slow
def test_sample_with_a_draft_is_speculative_sampling(small_tokenizer, tmp_path):
    """The draft's weights in the SavedModel, the completions those of
    speculative sampling in process for the same seeds."""
    model = language_model(small_tokenizer)
    draft = language_model(small_tokenizer, width=8, seed=1, name="draft")
    path = model.export(
        tmp_path, max_new_tokens=6, sampler=sampler(), assistant_model=draft,
        num_speculative_tokens=3,
    )  # fmt: skip
    report = check_servable(path, verbose=False)
    assert report.ok, str(report)
    metadata = json.loads((path / "assets.extra" / "keras_attn.json").read_text())
    assert "speculative" in metadata["sample"]
    got = served(path, PROMPTS, SEEDS)
    assert got == model.generate(
        PROMPTS, 6, sampler=sampler(), seed=SEEDS, assistant_model=draft,
        num_speculative_tokens=3,
    )  # fmt: skip
    assert served(path, PROMPTS[1:2], SEEDS[1:2]) == got[1:2]


@pytest.mark.slow  # two profiler runs in processes of their own
def test_serving_profile_profiles_the_sample_signature(exported):
    _, path = exported
    script = os.path.join(REPO_ROOT, "benchmarks", "serving_profile.py")

    def run(*arguments):
        return subprocess.run(
            [sys.executable, script, "profile", str(path), *arguments],
            capture_output=True, text=True, cwd=REPO_ROOT, timeout=600,
        )  # fmt: skip

    done = run("--batch", "4", "--signature", "sample")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"\(sample\): batch 4, p50 [0-9.]+ ms", done.stdout)
    assert re.search(r"^ops per call: [0-9]+ \(traced\)$", done.stdout, re.M)
    bad = run("--signature", "sampel")
    assert bad.returncode != 0
    assert "--signature must be one of ['sample', 'score', 'serving_default']" in (
        bad.stderr
    )
    assert "Received: 'sampel'" in bad.stderr


def test_a_sampler_from_a_command_line_option():
    """`sampler_from_text`, which `--export-sampler` and serving_bench's
    `--sampler` read: a name or a JSON config, checked as the export checks
    samplers."""
    from keras_attn.export.language_model import sampler_from_text

    assert sampler_from_text(None) is None
    assert isinstance(sampler_from_text("top_k"), generation.TopKSampler)
    configured = sampler_from_text(' {"class_name": "top_p", "config": {"p": 0.3}}')
    assert isinstance(configured, generation.TopPSampler) and configured.p == 0.3
    with pytest.raises(ValueError, match=r"not a JSON config .*: \"{'p': 1}\""):
        sampler_from_text("{'p': 1}")
    with pytest.raises(ValueError, match="greedy decoding is `serving_default`"):
        sampler_from_text("greedy")


def test_the_export_takes_samplers_as_the_decodings_do():
    from keras_attn.export.language_model import check_export_sampler

    assert isinstance(check_export_sampler("top_k"), generation.TopKSampler)
    configured = check_export_sampler({"class_name": "top_p", "config": {"p": 0.5}})
    assert isinstance(configured, generation.TopPSampler) and configured.p == 0.5
    assert isinstance(
        check_export_sampler(generation.RandomSampler), generation.RandomSampler
    )
    made = sampler()
    assert check_export_sampler(made) is made and check_export_sampler(None) is None
    with pytest.raises(
        ValueError, match=r"its name or its config. Received: sampler=3"
    ):
        check_export_sampler(3)
