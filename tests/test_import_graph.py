"""No import cycle anywhere in prefixrun: the graph of the import statements in cli/, engine/ and kernels/ is acyclic.

Counted, each edge marked with where it runs:
- module-level imports (run when the module is first imported; those under `if` / `try` and in class bodies too);
- function-level imports (run on a call). They keep start-up fast where a module defers CuPy, torch or a rarely
  used sibling, and that is legitimate, but one that closes a loop is still a cycle: the two modules can then be
  neither read, tested nor moved apart, and the import works only because of the order things are called in.
Both graphs must be acyclic: the module-level one alone (any cycle there is an import-order bug waiting to
happen), and module-level plus function-level together.
Not counted: imports under `if TYPE_CHECKING:` (never run; they only name types).
Importing `a.b.c` also runs the `__init__` of the package `a.b`, so that is an edge too, except from a module
inside `a.b` (its package is already being imported when it runs).
"""
from __future__ import annotations

import ast
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "prefixrun"
TOP_FOLDERS = ("cli", "engine", "kernels")


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    in_function: bool


def package_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the installed `prefixrun` namespace."""
    modules = {}
    for top in TOP_FOLDERS:
        for path in sorted((root / top).rglob("*.py")):
            parts = [PACKAGE, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules) -> list[str]:
    """The package modules an import statement loads (the deepest module each name resolves to)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in modules]
    base = node.module or ""
    if node.level:  # relative: from the importer's package, one level up per extra dot
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[:len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    found = []
    for alias in node.names:
        if f"{base}.{alias.name}" in modules:  # `from package import submodule`
            found.append(f"{base}.{alias.name}")
        elif base in modules:
            found.append(base)
    return found


def import_edges(modules: dict[str, Path]) -> list[Edge]:
    edges = []
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        own_packages = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1 + is_package)}

        def visit(node, in_function: bool):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and _is_type_checking(child.test):
                    for other in child.orelse:
                        visit(other, in_function)
                    continue
                deferred = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for target in _imported(child, module, is_package, modules):
                        parts = target.split(".")
                        for depth in range(2, len(parts) + 1):  # the packages on the way run their __init__
                            name = ".".join(parts[:depth])
                            if name in modules and name not in own_packages and name != module:
                                edges.append(Edge(module, name, child.lineno, deferred))
                visit(child, deferred)

        visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), False)
    return edges


def find_cycles(edges: list[Edge]) -> list[list[Edge]]:
    """One cycle (as its edges) per strongly connected component that has one (Tarjan, iterative)."""
    graph: dict[str, list[Edge]] = {}
    for e in edges:
        graph.setdefault(e.source, []).append(e)
        graph.setdefault(e.target, [])
    index, low, stack, on_stack, components = {}, {}, [], set(), []
    for start in graph:
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            out = graph[node]
            if i < len(out):
                work.append((node, i + 1))
                nxt = out[i].target
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                components.append(component)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    cycles = []
    for component in components:
        if len(component) == 1 and not any(e.target in component for e in graph[next(iter(component))]):
            continue
        cycles.append(_one_cycle(graph, component))
    return cycles


def _one_cycle(graph: dict[str, list[Edge]], component: set[str]) -> list[Edge]:
    """A shortest cycle through the component's first module (breadth-first inside the component)."""
    start = min(component)
    came_by: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for e in graph[node]:
                if e.target == start:
                    path = [e]
                    while path[0].source != start:
                        path.insert(0, came_by[path[0].source])
                    return path
                if e.target in component and e.target not in came_by:
                    came_by[e.target] = e
                    following.append(e.target)
        frontier = following
    raise AssertionError(f"no cycle through {start}")


def _describe(cycle: list[Edge], modules: dict[str, Path]) -> str:
    steps = [f"{modules[e.source].relative_to(ROOT)}:{e.line} imports {e.target}"
             f"{' (in a function)' if e.in_function else ''}" for e in cycle]
    return " -> ".join(steps)


MODULES = package_modules()
EDGES = import_edges(MODULES)
# Cycles being taken apart (each names its owner); an entry goes once its cycle does (a broken one warns).
KNOWN_CYCLES: dict[frozenset[str], str] = {}


def _component(cycle: list[Edge], edges: list[Edge]) -> frozenset[str]:
    """Every module on some cycle with `cycle`'s first module (the strongly connected component)."""
    start = cycle[0].source
    forward, backward = {start}, {start}
    for reach, key, other in ((forward, "source", "target"), (backward, "target", "source")):
        grew = True
        while grew:
            grew = False
            for e in edges:
                if getattr(e, key) in reach and getattr(e, other) not in reach:
                    reach.add(getattr(e, other))
                    grew = True
    return frozenset(forward & backward)


@pytest.mark.parametrize("with_function_level", [False, True], ids=["module-level", "module+function-level"])
def test_no_import_cycle(with_function_level):
    edges = [e for e in EDGES if with_function_level or not e.in_function]
    cycles = [c for c in find_cycles(edges) if _component(c, edges) not in KNOWN_CYCLES]
    assert not cycles, "import cycles:\n" + "\n".join(_describe(c, MODULES) for c in cycles)


def test_known_cycles_are_still_cycles():
    components = {_component(c, EDGES) for c in find_cycles(EDGES)}
    gone = [sorted(known) for known in KNOWN_CYCLES if known not in components]
    if gone:  # not a failure: breaking a cycle should not turn the suite red; the list is pruned as fixes land
        warnings.warn(f"no longer a cycle: remove from KNOWN_CYCLES: {gone}", stacklevel=1)


def test_the_graph_sees_every_kind_of_import():
    # the builder must find the imports it claims to count, or the cycle test above could pass on an empty graph
    found = {(e.source, e.target): e.in_function for e in EDGES}
    assert found[("prefixrun.kernels", "prefixrun.kernels.reference")] is True  # get_ops defers the backends
    assert found[("prefixrun.engine.models", "prefixrun.engine.load.config")] is False
    assert found[("prefixrun.engine.load.config", "prefixrun.engine.load.rope")] is False
    assert ("prefixrun.engine.load.hf_config", "prefixrun.engine.load") not in found  # its own package
    assert len(MODULES) > 60 and len(EDGES) > 150


def test_cycle_finder_reports_module_and_function_level_cycles(tmp_path):
    # a tiny tree: pkg.a -> pkg.b at module level, pkg.b -> pkg.a inside a function; pkg.c -> pkg.d alone;
    # pkg.sub.e imports pkg.sub's __init__, which imports pkg.c (no cycle); pkg.f imports itself through its package
    engine = tmp_path / "engine"
    (engine / "sub").mkdir(parents=True)
    files = {"__init__.py": "", "a.py": "from prefixrun.engine import b\n",
             "b.py": "def f():\n    from prefixrun.engine.a import x\n", "c.py": "import prefixrun.engine.d\n",
             "d.py": "", "sub/__init__.py": "from .. import c\n", "sub/e.py": "from . import c\n",
             "f.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from prefixrun.engine.c import x\n"}
    for name, text in files.items():
        (engine / name).write_text(text)
    edges = import_edges(package_modules(tmp_path))
    assert {(e.source.rsplit(".", 1)[-1], e.target.rsplit(".", 1)[-1], e.in_function) for e in edges} == {
        ("a", "b", False), ("b", "a", True), ("c", "d", False), ("sub", "c", False)}
    assert find_cycles([e for e in edges if not e.in_function]) == []
    (cycle,) = find_cycles(edges)
    assert {e.source for e in cycle} == {"prefixrun.engine.a", "prefixrun.engine.b"}


# (importer, the module it imports from, the private name) -> owner; shrinks to nothing
PRIVATE_IMPORTS_LEFT: dict[tuple[str, str, str], str] = {}


def private_imports(modules: dict[str, Path]) -> set[tuple[str, str, str]]:
    """(importer, module, name) for every `from <package module> import _name`: a name another module keeps to
    itself. A module that needs it needs it public (or the code belongs with it)."""
    found = set()
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(PACKAGE):
                found |= {(module, node.module, a.name) for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")}
    return found


def test_modules_import_public_names_only():
    found = private_imports(MODULES)
    assert not found - set(PRIVATE_IMPORTS_LEFT), sorted(found - set(PRIVATE_IMPORTS_LEFT))
    fixed = set(PRIVATE_IMPORTS_LEFT) - found
    if fixed:
        warnings.warn(f"no longer imported: remove from PRIVATE_IMPORTS_LEFT: {sorted(fixed)}", stacklevel=1)


def test_imports_go_down_from_the_command_line_to_the_kernels():
    # cli/ may use engine/ and kernels/, engine/ may use kernels/; kernels/ knows neither, engine/ not the cli
    rank = {"cli": 0, "engine": 1, "kernels": 2}
    upward = [f"{MODULES[e.source].relative_to(ROOT)}:{e.line} imports {e.target}" for e in EDGES
              if rank[e.target.split(".")[1]] < rank[e.source.split(".")[1]]]
    assert not upward, upward
