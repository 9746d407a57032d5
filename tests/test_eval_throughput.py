"""The throughput setting: ``speed`` with several rows decoded together (``speed.batch``)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("reasoning_gym")
pytest.importorskip("matplotlib")

from test_eval_e2e import build_tiny_model  # noqa: E402

from kvpolicy.eval.cli import main  # noqa: E402


def test_batched_speed_reports_throughput_memory_and_eviction_time(tmp_path, capsys):
    model = build_tiny_model(tmp_path / "tiny")
    run = tmp_path / "run"
    rc = main(["eval", "--model", str(model), "--metrics", "speed", "--policies", "snapkv", "vase-attnv",
               "--budgets", "96", "--set", "speed.batch=4", "--set", "speed.context=100",
               "--set", "speed.new_tokens=300", "--out", str(run), "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    rows = {r["key"]: r["values"] for r in json.loads((run / "metrics.json").read_text())["rows"]}
    assert set(rows) == {"full", "snapkv@96", "vase-attnv@96"}
    for key, v in rows.items():
        assert v["tokens_per_s"] > 0 and v["peak_mib"] > 0
        assert (v["evict_share"] > 0) == (key != "full")
    # The throughput setting: a short prompt, a long output. The full cache ends holding 4 x 400
    # tokens; a policy never more than budget + interval slots per row (plus its query window).
    assert rows["snapkv@96"]["kv_mib"] < rows["full"]["kv_mib"]
    # what is held never exceeds the room; a full cache (a DynamicCache) holds exactly its tensors
    assert all(0 < v["kv_held_mib"] <= v["kv_mib"] for v in rows.values())
    assert rows["full"]["kv_held_mib"] == rows["full"]["kv_mib"]
