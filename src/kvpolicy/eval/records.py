"""Per-sample records on disk: one JSON line per finished generation, written as it finishes.

The file is both the run's per-sample data and its resume point: a sample whose record is there
is never generated again. So a valid record is never deleted. Loading checks every line:

- a line that is not a record (a hand edit, a disk fault; a field missing or of the wrong type,
  ``record_problem``) is reported (``DamagedRecordWarning``,
  with its line number) and moved aside, out of the file, into ``<file>.damaged`` beside it
  (e.g. ``samples.jsonl.damaged``; see ``set_aside`` for its form), and the file is rewritten
  without it (a new file renamed over the old one, after the line is safe in ``.damaged``);
- a final line without its newline is what a run killed mid-write leaves: moved aside the same
  way when it is not a whole record, kept (its newline added) when it is.

Appends are one ``os.write`` of the whole line to a file opened ``O_APPEND`` (POSIX keeps such a
write to a regular file whole), under an exclusive ``fcntl.flock`` of the file that loading takes
too; so two runs appending to one file never interleave within a line, and loading never reads
another run's line half-written.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import os
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..files import replace_file

# (run key, task, doc id, sample, prompt hash, settings_key of the settings it was made under)
SampleKey = tuple[str, str, str, int, str, str]

#: Appended to a record file's name for the file its damaged lines are moved to.
DAMAGED_SUFFIX = ".damaged"


class DamagedRecordWarning(UserWarning):
    """A line of a record file was not a record: it was moved aside (to ``<file>.damaged``)."""


def prompt_hash(context: str, settings: dict[str, Any]) -> str:
    """A short hash of what a sample depends on besides its index: the prompt and how it is decoded."""
    text = json.dumps([context, settings], sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def settings_key(settings: dict[str, Any] | None) -> str:
    """The settings a record was made under (model, seeds, policy: see ``KVPolicyLM.settings``) as
    part of its key: a record is reused only under equal settings. None: an older record's, unknown."""
    return json.dumps(settings, sort_keys=True)


def record_key(record: dict[str, Any]) -> SampleKey:
    return (str(record["key"]), str(record["task"]), str(record["doc_id"]), int(record["sample"]),
            str(record["prompt_hash"]), settings_key(record.get("settings")))


_NUMBER = (int, float)
#: What a record holds, by type: the fields every record has, then those that may be None (not
#: measured) or absent (older records). A line with any other type is not a record.
REQUIRED_FIELDS: dict[str, tuple[type, ...]] = {
    "key": (str,), "task": (str,), "doc_id": (str,), "sample": (int,), "prompt_hash": (str,), "response": (str,)}
OPTIONAL_FIELDS: dict[str, tuple[type, ...]] = {
    "policy": (str,), "budget": (int,), "prompt_tokens": (int,), "tokens": (int,), "finish": (str,),
    "ended": (bool,), "thought_closed": (bool,), "rep4": _NUMBER, "loop": (bool,), "loop_period": (int,),
    "loop_span": (int,), "seconds": _NUMBER, "output": (str,), "settings": (dict,)}


def _is(value: Any, types: tuple[type, ...]) -> bool:
    # bool is an int to Python, never to a record: True is not 1 token
    return isinstance(value, types) and (bool in types or not isinstance(value, bool))


def record_problem(record: Any) -> str | None:
    """Why ``record`` (parsed JSON) is not a record, or None when it is one."""
    if not isinstance(record, dict):
        return f"JSON {type(record).__name__}, not an object"
    missing = [name for name in REQUIRED_FIELDS if name not in record]
    if missing:
        return f"no {', '.join(missing)}"
    wrong = [name for name, types in REQUIRED_FIELDS.items() if not _is(record[name], types)]
    wrong += [name for name, types in OPTIONAL_FIELDS.items()
              if record.get(name) is not None and not _is(record[name], types)]
    if wrong:
        return "a wrong type: " + ", ".join(f"{name} {record[name]!r}"[:60] for name in wrong)
    if record["sample"] < 0:
        return f"sample {record['sample']} below 0"
    return None


def parse_record(line: bytes) -> tuple[dict[str, Any] | None, str]:
    """The record on ``line`` (UTF-8 JSON of an object that ``record_problem`` accepts) and "",
    else None and why not."""
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:  # a ValueError: first
        return None, "not a record: not UTF-8"
    except (ValueError, RecursionError):
        return None, "not a record: not JSON"
    why = record_problem(record)
    return (None, f"not a record: {why}") if why else (record, "")


def damaged_path(path: Path) -> Path:
    """Where the damaged lines of the record file ``path`` are moved: ``<path>.damaged``."""
    return path.with_name(path.name + DAMAGED_SUFFIX)


@contextmanager
def _locked(path: Path, flags: int) -> Iterator[int]:
    """A descriptor of ``path`` (opened with ``flags``, created if missing) under an exclusive
    ``flock``. A loader may replace the file while we wait for the lock: the lock is then on the
    old file, so it is taken again on the file the path names now."""
    while True:
        fd = os.open(path, flags | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            held, now = os.fstat(fd), os.stat(path)
            if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):
                break
        except FileNotFoundError:  # replaced and not yet renamed in: try again
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield fd
    finally:
        os.close(fd)  # releases the lock


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_all(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def _excerpt(line: bytes, width: int = 80) -> str:
    text = line.decode("utf-8", errors="replace")
    return repr(text if len(text) <= width else text[:width] + "...")


def set_aside(path: Path, damaged: list[tuple[int, bytes, str]]) -> Path:
    """Append the ``(line number, bytes without the newline, why)`` of damaged lines of ``path`` to ``<path>.damaged``,
    one JSON object a line: ``file``, ``line`` (1-based, in the file as it was), ``why``, ``moved_at``
    (UTC), ``text`` (the bytes as UTF-8, undecodable bytes replaced) and ``base64`` (the bytes
    exactly). Returns that path; it is flushed to disk when this returns."""
    aside = damaged_path(path)
    moved_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out = b"".join(
        json.dumps({"file": path.name, "line": n, "why": why, "moved_at": moved_at,
                    "text": raw.decode("utf-8", errors="replace"),
                    "base64": base64.b64encode(raw).decode("ascii")}).encode("utf-8") + b"\n"
        for n, raw, why in damaged
    )
    with _locked(aside, os.O_WRONLY | os.O_APPEND) as fd:
        _write_all(fd, out)
        os.fsync(fd)
    return aside


def warn_damaged(path: Path, damaged: list[tuple[int, bytes, str]], aside: Path, stacklevel: int = 2) -> None:
    """One ``DamagedRecordWarning`` per line of ``path`` moved to ``aside``."""
    for n, line, why in damaged:
        warnings.warn(f"{path}: line {n} is {why}; moved to {aside}: {_excerpt(line)}",
                      DamagedRecordWarning, stacklevel=stacklevel + 1)


class SampleStore:
    """Records in a JSONL file (``path``), indexed by ``record_key``; ``None`` path: memory only."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = None if path is None else Path(path)
        self._records: dict[SampleKey, dict[str, Any]] = {}
        if self.path is not None and self.path.is_file():
            self._load()

    def _load(self) -> None:
        assert self.path is not None
        with _locked(self.path, os.O_RDONLY) as fd:  # a sound file needs no write permission
            raw = _read_all(fd)
            lines = raw.split(b"\n")
            tail = lines.pop()  # b"" when the file ends with its newline
            kept: list[bytes] = []
            damaged: list[tuple[int, bytes, str]] = []
            for n, line in enumerate(lines, start=1):
                record, why = parse_record(line)
                if record is None:
                    damaged.append((n, line, why))
                    continue
                self._records[record_key(record)] = record
                kept.append(line + b"\n")
            if tail:
                record, _ = parse_record(tail)
                if record is None:  # a run killed mid-write
                    damaged.append((len(lines) + 1, tail, "a torn last line (no newline): not a whole record"))
                else:  # whole but for its newline: kept, and the newline added so appends start a line
                    self._records[record_key(record)] = record
                    kept.append(tail + b"\n")
            if not damaged:
                if tail:  # only a newline missing: add it (under the lock held), so appends start a line
                    out = os.open(self.path, os.O_WRONLY | os.O_APPEND)
                    try:
                        _write_all(out, b"\n")
                        os.fsync(out)
                    finally:
                        os.close(out)
                return
            aside = set_aside(self.path, damaged)  # safe there before the file loses them
            replace_file(self.path, b"".join(kept))
        warn_damaged(self.path, damaged, aside, stacklevel=3)

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self._records.values())

    def get(self, key: SampleKey) -> dict[str, Any] | None:
        return self._records.get(key)

    def for_run(self, run_key: str) -> list[dict[str, Any]]:
        return [r for r in self._records.values() if r["key"] == run_key]

    def add(self, record: dict[str, Any]) -> None:
        """Keep ``record`` and append it to the file at once (one write, under the file's lock, synced)."""
        self._records[record_key(record)] = record
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = (json.dumps(record, default=str, ensure_ascii=False) + "\n").encode("utf-8")
        with _locked(self.path, os.O_WRONLY | os.O_APPEND) as fd:
            _write_all(fd, line)
            os.fsync(fd)
