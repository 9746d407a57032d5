"""Every registered policy end to end through ``Policy.select``, and the built-ins against the spec."""

from __future__ import annotations

import pytest
import reference as ref
import torch
from helpers import (
    assert_greedy_matches,
    assert_valid_selection,
    facts_for,
    left_padding,
    load_fitting,
    make_input,
    make_tensors,
    prompt_for,
)

import kvpolicy
from kvpolicy import PolicyError

BUILTIN = ["chunkkv", "criticalkv", "curdkv", "evict-large-range", "expected-attention", "knorm", "lagkv", "random", "rkv",
           "snapkv", "streamingllm", "tova", "vase-attnv", "vase-dkv"]
SHAPES = [  # (B, Hkv, Hq, N, budget)
    (1, 1, 1, 20, 32),  # N <= budget: everything is kept
    (2, 2, 4, 48, 32),
    (1, 2, 6, 33, 32),  # N = budget + 1
    (3, 1, 2, 70, 40),
]


def small(name: str, budget: int) -> kvpolicy.Policy:
    """The policy at a small budget, with VaSE-style buffers scaled down where they are 64 (a
    two-tier policy without its recall where the small budget cannot hold its pages:
    ``helpers.load_fitting``)."""
    try:
        return load_fitting(name, budget=budget, recent=8, window=8, interval=8)
    except PolicyError:  # e.g. streamingllm (recent = budget - 4) or a plugin's own constraints
        return load_fitting(name, budget=budget)


def fits(policy: kvpolicy.Policy, layers: int, hkv: int, hq: int | None = None, d: int = 8) -> bool:
    """Whether the policy serves a model of this shape (one bound to a head profile, such as
    ``duo-attention``, or to a calibration file, such as ``triattention``, serves its file's model
    only: tests/test_duo_attention.py and tests/test_triattention.py cover them)."""
    try:
        policy.layer_schedules(layers, hkv)
        facts_for(policy, layers, hkv, hq or hkv, d)
    except PolicyError:
        return False
    return True


def protected_mask(policy: kvpolicy.Policy, b: int, hkv: int, n: int) -> torch.Tensor:
    recent = policy.schedule.recent
    mask = (torch.arange(n) >= n - recent).expand(b, hkv, n).clone()
    for r in policy.config.reservations:
        if r.type_name == "sinks" and n > policy.budget:
            mask[..., : r.n] = True
        if r.type_name == "prompt" and n > policy.budget:
            mask[..., : prompt_for(policy)] = True
    return mask


def test_builtin_policies_are_registered():
    assert set(BUILTIN) <= set(kvpolicy.available_policies())


@pytest.mark.parametrize("name", kvpolicy.available_policies())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_every_policy_end_to_end(name, shape):
    b, hkv, hq, n, budget = shape
    policy = small(name, budget)
    if not fits(policy, 1, hkv, hq):
        pytest.skip(f"{name} is bound to another model's shape")
    k, v, q = make_tensors(b=b, hkv=hkv, hq=hq, n=n, d=8, w=8, seed=n)
    facts = facts_for(policy, 1, hkv, hq)
    k_keep = min(n, budget)
    prompt = prompt_for(policy)
    if policy.per_head:  # heads keep different counts: a keep mask and counts
        keep, counts = policy.select_heads(k, v, q, seed=0, model=facts, prompt_lengths=prompt)
        assert torch.equal(keep.sum(-1), counts)
        if policy.config.selector.sets_counts:  # a threshold: each head at most the budget
            assert bool((counts <= k_keep).all())
        else:  # a per-head allocation shares the layer's slots
            assert bool((counts.sum(-1) == hkv * k_keep).all())
        assert not bool((protected_mask(policy, b, hkv, n) & ~keep).any()), "protected slots dropped"
        assert torch.equal(keep, policy.select_heads(k, v, q, seed=0, model=facts, prompt_lengths=prompt)[0])
        return
    kept = policy.select(k, v, q, seed=0, model=facts, prompt_lengths=prompt)
    assert_valid_selection(kept, n, k_keep, protected_mask(policy, b, hkv, n))
    if n <= budget:
        assert torch.equal(kept, torch.arange(n).expand(b, hkv, n))
    again = policy.select(k, v, q, seed=0, model=facts, prompt_lengths=prompt)
    assert torch.equal(kept, again)


@pytest.mark.parametrize("name", BUILTIN)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_builtin_policies_low_precision(name, dtype):
    policy = small(name, 32)
    k, v, q = make_tensors(b=2, hkv=2, hq=4, n=72, d=16, w=8, seed=5)
    facts = facts_for(policy, 1, 2, 4, 16)
    kept32 = policy.select(k, v, q, seed=0, model=facts)
    kept = policy.select(k.to(dtype), v.to(dtype), q.to(dtype), seed=0, model=facts)
    assert_valid_selection(kept, 72, 32, protected_mask(policy, 2, 2, 72))
    if name not in ("random", "vase-attnv"):  # deterministic given the scores: mostly the same set
        overlap = sum(len(set(a.tolist()) & set(c.tolist())) for a, c in zip(kept.flatten(0, 1), kept32.flatten(0, 1),
                                                                             strict=True))
        assert overlap >= 0.85 * kept.numel()


@pytest.mark.parametrize("name", BUILTIN)
def test_builtin_policies_with_padding(name):
    policy = small(name, 32)
    k, v, q = make_tensors(b=3, hkv=2, hq=4, n=60, d=8, w=8, seed=9)
    slot_valid = left_padding(3, 60, [0, 10, 40])
    query_valid = torch.ones(3, 8, dtype=torch.bool)
    query_valid[2, :5] = False
    kept = policy.select(k, v, q, slot_valid=slot_valid, query_valid=query_valid,
                         seed=0, model=facts_for(policy, 1, 2, 4))
    assert_valid_selection(kept, 60, 32)
    for b in range(3):
        n_valid = int(slot_valid[b].sum())
        got_valid = slot_valid[b][kept[b]].sum(-1)
        assert bool((got_valid == min(32, n_valid)).all()), (b, got_valid)
        # sinks are the first real tokens, not the first slots
        if any(r.type_name == "sinks" for r in policy.config.reservations):
            first = int((~slot_valid[b]).sum())
            for h in range(2):
                assert set(range(first, first + 4)) <= set(kept[b, h].tolist())


def test_streamingllm_keeps_sinks_and_window():
    policy = kvpolicy.load_policy("streamingllm", budget=24)
    k, v, q = make_tensors(b=2, hkv=2, hq=4, n=50, d=8, w=1)
    kept = policy.select(k, v, q)
    want = torch.tensor([0, 1, 2, 3, *range(50 - 20, 50)])
    assert torch.equal(kept, want.expand(2, 2, 24))


def test_vase_attnv_reserves_top_quarter_range_with_sinks_counted():
    policy = small("vase-attnv", 64)  # budget/4 = 16 Range slots, 4 of them the sinks
    k, v, q = make_tensors(b=2, hkv=2, hq=4, n=200, d=16, w=8, seed=2)
    v[0, 0, 2] *= 50  # a sink with a huge Range: counted in the 16, not added to them
    kept = policy.select(k, v, q, seed=0)
    rng = ref.value_magnitude(v, "range")
    c = 200 - 8
    for b in range(2):
        for h in range(2):
            prot = set(range(c, 200)) | {0, 1, 2, 3}
            top = ref.top_reservation(rng[b, h], list(range(c)), prot, 16, include_prior=True)
            assert len(top) == 12
            assert top | {0, 1, 2, 3} <= set(kept[b, h].tolist())
    # the rest is sampled: another seed keeps the reservation but samples other slots
    other = policy.select(k, v, q, seed=1)
    assert not torch.equal(kept, other)


def test_evict_large_range_keeps_smallest_range():
    policy = small("evict-large-range", 32)
    k, v, q = make_tensors(b=2, hkv=3, hq=3, n=90, d=8, seed=4)
    kept = policy.select(k, v, q)
    rng = ref.value_magnitude(v, "range")
    want = ref.select(-rng, budget=32, recent=8)
    assert_greedy_matches(kept, want, -rng, None)
    c = 90 - 8
    for b in range(2):
        for h in range(3):
            cand_kept = [j for j in kept[b, h].tolist() if j < c]
            evicted = [j for j in range(c) if j not in cand_kept]
            assert max(rng[b, h, cand_kept]) <= min(rng[b, h, evicted])


def _check_greedy_against_reference(policy, k, v, q, *, sinks=0, projection=None, seed=None, **valid):
    kept = policy.select(k, v, q, seed=seed, **valid)
    cfg = policy.config.to_dict()
    scores = ref.policy_scores(cfg, k, v, q, projection=projection, **valid)
    want = ref.select(scores, budget=policy.budget, recent=policy.schedule.recent, sinks=sinks,
                      slot_valid=valid.get("slot_valid"))
    assert_greedy_matches(kept, want, scores, None, atol=1e-6)


@pytest.mark.parametrize("padded", [False, True])
def test_rkv_matches_reference(padded):
    policy = kvpolicy.load_policy("rkv", budget=24)
    k, v, q = make_tensors(b=2, hkv=2, hq=4, n=40, d=8, w=8, seed=21)
    k[:, :, 10:20] = k[:, :, :10] + 0.3 * k[:, :, 10:20]  # near-duplicate keys: threshold step matters
    valid = {}
    if padded:
        valid = {"slot_valid": left_padding(2, 40, [0, 6]), "query_valid": torch.tensor([[True] * 8, [False] * 2 + [True] * 6])}
    _check_greedy_against_reference(policy, k, v, q, **valid)


def test_snapkv_matches_reference():
    policy = small("snapkv", 24)
    k, v, q = make_tensors(b=2, hkv=2, hq=8, n=45, d=8, w=8, seed=22)
    _check_greedy_against_reference(policy, k, v, q * 2)


def test_curdkv_matches_reference_with_its_fixed_projection():
    policy = small("curdkv", 24)
    k, v, q = make_tensors(b=2, hkv=2, hq=2, n=45, d=8, seed=23)
    stage = policy.config.scorer
    p = stage.projections(make_input(k, v, q, recent=8, seed=policy.config.seed or 0))
    _check_greedy_against_reference(policy, k, v, q, sinks=4, projection=p)


def test_vase_dkv_matches_reference_with_the_drawn_projection():
    policy = small("vase-dkv", 24)
    k, v, q = make_tensors(b=2, hkv=2, hq=2, n=45, d=8, seed=24)
    p = policy.config.scorer.projections(make_input(k, v, q, recent=8, seed=5))
    _check_greedy_against_reference(policy, k, v, q, sinks=4, projection=p, seed=5)


def test_random_policy_is_uniform_over_candidates():
    policy = small("random", 16)
    k, v, q = make_tensors(b=200, hkv=1, hq=1, n=24, d=2, w=1)
    kept = policy.select(k, v, q, seed=0, evictions=torch.arange(200))
    counts = torch.bincount(kept[..., :8].flatten(), minlength=16)[:16].double()  # 8 of 16 candidates
    freq = counts / 200
    torch.testing.assert_close(freq, torch.full((16,), 0.5, dtype=torch.float64), atol=0.15, rtol=0)
