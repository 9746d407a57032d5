"""Progress for long runs as plain lines, for logs, pipes and batch jobs (no terminal needed).

A terminal gets rich's live bars (:func:`kvpolicy.eval.report.progress_bar`); anything else gets
these lines, each complete on its own, with a rate and an ETA::

    kvpolicy: [2/6] snapkv@512 done in 4m12s; elapsed 8m30s, ETA 17m00s
    kvpolicy: snapkv@512 gsm8k: 40/120 samples, 212.4 tok/s, elapsed 3m02s, ETA 6m04s
"""

from __future__ import annotations

import sys
import time
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

    def update(self, n: int = 1, tokens: int = 0) -> None:
        self.done += n
        self.tokens += tokens
        last = self.total is not None and self.done >= self.total
        if last or (self.every and (self.done - self.skipped) % self.every == 0):
            self.print()

    def line(self) -> str:
        elapsed = time.perf_counter() - self.start
        count = f"{self.done}/{self.total}" if self.total is not None else str(self.done)
        parts = [f"{PREFIX} {self.label}: {count} {self.unit}"]
        if self.tokens and elapsed > 0:
            parts.append(f"{self.tokens / elapsed:.1f} tok/s")
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

    def update(self, task_id: int, description: str | None = None, **_: Any) -> None:
        task = self._tasks.get(task_id)
        if task is not None and description is not None:
            task["description"] = description
            task["item_start"] = time.perf_counter()

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
            line += f", ETA {format_duration(elapsed / done * (total - done))}"
        self.console.print(line, highlight=False, markup=False, soft_wrap=True)

    def remove_task(self, task_id: int) -> None:
        self._tasks.pop(task_id, None)
