"""The language model export's `sample` signature at scale: 2,000 prompts
(each with its own seed, in requests of 16) served from the export in a
fresh process that imports only TensorFlow and TensorFlow Text, as a
serving client's host does, in flat memory; and a prompt's completion for
its seed is the same in whatever request it comes (the rows of a batch
draw from their own seeds)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.export.test_language_model_sample_export import language_model, sampler

pytestmark = [pytest.mark.tf_only, pytest.mark.slow]

SMALL, LARGE = 200, 2000
# test_task_scale's bound: flat moves the peak by a few MiB, one pass over
# every prompt by hundreds.
BOUND_MIB = 100

SCRIPT = (
    textwrap.dedent(
        """
    import json, sys

    import numpy as np
    import tensorflow as tf
    import tensorflow_text  # noqa: F401  (the export's tokenizer ops)

    export, prompts_file = sys.argv[1:3]
    prompts = json.load(open(prompts_file))
    sample = tf.saved_model.load(export).signatures["sample"]

    def peak_mib():
        with open("/proc/self/status") as status:
            line = next(x for x in status if x.startswith("VmHWM:"))
        return int(line.split()[1]) / 1024

    def serve(indices, rows=16):
        answers = {}
        for start in range(0, len(indices), rows):
            batch = indices[start : start + rows]
            out = sample(
                prompt=tf.constant([prompts[i] for i in batch]),
                seed=tf.constant(batch, tf.int64),  # the prompt's index
            )["completion"].numpy()
            answers.update(zip(batch, (c.decode("utf-8") for c in out)))
        return answers

    small = serve(list(range(SMALL)))
    before = peak_mib()
    every = serve(list(range(LARGE)))
    after = peak_mib()
    # The first prompts again, in other requests: reversed, 7 to a request.
    again = serve(list(range(SMALL))[::-1], rows=7)
    print(json.dumps({
        "before": before, "after": after, "answers": len(every),
        "empty": sum(not every[i] for i in every),
        "same_in_other_requests": all(
            again[i] == small[i] == every[i] for i in range(SMALL)
        ),
        "distinct": len(set(every.values())),
    }))
    """
    )
    .replace("SMALL", str(SMALL))
    .replace("LARGE", str(LARGE))
)


def test_two_thousand_prompts_through_sample_in_flat_memory(
    small_tokenizer, english_sentences, tmp_path
):
    model = language_model(small_tokenizer)
    export = model.export(tmp_path / "export", max_new_tokens=6, sampler=sampler())
    pool = sorted(set(english_sentences))
    prompts = [
        " ".join(pool[(index + step * 7) % len(pool)] for step in range(1 + index % 3))
        for index in range(LARGE)
    ]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(export), str(tmp_path / "prompts.json")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
        timeout=1800,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    print(found)  # shown with -s
    assert found["answers"] == LARGE and found["empty"] == 0
    assert found["same_in_other_requests"]
    assert found["distinct"] > LARGE // 2  # drawn, not one text for all
    assert found["after"] - found["before"] < BOUND_MIB, found
    # The served completions are generate's for the same seeds.
    some = [0, 1, 17, 1999]
    served = json.loads(
        subprocess.run(
            [sys.executable, "-c", SERVE_SOME, str(export), json.dumps(
                [[prompts[i] for i in some], some])],
            capture_output=True, text=True, cwd=tmp_path, timeout=600,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
        ).stdout.strip().splitlines()[-1]
    )  # fmt: skip
    assert served == model.generate(
        [prompts[i] for i in some], 6, sampler=sampler(), seed=some
    )


SERVE_SOME = textwrap.dedent(
    """
    import json, sys
    import tensorflow as tf
    import tensorflow_text  # noqa: F401

    export, request = sys.argv[1:3]
    prompts, seeds = json.loads(request)
    sample = tf.saved_model.load(export).signatures["sample"]
    out = sample(prompt=tf.constant(prompts), seed=tf.constant(seeds, tf.int64))
    print(json.dumps([c.decode("utf-8") for c in out["completion"].numpy()]))
    """
)
