"""``benchmarks/compare_trees.py`` reads the tables the benchmarks print (before/after runs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_benchmark

compare_trees = load_benchmark("compare_trees")

STATE = """budget 256, 96 steps per cache, 1 thread
policy          step ms   ratio  evicting ms   ratio  mean ms   ratio
h2o-windowed     11.359  1.000x       22.849  1.000x   11.724  1.000x
h2o              13.682  1.205x          nan    nanx   12.547  1.070x
"""
OVERHEAD = """decode step with no eviction due vs StaticCache(budget + interval), budget 256, batch 1
policy                 policy ms   static ms    overhead
snapkv                     4.209       4.052       +3.9%
"""
LOOSE = """policy        step ms vs uniform  evicting step ms vs uniform
snapkv          5.517      1.00x          12.0      1.00x
"""


def test_rows_and_columns_are_read_repeated_names_by_the_column_before():
    got = compare_trees.tables(STATE)
    header = "policy step ms ratio evicting ms ratio mean ms ratio"
    assert got[(header, "h2o", "step ms")] == 13.682
    assert got[(header, "h2o", "step ms ratio")] == 1.205
    assert got[(header, "h2o", "mean ms ratio")] == 1.070
    assert got[(header, "h2o", "evicting ms")] != got[(header, "h2o", "evicting ms")]  # nan
    assert len([k for k in got if k[1] == "h2o-windowed"]) == 6


def test_signed_percentages_and_headers_that_do_not_line_up():
    got = compare_trees.tables(OVERHEAD)
    assert got[("policy policy ms static ms overhead", "snapkv", "overhead")] == 3.9
    loose = compare_trees.tables(LOOSE)
    assert sorted(v for k, v in loose.items()) == [1.0, 1.0, 5.517, 12.0]
    assert {k[2] for k in loose} == {"column 1", "column 2", "column 3", "column 4"}


def test_json_records_per_configuration():
    got = compare_trees.tables('{"config": "snapkv", "output_tok_per_s": 71.1, "async_scheduling": false, "policy": {}}\n')
    assert got == {("json", "snapkv", "output_tok_per_s"): 71.1}


REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("argv", "message"), [
    (["--before", "/nonexistent", "--", "merge_bench.py"], "--before: /nonexistent is not a kvpolicy source tree"),
    (["--before", str(REPO), "--after", "/tmp", "--", "merge_bench.py"], "--after: /tmp is not a kvpolicy source tree"),
    (["--before", str(REPO), "--rounds", "0", "--", "merge_bench.py"], "--rounds must be at least 1, got 0"),
    (["--before", str(REPO), "--", "nope.py"], "no such benchmark"),
])
def test_bad_trees_and_rounds_are_refused_before_any_run(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        compare_trees.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_each_run_checks_which_kvpolicy_it_imported(tmp_path):
    """The child refuses a kvpolicy from outside the tree it was given (as when an installed one
    wins over PYTHONPATH), and runs the script as ``python SCRIPT`` would, its folder first on the path."""
    script = tmp_path / "bench.py"
    (tmp_path / "sibling.py").write_text("VALUE = 1.5\n")
    script.write_text("import sys\nfrom sibling import VALUE\nprint('policy  ms')\nprint('snapkv  ' + str(VALUE) + ' ' + sys.argv[1])\n")
    assert compare_trees.run(REPO, script, ["x"]) == "policy  ms\nsnapkv  1.5 x\n"
    other = tmp_path / "src"
    other.mkdir()
    env = {"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", compare_trees.CHILD, str(other), str(script), "x"], env=env,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 1 and done.stdout == ""
    assert f"kvpolicy was imported from {REPO / 'src' / 'kvpolicy' / '__init__.py'}, not from {other}" in done.stderr
