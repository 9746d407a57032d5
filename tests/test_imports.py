"""The modules of ``kvpolicy`` import each other without circles, and the stages are the ground floor.

Every import statement counts, wherever it stands: at the top, inside a function (a "late" import
that only hides a circle from the interpreter) or under ``TYPE_CHECKING``. Relative imports are
resolved, and ``from . import x`` is an edge to the module ``x`` when there is one. An import of a
module inside a package is an edge to that module, not to the packages above it (Python runs
their ``__init__`` first, but a package importing its own submodules is not a circle).
``tests/test_eval_imports.py`` checks ``kvpolicy.eval`` alone the same way; this covers the whole
package.

The layers (see docs/design.md, "The shape of the house"): the primitives (``PRIMITIVES``) import
no other kvpolicy module but each other; ``kvpolicy.stages.*`` imports only ``kvpolicy.stages.*``
and the primitives; everything else (the registry, policy files, ``Policy``, caches,
integrations, the command line) stands above them.
"""

from __future__ import annotations

import ast
import importlib
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

import kvpolicy

PACKAGE = "kvpolicy"
STAGES = "kvpolicy.stages"
#: The modules under the stages: no kvpolicy imports but each other's. A stage file needs
#: ``stages/base.py``, torch, pydantic and these.
PRIMITIVES = frozenset({
    "kvpolicy.seeds",  # counter-based random draws (EvictionInput's streams)
    "kvpolicy.schedule",  # the schedule stages validate against
    "kvpolicy.documents",  # YAML under the rules of policy files, PolicyError
    "kvpolicy.profile_format",  # the head-profile file the profile allocation reads
    "kvpolicy.files",  # output files checked before the work and replaced whole (profiles, calibrations)
})


@dataclass(frozen=True)
class Edge:
    """Module ``source`` imports module ``target`` at ``line`` of its file."""

    source: str
    target: str
    line: int


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package under ``root``: dotted name -> file (``__init__.py`` for a package)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([package, *parts])] = path
    return out


def import_edges(name: str, path: Path, known: set[str]) -> list[Edge]:
    """The imports of module ``name`` (file ``path``) of modules among ``known``, anywhere in it."""
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rpartition(".")[0]
    found: list[Edge] = []

    def add(target: str, line: int) -> None:
        # The module itself, else the nearest enclosing module (``from .x import Name``).
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.append(Edge(name, target, line))

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
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
                add(submodule if submodule in known else base, node.lineno)
    return found


def dynamic_imports(path: Path) -> list[str]:
    """``importlib.import_module("kvpolicy...")`` / ``__import__`` calls that name a kvpolicy
    module (or a relative one): such an import would escape the walk."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        arg = node.args[0]
        if (called in ("import_module", "__import__") and isinstance(arg, ast.Constant)
                and isinstance(arg.value, str) and (arg.value.startswith((PACKAGE, ".")))):
            out.append(f"{path}:{node.lineno}: {called}({arg.value!r})")
    return out


def import_graph(root: Path, package: str) -> tuple[dict[str, set[str]], list[Edge]]:
    """``(graph, edges)``: each module's imported modules, and every import with its line."""
    modules = module_names(root, package)
    edges = [e for name, path in modules.items() for e in import_edges(name, path, set(modules))]
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for e in edges:
        graph[e.source].add(e.target)
    return graph, edges


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
    return sorted(components)


def circle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest path ``a -> b -> ... -> a`` through the component, for the failure message."""
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


def describe_circles(graph: dict[str, set[str]], edges: list[Edge], found: list[list[str]]) -> str:
    lines = []
    for component in found:
        path = circle(graph, component)
        steps = []
        for a, b in zip(path[:-1], path[1:], strict=True):
            at = sorted({e.line for e in edges if e.source == a and e.target == b})
            steps.append(f"  {a} imports {b} (line {', '.join(map(str, at))})")
        lines.append(f"{' -> '.join(path)} (all of: {', '.join(component)}):\n" + "\n".join(steps))
    return "\n".join(lines)


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.fixture(scope="module")
def package_graph() -> tuple[dict[str, set[str]], list[Edge]]:
    return import_graph(Path(kvpolicy.__file__).parent, PACKAGE)


def test_the_walk_sees_the_package(package_graph):
    # A vacuous graph would pass everything below: the walk sees top-level, relative,
    # function-level and ``from . import`` imports of the real package.
    graph, _ = package_graph
    assert set(PRIMITIVES) <= set(graph)
    assert "kvpolicy.stages.base" in graph["kvpolicy.registry"]  # from .stages.base import ...
    assert "kvpolicy.seeds" in graph["kvpolicy.stages.inputs"]  # from .. import seeds
    assert "kvpolicy.profiles" in graph["kvpolicy.cli"]  # a function-level import
    assert "kvpolicy.vllm.worker" in graph["kvpolicy.vllm.hooks"]  # from . import worker, in a function
    assert "kvpolicy.hf" in graph["kvpolicy"]  # under TYPE_CHECKING, and in __getattr__


def test_kvpolicy_modules_import_each_other_without_circles(package_graph):
    graph, edges = package_graph
    found = cycles(graph)
    assert not found, "import circles in kvpolicy:\n" + describe_circles(graph, edges, found)


def test_stages_import_only_stages_and_primitives(package_graph):
    _, edges = package_graph
    upward = [e for e in edges if _in(e.source, STAGES) and not _in(e.target, STAGES) and e.target not in PRIMITIVES]
    assert not upward, "kvpolicy.stages imports modules above it:\n" + "\n".join(
        f"  {e.source} (line {e.line}) imports {e.target}" for e in upward)


def test_primitives_import_only_primitives(package_graph):
    _, edges = package_graph
    outside = [e for e in edges if e.source in PRIMITIVES and e.target not in PRIMITIVES]
    assert not outside, "a primitive imports a module above the stages:\n" + "\n".join(
        f"  {e.source} (line {e.line}) imports {e.target}" for e in outside)


def test_no_kvpolicy_module_is_imported_by_name():
    root = Path(kvpolicy.__file__).parent
    found = [hit for path in module_names(root, PACKAGE).values() for hit in dynamic_imports(path)]
    assert not found, "imports the walk cannot see:\n" + "\n".join(found)


# -- the walk itself, on small synthetic packages ------------------------------------------------------
def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_cycles_are_found_in_a_plain_graph():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}, "f": {"d"}}
    assert cycles(graph) == [["a", "b", "c"], ["e"]]
    assert circle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_walk_finds_late_type_checking_and_relative_circles(tmp_path):
    _write(tmp_path, {
        "__init__.py": "from .policy import load\n",
        "policy.py": "from .config import parse\n\ndef load():\n    from .registry import get  # late\n",
        "registry.py": "from .stages import ALL\n",
        "config.py": "from .stages.spec import Spec\n",
        "stages/__init__.py": "from .spec import Spec\nfrom . import base\nALL = (Spec,)\n",
        "stages/base.py": "from .. import seeds\n",
        "stages/spec.py": "from .base import Stage\n\ndef build():\n    from ..registry import get  # late\n",
        "stages/head.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..config import Policy\n",
        "seeds.py": "import torch\n",
    })
    graph, edges = import_graph(tmp_path, "pkg")
    assert graph["pkg.stages"] == {"pkg.stages.spec", "pkg.stages.base"}  # ``from . import base``
    assert graph["pkg.stages.base"] == {"pkg.seeds"}  # ``from .. import seeds``: the module
    assert graph["pkg.stages.spec"] == {"pkg.stages.base", "pkg.registry"}  # the late import counts
    assert graph["pkg.stages.head"] == {"pkg.config"}  # so does a TYPE_CHECKING one
    assert Edge("pkg.policy", "pkg.registry", 4) in edges
    assert cycles(graph) == [["pkg.registry", "pkg.stages", "pkg.stages.spec"]]
    message = describe_circles(graph, edges, cycles(graph))
    assert "pkg.registry -> pkg.stages -> pkg.stages.spec -> pkg.registry" in message
    assert "pkg.stages.spec imports pkg.registry (line 4)" in message
    upward = {(e.source, e.target) for e in edges
              if _in(e.source, "pkg.stages") and not _in(e.target, "pkg.stages") and e.target != "pkg.seeds"}
    assert upward == {("pkg.stages.spec", "pkg.registry"), ("pkg.stages.head", "pkg.config")}
    # Without the late import the circle is gone: an import of a package's module is no edge to
    # the package (config -> stages.spec does not close stages -> ... -> config).
    _write(tmp_path, {"stages/spec.py": "from .base import Stage\n"})
    assert cycles(import_graph(tmp_path, "pkg")[0]) == []


def test_imports_by_name_are_found(tmp_path):
    _write(tmp_path, {"a.py": "import importlib\n\ndef f():\n    importlib.import_module('kvpolicy.registry')\n"
                              "    __import__('torch')\n"})
    assert dynamic_imports(tmp_path / "a.py") == [f"{tmp_path / 'a.py'}:4: import_module('kvpolicy.registry')"]


# -- names that moved: the old import paths keep working, with a warning naming the new one ----------
@pytest.mark.parametrize(("old_module", "old_name", "new_module", "new_name"), [
    ("kvpolicy.guards", "run_scorer", "kvpolicy.stages.guards", "run_scorer"),
    ("kvpolicy.guards", "SelectionError", "kvpolicy.stages.guards", "SelectionError"),
    ("kvpolicy.config", "load_yaml", "kvpolicy.documents", "load_yaml"),
    ("kvpolicy.config", "decode_policy_bytes", "kvpolicy.documents", "decode_policy_bytes"),
    ("kvpolicy.config", "MAX_YAML_DEPTH", "kvpolicy.documents", "MAX_YAML_DEPTH"),
    ("kvpolicy.vllm.paged", "gather_slots", "kvpolicy.vllm.paged", "gather_paged"),
])
def test_a_moved_name_still_imports_with_a_warning_naming_its_new_place(old_module, old_name, new_module, new_name):
    old, new = importlib.import_module(old_module), importlib.import_module(new_module)
    with pytest.warns(DeprecationWarning, match=re.escape(f"{new_module}.{new_name}")):
        value = getattr(old, old_name)
    assert value is getattr(new, new_name)


def test_paths_that_did_not_move_import_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from kvpolicy import Allocation, SelectionError
        from kvpolicy.config import PolicyConfig, PolicyError, read_policy_text, read_source  # noqa: F401
        from kvpolicy.profiles import (  # noqa: F401
            PROFILE_FORMAT,
            HeadProfile,
            ProfileError,
            compute_profile,
            passkey_calibration,
        )
        from kvpolicy.stages import AllocationSpec, ScorerSpec  # noqa: F401
        from kvpolicy.stages.base import Allocation as BaseAllocation
        from kvpolicy.stages.guards import SelectionError as StageSelectionError
    assert Allocation is BaseAllocation and "Allocation" in kvpolicy.__all__
    assert SelectionError is StageSelectionError
    from kvpolicy import documents, profile_format

    assert PolicyError is documents.PolicyError and HeadProfile is profile_format.HeadProfile


def test_the_stage_kinds_are_one_list():
    from kvpolicy.registry import Registry
    from kvpolicy.schema import UNION_DEFS
    from kvpolicy.stages.base import STAGE_BASES, STAGE_KINDS

    assert STAGE_KINDS == ("scorer", "reservation", "selector", "allocation", "merge")
    assert list(STAGE_BASES) == list(STAGE_KINDS)
    assert all(base.kind == kind for kind, base in STAGE_BASES.items())
    assert list(Registry(autoload=False).stages) == list(STAGE_KINDS)
    assert list(UNION_DEFS) == list(STAGE_KINDS)
