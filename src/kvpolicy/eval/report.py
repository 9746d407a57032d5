"""Reporting: progress bars, the terminal table, and one plot per number against budget."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

from .config import FULL
from .metrics.base import Column
from .progress import LineBars

#: A policy is off scale when the others would fill less than 1 / SQUEEZE of the axis beside it.
SQUEEZE = 4.0
#: What a table shows for a pair whose policy refused its budget (``refusals: report``).
REFUSED = "refused"


@contextmanager
def progress_bar(console, enabled: bool = True):
    """Rich's live bars on a terminal; elsewhere (a log, a pipe, a job) a line per finished pair
    with an ETA (:class:`kvpolicy.eval.progress.LineBars`); nothing when not ``enabled``.

    A task's ``eta`` field (``bar.update(task, eta="12m30s")``) is shown beside its bar."""
    if enabled and not console.is_terminal:
        yield LineBars(console)
        return

    progress = Progress(
        TextColumn("{task.description:<28}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        _EtaColumn(),
        console=console,
        disable=not enabled,
        transient=False,
    )
    with progress:
        yield progress


class _EtaColumn(ProgressColumn):
    """The ``eta`` field of a task (the runner sets it on the top task), or nothing."""

    def render(self, task: Task) -> Text:
        eta = task.fields.get("eta")
        return Text(f"ETA {eta}" if eta else "", style="progress.remaining")


def shown_columns(cols: Sequence[Column], rows: list[dict]) -> list[Column]:
    """``cols`` without the optional ones (``Column.optional``: a two-tier policy's tiers) that no
    row reports: a run without such a policy shows no empty column for them."""
    return [c for c in cols if not c.optional or any(c.key in r["values"] for r in rows)]


def build_table(cols: Sequence[Column], rows: list[dict], title: str | None = None):
    """A rich table of ``cols`` (``shown_columns``): one row per (policy, budget) plus the full
    cache; best per budget in bold."""
    from rich.table import Table

    cols = shown_columns(cols, rows)

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
        if row.get("refused") and cells:
            cells[0] = f"[yellow]{REFUSED}[/yellow]"
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


def markdown_table(cols: Sequence[Column], rows: list[dict]) -> str:
    """``table.md``: ``cols`` (``shown_columns``), one row per (policy, budget) plus the full cache."""
    cols = shown_columns(cols, rows)
    head = ["policy", "budget", *[c.label for c in cols]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        budget = "-" if row["budget"] is None else str(row["budget"])
        cells = [row["policy"], budget, *[c.format(row["values"].get(c.key)) for c in cols]]
        if row.get("refused") and cols:
            cells[2] = REFUSED
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _line_style(i: int) -> dict:
    """The ``i``-th policy's line: matplotlib's 10 colours, then the same colours dashed with
    another marker, so no two of up to 40 policies look alike."""
    return {"color": f"C{i % 10}", "marker": "osD^"[(i // 10) % 4], "linestyle": ("-", "--", ":", "-.")[(i // 10) % 4]}


def write_plots(folder: Path, cols: Sequence[Column], rows: list[dict]) -> list[Path]:
    """``<key>.png`` per reported number (``shown_columns``): value against budget, one line per policy, the full
    cache as a dashed horizontal line.

    When a few policies lie far from the rest (an ablation such as ``random`` on perplexity), one
    axis spanning them all would squeeze the others into a thin band where they cannot be told
    apart: the plot then has a second panel, zoomed on the others (``off_scale``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = shown_columns(cols, rows)
    folder.mkdir(parents=True, exist_ok=True)
    full = next((r for r in rows if r["policy"] == FULL), None)
    policies = list(dict.fromkeys(r["policy"] for r in rows if r["policy"] != FULL))
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})
    out = []
    for c in cols:
        series = {}
        for name in policies:
            pts = sorted((r["budget"], r["values"].get(c.key)) for r in rows
                         if r["policy"] == name and _finite(r["values"].get(c.key)))
            if pts:
                series[name] = pts
        ref = full["values"].get(c.key) if full is not None else None
        ref = ref if _finite(ref) else None
        off = off_scale({n: [v for _, v in pts] for n, pts in series.items()}, ref)
        fig, axes = plt.subplots(1, 2 if off else 1, figsize=(10.5 if off else 6.5, 4), squeeze=False)
        panels: list[tuple[Any, set[str]]] = [(axes[0][0], set())] + ([(axes[0][1], set(off))] if off else [])
        for ax, hidden in panels:
            for i, name in enumerate(policies):
                if name in series and name not in hidden:
                    pts = series[name]
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, **_line_style(i))
            if ref is not None:
                ax.axhline(ref, color="black", linestyle="--", label="full cache")
            ax.set_xlabel("budget (slots per layer)")
            ax.set_ylabel(c.label)
            if budgets:
                ax.set_xticks(budgets)
            ax.grid(alpha=0.3)
        better = f" ({c.better} is better)" if c.better else ""
        if off:
            axes[0][0].set_title(f"{c.label}{better}: all policies", fontsize=10)
            axes[0][1].set_title(f"zoomed: without {', '.join(off)}", fontsize=10)
        else:
            axes[0][0].set_title(f"{c.label}{better}")
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
        fig.tight_layout()
        path = folder / f"{c.key}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        out.append(path)
    for extra in (pareto_plot(folder, rows), ranking_plot(folder, cols, rows)):
        if extra is not None:
            out.append(extra)
    return out


def off_scale(series: dict[str, list[float]], ref: float | None, squeeze: float = SQUEEZE) -> list[str]:
    """The policies to leave out of a zoomed panel: the fewest (at most a third of them) whose
    values lie beyond all the others', above, below or both, and without which the other
    policies and the full cache's value ``ref`` span at most ``1 / squeeze`` of what they span
    together. Empty when every policy reads well on one axis."""
    span = _span(series.values(), ref)
    if span <= 0:
        return []
    highest = sorted(series, key=lambda n: max(series[n]), reverse=True)
    lowest = sorted(series, key=lambda n: min(series[n]))
    for k in range(1, len(series) // 3 + 1):
        for top in range(k, -1, -1):
            out = list(dict.fromkeys(highest[:top] + lowest[: k - top]))
            rest = [v for n, v in series.items() if n not in out]
            if len(out) == k and _span(rest, ref) * squeeze <= span:
                return out
    return []


def off_scale_nested(series: dict[str, list[float]], ref: float | None, squeeze: float = SQUEEZE) -> list[str]:
    """``off_scale`` applied again to what it leaves, until nothing more stands out: one policy
    thousands of times off (``cam``'s ratios) would otherwise be the only one left out, and the
    next tier (``random``'s 2.2) would still squeeze the others. At most a third of the policies
    in all, the farthest first."""
    out: list[str] = []
    while len(out) < len(series) // 3:
        more = off_scale({n: v for n, v in series.items() if n not in out}, ref, squeeze)
        if not more or len(out) + len(more) > len(series) // 3:
            break
        out += more
    return out


def _span(values: Iterable[list[float]], ref: float | None) -> float:
    flat = [v for vs in values for v in vs] + ([] if ref is None else [ref])
    return max(flat) - min(flat) if flat else 0.0


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


def _number(v: Any) -> float | None:
    """``v`` as a float when it is a finite number, else None."""
    return float(v) if _finite(v) else None


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


# -- the ranking: one row per policy, its quality at every budget ------------------------------------

@dataclass
class Ranking:
    """The run's policies in rank order, with each ranked column's value per budget.

    Policies are ranked by the first ranked column (``Column.ranked``; perplexity ratio when the
    run measured it) averaged over the budgets; a policy refused at some budget ranks after
    every policy that ran at all of them. ``cells[policy][(column, budget)]`` is a number,
    ``REFUSED``, or None (not measured)."""

    columns: list[Column]
    budgets: list[int]
    policies: list[str]
    modes: dict[str, str]
    cells: dict[str, dict[tuple[str, int], Any]]
    reasons: dict[str, dict[int, str]]
    full: dict[str, Any] | None

    def measured(self, c: Column) -> list[int]:
        """The budgets at which some policy has a figure in column ``c`` (a metric may run at
        only some of the run's budgets: ``passkey.budgets``)."""
        return [b for b in self.budgets if any(_finite(self.cells[n].get((c.key, b))) for n in self.policies)]

    def score(self, name: str) -> float:
        key = self.columns[0].key
        vals = [v for b in self.budgets if (v := _number(self.cells[name].get((key, b)))) is not None]
        if not vals:
            return math.inf
        mean = sum(vals) / len(vals)
        return mean if self.columns[0].better == "lower" else -mean


def ranking(cols: Sequence[Column], rows: list[dict]) -> Ranking | None:
    """The ranking of ``rows`` over the ranked ones of ``cols``; None when there is nothing to rank."""
    columns = [c for c in cols if c.ranked and c.better]
    policies = list(dict.fromkeys(r["policy"] for r in rows if r["policy"] != FULL))
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})
    if not columns or not policies:
        return None
    cells: dict[str, dict[tuple[str, int], Any]] = {n: {} for n in policies}
    reasons: dict[str, dict[int, str]] = {n: {} for n in policies}
    modes: dict[str, str] = {}
    for r in rows:
        name, budget = r["policy"], r["budget"]
        if name == FULL:
            continue
        if r.get("mode"):
            modes[name] = r["mode"]
        for c in columns:
            cells[name][(c.key, budget)] = REFUSED if r.get("refused") else r["values"].get(c.key)
        if r.get("refused"):
            reasons[name][budget] = r["refused"]
    full = next((r["values"] for r in rows if r["policy"] == FULL), None)
    out = Ranking(columns, budgets, policies, modes, cells, reasons, full)
    out.policies = sorted(policies, key=lambda n: (bool(reasons[n]) or any(
        (columns[0].key, b) not in cells[n] for b in budgets), out.score(n)))
    return out


def ranking_markdown(cols: Sequence[Column], rows: list[dict]) -> str:
    """``ranking.md``: one row per policy in rank order (the full cache first), one column per
    ranked number and budget; the best policy of each column in bold, selection rows marked."""
    rk = ranking(cols, rows)
    if rk is None:
        return ""
    slots = [(c, b) for c in rk.columns for b in rk.measured(c)]
    head = ["rank", "policy", "mode"] + [f"{c.label} @{b}" for c, b in slots]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    if rk.full is not None:
        lines.append("| - | full cache | - | " + " | ".join(c.format(rk.full.get(c.key)) for c, _ in slots) + " |")
    best: dict[tuple[str, int], float] = {}
    for c in rk.columns:
        for b in rk.budgets:
            vals = [v for n in rk.policies if (v := _number(rk.cells[n].get((c.key, b)))) is not None]
            if vals:
                best[(c.key, b)] = min(vals) if c.better == "lower" else max(vals)
    for i, name in enumerate(rk.policies, 1):
        cells = []
        for c, b in slots:
            v = rk.cells[name].get((c.key, b))
            text = REFUSED if v == REFUSED else c.format(v)
            cells.append(f"**{text}**" if _finite(v) and v == best.get((c.key, b)) else text)
        lines.append(f"| {i} | {name} | {rk.modes.get(name, '-')} | " + " | ".join(cells) + " |")
    notes = [f"- {name} at {b}: {why}" for name in rk.policies for b, why in sorted(rk.reasons[name].items())]
    text = "\n".join(lines) + "\n"
    if notes:
        text += "\nRefused (the policy's own error, raised before any work):\n\n" + "\n".join(notes) + "\n"
    return text


def ranking_plot(folder: Path, cols: Sequence[Column], rows: list[dict]) -> Path | None:
    """``ranking.png``: one line per policy in rank order (best at the top), one panel per ranked
    number, a marker per budget; the full cache as a dashed line, selection policies in italics,
    refused budgets marked. A value off the panel's scale (see ``off_scale_nested``) is drawn at its edge
    with its figure beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rk = ranking(cols, rows)
    if rk is None:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    n = len(rk.policies)
    fig, axes = plt.subplots(1, len(rk.columns), figsize=(3.6 * len(rk.columns) + 2.2, 0.3 * n + 1.6),
                             sharey=True, squeeze=False)
    shades = plt.get_cmap("viridis")
    colors = {b: shades(0.1 + 0.75 * i / max(1, len(rk.budgets) - 1)) for i, b in enumerate(rk.budgets)}
    markers = dict(zip(rk.budgets, "o^sDv<>p", strict=False))
    ys = {name: n - 1 - i for i, name in enumerate(rk.policies)}
    for ax, c in zip(axes[0], rk.columns, strict=True):
        series: dict[str, list[float]] = {}
        for name in rk.policies:
            vals = [v for b in rk.budgets if (v := _number(rk.cells[name].get((c.key, b)))) is not None]
            if vals:
                series[name] = vals
        ref = _number(rk.full.get(c.key)) if rk.full is not None else None
        off = set(off_scale_nested(series, ref))
        shown = [v for k, vs in series.items() if k not in off for v in vs] + ([] if ref is None else [ref])
        lo, hi = (min(shown), max(shown)) if shown else (0.0, 1.0)
        pad = (hi - lo) * 0.06 or 0.01
        lo, hi = lo - pad, hi + pad
        for name in rk.policies:
            y = ys[name]
            ax.axhline(y, color="0.92", linewidth=0.6, zorder=0)
            pts = []
            clipped: list[tuple[float, float]] = []
            for b in rk.measured(c):
                v = rk.cells[name].get((c.key, b))
                if v == REFUSED:
                    # Above the row's line, where it cannot hide the budgets that did run.
                    ax.annotate(f"{b}: refused", (lo, y), xytext=(2, 3), textcoords="offset points",
                                fontsize=6, va="bottom", color="0.45")
                    continue
                value = _number(v)
                if value is None:
                    continue
                x = min(max(value, lo), hi)
                pts.append(x)
                ax.scatter([x], [y], color=colors[b], marker=markers[b], s=26, zorder=3, label=f"budget {b}")
                if x != value:
                    clipped.append((x, value))
            if clipped:  # one label per row: the figures drawn at the panel's edge, in budget order
                x = clipped[0][0]
                ax.annotate(" / ".join(c.format(v) for _, v in clipped), (x, y), xytext=(-3 if x == hi else 3, 5),
                            textcoords="offset points", fontsize=6, ha="right" if x == hi else "left", color="0.3")
            if len(pts) > 1:
                ax.plot([min(pts), max(pts)], [y, y], color="0.6", linewidth=1, zorder=2)
        if ref is not None:
            ax.axvline(ref, color="black", linestyle="--", linewidth=0.9, label="full cache")
        ax.set_xlim(lo, hi)
        arrow = {"lower": "lower is better", "higher": "higher is better"}[c.better]
        ax.set_title(f"{c.label}\n({arrow})", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
        ax.tick_params(axis="x", labelsize=7)
    axes[0][0].set_yticks([ys[n] for n in rk.policies])
    axes[0][0].set_yticklabels([f"{n} (select)" if rk.modes.get(n) == "select" else n for n in rk.policies],
                               fontsize=8)
    for label, name in zip(axes[0][0].get_yticklabels(), rk.policies, strict=True):
        if rk.modes.get(name) == "select":
            label.set_fontstyle("italic")
            label.set_color("C3")
    axes[0][0].set_ylim(-0.7, n - 0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    uniq = dict(zip(labels, handles, strict=True))
    fig.suptitle(f"policies ranked by {rk.columns[0].label}, mean over budgets (best at the top)", fontsize=10)
    fig.tight_layout()
    fig.legend(list(uniq.values()), list(uniq.keys()), fontsize=8, loc="upper center", ncol=len(uniq),
               bbox_to_anchor=(0.5, 0.0), frameon=False)
    path = folder / "ranking.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
