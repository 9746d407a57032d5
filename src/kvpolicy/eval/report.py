"""Reporting: progress bars, the terminal table, and one plot per number against budget."""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .runner import Plan

FULL = "full"


@contextmanager
def progress_bar(console, enabled: bool = True):
    """Rich's live bars on a terminal; elsewhere (a log, a pipe, a job) a line per finished pair
    with an ETA (:class:`kvpolicy.eval.progress.LineBars`); nothing when not ``enabled``."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if enabled and not console.is_terminal:
        from .progress import LineBars

        yield LineBars(console)
        return

    progress = Progress(
        TextColumn("{task.description:<28}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not enabled,
        transient=False,
    )
    with progress:
        yield progress


def columns(plan: Plan):
    return [c for metric in plan.metrics for c in metric.columns]


def build_table(plan: Plan, rows: list[dict], title: str | None = None):
    """A rich table: one row per (policy, budget) plus the full cache; best per budget in bold."""
    from rich.table import Table

    cols = columns(plan)
    table = Table(title=title, title_justify="left")
    table.add_column("policy", no_wrap=True, style="bold")
    table.add_column("budget", justify="right")
    for c in cols:
        arrow = {"higher": " ↑", "lower": " ↓"}.get(c.better, "")
        table.add_column(c.label + arrow, justify="right")
    best = _best_per_budget(cols, rows)
    for row in rows:
        cells = []
        for c in cols:
            text = c.format(row["values"].get(c.key))
            if row["policy"] != FULL and best.get((row["budget"], c.key)) == row["key"]:
                text = f"[bold green]{text}[/bold green]"
            cells.append(text)
        budget = "-" if row["budget"] is None else str(row["budget"])
        table.add_row(row["policy"], budget, *cells, end_section=row["policy"] == FULL)
    return table


def _best_per_budget(cols, rows) -> dict[tuple[Any, str], str]:
    best: dict[tuple[Any, str], tuple[float, str]] = {}
    for c in cols:
        if not c.better:
            continue
        for row in rows:
            v = row["values"].get(c.key)
            if row["policy"] == FULL or not _finite(v):
                continue
            score = v if c.better == "higher" else -v
            key = (row["budget"], c.key)
            if key not in best or score > best[key][0]:
                best[key] = (score, row["key"])
    return {k: v[1] for k, v in best.items()}


def markdown_table(plan: Plan, rows: list[dict]) -> str:
    cols = columns(plan)
    head = ["policy", "budget", *[c.label for c in cols]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        budget = "-" if row["budget"] is None else str(row["budget"])
        cells = [row["policy"], budget, *[c.format(row["values"].get(c.key)) for c in cols]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _line_style(i: int) -> dict:
    """The ``i``-th policy's line: matplotlib's 10 colours, then the same colours dashed with
    another marker, so no two of up to 40 policies look alike."""
    return {"color": f"C{i % 10}", "marker": "osD^"[(i // 10) % 4], "linestyle": ("-", "--", ":", "-.")[(i // 10) % 4]}


def write_plots(folder: Path, plan: Plan, rows: list[dict]) -> list[Path]:
    """``<key>.png`` per reported number: value against budget, one line per policy, the full
    cache as a dashed horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    full = next((r for r in rows if r["policy"] == FULL), None)
    policies = list(dict.fromkeys(r["policy"] for r in rows if r["policy"] != FULL))
    out = []
    for c in columns(plan):
        fig, ax = plt.subplots(figsize=(6, 4))
        for i, name in enumerate(policies):
            pts = sorted(
                (r["budget"], r["values"].get(c.key)) for r in rows
                if r["policy"] == name and _finite(r["values"].get(c.key))
            )
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, **_line_style(i))
        if full is not None and _finite(full["values"].get(c.key)):
            ax.axhline(full["values"][c.key], color="black", linestyle="--", label="full cache")
        ax.set_xlabel("budget (slots per layer)")
        ax.set_ylabel(c.label)
        better = f" ({c.better} is better)" if c.better else ""
        ax.set_title(f"{c.label}{better}")
        budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})
        if budgets:
            ax.set_xticks(budgets)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
        fig.tight_layout()
        path = folder / f"{c.key}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        out.append(path)
    pareto = pareto_plot(folder, rows)
    if pareto is not None:
        out.append(pareto)
    return out


# Quality against memory: the first pair of keys that the rows report.
PARETO = [("pass@1", "lm_kv_mib", "pass@1", "KV cache MiB (most held by a batch)"),
          ("pass@1", "lm_peak_mib", "pass@1", "peak memory MiB"),
          ("accuracy", "kv_mib", "pass@1 (reasoning-gym)", "KV cache MiB")]


def pareto_plot(folder: Path, rows: list[dict]) -> Path | None:
    """``pareto.png``: accuracy against KV memory, one line per policy through its budgets (the
    full cache a star), when the rows hold both numbers; None otherwise."""
    import matplotlib.pyplot as plt

    found = next(
        ((axes, pts) for axes in PARETO
         if (pts := [r for r in rows if _finite(r["values"].get(axes[0])) and _finite(r["values"].get(axes[1]))])),
        None,
    )
    if found is None:
        return None
    (y_key, x_key, y_label, x_label), pts = found
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, name in enumerate(n for n in dict.fromkeys(r["policy"] for r in pts) if n != FULL):
        mine = sorted((r["values"][x_key], r["values"][y_key], r["budget"]) for r in pts if r["policy"] == name)
        ax.plot([p[0] for p in mine], [p[1] for p in mine], label=name, **_line_style(i))
        for x, y, budget in mine:
            ax.annotate(str(budget), (x, y), textcoords="offset points", xytext=(3, 3), fontsize=6)
    full = [(r["values"][x_key], r["values"][y_key]) for r in pts if r["policy"] == FULL]
    if full:
        ax.scatter([p[0] for p in full], [p[1] for p in full], marker="*", s=160, color="black", label="full cache",
                   zorder=3)
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.set_title(f"{y_label} against memory (up and left is better)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path = folder / "pareto.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
