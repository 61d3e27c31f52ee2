"""Checks of the built sdist and wheel, run by `make check-package`:

    python tests/package/check_dist.py DIST_DIR

The wheel holds the package with `py.typed`, and LICENSE and NOTICE in its
metadata, and no tests, examples, benchmarks or test tooling
(`serving_standin`); its modules are those of keras_attn/ in the checkout
(none left over from an earlier build); its metadata asks for Keras
and NumPy only, Python >= 3.11, and offers the extras; the sdist holds
LICENSE, NOTICE and CHANGELOG.md. Not collected by pytest. Exits non-zero on
any failure.
"""

from __future__ import annotations

import email.parser
import re
import sys
import tarfile
import zipfile
from pathlib import Path

EXTRAS = {"text", "export", "visualize", "examples", "dev"}
REPO = Path(__file__).resolve().parents[2]


def check_wheel(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = email.parser.Parser().parsestr(archive.read(metadata_name).decode())
    assert "keras_attn/py.typed" in names, "no keras_attn/py.typed in the wheel"
    assert "keras_attn/_extras.py" in names and "keras_attn/layers/__init__.py" in names
    for notice in ("LICENSE", "NOTICE"):
        assert any(
            re.fullmatch(rf"[^/]+\.dist-info/(licenses/)?{notice}", n) for n in names
        ), f"no {notice} in the wheel's metadata"
    stray = sorted({n.split("/")[0] for n in names} - {"keras_attn"})
    stray = [n for n in stray if not n.endswith(".dist-info")]
    assert not stray, f"the wheel holds more than keras_attn: {stray}"
    modules = {n for n in names if n.endswith(".py")}
    source = {
        p.relative_to(REPO).as_posix() for p in (REPO / "keras_attn").rglob("*.py")
    }
    assert modules == source, (
        "the wheel's modules are not keras_attn/'s (a stale build/lib?): "
        f"{sorted(modules ^ source)}"
    )

    core = sorted(
        re.split(r"[ <>=!;\[(]", requirement, maxsplit=1)[0].lower()
        for requirement in metadata.get_all("Requires-Dist", [])
        if "extra ==" not in requirement
    )
    assert core == ["keras", "numpy"], f"core requirements: {core}"
    assert metadata["Requires-Python"] == ">=3.11", metadata["Requires-Python"]
    extras = set(metadata.get_all("Provides-Extra", []))
    assert extras == EXTRAS, f"extras: {sorted(extras)}"
    classifiers = metadata.get_all("Classifier", [])
    assert metadata["License-Expression"] == "Apache-2.0", metadata[
        "License-Expression"
    ]
    for classifier in (
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Typing :: Typed",
    ):
        assert classifier in classifiers, f"no classifier {classifier!r}"
    print(f"{wheel.name}: package, py.typed, LICENSE, NOTICE; requires {core}")


def check_sdist(sdist: Path) -> None:
    with tarfile.open(sdist) as archive:
        names = {Path(*Path(n).parts[1:]).as_posix() for n in archive.getnames()}
    for required in ("LICENSE", "NOTICE", "CHANGELOG.md", "keras_attn/py.typed"):
        assert required in names, f"no {required} in {sdist.name}"
    print(f"{sdist.name}: LICENSE, NOTICE, CHANGELOG.md, py.typed")


def main(dist_dir: str) -> int:
    dist = Path(dist_dir)
    wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, f"in {dist}: {wheels + sdists}"
    check_wheel(wheels[0])
    check_sdist(sdists[0])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
