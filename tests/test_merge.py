"""Merge stages (``merge: cam | similar | d2o``): each rule against its float64 loop reference
(``tests/reference.py``), the properties every merge keeps (the kept slots, their count and every
key unchanged; values nothing merged into unchanged), padded rows equal to rows alone, every
layout writing merged values, and the refusals."""

from __future__ import annotations

import math
import warnings

import pytest
import reference as ref
import torch
from helpers import assert_padded_row_merges_alone
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy import EvictingCache, PolicyError, PolicyWarning, eviction, load_policy
from kvpolicy.inputs import eviction_input
from kvpolicy.stages import CamMerge, D2OMerge, EvictionInput, SimilarMerge

B, HKV, HQ, D = 2, 2, 4, 8


def _tensors(seed: int, n: int, b: int = B, hkv: int = HKV, d: int = D):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, hkv, n, d, generator=g)
    keys[:, :, ::3] += keys[:, :, 1::3].mean(2, keepdim=True)  # some keys alike, so merges happen
    values = torch.randn(b, hkv, n, d, generator=g)
    return g, keys, values


def _keep(g: torch.Generator, valid: torch.Tensor, kept: int, recent: int) -> torch.Tensor:
    """A random kept set per row and head: ``kept`` valid slots, the last ``recent`` always."""
    b, h, n = valid.shape
    pri = torch.rand(b, h, n, generator=g)
    pri[..., n - recent:] = 2.0
    pri = pri.masked_fill(~valid, -1.0)
    idx = pri.topk(kept, dim=-1).indices
    return torch.zeros(b, h, n, dtype=torch.bool).scatter_(-1, idx, True) & valid


def _input(keys, values, valid, positions, state=None) -> EvictionInput:
    b, _, n, d = keys.shape
    return EvictionInput(
        keys, values, torch.zeros(b, HQ, 1, d), budget=n, num_candidates=n, slot_valid=valid,
        query_valid=torch.ones(b, 1, dtype=torch.bool), positions=positions, state=state,
    )


def _layout(n: int, seed: int, pad: int = 3):
    """Validity with padding at the front of row 1, and positions shuffled per head (per-head
    layouts hold slots out of position order)."""
    g = torch.Generator().manual_seed(seed + 100)
    valid = torch.ones(B, HKV, n, dtype=torch.bool)
    valid[1, :, :pad] = False
    positions = torch.full((B, HKV, n), -1, dtype=torch.long)
    for b in range(B):
        for h in range(HKV):
            slots = valid[b, h].nonzero().flatten()
            positions[b, h, slots] = torch.randperm(slots.numel(), generator=g)
    return valid, positions


# -- each rule against its reference -------------------------------------------------------------
@pytest.mark.parametrize(("threshold", "fraction"), [(0.0, 1.0), (0.3, 1.0), (-1.0, 0.5), (0.0, 0.25)])
def test_similar_matches_its_reference(threshold, fraction):
    n = 20
    g, keys, values = _tensors(1, n)
    valid, positions = _layout(n, 1)
    keep = _keep(g, valid, 9, 2)
    stage = SimilarMerge(similarity_threshold=threshold, merge_fraction=fraction, tile_elements=7)
    got = stage.merge(_input(keys, values, valid, positions), keep).values
    want = ref.similar_merge(keys, values, keep, valid, similarity_threshold=threshold, merge_fraction=fraction)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert not torch.equal(want, values.double()), "the case merges something"


def test_cam_matches_its_reference_given_the_same_draws():
    n, budget = 24, 3
    g, keys, values = _tensors(2, n)
    valid, positions = _layout(n, 2)
    keep = _keep(g, valid, 10, 2)
    attention = torch.rand(B, HKV, n, generator=g) * 3
    attention[0, 0, :6] = 0.0  # 0 / 0 -> p 0 and x / 0 -> p 1 where a window's attention is all 0
    stage = CamMerge(merge_budget=budget, mass="faithful")
    inp = _input(keys, values, valid, positions, state={stage.attention.state_key: {"attention": attention}})
    u = torch.rand(B, HKV, n, generator=g, dtype=torch.float64)
    want, p_want = ref.cam_merge(values, keep, valid, positions, attention, u, merge_budget=budget)
    p = stage.merge_probability(inp, keep)
    torch.testing.assert_close(p.double(), p_want, rtol=1e-6, atol=1e-7)
    got = stage.merge_with(inp, keep, u < p_want)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert not torch.equal(want, values.double())


def test_cam_probability_one_and_zero_merge_all_and_none():
    """With every draw merging (p = 1 forced) and none (p = 0), the rule is deterministic."""
    n = 16
    g, keys, values = _tensors(3, n)
    valid, positions = _layout(n, 3, pad=0)
    keep = _keep(g, valid, 8, 2)
    stage = CamMerge(merge_budget=4, mass="faithful")
    inp = _input(keys, values, valid, positions, state={stage.attention.state_key: {"attention": torch.ones(B, HKV, n)}})
    none = stage.merge_with(inp, keep, torch.zeros(B, HKV, n, dtype=torch.bool))
    assert torch.equal(none, values)
    every = stage.merge_with(inp, keep, torch.ones(B, HKV, n, dtype=torch.bool))
    want, p = ref.cam_merge(values, keep, valid, positions, torch.ones(B, HKV, n), torch.zeros(B, HKV, n),
                            merge_budget=4)
    # Equal attention everywhere: A_i / mean = 1, except a token with no kept slot after it (no window).
    assert set(p[valid & ~keep].tolist()) <= {0.0, 1.0} and float(p.sum()) > 0
    torch.testing.assert_close(every.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mass", ["faithful", "bounded", "attention"])
def test_cam_draws_from_the_rows_seeded_streams(mass):
    n = 16
    g, keys, values = _tensors(4, n)
    valid, positions = _layout(n, 4)
    keep = _keep(g, valid, 8, 2)
    stage = CamMerge(merge_budget=4, mass=mass)
    state = {stage.attention.state_key: {"attention": torch.rand(B, HKV, n, generator=g)},
             stage.state_key: {"mass": 1.0 + torch.rand(B, HKV, n, generator=g), "absorbed": torch.zeros(B, HKV, n)}}
    inp = _input(keys, values, valid, positions, state=state)
    got = stage.merge(inp, keep).values
    u = inp.head_uniform(n, stream="cam")
    draws = u < stage.merge_probability(inp, keep)
    given = {"faithful": lambda: stage.merge_with(inp, keep, draws), "bounded": lambda: stage.merge_bounded(inp, keep, draws)[0],
             "attention": lambda: stage.merge_attention(inp, keep, draws)[0]}[mass]()
    assert torch.equal(got, given)
    assert torch.equal(got, stage.merge(_input(keys, values, valid, positions, state=state), keep).values)
    assert 0 < int((draws & ~keep & valid).sum()) < int((~keep & valid).sum()), "some draws merge, some do not"


def test_d2o_matches_its_reference_over_repeated_merges():
    """Three merges in a row on the same slots: the per-slot weights and the per-head threshold
    carry over, so a slot that absorbed tokens weighs as many at the next merge."""
    n = 18
    g, keys, values = _tensors(5, n)
    valid, positions = _layout(n, 5)
    stage = D2OMerge(ema=0.3, tile_elements=5)
    weight, threshold = torch.ones(B, HKV, n), torch.zeros(B, HKV)
    evictions = torch.zeros(B, HKV, dtype=torch.long)
    rw, rt, re = weight.double(), threshold.double(), evictions.clone()
    for _ in range(3):
        keep = _keep(g, valid, 11, 2)
        state = {stage.state_key: {"weight": weight, "threshold": threshold, "evictions": evictions}}
        out = stage.merge(_input(keys, values, valid, positions, state=state), keep)
        want, rw, rt, re = ref.d2o_merge(keys, values, keep, valid, rw, rt, re, ema=0.3)
        torch.testing.assert_close(out.values.double(), want, rtol=1e-5, atol=1e-6)
        weight, threshold, evictions = out.state["weight"], out.state["threshold"], out.state["evictions"]
        torch.testing.assert_close(weight.double(), rw, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(threshold.double(), rt, rtol=1e-5, atol=1e-6)
        assert torch.equal(evictions, re)
        values = want.float()  # the next merge starts from the merged values
    assert float(weight.max()) > 1.5, "some slot absorbed tokens"


# -- properties of every merge, through the eviction core -----------------------------------------
MERGES = {"similar": {"type": "similar"}, "cam": {"type": "cam", "merge_budget": 3, "max_absorbed": 0.5},
          "cam-bounded": {"type": "cam", "merge_budget": 3, "mass": "bounded"},
          "cam-faithful": {"type": "cam", "merge_budget": 3, "mass": "faithful"}, "d2o": {"type": "d2o"}}


def _policy(merge: str | None, budget: int = 12, **extra):
    base = load_policy("h2o", budget=budget, recent=3, window=4, interval=4, **extra).config.to_dict()
    if merge is not None:
        base["merge"] = MERGES[merge]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PolicyWarning)  # cam-faithful's (tested on its own)
        return load_policy(base)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(13, 30), merge=st.sampled_from(sorted(MERGES)))
def test_a_merge_keeps_the_slots_count_and_untouched_values(seed, n, merge):
    """Through the eviction core: the kept slots (and so their count and keys) are the policy's
    without the merge; the merged values are the reference's, and exactly the input's on every
    slot the reference merges nothing into."""
    g, keys, values = _tensors(seed, n)
    queries = torch.randn(B, HQ, 4, D, generator=g)
    plain, merging = _policy(None), _policy(merge)

    def run(policy):
        state = policy._given_state(None, B, HKV, n, keys.device)
        inp = eviction_input(keys, values, queries, budget=policy.budget, recent=3, seed=0, state=state)
        return inp, eviction.evict(policy, inp)

    (_, a), (inp, b) = run(plain), run(merging)
    assert a.values is None and b.values is not None
    assert torch.equal(a.slots, b.slots), "a merge never changes which slots are kept"
    assert b.slots.shape[-1] == 12
    keep = torch.zeros(B, HKV, n, dtype=torch.bool).scatter_(-1, b.slots, True)
    valid = torch.ones(B, HKV, n, dtype=torch.bool)
    if merge == "similar":
        want = ref.similar_merge(keys, values, keep, valid)
    elif merge == "cam-faithful":
        positions = torch.arange(n).expand(B, HKV, n)
        want, _ = ref.cam_merge(values, keep, valid, positions, b.state["accumulated_attention.attention"],
                                inp.head_uniform(n, stream="cam"), merge_budget=3)
    elif merge == "cam":  # mass: attention, the default
        positions = torch.arange(n).expand(B, HKV, n)
        want, absorbed = ref.cam_attention_merge(
            values, keep, valid, positions, b.state["accumulated_attention.attention"], torch.zeros(B, HKV, n),
            inp.head_uniform(n, stream="cam"), merge_budget=3, num_candidates=inp.num_candidates, max_absorbed=0.5)
        torch.testing.assert_close(b.state["cam.absorbed"].double(), absorbed, rtol=1e-5, atol=1e-6)
    elif merge == "cam-bounded":
        positions = torch.arange(n).expand(B, HKV, n)
        want, mass = ref.cam_bounded_merge(values, keep, valid, positions, b.state["accumulated_attention.attention"],
                                           torch.ones(B, HKV, n), inp.head_uniform(n, stream="cam"), merge_budget=3)
        torch.testing.assert_close(b.state["cam.mass"].double(), mass, rtol=1e-5, atol=1e-6)
    else:
        fresh = torch.ones(B, HKV, n), torch.zeros(B, HKV), torch.zeros(B, HKV, dtype=torch.long)
        want, weight, _, _ = ref.d2o_merge(keys, values, keep, valid, *fresh, ema=0.5)
        torch.testing.assert_close(b.state["d2o.weight"].double(), weight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b.values.double(), want, rtol=1e-5, atol=1e-6)
    untouched = (want == values.double()).all(-1)
    assert torch.equal(b.values[untouched], values[untouched]), "values nothing merged into are unchanged"


@pytest.mark.parametrize("merge", sorted(MERGES))
@pytest.mark.parametrize("pad", [2, 5])
def test_a_padded_row_merges_exactly_as_it_would_alone(merge, pad):
    alone = assert_padded_row_merges_alone(_policy(merge), torch.Generator().manual_seed(9), pad, batch=B,
                                           hkv=HKV, hq=HQ, d=D)
    assert alone.layers[0].stats.evictions >= 3


@pytest.mark.parametrize("allocation", [None, {"type": "adaptive"}])
def test_every_layout_writes_the_merged_values(allocation):
    """The cache's first eviction (even rows; per-head runs under an adaptive allocation) holds
    the reference's merged values of the kept slots, and the keys of the kept tokens unchanged."""
    over = {"budget": 12, "recent": 2, "window": 4, "interval": 4}
    data = load_policy("snapkv", **over).config.to_dict()
    data["merge"] = {"type": "similar"}
    if allocation is not None:
        data["allocation"] = allocation
    policy = load_policy(data)
    n = 16
    g, keys, values = _tensors(11, n, b=1)
    queries = torch.randn(1, HQ, n, D, generator=g)
    cache = EvictingCache(policy, num_layers=1)
    cache.step(0, keys[:, :, :12], values[:, :, :12], queries[:, :, :12])
    for t in range(12, n):
        cache.step(0, keys[:, :, t : t + 1], values[:, :, t : t + 1], queries[:, :, t : t + 1])
    assert cache.evict_due() == 1
    keep, _ = policy.select_heads(keys, values, queries[:, :, -4:])
    want = ref.similar_merge(keys, values, keep, torch.ones_like(keep))
    view = cache.layers[0]
    for h in range(HKV):
        pos = view.positions[0, h][view.valid[0, h]]
        assert pos.tolist() == keep[0, h].nonzero().flatten().tolist(), "the cache keeps select_heads' slots"
        torch.testing.assert_close(view.values[0, h][view.valid[0, h]].double(), want[0, h, pos], rtol=1e-5, atol=1e-6)
        assert torch.equal(view.keys[0, h][view.valid[0, h]], keys[0, h, pos]), "keys are never merged"
    assert not torch.equal(want[keep], values.double()[keep])


# -- refusals --------------------------------------------------------------------------------------
def test_select_mode_refuses_a_merge_naming_the_field():
    with pytest.raises(PolicyError, match="merge 'similar'.*select mode evicts nothing"):
        load_policy("snapkv-merge", mode="select")
    load_policy("snapkv", mode="select")  # drop, the default, is fine


@pytest.mark.parametrize(("merge", "field"), [
    ({"type": "cam", "merge_budget": 0}, "merge_budget"),
    ({"type": "cam", "max_absorbed": 0.0}, "max_absorbed"),
    ({"type": "cam", "max_absorbed": math.inf}, "max_absorbed"),
    ({"type": "similar", "similarity_threshold": 1.5}, "similarity_threshold"),
    ({"type": "similar", "merge_fraction": 0.0}, "merge_fraction"),
    ({"type": "d2o", "ema": 1.0}, "ema"),
    ({"type": "d2o", "ema": math.nan}, "ema"),
    ({"type": "nosuch"}, "merge"),
])
def test_merge_hyperparameters_out_of_range_are_refused_by_name(merge, field):
    data = load_policy("snapkv").config.to_dict()
    data["merge"] = merge
    with pytest.raises(PolicyError, match=field):
        load_policy(data)


def test_drop_is_the_default_and_files_keep_their_form():
    assert load_policy("snapkv").config.merge.type_name == "drop"
    assert "merge" not in load_policy("snapkv").config.to_dict()
    assert load_policy("snapkv-merge").config.to_dict()["merge"]["type"] == "similar"
    assert load_policy(load_policy("d2o").to_yaml()).config.merge.type_name == "d2o"


@pytest.mark.parametrize("name", ["snapkv-merge", "cam", "d2o"])
def test_generate_decodes_padded_rows_as_alone_under_a_merge(name, one_thread):
    """``generate()`` through ``KVPolicyCache``: each row of a left-padded batch decodes under a
    merge policy as it does alone (the padded-row check of ``kvpolicy.hf.padded_rows``)."""
    pytest.importorskip("transformers")
    from hf_util import assert_rows_decode_as_alone, fresh, left_padded_prompt, tiny_qwen3

    model = tiny_qwen3(layers=2, vocab=512)
    ids, mask = left_padded_prompt(512, 2, 20, (0, 6), 3)
    policy = load_policy(name, budget=24, recent=4, interval=4, window=4)
    assert_rows_decode_as_alone(fresh(model), policy, ids, mask, 48)


def test_similar_merges_its_top_fraction_when_the_quantile_falls_among_tokens_below_the_threshold():
    """Tokens below ``similarity_threshold`` rank as -inf; a ``1 - merge_fraction`` quantile
    between two of them was lerp(-inf, -inf) = NaN, which no similarity reaches, so nothing
    merged (found from outside). One evicted token passes (cosine ~0.98), three do not: at a
    fraction of 0.5 or 0.34 the passing one is in the top fraction and merges."""
    kept = torch.tensor([1.0, 0, 0, 0])
    evicted = [torch.tensor([1.0, 0.2, 0, 0]), torch.eye(4)[1], torch.eye(4)[2], torch.eye(4)[3]]
    keys = torch.stack([kept, *evicted])[None, None]  # [1, 1, 5, 4]
    values = torch.randn(1, 1, 5, 4, generator=torch.Generator().manual_seed(0))
    keep = torch.tensor([True, False, False, False, False])[None, None]
    inp = EvictionInput(keys, values, torch.zeros(1, 1, 1, 4), budget=5, num_candidates=5,
                        slot_valid=torch.ones(1, 1, 5, dtype=torch.bool), query_valid=torch.ones(1, 1, dtype=torch.bool),
                        positions=torch.arange(5)[None, None])
    merged = [SimilarMerge(similarity_threshold=0.5, merge_fraction=f).merge(inp, keep).values[0, 0, 0] for f in
              (1.0, 0.5, 0.34)]
    assert not torch.equal(merged[0], values[0, 0, 0])
    assert torch.equal(merged[1], merged[0]) and torch.equal(merged[2], merged[0])  # the same one token merged


def test_d2o_leaves_a_head_that_keeps_nothing_as_it_was():
    """A threshold selector that nothing passes, recent 0: a head keeps no slot, so its evicted
    tokens have nowhere to merge. d2o's similarity threshold became -inf there and the next
    eviction stopped on d2o's own non-finite state (found from outside); it now stays put."""
    policy = load_policy({"name": "t", "schedule": {"budget": 6, "recent": 0, "interval": 2, "window": 0,
                                                    "evict_above": 0},
                          "scorer": {"type": "key_norm"}, "selector": {"type": "threshold", "threshold": 1e9},
                          "merge": {"type": "d2o"}})
    cache = EvictingCache(policy, 1)
    g = torch.Generator().manual_seed(0)
    for step in range(6):
        t = 4 if step == 0 else 1
        k, v, q = (torch.randn(1, h, t, 8, generator=g) for h in (2, 2, 4))
        cache.attend(0, q, k, v)
        state = cache.layers[0].state
        assert bool(torch.isfinite(state["d2o.threshold"]).all())
    assert state["d2o.evictions"].max() == 0  # never a merge: the moving average never started


@pytest.mark.parametrize("name", ["cam", "d2o"])
@pytest.mark.parametrize(("batch", "hkv", "prompt"), [(1, 1, 1), (1, 1, 6), (2, 1, 4), (1, 2, 4), (2, 2, 1)])
def test_h2o_merges_keep_h2os_slots_when_their_state_is_updated_between_evictions(name, batch, hkv, prompt):
    """A prompt shorter than the budget: before the first eviction the accumulated attention is
    brought up to date between evictions (its window would lose unseen queries), while the merge's
    own state (updated at evictions only) stays as it is. That update wrote the merge's state, a
    view of the cache's buffer, onto itself: a RuntimeError ("refer to a single memory location")
    where every row held one count and a layer had one KV head. Now the merge's fields are left where they are, and the
    merge keeps H2O's slots (its scorer reads keys and queries only) at every step."""
    over = {"budget": 12, "recent": 2, "interval": 3, "window": 3}
    merged, h2o = EvictingCache(load_policy(name, **over), 1), EvictingCache(load_policy("h2o", **over), 1)
    g = torch.Generator().manual_seed(4)
    for t in [prompt] + [1] * 30:
        k, v, q = (torch.randn(batch, hkv, t, D, generator=g), torch.randn(batch, hkv, t, D, generator=g),
                   torch.randn(batch, 2 * hkv, t, D, generator=g))
        merged.step(0, k, v, q)
        h2o.step(0, k, v, q)
        assert torch.equal(merged.layers[0].positions, h2o.layers[0].positions)
        assert torch.equal(merged.layers[0].keys, h2o.layers[0].keys)
    assert merged.layers[0].stats.evictions >= 5
