"""Threshold selection (the ``threshold`` selector, ``arrival_score``, the ``dms`` built-in).

The rule against a float64 loop reference (``reference.threshold_counts``), its properties with
hypothesis, the buffered score, the cache holding uneven per-head counts (memory and stats),
padded rows, and every refusal. Parity with kvpress's DMSPress is in tests/test_kvpress_parity.py.
"""

from __future__ import annotations

import math

import pytest
import reference as ref
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvpolicy
from kvpolicy import EvictingCache, PolicyError
from kvpolicy.stages.guards import SelectionError


def threshold_policy(threshold: float, *, budget: int = 32, recent: int = 4, interval: int = 4, floor: int = 0,
                     cap: int | None = None, buffered: bool = True, evict_above: int | str | None = "recent",
                     **extra) -> kvpolicy.Policy:
    scorer = {"type": "key_norm", "low_norm_first": True}
    schedule = {"budget": budget, "recent": recent, "interval": interval, "window": 0, "compress_prompt": True}
    if evict_above is not None:
        schedule["evict_above"] = evict_above
    selector = {"type": "threshold", "threshold": threshold, "floor": floor, "cap": cap}
    return kvpolicy.load_policy({
        "name": "thr", "schedule": schedule, "selector": selector,
        "scorer": {"type": "arrival_score", "scorer": scorer} if buffered else scorer, **extra,
    })


def integer_keys(b: int, hkv: int, n: int, d: int, seed: int) -> torch.Tensor:
    """Keys of small integers: squared norms are integers, so a threshold of -sqrt(k + 0.5) is
    never within float32 rounding of a score (the rule, not the norm, is under test)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, (b, hkv, n, d), generator=g).float()


@settings(max_examples=60, deadline=None)
@given(
    b=st.integers(1, 3), hkv=st.integers(1, 3), n=st.integers(1, 40), level=st.integers(0, 40),
    floor=st.integers(0, 8), cap=st.one_of(st.none(), st.integers(8, 20)), recent=st.integers(0, 6),
    pad=st.integers(0, 5), seed=st.integers(0, 1000),
)
def test_threshold_matches_the_float64_loop_reference(b, hkv, n, level, floor, cap, recent, pad, seed):
    budget = recent + 20
    threshold = -math.sqrt(level + 0.5)
    policy = threshold_policy(threshold, budget=budget, recent=recent, floor=floor, cap=cap,
                              evict_above=None if recent == 0 else "recent")
    keys = integer_keys(b, hkv, n, 4, seed)
    slot_valid = torch.stack([torch.arange(n) >= min(pad * r, n) for r in range(b)])
    keep, counts = policy.select_heads(keys, keys, torch.zeros(b, hkv, 0, 4), slot_valid=slot_valid)
    valid = slot_valid[:, None, :].expand(b, hkv, n)
    protected = (torch.arange(n) >= n - recent).expand(b, hkv, n)
    scores = ref.key_norm(keys.double(), low_norm_first=True)
    want = ref.threshold_counts(scores, protected, valid, threshold=threshold, floor=floor, cap=cap, budget=budget)
    # A padding slot of the recent buffer (a row shorter than it) counts as protected, as in
    # every policy; a cache never holds one (rows are packed). The real slots are the rule's.
    assert torch.equal(keep & valid, want)
    assert torch.equal(counts, keep.sum(-1))
    # Properties: protected valid slots kept, floor <= kept candidates <= cap, nothing invalid kept.
    n_prot = (protected & valid).sum(-1)
    cands = (valid & ~protected).sum(-1)
    kept_cands = (keep & ~protected).sum(-1)
    assert not bool((protected & valid & ~keep).any())
    assert not bool((keep & ~valid & ~protected).any())
    assert bool((kept_cands >= torch.clamp(cands, max=floor)).all())
    assert bool((counts <= n_prot + (budget - recent if cap is None else cap)).all())


def test_threshold_by_hand():
    """One head, no recent buffer: scores 3, 1, 2, 0 (as -norm of keys [-3], [-1], [-2], [0]
    after low_norm_first=False), threshold 1.5: slots 0 and 2 pass; floor 3 adds slot 1;
    cap 1 keeps slot 0 only."""
    keys = torch.tensor([3.0, 1.0, 2.0, 0.0]).view(1, 1, 4, 1)
    q = torch.zeros(1, 1, 0, 1)
    def kept(**kw):
        policy = kvpolicy.load_policy({
            "name": "hand", "schedule": {"budget": 4, "recent": 0, "interval": 1, "window": 0},
            "scorer": {"type": "key_norm", "low_norm_first": False},
            "selector": {"type": "threshold", "threshold": 1.5, **kw},
        })
        return policy.select_heads(keys, keys, q)[0][0, 0].nonzero().flatten().tolist()
    assert kept() == [0, 2]
    assert kept(floor=3) == [0, 1, 2]
    assert kept(cap=1) == [0]
    assert kept(floor=1, cap=1) == [0]


def test_the_buffered_score_decides_not_a_fresh_one():
    """``arrival_score`` ranks by the score it stored when it first saw a token: a state that
    says a token was scored keeps its stored score, whatever the keys now say."""
    policy = threshold_policy(-1.5, budget=8, recent=2, interval=1)
    keys = torch.zeros(1, 1, 6, 2)
    keys[..., 0] = torch.tensor([0.0, 5.0, 0.0, 5.0, 0.0, 0.0])  # fresh scores 0, -5, 0, -5, 0, 0
    q = torch.zeros(1, 1, 0, 2)
    fresh = policy.select_heads(keys, keys, q)[0][0, 0].nonzero().flatten().tolist()
    assert fresh == [0, 2, 4, 5]
    stored = torch.tensor([[[-9.0, 0.0, -9.0, 0.0, 0.0, 0.0]]])  # slots 0 and 2 stored as failing
    state = {"arrival_score.score": stored, "arrival_score.scored": torch.ones(1, 1, 6)}
    keep = policy.select_heads(keys, keys, q, state=state)[0][0, 0].nonzero().flatten().tolist()
    assert keep == [1, 3, 4, 5]


def _held(cache: EvictingCache, row: int) -> list[list[int]]:
    view = cache.layers[0]
    return [sorted(view.positions[row, h][view.valid[row, h]].tolist()) for h in range(view.positions.shape[1])]


def test_cache_frees_memory_and_reports_it_step_by_step():
    """A cache running a threshold holds each head's own count: per-head counts differ, the
    stats and ``held_bytes`` report them after every step, no position is held twice, and the
    bytes held are below the room (``memory_bytes``) and below a fixed budget's."""
    policy = threshold_policy(-2.2, budget=48, recent=8, interval=8)
    fixed = kvpolicy.load_policy({
        "name": "fixed", "schedule": {"budget": 48, "recent": 8, "interval": 8, "window": 0, "compress_prompt": True},
        "scorer": {"type": "key_norm"}, "selector": {"type": "greedy"},
    })
    g = torch.Generator().manual_seed(0)
    caches = [EvictingCache(policy, num_layers=2), EvictingCache(fixed, num_layers=2)]
    uneven = False
    for step in range(120):
        t = 40 if step == 0 else 1
        k = torch.randn(2, 3, t, 8, generator=g)
        q = torch.randn(2, 6, t, 8, generator=g)
        for cache in caches:
            for layer in range(2):
                cache.attend(layer, q, k, k)
        cache = caches[0]
        heads = cache.head_counts(0)
        st0 = cache.stats()[0]
        assert st0.head_slots_held == int(heads.sum())
        assert (st0.head_slots_fewest, st0.head_slots_most) == (int(heads.min()), int(heads.max()))
        assert bool((heads <= 48 + 8).all())
        uneven |= bool((heads != heads[:, :1]).any())
        for row in range(2):
            for h, pos in enumerate(_held(cache, row)):
                assert len(pos) == len(set(pos)) == int(heads[row, h])
        groups = cache._unique_groups()
        slot = groups[0].buffers.slot_nbytes()
        held = sum(int(cache.head_counts(layer).sum()) for layer in range(2)) * slot
        assert cache.held_bytes() == held + sum(g.ring.nbytes() for g in groups)
        assert cache.held_bytes() <= cache.memory_bytes()
    assert uneven
    assert caches[0].held_bytes() < caches[0].memory_bytes()
    assert caches[0].held_bytes() < caches[1].held_bytes()


@settings(max_examples=12, deadline=None)
@given(pad=st.integers(1, 20), threshold=st.floats(-3.2, -2.2), floor=st.integers(0, 6), seed=st.integers(0, 99))
def test_padded_rows_hold_what_they_hold_alone(pad, threshold, floor, seed):
    policy = threshold_policy(threshold, budget=32, recent=4, interval=4, floor=floor)
    g = torch.Generator().manual_seed(seed)
    batch = EvictingCache(policy, num_layers=1)
    alone = [EvictingCache(policy, num_layers=1) for _ in range(2)]
    for step in range(40):
        t = 30 if step == 0 else 1
        k = torch.randn(2, 2, t, 8, generator=g, dtype=torch.float64)
        q = torch.randn(2, 4, t, 8, generator=g, dtype=torch.float64)
        valid = torch.ones(2, t, dtype=torch.bool)
        if step == 0:
            valid[1, :pad] = False
        batch.attend(0, q, k, k, token_valid=None if bool(valid.all()) else valid)
        for r in range(2):
            keep = valid[r]
            alone[r].attend(0, q[r : r + 1, :, keep], k[r : r + 1, :, keep], k[r : r + 1, :, keep])
        for r in range(2):  # positions count a row's real tokens: the padded row's are its own
            assert _held(batch, r) == _held(alone[r], 0), (step, r)
            assert torch.equal(batch.head_counts(0)[r], alone[r].head_counts(0)[0])


def test_dms_builtin_runs_at_the_prompt_and_while_decoding():
    policy = kvpolicy.load_policy("dms", budget=64, recent=16, interval=8)
    assert policy.per_head and policy.schedule.fires_above == 16
    cache = EvictingCache(policy, num_layers=1)
    g = torch.Generator().manual_seed(1)
    k = torch.randn(1, 2, 40, 8, generator=g) * 2.5  # norms around 7: the threshold -17 keeps all
    cache.attend(0, torch.randn(1, 4, 40, 8, generator=g), k, k)
    assert cache.layers[0].eviction_due  # the prompt is longer than the window: decided at once
    small = threshold_policy(-2.8, budget=64, recent=16, interval=8)
    cache = EvictingCache(small, num_layers=1)
    cache.attend(0, torch.randn(1, 4, 40, 8, generator=g), k / 2.5, k / 2.5)
    cache.evict_due()
    after_prompt = cache.head_counts(0).clone()
    assert bool((after_prompt < 40).all())
    for _ in range(24):
        x = torch.randn(1, 2, 1, 8, generator=g)
        cache.attend(0, torch.randn(1, 4, 1, 8, generator=g), x, x)
    assert cache.stats()[0].evictions >= 3  # every 8 tokens while decoding


@pytest.mark.parametrize("scorer", [{"type": "attention"}, {"type": "attention", "softmax_over": "all", "kernel": 1},
                                    {"type": "redundancy", "over": "candidates"}, {"type": "key_norm"}])
@pytest.mark.parametrize("pad", [False, True])
def test_select_heads_keeps_every_slot_while_none_is_a_candidate(scorer, pad):
    """N <= recent: no candidate, so nothing is scored (scorers need one) and every slot is kept,
    as select keeps every slot at N <= budget; at N = recent + 1 the threshold decides again."""
    recent, budget = 6, 27
    policy = kvpolicy.load_policy({"name": "x", "schedule": {"budget": budget, "recent": recent, "interval": 2, "window": 4},
                                   "scorer": scorer, "selector": {"type": "threshold", "threshold": 0.4, "floor": 6}})
    for n in range(1, recent + 2):
        k = torch.randn(1, 2, n, 8, generator=torch.Generator().manual_seed(n))
        slot_valid = (torch.arange(n) >= int(pad))[None]  # a padding slot first
        keep, counts = policy.select_heads(k, k.clone(), torch.randn(1, 2, 2, 8), slot_valid=slot_valid)
        assert bool((counts <= budget).all())
        if n <= recent:
            assert bool(keep.all()) and counts.tolist() == [[n, n]]


def test_select_is_refused_with_the_way_out():
    policy = threshold_policy(-2.0)
    k = torch.randn(1, 1, 40, 4)
    with pytest.raises(ValueError, match="select_heads"):
        policy.select(k, k, torch.zeros(1, 1, 0, 4))


@pytest.mark.parametrize(("selector", "field"), [
    ({"threshold": float("nan")}, "threshold"),
    ({"threshold": float("inf")}, "threshold"),
    ({"threshold": 0.0, "floor": -1}, "floor"),
    ({"threshold": 0.0, "cap": -1}, "cap"),
    ({"threshold": 0.0, "floor": 5, "cap": 4}, "selector.floor"),
    ({"threshold": 0.0, "cap": 40}, "selector.cap"),
    ({"threshold": 0.0, "floor": 40}, "selector.floor"),
])
def test_impossible_thresholds_are_refused_at_load(selector, field):
    with pytest.raises(PolicyError, match=field.replace(".", r"\.")):
        kvpolicy.load_policy({
            "name": "bad", "schedule": {"budget": 32, "recent": 4, "window": 0},
            "scorer": {"type": "key_norm"}, "selector": {"type": "threshold", **selector},
        })


def test_cap_below_the_protected_slots_is_refused():
    """Protected slots are always kept: a per-head total (the budget, each head's pool) below them
    is refused, naming the schedule, and a cap of candidates that does not fit beside them in the
    pool is refused, naming the cap."""
    with pytest.raises(PolicyError, match="protects more slots than the budget holds"):
        kvpolicy.load_policy({
            "name": "bad", "schedule": {"budget": 32, "recent": 30, "window": 0},
            "reservations": [{"type": "sinks", "n": 4}],
            "scorer": {"type": "key_norm"}, "selector": {"type": "threshold", "threshold": 0.0},
        })
    with pytest.raises(PolicyError, match=r"selector\.cap"):
        kvpolicy.load_policy({
            "name": "bad", "schedule": {"budget": 32, "recent": 28, "window": 0},
            "reservations": [{"type": "sinks", "n": 2}],
            "scorer": {"type": "key_norm"}, "selector": {"type": "threshold", "threshold": 0.0, "cap": 3},
        })


def test_threshold_with_a_per_head_allocation_or_evict_above_without_one_is_refused():
    with pytest.raises(PolicyError, match="one or the other"):
        kvpolicy.load_policy({
            "name": "bad", "schedule": {"budget": 32, "recent": 4, "window": 0},
            "scorer": {"type": "key_norm"}, "selector": {"type": "threshold", "threshold": 0.0},
            "allocation": {"type": "adaptive"},
        })
    with pytest.raises(PolicyError, match="evict_above"):
        kvpolicy.load_policy({
            "name": "bad", "schedule": {"budget": 32, "recent": 4, "window": 0, "evict_above": 4},
            "scorer": {"type": "key_norm"}, "selector": {"type": "greedy"},
        })
    with pytest.raises(PolicyError, match="evict_above"):
        threshold_policy(0.0, budget=32, recent=4, evict_above=2)


def test_non_finite_scores_are_refused_at_run_time_naming_the_scorer():
    """Finite keys whose norm overflows float32: the inner scorer's inf is refused, naming it,
    before anything is kept or stored."""
    policy = threshold_policy(-2.0, budget=8, recent=2)
    k = torch.ones(1, 1, 12, 4)
    k[0, 0, 3] = 3e38
    with pytest.raises(SelectionError, match="key_norm"):
        policy.select_heads(k, k, torch.zeros(1, 1, 0, 4))
    cache = EvictingCache(policy, num_layers=1)
    cache.step(0, k, k)
    before = cache.layers[0].positions.clone()
    with pytest.raises(SelectionError, match="key_norm"):
        cache.evict_due()
    assert torch.equal(cache.layers[0].positions, before)  # nothing evicted, nothing stored
    assert cache.layers[0].state["arrival_score.scored"].sum() == 0


def test_overrides_move_the_window_the_threshold_waits_for():
    policy = kvpolicy.load_policy("dms", budget=512, recent=32)
    assert (policy.schedule.recent, policy.schedule.evict_above) == (32, 32)


def test_attention_reads_each_heads_own_uneven_slots():
    """Decoding under a threshold, every step's attention equals a float64 softmax over exactly
    the slots its KV head holds (heads below the pool: deficits only, no head above it)."""
    policy = threshold_policy(-2.6, budget=32, recent=4, interval=4)
    cache = EvictingCache(policy, num_layers=1)
    g = torch.Generator().manual_seed(5)
    k = torch.randn(2, 2, 24, 8, generator=g, dtype=torch.float64)
    cache.attend(0, torch.randn(2, 4, 24, 8, generator=g, dtype=torch.float64), k, k)
    differ = False
    for _ in range(40):
        k = torch.randn(2, 2, 1, 8, generator=g, dtype=torch.float64)
        v = torch.randn(2, 2, 1, 8, generator=g, dtype=torch.float64)
        q = torch.randn(2, 4, 1, 8, generator=g, dtype=torch.float64)
        out = cache.attend(0, q, k, v)
        view = cache.layers[0]
        counts = cache.head_counts(0)
        differ |= bool((counts != counts[:, :1]).any())
        for b in range(2):
            for hq in range(4):
                h = hq // 2
                keys, values = view.keys[b, h][view.valid[b, h]], view.values[b, h][view.valid[b, h]]
                assert keys.shape[0] == int(counts[b, h])
                w = torch.softmax(keys @ q[b, hq, 0] / math.sqrt(8), dim=0)
                torch.testing.assert_close(out[b, hq, 0], w @ values, atol=1e-10, rtol=1e-10)
    assert differ


@pytest.mark.usefixtures("one_thread")
def test_dms_through_generate_rows_decode_as_alone():
    """A threshold through ``model.generate`` (``KVPolicyCache``): heads hold uneven counts, less
    than the pool, and each row of a left-padded batch decodes as it does alone."""
    from hf_util import assert_rows_decode_as_alone, fresh, generate, left_padded_prompt, tiny_qwen3

    from kvpolicy import KVPolicyCache

    model = tiny_qwen3(layers=2, vocab=97, hidden=64, heads=4, head_dim=16)
    g = torch.Generator().manual_seed(0)
    for layer in model.model.layers:  # k_norm's unit weights would give every key the same norm
        layer.self_attn.k_norm.weight.data = 1 + 0.5 * torch.randn(16, generator=g)
    ids, mask = left_padded_prompt(97, batch=2, length=24, pads=(0, 5), seed=1)
    with torch.no_grad():
        keys = model(input_ids=ids[:1], use_cache=True).past_key_values.layers[0].keys
    threshold = float((-keys.float().norm(dim=-1)).median())
    policy = threshold_policy(threshold, budget=32, recent=8, interval=8)
    served = fresh(model)
    cache = KVPolicyCache(policy, served)
    generate(served, cache, ids, mask, 48)
    counts = cache.evicting.head_counts(0)
    assert bool((counts != counts[:, :1]).any()) and bool((counts < 32).any())
    assert cache.held_bytes() < cache.memory_bytes()
    # the evaluation harness reports both: the room (kv_mib) and what is held (kv_held_mib)
    from kvpolicy.eval.cost import cache_bytes, cache_held_bytes

    assert (cache_held_bytes(cache), cache_bytes(cache)) == (cache.held_bytes(), cache.memory_bytes())
    assert min(s.evictions for s in cache.stats()) >= 5
    assert_rows_decode_as_alone(fresh(model), policy, ids, mask, 48)


def test_threshold_bench_matches_the_fixed_budget_by_what_a_cache_holds():
    """``benchmarks/threshold_bench.py`` sizes the fixed budget from the schedule alone: its mean
    slots per head over a text equal a cache's, token by token."""
    from helpers import load_benchmark

    bench = load_benchmark("threshold_bench")
    budget, recent, interval, tokens, prefill = 40, 8, 8, 150, 12
    cache = EvictingCache(bench.fixed(budget, recent, interval), num_layers=1)
    g = torch.Generator().manual_seed(0)
    held = []
    for t in [prefill] + [1] * (tokens - prefill):
        k = torch.randn(1, 2, t, 4, generator=g)
        if t > 1:  # the prompt, one chunk: each of its tokens held as it arrived
            cache.step(0, k, k)
            held += list(range(1, t + 1))
            continue
        cache.evict_due()
        cache.step(0, k, k)
        held.append(cache.stats()[0].head_slots_held // 2)
    assert bench.fixed_mean_held(budget, recent, interval, tokens, prefill) == pytest.approx(sum(held) / tokens)
    per_head = bench.fixed_mean_held(budget, recent, interval, tokens, prefill)
    assert bench.equal_budget(per_head, recent, interval, tokens, prefill) == budget


def test_a_merge_over_a_threshold_keeps_the_same_slots():
    """A merge (what becomes of the dropped tokens) composes with the threshold: the same slots
    per head, the same counts; only kept values differ, and keys never."""
    plain = threshold_policy(-2.6, budget=32, recent=4, interval=4)
    merging = threshold_policy(-2.6, budget=32, recent=4, interval=4,
                               merge={"type": "similar", "similarity_threshold": 0.0, "merge_fraction": 1.0})
    caches = [EvictingCache(p, num_layers=1) for p in (plain, merging)]
    g = torch.Generator().manual_seed(2)
    changed = False
    for step in range(30):
        t = 24 if step == 0 else 1
        k = torch.randn(2, 2, t, 8, generator=g, dtype=torch.float64)
        v = torch.randn(2, 2, t, 8, generator=g, dtype=torch.float64)
        q = torch.randn(2, 4, t, 8, generator=g, dtype=torch.float64)
        for cache in caches:
            cache.attend(0, q, k, v)
        a, b = (c.layers[0] for c in caches)
        assert torch.equal(caches[0].head_counts(0), caches[1].head_counts(0))
        assert torch.equal(a.positions, b.positions) and torch.equal(a.keys, b.keys)
        changed |= not torch.equal(a.values, b.values)
    assert changed
