"""``benchmarks/ranking_plot.py`` reads the ranking table published in docs/findings.md (the figures
below are that table's) and draws the plot from it; a table it cannot read is refused, saying where."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import load_benchmark

from kvpolicy.eval.config import FULL
from kvpolicy.eval.report import REFUSED, ranking

pytest.importorskip("matplotlib")
ranking_plot = load_benchmark("ranking_plot")

FINDINGS = Path(__file__).resolve().parents[1] / "docs" / "findings.md"


def _published():
    text = FINDINGS.read_text(encoding="utf-8")
    cols, rows = ranking_plot.parse_ranking(text)
    return text, cols, {(r["policy"], r["budget"]): r for r in rows}


def test_the_published_table_is_read_row_by_row():
    _, cols, rows = _published()
    assert [c.key for c in cols] == ["ppl_ratio", "passkey", "agreement"]
    # bold (the best of a column) is read as its number
    assert rows[("oracle-topk", 128)]["values"] == {"ppl_ratio": 1.0550}
    assert rows[("oracle-topk", 256)]["values"] == {"ppl_ratio": 1.0246, "passkey": 0.67, "agreement": 0.995}
    assert rows[("oracle-topk", 256)]["mode"] == "select" and rows[("snapkv", 256)]["mode"] == "evict"
    assert rows[("lagkv", 256)]["values"]["passkey"] == 1.0
    assert rows[("random", 128)]["values"]["ppl_ratio"] == 2.2181
    assert rows[("knorm", 512)]["values"]["ppl_ratio"] == 1.3345
    assert rows[("snapkv", 512)]["values"] == {"ppl_ratio": 1.0192}  # passkey and agreement ran at 256 only
    # a refused budget is a refused row with no figures; the policy's other budgets are figures
    assert "refused" in rows[("triattention", 128)] and rows[("triattention", 128)]["values"] == {}
    assert rows[("triattention", 256)]["values"]["ppl_ratio"] == 1.0338
    full = rows[(FULL, None)]
    assert full["values"] == {"ppl_ratio": 1.0, "passkey": 0.67, "agreement": 1.0}


def test_the_published_order_is_the_order_its_figures_give():
    text, cols, rows = _published()
    ranked = ranking(cols, list(rows.values()))
    assert ranked.policies[0] == "oracle-topk"
    assert ranked.cells["triattention"][("ppl_ratio", 128)] == REFUSED
    ranking_plot.check_order(text, cols, list(rows.values()))  # raises on a disagreement


TABLE = """\
| rank | policy | mode | PPL / full @128 | PPL / full @256 | passkey @256 | held @256 |
|---|---|---|---|---|---|---|
| - | full cache | - | 1.0000 | 1.0000 | 1.00 | 4,096 |
| 1 | a | evict | **1.0100** | **1.0050** | 0.00 | 320 |
| 2 | b | evict | 1.0300 | 1.0200 | **1.00** | 320 |
| 3 | c | evict | refused | 1.0010 | 0.00 | 384 |
"""


def test_a_small_table_is_drawn_and_a_misplaced_row_is_refused(tmp_path):
    cols, rows = ranking_plot.parse_ranking(TABLE)
    ranking_plot.check_order(TABLE, cols, rows)  # c ranks last: refused at 128
    assert ranking_plot.main(["--findings", str(_write(tmp_path, TABLE)), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "ranking.png").stat().st_size > 10_000

    lines = TABLE.splitlines()
    lines[3], lines[4] = lines[4], lines[3]  # b above a, although a's mean is lower
    misplaced = "\n".join(lines) + "\n"
    cols, rows = ranking_plot.parse_ranking(misplaced)
    with pytest.raises(ranking_plot.TableError, match="rank 1: the table has 'b', its figures rank 'a'"):
        ranking_plot.check_order(misplaced, cols, rows)


def test_an_unreadable_table_is_refused_naming_the_cell():
    with pytest.raises(ranking_plot.TableError, match="no table"):
        ranking_plot.parse_ranking("no table here\n")
    with pytest.raises(ranking_plot.TableError, match="'PPL/full'"):
        ranking_plot.parse_ranking(TABLE.replace("PPL / full @128", "PPL/full @128"))
    with pytest.raises(ranking_plot.TableError, match=r"b, PPL / full @256: '1\.02x'"):
        ranking_plot.parse_ranking(TABLE.replace("1.0200", "1.02x"))


def _write(folder: Path, text: str) -> Path:
    path = folder / "findings.md"
    path.write_text(text, encoding="utf-8")
    return path


def test_nested_outliers_are_all_left_out_of_the_zoomed_scale():
    from kvpolicy.eval.report import off_scale, off_scale_nested

    _, _, rows = _published()
    ppl: dict[str, list[float]] = {}
    for (name, _), row in rows.items():
        if name != FULL and "ppl_ratio" in row["values"]:
            ppl.setdefault(name, []).append(row["values"]["ppl_ratio"])
    # cam's attention merge (1.11 at 128, since 2026-12-05) sits next to h2o: two stand out, found in one pass
    assert off_scale(ppl, 1.0) == ["random", "knorm"]
    assert off_scale_nested(ppl, 1.0) == ["random", "knorm"]
    # nothing stands out: nothing left out; never more than a third of the policies
    assert off_scale_nested({"a": [1.0], "b": [1.1], "c": [1.2]}, 1.0) == []
    # y stands out, then x does among the rest, but a third of four policies is one: x stays in scale
    assert off_scale_nested({"a": [1.0], "b": [1.01], "x": [5.0], "y": [500.0]}, 1.0) == ["y"]
