"""``benchmarks/long_decode_bench.py`` runs against the current API (the GPU check calls it).

A tiny run: the numbers are not checked, only that every cache decodes and that the selection
policies' choosing time is really measured (through the executor's ``timer`` hook)."""

from __future__ import annotations

import math

import torch
from helpers import load_benchmark

long_decode_bench = load_benchmark("long_decode_bench")


def test_every_cache_decodes_and_choosing_is_timed_then_unwrapped():
    from kvpolicy.executor import Executor

    before = Executor.choose
    results = long_decode_bench.run(
        [160], ["full", "dense", "quest", "quest-pages", "vase-attnv@select"], budget=96, steps=2, trials=1, batch=1,
        device=torch.device("cpu"), dtype=torch.float32, log=lambda *_: None)
    assert Executor.choose is before  # timed through the hook: nothing is patched
    row = results[160]
    assert set(row) == {"full", "dense", "quest", "quest-pages", "vase-attnv@select"}
    for name, r in row.items():
        assert r["tok_s"] > 0 and math.isfinite(r["ratio"]), name
    assert row["full"]["choosing"] is None and row["dense"]["choosing"] is None
    # quest chooses at every step; vase-attnv@select every 64 steps, so not in these two
    for name in ("quest", "quest-pages"):
        share = row[name]["choosing"]
        assert share is not None and 0 < share < 1, (name, share)
    assert row["vase-attnv@select"]["choosing"] is not None
    table = long_decode_bench.table(results, "t")
    assert "| quest |" in table
