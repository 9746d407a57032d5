"""One benchmark, two source trees, side by side in one run: before and after a change.

Runs ``BENCHMARK ARGS`` (a script of this folder, e.g. ``state_bench.py --quick``) with
``PYTHONPATH`` set to each tree's ``src`` in turn, A B A B ..., so that a machine's drift hits
both alike; parses every table the benchmark prints (a header line, then rows of a name followed
by numbers, ``1.05x`` ratios included, and the JSON record per configuration that
``vllm_bench.py`` prints) and prints, per row and column, the median over the
rounds of each tree and their ratio (after / before)::

    git worktree add /tmp/before HEAD~3
    python benchmarks/compare_trees.py --before /tmp/before --after . --rounds 3 -- state_bench.py --quick

The benchmark scripts themselves are taken from the ``--after`` tree, so both trees run the same
measurement code; only the library differs. A tree without ``src/kvpolicy`` is refused, and each
run checks that the kvpolicy it imported is its tree's (an installed kvpolicy that wins over
``PYTHONPATH`` would otherwise compare a tree with itself).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

NUMBER = re.compile(r"^([+-]?\d+(\.\d+)?(e-?\d+)?|nan|inf)[x%]?$")


def tables(text: str) -> dict[tuple[str, str, str], float]:
    """``{(header, row name, column): value}`` for every table row of ``text``."""
    out: dict[tuple[str, str, str], float] = {}
    header: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("{"):  # a JSON record per configuration (vllm_bench.py)
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            if isinstance(record, dict) and "config" in record:
                for col, value in record.items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        out[("json", str(record["config"]), col)] = float(value)
            continue
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) < 2:
            header = None
            continue
        nums = [c for c in cells[1:] if NUMBER.match(c)]
        if len(nums) == len(cells) - 1:
            if header is not None:
                if len(header) != len(cells):  # a header whose words do not line up: columns by number
                    header = [header[0], *(f"column {j}" for j in range(1, len(cells)))]
                for j, (col, value) in enumerate(zip(header[1:], cells[1:], strict=True)):
                    # a column named twice ("ratio" after each figure) is named by the one before it
                    name = col if header.count(col) == 1 else f"{header[j]} {col}"
                    out[(" ".join(header), cells[0], name)] = float(value.rstrip("x%"))
        else:
            header = re.split(r"\s{2,}", line.strip())
    return out


#: What each run executes: ``python -c CHILD SRC SCRIPT ARGS...`` imports kvpolicy, refuses one
#: that is not under SRC, then runs SCRIPT as ``python SCRIPT ARGS...`` would.
CHILD = """\
import runpy, sys
from pathlib import Path
import kvpolicy
src, script = Path(sys.argv[1]).resolve(), sys.argv[2]
if not Path(kvpolicy.__file__).resolve().is_relative_to(src):
    sys.exit(f"kvpolicy was imported from {kvpolicy.__file__}, not from {src}: another install wins over PYTHONPATH")
sys.argv, sys.path[0] = sys.argv[2:], str(Path(script).resolve().parent)
runpy.run_path(script, run_name="__main__")
"""


def source_tree(tree: Path) -> Path:
    """``tree``'s ``src`` folder; ``ValueError`` unless it holds a kvpolicy package."""
    src = tree.resolve() / "src"
    if not (src / "kvpolicy" / "__init__.py").is_file():
        raise ValueError(f"{tree} is not a kvpolicy source tree: no {src / 'kvpolicy' / '__init__.py'}")
    return src


def run(tree: Path, script: Path, args: list[str]) -> str:
    src = source_tree(tree)
    env = {**os.environ, "PYTHONPATH": str(src)}
    done = subprocess.run([sys.executable, "-c", CHILD, str(src), str(script), *args], env=env, capture_output=True,
                          text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{script.name} under {tree} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    return done.stdout


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, required=True, help="the source tree before the change")
    ap.add_argument("--after", type=Path, default=Path("."), help="the source tree after it (default: here)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--keep", type=Path, default=None, help="a folder to write each run's output to")
    ap.add_argument("benchmark", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS]")
    a = ap.parse_args(argv)
    bench = a.benchmark[1:] if a.benchmark[:1] == ["--"] else a.benchmark
    if not bench:
        ap.error("name the benchmark: -- SCRIPT [ARGS]")
    if a.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {a.rounds}")
    for flag, tree in (("--before", a.before), ("--after", a.after)):
        try:
            source_tree(tree)
        except ValueError as exc:
            ap.error(f"{flag}: {exc}")
    script = a.after.resolve() / "benchmarks" / bench[0]
    if not script.is_file():
        ap.error(f"no such benchmark: {script}")
    got: dict[str, list[dict]] = {"before": [], "after": []}
    if a.keep is not None:
        a.keep.mkdir(parents=True, exist_ok=True)
    for i in range(a.rounds):
        for side, tree in (("before", a.before), ("after", a.after)):
            text = run(tree, script, bench[1:])
            if a.keep is not None:
                (a.keep / f"{side}-{i}.txt").write_text(text)
            got[side].append(tables(text))
    keys = [k for k in got["after"][0] if all(k in r for side in got.values() for r in side)]
    print(f"{' '.join(bench)}: median of {a.rounds} rounds per tree, alternating (before {a.before}, after {a.after})")
    last = None
    for key in keys:
        header, row, col = key
        if header != last:
            print(f"\n{'row':<18} {'column':<22} {'before':>10} {'after':>10} {'after/before':>13}")
            last = header
        before = statistics.median(r[key] for r in got["before"])
        after = statistics.median(r[key] for r in got["after"])
        ratio = f"{after / before:.3f}" if before and before == before else "-"
        print(f"{row:<18} {col:<22} {before:>10.3f} {after:>10.3f} {ratio:>13}")


if __name__ == "__main__":
    main()
