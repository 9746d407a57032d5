"""Per-sample records on disk: one JSON line per finished generation, written as it finishes.

The file is both the run's per-sample data and its resume point: a sample whose record is there
is never generated again. A run killed mid-write leaves at most one partial last line, which is
ignored (and overwritten by the next append).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SampleKey = tuple[str, str, str, int, str]  # (run key, task, doc id, sample, prompt hash)


def prompt_hash(context: str, settings: dict[str, Any]) -> str:
    """A short hash of what a sample depends on besides its index: the prompt and how it is decoded."""
    text = json.dumps([context, settings], sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def record_key(record: dict[str, Any]) -> SampleKey:
    return (str(record["key"]), str(record["task"]), str(record["doc_id"]), int(record["sample"]),
            str(record["prompt_hash"]))


class SampleStore:
    """Records in a JSONL file (``path``), indexed by ``record_key``; ``None`` path: memory only."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = None if path is None else Path(path)
        self._records: dict[SampleKey, dict[str, Any]] = {}
        if self.path is not None and self.path.is_file():
            self._load()

    def _load(self) -> None:
        assert self.path is not None
        raw = self.path.read_bytes()
        good = 0
        for line in raw.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break  # a partial last line from a killed run
            try:
                record = json.loads(line)
                self._records[record_key(record)] = record
            except (ValueError, KeyError, TypeError):
                break
            good += len(line)
        if good < len(raw):  # drop the torn tail so appends start on a fresh line
            with self.path.open("r+b") as f:
                f.truncate(good)

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self._records.values())

    def get(self, key: SampleKey) -> dict[str, Any] | None:
        return self._records.get(key)

    def for_run(self, run_key: str) -> list[dict[str, Any]]:
        return [r for r in self._records.values() if r["key"] == run_key]

    def add(self, record: dict[str, Any]) -> None:
        """Keep ``record`` and append it to the file at once (flushed to the OS)."""
        self._records[record_key(record)] = record
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps(record, default=str, ensure_ascii=False) + "\n"
        with self.path.open("a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
