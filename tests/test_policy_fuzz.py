"""Fuzzed policy documents either load or fail with ``PolicyError``: never another exception.

Mutations of the built-in policy files (as YAML text, UTF-8 or not, in a file or not) and of
their parsed mappings (random values at random paths). No timing assertion: documents that could
take long (alias bombs) are refused before any expansion, and ``deadline=None`` keeps slow CI
machines from flaking.
"""

from __future__ import annotations

import copy
import math
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvpolicy
from kvpolicy import PolicyError
from kvpolicy.cli import main

POLICY_DIR = Path(kvpolicy.__file__).parent / "policies"
TEXTS = {p.stem: p.read_text(encoding="utf-8") for p in sorted(POLICY_DIR.glob("*.yaml"))}
DATA = {name: yaml.safe_load(text) for name, text in TEXTS.items()}


def fuzz(max_examples: int, *checks: HealthCheck) -> settings:
    """Hypothesis settings of these tests: no per-example deadline (see the module docstring)."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, *checks],
    )


def load_or_policy_error(source: Any, **overrides: Any) -> kvpolicy.Policy | None:
    """Load ``source``; a ``PolicyError`` is fine (one-line problems), anything else fails the test."""
    try:
        return kvpolicy.load_policy(source, **overrides)
    except PolicyError as exc:
        assert exc.problems, exc
        assert all(p and "\n" not in p for p in exc.problems), exc.problems
        return None


def test_builtin_policies_load():
    assert len(TEXTS) >= 8
    for name, text in TEXTS.items():
        assert kvpolicy.load_policy(text).name == name
        assert kvpolicy.load_policy(DATA[name]).name == name


# -- YAML text ------------------------------------------------------------------------------------
HUGE_INT = "9" * 5000
NUMBERS = [
    HUGE_INT,
    "-" + HUGE_INT,
    "0x" + "f" * 600,
    "1e999",
    "-.inf",
    ".nan",
    ".inf",
    str(2**64),
    str(2**63),
    str(-(2**63) - 1),
    str(2**31 + 1),
    str(2**34),
    "-1",
    "0",
    "2001-13-45",
    "1:2:3",
    "0o9",
    "0b2",
]
SNIPPETS = [
    *NUMBERS,
    " &a",
    " *a",
    "&a [*a]",
    "&x",
    "*x",
    "!!int ",
    "!!float ",
    "!!binary ",
    "!!set ",
    "!!omap ",
    "!!timestamp ",
    "!!python/object:os.system ",
    "<<: {budget: 3}\n",
    "<<: *a\n",
    "2**64",
    "null",
    "~",
    "true",
    "[" * 200,
    "{" * 200,
    "]",
    "}",
    "\t",
    "\x00",
    "\ufeff",
    "\x85",
    "\u2028",
    "'",
    '"',
    "\\",
    "%YAML 1.1\n",
    "---\n",
    "...\n",
    "? ",
    "? [a, b]\n: c\n",
    "budget - 4",
    "budget - " + HUGE_INT,
    "seed: 1\n",
    "name: dup\n",
    "selector: greedy\n",
    "type: combination\n",
    "terms: []\n",
    "{type: attention}",
    "weight: .inf",
    "weight: .nan",
    "kernel: 2147483649",
    "tile_elements: 17179869184",
    "- ",
]
CHARS = st.one_of(st.sampled_from(list(":{}[],&*!|>-#'\"\n \t%@`?0123456789.eE+_~")), st.characters())


@st.composite
def mutated_texts(draw) -> str:
    text = draw(st.sampled_from(sorted(TEXTS.values())))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(
            st.sampled_from(["char", "insert", "delete", "line_del", "line_dup", "line_swap", "number"])
        )
        lines = text.splitlines(keepends=True)
        pos = draw(st.integers(0, len(text)))
        if kind == "char" and text:
            i = min(pos, len(text) - 1)
            text = text[:i] + draw(CHARS) + text[i + 1 :]
        elif kind == "insert":
            text = text[:pos] + draw(st.one_of(st.sampled_from(SNIPPETS), st.text(max_size=8))) + text[pos:]
        elif kind == "delete":
            text = text[:pos] + text[pos + draw(st.integers(1, 40)) :]
        elif kind in ("line_del", "line_dup", "line_swap") and lines:
            i = draw(st.integers(0, len(lines) - 1))
            if kind == "line_del":
                del lines[i]
            elif kind == "line_dup":
                lines.insert(i, lines[i])
            else:
                j = draw(st.integers(0, len(lines) - 1))
                lines[i], lines[j] = lines[j], lines[i]
            text = "".join(lines)
        elif kind == "number":
            digits = [i for i, c in enumerate(text) if c.isdigit()]
            if digits:
                i = draw(st.sampled_from(digits))
                text = text[:i] + draw(st.sampled_from(NUMBERS)) + text[i + 1 :]
    return text


@fuzz(900)
@given(text=mutated_texts())
def test_mutated_yaml_text(text):
    load_or_policy_error(text)


@pytest.fixture(scope="module")
def fuzz_dir():
    with tempfile.TemporaryDirectory(prefix="kvpolicy-fuzz-") as folder:
        yield Path(folder)


@fuzz(500)
@given(
    text=mutated_texts(),
    junk=st.lists(st.tuples(st.integers(0, 10_000), st.binary(min_size=1, max_size=4)), max_size=3),
    how=st.sampled_from(["path", "str", "bytes"]),
)
def test_mutated_files_and_bytes(fuzz_dir, text, junk, how):
    raw = text.encode("utf-8")
    for pos, blob in junk:  # maybe no longer UTF-8
        pos %= len(raw) + 1
        raw = raw[:pos] + blob + raw[pos:]
    if how == "bytes":
        load_or_policy_error(raw)
        return
    path = fuzz_dir / "fuzzed.yaml"
    path.write_bytes(raw)
    policy = load_or_policy_error(path if how == "path" else str(path))
    if policy is None and how == "path":
        with pytest.raises(PolicyError) as err:
            kvpolicy.load_policy(path)
        assert err.value.source == str(path)  # the error names the file


@fuzz(200)
@given(
    source=st.one_of(st.text(max_size=40), st.sampled_from(["", " ", ":", "\n", "a:", "x.yaml", "a/b", "."]))
)
def test_arbitrary_strings(source):
    load_or_policy_error(source)


# -- Python mappings ------------------------------------------------------------------------------
def _deep(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def _cyclic() -> dict:
    d: dict = {"type": "combination"}
    d["terms"] = [{"weight": 1.0, "scorer": d}]
    return d


SPECIAL_VALUES = [
    math.inf,
    -math.inf,
    math.nan,
    2**31 + 1,
    2**34,
    2**63,
    2**64,
    -(2**63) - 1,
    10**5000,
    -1,
    0,
    1,
    0.5,
    1.5,
    -0.0,
    1e308,
    5e-324,
    True,
    False,
    None,
    "",
    "x",
    "budget - 4",
    "budget - " + "9" * 5000,
    "9" * 5000,
    "attention",
    "greedy",
    "stochastic",
    "sinks",
    "combination",
    "top_scores",
    "redundancy",
    "leverage",
    [],
    {},
    [1, 2],
    {"type": "attention"},
    {"type": "attention", "kernel": 2**31 + 1},
    {"type": None},
    {"type": "combination", "terms": [{"weight": math.nan, "scorer": "random"}]},
    {1: 2},
    {None: 1},
    {(1, 2): 3},
    b"bytes",
    {"a": [{"b": None}]},
]
VALUES = st.one_of(
    st.sampled_from(SPECIAL_VALUES).map(copy.deepcopy),  # fresh: mutations may nest into it
    st.integers(),
    st.floats(),
    st.text(max_size=10),
    st.booleans(),
    st.none(),
    st.integers(0, 3000).map(_deep),
    st.builds(_cyclic),
    st.recursive(
        st.none() | st.integers(-5, 5) | st.floats() | st.text(max_size=5),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
        max_leaves=8,
    ),
)


@st.composite
def mutated_mappings(draw) -> dict:
    data = copy.deepcopy(DATA[draw(st.sampled_from(sorted(DATA)))])
    for _ in range(draw(st.integers(1, 3))):
        parent: Any = None
        key: Any = None
        node: Any = data
        while isinstance(node, (dict, list)) and node and (parent is None or draw(st.booleans())):
            keys = list(node) if isinstance(node, dict) else list(range(len(node)))
            parent, key = node, draw(st.sampled_from(keys))
            node = node[key]
        if parent is None:  # an empty top level
            data[draw(st.text(max_size=5))] = draw(VALUES)
            continue
        action = draw(st.sampled_from(["set", "set", "set", "delete", "new_key"]))
        if action == "set":
            parent[key] = draw(VALUES)
        elif action == "delete" and isinstance(parent, dict):
            del parent[key]
        elif isinstance(parent, dict):
            new_key = draw(
                st.one_of(st.text(max_size=8), st.integers(), st.none(), st.sampled_from(["seed", "n"]))
            )
            parent[new_key] = draw(VALUES)
    return data


@fuzz(900)
@given(data=mutated_mappings())
def test_mutated_mappings(data):
    load_or_policy_error(data)


OVERRIDE_KEYS = [
    "budget",
    "recent",
    "interval",
    "window",
    "count",
    "compress_prompt",
    "seed",
    "name",
    "description",
]


@fuzz(400)
@given(
    name=st.sampled_from(sorted(DATA)),
    as_mapping=st.booleans(),
    schedule=st.one_of(st.just("keep"), st.sampled_from(SPECIAL_VALUES).map(copy.deepcopy)),
    overrides=st.dictionaries(st.sampled_from([*OVERRIDE_KEYS, "bugdet"]), VALUES, max_size=3),
)
def test_overrides(name, as_mapping, schedule, overrides):
    source: Any = name
    if as_mapping or schedule != "keep":
        source = copy.deepcopy(DATA[name])
        if schedule != "keep":
            source["schedule"] = schedule
    load_or_policy_error(source, **overrides)


# -- the command line -----------------------------------------------------------------------------
@fuzz(150, HealthCheck.function_scoped_fixture)
@given(text=mutated_texts(), junk=st.binary(max_size=3))
def test_cli_show_and_validate_never_print_a_traceback(fuzz_dir, capsys, text, junk):
    path = fuzz_dir / "cli.yaml"
    path.write_bytes(text.encode("utf-8") + junk)
    capsys.readouterr()
    code = main(["show", str(path)])
    _, err = capsys.readouterr()
    assert code in (0, 2)
    assert "Traceback" not in err
    assert len([ln for ln in err.splitlines() if ln.strip()]) == (code == 2)
    code = main(["validate", str(path)])
    out, err = capsys.readouterr()
    assert code in (0, 1)
    assert "Traceback" not in err and str(path) in out
