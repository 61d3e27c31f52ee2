"""Every Python code block in README.md and docs/ runs.

A page's ```python blocks run in order in one namespace (as a reader runs
them one after another), in a temporary working directory, on the backend of
the test run. The info string says how a block runs:

- ```python            runs in the default test run;
- ```python slow       trains or exports for tens of seconds: runs with the
                        slow tests (`make test-slow`);
- ```python large      needs downloads or long training: runs with `-m large`;
- ```python tf_only    needs TensorFlow (tf.data, SavedModel): TensorFlow run only.

Blocks of other languages (```bash, ```text, ```json) are not executed;
commands and outputs go there. Pages under docs/experiments/ record history
and are not executed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```python([^\n]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
KNOWN_FLAGS = {"large", "slow", "tf_only"}


def doc_pages() -> list[Path]:
    pages = [REPO_ROOT / "README.md"]
    pages += sorted(
        page
        for page in (REPO_ROOT / "docs").rglob("*.md")
        if "experiments" not in page.relative_to(REPO_ROOT / "docs").parts
    )
    return [page for page in pages if page.exists()]


def python_blocks(page: Path) -> list[tuple[int, set[str], str]]:
    """`(line, flags, source)` of each ```python block of `page`."""
    text = page.read_text(encoding="utf-8")
    blocks = []
    for match in FENCE.finditer(text):
        flags = set(match.group(1).split())
        unknown = flags - KNOWN_FLAGS
        if unknown:
            raise ValueError(
                f"{page.name}: unknown code block flags {sorted(unknown)}; "
                f"use {sorted(KNOWN_FLAGS)}"
            )
        line = text.count("\n", 0, match.start()) + 1
        blocks.append((line, flags, match.group(2)))
    return blocks


def _page_params():
    """Per page: one test for its default blocks, one `slow` test when it has
    blocks flagged `slow` (the page's blocks but its `large` ones, in order),
    one `large` test when it has large blocks (the whole page, in order)."""
    params = []
    for page in doc_pages():
        blocks = python_blocks(page)
        flags = set().union(set(), *(block[1] for block in blocks))
        name = str(page.relative_to(REPO_ROOT))
        tf_mark = [pytest.mark.tf_only] if "tf_only" in flags else []
        if any(not block[1] & {"slow", "large"} for block in blocks):
            params.append(pytest.param(page, set(), marks=tf_mark, id=name))
        if "slow" in flags:
            params.append(
                pytest.param(
                    page,
                    {"slow"},
                    marks=[pytest.mark.slow, *tf_mark],
                    id=name + "-slow",
                )
            )
        if "large" in flags:
            params.append(
                pytest.param(
                    page,
                    {"slow", "large"},
                    marks=[pytest.mark.large, *tf_mark],
                    id=name + "-large",
                )
            )
    return params


@pytest.mark.parametrize(("page", "runs"), _page_params())
def test_code_blocks_run(page, runs, tmp_path, monkeypatch):
    """Runs the page's blocks in order, those flagged `slow` or `large` only
    in the test of that flag. A block that needs a slow one is flagged slow
    itself."""
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__docs__"}
    for line, flags, source in python_blocks(page):
        if flags & {"slow", "large"} - runs:
            continue
        code = compile(source, f"{page.name}:{line}", "exec")
        try:
            exec(code, namespace)
        except Exception as error:
            raise AssertionError(
                f"{page.relative_to(REPO_ROOT)}, the block at line {line} "
                f"failed: {type(error).__name__}: {error}"
            ) from error


def test_block_flags_are_known():
    for page in doc_pages():
        python_blocks(page)  # raises on an unknown flag
