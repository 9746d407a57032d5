"""Per-sample records on disk (``kvpolicy.eval.records``): a valid record is never deleted, damaged
lines are reported and moved aside, concurrent appends stay whole lines."""

from __future__ import annotations

import base64
import json
import multiprocessing
import os
import tempfile
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy.eval.records import DamagedRecordWarning, SampleStore, damaged_path, record_key


def _record(i: int, response: str | None = None, run: str = "snapkv@96") -> dict:
    return {"key": run, "task": "t", "doc_id": str(i), "sample": 0, "prompt_hash": "h",
            "response": f"r{i}" if response is None else response}


def _line(record: dict) -> bytes:
    return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")


def _key(record: dict) -> tuple:
    return record_key(record)


def _aside(path: Path) -> list[dict]:
    side = damaged_path(path)
    return [json.loads(x) for x in side.read_bytes().split(b"\n") if x] if side.exists() else []


def _load(path: Path) -> tuple[SampleStore, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = SampleStore(path)
    assert all(issubclass(w.category, DamagedRecordWarning) for w in caught)
    return store, [str(w.message) for w in caught]


def test_a_damaged_middle_line_and_a_torn_tail_lose_no_valid_record(tmp_path):
    """The reported case: six records, the third damaged, a torn last line. Before, loading stopped
    at line 3 and truncated the file there (two records kept, three valid ones deleted, no word)."""
    path = tmp_path / "samples.jsonl"
    lines = [_line(_record(i)) for i in range(6)]
    lines[2] = lines[2].replace(b'"doc_id"', b'"doc_#d', 1)  # a hand edit or a flipped byte
    torn = _line(_record(6))[:30]  # killed mid-write
    path.write_bytes(b"".join(lines) + torn)

    store, messages = _load(path)
    assert sorted(r["doc_id"] for r in store) == ["0", "1", "3", "4", "5"]
    for i in (0, 1, 3, 4, 5):
        assert store.get(_key(_record(i))) == _record(i)
    assert path.read_bytes() == b"".join(lines[:2] + lines[3:])  # every valid line, byte for byte

    assert len(messages) == 2
    assert "line 3 " in messages[0] and "not a record" in messages[0]
    assert "line 7 " in messages[1] and "torn" in messages[1]
    assert all(str(damaged_path(path)) in m for m in messages)
    aside = _aside(path)
    assert [a["line"] for a in aside] == [3, 7]
    assert [base64.b64decode(a["base64"]) for a in aside] == [lines[2].rstrip(b"\n"), torn]
    assert aside[0]["text"] == lines[2].rstrip(b"\n").decode() and aside[0]["file"] == "samples.jsonl"

    store.add(_record(6))  # the lost sample, generated again, starts a fresh line
    again, messages = _load(path)
    assert messages == [] and len(again) == 6 and again.get(_key(_record(6))) == _record(6)
    assert len(_aside(path)) == 2  # nothing moved twice


def test_a_whole_last_record_missing_only_its_newline_is_kept():
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "samples.jsonl"
        path.write_bytes(_line(_record(0)) + _line(_record(1)).rstrip(b"\n"))
        store, messages = _load(path)
        assert messages == [] and len(store) == 2
        assert path.read_bytes() == _line(_record(0)) + _line(_record(1))
        assert not damaged_path(path).exists()


@pytest.mark.parametrize(
    ("text", "why"),
    [(b"", "a blank line"), (b"[1, 2]", "JSON, not an object"), (b'{"key": "a"}', "fields missing"),
     (b'{"key": "a", "task": "t", "doc_id": "1", "sample": "x", "prompt_hash": "h"}', "sample not a number"),
     (b'{"key": "\xff", "task": "t", "doc_id": "1", "sample": 0, "prompt_hash": "h"}', "not UTF-8")],
)
def test_lines_that_are_not_records_are_moved_aside(tmp_path, text, why):
    path = tmp_path / "samples.jsonl"
    path.write_bytes(_line(_record(0)) + text + b"\n" + _line(_record(1)))
    store, messages = _load(path)
    assert len(store) == 2, why
    assert len(messages) == 1 and "line 2 " in messages[0]
    assert [base64.b64decode(a["base64"]) for a in _aside(path)] == [text]
    assert path.read_bytes() == _line(_record(0)) + _line(_record(1))


@pytest.mark.parametrize(
    ("edit", "why"),
    [({"response": ...}, "no response"), ({"response": None}, "a wrong type: response None"),
     ({"tokens": "many"}, "a wrong type: tokens 'many'"), ({"response": 5}, "a wrong type: response 5"),
     ({"sample": True}, "a wrong type: sample True"), ({"sample": -1}, "sample -1 below 0"),
     ({"rep4": "x", "loop": 1}, "a wrong type: rep4 'x', loop 1"), ({"doc_id": 7}, "a wrong type: doc_id 7")],
)
def test_a_line_with_every_key_field_but_a_bad_field_is_not_a_record(tmp_path, edit, why):
    """Reported: a record without its response (KeyError on reuse), with "tokens": "many" (a
    TypeError in grading) or "response": null (graded as the text "None") passed as a record.
    (``...`` in ``edit``: the field deleted.)"""
    bad = {k: v for k, v in {**_record(1), **edit}.items() if v is not ...}
    path = tmp_path / "samples.jsonl"
    path.write_bytes(_line(_record(0)) + _line(bad) + _line(_record(2)))
    store, messages = _load(path)
    assert sorted(r["doc_id"] for r in store) == ["0", "2"]
    assert len(messages) == 1 and f"line 2 is not a record: {why}" in messages[0]
    assert [json.loads(base64.b64decode(a["base64"])) for a in _aside(path)] == [bad]
    assert path.read_bytes() == _line(_record(0)) + _line(_record(2))


# -- any damage to any byte --------------------------------------------------------------------------
_records = st.lists(st.text(max_size=12), min_size=1, max_size=6).map(
    lambda texts: [_record(i, t) for i, t in enumerate(texts)]
)
_edit = st.tuples(st.sampled_from(["replace", "delete", "insert"]), st.floats(0, 1, exclude_max=True),
                  st.integers(0, 255))


def _damage(data: bytes, edits: list[tuple[str, float, int]], cut: float | None) -> bytes:
    for kind, where, value in edits:
        i = int(where * len(data))
        if kind == "replace":
            data = data[:i] + bytes([value if value != data[i] else (value + 1) % 256]) + data[i + 1 :]
        elif kind == "delete":
            data = data[:i] + data[i + 1 :]
        else:
            data = data[:i] + bytes([value]) + data[i:]
    return data if cut is None else data[: int(cut * len(data))]


@settings(max_examples=300)
@given(records=_records, edits=st.lists(_edit, min_size=1, max_size=3),
       cut=st.none() | st.floats(0, 1, exclude_max=True))
def test_any_damage_keeps_every_valid_record_and_every_line(records, edits, cut):
    original = b"".join(_line(r) for r in records)
    damaged = _damage(original, edits, cut)
    pieces = damaged.split(b"\n")
    whole, tail = pieces[:-1], pieces[-1]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "samples.jsonl"
        path.write_bytes(damaged)
        store, messages = _load(path)
        after = path.read_bytes()
        aside = _aside(path)

        # Every line that is still one of the records written is loaded and kept in the file.
        written = {_line(r).rstrip(b"\n"): r for r in records}
        numbered = dict(enumerate([*whole, tail] if tail else whole, start=1))
        moved = {a["line"]: base64.b64decode(a["base64"]) for a in aside}
        for n, p in numbered.items():
            if p in written:
                assert store.get(_key(written[p])) == written[p] and n not in moved
        # Nothing is lost: each line is kept, byte for byte and in order, or moved aside whole.
        assert all(numbered[n] == p for n, p in moved.items())
        assert after == b"".join(p + b"\n" for n, p in numbered.items() if n not in moved)
        # Each moved line was reported once, by its number; the loaded records are the file's.
        assert len(messages) == len(moved)
        for n, m in zip(sorted(moved), messages, strict=True):
            assert f"line {n} " in m
        assert sorted(map(_key, store)) == sorted({_key(json.loads(x)) for x in after.split(b"\n") if x})
        # Loading again finds nothing wrong and changes nothing.
        again, messages = _load(path)
        assert messages == [] and path.read_bytes() == after and len(again) == len(store)


# -- two runs sharing a folder -----------------------------------------------------------------------
def _append_many(path: str, run: str, n: int, size: int) -> None:
    store = SampleStore(path)
    for i in range(n):
        store.add(_record(i, response=run[-1] * size * (1 + i % 3), run=run))


def _damage_and_load(path: str, rounds: int) -> None:
    """A second run that keeps finding a damaged line: each load rewrites the file (a rename)."""
    for i in range(rounds):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, f"damaged {i}\n".encode())
        os.close(fd)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DamagedRecordWarning)
            SampleStore(path)


def test_two_runs_appending_at_once_never_interleave_within_a_line(tmp_path):
    path = tmp_path / "samples.jsonl"
    ctx = multiprocessing.get_context("fork")  # the children only write files
    n, size = 200, 40_000  # lines of 40 to 120 kB: several writes each without one os.write per line
    procs = [ctx.Process(target=_append_many, args=(str(path), run, n, size)) for run in ("run-a", "run-b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    store, messages = _load(path)
    assert messages == [] and not damaged_path(path).exists()
    assert len(store) == 2 * n
    for run in ("run-a", "run-b"):
        for i in range(n):
            assert store.get(_key(_record(i, run=run))) == _record(i, run[-1] * size * (1 + i % 3), run)


def test_appends_while_another_run_rewrites_the_file_are_not_lost(tmp_path):
    """A load that moves a damaged line aside renames a new file over the old one; an append waiting
    for the old file's lock must land in the new file."""
    path = tmp_path / "samples.jsonl"
    ctx = multiprocessing.get_context("fork")
    n = 400
    procs = [ctx.Process(target=_append_many, args=(str(path), "run-a", n, 100)),
             ctx.Process(target=_damage_and_load, args=(str(path), 100))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DamagedRecordWarning)
        store = SampleStore(path)
    assert sorted(int(r["doc_id"]) for r in store) == list(range(n))
    assert sorted(a["text"] for a in _aside(path)) == sorted(f"damaged {i}" for i in range(100))
