"""What a script's run leaves loads in a fresh process that imports only
`keras` and `keras_attn`: `model.keras` with its compile config (loss,
metrics, optimizer) and tokenizers, its preset (`preset/`, keras-hub's
layout: the same answers), and every weight file of the run; the model then
answers raw strings and trains a step with its compiled loss."""

import json
import os
import subprocess
import sys
import textwrap

from tests.test_case import REPO_ROOT

FRESH = textwrap.dedent(
    """
    import json, pathlib, sys

    import keras
    import keras_attn
    import numpy as np

    run = pathlib.Path(sys.argv[1])
    before = set(sys.modules)
    model = keras.saving.load_model(run / "model.keras")  # compile=True
    report = {"class": type(model).__name__, "loss": type(model.loss).__name__}
    texts = ["Where is the station?", "", "KING: To be, or not"]
    preset = run / "preset"
    if preset.is_dir():  # the same task, from keras-hub's preset layout
        again = type(model).from_preset(preset)
        if hasattr(model, "translate"):
            same = again.translate(texts, beam_width=2) == model.translate(
                texts, beam_width=2)
        elif hasattr(model, "classify"):
            same = np.allclose(again.predict(texts, verbose=0),
                               model.predict(texts, verbose=0), atol=1e-6)
        else:
            same = np.allclose(again.score(texts)["log_likelihood"],
                               model.score(texts)["log_likelihood"], atol=1e-5)
        report["preset"] = bool(same)
    if hasattr(model, "translate"):
        report["answers"] = model.translate(texts, beam_width=2)
        width = 6
        x = {"encoder_inputs": np.full((2, width), 5, "int32"),
             "decoder_inputs": np.full((2, width), 5, "int32")}
        y = np.full((2, width), 5, "int32")
    elif hasattr(model, "classify"):
        found = model.classify(texts)
        report["answers"] = [found["positive_probability"].tolist(), found["label"]]
        x, y = np.full((2, 6), 5, "int32"), np.ones((2, 1), "float32")
    else:
        report["answers"] = [model.generate(texts),  # max_new_tokens: the room left
                             model.score(texts)["log_likelihood"].tolist()]
        x = y = np.full((2, 6), 5, "int32")
    # The compiled loss and metrics, and the optimizer of the compile config.
    report["evaluated"] = model.evaluate(x, y, verbose=0, return_dict=True)
    history = model.fit(x, y, epochs=1, verbose=0)
    report["trained_loss"] = history.history["loss"][-1]
    report["optimizer"] = type(model.optimizer).__name__
    # Every weight file of the run loads into the model it was written from.
    report["weights"] = []
    members = getattr(model, "members", None)
    for path in sorted(run.rglob("*.weights.h5")):
        parts = path.relative_to(run).parts
        if parts[0] == "preset":  # the backbone's and the head's, loaded above
            continue
        target = model
        if members is not None and parts[0] == "members":
            target = next(m for m in members if m.name == f"member_{parts[1]}")
        target.load_weights(path)
        report["weights"].append(str(path.relative_to(run)))
    report["imported"] = sorted(
        {name.split(".")[0] for name in set(sys.modules) - before}
    )
    print(json.dumps(report))
    """
)


def assert_run_loads_in_a_fresh_process(out, cwd):
    """Load the run in `out` in a fresh process (working directory `cwd`,
    not the repository: nothing of the scripts is importable there) and
    return its report."""
    result = subprocess.run(
        [sys.executable, "-c", FRESH, str(out)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={
            **os.environ,
            "TF_CPP_MIN_LOG_LEVEL": "3",
            "PYTHONPATH": REPO_ROOT,  # keras_attn, as if installed
        },
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(report["answers"]) in (2, 3)
    for name, value in report["evaluated"].items():
        assert isinstance(value, float) and value == value, (name, value)  # not NaN
    assert report["trained_loss"] == report["trained_loss"]
    # Nothing but keras_attn's own dependencies was imported while loading.
    assert not {"examples", "_cli", "_options", "tests"} & set(report["imported"])
    # A task on a backbone (not an ensemble, not the RNN) left its preset.
    if report["class"] in ("TextClassifier", "TransformerTranslator",
                           "TransformerLanguageModel"):  # fmt: skip
        assert report["preset"] is True, report
    else:
        assert "preset" not in report
    return report
