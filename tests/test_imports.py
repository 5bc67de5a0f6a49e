"""The package's import graph has no cycle, so its modules can be read in the order of the data
flow (counting imports under TYPE_CHECKING and inside functions too: a cycle there is still a
knot for a reader). The reference is a plain depth-first search over the graph read with ast."""

from __future__ import annotations

import ast
from pathlib import Path

import batchpage

# batchpage/kernels and batchpage/conf are links to the top-level folders (see pyproject.toml).
ROOTS = {
    "batchpage": Path(batchpage.__file__).resolve().parent,
    "batchpage.kernels": Path(batchpage.__file__).resolve().parent.parent / "kernels",
}


def module_name(root: str, path: Path) -> str:
    parts = (root, *path.relative_to(ROOTS[root]).with_suffix("").parts)
    return ".".join(parts).removesuffix(".__init__")


def import_graph() -> dict[str, set[str]]:
    files = {
        module_name(r, f): f
        for r, folder in ROOTS.items()
        for f in folder.rglob("*.py")
        if r != "batchpage" or f.relative_to(folder).parts[0] not in ("kernels", "conf")
    }
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            graph[mod] |= {n for n in names if n in files and n != mod}
    # Importing a submodule runs its package's __init__ first (a namespace package has none).
    for mod in list(graph):
        for dep in list(graph[mod]):
            parent = dep.rpartition(".")[0]
            while parent and parent not in (mod, "batchpage") and not mod.startswith(parent + "."):
                if parent in files:
                    graph[mod].add(parent)
                parent = parent.rpartition(".")[0]
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state and (found := visit(dep)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph()
    assert "batchpage.engine.engine" in graph and graph["batchpage.engine.engine"]
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])
