"""Progress for long runs as plain lines, for logs, pipes and batch jobs (no terminal needed).

A terminal gets rich's live bars (:func:`kvpolicy.eval.report.progress_bar`); anything else gets
these lines, each complete on its own, with a rate and an ETA::

    kvpolicy: [2/6] snapkv@512 done in 4m12s; elapsed 8m30s, ETA 17m00s
    kvpolicy: snapkv@512 gsm8k: 40/120 samples, 212.4 tok/s, elapsed 3m02s, ETA 6m04s
    kvpolicy: snapkv-recall@512 gsm8k: 40/120 samples, 198.0 tok/s, moved 1.2 GiB (41.3 KiB/tok), ...

(the second: a two-tier policy, with the bytes its recalls moved from the slow tier to the fast one).

The ETA of a run's pairs (``PairEta``) weighs each pair by what pairs like it took: a selection
pair runs the policy at every decoded token and costs several evicting pairs.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

PREFIX = "kvpolicy:"


def format_duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``1h02m``."""
    if seconds != seconds or seconds < 0:  # NaN or negative
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def format_bytes(n: float) -> str:
    """``512 B``, ``41.3 KiB``, ``1.2 GiB``."""
    units, i = ("B", "KiB", "MiB", "GiB"), 0
    while abs(n) >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"


class LineProgress:
    """Counts finished items and prints a line every ``every`` items (and at the last one).

    Args:
        label: what is counted, e.g. ``"snapkv@512 gsm8k"``.
        total: items expected (None if unknown: no ETA).
        every: items between lines (0: only the last; negative: no lines at all).
        unit: the items' name in the line.
        stream: where lines go (default ``sys.stderr``, flushed at once).
    """

    def __init__(
        self, label: str, total: int | None, *, every: int = 10, unit: str = "samples",
        stream: TextIO | None = None, done: int = 0,
    ) -> None:
        self.label = label
        self.total = total
        self.silent = every < 0
        self.every = max(0, every)
        self.unit = unit
        self.stream = stream
        self.start = time.perf_counter()
        self.skipped = done  # already done before this run (resumed): no time spent on them
        self.done = done
        self.tokens = 0
        self.moved: int | None = None  # bytes a two-tier policy moved (slow tier -> fast); None: one tier

    def update(self, n: int = 1, tokens: int = 0, moved: int | None = None) -> None:
        """``n`` more items done, ``tokens`` more generated, and (a two-tier policy) ``moved``
        more bytes moved from the slow tier to the fast one."""
        self.done += n
        self.tokens += tokens
        if moved is not None:
            self.moved = (self.moved or 0) + moved
        last = self.total is not None and self.done >= self.total
        if last or (self.every and (self.done - self.skipped) % self.every == 0):
            self.print()

    def line(self) -> str:
        elapsed = time.perf_counter() - self.start
        count = f"{self.done}/{self.total}" if self.total is not None else str(self.done)
        parts = [f"{PREFIX} {self.label}: {count} {self.unit}"]
        if self.tokens and elapsed > 0:
            parts.append(f"{self.tokens / elapsed:.1f} tok/s")
        if self.moved is not None:
            per = f" ({format_bytes(self.moved / self.tokens)}/tok)" if self.tokens else ""
            parts.append(f"moved {format_bytes(self.moved)}{per}")
        parts.append(f"elapsed {format_duration(elapsed)}")
        ran = self.done - self.skipped
        if self.total is not None and ran > 0 and self.done < self.total:
            parts.append(f"ETA {format_duration(elapsed / ran * (self.total - self.done))}")
        return ", ".join(parts)

    def print(self, line: str | None = None) -> None:
        if self.silent:
            return
        stream = self.stream or sys.stderr
        print(self.line() if line is None else line, file=stream, flush=True)


#: What a pair costs against an evicting pair, used only until a pair of its kind has been timed.
#: From the default comparison on the bundled model (CPU): the full cache took about as long as
#: an evicting pair (16 s), a selection pair about 6 times as long (1 min 40 s).
PRIOR_WEIGHT = {"full": 1.0, "evict": 1.0, "select": 6.0}
_KIND_NAMES = {"full": "full-cache", "evict": "evicting", "select": "selection"}


class PairEta:
    """The time left in a run of pairs of unequal cost.

    ``pairs`` are ``(key, policy, kind)`` for each pair to run, ``kind`` one of ``"full"``,
    ``"evict"`` and ``"select"``. A pair still to run is estimated by the mean time of the finished
    pairs (1) of the same policy (at other budgets), else (2) of the same kind, else (3) of any
    kind, each scaled by ``PRIOR_WEIGHT`` of its kind against the pair's own: a guess, which
    ``text`` says.
    """

    def __init__(self, pairs: Sequence[tuple[str, str, str]]) -> None:
        unknown = {kind for _, _, kind in pairs} - set(PRIOR_WEIGHT)
        if unknown:
            raise ValueError(f"unknown kind(s) of pair {sorted(unknown)}; known: {', '.join(PRIOR_WEIGHT)}")
        self.pending = {key: (policy, kind) for key, policy, kind in pairs}
        self.finished: list[tuple[str, str, float]] = []  # (policy, kind, seconds)

    def done(self, key: str, seconds: float) -> None:
        """Pair ``key`` finished in ``seconds``."""
        policy, kind = self.pending.pop(key)
        self.finished.append((policy, kind, seconds))

    def _estimate(self, policy: str, kind: str) -> tuple[float, bool]:
        """Seconds for one pair, and whether it is a guess (no pair of its kind timed yet)."""
        same_policy = [s for p, k, s in self.finished if p == policy and k == kind]
        if same_policy:
            return sum(same_policy) / len(same_policy), False
        same_kind = [s for _, k, s in self.finished if k == kind]
        if same_kind:
            return sum(same_kind) / len(same_kind), False
        units = [s / PRIOR_WEIGHT[k] for _, k, s in self.finished]
        return sum(units) / len(units) * PRIOR_WEIGHT[kind], True

    def remaining(self) -> tuple[float, list[str]] | None:
        """Seconds left, and the kinds still untimed among the pairs left (the guessed part);
        None before any pair has finished."""
        if not self.finished:
            return None
        total, guessed = 0.0, []
        for policy, kind in self.pending.values():
            seconds, guess = self._estimate(policy, kind)
            total += seconds
            if guess and kind not in guessed:
                guessed.append(kind)
        return total, guessed

    def text(self) -> str | None:
        """``"12m30s"``, ``"~12m30s (no selection pair timed yet)"`` when part of it is a guess,
        ``"0s"`` when nothing is left, None before any pair has finished."""
        left = self.remaining()
        if left is None:
            return None
        seconds, guessed = left
        if not guessed:
            return format_duration(seconds)
        kinds = " or ".join(_KIND_NAMES[k] for k in guessed)
        return f"~{format_duration(seconds)} (no {kinds} pair timed yet)"


class LineBars:
    """The part of ``rich.progress.Progress``'s API that the runner uses, printing a line per
    finished top-level item (a policy x budget pair) instead of drawing bars."""

    def __init__(self, console: Any) -> None:
        self.console = console
        self._tasks: dict[int, dict[str, Any]] = {}
        self._next = 0

    def add_task(self, description: str, total: float | None = None, **_: Any) -> int:
        task_id = self._next
        self._next += 1
        self._tasks[task_id] = {"description": description, "total": total, "done": 0,
                                "start": time.perf_counter(), "item_start": time.perf_counter(),
                                "top": task_id == 0}
        return task_id

    def update(self, task_id: int, description: str | None = None, **fields: Any) -> None:
        """As rich's: a new ``description`` starts the next item; an ``eta`` field (a text, or
        None for unknown) replaces the line's own ETA, which assumes items of equal cost."""
        task = self._tasks.get(task_id)
        if task is None:
            return
        if description is not None:
            task["description"] = description
            task["item_start"] = time.perf_counter()
        if "eta" in fields:
            task["eta"] = fields["eta"]

    def advance(self, task_id: int, advance: float = 1) -> None:
        task = self._tasks.get(task_id)
        if task is None:
            return
        task["done"] += advance
        if not task["top"]:
            return
        now = time.perf_counter()
        elapsed = now - task["start"]
        total, done = task["total"], int(task["done"])
        line = (f"{PREFIX} [{done}/{total}] {task['description'].strip()} done in "
                f"{format_duration(now - task['item_start'])}; elapsed {format_duration(elapsed)}")
        if total and done < total:
            eta = task["eta"] if "eta" in task else format_duration(elapsed / done * (total - done))
            if eta:
                line += f", ETA {eta}"
        self.console.print(line, highlight=False, markup=False, soft_wrap=True)

    def remove_task(self, task_id: int) -> None:
        self._tasks.pop(task_id, None)
