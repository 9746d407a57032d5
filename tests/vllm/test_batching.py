"""Continuous batching and block accounting on a tiny random Qwen3 (fast): snapkv, budget 32."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

from engine_util import first_divergence, greedy, make_llm, read_jsonl, tokens_prompt  # noqa: E402

from kvpolicy.vllm.models import tiny_qwen3_folder  # noqa: E402

POLICY = {"policy": "snapkv", "budget": 32, "recent": 16, "interval": 16, "window": 16}
BLOCK = 32


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    trace = tmp_path_factory.mktemp("trace")
    llm = make_llm(tiny_qwen3_folder(), {**POLICY, "trace": str(trace)}, block_size=BLOCK, max_num_seqs=32)
    yield llm, trace
    del llm


def _requests(n, seed):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        plen = rng.randint(5, 120)
        out.append(([rng.randint(3, 4000) for _ in range(plen)], rng.randint(40, 140)))
    return out


def test_continuous_batching_equals_each_request_alone(engine):
    llm, trace = engine
    reqs = _requests(16, seed=1)
    alone = []
    for ids, n in reqs:
        out = llm.generate([tokens_prompt(ids)], greedy(n), use_tqdm=False)
        alone.append(list(out[0].outputs[0].token_ids))
    # Staggered arrivals: request i joins at step 5 * i, while earlier ones decode and evict.
    eng = llm.llm_engine
    done: dict[str, list[int]] = {}
    step, nxt = 0, 0
    while len(done) < len(reqs):
        while nxt < len(reqs) and step >= 5 * nxt:
            ids, n = reqs[nxt]
            eng.add_request(f"cb-{nxt}", tokens_prompt(ids), greedy(n))
            nxt += 1
        for out in eng.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        step += 1
    evictions = read_jsonl(trace, "worker-")
    assert evictions, "no eviction happened"
    for i in range(len(reqs)):
        got = done[f"cb-{i}"]
        assert got == alone[i], f"request {i}: first divergence at {first_divergence(got, alone[i])}"


def test_blocks_are_freed_by_evictions_and_none_leak(engine):
    llm, trace = engine
    for f in trace.glob("scheduler-*.jsonl"):
        f.unlink()
    reqs = _requests(300, seed=2)
    outs = llm.generate([tokens_prompt(ids) for ids, _ in reqs], [greedy(n) for _, n in reqs], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [n for _, n in reqs]
    steps = read_jsonl(trace, "scheduler-")
    assert sum(s["evicted"] for s in steps) > 300  # most requests evict, several times
    # Blocks go back to the pool when requests evict (not only when they finish) ...
    freed = [b["blocks_freed_total"] - a["blocks_freed_total"] for a, b in zip(steps, steps[1:], strict=False)]
    assert sum(freed) > 0
    # ... each running request holds at most the blocks of budget + interval + prompt slots ...
    worst_prompt = max(len(ids) for ids, _ in reqs)
    per_request = -(-max(worst_prompt + 16, 32 + 16) // BLOCK)
    assert all(s["held_blocks"] <= per_request * max(1, s["running"]) for s in steps)
    # ... and none leaks: at the end every block is free again.
    last = steps[-1]
    assert last["running"] == 0 and last["held_blocks"] == 0
    assert last["free_blocks"] == last["total_blocks"]
