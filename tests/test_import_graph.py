"""The package's modules import one another without circles.

Every import statement of every module counts: at module level, inside functions (an import deferred to a
call still makes the two modules depend on each other, and only hides the circle until that call) and under
`if TYPE_CHECKING:`. `from pkg import name` depends on the submodule `pkg.name` when there is one, else on
`pkg` itself (its `__init__`).
"""

from __future__ import annotations

import ast
import os
from collections import defaultdict

PACKAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron_bfpp")


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(PACKAGE_DIR))[: -len(".py")].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def package_modules() -> dict[str, str]:
    """Module name -> file, for every module of the package."""
    found = {}
    for folder, _, files in os.walk(PACKAGE_DIR):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                found[_module_name(path)] = path
    return found


def imports_of(module: str, source: str, modules: dict[str, str]) -> dict[str, int]:
    """The package modules `module` imports (anywhere in its source), each with the line of one import."""
    package = module if modules[module].endswith("__init__.py") else module.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            if target in modules and target != module:
                found.setdefault(target, node.lineno)
    return found


def import_graph() -> dict[str, dict[str, int]]:
    modules = package_modules()
    graph = {}
    for name, path in modules.items():
        with open(path) as f:
            graph[name] = imports_of(name, f.read(), modules)
    return graph


def import_circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def _describe(graph: dict[str, dict[str, int]], circle: list[str]) -> str:
    edges = [f"  {a} (line {line}) imports {b}" for a in circle for b, line in sorted(graph[a].items()) if b in circle]
    return " <-> ".join(circle) + "\n" + "\n".join(edges)


def test_package_imports_have_no_circles():
    graph = import_graph()
    assert len(graph) > 40 and sum(map(len, graph.values())) > 60  # the scan read the package's imports
    circles = import_circles(graph)
    assert not circles, "import circles (pass the state, or move the shared names down):\n" + "\n".join(
        _describe(graph, c) for c in circles)


def test_circles_are_found_through_function_level_and_type_checking_imports():
    modules = {"p": "p/__init__.py", "p.a": "p/a.py", "p.b": "p/b.py", "p.c": "p/c.py", "p.d": "p/d.py"}
    sources = {
        "p": "",
        "p.a": "from .b import x\n",
        "p.b": "def f():\n    from . import a\n",  # a circle p.a <-> p.b, one side inside a function
        "p.c": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.d import D\n",
        "p.d": "import p.c\n",  # a circle p.c <-> p.d, one side for type hints only
    }
    graph = {m: imports_of(m, s, modules) for m, s in sources.items()}
    assert graph["p.b"] == {"p.a": 2} and graph["p.c"] == {"p.d": 3}
    assert import_circles(graph) == [["p.a", "p.b"], ["p.c", "p.d"]]
    assert import_circles({"p.a": {"p.b": 1}, "p.b": {}, "p.c": {"p.a": 1}}) == []
