"""Preemption that replays evictions (tiny random Qwen3, block size 32, prefix caching on).

A KV pool of 12 blocks (384 slots) serves five requests of 450-530 tokens each under eviction (one
of them under H2O, whose state the replay must rebuild): more
than the pool holds, which only eviction makes possible. Bursts of high-priority requests make
vLLM preempt the long low-priority ones, and every 100 steps vLLM preempts every running request
(``reset_prefix_cache(reset_running_requests=True)``), so each is preempted several times after it
has evicted; vLLM then
recomputes them, and kvpolicy feeds the recompute in chunks that end where their evictions fell,
evicting again at each. Every request must give exactly its tokens alone on an idle engine, and
its cache after each replayed eviction must hold the slots (token positions per layer and head)
that the uninterrupted run's held after the same eviction.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

from engine_util import ASYNC_DEFAULT, close, first_divergence, make_llm, read_jsonl, tokens_prompt  # noqa: E402

from kvpolicy.vllm.models import tiny_qwen3_folder  # noqa: E402

BLOCK = 32
POOL = 12  # blocks: 384 slots, less than any long request's length
SERVER = {"policy": "snapkv", "budget": 32, "recent": 16, "interval": 16, "window": 16}
LONG = [  # (extra_args, sampled): per-request policies, greedy and sampled
    (None, False),  # the server's snapkv@32
    ({"kvpolicy": {"policy": "vase-attnv", "budget": 32, "recent": 16, "interval": 16, "window": 16}}, True),
    ({"kvpolicy": "streamingllm", "kvpolicy_budget": 48, "kvpolicy_interval": 16}, False),
    ({"kvpolicy": {"policy": "snapkv", "budget": 64, "recent": 16, "interval": 32, "window": 16}}, True),
    # A policy that keeps state (H2O's accumulated attention): its replay must rebuild the state
    # from the recomputed queries, fed in chunks, exactly as decoding built it token by token.
    ({"kvpolicy": {"policy": "h2o", "budget": 32, "recent": 16, "interval": 16, "window": 16}}, False),
]


def _params(n: int, extra, sampled: bool, seed: int):
    from vllm import SamplingParams

    # Under async scheduling vLLM's reset_prefix_cache(reset_running_requests=True) drops each
    # request's in-flight token and samples that position again, from a seeded generator that
    # already drew for it: a sampled request then continues differently with or without
    # kvpolicy. So with async scheduling on (KVPOLICY_TEST_ASYNC=1) every request is greedy.
    if sampled and not ASYNC_DEFAULT:
        return SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.8, top_p=0.95, seed=seed,
                              extra_args=extra)
    return SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0, extra_args=extra)


def _workload():
    rng = random.Random(11)
    shared = [rng.randint(3, 4000) for _ in range(64)]  # two blocks every long prompt starts with
    long = []
    for i, (extra, sampled) in enumerate(LONG):
        ids = shared + [rng.randint(3, 4000) for _ in range(rng.randint(10, 40))]
        long.append((f"long-{i}", ids, _params(rng.randint(400, 430), extra, sampled, 100 + i)))
    bursts = []
    for b in range(3):
        # Each burst, at top priority: a full-cache request that grows to 9 of the 11 blocks while
        # it decodes (vLLM preempts low-priority requests when a running request finds no free
        # block: here every long one), and one under the server's policy.
        burst = []
        for j, (extra, n) in enumerate((({"kvpolicy": "none"}, 260), (None, 120))):
            ids = [rng.randint(3, 4000) for _ in range(rng.randint(15, 25))]
            burst.append((f"burst-{b}-{j}", ids, _params(n, extra, j == 1, 200 + 2 * b + j)))
        bursts.append(burst)
    return long, bursts


def _run(llm, long, bursts, load: bool) -> dict[str, list[int]]:
    eng = llm.llm_engine
    done: dict[str, list[int]] = {}
    if not load:  # each request alone on the idle engine
        for rid, ids, params in [*long, *(r for b in bursts for r in b)]:
            eng.add_request(rid, tokens_prompt(ids), params)
            while eng.has_unfinished_requests():
                for out in eng.step():
                    if out.finished:
                        done[out.request_id] = list(out.outputs[0].token_ids)
        return done
    for rid, ids, params in long:
        eng.add_request(rid, tokens_prompt(ids), params, priority=5)
    # A burst arrives 60 steps after the long requests start, and 50 steps after the previous
    # burst has finished (the long ones have resumed, replayed and decoded meanwhile).
    # Every 100 steps, besides, vLLM preempts every running request at once (its own
    # reset_prefix_cache(reset_running_requests=True)): each long request is preempted several times.
    step, next_at, b = 0, 60, 0
    while eng.has_unfinished_requests() or b < len(bursts):
        if step % 100 == 40:
            assert eng.reset_prefix_cache(reset_running_requests=True)
        if b < len(bursts) and next_at is not None and step >= next_at:
            for rid, ids, params in bursts[b]:
                eng.add_request(rid, tokens_prompt(ids), params, priority=0)
            b, next_at = b + 1, None
        for out in eng.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        if next_at is None and all(rid in done for rid, *_ in bursts[b - 1]):
            next_at = step + 50
        step += 1
    return done


def _evictions(trace) -> dict[str, list[tuple[int, int, str]]]:
    """Per request, each eviction as (tokens seen, evictions so far, digest of the kept slots)."""
    out: dict[str, list[tuple[int, int, str]]] = {}
    for e in read_jsonl(trace, "worker-"):
        for req, tokens, n, digest in zip(e["requests"], e["tokens"], e["evictions_after"], e["kept_digest"],
                                          strict=True):
            # the engine's id is the request's id plus a suffix of its own
            out.setdefault(req.rsplit("-", 1)[0], []).append((tokens, n, digest))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    long, bursts = _workload()
    got = {}
    for name, blocks in (("alone", None), ("loaded", POOL)):
        trace = tmp_path_factory.mktemp(f"trace-{name}")
        kwargs = {} if blocks is None else {"num_gpu_blocks_override": blocks}
        llm = make_llm(tiny_qwen3_folder(), {**SERVER, "trace": str(trace)}, block_size=BLOCK, max_num_seqs=8,
                       max_model_len=1024, enable_prefix_caching=True, scheduling_policy="priority", **kwargs)
        try:
            got[name] = (_run(llm, long, bursts, load=blocks is not None), trace)
        finally:
            close(llm)
    return long, bursts, got


def test_preempted_requests_equal_their_runs_alone(runs):
    long, bursts, got = runs
    alone, _ = got["alone"]
    loaded, trace = got["loaded"]
    steps = read_jsonl(trace, "scheduler-")
    print(f"preemptions: {steps[-1]['preempted_total']} ({steps[-1]['preempted_after_evicting_total']} after "
          f"evicting); recompute steps cut at an eviction point: {steps[-1]['replay_cuts_total']}; peak blocks in use "
          f"{max(s['held_blocks'] for s in steps)} of {steps[-1]['total_blocks']}")
    for rid, *_ in [*long, *(r for b in bursts for r in b)]:
        assert loaded[rid] == alone[rid], f"{rid}: first divergence at {first_divergence(loaded[rid], alone[rid])}"
    assert all(len(ids) + p.max_tokens > POOL * BLOCK for _, ids, p in long)  # longer than the pool


def test_each_long_request_was_preempted_after_evicting_several_times_and_replayed_its_evictions(runs):
    long, _, got = runs
    alone = _evictions(got["alone"][1])
    loaded = _evictions(got["loaded"][1])
    for rid, *_ in long:
        records = loaded[rid]
        replays = sum(1 for a, b in zip(records, records[1:], strict=False) if b[1] <= a[1])
        assert replays >= 2, f"{rid} replayed {replays} times: the workload no longer preempts it enough"
        # Every eviction, first or replayed, kept exactly the slots the uninterrupted run kept at
        # the same eviction: its cache after resuming is the one it had.
        assert set(records) == set(alone[rid]), rid
    steps = read_jsonl(got["loaded"][1], "scheduler-")
    assert steps[-1]["preempted_after_evicting_total"] >= 2 * len(long)
    assert steps[-1]["replay_cuts_total"] > 0  # recompute steps were cut at eviction points


def test_blocks_all_returned(runs):
    _, _, got = runs
    steps = read_jsonl(got["loaded"][1], "scheduler-")
    assert all(s["held_blocks"] <= s["total_blocks"] == POOL - 1 for s in steps)
    last = steps[-1]
    assert last["running"] == 0 and last["held_blocks"] == 0 and last["free_blocks"] == last["total_blocks"]
