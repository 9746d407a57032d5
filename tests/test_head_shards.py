"""Sharded heads (tensor parallelism): a shard of the KV heads keeps what all heads keep for it.

A tensor-parallel rank holds a slice of the model's KV heads and evicts them alone
(``Policy.select(..., head_offset=...)``). Per-head random draws are keyed by the model's head,
so for every built-in policy, stochastic ones included, the shards' choices put side by side are
exactly the unsharded choice.
"""

from __future__ import annotations

import pytest
import torch
from helpers import facts_for, make_tensors, prompt_for
from hypothesis import given, settings
from hypothesis import strategies as st

import kvpolicy
from kvpolicy import seeds
from kvpolicy.policy import eviction_input

# Per-head allocations pool slots across the heads of a layer, and TOVA's scorer reduces over all
# of them (``Policy.couples_heads``), so a shard of the heads cannot choose alone: they are refused
# where heads are sharded (vLLM), and left out here.
EVICT_POLICIES = [
    name for name in kvpolicy.available_policies()
    if kvpolicy.load_policy(name).mode == "evict" and not kvpolicy.load_policy(name).couples_heads
]


def _serves_made_up_models(name: str) -> bool:
    """Whether the policy serves a made-up model (``triattention`` is bound to its calibration's)."""
    try:
        facts_for(kvpolicy.load_policy(name), 4, 2, 2)
    except kvpolicy.PolicyError:
        return False
    return True


EVICT_POLICIES = [name for name in EVICT_POLICIES if _serves_made_up_models(name)]


def test_only_policies_whose_heads_choose_together_are_left_out():
    coupled = {name for name in kvpolicy.available_policies() if kvpolicy.load_policy(name).couples_heads}
    per_head = {name for name in kvpolicy.available_policies() if kvpolicy.load_policy(name).allocation.per_head}
    assert coupled - per_head == {"tova"}
    assert "knorm" in EVICT_POLICIES


@settings(max_examples=60, deadline=None)
@given(
    before=st.integers(0, 5), n=st.integers(1, 5), rest=st.integers(1, 7), seed=st.integers(0, 2**63 - 1),
    normal=st.booleans(),
)
def test_a_draw_started_later_is_a_window_of_the_longer_draw(before, n, rest, seed, normal):
    draw = seeds.normal if normal else seeds.uniform
    s = torch.tensor([seed, seed // 3])
    full = draw(s, (before + n, rest), "x")
    window = draw(s, (n, rest), "x", start=before * rest)
    assert torch.equal(window, full[:, before:])


@pytest.mark.parametrize("name", EVICT_POLICIES)
@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_shards_of_the_heads_keep_what_all_heads_keep(name, data):
    hkv = data.draw(st.sampled_from([2, 4, 6]), label="hkv")
    shards = data.draw(st.sampled_from([d for d in (2, 3, hkv) if hkv % d == 0]), label="shards")
    group = data.draw(st.sampled_from([1, 2]), label="group")
    n = data.draw(st.integers(40, 80), label="n")
    seed = data.draw(st.integers(0, 2**63 - 1), label="seed")
    evictions = data.draw(st.integers(0, 5), label="evictions")
    # keep_protected keeps sinks + recent only: its recent buffer is what the budget leaves;
    # arkvale keeps whole pages of 32: the budget less its recent buffer is one page.
    recent = {"streamingllm": 28, "arkvale": 0}.get(name, 8)
    policy = kvpolicy.load_policy(name, budget=32, recent=recent, window=4, seed=seed)
    keys, values, queries = make_tensors(b=2, hkv=hkv, hq=hkv * group, n=n, d=8, w=4, seed=seed % 1000)
    # Policies that read the model (CriticalKV's output projection) read each shard's heads' slice.
    args = dict(layer_idx=3, evictions=evictions, model=facts_for(policy, 4, hkv, hkv * group),
                prompt_lengths=prompt_for(policy))
    # A threshold (dms) keeps a count of its own per head, each head alone: a keep mask.
    select = (lambda *a, **kw: policy.select_heads(*a, **kw)[0]) if policy.per_head else policy.select
    whole = select(keys, values, queries, **args)
    per = hkv // shards
    parts = [
        select(
            keys[:, i * per:(i + 1) * per], values[:, i * per:(i + 1) * per],
            queries[:, i * per * group:(i + 1) * per * group], head_offset=i * per, **args,
        )
        for i in range(shards)
    ]
    assert torch.equal(torch.cat(parts, dim=1), whole)


def test_head_offset_shifts_per_head_draws_only():
    keys, values, queries = make_tensors(b=1, hkv=4, hq=4, n=10, d=4, w=2)
    base = eviction_input(keys, values, queries, budget=5, recent=2, seed=7)
    shard = eviction_input(keys[:, 2:], values[:, 2:], queries[:, 2:], budget=5, recent=2, seed=7, head_offset=2)
    assert torch.equal(shard.head_uniform(10, stream="s"), base.head_uniform(10, stream="s")[:, 2:])
    assert torch.equal(shard.head_normal(10, stream="s"), base.head_normal(10, stream="s")[:, 2:])
    # Draws that are not per head (a projection shared by every head) do not move with the shard.
    assert torch.equal(shard.normal(4, 3, stream="p"), base.normal(4, 3, stream="p"))
    # With offset 0, head_uniform is the plain per-head-shaped draw (seeded results did not change).
    assert torch.equal(base.head_uniform(10, stream="s"), base.uniform(4, 10, stream="s"))


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2", 1 << 21])
def test_bad_head_offset_is_refused(bad):
    keys, values, queries = make_tensors(b=1, hkv=2, hq=2, n=40, d=4, w=2)
    policy = kvpolicy.load_policy("snapkv", budget=16, recent=4, window=2)
    with pytest.raises(ValueError, match="head_offset"):
        policy.select(keys, values, queries, head_offset=bad)
