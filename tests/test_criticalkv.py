"""The built-in ``criticalkv`` policy (SnapKV's scores reweighted by ``||v W_o||_1`` in two stages),
its ``output_value_norm`` and ``product`` scorers and ``top_scores``' ``count_recent``, against float64
loop references, and runs in a cache (through ``generate()``: test_methods_generate.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import reference as ref
import torch
from helpers import make_input, make_tensors, model_facts

import kvpolicy
from kvpolicy.policy import eviction_input
from kvpolicy.stages import OutputValueNormScorer, TopScoresReservation


def test_defaults_follow_kvpress():
    policy = kvpolicy.load_policy("criticalkv")
    s = policy.schedule
    assert (s.budget, s.recent, s.interval, s.window, s.compress_prompt) == (1024, 64, 64, 64, True)
    (stage1,) = policy.config.reservations
    assert (stage1.type_name, stage1.n, stage1.count_recent) == ("top_scores", 0.5, True)
    base = stage1.scorer
    assert (base.type_name, base.softmax_over, base.pooling, base.kernel, base.group_reduce) == (
        "attention", "all", "avg", 5, "mean")
    first, second = policy.config.scorer.factors
    assert first.scorer == base and first.offset == 1e-4
    assert (second.scorer.type_name, second.scorer.norm, second.scorer.group_reduce, second.offset) == (
        "output_value_norm", 1, "mean", 0.0)
    assert policy.needs_model == {"output_projection"}


@pytest.mark.parametrize("norm, reduce", [(1, "mean"), (2, "max")])
@pytest.mark.parametrize("tile", [1 << 24, 1 << 20, 7])
def test_output_value_norm_matches_reference_on_stacked_layers(norm, reduce, tile):
    """Rows of two layers stacked in one call (as the executor evicts a group) each read their
    own layer's projection; tiling does not change the result."""
    k, v, q = make_tensors(b=4, hkv=2, hq=6, n=19, d=8, w=0, seed=2)
    facts = model_facts(layers=3, hkv=2, hq=6, d=8, hidden=10)
    layers = torch.tensor([2, 2, 0, 0])
    inp = eviction_input(k, v, q, budget=10, recent=2, seed=0, layer_idx=layers, model=facts)
    got = OutputValueNormScorer(norm=norm, group_reduce=reduce, tile_elements=tile).norms(inp).double()
    for i, layer in enumerate(layers.tolist()):
        want = ref.output_value_norm(v[i : i + 1], facts.output_projection(layer), norm=norm, reduce=reduce)
        torch.testing.assert_close(got[i : i + 1], want, rtol=1e-5, atol=1e-6)


def test_a_head_shard_reads_its_own_heads_projection():
    k, v, q = make_tensors(b=1, hkv=4, hq=8, n=12, d=8, w=0, seed=4)
    facts = model_facts(layers=1, hkv=4, hq=8, d=8)
    scorer = OutputValueNormScorer()
    whole = scorer.norms(eviction_input(k, v, q, budget=6, recent=2, seed=0, model=facts))
    shard = scorer.norms(eviction_input(k[:, 2:], v[:, 2:], q[:, 4:], budget=6, recent=2, seed=0, head_offset=2,
                                        model=facts))
    torch.testing.assert_close(shard, whole[:, 2:])


def test_count_recent_counts_the_recent_buffer_towards_n():
    k, v, q = make_tensors(b=2, hkv=2, hq=2, n=30, d=8, w=0, seed=1)
    slot_valid = torch.ones(2, 2, 30, dtype=torch.bool)
    slot_valid[1, :, :3] = False  # padding: row 1 holds 3 fewer slots, none of them recent
    inp = make_input(k, v, q, recent=4, budget=16, slot_valid=slot_valid)
    protected = (torch.arange(30) >= 26).expand(2, 2, 30).clone()
    stage = TopScoresReservation(n=10, scorer={"type": "key_norm", "low_norm_first": False}, count_recent=True)
    got = stage.reserve(inp, protected)
    norms = k.norm(dim=-1)
    for b in range(2):
        for h in range(2):
            cands = [j for j in range(26) if slot_valid[b, h, j]]
            want = set(sorted(cands, key=lambda j: -float(norms[b, h, j]))[:6])  # 10 - the 4 recent
            assert set(got[b, h].nonzero().flatten().tolist()) == want
    plain = TopScoresReservation(n=10, scorer={"type": "key_norm", "low_norm_first": False}).reserve(inp, protected)
    assert bool((plain.sum(-1) == 10).all())


def _criticalkv_reference(k, v, q, facts, *, budget, recent):
    n = k.shape[2]
    qpos = torch.arange(n - q.shape[2], n).expand(k.shape[0], q.shape[2])
    c = n - recent
    base = ref.attention_all(k, q, qpos)  # pooled over the candidates only, as SnapKV pools its non-window keys
    base = torch.stack([torch.stack([torch.tensor(ref.pool1d(base[b, h, :c].tolist(), "avg", 5) + [0.0] * recent,
                                                  dtype=torch.float64)
                                     for h in range(k.shape[1])]) for b in range(k.shape[0])])
    weight = ref.output_value_norm(v, facts.output_projection(0))
    second = (base + 1e-4) * weight
    stage1 = max(0, int(0.5 * budget) - recent)  # the window counts towards the first half
    return ref.select(second, budget=budget, recent=recent, reserve_scores=base, reserve_n=stage1)


@pytest.mark.parametrize("shape", [(2, 2, 4, 50, 24), (1, 3, 6, 41, 20)], ids=lambda s: "x".join(map(str, s)))
def test_the_policy_keeps_the_reference_slots(shape):
    b, hkv, hq, n, budget = shape
    k, v, q = make_tensors(b=b, hkv=hkv, hq=hq, n=n, d=8, w=6, seed=n)
    facts = model_facts(layers=1, hkv=hkv, hq=hq, d=8, hidden=10)
    policy = kvpolicy.load_policy("criticalkv", budget=budget, recent=6, window=6, interval=6)
    kept = policy.select(k, v, q, model=facts)
    want = _criticalkv_reference(k, v, q, facts, budget=budget, recent=6)
    assert [[set(h.tolist()) for h in row] for row in kept] == [[set(h) for h in row] for row in want]


def test_half_the_budget_below_the_window_loads_and_keeps_the_reference_slots():
    """The first half counts the window (``count_recent``): where half the budget is below the
    window (96 beside the shipped 64, one of `kvpolicy eval`'s default budgets) the first stage
    adds nothing, and the load check counts the window once, not once more for the half."""
    k, v, q = make_tensors(b=2, hkv=2, hq=4, n=40, d=8, w=12, seed=7)
    facts = model_facts(layers=1, hkv=2, hq=4, d=8, hidden=10)
    policy = kvpolicy.load_policy("criticalkv", budget=20, recent=12, window=12, interval=12)
    kept = policy.select(k, v, q, model=facts)
    want = _criticalkv_reference(k, v, q, facts, budget=20, recent=12)
    assert [[set(h.tolist()) for h in row] for row in kept] == [[set(h) for h in row] for row in want]
    assert kvpolicy.load_policy("criticalkv", budget=96).schedule.budget == 96
    with pytest.raises(kvpolicy.PolicyError, match="recent 64 [+] reserved 4 > budget 64|must be above the recent"):
        kvpolicy.load_policy("criticalkv", budget=64)


def test_make_input_without_facts_names_the_stage():
    k, v, q = make_tensors(n=12, w=0)
    with pytest.raises(KeyError, match="output_value_norm.*output_projection"):
        OutputValueNormScorer().norms(make_input(k, v, q))


def test_each_norm_is_computed_once_and_kept_with_its_token():
    """The norm is state: a slot that holds one keeps it (not recomputed), a new slot (-1) gets
    its own, padding stays -1; in a cache, every eviction's state equals the norms of the held
    values."""
    k, v, q = make_tensors(b=2, hkv=2, hq=4, n=20, d=8, w=0, seed=5)
    facts = model_facts(layers=1, hkv=2, hq=4, d=8, hidden=10)
    scorer = OutputValueNormScorer()
    base = eviction_input(k, v, q, budget=10, recent=2, seed=0, model=facts)
    full = scorer.norms(base)
    known = full.clone()
    known[..., 12:] = -1.0  # the tokens since the last eviction
    known[0, 1, 3] = 123.0  # a held slot's stored norm is read, not recomputed
    slot_valid = torch.ones(2, 2, 20, dtype=torch.bool)
    slot_valid[1, :, 18:] = False
    known[1, :, 18:] = -1.0
    inp = replace(eviction_input(k, v, q, budget=10, recent=2, seed=0, slot_valid=slot_valid, model=facts),
                  state={scorer.state_key: {"norm": known}})
    got = scorer.update_state(inp)["norm"]
    want = full.clone()
    want[0, 1, 3] = 123.0
    want[1, :, 18:] = -1.0
    torch.testing.assert_close(got, want)

    policy = kvpolicy.load_policy("criticalkv", budget=16, recent=4, window=4, interval=4)
    cache = kvpolicy.EvictingCache(policy, 1, model_facts=facts)
    g = torch.Generator().manual_seed(1)
    (name,) = [n for n in policy.state_fields if n.endswith(".norm")]
    checked = evictions = 0
    for step in range(30):
        t = 24 if step == 0 else 1
        cache.step(0, torch.randn(1, 2, t, 8, generator=g), torch.randn(1, 2, t, 8, generator=g),
                   torch.randn(1, 4, t, 8, generator=g))
        view = cache.layers[0]
        state = view.state[name]
        held = state >= 0
        want = ref.output_value_norm(view.values, facts.output_projection(0))
        torch.testing.assert_close(state[held].double(), want[held], rtol=1e-5, atol=1e-6)
        if view.stats.evictions > evictions:  # this step's eviction computed the 16 kept, not the new token
            evictions = view.stats.evictions
            assert bool(held[..., :16].all()) and not bool(held[..., 16:].any())
            checked += 1
    assert checked >= 5
