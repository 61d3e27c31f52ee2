"""`pip_download` where pip cannot be imported (a uv virtual environment):
the pinned file comes from the configured index's simple API, served here by
a local `http.server` (no network)."""

import contextlib
import hashlib
import http.server
import importlib.abc
import json
import sys
import threading
import zipfile
from pathlib import Path

import pytest

from keras_attn import _package_index, downloads
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


@pytest.fixture
def clean_index_settings(monkeypatch, tmp_path):
    """No index setting of this machine leaks into a test."""
    for name in (
        "PIP_INDEX_URL",
        "PIP_EXTRA_INDEX_URL",
        "UV_DEFAULT_INDEX",
        "UV_INDEX_URL",
        "UV_INDEX",
        "UV_EXTRA_INDEX_URL",
        "PIP_CERT",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "no-config"))
    monkeypatch.setenv("XDG_CONFIG_DIRS", str(tmp_path / "no-config"))
    monkeypatch.setattr(_package_index, "_uv_default_index", lambda: None)


def build_wheel(path: Path) -> bytes:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("fake_pkg/__init__.py", "VALUE = 1\n")
        archive.writestr("fake_pkg-1.0.dist-info/METADATA", "Name: fake-pkg\n")
    return path.read_bytes()


class IndexHandler(http.server.SimpleHTTPRequestHandler):
    """Serves the directory; `/json/<project>/` answers PEP 691 JSON; records
    each request's path and Authorization header."""

    requests: list  # set per server

    def do_GET(self):
        self.requests.append((self.path, self.headers.get("Authorization")))
        if self.path.startswith("/json/fake-pkg/"):
            body = json.dumps(
                {
                    "meta": {"api-version": "1.0"},
                    "name": "fake-pkg",
                    "files": [{"filename": FILENAME, "url": f"/files/{FILENAME}"}],
                }
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/vnd.pypi.simple.v1+json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        super().do_GET()

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def local_index(root: Path):
    """A PEP 503 index under `root` served on localhost: `/simple/fake-pkg/`
    lists the wheel at `/files/`; yields (base URL, requests, wheel bytes)."""
    (root / "files").mkdir(parents=True)
    wheel = build_wheel(root / "files" / FILENAME)
    digest = hashlib.sha256(wheel).hexdigest()
    page = root / "simple" / "fake-pkg"
    page.mkdir(parents=True)
    (page / "index.html").write_text(
        "<!DOCTYPE html><html><body>\n"
        f'<a href="../../files/fake_pkg-0.9.tar.gz#sha256={"0" * 64}">'
        "fake_pkg-0.9.tar.gz</a>\n"
        f'<a href="../../files/{FILENAME}#sha256={digest}">{FILENAME}</a>\n'
        "</body></html>\n"
    )
    requests = []
    handler = type("Handler", (IndexHandler,), {"requests": requests})

    def make(*args, **kwargs):
        return handler(*args, directory=str(root), **kwargs)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), make)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requests, wheel
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.usefixtures("without_pip", "clean_index_settings")
def test_fetches_from_the_pip_index_url_without_pip(monkeypatch, tmp_path, capsys):
    with local_index(tmp_path / "index") as (base, requests, wheel):
        monkeypatch.setenv("PIP_INDEX_URL", f"{base}/simple/")
        work_dir = tmp_path / "work"
        work_dir.mkdir()
        path = pip_download(
            "Fake_Pkg==1.0",
            FILENAME,
            hashlib.sha256(wheel).hexdigest(),
            work_dir,
            hint="HINT",
        )
    assert path == work_dir / FILENAME
    assert path.read_bytes() == wheel
    # The project page under its normalized name, then the file.
    assert [p for p, _ in requests] == ["/simple/fake-pkg/", f"/files/{FILENAME}"]
    assert f"from {base}/files/{FILENAME}" in capsys.readouterr().err


@pytest.mark.usefixtures("without_pip", "clean_index_settings")
def test_json_index_credentials_and_extra_index(monkeypatch, tmp_path, capsys):
    """The primary index lacks the project (404); the extra one, given with
    credentials in the uv variable, answers JSON and gets basic auth."""
    with local_index(tmp_path / "index") as (base, requests, wheel):
        credentialed = base.replace("http://", "http://me:s3cret@")
        monkeypatch.setenv("UV_DEFAULT_INDEX", f"{base}/missing/")
        monkeypatch.setenv("UV_INDEX", f"mine={credentialed}/json/")
        path = pip_download(
            "fake-pkg==1.0",
            FILENAME,
            hashlib.sha256(wheel).hexdigest(),
            tmp_path,
            hint="HINT",
        )
    assert path.read_bytes() == wheel
    assert [p for p, _ in requests] == [
        "/missing/fake-pkg/",
        "/json/fake-pkg/",
        f"/files/{FILENAME}",
    ]
    assert requests[0][1] is None
    # base64 of me:s3cret, for the page and for the file on the same host
    assert requests[1][1] == requests[2][1] == "Basic bWU6czNjcmV0"
    err = capsys.readouterr().err
    assert "s3cret" not in err and "me:***@127.0.0.1" in err


@pytest.mark.usefixtures("without_pip", "clean_index_settings")
def test_a_wrong_file_is_refused(monkeypatch, tmp_path):
    with local_index(tmp_path / "index") as (base, _, _):
        monkeypatch.setenv("PIP_INDEX_URL", f"{base}/simple/")
        with pytest.raises(DatasetUnavailableError, match=r"expected sha256 0+\. HINT"):
            pip_download("fake-pkg==1.0", FILENAME, "0" * 64, tmp_path, hint="HINT")


@pytest.mark.usefixtures("without_pip", "clean_index_settings")
def test_a_file_no_index_has_says_what_to_do(monkeypatch, tmp_path):
    with local_index(tmp_path / "index") as (base, _, _):
        monkeypatch.setenv("PIP_INDEX_URL", f"{base}/simple/")
        with pytest.raises(DatasetUnavailableError) as raised:
            pip_download(
                "fake-pkg==2.0",
                "fake_pkg-2.0-py3-none-any.whl",
                "0" * 64,
                tmp_path,
                hint="HINT",
                verbose=False,
            )
    message = str(raised.value)
    assert "pip is not installed" in message
    assert f"{base}/simple/: does not list fake_pkg-2.0-py3-none-any.whl" in message
    assert "PIP_INDEX_URL" in message and "uv pip install pip" in message
    assert message.endswith("HINT")
    assert not (tmp_path / "fake_pkg-2.0-py3-none-any.whl").exists()


@pytest.mark.usefixtures("clean_index_settings")
def test_index_settings_order(monkeypatch, tmp_path):
    config = tmp_path / "pip.conf"
    config.write_text(
        "[global]\nindex-url = https://global.example/simple\n"
        "extra-index-url = https://extra-a.example/simple "
        "https://extra-b.example/simple\n"
        "[download]\nindex-url = https://download.example/simple\n"
    )
    monkeypatch.setenv("PIP_CONFIG_FILE", str(config))
    assert _package_index.configured_indexes() == [
        "https://download.example/simple",  # [download] overrides [global]
        "https://extra-a.example/simple",
        "https://extra-b.example/simple",
    ]
    monkeypatch.setenv("UV_INDEX_URL", "https://uv.example/simple")
    assert _package_index.configured_indexes()[0] == "https://uv.example/simple"
    monkeypatch.setenv("PIP_INDEX_URL", "https://pip.example/simple")
    assert _package_index.configured_indexes()[0] == "https://pip.example/simple"
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.delenv("PIP_INDEX_URL")
    monkeypatch.delenv("UV_INDEX_URL")
    assert _package_index.configured_indexes() == [_package_index.PYPI_SIMPLE]


def test_uv_toml_default_index(monkeypatch, tmp_path):
    (tmp_path / "uv").mkdir()
    (tmp_path / "uv" / "uv.toml").write_text(
        '[[index]]\nname = "other"\nurl = "https://other.example/simple"\n\n'
        '[[index]]\nname = "corp"\nurl = "https://corp.example/simple"\n'
        "default = true\n"
    )
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert _package_index._uv_default_index() == "https://corp.example/simple"


def test_with_pip_the_download_is_pips(monkeypatch, tmp_path):
    """Where pip is importable, pip downloads (with its own index settings)."""
    commands = []

    def fake_pip(command, *, cwd, what, hint, timeout=900):
        commands.append([str(part) for part in command])
        Path(cwd, FILENAME).write_bytes(b"wheel")

    monkeypatch.setattr(downloads, "pip_importable", lambda: True)
    monkeypatch.setattr(downloads, "run_command", fake_pip)
    pip_download(
        "fake-pkg==1.0",
        FILENAME,
        hashlib.sha256(b"wheel").hexdigest(),
        tmp_path,
        hint="HINT",
    )
    assert commands[0][1:4] == ["-m", "pip", "download"]


def test_an_unpinned_package_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"Received: package='fake-pkg>=1'"):
        pip_download("fake-pkg>=1", FILENAME, "0" * 64, tmp_path, hint="HINT")
