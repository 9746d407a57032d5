"""The built-in ``lagkv`` policy and its ``lag`` scorer against a float64 loop reference
(``reference.lag``), a hand-computed partition, the properties every eviction keeps, and runs in a
cache (through ``generate()``: test_methods_generate.py)."""

from __future__ import annotations

import math

import pytest
import reference as ref
import torch
from helpers import assert_greedy_matches, assert_valid_selection, left_padding, make_input, make_tensors
from hypothesis import given, settings
from hypothesis import strategies as st

import kvpolicy
from kvpolicy.stages import LagScorer


def _policy(budget, recent=4, lag=6, sink=2, ratio=1.0, interval=4, rank=True):
    return kvpolicy.load_policy({
        "name": "lag-small", "schedule": {"budget": budget, "recent": recent, "window": 0, "interval": interval},
        "scorer": {"type": "lag", "lag_size": lag, "sink": sink, "score_v_ratio": ratio,
                   "rank_within_partition": rank},
        "reservations": [{"type": "sinks", "n": sink}], "selector": "greedy",
    })


def test_defaults_follow_kvpress_and_the_official_code():
    policy = kvpolicy.load_policy("lagkv")
    s = policy.schedule
    assert (s.budget, s.recent, s.interval, s.window, s.compress_prompt) == (1024, 64, 64, 0, True)
    scorer = policy.config.scorer
    assert (scorer.type_name, scorer.lag_size, scorer.sink, scorer.score_v_ratio) == ("lag", 128, 4, 1.0)
    assert scorer.rank_within_partition  # every partition keeps the same share, as the official code
    assert [(r.type_name, r.n) for r in policy.config.reservations] == [("sinks", 4)]
    assert policy.config.selector.type_name == "greedy"
    assert not policy.config.query_readers()  # attention-free: no query window


@pytest.mark.parametrize("rank", [True, False], ids=["ranked", "raw"])
@pytest.mark.parametrize("ratio", [1.0, 0.0, 2.5])
@pytest.mark.parametrize("shape", [(2, 2, 40, 20, 6), (1, 3, 57, 30, 8), (3, 1, 25, 18, 5)],
                         ids=lambda s: "x".join(map(str, s)))
def test_scores_match_reference(shape, ratio, rank):
    b, hkv, n, budget, lag = shape
    k, v, q = make_tensors(b=b, hkv=hkv, hq=hkv, n=n, d=8, w=0, seed=n)
    v = v[..., :6].contiguous()  # values of another width than keys
    inp = make_input(k, v, q, recent=4, budget=budget)
    got = LagScorer(lag_size=lag, sink=2, score_v_ratio=ratio, rank_within_partition=rank).score(inp).double()
    want = ref.lag(k, v, lag_size=lag, sink=2, score_v_ratio=ratio, rank_within_partition=rank)
    scored = want < 1e5
    torch.testing.assert_close(got[scored], want[scored], atol=1e-6, rtol=1e-5)
    # Sinks and tail rank above every partition token, sinks first, the tail newest first.
    for bi in range(b):
        for h in range(hkv):
            order = sorted(range(n), key=lambda j: -float(want[bi, h, j]))
            assert sorted(range(n), key=lambda j: -float(got[bi, h, j]))[: int((~scored[bi, h]).sum())] == order[
                : int((~scored[bi, h]).sum())]


@pytest.mark.parametrize("shape", [(2, 2, 40, 20, 6), (1, 3, 57, 30, 8), (2, 2, 64, 24, 5)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("rank", [True, False], ids=["ranked", "raw"])
def test_kept_slots_match_reference(shape, rank):
    b, hkv, n, budget, lag = shape
    k, v, q = make_tensors(b=b, hkv=hkv, hq=hkv, n=n, d=8, w=0, seed=2 * n)
    policy = _policy(budget, lag=lag, rank=rank)
    kept = policy.select(k, v, q)
    scores = ref.lag(k, v, lag_size=lag, sink=2, rank_within_partition=rank)
    want = ref.select(scores, budget=budget, recent=4, sinks=2)
    assert_greedy_matches(kept, want, scores, None, atol=1e-6)
    assert_valid_selection(kept, n, budget)


def test_a_hand_computed_partition():
    """Two channels, lag 2, no sinks, six slots: partition [0, 1] against [2, 3]. The reference's
    channel ranges are [0, 2] and [0, 4]; key 0 = (0, 4) normalises to (0, 1), key 1 = (1, 1) to
    (0.5, 0.25). Unbiased std of two numbers is |a - b| / sqrt(2): 1/sqrt(2) and 0.25/sqrt(2),
    then a softmax over the two. Values equal to the keys: the score doubles."""
    k = torch.tensor([[0.0, 4.0], [1.0, 1.0], [0.0, 0.0], [2.0, 4.0], [7.0, 7.0], [7.0, 7.0]])[None, None]
    inp = make_input(k, k.clone(), torch.zeros(1, 1, 0, 2), recent=0, budget=3)
    got = LagScorer(lag_size=2, sink=0, score_v_ratio=1.0, rank_within_partition=False).score(inp)[0, 0]
    a, c = 1 / math.sqrt(2), 0.25 / math.sqrt(2)
    p0 = math.exp(a) / (math.exp(a) + math.exp(c))
    torch.testing.assert_close(got[:2].double(), torch.tensor([2 * p0, 2 * (1 - p0)], dtype=torch.float64))
    # [2, 3] against the constant [4, 5]: every channel normalises to 0, so the softmax is uniform.
    torch.testing.assert_close(got[2:4], torch.ones(2))
    assert bool((got[4:] > 2.0).all()) and got[5] > got[4]  # the last partition is the tail, newest first
    # Ranked within each partition (the default): slot 0 (p0 > 1/2) ranks above slot 1; the tie of
    # [2, 3] is ranked by position. Ranks over lag_size, 0 and 1/2, and partition 1 is a quarter of
    # a rank (1 / (6 // 2 + 1)) above partition 0, so equal ranks favour the newer partition.
    ranked = LagScorer(lag_size=2, sink=0, score_v_ratio=1.0).score(inp)[0, 0]
    assert ranked[:4].tolist() == [0.5, 0.0, 0.125, 0.625]
    torch.testing.assert_close(ranked[4:], got[4:])


def test_a_constant_reference_channel_normalises_to_zero_not_nan():
    k = torch.tensor([[0.0, 4.0], [1.0, 1.0], [3.0, 0.0], [3.0, 4.0], [7.0, 7.0], [7.0, 7.0]])[None, None]
    inp = make_input(k, k.clone(), torch.zeros(1, 1, 0, 2), recent=0, budget=3)
    got = LagScorer(lag_size=2, sink=0, rank_within_partition=False).score(inp)
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got[..., :2].double(), ref.lag(k, k.clone(), lag_size=2, sink=0)[..., :2])


def test_too_few_slots_keep_the_sinks_and_the_newest():
    """Under sink + 2 * lag_size held slots nothing is scored by lag: the sinks and the newest
    tokens are kept, as kvpress does there."""
    k, v, q = make_tensors(b=2, hkv=2, hq=2, n=20, d=8, w=0, seed=3)
    kept = _policy(12, lag=10, sink=2).select(k, v, q)
    assert kept.tolist() == [[[0, 1, *range(10, 20)]] * 2] * 2


def test_padding_ranks_slots_among_the_held_ones():
    b, hkv, n, budget = 3, 2, 50, 20
    k, v, q = make_tensors(b=b, hkv=hkv, hq=hkv, n=n, d=8, w=0, seed=5)
    slot_valid = left_padding(b, n, [0, 9, 21])
    kept = _policy(budget, lag=5).select(k, v, q, slot_valid=slot_valid)
    scores = ref.lag(k, v, lag_size=5, sink=2, slot_valid=slot_valid, rank_within_partition=True)
    want = ref.select(scores, budget=budget, recent=4, sinks=2, slot_valid=slot_valid)
    assert_greedy_matches(kept, want, scores, None, atol=1e-6)
    for bi in range(b):
        assert bool(slot_valid[bi][kept[bi]].all())


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(8, 70), budget=st.integers(6, 40), lag=st.integers(1, 9), sink=st.integers(0, 3),
    hkv=st.sampled_from([1, 2]), pad=st.integers(0, 6), seed=st.integers(0, 2**31),
)
def test_properties(n, budget, lag, sink, hkv, pad, seed):
    """Exactly min(N, budget) slots, no duplicates, the recent buffer and sinks kept, padding never
    kept over a real slot, and the same slots on a second call."""
    if sink + 2 >= budget:
        return
    policy = _policy(budget, recent=2, lag=lag, sink=sink)
    k, v, q = make_tensors(b=2, hkv=hkv, hq=hkv, n=n, d=4, w=0, seed=seed)
    slot_valid = left_padding(2, n, [0, min(pad, n - 1)])
    kept = policy.select(k, v, q, slot_valid=slot_valid)
    protected = (torch.arange(n) >= n - 2).expand(2, hkv, n).clone()
    if n > budget:
        for bi in range(2):
            first = int((~slot_valid[bi]).sum())
            protected[bi, :, first: first + sink] = True
    assert_valid_selection(kept, n, min(n, budget), protected)
    assert torch.equal(kept, policy.select(k, v, q, slot_valid=slot_valid))
    for bi in range(2):
        if int(slot_valid[bi].sum()) >= budget:
            assert bool(slot_valid[bi][kept[bi]].all())


def test_in_a_cache_each_eviction_is_the_reference_on_the_cache_state():
    budget, hkv, d = 20, 2, 8
    policy = _policy(budget, recent=4, lag=4, sink=2, interval=4).with_overrides(compress_prompt=True)
    cache = kvpolicy.EvictingCache(policy, num_layers=1)
    g = torch.Generator().manual_seed(1)
    checked = 0
    for step in range(30):
        state = cache.layers[0]
        expected = None
        if step > 0 and state.eviction_due:
            scores = ref.lag(state.keys, state.values, lag_size=4, sink=2, slot_valid=state.valid,
                             rank_within_partition=True)
            want = ref.select(scores, budget=budget, recent=4, sinks=2, slot_valid=state.valid,
                              positions=state.positions)
            pos = state.positions
            expected = [[sorted(int(pos[b, h, j]) for j in want[b][h]) for h in range(hkv)] for b in range(2)]
        t = 30 if step == 0 else 1
        cache.step(0, torch.randn(2, hkv, t, d, generator=g), torch.randn(2, hkv, t, d, generator=g),
                   torch.randn(2, hkv, t, d, generator=g))
        if expected is not None:
            got = [[sorted(int(p) for p in state.positions[b, h, :-1].tolist()) for h in range(hkv)] for b in range(2)]
            assert got == expected, step
            checked += 1
    assert checked >= 5


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 2), st.integers(2, 70), st.integers(1, 12), st.integers(0, 6),
       st.integers(0, 2**31 - 1))
def test_packed_rows_reduce_partitions_by_reshape_exactly_as_by_scatter(b, h, n, lag, sink, seed):
    """Every slot held: the partitions' per-channel minima and maxima by a reshape give the scores
    the scatter over the partition index gives, bit for bit (keys and values alike)."""

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, h, n, 4, generator=g)
    rank = torch.arange(n).expand(b, h, n)
    full = max(n - sink, 0) // lag
    part = (rank - sink).div(lag, rounding_mode="floor")
    in_part = (rank >= sink) & (part < full)
    scored = in_part & (part < full - 1)
    parts = n // lag + 1
    index = torch.where(in_part, part, parts - 1).clamp(0, parts - 1)
    by_scatter = LagScorer._states_score(x, index, in_part, scored, parts)
    by_reshape = LagScorer._states_score(x, index, in_part, scored, parts, (sink, full, lag))
    assert torch.equal(by_scatter, by_reshape)


def test_sinks_the_budget_cannot_keep_are_refused_at_load():
    """The spec: LagKV's sink tokens are always kept. More sinks than the budget leaves to
    candidates were accepted and then cut (found from outside)."""
    doc = {"name": "l", "schedule": {"budget": 24, "recent": 4, "interval": 4, "window": 0},
           "scorer": {"type": "lag", "sink": 21, "lag_size": 8}, "selector": "greedy"}
    with pytest.raises(kvpolicy.PolicyError, match=r"scorer.sink \(21\) is more than .*budget 24 - recent 4 = 20"):
        kvpolicy.load_policy(doc)
    doc["scorer"]["sink"] = 20
    kvpolicy.load_policy(doc)
