"""``cam``'s rules (issue 43): ``mass: attention`` (the default; each kept value the
attention-mass-weighted mean of its own and what it absorbed, windows outside the recent buffer,
the absorbed mass capped) and ``mass: bounded`` (the token-count-weighted mean), each against a
hand-computed case and its float64 loop reference (``tests/reference.py``,
``cam_attention_merge`` and ``cam_bounded_merge``), their values staying within the hull of what
they absorbed over many evictions (where ``mass: faithful``, CaM's rule, leaves it), padded rows
merging as alone and seeded draws (hypothesis), the warning the faithful rule gives under
decode-time eviction, and the accumulated attention read from the scorer's state (one state for
``h2o``'s scorer and the merge)."""

from __future__ import annotations

import warnings

import pytest
import reference as ref
import torch
from helpers import assert_padded_row_merges_alone
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy import EvictingCache, PolicyError, PolicyWarning, load_policy
from kvpolicy.stages import CamMerge, EvictionInput

HKV, HQ, D = 2, 4, 3


def _input(values: torch.Tensor, state, num_candidates: int | None = None) -> EvictionInput:
    b, h, n, d = values.shape
    return EvictionInput(
        torch.randn(b, h, n, d), values, torch.zeros(b, h, 1, d), budget=n,
        num_candidates=n if num_candidates is None else num_candidates,
        slot_valid=torch.ones(b, h, n, dtype=torch.bool), query_valid=torch.ones(b, 1, dtype=torch.bool),
        positions=torch.arange(n).expand(b, h, n), state=state,
    )


@pytest.mark.parametrize("token_3_merges", [True, False])
def test_bounded_merge_by_hand(token_3_merges):
    """Six tokens, slots 0, 2, 4, 5 kept, windows of 2; slot 5 stands for 2 tokens already, and
    evicted slot 3 for 3 (which does not count: a token goes out with weight 1). Token 1 gives
    slots 2 and 4 the weight 1/2 each, token 3 slots 4 and 5 (or, with no attention, p = 0: nothing)."""
    values = torch.tensor([[1.0, 0.0], [2.0, 4.0], [0.0, 2.0], [6.0, -2.0], [-4.0, 8.0], [1.0, 1.0]])[None, None]
    mass = torch.tensor([1.0, 1.0, 1.0, 3.0, 1.0, 2.0])[None, None]
    attention = torch.ones(1, 1, 6)
    if not token_3_merges:
        attention[..., 3] = 0.0
    stage = CamMerge(merge_budget=2, mass="bounded")
    state = {stage.attention.state_key: {"attention": attention}, stage.state_key: {"mass": mass}}
    keep = torch.tensor([True, False, True, False, True, True])[None, None]
    out = stage.merge(_input(values, state), keep)
    if token_3_merges:
        # slot 2: ([0, 2] + 0.5 [2, 4]) / 1.5; slot 4: ([-4, 8] + 0.5 [2, 4] + 0.5 [6, -2]) / 2;
        # slot 5: (2 [1, 1] + 0.5 [6, -2]) / 2.5
        want = [[1.0, 0.0], [2 / 3, 8 / 3], [0.0, 4.5], [2.0, 0.4]]
        want_mass = [1.0, 1.5, 2.0, 2.5]
    else:
        want = [[1.0, 0.0], [2 / 3, 8 / 3], [-2.0, 20 / 3], [1.0, 1.0]]  # slot 4: ([-4, 8] + 0.5 [2, 4]) / 1.5
        want_mass = [1.0, 1.5, 1.5, 2.0]
    torch.testing.assert_close(out.values[keep], torch.tensor(want), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.state["mass"][keep], torch.tensor(want_mass))
    assert float(stage.merge_probability(_input(values, state), keep)[0, 0, 3]) == (1.0 if token_3_merges else 0.0)


def test_bounded_merge_matches_its_reference():
    g = torch.Generator().manual_seed(7)
    b, n, budget = 2, 26, 4
    values = torch.randn(b, HKV, n, D, generator=g)
    positions = torch.stack([torch.stack([torch.randperm(n, generator=g) for _ in range(HKV)]) for _ in range(b)])
    valid = torch.ones(b, HKV, n, dtype=torch.bool)
    valid[1, :, positions[1, 0] < 3] = False  # three padding slots in row 1 (head 0's, in both heads)
    positions = torch.where(valid, positions, -1)
    keep = (torch.rand(b, HKV, n, generator=g) < 0.4) & valid
    attention = torch.rand(b, HKV, n, generator=g) * 2
    mass = 1.0 + 3.0 * torch.rand(b, HKV, n, generator=g)
    u = torch.rand(b, HKV, n, generator=g, dtype=torch.float64)
    stage = CamMerge(merge_budget=budget, mass="bounded")
    inp = EvictionInput(
        torch.randn(b, HKV, n, D), values, torch.zeros(b, HQ, 1, D), budget=n, num_candidates=n, slot_valid=valid,
        query_valid=torch.ones(b, 1, dtype=torch.bool), positions=positions,
        state={stage.attention.state_key: {"attention": attention}, stage.state_key: {"mass": mass}},
    )
    want, want_mass = ref.cam_bounded_merge(values, keep, valid, positions, attention, mass, u, merge_budget=budget)
    _, p = ref.cam_merge(values, keep, valid, positions, attention, u, merge_budget=budget)
    got, got_mass = stage.merge_bounded(inp, keep, u < p)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_mass.double(), want_mass, rtol=1e-5, atol=1e-6)
    assert not torch.equal(want, values.double()) and float((want_mass - mass).abs().max()) > 0.2


@pytest.mark.parametrize("capped", [False, True])
def test_attention_merge_by_hand(capped):
    """Eight tokens by position, slots 6 and 7 the recent buffer (num_candidates 6); kept: 0, 2, 3,
    6, 7; windows of 2 kept slots outside the recent buffer. Token 1 (A 1) has the window {2, 3}
    (mean A 2, p 1/2: its draw 0.25 merges) and gives each A_1 / 2 = 0.5; token 4 (A 3) has no
    kept candidate after it (6 and 7 are recent): no window, p 0; token 5 likewise. Slot 3 has
    absorbed 0.2 already. With max_absorbed 1 nothing binds; with 0.1 slot 2 (A 2) takes 0.2 of
    the 0.5 it receives (its room, 0.1 * 2 - 0) and slot 3 nothing (0.1 * 2 - 0.2 = 0)."""
    values = torch.tensor([[1.0, 0.0], [4.0, -2.0], [0.0, 2.0], [2.0, 2.0], [9.0, 9.0], [7.0, 7.0],
                           [1.0, 1.0], [3.0, 3.0]])[None, None]
    attention = torch.tensor([5.0, 1.0, 2.0, 2.0, 3.0, 0.5, 0.2, 0.1])[None, None]
    absorbed = torch.tensor([0.0, 0.0, 0.0, 0.2, 0.0, 0.0, 0.0, 0.0])[None, None]
    stage = CamMerge(merge_budget=2, max_absorbed=0.1 if capped else 1.0)
    state = {stage.attention.state_key: {"attention": attention}, stage.state_key: {"absorbed": absorbed}}
    keep = torch.tensor([True, False, True, True, False, False, True, True])[None, None]
    inp = _input(values, state, num_candidates=6)
    p = stage.merge_probability(inp, keep)[0, 0]
    assert p.tolist() == [0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    draws = torch.tensor([0.9, 0.25, 0.9, 0.9, 0.0, 0.0, 0.9, 0.9])[None, None] < p
    got, got_absorbed = stage.merge_attention(inp, keep, draws)
    if capped:
        # slot 2: room 0.1 * 2 - 0 = 0.2 of 0.5: (2 [0, 2] + 0.2 [4, -2]) / 2.2
        # slot 3: room 0.1 * 2 - 0.2 = 0: unchanged, absorbed stays 0.2
        want = {2: [0.8 / 2.2, 3.6 / 2.2], 3: [2.0, 2.0]}
        want_absorbed = {2: 0.2, 3: 0.2}
    else:
        # slot 2: (2 [0, 2] + 0.5 [4, -2]) / 2.5; slot 3: (2.2 [2, 2] + 0.5 [4, -2]) / 2.7
        want = {2: [0.8, 1.2], 3: [6.4 / 2.7, 3.4 / 2.7]}
        want_absorbed = {2: 0.5, 3: 0.7}
    for t, v in want.items():
        torch.testing.assert_close(got[0, 0, t], torch.tensor(v), rtol=1e-6, atol=1e-6)
        assert float(got_absorbed[0, 0, t]) == pytest.approx(want_absorbed[t])
    untouched = [0, 1, 4, 5, 6, 7]  # the recent buffer (6, 7) never receives; 0 is before every evicted token
    assert torch.equal(got[0, 0, untouched], values[0, 0, untouched])
    assert torch.equal(got_absorbed[0, 0, untouched], absorbed[0, 0, untouched])


def _attention_case(seed: int, b: int = 2, n: int = 26, recent: int = 5, max_absorbed: float = 0.3,
                    merge_budget: int = 4):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(b, HKV, n, D, generator=g)
    positions = torch.stack([torch.stack([torch.randperm(n, generator=g) for _ in range(HKV)]) for _ in range(b)])
    valid = torch.ones(b, HKV, n, dtype=torch.bool)
    if b > 1:
        valid[1, :, positions[1, 0] < 3] = False  # three padding slots in row 1 (head 0's, in both heads)
    positions = torch.where(valid, positions, -1)
    keep = ((torch.rand(b, HKV, n, generator=g) < 0.4) | (torch.arange(n) >= n - recent)) & valid
    attention = torch.rand(b, HKV, n, generator=g) * 2
    absorbed = torch.rand(b, HKV, n, generator=g) * attention * max_absorbed  # within the cap, some near it
    u = torch.rand(b, HKV, n, generator=g, dtype=torch.float64)
    stage = CamMerge(merge_budget=merge_budget, max_absorbed=max_absorbed)
    inp = EvictionInput(
        torch.randn(b, HKV, n, D), values, torch.zeros(b, HQ, 1, D), budget=n, num_candidates=n - recent,
        slot_valid=valid, query_valid=torch.ones(b, 1, dtype=torch.bool), positions=positions,
        state={stage.attention.state_key: {"attention": attention}, stage.state_key: {"absorbed": absorbed}},
    )
    return stage, inp, keep, u


@pytest.mark.parametrize("max_absorbed", [0.05, 0.3, 1e6])
def test_attention_merge_matches_its_reference(max_absorbed):
    stage, inp, keep, u = _attention_case(7, max_absorbed=max_absorbed)
    attention = inp.state_of(stage.attention)["attention"]
    absorbed = inp.state_of(stage)["absorbed"]
    valid, n = inp.slot_valid, inp.num_slots
    want, want_absorbed = ref.cam_attention_merge(
        inp.values, keep, valid, inp.positions, attention, absorbed, u, merge_budget=4,
        num_candidates=inp.num_candidates, max_absorbed=max_absorbed)
    p = stage.merge_probability(inp, keep)
    got, got_absorbed = stage.merge_attention(inp, keep, u < p.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_absorbed.double(), want_absorbed, rtol=1e-5, atol=1e-6)
    assert not torch.equal(want, inp.values.double()), "the case merges"
    recent = torch.arange(n) >= inp.num_candidates
    assert torch.equal(got[..., recent, :], inp.values[..., recent, :]), "the recent buffer never receives"
    assert torch.equal(stage.merge(inp, keep).values, stage.merge_attention(inp, keep, inp.head_uniform(n, stream="cam") < p)[0])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), max_absorbed=st.sampled_from([0.01, 0.1, 0.5, 3.0]),
       recent=st.integers(0, 8), merge_budget=st.integers(1, 8))
def test_one_attention_merge_is_a_capped_convex_combination(seed, max_absorbed, recent, merge_budget):
    """One merge from any state within the cap: every value lies in the box of its own value and
    those of the tokens evicted before it, the slots' absorbed mass stays within ``max_absorbed *
    A``, and a value moves at most ``max_absorbed / (1 + max_absorbed)`` of the way to the farthest
    evicted value (its own weighs ``A_t + M_t``, what it takes at most ``max_absorbed A_t - M_t``)."""
    stage, inp, keep, _ = _attention_case(seed, n=24, recent=recent, max_absorbed=max_absorbed,
                                          merge_budget=merge_budget)
    out = stage.merge(inp, keep)
    a = inp.state_of(stage.attention)["attention"]
    absorbed = out.state["absorbed"]
    assert bool((absorbed <= max_absorbed * a * (1 + 1e-5) + 1e-6).all()), "the cap holds"
    assert bool((absorbed >= inp.state_of(stage)["absorbed"]).all()), "absorbed mass never falls"
    v, got = inp.values.double(), out.values.double()
    for b in range(v.shape[0]):
        for h in range(HKV):
            valid = inp.slot_valid[b, h]
            for t in (keep[b, h] & valid).nonzero().flatten().tolist():
                pos = int(inp.positions[b, h, t])
                before = valid & ~keep[b, h] & (inp.positions[b, h] < pos)
                pool = torch.cat([v[b, h, t][None], v[b, h][before]])
                lo, hi = pool.amin(0), pool.amax(0)
                assert bool((got[b, h, t] >= lo - 1e-5).all() and (got[b, h, t] <= hi + 1e-5).all())
                far = float((pool - v[b, h, t]).norm(dim=-1).max())
                moved = float((got[b, h, t] - v[b, h, t]).norm())
                assert moved <= max_absorbed / (1 + max_absorbed) * far + 1e-5


# -- over many evictions, through the cache ---------------------------------------------------------
def _cam(mass: str = "attention", merge_budget: int = 3, **schedule):
    data = load_policy("cam", **{"budget": 12, "recent": 3, "window": 4, "interval": 4, **schedule}).config.to_dict()
    data["merge"] = {**data["merge"], "merge_budget": merge_budget, "mass": mass}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PolicyWarning)  # the faithful rule's (tested below)
        return load_policy(data)


def _stream(policy, seed: int, steps: int):
    """A cache fed ``steps`` random tokens one at a time, and every value fed, by head and position."""
    g = torch.Generator().manual_seed(seed)
    cache = EvictingCache(policy, num_layers=1)
    fed = torch.randn(1, HKV, steps, D, generator=g) * 2
    for t in range(steps):
        cache.step(0, torch.randn(1, HKV, 1, D, generator=g), fed[:, :, t : t + 1], torch.randn(1, HQ, 1, D, generator=g))
        yield cache, fed[0, :, : t + 1]


def _outside_hull(cache: EvictingCache, fed: torch.Tensor) -> float:
    """How far (0: not at all) a held value lies outside the box of the values fed at positions up
    to its own: each evicted token merges only into kept slots after it, so a convex combination
    of what a slot absorbed lies in that box."""
    view = cache.layers[0]
    worst = 0.0
    for h in range(HKV):
        for s in view.valid[0, h].nonzero().flatten().tolist():
            pos = int(view.positions[0, h, s])
            lo, hi = fed[h, : pos + 1].amin(0), fed[h, : pos + 1].amax(0)
            v = view.values[0, h, s]
            worst = max(worst, float((lo - v).clamp_min(0).max()), float((v - hi).clamp_min(0).max()))
    return worst


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), merge_budget=st.integers(1, 6), interval=st.sampled_from([1, 3, 4, 6]),
       mass=st.sampled_from(["attention", "bounded"]))
def test_bounded_values_stay_within_what_they_absorbed(seed, merge_budget, interval, mass):
    policy = _cam(mass, merge_budget=merge_budget, interval=interval, window=3)
    seen = 0
    for cache, fed in _stream(policy, seed, 70):
        assert _outside_hull(cache, fed) < 1e-5
        view = cache.layers[0]
        if mass == "bounded":
            m = view.state["cam.mass"][view.valid]
            assert bool((m >= 1.0).all()) and float(m.sum()) <= HKV * fed.shape[1] + 1e-3, "mass is tokens"
        else:
            m = view.state["cam.absorbed"][view.valid]
            a = view.state["accumulated_attention.attention"][view.valid]
            assert bool((m >= 0).all()) and bool((m <= 0.1 * a * (1 + 1e-5) + 1e-6).all()), "the cap holds"
        seen = int(view.stats.evictions)
    assert seen >= 8, "many evictions"
    assert float(m.max()) > (1.5 if mass == "bounded" else 0.0), "slots absorbed tokens"


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), pad=st.integers(1, 6), merge_budget=st.integers(1, 5))
def test_a_padded_row_merges_as_it_would_alone(seed, pad, merge_budget):
    """``mass: attention`` through the cache: a left-padded row of a batch holds, after every
    step, exactly the keys and merged values (and the absorbed mass) it holds alone."""
    alone = assert_padded_row_merges_alone(_cam(merge_budget=merge_budget), torch.Generator().manual_seed(seed), pad,
                                           hkv=HKV, hq=HQ, d=D, state_fields=("cam.absorbed",))
    assert alone.layers[0].stats.evictions >= 3


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), stream=st.integers(0, 2**31 - 1))
def test_a_seed_reproduces_its_merges(seed, stream):
    """The same policy seed and inputs give the same merged values and absorbed mass, bit for bit
    (the draws come from each row's seeded stream, not a global generator)."""
    data = _cam().config.to_dict()
    data["seed"] = seed
    policy = load_policy(data)

    def run():
        torch.manual_seed(seed ^ 12345)  # a global generator the merge must not read
        *_, (cache, _) = _stream(policy, stream % 1000, 40)
        return cache.layers[0].values.clone(), cache.layers[0].state["cam.absorbed"].clone()

    a, b = run(), run()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_the_faithful_rule_leaves_the_hull_over_many_evictions():
    """The same stream under CaM's own rule: values grow past anything fed (what issue 43 measured)."""
    worst = 0.0
    for cache, fed in _stream(_cam("faithful"), 3, 70):
        worst = max(worst, _outside_hull(cache, fed))
    assert worst > 1.0


# -- the warning ---------------------------------------------------------------------------------------
def test_the_faithful_rule_warns_at_load_saying_why():
    data = load_policy("cam", budget=256).config.to_dict()
    data["merge"]["mass"] = "faithful"
    with pytest.warns(PolicyWarning, match=r"mass: faithful.*every 64 slots.*grows with the number of evictions"):
        load_policy(data)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PolicyWarning)
        load_policy("cam", budget=256)  # the default, bounded: no warning
        load_policy(load_policy("cam").to_yaml())


# -- draws and state ----------------------------------------------------------------------------------
def test_seeded_draws_reproduce_and_the_seed_matters():
    def values(seed: int) -> torch.Tensor:
        # Under h2o's eviction p is 1 on nearly every draw here (issue 43): a random kept set
        # leaves draws to chance. The file's seed keys every row's stream.
        data = _cam().config.to_dict()
        data["selector"] = {"type": "stochastic"}
        data["seed"] = seed
        *_, (cache, _) = _stream(load_policy(data), 5, 60)
        return cache.layers[0].values.clone()

    a = values(0)
    assert torch.equal(a, values(0))
    assert not torch.equal(a, values(1)), "another seed draws other merges"


def test_the_merge_reads_the_scorers_accumulated_attention():
    """``cam`` keeps one accumulated attention, the scorer's (h2o's state), and its own mass: it
    keeps h2o's slots with h2o's state, whatever it merges."""
    cam, h2o = _cam(), load_policy("h2o", budget=12, recent=3, window=4, interval=4)
    assert set(cam.state_fields) == {"accumulated_attention.attention", "cam.absorbed"}
    assert cam.config.merge.attention == cam.config.scorer
    for (c, _), (h, _) in zip(_stream(cam, 8, 50), _stream(h2o, 8, 50), strict=True):
        assert torch.equal(c.layers[0].positions, h.layers[0].positions)
        assert torch.equal(c.layers[0].state["accumulated_attention.attention"],
                           h.layers[0].state["accumulated_attention.attention"])
    assert not torch.equal(c.layers[0].values, h.layers[0].values), "cam merged"
    # A merge whose scorer differs keeps its own accumulated attention beside the policy's scorer.
    data = load_policy("snapkv").config.to_dict()
    data["merge"] = {"type": "cam"}
    assert "accumulated_attention.attention" in load_policy(data).state_fields


def test_attention_must_be_accumulated_attention():
    data = load_policy("h2o").config.to_dict()
    data["merge"] = {"type": "cam", "attention": {"type": "key_norm"}}
    with pytest.raises(PolicyError, match="merge.attention.*must be an accumulated_attention scorer"):
        load_policy(data)
