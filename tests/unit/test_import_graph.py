"""The package's modules import one another without circles.

Every import statement of every module counts: at module level, inside functions (an import deferred to a
call still makes the two modules depend on each other, and only hides the circle until that call) and under
`if TYPE_CHECKING:`; and so does every `importlib.import_module(...)` / `import_module(...)` / `__import__(...)` call
whose module name is a string literal (a relative name resolved against its `package` argument: a literal,
`__name__` or `__package__`). `from pkg import name` depends on the submodule `pkg.name` when there is one, else on
`pkg` itself (its `__init__`). A module name computed at run time (cli.py's command table) cannot be seen.
"""

from __future__ import annotations

import ast
import os
from collections import defaultdict

from tests.support.paths import ROOT

PACKAGE_DIR = os.path.join(str(ROOT), "megatron_bfpp")


def _module_name(path: str, package_dir: str = PACKAGE_DIR) -> str:
    rel = os.path.relpath(path, os.path.dirname(package_dir))[: -len(".py")].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def package_modules(package_dir: str = PACKAGE_DIR) -> dict[str, str]:
    """Module name -> file, for every module of the package."""
    found = {}
    for folder, _, files in os.walk(package_dir):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                found[_module_name(path, package_dir)] = path
    return found


def _resolve(name: str, package: str | None) -> str | None:
    """importlib's resolution of a (possibly relative) module name against `package`."""
    level = len(name) - len(name.lstrip("."))
    if not level:
        return name
    if not package:
        return None  # importlib raises: nothing to depend on
    parts = package.split(".")
    if level > len(parts):
        return None
    return ".".join(parts[: len(parts) - level + 1] + ([name[level:]] if name[level:] else []))


def _dynamic_import(node: ast.Call, module: str, package: str) -> str | None:
    """The module an `importlib.import_module(NAME[, PACKAGE])`, `import_module(...)` or `__import__(NAME)` call
    imports, when NAME is a string literal."""
    func = node.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "importlib":
        called = func.attr
    elif isinstance(func, ast.Name):
        called = func.id
    else:
        return None
    if called not in ("import_module", "__import__") or not node.args:
        return None
    name = node.args[0]
    if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
        return None
    if called == "__import__":
        return name.value
    anchor = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "package"), None)
    if isinstance(anchor, ast.Constant) and isinstance(anchor.value, str):
        anchor_name: str | None = anchor.value
    elif isinstance(anchor, ast.Name) and anchor.id in ("__name__", "__package__"):
        anchor_name = module if anchor.id == "__name__" else package
    else:
        anchor_name = None
    return _resolve(name.value, anchor_name)


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
        elif isinstance(node, ast.Call):
            target = _dynamic_import(node, module, package)
            if target is None:
                continue
            targets = [target]
        else:
            continue
        for target in targets:
            if target in modules and target != module:
                found.setdefault(target, node.lineno)
    return found


def import_graph(package_dir: str = PACKAGE_DIR) -> dict[str, dict[str, int]]:
    modules = package_modules(package_dir)
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


def test_circles_are_found_through_import_module_calls(tmp_path):
    """A package on disk whose circles each close through a call: `importlib.import_module` with an absolute
    name inside a function, `import_module` (imported from importlib) with a relative name and `__package__`,
    and `__import__`; a name computed at run time and modules outside the package add nothing."""
    files = {
        "__init__.py": "",
        "a.py": "import importlib\n\ndef load():\n    return importlib.import_module('pkg.b')\n",
        "b.py": "from . import a\n",
        "c.py": "from importlib import import_module\n\nD = import_module('.d', __package__)\n",
        "d.py": "import pkg.c\n",
        "e.py": "def f():\n    return __import__('pkg.f')\n",
        "f.py": "import importlib\n\ndef g():\n    importlib.import_module('..e', package='pkg.sub')\n",
        "sub/__init__.py": "import importlib\n\nNAME = 'pkg.a'\nimportlib.import_module(NAME)\n"
                           "importlib.import_module('json')\nimportlib.import_module('.x', package='pkg.sub')\n",
    }
    for rel, text in files.items():
        path = tmp_path / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    graph = import_graph(str(tmp_path / "pkg"))
    assert graph["pkg.a"] == {"pkg.b": 4} and graph["pkg.c"] == {"pkg.d": 3}
    assert graph["pkg.e"] == {"pkg.f": 2} and graph["pkg.f"] == {"pkg.e": 4}
    assert graph["pkg.sub"] == {}
    assert import_circles(graph) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"], ["pkg.e", "pkg.f"]]


# ------------------------------------------------------------------------------------------------ the layers

# The package's layers and what each may import besides itself (README's layout section). Lowest first:
# schedules as data; the runtime (which drives the sharded wrapper), the simulator and the timelines over them;
# then what knows Megatron-LM (which also reads its flags into the simulator's inputs) and the standalone trainer;
# the device kit and the entry points on top. A command (`<layer>/cli.py`, the top-level `cli.py`) may import any
# layer.
LAYERS: dict[str, set[str]] = {
    "errors": set(),
    "schedule": set(),
    "sharded": set(),
    "runtime": {"schedule", "sharded"},
    "sim": {"schedule"},
    "trace": {"schedule", "sim"},
    "megatron": {"schedule", "sharded", "runtime", "sim", "trace"},
    "train": {"errors", "schedule", "sharded", "runtime", "sim", "trace", "megatron"},
    "run_megatron_script": {"megatron"},
    "devkit": {"megatron_bfpp", "schedule", "sim", "train", "run_megatron_script"},
    "megatron_bfpp": set(),  # the package's __init__: its version only
}
# Third-party imports a layer must not make: schedules are plain Python (no torch), and nothing below
# `megatron/` and `train/` reads Megatron-LM's training globals (megatron.training).
FORBIDDEN = {
    "schedule": ("torch", "megatron", "numpy"),
    "sharded": ("megatron.training",),
    "runtime": ("megatron.training",),
    "sim": ("torch", "megatron"),
    "trace": ("megatron.training",),
}


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def is_command(module: str) -> bool:
    return module == "megatron_bfpp.cli" or module.endswith(".cli")


def layer_violations(graph: dict[str, dict[str, int]]) -> list[str]:
    out = []
    for module, deps in sorted(graph.items()):
        if is_command(module):
            continue
        mine = layer_of(module)
        allowed = LAYERS.get(mine)
        if allowed is None:
            out.append(f"{module}: layer {mine!r} is not in LAYERS (add it, with what it may import)")
            continue
        out += [f"{module} (line {line}) imports {dep}: layer {mine} may import {sorted(allowed) or 'nothing'}"
                for dep, line in sorted(deps.items()) if layer_of(dep) != mine and layer_of(dep) not in allowed]
    return out


def third_party_violations(modules: dict[str, str]) -> list[str]:
    out = []
    for module, path in sorted(modules.items()):
        banned = FORBIDDEN.get(layer_of(module))
        if not banned or is_command(module):
            continue
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            out += [f"{module} (line {node.lineno}) imports {n}" for n in names
                    if any(n == b or n.startswith(b + ".") for b in banned)]
    return out


def test_package_respects_its_layers():
    graph = import_graph()
    assert {layer_of(m) for m in graph} <= set(LAYERS) | {"cli"}, sorted({layer_of(m) for m in graph} - set(LAYERS))
    violations = layer_violations(graph) + third_party_violations(package_modules())
    assert not violations, "imports across the layers (tests/unit/test_import_graph.py LAYERS):\n" + "\n".join(violations)


def test_layer_violations_are_found():
    graph = {"megatron_bfpp.schedule.ir": {"megatron_bfpp.runtime.p2p": 3},
             "megatron_bfpp.sim.cli": {"megatron_bfpp.trace.chrome": 1},
             "megatron_bfpp.runtime.p2p": {"megatron_bfpp.schedule.ir": 1, "megatron_bfpp.megatron.install": 9},
             "megatron_bfpp.newlayer.x": {}}
    assert layer_violations(graph) == [
        "megatron_bfpp.newlayer.x: layer 'newlayer' is not in LAYERS (add it, with what it may import)",
        "megatron_bfpp.runtime.p2p (line 9) imports megatron_bfpp.megatron.install: layer runtime may import "
        "['schedule', 'sharded']",
        "megatron_bfpp.schedule.ir (line 3) imports megatron_bfpp.runtime.p2p: layer schedule may import nothing",
    ]


def test_third_party_violations_are_found(tmp_path):
    pkg = tmp_path / "megatron_bfpp"
    (pkg / "schedule").mkdir(parents=True)
    (pkg / "runtime").mkdir()
    (pkg / "schedule" / "ir.py").write_text("import torch.distributed\n")
    (pkg / "runtime" / "p2p.py").write_text("def f():\n    from megatron.training.global_vars import get_args\n")
    (pkg / "runtime" / "ok.py").write_text("import torch\nfrom megatron.core import parallel_state\n")
    found = third_party_violations(package_modules(str(pkg)))
    assert found == ["megatron_bfpp.runtime.p2p (line 2) imports megatron.training.global_vars",
                     "megatron_bfpp.schedule.ir (line 1) imports torch.distributed"]
