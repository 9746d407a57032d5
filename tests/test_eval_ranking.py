"""The ranking run: every built-in policy by name set, refusals shown instead of stopping the run,
agreement without free-running generation, and the ranking table and plot of a run folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpolicy.eval.config import EvalConfig, EvalError
from kvpolicy.eval.metrics.base import Column
from kvpolicy.eval.report import REFUSED, ranking, ranking_markdown, ranking_plot
from kvpolicy.eval.runner import expand_policies, resolve_policies
from kvpolicy.registry import get_registry

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "docs" / "examples" / "ranking.yaml"


def _builtin() -> list[str]:
    return sorted(n for n, r in get_registry().policies.items() if r.plugin == "kvpolicy")


def test_builtin_and_all_stand_for_the_policies_registered_now():
    assert expand_policies(["builtin"]) == _builtin()
    assert set(expand_policies(["all"])) == set(get_registry().policies)
    # a policy named beside the set is kept once, where it first appears; files and mappings pass through
    assert expand_policies(["snapkv", "builtin", {"name": "x"}]) == (
        ["snapkv"] + [n for n in _builtin() if n != "snapkv"] + [{"name": "x"}])


def test_a_refused_budget_is_an_error_or_a_refused_pair():
    data = {"policies": ["snapkv", "streamingllm"], "budgets": [64, 128]}
    with pytest.raises(EvalError, match="snapkv.*budget 64"):
        resolve_policies(EvalConfig.build(data))
    pairs = resolve_policies(EvalConfig.build({**data, "refusals": "report"}))
    refused = {p.key: p.refused for p in pairs if p.refused}
    assert set(refused) == {"snapkv@64"}  # streamingllm fits its window to the budget
    assert "recent buffer" in refused["snapkv@64"]
    assert all(p.policy is not None for p in pairs if not p.refused)


def test_the_ranking_preset_ranks_every_builtin_policy_at_three_budgets():
    config = EvalConfig.load(PRESET)
    assert config.policies == ["builtin"] and config.refusals == "report"
    assert config.budgets == [128, 256, 512] and config.perplexity.tokens == 4096
    assert config.passkey.budgets == config.fidelity.budgets == [256]
    assert not config.fidelity.free_running
    pairs = resolve_policies(config)
    names = {p.name for p in pairs}
    assert names == set(_builtin()) and "oracle-topk" in names
    assert len(pairs) == 3 * len(names)


def _rows() -> list[dict]:
    rows = [{"key": "full", "policy": "full", "budget": None, "values": {"ppl_ratio": 1.0, "agreement": 1.0}}]
    table = {  # ppl_ratio, agreement at budgets 1 and 2 (made up)
        "a": ((1.10, 0.8), (1.02, 0.9)), "b": ((1.05, 0.7), (1.03, 0.95)), "oracle": ((1.01, 0.99), (1.002, 1.0)),
    }
    for name, per_budget in table.items():
        for budget, (ppl, agree) in zip((1, 2), per_budget, strict=True):
            rows.append({"key": f"{name}@{budget}", "policy": name, "budget": budget,
                         "mode": "select" if name == "oracle" else "evict",
                         "values": {"ppl_ratio": ppl, "agreement": agree, "kv_mib": 3.0}})
    rows.append({"key": "c@1", "policy": "c", "budget": 1, "values": {}, "refused": "budget too small"})
    rows.append({"key": "c@2", "policy": "c", "budget": 2, "mode": "evict",
                 "values": {"ppl_ratio": 1.0001, "agreement": 1.0}})
    return rows


COLS = [Column("ppl", "PPL", "{:.2f}", "lower"), Column("ppl_ratio", "PPL / full", "{:.4f}", "lower", ranked=True),
        Column("agreement", "agree", "{:.3f}", "higher", ranked=True), Column("kv_mib", "KV MiB", "{:.2f}", "lower")]


def test_policies_rank_by_their_mean_and_a_refused_one_comes_last():
    rk = ranking(COLS, _rows())
    assert rk is not None
    assert [c.key for c in rk.columns] == ["ppl_ratio", "agreement"]  # cost and raw figures are not ranked
    # means 1.006 (oracle), 1.04 (b), 1.06 (a); c is best where it ran but was refused at budget 1
    assert rk.policies == ["oracle", "b", "a", "c"]
    assert rk.cells["c"][("ppl_ratio", 1)] == REFUSED
    md = ranking_markdown(COLS, _rows())
    lines = md.splitlines()
    assert lines[0] == ("| rank | policy | mode | PPL / full @1 | PPL / full @2 | agree @1 | agree @2 |")
    assert lines[2].startswith("| - | full cache | - | 1.0000 | 1.0000 | 1.000 | 1.000 |")
    assert lines[3] == "| 1 | oracle | select | **1.0100** | 1.0020 | **0.990** | **1.000** |"
    assert lines[6] == "| 4 | c | evict | refused | **1.0001** | refused | **1.000** |"
    assert "- c at 1: budget too small" in md


def test_the_ranking_plot_is_written(tmp_path):
    from matplotlib.image import imread

    path = ranking_plot(tmp_path, COLS, _rows())
    assert path == tmp_path / "ranking.png"
    height, width = imread(path).shape[:2]
    assert width > height > 100
    assert ranking_plot(tmp_path, COLS[:1], _rows()) is None  # nothing ranked: no plot


def test_a_ranking_run_on_a_tiny_model(tmp_path, capsys):
    from test_eval_e2e import build_tiny_model

    from kvpolicy.eval.cli import main

    model = build_tiny_model(tmp_path / "tiny")
    run = tmp_path / "run"
    # duo-attention's head profile is the bundled model's (30 layers): it refuses the 2-layer model at
    # run time; snapkv refuses budget 64 (its recent buffer) before any work
    args = ["eval", "--model", str(model), "--policies", "snapkv", "streamingllm", "oracle-topk", "duo-attention",
            "--budgets", "64", "96", "--metrics", "perplexity", "fidelity", "--set", "refusals=report",
            "--set", "perplexity.tokens=320", "--set", "fidelity.prompts=1", "--set", "fidelity.new_tokens=40",
            "--set", "fidelity.free_running=false", "--out", str(run), "--no-progress"]
    assert main(args) == 0, capsys.readouterr().err
    rows = {r["key"]: r for r in json.loads((run / "metrics.json").read_text())["rows"]}
    assert "recent buffer" in rows["snapkv@64"]["refused"]
    assert "allocation" in rows["duo-attention@96"]["refused"]
    assert rows["oracle-topk@96"]["mode"] == "select"
    for key in ("streamingllm@96", "oracle-topk@96", "snapkv@96"):
        values = rows[key]["values"]
        assert 0.0 <= values["agreement"] <= 1.0 and "first_divergence" not in values
    preds = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines()]
    assert all("output" not in p for p in preds if p["metric"] == "fidelity" and p["key"] != "full")
    ranked = (run / "ranking.md").read_text()
    assert "| agree @64 | agree @96 |" in ranked and "duo-attention | - | refused" in ranked
    assert "1st div" not in (run / "table.md").read_text() and REFUSED in (run / "table.md").read_text()
    assert (run / "plots" / "ranking.png").stat().st_size > 1000

    # --report writes the tables and plots of the pairs a folder holds, running nothing: here a
    # partial folder (one pair's line dropped) keeps that pair out instead of running it
    lines = (run / "results.jsonl").read_text().splitlines()
    (run / "results.jsonl").write_text("\n".join(x for x in lines if '"streamingllm@96"' not in x) + "\n")
    (run / "ranking.md").unlink()
    (run / "plots" / "ranking.png").unlink()
    assert main(["eval", "--report", str(run), "--no-progress"]) == 0
    assert "streamingllm@96" not in {r["key"] for r in json.loads((run / "metrics.json").read_text())["rows"]}
    assert "streamingllm" in (run / "ranking.md").read_text()  # its budget-64 row is still there
    assert (run / "plots" / "ranking.png").is_file()
    assert len((run / "results.jsonl").read_text().splitlines()) == len(lines) - 1  # nothing was run
