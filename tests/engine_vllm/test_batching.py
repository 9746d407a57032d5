"""Continuous batching and block accounting on a tiny random Qwen3 (fast): snapkv, budget 32.

The module's shared engine runs vLLM's production layout (``processes=True``: the engine core and
the model runner in processes of their own), so a request's settings, plan and evictions are
checked across the process boundaries the other modules' in-process engines skip."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

from engine_util import close, first_divergence, greedy, make_llm, read_jsonl, tokens_prompt  # noqa: E402

from kvpolicy.vllm.models import tiny_qwen3_folder  # noqa: E402

POLICY = {"policy": "snapkv", "budget": 32, "recent": 16, "interval": 16, "window": 16}
BLOCK = 32


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    trace = tmp_path_factory.mktemp("trace")
    llm = make_llm(tiny_qwen3_folder(), {**POLICY, "trace": str(trace)}, block_size=BLOCK, max_num_seqs=32,
                   processes=True)
    yield llm, trace
    close(llm)


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


def test_requests_preempted_after_evicting_finish_and_leak_no_block(tmp_path):
    """10 blocks for 10 requests under priority scheduling: 4 low-priority requests decode and
    evict for 60 steps, then 6 high-priority ones arrive, and vLLM preempts the low-priority ones
    (after several evictions each) to make room, and recomputes them later. Every request still
    gets its tokens, the resumed ones replay their evictions at the same token counts, and no
    block leaks. (test_preemption.py checks tokens and kept slots against uninterrupted runs.)"""
    llm = make_llm(tiny_qwen3_folder(), {**POLICY, "trace": str(tmp_path)}, block_size=BLOCK, max_num_seqs=12,
                   num_gpu_blocks_override=10, max_model_len=288, scheduling_policy="priority")
    rng = random.Random(3)
    reqs = [([rng.randint(3, 4000) for _ in range(rng.randint(10, 30))], rng.randint(150, 200)) for _ in range(10)]
    done: dict[str, int] = {}
    try:
        eng = llm.llm_engine
        for i in range(4):
            eng.add_request(f"low-{i}", tokens_prompt(reqs[i][0]), greedy(reqs[i][1]), priority=5)
        step = 0
        while len(done) < len(reqs):
            if step == 60:
                for i in range(4, len(reqs)):
                    eng.add_request(f"high-{i}", tokens_prompt(reqs[i][0]), greedy(reqs[i][1]), priority=0)
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = len(out.outputs[0].token_ids)
            step += 1
    finally:
        close(llm)
    assert [done[f"{'low' if i < 4 else 'high'}-{i}"] for i in range(len(reqs))] == [n for _, n in reqs]
    steps = read_jsonl(tmp_path, "scheduler-")
    assert sum(s["resumed"] for s in steps) > 0, "no request was preempted: the test no longer tests preemption"
    # A preempted request that had evicted counts its evictions afresh in its recompute ...
    counts: dict[str, list[int]] = {}
    for e in read_jsonl(tmp_path, "worker-"):
        for req, n in zip(e["requests"], e["evictions_after"], strict=True):
            counts.setdefault(req, []).append(n)
    restarted = [r for r, c in counts.items() if any(b <= a for a, b in zip(c, c[1:], strict=False))]
    assert any(r.startswith("low-") for r in restarted), counts
    # ... and evicts at the same token counts again (the recompute replays its evictions).
    points: dict[str, list[int]] = {}
    for e in read_jsonl(tmp_path, "worker-"):
        for req, tokens in zip(e["requests"], e["tokens"], strict=True):
            points.setdefault(req, []).append(tokens)
    for r in restarted:
        assert len(points[r]) > len(set(points[r]))  # some points evicted twice: once, then replayed
    assert all(s["held_blocks"] <= s["total_blocks"] for s in steps)
    last = steps[-1]
    assert last["running"] == 0 and last["held_blocks"] == 0 and last["free_blocks"] == last["total_blocks"]


def test_first_come_first_served_admits_a_request_only_where_every_peak_fits(tmp_path):
    """10 requests at once over 10 blocks (9 usable), first come first served: vLLM alone admits
    as many as their prompts fit (a block each), then preempts the last admitted as they grow to
    their peaks (budget 32 + interval 16: 2 blocks each) and recomputes it from its prompt.
    kvpolicy's admission also counts every admitted request's room to its peak
    (``SchedulerEviction.admission_reserve``): the others wait, none is preempted, every request
    gets its tokens, and the running requests' peaks fit the pool at every step."""
    llm = make_llm(tiny_qwen3_folder(), {**POLICY, "trace": str(tmp_path)}, block_size=BLOCK, max_num_seqs=12,
                   num_gpu_blocks_override=10, max_model_len=288)
    rng = random.Random(3)
    reqs = [([rng.randint(3, 4000) for _ in range(rng.randint(10, 30))], rng.randint(150, 200)) for _ in range(10)]
    try:
        outs = llm.generate([tokens_prompt(ids) for ids, _ in reqs], [greedy(n) for _, n in reqs], use_tqdm=False)
    finally:
        close(llm)
    assert [len(o.outputs[0].token_ids) for o in outs] == [n for _, n in reqs]
    steps = read_jsonl(tmp_path, "scheduler-")
    assert steps[-1]["preempted_total"] == 0 and sum(s["resumed"] for s in steps) == 0
    assert max(s["waiting"] for s in steps) > 0  # the pool could not hold every request's peak at once
    assert all(2 * s["running"] <= s["total_blocks"] for s in steps)


def test_chunked_prefill_equals_one_shot_prefill(tmp_path):
    """Prompts of 100-300 tokens prefilled in chunks of at most 64 tokens, beside decoding
    requests, with prompt compression on (the step that completes a prompt evicts it to the
    budget): the tokens equal those of the same requests with every prompt prefilled at once."""
    policy = {**POLICY, "compress_prompt": True}
    rng = random.Random(4)
    reqs = [([rng.randint(3, 4000) for _ in range(rng.randint(100, 300))], rng.randint(40, 80)) for _ in range(8)]
    prompts = [tokens_prompt(ids) for ids, _ in reqs]
    params = [greedy(n) for _, n in reqs]
    got = {}
    for budget in (64, 4096):
        trace = tmp_path / f"trace-{budget}"
        llm = make_llm(tiny_qwen3_folder(), {**policy, "trace": str(trace)}, block_size=BLOCK, max_num_seqs=8,
                       enable_chunked_prefill=True, max_num_batched_tokens=budget)
        try:
            got[budget] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            close(llm)
        steps = read_jsonl(trace, "scheduler-")
        most = max(s["scheduled_tokens"] for s in steps)
        assert most <= 64 if budget == 64 else most > 300  # chunked, or whole prompts in one step
        # Every prompt is longer than the budget: its first eviction comes with its last chunk.
        first: dict[str, int] = {}
        for e in read_jsonl(trace, "worker-"):
            for req, tokens in zip(e["requests"], e["tokens"], strict=True):
                first.setdefault(req, tokens)
        assert sorted(first.values()) == sorted(len(ids) for ids, _ in reqs)
    for i, (a, b) in enumerate(zip(got[64], got[4096], strict=True)):
        assert a == b, f"request {i}: first divergence at {first_divergence(a, b)}"


MIXED = [  # (extra_args, budget the request keeps; None: never evicts)
    ({"kvpolicy": "none"}, None),  # the full cache
    ({"kvpolicy": {"policy": "snapkv", "budget": 128}}, 128),
    ({"kvpolicy": "streamingllm", "kvpolicy_budget": 64}, 64),  # the flat form vllm_xargs carries
    ({"kvpolicy": {"policy": "vase-attnv", "budget": 256}}, 256),
    (None, POLICY["budget"]),  # names nothing: the server's policy
]


def test_mixed_policies_in_one_batch_equal_each_request_alone(engine):
    """Requests naming different policies and budgets (and one naming none) decode together, each
    evicting on its own schedule: every request gives exactly its tokens alone."""
    llm, trace = engine
    rng = random.Random(6)
    reqs = []
    for i in range(10):
        extra, budget = MIXED[i % len(MIXED)]
        # Prompt lengths equal modulo 64 (every interval here divides 64): the policies' evictions
        # fall on the same steps, so one step evicts requests of several policies.
        ids = [rng.randint(3, 4000) for _ in range(rng.choice([32, 96]))]
        reqs.append((ids, rng.randint(330, 420), extra, budget))
    for f in trace.glob("worker-*.jsonl"):
        f.unlink()
    alone = []
    for ids, n, extra, _ in reqs:
        out = llm.generate([tokens_prompt(ids)], greedy(n, extra_args=extra), use_tqdm=False)
        alone.append(list(out[0].outputs[0].token_ids))
    alone_evictions = read_jsonl(trace, "worker-")
    for f in trace.glob("worker-*.jsonl"):
        f.unlink()
    together = llm.generate([tokens_prompt(ids) for ids, *_ in reqs],
                            [greedy(n, extra_args=extra) for _, n, extra, _ in reqs], use_tqdm=False)
    for i, out in enumerate(together):
        got = list(out.outputs[0].token_ids)
        assert got == alone[i], f"request {i} ({reqs[i][2]}): first divergence at {first_divergence(got, alone[i])}"
    evictions = read_jsonl(trace, "worker-")
    # Every evicting policy evicted, keeping its own budget; several policies evicted in one step.
    kept = {(e["policy"], e["kept"]) for e in evictions}
    assert kept == {("snapkv", 128), ("streamingllm", 64), ("vase-attnv", 256), ("snapkv", POLICY["budget"])}
    assert {(e["policy"], e["kept"]) for e in alone_evictions} == kept
    steps: dict[int, set[str]] = {}
    for e in evictions:
        steps.setdefault(e["step"], set()).add(e["policy"])
    assert max(len(p) for p in steps.values()) > 1, "no step evicted requests of different policies"


def test_a_bad_per_request_setting_fails_that_request_only(engine):
    from vllm.exceptions import VLLMValidationError

    llm, _ = engine
    ids = list(range(10, 40))
    for extra, message in (
        ({"kvpolicy": "no-such-policy"}, "unknown policy 'no-such-policy'"),
        ({"kvpolicy": "h2o@select"}, "keep state"),
        ({"kvpolicy": "snapkv", "kvpolicy_budget": 0}, "does not load"),
    ):
        with pytest.raises(VLLMValidationError, match=message):
            llm.generate([tokens_prompt(ids)], greedy(8, extra_args=extra), use_tqdm=False)
    out = llm.generate([tokens_prompt(ids)], greedy(8), use_tqdm=False)  # the engine goes on serving
    assert len(out[0].outputs[0].token_ids) == 8
