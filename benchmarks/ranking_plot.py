"""Redraw the ranking plot (``docs/img/ranking.png``) from the ranking table published in
``docs/findings.md``, so the figure follows the table without the run folder that produced it.

    python benchmarks/ranking_plot.py [--findings docs/findings.md] [--out docs/img]

The table is the one whose header starts ``| rank | policy | mode |`` (the layout of a run's
``ranking.md``): a column per ranked measure and budget (``PPL / full @128`` ...), bold marking the
best, ``refused`` where a policy refused a budget, ``-`` where a measure was not run. It is drawn
by the same code as a run's ``plots/ranking.png`` (``kvpolicy.eval.report.ranking_plot``): one line
per policy in rank order, a policy far off a panel's scale drawn at its edge with its figures
written beside it.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from kvpolicy.eval.config import FULL
from kvpolicy.eval.metrics.base import Column
from kvpolicy.eval.metrics.fidelity import Fidelity
from kvpolicy.eval.metrics.passkey import Passkey
from kvpolicy.eval.metrics.perplexity import Perplexity
from kvpolicy.eval.report import REFUSED, ranking, ranking_plot

ROOT = Path(__file__).resolve().parents[1]
HEAD = ("rank", "policy", "mode")
#: The ranked measures the table may hold, by the label its header uses (the metrics' own columns).
COLUMNS: dict[str, Column] = {c.label: c for m in (Perplexity, Passkey, Fidelity) for c in m.columns if c.ranked}
#: Columns the findings add to a run's ranking.md that are not measures (the most slots a head holds).
INFORMATIONAL = {"held"}
FULL_LABEL = "full cache"
SLOT = re.compile(r"^(?P<label>.+?) @(?P<budget>\d+)$")


class TableError(ValueError):
    """The findings page holds no ranking table, or one this script cannot read (says where)."""


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def find_table(text: str) -> list[list[str]]:
    """The ranking table's rows (header first, the ``|---|`` line dropped) in ``text``."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|") and tuple(_cells(line)[:3]) == HEAD:
            table = [_cells(line)]
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                table.append(_cells(row))
            return table
    raise TableError(f"no table whose header starts '| {' | '.join(HEAD)} |'")


def _value(cell: str, where: str) -> float | str | None:
    text = cell.replace("**", "").replace(",", "").strip()
    if text == "-":
        return None
    if text == REFUSED:
        return REFUSED
    try:
        return float(text)
    except ValueError:
        raise TableError(f"{where}: {cell!r} is not a number, '-' or '{REFUSED}'") from None


def parse_ranking(text: str) -> tuple[list[Column], list[dict]]:
    """The ranked columns and one result row per (policy, budget), plus the full cache's, as a run
    folder's ``results.jsonl`` holds them, read from the ranking table in ``text``."""
    header, *body = find_table(text)
    slots: list[tuple[int, Column, int]] = []  # (cell index, column, budget)
    for i, name in enumerate(header[len(HEAD):], len(HEAD)):
        m = SLOT.match(name)
        if m is None or m["label"] in INFORMATIONAL:
            continue
        if m["label"] not in COLUMNS:
            raise TableError(f"header {name!r}: no ranked measure is labelled {m['label']!r} "
                             f"(known: {', '.join(COLUMNS)}; not drawn: {', '.join(INFORMATIONAL)})")
        slots.append((i, COLUMNS[m["label"]], int(m["budget"])))
    if not slots:
        raise TableError("the ranking table has no 'MEASURE @BUDGET' column")
    cols = list(dict.fromkeys(c for _, c, _ in slots))
    rows: list[dict] = []
    for cells in body:
        if len(cells) != len(header):
            raise TableError(f"row {cells[:2]}: {len(cells)} cells, the header has {len(header)}")
        name, mode = cells[1], cells[2]
        values: dict[int | None, dict] = {}
        refused: set[int] = set()
        for i, column, budget in slots:
            v = _value(cells[i], f"{name}, {header[i]}")
            if v == REFUSED:
                refused.add(budget)
            elif v is not None:
                values.setdefault(budget, {})[column.key] = v
        if name == FULL_LABEL:
            merged = {k: v for vals in values.values() for k, v in vals.items()}
            rows.append({"key": FULL, "policy": FULL, "budget": None, "values": merged})
            continue
        for budget in sorted({b for _, _, b in slots}):
            row = {"key": f"{name}@{budget}", "policy": name, "budget": budget, "mode": mode,
                   "values": values.get(budget, {})}
            if budget in refused:
                row["refused"] = f"{name} refused budget {budget} (as published)"
            rows.append(row)
    return cols, rows


def check_order(text: str, cols: list[Column], rows: list[dict]) -> None:
    """Refuse a table whose rank column disagrees with the ranking its figures give (a row pasted
    in at the wrong place would otherwise be drawn somewhere the table does not put it)."""
    published = [cells[1] for cells in find_table(text)[1:] if cells[1] != FULL_LABEL]
    computed = ranking(cols, rows).policies
    if published != computed:
        first = next(i for i, (a, b) in enumerate(zip(published, computed, strict=False)) if a != b)
        raise TableError(f"rank {first + 1}: the table has {published[first]!r}, its figures rank "
                         f"{computed[first]!r} there (mean ratio over the budgets; refused rows last)")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--findings", default=str(ROOT / "docs" / "findings.md"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "img"), help="folder for ranking.png")
    args = ap.parse_args(argv)
    text = Path(args.findings).read_text(encoding="utf-8")
    try:
        cols, rows = parse_ranking(text)
        check_order(text, cols, rows)
    except TableError as exc:
        raise SystemExit(f"{args.findings}: {exc}") from None
    path = ranking_plot(Path(args.out), cols, rows)
    print(f"{path}: {len({r['policy'] for r in rows}) - 1} policies")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
