"""The built-in ``chunkkv`` policy and its ``chunks`` selector against a float64 loop reference
(``reference.chunk_select`` over ``reference.attention``), a hand-computed case, the properties
every eviction keeps (exactly ``budget`` slots, protected ones kept, no duplicates, at most one
chunk cut); its run through ``generate()`` is in test_methods_generate.py."""

from __future__ import annotations

import pytest
import reference as ref
import torch
from helpers import assert_valid_selection, left_padding, make_tensors
from hypothesis import given, settings
from hypothesis import strategies as st

import kvpolicy
from kvpolicy import PolicyError

SMALL = {"recent": 8, "window": 8, "interval": 8}
SHAPES = [  # (B, Hkv, Hq, N, budget)
    (2, 2, 4, 45, 24),
    (1, 2, 6, 33, 32),
    (3, 1, 2, 70, 40),
    (2, 4, 8, 64, 30),
]


def _attention(k, q, c, **valid):
    return ref.attention(k, q, c, pooling="none", window_reduce="sum", group_reduce="mean", **valid)


def _kept_sets(kept):
    return [[kept[b, h].tolist() for h in range(kept.shape[1])] for b in range(kept.shape[0])]


def test_defaults_follow_the_paper():
    policy = kvpolicy.load_policy("chunkkv")
    s = policy.schedule
    assert (s.budget, s.recent, s.interval, s.window, s.compress_prompt) == (1024, 64, 64, 64, True)
    assert policy.config.reservations == []
    scorer = policy.config.scorer
    assert (scorer.type_name, scorer.pooling, scorer.window_reduce, scorer.group_reduce) == (
        "attention", "none", "sum", "mean")
    assert (policy.config.selector.type_name, policy.config.selector.chunk_size) == ("chunks", 10)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("chunk_size", [1, 4, 10])
def test_matches_reference(shape, chunk_size):
    b, hkv, hq, n, budget = shape
    policy = kvpolicy.load_policy(
        {**kvpolicy.load_policy("chunkkv").config.to_dict(), "selector": {"type": "chunks", "chunk_size": chunk_size}},
        budget=budget, **SMALL)
    k, v, q = make_tensors(b=b, hkv=hkv, hq=hq, n=n, d=8, w=8, seed=n + chunk_size)
    kept = policy.select(k, v, 3 * q)
    scores = _attention(k, 3 * q, n - 8)
    assert _kept_sets(kept) == ref.chunk_select(scores, budget=budget, recent=8, chunk_size=chunk_size)
    assert_valid_selection(kept, n, budget, (torch.arange(n) >= n - 8).expand(b, hkv, n))


def test_chunk_size_one_is_greedy_top_k():
    k, v, q = make_tensors(b=2, hkv=2, hq=4, n=50, d=8, w=8, seed=4)
    data = kvpolicy.load_policy("chunkkv").config.to_dict()
    chunks = kvpolicy.load_policy({**data, "selector": {"type": "chunks", "chunk_size": 1}}, budget=20, **SMALL)
    greedy = kvpolicy.load_policy({**data, "selector": {"type": "greedy"}}, budget=20, **SMALL)
    assert torch.equal(chunks.select(k, v, q), greedy.select(k, v, q))


def test_a_hand_computed_eviction():
    """Scores set by hand through the key norms (``key_norm``, highest norm kept): 20 slots, the
    last 4 recent, chunks of 4. Chunk sums: [0-3] 4, [4-7] 14, [8-11] 10, [12-15] 9. A budget of
    10 leaves 6 slots: chunk 4-7 whole, then the best 2 of chunk 8-11 (slots 9 and 11, scores 4
    and 3)."""
    norms = [1, 1, 1, 1,  2, 3, 4, 5,  1, 4, 2, 3,  3, 3, 2, 1,  9, 9, 9, 9]
    k = torch.zeros(1, 1, 20, 4)
    k[0, 0, :, 0] = torch.tensor(norms, dtype=torch.float32)
    policy = kvpolicy.load_policy({
        "name": "hand", "schedule": {"budget": 10, "recent": 4, "window": 0, "interval": 4},
        "scorer": {"type": "key_norm", "low_norm_first": False}, "selector": {"type": "chunks", "chunk_size": 4},
    })
    kept = policy.select(k, k.clone(), torch.zeros(1, 1, 0, 4))
    assert kept[0, 0].tolist() == [4, 5, 6, 7, 9, 11, 16, 17, 18, 19]
    # A budget of 12 takes exactly two whole chunks; 13 adds the best of chunk 12-15 (12 before 13: a tie).
    policy = policy.with_overrides(budget=12)
    assert policy.select(k, k.clone(), torch.zeros(1, 1, 0, 4))[0, 0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 16, 17, 18, 19]
    policy = policy.with_overrides(budget=13)
    assert 12 in policy.select(k, k.clone(), torch.zeros(1, 1, 0, 4))[0, 0].tolist()


def test_chunks_follow_token_positions_with_padding_and_gaps():
    """Chunks are spans of token positions, not of slots: with left padding, and with positions
    that skip evicted tokens (as a cache's do after an eviction), the reference still agrees."""
    b, hkv, n, budget = 3, 2, 60, 30
    k, v, q = make_tensors(b=b, hkv=hkv, hq=4, n=n, d=8, w=8, seed=7)
    slot_valid = left_padding(b, n, [0, 7, 20])
    gaps = torch.cumsum(torch.randint(1, 4, (b, n), generator=torch.Generator().manual_seed(0)), -1)
    positions = torch.where(slot_valid, gaps, -1)
    policy = kvpolicy.load_policy("chunkkv", budget=budget, **SMALL)
    valid = {"slot_valid": slot_valid}
    kept = policy.select(k, v, 3 * q, positions=positions, **valid)
    scores = _attention(k, 3 * q, n - 8, **valid)
    want = ref.chunk_select(scores, budget=budget, recent=8, chunk_size=10, positions=positions, **valid)
    assert _kept_sets(kept) == want
    for bi in range(b):  # padding is never kept while a real slot is left out
        assert bool(slot_valid[bi][kept[bi]].all())


def test_a_chunk_larger_than_the_budget_is_refused_at_load():
    with pytest.raises(PolicyError, match=r"selector\.chunk_size \(10\) is larger than the slots the budget leaves"):
        kvpolicy.load_policy("chunkkv", budget=70)  # 70 - 64 recent = 6 slots for chunks of 10
    with pytest.raises(PolicyError, match=r"chunk_size \(33\).*budget 40 - recent 8 = 32"):
        kvpolicy.load_policy({"name": "x", "schedule": {"budget": 40, "recent": 8}, "scorer": "attention",
                              "selector": {"type": "chunks", "chunk_size": 33}})
    with pytest.raises(PolicyError, match="chunk_size"):
        kvpolicy.load_policy({"name": "x", "schedule": {"budget": 40}, "scorer": "attention",
                              "selector": {"type": "chunks", "chunk_size": 0}})


def test_a_layer_budget_smaller_than_a_chunk_is_refused_before_any_work():
    policy = kvpolicy.load_policy("chunkkv", budget=30, **SMALL)
    k, v, q = make_tensors(b=1, hkv=2, hq=4, n=40, d=8, w=8, seed=1)
    with pytest.raises(ValueError, match=r"chunk_size \(10\) is larger than .*budget 17 - recent 8 = 9"):
        policy.select_heads(k, v, q, budget=17)  # a per-layer allocation's smaller layer


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(12, 70), budget=st.integers(10, 40), recent=st.integers(0, 6), chunk=st.integers(1, 9),
    hkv=st.sampled_from([1, 2, 3]), pad=st.integers(0, 8), seed=st.integers(0, 2**31),
)
def test_properties(n, budget, recent, chunk, hkv, pad, seed):
    """Exactly min(N, budget) slots, ascending so no duplicates, the recent buffer kept, padding
    never kept over a real slot, and at most one chunk cut: every other chunk among the
    candidates is kept whole or evicted whole."""
    if chunk > budget - recent:
        return
    policy = kvpolicy.load_policy({"name": "p", "schedule": {"budget": budget, "recent": recent, "window": 4,
                                   "interval": 4}, "scorer": "attention",
                                   "selector": {"type": "chunks", "chunk_size": chunk}})
    k, v, q = make_tensors(b=2, hkv=hkv, hq=2 * hkv, n=n, d=4, w=4, seed=seed)
    slot_valid = left_padding(2, n, [0, min(pad, n - 1)])
    kept = policy.select(k, v, q, slot_valid=slot_valid)
    keep = min(n, budget)
    assert_valid_selection(kept, n, keep, (torch.arange(n) >= n - recent).expand(2, hkv, n))
    if n <= budget:
        return
    positions = (slot_valid.long().cumsum(-1) - 1).masked_fill(~slot_valid, -1)
    for bi in range(2):
        real = int(slot_valid[bi].sum())
        for h in range(hkv):
            kset = set(kept[bi, h].tolist())
            if real > keep:
                assert all(slot_valid[bi, j] for j in kset)
            chunks: dict[int, list[int]] = {}
            for j in range(n - recent):
                if slot_valid[bi, j]:
                    chunks.setdefault(int(positions[bi, j]) // chunk, []).append(j)
            cut = [c for c, js in chunks.items() if 0 < sum(j in kset for j in js) < len(js)]
            assert len(cut) <= 1, (bi, h, cut)


def test_in_a_cache_each_eviction_is_the_reference_on_the_cache_state():
    """Compress the prompt, then evict every 4 steps; each eviction keeps what the reference keeps
    on the cache's own state (chunks by the tokens' real positions, which skip evicted tokens)."""
    budget, hkv, hq, d, recent = 16, 2, 4, 8, 4
    policy = kvpolicy.load_policy("chunkkv", budget=budget, recent=recent, window=4, interval=4,
                                  ).config.to_dict()
    policy["selector"]["chunk_size"] = 3
    policy = kvpolicy.load_policy(policy)
    cache = kvpolicy.EvictingCache(policy, num_layers=1)
    g = torch.Generator().manual_seed(0)
    checked = 0
    for step in range(30):
        state = cache.layers[0]
        expected = None
        if step > 0 and state.eviction_due:
            window, wvalid = state.window()
            n = state.keys.shape[2]
            scores = _attention(state.keys, window, n - recent, slot_valid=state.valid, query_valid=wvalid)
            want = ref.chunk_select(scores, budget=budget, recent=recent, chunk_size=3, slot_valid=state.valid,
                                    positions=state.positions)
            pos = state.positions
            expected = [[sorted(int(pos[b, h, j]) for j in want[b][h]) for h in range(hkv)] for b in range(2)]
        t = 24 if step == 0 else 1
        cache.step(0, torch.randn(2, hkv, t, d, generator=g), torch.randn(2, hkv, t, d, generator=g),
                   3 * torch.randn(2, hq, t, d, generator=g))
        if step == 0:
            assert state.counts == [24, 24] and state.eviction_due  # the prompt is compressed at the next step
        if expected is not None:
            pos = state.positions
            got = [[sorted(int(p) for p in pos[b, h, :-1].tolist()) for h in range(hkv)] for b in range(2)]
            assert got == expected, step
            checked += 1
    assert checked >= 5
