"""Budget allocation: per-layer budgets, per-head counts, the flat per-head layout and its errors."""

from __future__ import annotations

import math
from importlib.resources import files

import pytest
import torch
import yaml
from helpers import make_tensors
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import kvpolicy
from kvpolicy import EvictingCache, load_policy
from kvpolicy.config import PolicyError
from kvpolicy.profiles import HeadProfile
from kvpolicy.stages.layer_list import largest_remainder

SMALL = {"name": "p", "schedule": {"budget": 24, "recent": 4, "interval": 8, "window": 4}}
ATTENTION = {"type": "attention"}


def _policy(allocation, selector="greedy", reservations=(), **schedule):
    doc = {**SMALL, "scorer": ATTENTION, "selector": {"type": selector}, "allocation": allocation,
           "reservations": list(reservations)}
    doc["schedule"] = {**SMALL["schedule"], **schedule}
    return load_policy(doc)


# -- per-layer budgets ------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 40), budget=st.integers(70, 3000), beta=st.floats(1.0, 50.0))
def test_pyramid_budgets_keep_the_total_and_fall_with_depth(layers, budget, beta):
    policy = load_policy("pyramidkv", budget=budget)
    policy = policy.with_overrides()  # the source mapping round-trips
    budgets = policy.allocation.model_copy(update={"beta": beta}).layer_budgets(budget, layers, 64)
    assert len(budgets) == layers and sum(budgets) == layers * budget
    assert all(a >= b for a, b in zip(budgets, budgets[1:], strict=False))
    if layers > 1:  # the last layer: the recent buffer plus (budget - recent) / beta, rounded
        assert abs(budgets[-1] - (64 + (budget - 64) / beta)) <= 1


def test_pyramid_with_beta_1_is_uniform():
    assert _policy({"type": "pyramid", "beta": 1}).allocation.layer_budgets(24, 5, 4) == [24] * 5


@settings(max_examples=60, deadline=None)
@given(weights=st.lists(st.floats(0.01, 100.0), min_size=1, max_size=30), budget=st.integers(1, 5000))
def test_layer_list_shares_in_proportion(weights, budget):
    alloc = _policy({"type": "layers", "budgets": weights}).allocation
    budgets = alloc.layer_budgets(budget, len(weights), 0)
    assert sum(budgets) == budget * len(weights)
    total = sum(weights)
    for w, b in zip(weights, budgets, strict=True):
        assert abs(b - budget * len(weights) * w / total) < 1


def test_largest_remainder_is_exact_and_close():
    assert largest_remainder([1.5, 1.5, 1.0], 4) == [2, 1, 1]
    assert largest_remainder([0.2] * 5, 1) == [1, 0, 0, 0, 0]


def test_an_explicit_list_that_averages_the_budget_is_kept():
    policy = _policy({"type": "layers", "budgets": [30, 24, 18]})
    assert [s.budget for s in policy.layer_schedules(3)] == [30, 24, 18]


# -- per-head counts (Ada-KV) -------------------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(
    hkv=st.integers(1, 4), n=st.integers(30, 70), budget=st.integers(7, 29), floor=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16), selector=st.sampled_from(["greedy", "stochastic"]),
)
def test_adaptive_counts_add_up_respect_floors_and_keep_protected(hkv, n, budget, floor, seed, selector):
    policy = _policy({"type": "adaptive", "floor": floor}, selector=selector, reservations=[{"type": "sinks", "n": 2}],
                     budget=budget)
    keys, values, queries = make_tensors(b=2, hkv=hkv, hq=2 * hkv, n=n, w=4, seed=seed)
    keep, counts = policy.select_heads(keys, values, queries)
    assert counts.shape == (2, hkv) and keep.shape == (2, hkv, n)
    assert torch.equal(keep.sum(-1), counts)
    assert torch.equal(counts.sum(-1), torch.full((2,), hkv * budget))
    assert bool((counts >= min(math.ceil(floor * budget), n)).all())
    assert bool(keep[..., n - 4:].all()), "the recent buffer is always kept"
    assert bool(keep[..., :2].all()), "the sinks are always kept"
    again, _ = policy.select_heads(keys, values, queries)
    assert torch.equal(keep, again), "seeded runs reproduce"


def test_adaptive_gives_spread_heads_more_slots():
    # Head 0 attends one key sharply, head 1 spreads its attention: head 1 gets more slots.
    n, d = 48, 8
    keys = torch.zeros(1, 2, n, d)
    keys[0, 0, 5, 0] = 30.0
    keys[0, 1] = torch.randn(n, d) * 0.01
    queries = torch.zeros(1, 2, 4, d)
    queries[..., 0] = 1.0
    values = torch.randn(1, 2, n, d)
    _, counts = _policy({"type": "adaptive", "floor": 0.2}).select_heads(keys, values, queries)
    assert counts[0, 1] > counts[0, 0] and int(counts.sum()) == 48


def test_floor_1_is_uniform_per_head():
    keys, values, queries = make_tensors(b=2, hkv=3, hq=6, n=40, w=4, seed=1)
    adaptive = _policy({"type": "adaptive", "floor": 1.0})
    uniform = _policy({"type": "uniform"})
    keep, counts = adaptive.select_heads(keys, values, queries)
    assert bool((counts == 24).all())
    want = torch.zeros_like(keep).scatter_(-1, uniform.select(keys, values, queries), True)
    assert torch.equal(keep, want)


def test_uniform_allocation_is_bit_identical_to_no_allocation():
    keys, values, queries = make_tensors(b=2, hkv=2, hq=4, n=60, w=4, seed=2)
    plain = load_policy({**SMALL, "scorer": ATTENTION, "selector": {"type": "stochastic"}})
    explicit = _policy({"type": "uniform"}, selector="stochastic")
    assert torch.equal(plain.select(keys, values, queries), explicit.select(keys, values, queries))
    assert plain.to_yaml() == explicit.to_yaml()  # uniform is the default: the file keeps its form


def test_select_refuses_per_head_policies_and_points_to_select_heads():
    keys, values, queries = make_tensors(n=40)
    with pytest.raises(ValueError, match="select_heads"):
        load_policy("ada-snapkv", budget=24, recent=4, window=4, interval=8).select(keys, values, queries)


# -- the flat per-head layout in a decoding loop ------------------------------------------------
def _reference(out_q, all_k, all_v, positions, valid, t):
    """Float64 attention of each query over exactly the positions its head holds."""
    b_, hq, _, d = out_q.shape
    hkv = all_k.shape[1]
    g = hq // hkv
    ref = torch.empty_like(out_q)
    for b in range(b_):
        for h in range(hkv):
            held = positions[b, h][valid[b, h]]
            for q in range(t):
                seen = held[held <= all_k.shape[2] - t + q]
                for j in range(g):
                    s = all_k[b, h, seen] @ out_q[b, h * g + j, q] / d**0.5
                    ref[b, h * g + j, q] = torch.softmax(s, 0) @ all_v[b, h, seen]
    return ref


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("name", ["ada-snapkv", "ada-vase-attnv", "pyramidkv"])
def test_uneven_layout_attention_is_exact_and_memory_constant(name, chunk):
    """Decode steps (``chunk`` 1: static memory once evicting) and chunks of 3 tokens every 7th
    step on uneven heads (causal within the chunk; they may outgrow the append room)."""
    torch.manual_seed(0)
    policy = load_policy(name, budget=24, recent=4, interval=8, window=4)
    b, hkv, g, d, layers = 2, 3, 2, 8, 3
    cache = EvictingCache(policy, layers)
    seen_k = [[] for _ in range(layers)]
    seen_v = [[] for _ in range(layers)]
    memory, uneven = set(), False
    for step in range(70):
        t = 11 if step == 0 else chunk if step % 7 == 0 else 1
        for layer in range(layers):
            q = torch.randn(b, hkv * g, t, d, dtype=torch.float64)
            k = torch.randn(b, hkv, t, d, dtype=torch.float64)
            v = torch.randn(b, hkv, t, d, dtype=torch.float64)
            out = cache.attend(layer, q, k, v)
            seen_k[layer].append(k)
            seen_v[layer].append(v)
            view = cache.layers[layer]
            ref = _reference(q, torch.cat(seen_k[layer], 2), torch.cat(seen_v[layer], 2), view.positions, view.valid, t)
            torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
            held = view.valid.sum(-1)
            uneven |= bool((held != held[..., :1]).any())
        if cache.stats()[0].evictions:
            memory.add(cache.memory_bytes())
    if chunk == 1:
        assert len(memory) == 1, "buffers grew or shrank after the first eviction"
    if policy.allocation.per_head:
        assert uneven, "the test should exercise heads holding different counts"


def test_what_locates_the_heads_is_computed_once_per_eviction():
    """docs/allocation.md: the head layout's read plan (and its one host copy, each row's
    surplus) is built after an eviction and reused by every step until the next one."""
    torch.manual_seed(0)
    cache = EvictingCache(load_policy("ada-snapkv", budget=24, recent=4, interval=8, window=4), 1)
    plans, evictions, held = [], [], []  # held: keeps the objects alive, so ids are not reused
    for step in range(40):
        t = 11 if step == 0 else 1
        cache.attend(0, torch.randn(1, 4, t, 8), torch.randn(1, 2, t, 8), torch.randn(1, 2, t, 8))
        heads = cache.layers[0].group.heads
        if not heads.even:
            held.append((heads._reads, heads._surplus))
            plans.append((id(heads._reads), id(heads._surplus)))
            evictions.append(cache.stats()[0].evictions)
    assert len(set(evictions)) >= 2, "the test should span several evictions"
    # One plan per eviction: steps between evictions reuse it.
    assert len(set(plans)) == len(set(evictions))
    assert all(plans[i] == plans[i + 1] for i in range(len(plans) - 1) if evictions[i] == evictions[i + 1])


def test_kv_bytes_are_the_kept_slots_plus_headroom_over_3000_tokens():
    policy = load_policy("ada-snapkv", budget=32, recent=8, interval=8, window=8)
    b, hkv, d = 2, 2, 4
    cache = EvictingCache(policy, 2)
    bytes_seen = set()
    for step in range(3000):
        t = 16 if step == 0 else 1
        for layer in range(2):
            cache.attend(layer, torch.randn(b, 4, t, d), torch.randn(b, hkv, t, d), torch.randn(b, hkv, t, d))
        if step > 40:
            group = cache.layers[0].group
            kv = group.buffers.keys.nbytes + group.buffers.values.nbytes
            bytes_seen.add(kv)
            held = torch.stack([cache.layers[i].valid.sum(-1) for i in range(2)])  # [Lyr, B, Hkv]
            headroom = group.buffers.capacity - group.counts  # every head's free room: cap - L
            slots = held.sum(-1) + hkv * headroom  # per layer and row: kept + headroom
            assert bool((slots == hkv * group.buffers.capacity).all())
    assert len(bytes_seen) == 1
    per_slot = 2 * d * 4  # a key and a value of float32
    assert bytes_seen.pop() == 2 * b * hkv * policy.schedule.capacity * per_slot


def test_row_reordering_keeps_each_rows_heads():
    policy = load_policy("ada-snapkv", budget=24, recent=4, interval=8, window=4)
    cache = EvictingCache(policy, 1)
    for step in range(40):
        t = 10 if step == 0 else 1
        cache.attend(0, torch.randn(3, 4, t, 8), torch.randn(3, 2, t, 8), torch.randn(3, 2, t, 8))
    before = cache.layers[0].positions.clone(), cache.layers[0].keys.clone()
    cache.select_rows([2, 0])
    after = cache.layers[0].positions, cache.layers[0].keys
    assert torch.equal(after[0], before[0][[2, 0]]) and torch.equal(after[1], before[1][[2, 0]])


# -- bad input, before any work ------------------------------------------------------------------
def test_floor_above_1_names_the_field():
    with pytest.raises(PolicyError, match=r"allocation.floor"):
        _policy({"type": "adaptive", "floor": 1.5})


@pytest.mark.parametrize(("budgets", "refusal"), [
    ([True, 1], r"allocation.budgets: budgets\[0\] must be a number, got true \(a boolean\)"),
    ([1, "3"], r"allocation.budgets: budgets\[1\] must be a number, got the string '3': write it unquoted"),
])
def test_a_layer_list_entry_lax_mode_would_convert_is_refused(budgets, refusal):
    """``budgets: [true, 1]`` was read as [1, 1] and ``[1, '3']`` as [1, 3], where a scalar field
    (``floor: true``, ``budget: '16'``) is refused by name."""
    with pytest.raises(PolicyError, match=refusal):
        _policy({"type": "layers", "budgets": budgets})


@pytest.mark.parametrize(("budgets", "want"), [([1e308, 1e308], [24, 24]), ([1e308, 5e307], [32, 16])])
def test_layer_weights_whose_sum_overflows_keep_their_proportions(budgets, want):
    """Weights are read in proportion: [1e308, 1e308] summed to inf and the shares were nan, refused
    with 'cannot convert float NaN to integer'. Now the same proportions as [1, 1] and [2, 1]."""
    assert [s.budget for s in _policy({"type": "layers", "budgets": budgets}).layer_schedules(2)] == want


def test_a_layer_list_of_the_wrong_length_is_refused_at_cache_build():
    policy = _policy({"type": "layers", "budgets": [1, 2, 3]})
    with pytest.raises(PolicyError, match=r"allocation: allocation.budgets has 3 entries but the model has 4 layers"):
        EvictingCache(policy, 4)


def test_budgets_that_leave_no_candidate_are_refused():
    policy = _policy({"type": "layers", "budgets": [1, 10, 10]})  # layer 0: 72 / 21 -> 4 slots, recent 4
    with pytest.raises(PolicyError, match=r"allocation: layer 0 gets a budget of 4 slots, which leaves no candidate"):
        EvictingCache(policy, 3)


@pytest.mark.parametrize(("doc", "refusal"), [
    ({"selector": {"type": "chunks", "chunk_size": 9}, "allocation": {"type": "pyramid", "beta": 15.8}},
     r"layer 1 gets a budget of 5 slots: selector\.chunk_size \(9\) is larger"),
    ({"selector": {"type": "chunks", "chunk_size": 18}, "allocation": {"type": "layers", "budgets": [3, 1]}},
     r"layer 1 gets a budget of 12 slots: selector\.chunk_size \(18\)"),
    ({"selector": {"type": "threshold", "threshold": 0.0, "cap": 20}, "allocation": {"type": "pyramid", "beta": 2}},
     r"layer 1 gets a budget of 14 slots: selector\.cap \(20\)"),
    ({"mode": "select", "scorer": {"type": "quest", "page_size": 16, "granularity": "page"}, "selector": "greedy",
      "allocation": {"type": "pyramid"}, "schedule": {"budget": 20, "recent": 4, "interval": 1, "window": 1}},
     r"layer 0 gets a budget of 35 slots: scorer\.page_size 16 with granularity page must divide(.|\n)*"
     r"layer 1 gets a budget of 5 slots: scorer\.page_size 16 with granularity page needs"),
])
def test_every_layer_budget_passes_the_checks_the_policy_budget_passed(doc, refusal):
    """A chunk, a threshold's cap or a page that fits the policy's budget may not fit a smaller
    layer's: refused when the layer budgets are known (the cache is built), naming the layer,
    instead of failing mid-decode (chunks) or attending past the layer's budget (quest pages)."""
    policy = load_policy({**SMALL, "scorer": {"type": "key_norm"}, **doc,
                          "schedule": {**SMALL["schedule"], "window": 0, **doc.get("schedule", {})}})
    with pytest.raises(PolicyError, match=refusal):
        EvictingCache(policy, 2)
    with pytest.raises(PolicyError, match=refusal):
        policy.layer_schedules(2)


def test_a_profile_for_another_model_shape_is_refused(tmp_path):
    path = tmp_path / "heads.yaml"
    HeadProfile.from_weights(torch.ones(3, 2)).save(path)
    policy = _policy({"type": "profile", "path": str(path)})
    with pytest.raises(PolicyError, match=r"3 layers x 2 KV heads"):
        EvictingCache(policy, 4)
    cache = EvictingCache(policy, 3)  # heads are checked at the first append
    with pytest.raises(PolicyError, match=r"3 layers x 2 KV heads"):
        cache.attend(0, torch.randn(1, 6, 5, 8), torch.randn(1, 3, 5, 8), torch.randn(1, 3, 5, 8))


def test_a_missing_profile_names_the_field(tmp_path):
    with pytest.raises(PolicyError, match=r"allocation.*cannot use the head profile"):
        _policy({"type": "profile", "path": str(tmp_path / "missing.yaml")})


def test_profile_allocation_follows_the_weights(tmp_path):
    weights = torch.tensor([[1.0, 0.0], [3.0, 0.0]])  # head 1 of each layer: streaming
    path = tmp_path / "heads.yaml"
    HeadProfile.from_weights(weights).save(path)
    policy = _policy({"type": "profile", "path": str(path), "floor": 0.25})
    budgets = [s.budget for s in policy.layer_schedules(2, 2)]
    assert sum(budgets) == 2 * 24 and budgets[1] > budgets[0]
    alloc = policy.allocation
    assert alloc.head_budgets(1, budgets[1]) == [2 * budgets[1] - 6, 6]  # the streaming head: its floor
    keys, values, queries = make_tensors(b=1, hkv=2, hq=4, n=60, w=4, seed=3)
    keep, counts = policy.select_heads(keys, values, queries, budget=budgets[1], layer_idx=1)
    assert counts.tolist() == [[2 * budgets[1] - 6, 6]]


def test_a_profile_share_below_a_heads_protected_slots_is_refused_at_cache_build(tmp_path):
    """A streaming head's floor share (0.2 x 256 = 51) below its recent buffer (64) was accepted,
    then the heads' guarantees added up to more than the layer's total and the fourth eviction
    stopped on a SelectionError mid-decode. Reservations count as protected too."""
    path = tmp_path / "heads.yaml"
    HeadProfile.from_weights(torch.tensor([[1.0, 0.0]])).save(path)
    doc = {"name": "p", "schedule": {"budget": 256, "recent": 64, "interval": 64, "window": 64},
           "scorer": ATTENTION, "selector": {"type": "greedy"}, "allocation": {"type": "profile", "path": str(path)}}
    with pytest.raises(PolicyError, match=r"layer 0, KV head 1 gets a share of 51 slots, fewer than its 64 protected"):
        EvictingCache(load_policy(doc), 1)
    doc["allocation"]["floor"] = 0.25  # 64: exactly the recent buffer
    EvictingCache(load_policy(doc), 1)
    doc["reservations"] = [{"type": "sinks", "n": 4}]
    with pytest.raises(PolicyError, match=r"share of 64 slots, fewer than its 68 protected"):
        EvictingCache(load_policy(doc), 1)


@settings(max_examples=25, deadline=None)
@given(w0=st.floats(0.0, 4.0), w1=st.floats(0.5, 4.0), floor=st.floats(0.0, 1.0), recent=st.integers(1, 12),
       sinks=st.integers(0, 4), prompt=st.integers(1, 60))
def test_an_accepted_profile_keeps_every_layers_total_at_every_eviction(tmp_path_factory, w0, w1, floor, recent,
                                                                        sinks, prompt):
    path = tmp_path_factory.mktemp("profile") / "heads.yaml"
    HeadProfile.from_weights(torch.tensor([[w0, w1], [w1, w0]])).save(path)
    doc = {"name": "p", "schedule": {"budget": 24, "recent": recent, "interval": 4, "window": 4},
           "scorer": ATTENTION, "selector": {"type": "greedy"},
           "reservations": [{"type": "sinks", "n": sinks}] if sinks else [],
           "allocation": {"type": "profile", "path": str(path), "floor": floor}}
    try:
        policy = load_policy(doc)
        cache = EvictingCache(policy, 2)
    except PolicyError:
        return  # refused before any work: fine
    budgets = [s.budget for s in policy.layer_schedules(2, 2)]
    torch.manual_seed(0)
    x = lambda t: torch.randn(1, 2, t, 8)  # noqa: E731
    for layer in (0, 1):
        cache.step(layer, x(prompt), x(prompt), x(prompt))
    evictions = [0, 0]
    for _ in range(40):
        for layer in (0, 1):
            cache.step(layer, x(1), x(1), x(1))
        cache.evict_due()
        for layer in (0, 1):
            if cache.layers[layer].stats.evictions > evictions[layer]:  # this layer evicted now
                evictions[layer] = cache.layers[layer].stats.evictions
                assert int(cache.head_counts(layer).sum()) == 2 * budgets[layer]
    assume(sum(evictions) > 0)


def test_vllm_refuses_uneven_budgets_it_cannot_bound(tmp_path):
    """vLLM serves per-head budgets whose fullest head has a data-free bound (Ada-KV's ``adaptive``:
    ``head_cap``), without state or merges, and per-layer budgets known before any data
    (``pyramid``) or decided from each prompt (``cake``), each a KV-cache group per layer, and
    per-head counts whose fullest head has a data-free bound in each layer (``duo``:
    ``layer_head_cap``); other uneven budgets are refused by name (a head profile's ``profile``
    allocation, which bounds no head)."""
    from kvpolicy.vllm.budgets import head_cap
    from kvpolicy.vllm.settings import KVPolicyVLLMError, resolve

    for name in ("pyramidkv", "cake", "duo-attention"):
        assert resolve({"policy": name}).policy() is not None
    profile = tmp_path / "heads.yaml"
    HeadProfile.parse({"kvpolicy_profile": 1, "num_layers": 2, "num_kv_heads": 2,
                       "weights": [[1.0, 0.5], [0.2, 0.1]]}).save(profile)
    spec = yaml.safe_load((files("kvpolicy") / "policies" / "ada-snapkv.yaml").read_text())
    spec["allocation"] = {"type": "profile", "path": str(profile)}
    with pytest.raises(KVPolicyVLLMError, match="shares its budget unevenly .* no bound on a head count known"):
        resolve({"policy": yaml.safe_dump(spec)})
    assert resolve({"policy": "ada-snapkv"}).policy() is not None
    assert head_cap(load_policy("ada-snapkv", budget=100), 8) == 8 * 100 - 7 * 20
    assert head_cap(load_policy("ada-snapkv", budget=100), 1) == 100  # one head keeps the layer's total
    assert head_cap(load_policy("snapkv"), 8) is None
    stateful = yaml.safe_load((files("kvpolicy") / "policies" / "ada-snapkv.yaml").read_text())
    stateful["scorer"] = {"type": "accumulated_attention", "group_reduce": "sum"}
    with pytest.raises(KVPolicyVLLMError, match="keeps a count of its own per head .* and keeps state that sees every query"):
        resolve({"policy": yaml.safe_dump(stateful)})


def test_the_adaptive_head_cap_bounds_every_head_over_random_evictions():
    """No head ever keeps more than ``head_cap`` (every other head keeps its floor), over random
    priorities, skewed toward one head."""
    policy = load_policy("ada-snapkv", budget=20, recent=2, interval=4, window=4)
    cap = policy.config.allocation.head_cap(20, 4)
    for seed in range(20):
        keys, values, queries = make_tensors(b=2, hkv=4, hq=8, n=60, w=4, seed=seed)
        keys[:, 0] *= 8  # one head's attention far more spread: it takes the pool
        _, counts = policy.select_heads(keys, values, queries)
        assert int(counts.max()) <= cap and counts.sum(-1).tolist() == [80, 80]


def test_per_head_select_mode_needs_a_recent_buffer():
    with pytest.raises(PolicyError, match="recent"):
        kvpolicy.load_policy("ada-snapkv@select", recent=0)


@pytest.mark.parametrize("b", [1, 2])
def test_per_head_select_mode_attends_each_heads_own_choice_exactly(b):
    """Select mode with per-head budgets: at each choice the layer's ``Hkv * budget`` slots go to
    the heads as ``Policy.select_heads`` shares them on the full cache; each head then attends
    its own chosen slots plus the tokens appended since, in float64 to rounding."""
    torch.manual_seed(0)
    policy = load_policy("ada-snapkv@select", budget=24, recent=4, interval=8, window=4)
    hkv, g, d, layers = 3, 2, 8, 2
    cache = EvictingCache(policy, layers)
    seen = [{"k": [], "v": [], "q": []} for _ in range(layers)]
    chosen: list[torch.Tensor | None] = [None] * layers
    chosen_at = [0] * layers
    uneven = choices = 0
    for step in range(60):
        t = 11 if step == 0 else 1
        for layer in range(layers):
            q = torch.randn(b, hkv * g, t, d, dtype=torch.float64)
            k = torch.randn(b, hkv, t, d, dtype=torch.float64)
            v = torch.randn(b, hkv, t, d, dtype=torch.float64)
            out = cache.attend(layer, q, k, v)
            for name, x in (("k", k), ("v", v), ("q", q)):
                seen[layer][name].append(x)
            if t > 1:
                continue
            keys, values, queries = (torch.cat(seen[layer][n], 2) for n in ("k", "v", "q"))
            n = keys.shape[2]
            if n > 24 and (chosen[layer] is None or n - chosen_at[layer] >= 8):
                keep, counts = policy.select_heads(keys, values, queries[:, :, -4:], layer_idx=layer)
                assert (counts.sum(-1) == hkv * 24).all()
                uneven += int((counts != counts[..., :1]).any())
                choices += 1
                chosen[layer], chosen_at[layer] = keep, n
            attended = torch.ones(b, hkv, n, dtype=torch.bool)
            if chosen[layer] is not None and n > 24:
                attended[..., : chosen_at[layer]] = chosen[layer]
            ref = torch.empty_like(out)
            for r in range(b):
                for h in range(hkv):
                    slots = attended[r, h].nonzero().squeeze(1)
                    for j in range(g):
                        weights = torch.softmax(keys[r, h, slots] @ q[r, h * g + j, 0] / d**0.5, 0)
                        ref[r, h * g + j, 0] = weights @ values[r, h, slots]
            torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    assert choices >= 10 and uneven, "the test should exercise heads choosing different counts"


def test_the_reconstruction_metric_uses_each_layers_budget_and_heads():
    from kvpolicy.eval.metrics.reconstruction import kept_slots, reconstruction_error

    keys, values, queries = make_tensors(b=1, hkv=2, hq=4, n=80, w=80, seed=4)
    pyramid = load_policy("pyramidkv", budget=24, recent=4, interval=8, window=4)
    budgets = [s.budget for s in pyramid.layer_schedules(3, 2)]
    for layer, budget in enumerate(budgets):
        keep = kept_slots(pyramid, queries, keys, values, layer, budget)
        assert bool((keep.sum(-1) == budget).all())
    ada = load_policy("ada-snapkv", budget=24, recent=4, interval=8, window=4)
    keep = kept_slots(ada, queries, keys, values, 0, 24)
    assert int(keep.sum()) == 48
    uniform = load_policy("snapkv", budget=24, recent=4, interval=8, window=4)
    kept = kept_slots(uniform, queries, keys, values)
    as_mask = torch.zeros(1, 2, 80, dtype=torch.bool).scatter_(-1, kept, True)
    by_index = reconstruction_error(queries[:, :, -8:], keys, values, kept)
    by_mask = reconstruction_error(queries[:, :, -8:], keys, values, as_mask)
    assert abs(by_index - by_mask) < 1e-6


def test_select_mode_attends_each_layers_own_budget():
    policy = load_policy("pyramidkv@select", budget=24, recent=4, interval=8, window=4)
    budgets = [s.budget for s in policy.layer_schedules(3)]
    assert len(set(budgets)) == 3
    cache = EvictingCache(policy, 3)
    for step in range(70):
        t = 10 if step == 0 else 1
        for layer in range(3):
            _, _, valid = cache.step(layer, torch.randn(2, 2, t, 8), torch.randn(2, 2, t, 8), torch.randn(2, 4, t, 8))
            held = 10 + step
            if held > budgets[layer]:  # a selection: the layer's budget plus the tokens since it chose
                attended = valid.sum(-1)
                assert bool((attended >= budgets[layer]).all()) and bool((attended < budgets[layer] + 8).all())


def test_layer_schedules_are_computed_once_per_shape_and_handed_out_as_copies():
    """Every KV-cache group of a vLLM worker asks for the same layer schedules: computed once per
    (layers, KV heads), each caller gets its own list (changing it changes no other's)."""
    policy = load_policy("pyramidkv", budget=96)
    first = policy.layer_schedules(30, 3)
    first[0] = None
    again = policy.layer_schedules(30, 3)
    assert again is not first and again[0] is not None and again == policy.layer_schedules(30, 3)
    assert [s.budget for s in again] == [s.budget for s in load_policy("pyramidkv", budget=96).layer_schedules(30, 3)]
    assert len(policy.layer_schedules(12, 3)) == 12  # another shape: its own
