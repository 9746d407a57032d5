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


# -- tova --------------------------------------------------------------------------------------


def _tova_scores(k, q, **valid):
    return ref.current_attention(k, q, group_reduce="mean", head_reduce="layer", **valid)


def test_tova_defaults_follow_the_official_code():
    policy = kvpolicy.load_policy("tova")
    s = policy.schedule
    assert (s.budget, s.recent, s.interval, s.window, s.compress_prompt) == (1024, 0, 1, 1, True)
    assert policy.config.reservations == []
    scorer = policy.config.scorer
    assert (scorer.type_name, scorer.group_reduce, scorer.head_reduce) == ("current_attention", "mean", "layer")
    assert policy.config.selector.type_name == "greedy"
    # Interval 1: once over the budget, every step evicts (down to the budget: one token).
    assert all(s.fires(1025, t) for t in range(1025, 1100))
    assert not s.fires(1024, 1024)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("w", [1, 4])
def test_tova_matches_reference(shape, w):
    b, hkv, hq, n, budget = shape
    policy = kvpolicy.load_policy("tova", budget=budget, window=w, interval=w)
    k, v, q = make_tensors(b=b, hkv=hkv, hq=hq, n=n, d=8, w=w, seed=n + w)
    q = 3 * q  # peakier attention: fewer near-ties
    kept = _check(policy, k, v, q, _tova_scores(k, q))
    assert_valid_selection(kept, n, budget)
    assert bool((kept == kept[:, :1]).all()), "KV heads kept different slots"


def test_tova_averages_all_query_heads_not_each_group():
    k, v, q = make_tensors(b=1, hkv=2, hq=4, n=12, d=4, w=1, seed=2)
    inp = kvpolicy.policy.eviction_input(
        k, v, q, budget=8, recent=0, slot_valid=None, query_valid=None, positions=None, seed=0,
        layer_idx=0, evictions=0, streams=0)
    scorer = kvpolicy.load_policy("tova").config.scorer
    got = scorer.score(inp)
    torch.testing.assert_close(got.double(), _tova_scores(k, q), atol=1e-6, rtol=0)
    per_group = ref.current_attention(k, q, head_reduce="group")
    torch.testing.assert_close(got.double(), per_group.mean(1, keepdim=True).expand(1, 2, 12), atol=1e-6, rtol=0)
    assert not torch.allclose(per_group[:, 0], per_group[:, 1])  # the groups disagree; the layer decides
    # The softmax covers the current (newest) token too: the masses over all slots add up to 1.
    torch.testing.assert_close(got.sum(-1), torch.ones(1, 2))


def test_tova_with_padding_and_invalid_queries():
    k, v, q = make_tensors(b=3, hkv=2, hq=4, n=60, d=8, w=4, seed=9)
    slot_valid = left_padding(3, 60, [0, 10, 30])
    query_valid = torch.ones(3, 4, dtype=torch.bool)
    query_valid[1, 3] = False  # the newest valid query of row 1 is entry 2
    policy = kvpolicy.load_policy("tova", budget=24, window=4, interval=4)
    valid = {"slot_valid": slot_valid, "query_valid": query_valid}
    kept = _check(policy, k, v, 3 * q, _tova_scores(k, 3 * q, **valid), **valid)
    assert bool((kept == kept[:, :1]).all())
    for bi in range(3):
        assert bool(slot_valid[bi][kept[bi]].all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tova_ties_cannot_split_the_heads(dtype):
    """Exactly tied scores (repeated keys, a query orthogonal to most of them): every KV head
    keeps the same slots all the same."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(1, 2, 5, 8, generator=g)
    k = base.repeat(2, 1, 8, 1).to(dtype)  # [2, 2, 40, 8]: each key 8 times
    q = torch.zeros(2, 8, 1, 8, dtype=dtype)
    q[1, :, :, 0] = 1.0
    v = torch.zeros_like(k)
    for budget in (7, 13, 20, 39):
        policy = kvpolicy.load_policy("tova", budget=budget)
        kept = policy.select(k, v, q)
        assert_valid_selection(kept, 40, budget)
        assert bool((kept == kept[:, :1]).all()), budget


def test_tova_evicts_the_current_token_when_it_scores_lowest():
    policy = kvpolicy.load_policy("tova", budget=8)
    k, v, q = make_tensors(b=1, hkv=2, hq=4, n=9, d=4, w=1, seed=3)
    q = q[:, :1].expand(1, 4, 1, 4).contiguous()
    k[..., -1, :] = -10 * q[0, :1, 0, :]  # every query head turns away from the newest key
    kept = policy.select(k, v, q)
    assert 8 not in kept.flatten().tolist()


def test_tova_in_a_cache_evicts_one_token_per_step_by_the_newest_query():
    """Prompt cut to the budget once it is in (by the last prompt query), then one token evicted
    per decode step; each eviction is the reference's choice on the cache's own state."""
    budget, hkv, hq, d = 8, 2, 4, 8
    policy = kvpolicy.load_policy("tova", budget=budget)
    cache = kvpolicy.EvictingCache(policy, num_layers=1)
    g = torch.Generator().manual_seed(0)
    for step in range(12):
        expected = None
        state = cache.layers[0]
        if step > 0:
            assert state.eviction_due
            window, wvalid = state.window()
            assert window.shape[2] == 1
            scores = _tova_scores(state.keys, window, slot_valid=state.valid, query_valid=wvalid)
            want = ref.select(scores, budget=budget, recent=0, slot_valid=state.valid)
            pos = state.positions
            expected = [[{int(pos[b, h, j]) for j in want[b][h]} for h in range(hkv)] for b in range(2)]
        t = 12 if step == 0 else 1
        k = torch.randn(2, hkv, t, d, generator=g)
        q = 3 * torch.randn(2, hq, t, d, generator=g)
        cache.step(0, k, torch.randn(2, hkv, t, d, generator=g), q)
        assert state.counts == [12, 12] if step == 0 else state.counts == [budget + 1] * 2
        if expected is not None:
            pos = state.positions
            newest = 12 + step - 1
            for b in range(2):
                for h in range(hkv):
                    held = {int(p) for p in pos[b, h].tolist()} - {newest}
                    assert held == expected[b][h], (step, b, h)
                assert bool((pos[b] == pos[b, :1]).all())


def test_tova_select_mode_direct_path_keeps_what_select_keeps():
    from kvpolicy.selection import choose_directly

    policy = kvpolicy.load_policy("tova@select", budget=16, compress_prompt=False)
    k, v, q = make_tensors(b=2, hkv=2, hq=8, n=40, d=8, w=1, seed=11)
    inp = kvpolicy.policy.eviction_input(
        k, v, q, budget=16, recent=0, slot_valid=None, query_valid=None, positions=None, seed=0,
        layer_idx=0, evictions=0, streams=0)
    direct = choose_directly(policy, inp)
    assert direct is not None
    assert torch.equal(direct, policy.select_from(inp))
    assert bool((direct == direct[:, :1]).all())


@pytest.mark.parametrize("name", ["knorm", "tova"])
def test_properties(name):
    policy = kvpolicy.load_policy(name, budget=20)
    for seed in range(5):
        k, v, q = make_tensors(b=2, hkv=2, hq=4, n=20 + 3 * seed + 1, d=8, w=1, seed=seed)
        n = k.shape[2]
        kept = policy.select(k, v, q, seed=seed)
        protected = (torch.arange(n) >= n - policy.schedule.recent).expand(2, 2, n)
        assert_valid_selection(kept, n, 20, protected)  # exactly budget, ascending so no duplicates
        assert torch.equal(kept, policy.select(k, v, q, seed=seed))
