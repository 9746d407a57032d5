"""Tensor parallelism on CPU (two ranks, gloo): each rank evicts its own KV heads.

The tiny random Qwen3 has 2 KV heads: with ``tensor_parallel_size=2`` each rank holds one, runs
``Policy.select`` on it alone (``head_offset`` = its first head), and keeps ``budget`` slots per
request, so the block table the ranks share stays valid. vase-attnv is the hardest case: its
stochastic selector draws per head, so a rank must draw exactly what an unsharded run draws for
its head. Each engine runs in its own process (vLLM's CPU workers need their own thread binding).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

pytest.importorskip("vllm")

from engine_util import generate_in_subprocess, read_jsonl  # noqa: E402

from kvpolicy import load_policy  # noqa: E402
from kvpolicy.vllm.models import tiny_qwen3_folder  # noqa: E402

POLICY = {"policy": "vase-attnv", "budget": 32, "recent": 16, "interval": 16, "window": 16}
NEW = 96
CPUS = sorted(os.sched_getaffinity(0))

pytestmark = pytest.mark.skipif(len(CPUS) < 2, reason="two tensor-parallel CPU workers need two CPUs")


def _prompts():
    rng = random.Random(5)
    return [[rng.randint(3, 4000) for _ in range(rng.randint(8, 90))] for _ in range(6)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for tp in (1, 2):
        folder = tmp_path_factory.mktemp(f"tp{tp}")
        trace = folder / "trace"
        kwargs = {"tensor_parallel_size": tp}
        env = {}
        if tp == 2:
            kwargs["distributed_executor_backend"] = "mp"
            # vLLM binds each CPU worker's threads to NUMA nodes by default; one node here.
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"{CPUS[0]}|{CPUS[1]}"
        tokens = generate_in_subprocess(
            folder, tiny_qwen3_folder(), _prompts(), NEW, {**POLICY, "trace": str(trace)}, env=env, **kwargs
        )
        out[tp] = (tokens, trace)
    return out


def test_two_ranks_give_the_tokens_of_one(runs):
    (one, trace1), (two, _) = runs[1], runs[2]
    assert read_jsonl(trace1, "worker-"), "no eviction happened"
    assert len(two) == len(one) == 6 and all(len(t) == NEW for t in two)
    assert two == one


def test_ranks_evict_in_lockstep_and_keep_the_same_slot_counts(runs):
    _, trace = runs[2]
    by_rank = {r: [e for e in read_jsonl(trace, "worker-") if e["rank"] == r] for r in (0, 1)}
    assert by_rank[0], "no eviction happened"
    fields = ("requests", "slots_before", "kept", "tokens", "evictions_after")
    assert [[e[f] for f in fields] for e in by_rank[0]] == [[e[f] for f in fields] for e in by_rank[1]]
    assert {e["head_offset"] for e in by_rank[0]} == {0} and {e["head_offset"] for e in by_rank[1]} == {1}
    assert all(e["kept"] == POLICY["budget"] for e in by_rank[0])


def test_each_rank_keeps_policy_select_on_its_own_heads(runs):
    _, trace = runs[2]
    saved = sorted(trace.glob("evict-*.pt"))
    assert {p.name.split("-")[1] for p in saved} == {"0", "1"}
    for path in saved:
        rec = torch.load(path)
        assert rec["keys"].shape[1] == 1  # one of the model's two KV heads per rank
        kept = load_policy(rec["policy_yaml"]).select(
            rec["keys"], rec["values"], rec["queries"], query_valid=rec["query_valid"], positions=rec["positions"],
            layer_idx=rec["layer_idx"], evictions=rec["evictions"], seed=rec["seed"], head_offset=rec["head_offset"],
        )
        assert torch.equal(kept, rec["kept"])
