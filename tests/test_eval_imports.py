"""The modules of ``kvpolicy.eval`` import each other without circles.

Every import statement counts, wherever it stands: at the top, inside a function (a "late"
import that only hides a circle from the interpreter) or under ``TYPE_CHECKING``. The walk is
``tests/test_imports.py``'s (which holds the whole package to the same rule and tests the walk
itself); here it runs over ``kvpolicy.eval`` alone, with what that package must show.
"""

from __future__ import annotations

from pathlib import Path

from test_imports import cycles, describe_circles, import_graph

import kvpolicy.eval

EVAL = "kvpolicy.eval"


def test_eval_modules_import_each_other_without_circles():
    root = Path(kvpolicy.eval.__file__).parent
    graph, edges = import_graph(root, EVAL)
    # The walk sees the package (a vacuous graph would pass): the runner writes the report, and
    # the command line reads its configuration through a function-level import.
    assert f"{EVAL}.report" in graph[f"{EVAL}.runner"]
    assert f"{EVAL}.config" in graph[f"{EVAL}.cli"]
    found = cycles(graph)
    assert not found, "import circles in kvpolicy.eval:\n" + describe_circles(graph, edges, found)
