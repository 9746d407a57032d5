"""Quality against fast-tier bytes for eviction, two tiers and selection (``docs/img/two-tiers.png``),
drawn from the two-tier table in ``docs/findings.md``, and the fast-tier bytes that table lists.

    python benchmarks/two_tier_plot.py [--findings docs/findings.md] [--out docs/img]
    python benchmarks/two_tier_plot.py --bytes S I R P SUMMARY   # one configuration's fast MiB

The table is the one whose header starts ``| kind | policy | attended | fast MiB | PPL / full |``.
Fast-tier bytes are what the issue counts: the kept slots at their most (``budget + interval``
per head), the recall buffer and the slow tier's summaries with their bookkeeping, on the bundled
model (30 layers, 3 KV heads of 64, float32: a slot is a key, a value and an int64 position, 520
bytes) after the ranking protocol's 4,096 tokens; a selecting policy keeps every token fast.
Query windows are left out (eviction and two tiers hold the same one).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAD = ("kind", "policy", "attended", "fast MiB", "PPL / full")
LAYERS, KV_HEADS, D, DTYPE_BYTES, TOKENS = 30, 3, 64, 4, 4096
SLOT = 2 * D * DTYPE_BYTES + 8
#: Fast bytes per page of one layer and head, besides its summaries: valid (1), age (4), score (4).
PAGE_BOOKKEEPING = 9
#: Bytes of one page's summaries: landmark (one D-vector) or quest (two), float32 or int8 + scale.
SUMMARY = {"landmark": D * DTYPE_BYTES, "quest": 2 * D * DTYPE_BYTES, "landmark-int8": D + 4, "quest-int8": 2 * (D + 4)}


def fast_bytes(budget: int, interval: int, recall: int = 0, page: int = 1, summary: str | None = None) -> int:
    """Fast-tier bytes of a sequence after ``TOKENS`` tokens: eviction at ``budget`` every
    ``interval`` tokens, plus a recall buffer of ``recall`` slots in pages of ``page`` whose
    summaries are ``summary`` (``SUMMARY``'s keys); every eviction evicts ``interval`` tokens."""
    per_head = (budget + interval + recall) * SLOT
    if recall or summary:
        evictions = (TOKENS - budget - interval) // interval + 1 if TOKENS >= budget + interval else 0
        pages = evictions * -(-interval // page)
        per_head += (recall // page) * 8 + pages * (SUMMARY[summary or "landmark"] + PAGE_BOOKKEEPING)
    return per_head * LAYERS * KV_HEADS


def read_table(text: str) -> list[dict[str, str]]:
    lines = text.splitlines()
    for i, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and tuple(cells[: len(HEAD)]) == HEAD:
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append(dict(zip(cells, [c.strip().strip("*") for c in row.strip().strip("|").split("|")],
                                     strict=False)))
            return rows
    raise ValueError(f"no table whose header starts '| {' | '.join(HEAD)} |'")


def plot(rows: list[dict[str, str]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    style = {"eviction": ("o", "tab:gray"), "two tiers": ("s", "tab:blue"), "selection": ("^", "tab:red")}
    fig, ax = plt.subplots(figsize=(8, 5))
    for kind, (marker, color) in style.items():
        mine = [r for r in rows if r["kind"] == kind]
        if not mine:
            continue
        xs = [float(r["fast MiB"]) for r in mine]
        ys = [float(r["PPL / full"]) for r in mine]
        ax.scatter(xs, ys, marker=marker, color=color, label=kind, zorder=3)
        for r, x, y in zip(mine, xs, ys, strict=True):
            ax.annotate(f"{r['policy']} ({r['attended']})", (x, y), fontsize=7, xytext=(4, 3),
                        textcoords="offset points", color=color)
    ax.set_xscale("log")
    ax.set_xlabel("fast-tier MiB per sequence after 4,096 tokens (kept + recall buffer + summaries)")
    ax.set_ylabel("perplexity / full cache")
    ax.set_title("Quality against fast-tier bytes (bundled model, ranking protocol)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "two-tiers.png"
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--findings", default=str(ROOT / "docs" / "findings.md"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "img"))
    ap.add_argument("--bytes", nargs=5, metavar=("BUDGET", "INTERVAL", "RECALL", "PAGE", "SUMMARY"),
                    help="print one configuration's fast-tier MiB (SUMMARY: none, landmark, quest, landmark-int8, "
                         "quest-int8)")
    args = ap.parse_args(argv)
    if args.bytes:
        budget, interval, recall, page, summary = args.bytes
        n = fast_bytes(int(budget), int(interval), int(recall), int(page), None if summary == "none" else summary)
        print(f"{n / 2**20:.2f} MiB")
        return 0
    path = plot(read_table(Path(args.findings).read_text(encoding="utf-8")), Path(args.out))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
