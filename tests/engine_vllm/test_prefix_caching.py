"""Eviction with vLLM's prefix caching on (tiny random Qwen3, block size 32).

Requests share a 200-token prefix; half of them evict (snapkv and vase-attnv at budget 128,
named per request), half keep their full cache (the server's policy is ``none``). Each request
must give exactly the tokens it gives alone on an engine with prefix caching off: a compaction
that wrote into a block another request reads, or into a block the prefix cache hands out
again, would change some request's tokens.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

from engine_util import close, first_divergence, greedy, make_llm, read_jsonl, tokens_prompt  # noqa: E402

from kvpolicy.vllm.models import tiny_qwen3_folder  # noqa: E402

BLOCK = 32
PREFIX = 200
EVICTING = [{"kvpolicy": {"policy": "snapkv", "budget": 128}}, {"kvpolicy": {"policy": "vase-attnv", "budget": 128}}]


def _requests(n: int, seed: int, new: tuple[int, int]) -> list[tuple[list[int], int, dict | None]]:
    """``n`` requests: the shared prefix, a suffix of their own, and every other one evicting."""
    rng = random.Random(seed)
    prefix = [random.Random(0).randint(3, 4000) for _ in range(PREFIX)]
    out = []
    for i in range(n):
        suffix = [rng.randint(3, 4000) for _ in range(rng.randint(10, 40))]
        extra = EVICTING[(i // 2) % 2] if i % 2 else None
        out.append((prefix + suffix, rng.randint(*new), extra))
    return out


def _alone(reqs) -> list[list[int]]:
    """Each request alone on an engine with prefix caching off (the plugin on, same policies)."""
    llm = make_llm(tiny_qwen3_folder(), {"policy": "none"}, block_size=BLOCK, enable_prefix_caching=False)
    try:
        return [list(llm.generate([tokens_prompt(ids)], greedy(n, extra_args=extra), use_tqdm=False)[0]
                     .outputs[0].token_ids) for ids, n, extra in reqs]
    finally:
        close(llm)


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    trace = tmp_path_factory.mktemp("trace")
    # vLLM's own processes: this engine outlives the one ``_alone`` starts beside it
    llm = make_llm(tiny_qwen3_folder(), {"policy": "none", "trace": str(trace)}, block_size=BLOCK,
                   enable_prefix_caching=True, max_num_seqs=16, processes=True)
    yield llm, trace
    close(llm)


def test_shared_prefix_with_eviction_equals_each_request_alone_without_prefix_caching(cached):
    llm, trace = cached
    reqs = _requests(16, seed=1, new=(180, 260))
    late = _requests(1, seed=2, new=(100, 100))[0]  # arrives after requests have evicted
    expected = _alone([*reqs, late])
    eng = llm.llm_engine
    done: dict[str, list[int]] = {}
    # The first request computes the prefix; the others find it in the prefix cache.
    eng.add_request("r0", tokens_prompt(reqs[0][0]), greedy(reqs[0][1], extra_args=reqs[0][2]))
    eng.step()
    for i, (ids, n, extra) in enumerate(reqs[1:], start=1):
        eng.add_request(f"r{i}", tokens_prompt(ids), greedy(n, extra_args=extra))
    late_added = False
    while len(done) < len(reqs) + 1:
        if not late_added and read_jsonl(trace, "worker-"):  # an evicting request has evicted
            steps = read_jsonl(trace, "scheduler-")
            hit_before = steps[-1]["prefix_hit_total"]
            eng.add_request("late", tokens_prompt(late[0]), greedy(late[1], extra_args=late[2]))
            late_added = True
        for out in eng.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    for i in range(len(reqs)):
        got = done[f"r{i}"]
        assert got == expected[i], f"request {i} ({reqs[i][2]}): first divergence at {first_divergence(got, expected[i])}"
    assert done["late"] == expected[-1]
    steps = read_jsonl(trace, "scheduler-")
    evictions = read_jsonl(trace, "worker-")
    assert {e["policy"] for e in evictions} == {"snapkv", "vase-attnv"}
    assert steps[-1]["blocks_copied_total"] > 0  # first evictions wrote fresh blocks, not cached ones
    # The late request found the shared prefix (6 full blocks of it) after requests had evicted.
    late_hit = [s["prefix_hit_total"] for s in steps if s["prefix_hit_total"] > hit_before]
    assert late_hit and late_hit[0] - hit_before >= PREFIX // BLOCK * BLOCK
    queried, hit = steps[-1]["prefix_queried_total"], steps[-1]["prefix_hit_total"]
    rate = hit / queried
    print(f"prefix cache: {hit} of {queried} prompt tokens hit ({rate:.1%}); "
          f"{steps[-1]['blocks_copied_total']} blocks copied on first evictions")
    assert rate > 0.6  # 16 of 17 requests find 192 of their 210-240 prompt tokens


def test_no_block_leaks_over_300_requests(cached):
    llm, trace = cached
    for f in trace.glob("*.jsonl"):
        f.unlink()
    reqs = _requests(300, seed=3, new=(40, 90))
    outs = llm.generate([tokens_prompt(ids) for ids, _, _ in reqs],
                        [greedy(n, extra_args=extra) for _, n, extra in reqs], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [n for _, n, _ in reqs]
    steps = read_jsonl(trace, "scheduler-")
    assert sum(s["evicted"] for s in steps) >= 100
    assert steps[-1]["blocks_copied_total"] > 0 and steps[-1]["prefix_hit_total"] > 0
    last = steps[-1]
    assert last["running"] == 0 and last["held_blocks"] == 0
    assert last["free_blocks"] == last["total_blocks"]  # cached blocks sit in the free queue
