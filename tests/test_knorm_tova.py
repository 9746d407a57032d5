"""The built-in ``knorm`` and ``tova`` policies against float64 loop references (``reference.py``),
and the properties every eviction keeps: exactly ``budget`` slots, protected slots kept, no
duplicates, the same slots for the same seed."""

from __future__ import annotations

import pytest
import reference as ref
import torch
from helpers import assert_greedy_matches, assert_valid_selection, left_padding, make_tensors

import kvpolicy

SHAPES = [  # (B, Hkv, Hq, N, budget)
    (2, 2, 4, 45, 24),
    (1, 2, 6, 33, 32),  # N = budget + 1: one eviction, as TOVA does at every step
    (3, 1, 2, 70, 40),
    (2, 4, 8, 64, 16),
]


def _check(policy, k, v, q, scores, **valid):
    kept = policy.select(k, v, q, seed=0, **valid)
    want = ref.select(scores, budget=policy.budget, recent=policy.schedule.recent, slot_valid=valid.get("slot_valid"))
    assert_greedy_matches(kept, want, scores, None, atol=1e-6)
    return kept


# -- knorm -------------------------------------------------------------------------------------


def test_knorm_defaults_follow_kvpress():
    policy = kvpolicy.load_policy("knorm")
    s = policy.schedule
    assert (s.budget, s.recent, s.window, s.compress_prompt) == (1024, 0, 0, True)
    assert policy.config.reservations == []
    assert policy.config.scorer.type_name == "key_norm" and policy.config.scorer.low_norm_first
    assert policy.config.selector.type_name == "greedy"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_knorm_matches_reference(shape):
    b, hkv, hq, n, budget = shape
    policy = kvpolicy.load_policy("knorm", budget=budget)
    k, v, q = make_tensors(b=b, hkv=hkv, hq=hq, n=n, d=8, w=0, seed=n)
    scores = ref.key_norm(k)
    kept = _check(policy, k, v, q, scores)
    assert_valid_selection(kept, n, budget)
    # Greedy on -norm: every kept key is no longer than every evicted one, per head.
    norms = -scores
    for bi in range(b):
        for h in range(hkv):
            keep = set(kept[bi, h].tolist())
            gone = [j for j in range(n) if j not in keep]
            assert max(float(norms[bi, h, j]) for j in keep) <= min(float(norms[bi, h, j]) for j in gone)


def test_knorm_with_padding_and_a_recent_buffer():
    k, v, q = make_tensors(b=3, hkv=2, hq=4, n=60, d=8, w=0, seed=3)
    slot_valid = left_padding(3, 60, [0, 10, 30])  # every row holds more valid slots than the budget
    policy = kvpolicy.load_policy("knorm", budget=24)
    kept = _check(policy, k, v, q, ref.key_norm(k), slot_valid=slot_valid)
    for bi in range(3):
        n_valid = int(slot_valid[bi].sum())
        assert bool((slot_valid[bi][kept[bi]].sum(-1) == min(24, n_valid)).all())
    # A recent buffer (not the reference's default) is protected and the rest is still by norm.
    policy = kvpolicy.load_policy("knorm", budget=24, recent=6)
    k[:, :, -6:] *= 100  # the longest keys: kept only because they are recent
    kept = _check(policy, k, v, q, ref.key_norm(k))
    protected = (torch.arange(60) >= 54).expand(3, 2, 60)
    assert_valid_selection(kept, 60, 24, protected)


def test_knorm_evicts_the_newest_token_without_a_recent_buffer():
    policy = kvpolicy.load_policy("knorm", budget=8)
    k, v, q = make_tensors(b=1, hkv=2, hq=2, n=12, d=4, w=0, seed=1)
    k[..., -1, :] *= 1000
    kept = policy.select(k, v, q)
    assert 11 not in kept.flatten().tolist()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_knorm_norm_is_taken_in_float32(dtype):
    policy = kvpolicy.load_policy("knorm", budget=32)
    k, v, q = make_tensors(b=2, hkv=2, hq=4, n=96, d=64, w=0, seed=7)
    k, v = k.to(dtype), v.to(dtype)
    # The reference sums the low-precision keys' exact values in float64: a float32 norm ranks
    # them the same up to near-ties, which a norm accumulated in the keys' dtype would not.
    kept = _check(policy, k, v, q, ref.key_norm(k))
    assert_valid_selection(kept, 96, 32)
    scores = policy.config.scorer.score(kvpolicy.policy.eviction_input(
        k, v, q, budget=32, recent=0, slot_valid=None, query_valid=None, positions=None, seed=0,
        layer_idx=0, evictions=0, streams=0))
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores.double(), ref.key_norm(k), atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("name", ["knorm"])
def test_properties(name):
    policy = kvpolicy.load_policy(name, budget=20)
    for seed in range(5):
        k, v, q = make_tensors(b=2, hkv=2, hq=4, n=20 + 3 * seed + 1, d=8, w=1, seed=seed)
        n = k.shape[2]
        kept = policy.select(k, v, q, seed=seed)
        protected = (torch.arange(n) >= n - policy.schedule.recent).expand(2, 2, n)
        assert_valid_selection(kept, n, 20, protected)  # exactly budget, ascending so no duplicates
        assert torch.equal(kept, policy.select(k, v, q, seed=seed))
