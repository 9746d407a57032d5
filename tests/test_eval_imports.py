"""The modules of ``kvpolicy.eval`` import each other without circles.

Every import statement counts, wherever it stands: at the top, inside a function (a "late"
import that only hides a circle from the interpreter) or under ``TYPE_CHECKING``. An import of a
module inside a package is an edge to that module, not to the packages above it (Python runs
their ``__init__`` first, but a package importing its own submodules is not a circle).
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvpolicy.eval

EVAL = "kvpolicy.eval"


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package under ``root``: dotted name -> file (``__init__.py`` for a package)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([package, *parts])] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules among ``known`` that module ``name`` (file ``path``) imports, anywhere in it."""
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rpartition(".")[0]
    found = set()

    def add(target: str) -> None:
        # The module itself, else the nearest enclosing module (``from .x import Name``).
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                add(submodule if submodule in known else base)
    return found


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    modules = module_names(root, package)
    return {name: imports_of(name, path, set(modules)) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a self-import), sorted:
    each module of one reaches every other through imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def _circle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A path ``a -> b -> ... -> a`` through the component, for the failure message."""
    members, start = set(component), component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth-first: the shortest way back to the start
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    return [*paths[v], start]
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no circle through {component}")


def test_eval_modules_import_each_other_without_circles():
    root = Path(kvpolicy.eval.__file__).parent
    graph = import_graph(root, EVAL)
    # The walk sees the package (a vacuous graph would pass): the runner writes the report, and
    # the command line reads its configuration through a function-level import.
    assert f"{EVAL}.report" in graph[f"{EVAL}.runner"]
    assert f"{EVAL}.config" in graph[f"{EVAL}.cli"]
    found = cycles(graph)
    assert not found, "import circles in kvpolicy.eval:\n" + "\n".join(
        f"{' -> '.join(_circle(graph, c))} (all of: {', '.join(c)})" for c in found)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_the_walk_finds_late_type_checking_and_relative_circles(tmp_path):
    _write(tmp_path, {
        "__init__.py": "from .runner import run\n",
        "runner.py": "def run():\n    from .report import table  # late import\n",
        "report.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .runner import run\n",
        "metrics/__init__.py": "from .base import Metric\nfrom .lm import LM\n",
        "metrics/base.py": "from ..decoding import Stream\n",
        "metrics/lm.py": "from .base import Metric\n\ndef model():\n    from ..lmeval import LM\n",
        "decoding.py": "import torch\n",
        "lmeval/__init__.py": "from . import model\nfrom .model import LM\n",
        "lmeval/model.py": "from ..decoding import Stream\nfrom ..metrics.base import Metric\n",
    })
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.lmeval"] == {"pkg.lmeval.model"}  # ``from . import model`` is the submodule
    assert graph["pkg.metrics.lm"] == {"pkg.metrics.base", "pkg.lmeval"}
    assert cycles(graph) == [["pkg.report", "pkg.runner"]]
    assert _circle(graph, ["pkg.report", "pkg.runner"]) == ["pkg.report", "pkg.runner", "pkg.report"]
    # A module that imports a sibling package's module does not import the package's __init__:
    # lmeval.model -> metrics.base is no circle with metrics -> metrics.lm -> lmeval.
    _write(tmp_path, {"lmeval/model.py": "from ..metrics import LM\n"})
    circles = {frozenset(c) for c in cycles(import_graph(tmp_path, "pkg"))}
    assert circles == {frozenset({"pkg.report", "pkg.runner"}),
                       frozenset({"pkg.lmeval", "pkg.lmeval.model", "pkg.metrics", "pkg.metrics.lm"})}
