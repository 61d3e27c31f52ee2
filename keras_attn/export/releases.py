"""The TF Serving releases an export is checked against, and their runtimes.

A `tensorflow_model_server` binary links its own TensorFlow and its own
TensorFlow Text, fixed at each release tag by TF Serving's `WORKSPACE`
(`org_tensorflow`) and `tensorflow_serving/workspace.bzl`
(`org_tensorflow_text`). `SERVING_RELEASES` records them; `serving_runtime()`
builds, on first use, a virtual environment holding exactly that TensorFlow
(from PyPI) and that TensorFlow Text's kernels, in which
`check_servable(path, serving_release=...)` loads and runs the export.

Layout under `keras_attn.downloads.cache_home()` (`$KERAS_ATTN_HOME`, default
`~/.cache/keras_attn`), the same root as the corpora:

```
serving/
  tf-serving-<release>/venv/            python -m venv: tensorflow-cpu==<TF>,
                                        tensorflow-serving-api==<release>
                                        (its protos only, --no-deps)
  tf-serving-<release>/text_ops/<ver>/  TensorFlow Text's op libraries
                                        (python/ops/*.so, python/metrics/*.so)
                                        unpacked from its wheel; no Python
  tf-serving-<release>/RUNTIME.json     what was installed, written last
  .tf-serving-<release>.lock            held while building
```

A runtime without `RUNTIME.json` is incomplete (an interrupted build) and is
built again. When a TF Serving release links a TensorFlow Text older than
its TensorFlow (2.18 and 2.19 link 2.12.1), no wheel of that TensorFlow Text
loads into that TensorFlow (its libraries were built against TensorFlow 2.12's
ABI): the runtime then runs the kernels of the TensorFlow Text wheel built for
its TensorFlow (`text_kernels`) and checks the graph's TensorFlow Text ops by
name against the op libraries of the linked release's wheel.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

from keras_attn.downloads import locked

RUNTIME_FILE = "RUNTIME.json"
# Where a TensorFlow Text wheel keeps the op libraries its `ops_lib` target
# (what TF Serving links) is made of.
TEXT_OP_LIBRARY_DIRS = ("tensorflow_text/python/ops", "tensorflow_text/python/metrics")


@dataclass(frozen=True)
class ServingRelease:
    """One TF Serving release and the runtime its model server links.

    Attributes:
        version: the release tag, e.g. `"2.20.0"` (also the Docker image tag
            `tensorflow/serving:<version>`).
        tensorflow: the TensorFlow release its `WORKSPACE` pins.
        tensorflow_text: the TensorFlow Text release its `workspace.bzl`
            pins (the ops the binary has).
        text_kernels: the TensorFlow Text wheel whose kernels the runtime
            loads: `tensorflow_text` itself when its wheel loads into
            `tensorflow`, else the wheel built for `tensorflow`.
    """

    version: str
    tensorflow: str
    tensorflow_text: str
    text_kernels: str

    @property
    def docker_image(self) -> str:
        return f"tensorflow/serving:{self.version}"

    @property
    def exact_text_ops(self) -> bool:
        """True when the runtime loads the very TensorFlow Text the server
        links; False when its ops are matched by name only."""
        return self.text_kernels == self.tensorflow_text


# Filled from tensorflow/serving at each tag (newest first). TensorFlow: the
# `org_tensorflow` archive in `WORKSPACE`, a commit of the TensorFlow release
# named; TensorFlow Text: `org_tensorflow_text` in
# `tensorflow_serving/workspace.bzl`.
#
# 2.20.0 (tag commit bc7e9d2b, 2026-04-23):
#   WORKSPACE:       git_commit = "72fbba3d20f4616d7312b5e2b7f79daf6e82f2fa"  (v2.20.0)
#   workspace.bzl:   strip_prefix = "text-2.20.0",
#                    url = "https://github.com/tensorflow/text/archive/v2.20.0.zip",
# 2.19.1 (tag commit eab9c352, 2025-08-18):
#   WORKSPACE:       git_commit = "f4247ebb6f9e7421f38c3f01a9a5d5cd54bd24fd"  (v2.19.1)
#   workspace.bzl:   strip_prefix = "text-2.12.1",
#                    url = "https://github.com/tensorflow/text/archive/v2.12.1.zip",
# 2.19.0 (tag commit c491ba65, 2025-05-05):
#   WORKSPACE:       git_commit = "e36baa302922ea3c7131b302c2996bd2051ee5c4"  (v2.19.0)
#   workspace.bzl:   strip_prefix = "text-2.12.1",
#                    url = "https://github.com/tensorflow/text/archive/v2.12.1.zip",
# 2.18.0:
#   WORKSPACE:       git_commit = "6550e4bd80223cdb8be6c3afd1f81e86a4d433c3"  (v2.18.0)
#   workspace.bzl:   strip_prefix = "text-2.12.1",
#                    url = "https://github.com/tensorflow/text/archive/v2.12.1.zip",
# Not listed: 2.18.1 (its TensorFlow commit cb64295e could not be matched to a
# TensorFlow release), releases before 2.18 (no TensorFlow wheel of theirs
# for Python 3.11 and later is needed here), and 2.21 (not tagged when this
# table was filled; its release branch was being prepared).
# Every version below exists on PyPI for Python 3.11 (tensorflow-cpu,
# tensorflow-text, tensorflow-serving-api).
SERVING_RELEASES = (
    ServingRelease("2.20.0", "2.20.0", "2.20.0", "2.20.0"),
    ServingRelease("2.19.1", "2.19.1", "2.12.1", "2.19.0"),
    ServingRelease("2.19.0", "2.19.0", "2.12.1", "2.19.0"),
    ServingRelease("2.18.0", "2.18.0", "2.12.1", "2.18.0"),
)


def serving_release(version) -> ServingRelease:
    """The `ServingRelease` of TF Serving `version` (e.g. `"2.20.0"`)."""
    for release in SERVING_RELEASES:
        if release.version == version:
            return release
    raise ValueError(
        "`serving_release` must be a TF Serving release of the table "
        f"({', '.join(r.version for r in SERVING_RELEASES)}). "
        f"Received: serving_release={version!r}"
    )


def newest_releases(count: int = 2) -> list[ServingRelease]:
    """The `count` newest releases of the table, newest first."""
    return list(SERVING_RELEASES[:count])


def release_for_tensorflow(tensorflow_version: str) -> ServingRelease:
    """The release to serve an export written with `tensorflow_version`.

    The newest release whose TensorFlow has the same major.minor, else the
    newest release older than it (TF Serving is released after TensorFlow;
    `check_servable(..., serving_release=...)` says whether that one loads
    the export).
    """
    wanted = _version_tuple(tensorflow_version)[:2]
    older = [r for r in SERVING_RELEASES if _version_tuple(r.tensorflow)[:2] <= wanted]
    if not older:
        raise ValueError(
            "No TF Serving release of the table is as old as TensorFlow "
            f"{tensorflow_version}. Received: tensorflow_version="
            f"{tensorflow_version!r}"
        )
    return older[0]


def _version_tuple(version: str) -> tuple[int, ...]:
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", str(version))
    if match is None:
        raise ValueError(f"Not a version number. Received: version={version!r}")
    return tuple(int(part or 0) for part in match.groups())


@dataclass(frozen=True)
class ServingRuntime:
    """A built runtime: where its Python and TensorFlow Text live."""

    release: ServingRelease
    directory: Path
    python: Path
    text_ops_dir: Path
    linked_text_ops_dir: Path
    installed: dict

    def linked_text_ops(self, op_names) -> set[str] | None:
        """Which of `op_names` the linked TensorFlow Text's libraries hold
        (`ops_in_libraries`), or None when the runtime loads those libraries
        themselves (the op registry then answers exactly)."""
        if self.release.exact_text_ops:
            return None
        return ops_in_libraries(self.linked_text_ops_dir, op_names)


def runtime_root(root=None) -> Path:
    if root is not None:
        return Path(root).expanduser()
    from keras_attn.downloads import cache_home

    return cache_home() / "serving"


def serving_runtime(
    release, root=None, verbose: bool = True, installer=None
) -> ServingRuntime:
    """The runtime of TF Serving `release`, built on first use.

    Args:
        release: a `ServingRelease` or a release version such as `"2.20.0"`.
        root: where runtimes live; default `cache_home() / "serving"`.
        verbose: print a line to stderr before building.
        installer: `installer(release, directory)` doing the build (tests
            replace it); default `install_runtime`.

    Building needs PyPI and installs TensorFlow's
    wheel, its dependencies and TensorFlow Text's wheel(s). Concurrent
    callers (threads or processes) serialise on a lock file; the second one
    reuses the first one's runtime.
    """
    if not isinstance(release, ServingRelease):
        release = serving_release(release)
    root = runtime_root(root)
    directory = root / f"tf-serving-{release.version}"
    runtime = _read_runtime(release, directory)
    if runtime is not None:
        return runtime
    root.mkdir(parents=True, exist_ok=True)
    with locked(root / f".tf-serving-{release.version}.lock"):
        runtime = _read_runtime(release, directory)
        if runtime is not None:  # built by another caller while we waited
            return runtime
        shutil.rmtree(directory, ignore_errors=True)  # an interrupted build
        directory.mkdir(parents=True)
        if verbose:
            print(
                f"keras_attn: building the runtime of TF Serving {release.version} "
                f"(TensorFlow {release.tensorflow}, TensorFlow Text "
                f"{release.tensorflow_text}) in {directory} ...",
                file=sys.stderr,
                flush=True,
            )
        started = time.monotonic()
        try:
            installed = (installer or install_runtime)(release, directory)
            record = {
                "release": asdict(release),
                "installed": installed,
                "build_seconds": round(time.monotonic() - started, 1),
            }
            # Written last: a directory without it is never taken as built.
            (directory / RUNTIME_FILE).write_text(json.dumps(record, indent=1) + "\n")
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
    runtime = _read_runtime(release, directory)
    if runtime is None:
        raise RuntimeError(f"The runtime at {directory} is incomplete after building.")
    return runtime


def _paths(release: ServingRelease, directory: Path) -> dict:
    return {
        "python": directory / "venv" / "bin" / "python",
        "text_ops_dir": directory / "text_ops" / release.text_kernels,
        "linked_text_ops_dir": directory / "text_ops" / release.tensorflow_text,
    }


def _read_runtime(release: ServingRelease, directory: Path) -> ServingRuntime | None:
    try:
        record = json.loads((directory / RUNTIME_FILE).read_text())
    except (OSError, ValueError):
        return None
    paths = _paths(release, directory)
    if record.get("release") != asdict(release) or not all(
        path.exists() for path in paths.values()
    ):
        return None
    return ServingRuntime(
        release=release, directory=directory, installed=record["installed"], **paths
    )


def tensorflow_distribution() -> str:
    """`tensorflow-cpu` where PyPI has it (x86-64), else `tensorflow`."""
    machine = platform.machine().lower()
    return "tensorflow-cpu" if machine in ("x86_64", "amd64") else "tensorflow"


def install_runtime(release: ServingRelease, directory: Path) -> dict:
    """Build the runtime of `release` in the empty `directory`; returns what
    was installed (`pip freeze` of the venv and the TensorFlow Text wheels)."""
    paths = _paths(release, directory)
    _run([sys.executable, "-m", "venv", str(directory / "venv")], "create the venv")
    pip = [str(paths["python"]), "-m", "pip", "--disable-pip-version-check"]
    tensorflow = f"{tensorflow_distribution()}=={release.tensorflow}"
    _run([*pip, "install", "--no-input", tensorflow], f"install {tensorflow}")
    # The protos TF Serving parses its warmup file with; no dependencies (they
    # would pull another TensorFlow).
    _run(
        [*pip, "install", "--no-input", "--no-deps",
         f"tensorflow-serving-api=={release.version}"],
        f"install tensorflow-serving-api {release.version}",
    )  # fmt: skip
    wheels = {}
    for version in sorted({release.tensorflow_text, release.text_kernels}):
        wheels[version] = _unpack_text_ops(
            pip, version, directory / "text_ops" / version
        )
    freeze = _run([*pip, "freeze"], "list the venv").stdout.split()
    return {"pip_freeze": freeze, "tensorflow_text_wheels": wheels}


def _unpack_text_ops(pip: list, version: str, target: Path) -> str:
    """Download TensorFlow Text `version`'s wheel and unpack its op
    libraries (no Python) into `target`; returns the wheel's name."""
    with tempfile.TemporaryDirectory() as download:
        _run(
            [*pip, "download", "--no-input", "--no-deps", "--only-binary", ":all:",
             f"tensorflow-text=={version}", "-d", download],
            f"download tensorflow-text {version}",
        )  # fmt: skip
        (wheel,) = Path(download).glob("tensorflow_text-*.whl")
        target.mkdir(parents=True)
        with zipfile.ZipFile(wheel) as archive:
            for member in archive.namelist():
                if member.endswith(".so") and member.rsplit("/", 1)[0] in (
                    TEXT_OP_LIBRARY_DIRS
                ):
                    (target / Path(member).name).write_bytes(archive.read(member))
        if not any(target.glob("*.so")):
            raise RuntimeError(f"{wheel.name} holds no op libraries")
        return wheel.name


def _run(command: list, what: str) -> subprocess.CompletedProcess:
    result = subprocess.run(
        command, capture_output=True, text=True, errors="replace", timeout=3600
    )
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-15:])
        raise RuntimeError(
            f"Cannot {what}: `{' '.join(command)}` failed with exit status "
            f"{result.returncode}:\n{tail}"
        )
    return result


def ops_in_libraries(directory, op_names) -> set[str]:
    """The names among `op_names` found in the op libraries (`*.so`) of
    `directory`, read from their bytes without loading them.

    A library that registers an op holds its name as a NUL-terminated string
    constant (`REGISTER_OP("Name")`, a kernel template's `kOpName`, with
    TensorFlow Text's `TFText>` prefix where it has one), possibly as the tail
    of a longer string the linker merged it into. A name found is very likely
    registered by the library; a name not found is certainly not.
    """
    data = b"".join(
        library.read_bytes() for library in sorted(Path(directory).glob("*.so"))
    )
    return {name for name in op_names if name.encode() + b"\x00" in data}


def runtime_environment(runtime: ServingRuntime) -> dict:
    """Environment variables for a process run with `runtime.python`."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
    }
    env["KERAS_ATTN_TEXT_OPS_DIR"] = str(runtime.text_ops_dir)
    return env
