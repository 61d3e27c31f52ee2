"""The package's import graph: rooms talk downward, never in a cycle, and
nothing in the package imports the example scripts or the tooling of the
tests and benchmarks (`serving_standin`, not installed)."""

import ast
import subprocess
import sys
from pathlib import Path

from tests.test_case import REPO_ROOT

PACKAGE = Path(REPO_ROOT) / "keras_attn"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(path: Path, modules: dict) -> set[str]:
    """Every module `path` imports, at its top level or inside a function,
    resolved to a module of the package where it names one (`from
    keras_attn.memory import search` is `keras_attn.memory.search`)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")
                parent = parent[: len(parent) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in modules else base)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    graph = {}
    for name, path in modules.items():
        # A module imports its parent packages first; that edge is Python's,
        # not the module's own dependency.
        parents = {name.rsplit(".", n)[0] for n in range(1, name.count(".") + 1)}
        graph[name] = {
            target
            for target in imported_modules(path, modules)
            if target in modules and target != name and target not in parents
        }
    return graph


def cycles(graph) -> list[list[str]]:
    """The strongly connected components with more than one module."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_no_import_cycle_in_the_package():
    graph = import_graph()
    assert "keras_attn.models.translator" in graph  # the walk found the package
    assert cycles(graph) == []


def test_the_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_package_module_imports_the_examples():
    modules = package_modules()
    for name, path in modules.items():
        imports = imported_modules(path, modules)
        scripts = {"_cli", "_options", "examples", "translate", "sentiment"}
        scripts |= {"serving_standin", "benchmarks", "tests"}  # tooling, not installed
        assert not {i.split(".")[0] for i in imports} & scripts, name


def test_rooms_talk_downward():
    """ops <- layers <- generation/models <- memory/export: the lower rooms
    import none above them (the models' `export` methods import the export
    module when called), and nothing below the scripts imports training."""
    graph = import_graph()
    above = {
        "keras_attn.ops": ("layers", "generation", "models", "memory", "export"),
        "keras_attn.layers": ("generation", "models", "memory", "export"),
        "keras_attn.generation": ("models", "memory", "export"),
        "keras_attn.models": ("memory", "training", "datasets"),
        "keras_attn.memory": ("models", "export", "training"),
    }
    for name, targets in graph.items():
        for room, rooms in above.items():
            if name.startswith(room):
                higher = tuple(f"keras_attn.{r}" for r in rooms)
                assert not {t for t in targets if t.startswith(higher)}, name


def test_every_module_imports_in_a_fresh_process():
    names = sorted(package_modules())
    code = (
        "import importlib, sys\nfor name in sys.argv[1:]: importlib.import_module(name)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, *names],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
