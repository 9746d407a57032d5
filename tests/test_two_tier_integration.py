"""Two-tier policies (a ``recall`` block) everywhere a policy runs besides ``EvictingCache``:
``KVPolicyCache`` under ``generate()``, ``kvpolicy eval``'s exact chunks, the lm-eval model and
``kvpolicy eval --lm-tasks`` (tiny random models, offline). vLLM refuses them:
``tests/test_vllm_served.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from hf_util import CACHE_ARG, assert_rows_decode_as_alone, fresh, generate, left_padded_prompt, tiny_qwen3

from kvpolicy import load_policy
from kvpolicy.hf import KVPolicyCache

#: SnapKV's eviction with a second tier (budget 96, evictions of 16 after the prompt, 32 recalled
#: slots per KV head at every decode token), as tests/test_eval_tiers.py runs it.
TWO_TIER = {
    "name": "snapkv-two-tier", "seed": 0, "schedule": {"budget": 96, "recent": 32, "interval": 16, "window": 16},
    "scorer": {"type": "attention", "pooling": "avg", "kernel": 5, "group_reduce": "mean",
               "group_reduce_at": "after_softmax", "window_reduce": "mean"},
    "selector": {"type": "greedy"},
    "recall": {"budget": 32, "page_size": 16, "interval": 1, "scorer": {"type": "quest"}},
}


def _small(selector: dict | None = None):
    """``TWO_TIER`` at a budget a 40-token prompt outgrows: budget 32, pages of 8, 16 recalled."""
    spec = {**TWO_TIER, "schedule": {"budget": 32, "recent": 8, "interval": 8, "window": 8},
            "recall": {"budget": 16, "page_size": 8, "interval": 1, "scorer": {"type": "quest"}}}
    if selector is not None:
        spec["selector"] = selector
    return load_policy(spec)


# -- KVPolicyCache under generate() -----------------------------------------------------------------------
def test_generate_runs_a_two_tier_policy_padded_rows_as_alone_and_reports_its_tiers():
    model = tiny_qwen3(2, 97)
    policy = _small()
    ids, mask = left_padded_prompt(97, batch=2, length=40, pads=(0, 7))
    assert_rows_decode_as_alone(fresh(model), policy, ids, mask, 24)  # padded batches stay exact

    m = fresh(model)
    cache = KVPolicyCache(policy, m)
    out = generate(m, cache, ids, mask, 24)
    assert out.shape == (2, 64)
    stats = cache.tier_stats()
    assert stats == cache.evicting.tier_stats()
    assert stats is not None and stats.moved_bytes > 0 and stats.hits > 0 and stats.slow_bytes > 0
    assert KVPolicyCache(load_policy("snapkv", budget=32, recent=8, interval=8, window=8), fresh(model)).tier_stats() \
        is None


def test_generate_with_beams_and_several_samples_per_prompt_and_seeded_sampling_reproduces():
    """Rows reordered (beam search), repeated (``num_return_sequences``) and a stochastic
    eviction: the slow tier and the recall buffer follow the rows, and a seeded run repeats."""
    model = tiny_qwen3(2, 97)
    ids, mask = left_padded_prompt(97, batch=2, length=40, pads=(0, 7))
    m = fresh(model)
    cache = KVPolicyCache(_small(), m)
    beams = generate(m, cache, ids, mask, 16, num_beams=2)
    assert beams.shape == (2, 56) and cache.tier_stats().moved_bytes > 0

    stochastic = _small({"type": "stochastic", "temperature": 1.0})
    runs = []
    for _ in range(2):
        m = fresh(model)
        cache = KVPolicyCache(stochastic, m, seed=5)
        torch.manual_seed(0)
        with torch.no_grad():
            runs.append(m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, min_new_tokens=16,
                                   do_sample=True, num_return_sequences=2, pad_token_id=0, **{CACHE_ARG: cache}))
        runs.append(cache.tier_stats())
    assert runs[0].shape == (4, 56) and torch.equal(runs[0], runs[2])
    assert runs[1] == runs[3] and runs[1].moved_bytes > 0


# -- kvpolicy eval's exact chunks (what the metrics and lm-eval's log-likelihoods feed) -----------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    pytest.importorskip("reasoning_gym")
    from test_eval_e2e import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"))


def test_chunked_feeding_is_token_by_token_under_two_tiers(tiny_model):
    from transformers import AutoModelForCausalLM

    from kvpolicy.eval.decoding import Stream

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = torch.randint(0, 250, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    policy = load_policy(TWO_TIER)
    chunked, single = Stream(model, policy), Stream(model, policy)
    got = torch.zeros(len(ids) - 40, 256 + 3)

    def keep(offset, logits):
        got[offset : offset + logits.shape[0]] = logits

    chunked.feed(ids[:40])
    chunked.feed(ids[40:], keep)
    single.feed(ids[:40])
    want = torch.stack([single.feed([t]) for t in ids[40:]])
    assert torch.allclose(got, want, atol=1e-4)
    assert chunked.evictions() == single.evictions() > 0
    assert chunked.cache.tier_stats() == single.cache.tier_stats()
    assert chunked.cache.tier_stats().moved_bytes > 0


# -- the lm-eval model and kvpolicy eval --lm-tasks ----------------------------------------------------------
@pytest.fixture
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="module")
def task_file(tmp_path_factory) -> Path:
    pytest.importorskip("lm_eval")
    pytest.importorskip("math_verify")
    from test_lmeval import write_task

    return write_task(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="module")
def two_tier_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("policies") / "snapkv-two-tier.yaml"
    path.write_text(yaml.safe_dump(TWO_TIER))
    return path


@pytest.mark.usefixtures("_offline")
def test_the_lm_eval_model_runs_a_two_tier_policy_batch_3_as_batch_1(tiny_model, task_file, two_tier_file, capsys):
    """Each problem's answer, and every tier counter, are the same at batch size 3 as at 1: a
    row recalls as it would alone; the progress lines and the cost line show the bytes moved."""
    from test_lmeval import _evaluate, _responses

    from kvpolicy.eval.lmeval import KVPolicyLM

    out = {}
    for batch in (1, 3):
        lm = KVPolicyLM(str(tiny_model), policy=str(two_tier_file), budget=96, batch_size=batch, progress_every=2)
        out[batch] = (_responses(_evaluate(lm, task_file, limit=3)), lm.cost.total.tiers, lm._cost_line())
    assert out[1][0] == out[3][0]
    one, three = out[1][1], out[3][1]
    assert one is not None and three is not None and one.moved_bytes > 0 and one.hits > 0
    for name in ("moved_bytes", "written_bytes", "pages_recalled", "hits", "decode_tokens"):
        assert getattr(one, name) == getattr(three, name), name
    assert three.fast_bytes > one.fast_bytes  # three rows' fast tiers at once
    assert "moved" in out[3][2] and "fast tier" in out[3][2] and "recall hits" in out[3][2]
    err = capsys.readouterr().err
    assert "snapkv-two-tier@96 gsm_local: 2/3 samples" in err and "moved" in err.split("2/3 samples")[1].split("\n")[0]


@pytest.mark.usefixtures("_offline")
def test_eval_lm_tasks_reports_a_two_tier_policys_tiers(tiny_model, task_file, two_tier_file, tmp_path, capsys):
    from kvpolicy.eval.cli import main

    run = tmp_path / "run"
    assert main(["eval", "--model", str(tiny_model), "--lm-tasks", str(task_file), "--policies", str(two_tier_file),
                 "--budgets", "96", "--samples", "1", "--max-new-tokens", "32", "--batch-size", "3",
                 "--out", str(run), "--no-progress"]) == 0, capsys.readouterr().err
    rows = {r["key"]: r["values"] for r in json.loads((run / "metrics.json").read_text())["rows"]}
    two, full = rows["snapkv-two-tier@96"], rows["full"]
    assert not any(k.startswith(("lm_fast", "lm_slow", "lm_moved", "lm_hit")) for k in full)
    assert two["lm_moved_bytes"] > 0 and two["lm_recall_hits"] > 0 and two["lm_fast_mib"] > 0
    assert two["lm_hit_rate"] == pytest.approx(two["lm_recall_hits"] / two["lm_pages_recalled"])
    assert two["lm_moved_kib_tok"] == pytest.approx(two["lm_moved_bytes"] / two["lm_decode_tokens"] / 1024)
    header = (run / "table.md").read_text().splitlines()[0]
    assert header.endswith("| evict % | fast MiB | slow MiB | moved KiB/tok | recall hits |")
