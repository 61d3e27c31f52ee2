"""The TF Serving release table, the runtimes built from it, and the check's
reading of a release's TensorFlow Text.

Nothing here builds a real runtime (minutes and gigabytes): the builder runs
with a stand-in installer, and the check's handling of a release whose
TensorFlow Text cannot be loaded runs with this environment's TensorFlow and
op libraries laid out as such a runtime. `test_serving_releases.py` (large)
builds and uses the real ones.
"""

import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from keras_attn.export import releases
from keras_attn.export.releases import (
    SERVING_RELEASES,
    ServingRuntime,
    newest_releases,
    ops_in_libraries,
    release_for_tensorflow,
    serving_release,
    serving_runtime,
)


def test_table():
    versions = [r.version for r in SERVING_RELEASES]
    assert versions[:2] == ["2.20.0", "2.19.1"]  # newest first
    assert (
        versions == sorted(versions, key=lambda v: tuple(map(int, v.split("."))))[::-1]
    )
    assert [r.version for r in newest_releases()] == ["2.20.0", "2.19.1"]
    release = serving_release("2.20.0")
    assert (release.tensorflow, release.tensorflow_text) == ("2.20.0", "2.20.0")
    assert (
        release.exact_text_ops and release.docker_image == "tensorflow/serving:2.20.0"
    )
    older = serving_release("2.19.1")
    assert (older.tensorflow, older.tensorflow_text, older.text_kernels) == (
        "2.19.1",
        "2.12.1",
        "2.19.0",
    )
    assert not older.exact_text_ops
    with pytest.raises(
        ValueError, match=re.escape("Received: serving_release='2.17.1'")
    ):
        serving_release("2.17.1")


def test_release_for_an_exports_tensorflow():
    assert release_for_tensorflow("2.21.0").version == "2.20.0"  # none for 2.21 yet
    assert release_for_tensorflow("2.20.1").version == "2.20.0"
    assert release_for_tensorflow("2.19.0").version == "2.19.1"
    with pytest.raises(ValueError, match=re.escape("as old as TensorFlow 2.17.0")):
        release_for_tensorflow("2.17.0")


def fake_installer(calls, fail=False):
    def install(release, directory):
        calls.append(release.version)
        if fail:
            (directory / "venv").mkdir()
            raise RuntimeError("pip failed")
        python = directory / "venv" / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.write_text("")
        for version in {release.tensorflow_text, release.text_kernels}:
            (directory / "text_ops" / version).mkdir(parents=True)
        return {"pip_freeze": [f"tensorflow-cpu=={release.tensorflow}"]}

    return install


def test_runtime_is_built_once_and_reused(tmp_path):
    calls = []
    runtime = serving_runtime("2.19.1", root=tmp_path, installer=fake_installer(calls))
    assert runtime.directory == tmp_path / "tf-serving-2.19.1"
    assert runtime.python == runtime.directory / "venv" / "bin" / "python"
    assert runtime.text_ops_dir.name == "2.19.0"
    assert runtime.linked_text_ops_dir.name == "2.12.1"
    record = json.loads((runtime.directory / "RUNTIME.json").read_text())
    assert record["release"]["tensorflow_text"] == "2.12.1"
    assert record["installed"] == {"pip_freeze": ["tensorflow-cpu==2.19.1"]}
    again = serving_runtime("2.19.1", root=tmp_path, installer=fake_installer(calls))
    assert again == runtime and calls == ["2.19.1"]


def test_an_interrupted_or_failed_build_is_redone(tmp_path):
    calls = []
    with pytest.raises(RuntimeError, match="pip failed"):
        serving_runtime("2.20.0", root=tmp_path, installer=fake_installer(calls, True))
    assert not (tmp_path / "tf-serving-2.20.0").exists()  # nothing half-built left
    # A directory without RUNTIME.json (a build killed midway) is not taken.
    (tmp_path / "tf-serving-2.20.0" / "venv").mkdir(parents=True)
    serving_runtime("2.20.0", root=tmp_path, installer=fake_installer(calls))
    assert calls == ["2.20.0", "2.20.0"]


def test_concurrent_first_calls_build_once(tmp_path):
    calls, results = [], []
    slow = fake_installer(calls)

    def build():
        results.append(serving_runtime("2.20.0", root=tmp_path, installer=slow))

    threads = [threading.Thread(target=build) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert calls == ["2.20.0"]
    assert len(results) == 4 and all(r == results[0] for r in results)


# The op libraries of the TensorFlow Text this environment has, registered in a
# fresh TensorFlow-only process (as the check loads them).
LIST_TEXT_OPS = r"""
from tensorflow.core.framework import op_def_pb2
from tensorflow.python.client import pywrap_tf_session

ops = set()
for directory in TEXT_OPS_DIRS:
    for library in sorted(glob.glob(os.path.join(directory, "*.so"))):
        handle = pywrap_tf_session.TF_LoadLibrary(library)
        op_list = op_def_pb2.OpList.FromString(pywrap_tf_session.TF_GetOpList(handle))
        pywrap_tf_session.TF_DeleteLibraryHandle(handle)
        ops |= {op.name for op in op_list.op}
print(json.dumps({"dirs": TEXT_OPS_DIRS, "ops": sorted(ops)}))
"""


@pytest.fixture(scope="module")
def text_op_libraries():
    from keras_attn.export.check import TENSORFLOW_ONLY_PRELUDE

    result = subprocess.run(
        [sys.executable, "-c", TENSORFLOW_ONLY_PRELUDE + LIST_TEXT_OPS],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.tf_only
def test_op_names_read_from_libraries_are_the_ops_they_register(
    text_op_libraries, tmp_path
):
    registered = set(text_op_libraries["ops"])
    assert {"SentencepieceOp", "FastWordpieceTokenizeWithOffsets"} <= registered
    libraries = tmp_path / "libraries"
    libraries.mkdir()
    for directory in text_op_libraries["dirs"]:
        for library in Path(directory).glob("*.so"):
            (libraries / library.name).symlink_to(library)
    found = ops_in_libraries(libraries, registered | {"KerasAttnMadeUpOp"})
    assert found == registered  # every registered op, and nothing made up


def fake_runtime(release, text_ops_dir, linked_dir):
    """`ServingRuntime` of this environment's TensorFlow with the given op
    libraries: the check's code path for `release`, without building it."""
    return ServingRuntime(
        release=release,
        directory=Path(linked_dir).parent,
        python=Path(sys.executable),
        text_ops_dir=Path(text_ops_dir),
        linked_text_ops_dir=Path(linked_dir),
        installed={},
    )


@pytest.mark.slow  # the release table and its parsing stay in the default run
@pytest.mark.tf_only
def test_check_against_a_release_whose_text_library_cannot_load(
    small_sentiment_export, text_op_libraries, tmp_path, monkeypatch
):
    """TF Serving 2.19 links TensorFlow Text 2.12.1: the check reads the op
    names in that release's libraries and runs the kernels of another wheel.
    Here: libraries that lack an op the export uses (NOT SERVABLE), and
    kernels that do not load (NOT VERIFIED)."""
    from keras_attn.export import check_servable

    kernels = tmp_path / "kernels"
    kernels.mkdir()
    for directory in text_op_libraries["dirs"]:
        for library in Path(directory).glob("*.so"):
            (kernels / library.name).symlink_to(library)
    linked = tmp_path / "linked"
    linked.mkdir()
    release = serving_release("2.19.1")
    runtime = fake_runtime(release, kernels, linked)
    monkeypatch.setattr(releases, "serving_runtime", lambda *a, **k: runtime)

    # The server's libraries have SentencepieceOp but not the tokenize op.
    (linked / "_sentencepiece_tokenizer.so").write_bytes(b"\x00SentencepieceOp\x00")
    report = check_servable(
        small_sentiment_export, verbose=False, serving_release="2.19.1"
    )
    assert report.status == "NOT SERVABLE" and not report.ok
    assert report.problems == [
        "ops outside the server's TensorFlow and TensorFlow Text: "
        "SentencepieceTokenizeOp"
    ]
    assert report.serving_release == "2.19.1"

    # The server has both; the runtime's kernels are missing: not verified.
    (linked / "_sentencepiece_tokenizer.so").write_bytes(
        b"\x00SentencepieceOp\x00xSentencepieceTokenizeOp\x00"
    )
    empty = tmp_path / "no_kernels"
    empty.mkdir()
    monkeypatch.setattr(
        releases,
        "serving_runtime",
        lambda *a, **k: fake_runtime(release, empty, linked),
    )
    report = check_servable(
        small_sentiment_export, verbose=False, serving_release="2.19.1"
    )
    assert report.status == "NOT VERIFIED" and not report.ok and not report.problems
    assert (
        "SentencepieceOp, SentencepieceTokenizeOp (the server has them)"
        in (report.unverified[0])
    )
    assert report.text_ops == ["SentencepieceOp", "SentencepieceTokenizeOp"]

    # With the kernels there, the whole check runs and passes.
    monkeypatch.setattr(releases, "serving_runtime", lambda *a, **k: runtime)
    report = check_servable(
        small_sentiment_export, verbose=False, serving_release="2.19.1"
    )
    assert report.ok, str(report)
    assert report.warmup["records"] == 3
