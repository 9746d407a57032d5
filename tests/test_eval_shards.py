"""The tools that run one configuration in pieces (``benchmarks/start_shard.py``,
``benchmarks/merge_runs.py``): a piece starts from another's full-cache row without running it
again, a pair whose metrics ran in two pieces merges to the union, and a mismatch stops them; and
``benchmarks/seed_spread.py``, a policy over seeds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import load_benchmark

from kvpolicy.eval.cli import main as kvpolicy_main

pytest.importorskip("matplotlib")


def _rows(run: Path) -> dict[str, dict]:
    return {json.loads(x)["key"]: json.loads(x) for x in (run / "results.jsonl").read_text().splitlines() if x.strip()}


def test_pieces_reuse_the_full_cache_and_merge_to_the_whole_run(tmp_path, capsys):
    from test_eval_e2e import build_tiny_model

    start_shard, merge_runs = load_benchmark("start_shard"), load_benchmark("merge_runs")
    model = build_tiny_model(tmp_path / "tiny")
    first = tmp_path / "first"
    settings = ["--set", "perplexity.tokens=200", "--set", "fidelity.prompts=1", "--set", "fidelity.new_tokens=24",
                "--set", "fidelity.free_running=false", "--no-progress"]
    assert kvpolicy_main(["eval", "--model", str(model), "--policies", "streamingllm", "snapkv", "--budgets", "96",
                          "--metrics", "perplexity", "fidelity", "--out", str(first), *settings]) == 0
    whole = _rows(first)
    config = tmp_path / "config.yaml"  # the whole configuration: both policies, both metrics
    config.write_text((first / "config.yaml").read_text())

    # Two pieces of snapkv, one metric each, both started from the first run's full-cache row.
    pieces = []
    for metric in ("perplexity", "fidelity"):
        piece = tmp_path / metric
        assert start_shard.main([str(config), str(piece), "--from", str(first), "--policies", "snapkv",
                                 "--metrics", metric]) == 0
        assert kvpolicy_main(["eval", "--resume", str(piece), "--no-progress"]) == 0
        rows = _rows(piece)
        assert rows["full"] == whole["full"]  # copied, not run again (its seconds too)
        assert set(rows) == {"full", "snapkv@96"}
        pieces.append(piece)
    assert "ppl_ratio" in _rows(pieces[0])["snapkv@96"]["values"]
    assert "agreement" in _rows(pieces[1])["snapkv@96"]["values"]

    # The pieces and the first run's streamingllm merge to the whole run's figures.
    only_streaming = tmp_path / "streaming"
    only_streaming.mkdir()
    for name in ("config.yaml", "reference.json", "predictions.jsonl"):
        (only_streaming / name).write_text((first / name).read_text())
    (only_streaming / "results.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for k, r in whole.items() if k != "snapkv@96"))
    merged = tmp_path / "merged"
    assert merge_runs.main([str(config), str(merged), str(only_streaming), *map(str, pieces)]) == 0
    rows = _rows(merged)
    assert set(rows) == set(whole)
    for key, row in whole.items():
        assert rows[key]["values"] == row["values"], key  # deterministic: the same figures in pieces
    assert rows["snapkv@96"]["seconds"] == pytest.approx(
        sum(_rows(p)["snapkv@96"]["seconds"] for p in pieces), abs=0.02)
    metrics = {p["metric"] for p in map(json.loads, (merged / "predictions.jsonl").read_text().splitlines())
               if p["key"] == "snapkv@96"}
    assert "fidelity" in metrics
    assert kvpolicy_main(["eval", "--report", str(merged), "--no-progress"]) == 0
    assert "snapkv" in (merged / "ranking.md").read_text()

    # Figures that disagree stop the merge, naming the pair.
    clash = tmp_path / "clash"
    clash.mkdir()
    for name in ("config.yaml", "reference.json", "predictions.jsonl"):
        (clash / name).write_text((pieces[0] / name).read_text())
    changed = _rows(pieces[0])
    changed["snapkv@96"]["values"]["ppl_ratio"] += 0.001
    (clash / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in changed.values()))
    with pytest.raises(SystemExit, match=r"snapkv@96: .* disagree: \{'ppl_ratio'"):
        merge_runs.main([str(config), str(tmp_path / "merged2"), str(pieces[0]), str(clash)])

    # A piece of another protocol cannot take the first run's full-cache row.
    other = tmp_path / "other.yaml"
    other.write_text(config.read_text().replace("tokens: 200", "tokens: 240"))
    with pytest.raises(SystemExit, match="other settings than .*: perplexity"):
        start_shard.main([str(other), str(tmp_path / "p3"), "--from", str(first), "--policies", "snapkv"])
    with pytest.raises(SystemExit, match="did not run passkey"):
        start_shard.main([str(config), str(tmp_path / "p4"), "--from", str(first), "--metrics", "passkey"])
    capsys.readouterr()


def test_seed_spread_runs_a_sampled_policy_once_per_seed(tmp_path, capsys):
    from test_eval_e2e import build_tiny_model

    seed_spread = load_benchmark("seed_spread")
    model = build_tiny_model(tmp_path / "tiny")
    out = tmp_path / "seeds"
    assert seed_spread.main(["vase-attnv", "snapkv", "--seeds", "0", "1", "2", "--budgets", "96", "--tokens", "300",
                             "--model", str(model), "--out", str(out), "--target", "1.0"]) == 0
    printed = capsys.readouterr().out.splitlines()
    rows = _rows(out)
    assert set(rows) == {"full", "vase-attnv#s0@96", "vase-attnv#s1@96", "vase-attnv#s2@96", "snapkv#s0@96"}
    sampled = [rows[f"vase-attnv#s{s}@96"]["values"]["ppl_ratio"] for s in range(3)]
    assert len(set(sampled)) > 1  # the seed changes what a sampled policy keeps
    line = next(x for x in printed if x.startswith("vase-attnv@96:"))
    assert " ".join(f"{v:.4f}" for v in sampled) in line and f"mean {sum(sampled) / 3:.4f}" in line
    assert next(x for x in printed if x.startswith("snapkv@96:")).count(" sd 0.0000") == 1  # deterministic: one run
    # An interrupted run continues where it stopped: the dropped pair runs again, to the same figures.
    lines = (out / "results.jsonl").read_text().splitlines()
    (out / "results.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    assert seed_spread.main(["vase-attnv", "snapkv", "--seeds", "0", "1", "2", "--budgets", "96", "--tokens", "300",
                             "--model", str(model), "--out", str(out), "--resume"]) == 0
    assert {k: r["values"] for k, r in _rows(out).items()} == {k: r["values"] for k, r in rows.items()}
    # --full-from: a second seed run takes the first one's full-cache row instead of running it.
    again = tmp_path / "again"
    assert seed_spread.main(["vase-attnv", "--seeds", "1", "--budgets", "96", "--tokens", "300", "--model", str(model),
                             "--out", str(again), "--full-from", str(out)]) == 0
    assert _rows(again)["full"] == rows["full"]
    assert _rows(again)["vase-attnv#s1@96"]["values"] == rows["vase-attnv#s1@96"]["values"]


def test_seed_spread_reports_a_refused_budget_when_asked(tmp_path, capsys):
    from test_eval_e2e import build_tiny_model

    from kvpolicy.eval.config import EvalError

    seed_spread = load_benchmark("seed_spread")
    model = build_tiny_model(tmp_path / "tiny")
    args = ["snapkv", "--seeds", "0", "--budgets", "64", "96", "--tokens", "300", "--model", str(model)]
    # snapkv's 64 recent slots leave no candidate at budget 64: by default nothing runs
    with pytest.raises(EvalError, match="snapkv#s0' at budget 64"):
        seed_spread.main([*args, "--out", str(tmp_path / "strict")])
    assert not (tmp_path / "strict" / "results.jsonl").exists()
    assert seed_spread.main([*args, "--out", str(tmp_path / "report"), "--refusals", "report"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert any(x.startswith("snapkv@64: refused: ") and "recent buffer" in x for x in printed)
    assert any(x.startswith("snapkv@96: ") and " mean " in x for x in printed)
    rows = _rows(tmp_path / "report")
    assert rows["snapkv#s0@64"]["values"] == {} and "ppl_ratio" in rows["snapkv#s0@96"]["values"]
