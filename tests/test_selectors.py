"""Selector and executor properties (hypothesis), seeded randomness and sampling frequencies."""

from __future__ import annotations

import reference as ref
import torch
from helpers import assert_valid_selection, make_input, make_tensors
from hypothesis import given
from hypothesis import strategies as st

import kvpolicy
from kvpolicy.stages import LeverageScorer, StochasticSelector


def build(budget, recent, sinks, n_large, selector, scorer=None, seed=0):
    reservations = []
    if sinks:
        reservations.append({"type": "sinks", "n": sinks})
    if n_large:
        reservations.append({"type": "top_scores", "n": n_large, "include_prior": True,
                             "scorer": {"type": "value_magnitude", "metric": "range"}})
    return kvpolicy.load_policy({
        "name": "prop",
        "seed": seed,
        "schedule": {"budget": budget, "recent": recent, "interval": 64, "window": 4},
        "scorer": scorer or {"type": "attention"},
        "reservations": reservations,
        "selector": {"type": selector},
    })


@st.composite
def cases(draw):
    budget = draw(st.integers(2, 24))
    recent = draw(st.integers(0, budget - 1))
    sinks = draw(st.integers(0, min(4, budget - recent)))
    n_large = draw(st.integers(0, budget - recent - sinks))
    n = draw(st.integers(max(1, budget - 3), budget + 24))
    b, hkv, g = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    selector = draw(st.sampled_from(["greedy", "stochastic"]))
    seed = draw(st.integers(0, 2**16))
    return budget, recent, sinks, n_large, n, b, hkv, g, selector, seed


def expected_protected(values, n, budget, recent, sinks, n_large):
    """[B, H, N] bool: recent buffer, sinks and the top-Range reservation, from the reference."""
    b_, h_ = values.shape[:2]
    prot = torch.zeros(b_, h_, n, dtype=torch.bool)
    if n <= budget:
        return prot
    c = n - recent
    rng = ref.value_magnitude(values, "range")
    for b in range(b_):
        for h in range(h_):
            p = set(range(c, n)) | set(range(min(sinks, c)))
            if n_large:
                p |= ref.top_reservation(rng[b, h], list(range(c)), p, n_large, True)
            prot[b, h, sorted(p)] = True
    return prot


@given(cases())
def test_selection_properties(case):
    budget, recent, sinks, n_large, n, b, hkv, g, selector, seed = case
    policy = build(budget, recent, sinks, n_large, selector)
    k, v, q = make_tensors(b=b, hkv=hkv, hq=hkv * g, n=n, d=4, w=3, seed=seed)
    kept = policy.select(k, v, q, seed=seed)
    assert kept.shape == (b, hkv, min(n, budget))
    assert_valid_selection(kept, n, min(n, budget), expected_protected(v, n, budget, recent, sinks, n_large))
    again = policy.select(k, v, q, seed=seed)
    assert torch.equal(kept, again)


@given(cases(), st.lists(st.integers(0, 6), min_size=2, max_size=2))
def test_padding_is_never_kept_over_a_valid_slot(case, pads):
    budget, recent, sinks, n_large, n, b, hkv, g, selector, seed = case
    policy = build(budget, recent, sinks, n_large, selector)
    k, v, q = make_tensors(b=b, hkv=hkv, hq=hkv * g, n=n, d=4, w=3, seed=seed)
    c = n - recent
    slot_valid = torch.stack([torch.arange(n) >= min(p, max(c, 0)) for p in pads[:b]])
    kept = policy.select(k, v, q, seed=seed, slot_valid=slot_valid)
    k_keep = min(n, budget)
    assert_valid_selection(kept, n, k_keep)
    for bb in range(b):
        valid_kept = slot_valid[bb][kept[bb]].sum(-1)  # per head
        assert bool((valid_kept == min(k_keep, int(slot_valid[bb].sum()))).all())


def test_different_seeds_differ_and_select_is_a_pure_function():
    policy = build(40, 8, 4, 10, "stochastic")
    k, v, q = make_tensors(b=2, hkv=2, hq=4, n=120, d=8, w=4, seed=1)
    a = policy.select(k, v, q, seed=1)
    b = policy.select(k, v, q, seed=2)
    assert not torch.equal(a, b)
    # the policy's seed: the same call gives the same slots; another eviction or layer other ones
    p1, p2 = build(40, 8, 4, 10, "stochastic", seed=3), build(40, 8, 4, 10, "stochastic", seed=3)
    first = p1.select(k, v, q)
    assert torch.equal(first, p2.select(k, v, q)) and torch.equal(first, p1.select(k, v, q))
    assert not torch.equal(first, p1.select(k, v, q, evictions=1))
    assert not torch.equal(first, p1.select(k, v, q, layer_idx=1))
    assert not torch.equal(first, p1.select(k, v, q, seed=4))


def test_each_row_draws_from_its_own_stream():
    """A row's draws depend on that row alone: the same row in another batch, at another index,
    keeps the same slots (what makes padded batches equal rows alone for stochastic policies)."""
    policy = build(40, 8, 4, 10, "stochastic")
    k, v, q = make_tensors(b=3, hkv=2, hq=4, n=120, d=8, w=4, seed=5)
    batch = policy.select(k, v, q, evictions=torch.tensor([0, 2, 5]))
    for row, ev in enumerate((0, 2, 5)):
        alone = policy.select(k[row:row + 1], v[row:row + 1], q[row:row + 1], evictions=ev)
        assert torch.equal(batch[row], alone[0])
    swapped = policy.select(k.flip(0), v.flip(0), q.flip(0), evictions=torch.tensor([5, 2, 0]))
    assert torch.equal(swapped.flip(0), batch)


def _stochastic_draws(weights: list[float], draws: int, k: int, seed: int = 0) -> torch.Tensor:
    """``[draws, k]`` slots picked by the stochastic selector's priority: one draw per batch row,
    each row at another eviction count (identical rows at one count draw identically)."""
    c = len(weights)
    scores = torch.tensor(weights).expand(draws, 1, c).contiguous()
    keys = torch.zeros(draws, 1, c, 1)
    inp = make_input(keys, keys, torch.zeros(draws, 1, 1, 1), recent=0, seed=seed, evictions=torch.arange(draws))
    prio = StochasticSelector().priority(scores, inp)
    return prio.topk(k, dim=-1).indices[:, 0]


def _inclusion_k2(p: torch.Tensor) -> torch.Tensor:
    """Exact P(i among 2 draws without replacement, proportional to p)."""
    p = p / p.sum()
    out = p.clone()
    for i in range(len(p)):
        out[i] += sum(p[j] * p[i] / (1 - p[j]) for j in range(len(p)) if j != i)
    return out


def test_stochastic_first_draw_is_proportional_to_score():
    w = [0.1, 0.2, 0.3, 0.4, 0.0]
    draws = 20000
    picks = _stochastic_draws(w, draws, 1)[:, 0]
    freq = torch.bincount(picks, minlength=5).double() / draws
    expected = torch.tensor(w, dtype=torch.float64)
    # chi-square with 3 dof (the zero-weight slot is never drawn): 99.9% quantile ~ 16.3
    chi2 = float((((freq - expected) ** 2) / expected.clamp_min(1e-12))[:4].sum() * draws)
    assert chi2 < 16.3, (freq, chi2)
    assert freq[4] == 0


def test_stochastic_without_replacement_matches_multinomial():
    w = [0.05, 0.15, 0.3, 0.5]
    draws = 20000
    picks = _stochastic_draws(w, draws, 2)
    assert bool((picks[:, 0] != picks[:, 1]).all())
    ours = torch.bincount(picks.flatten(), minlength=4).double() / draws
    g = torch.Generator().manual_seed(1)
    mult = torch.multinomial(torch.tensor(w).expand(draws, 4), 2, replacement=False, generator=g)
    theirs = torch.bincount(mult.flatten(), minlength=4).double() / draws
    exact = _inclusion_k2(torch.tensor(w, dtype=torch.float64))
    # binomial standard error of an inclusion frequency is <= 0.0036 here; allow ~4 sigma
    torch.testing.assert_close(ours, exact, atol=0.015, rtol=0)
    torch.testing.assert_close(theirs, exact, atol=0.015, rtol=0)
    torch.testing.assert_close(ours, theirs, atol=0.02, rtol=0)


def test_stochastic_zero_weights_only_after_positive_ones():
    picks = _stochastic_draws([0.0, 0.7, 0.0, 0.3, 0.0], 3000, 3)
    for row in picks.tolist():
        assert {1, 3} <= set(row)
    # the third pick is uniform over the zero-weight slots
    third = torch.tensor([next(j for j in row if j not in (1, 3)) for row in picks.tolist()])
    freq = torch.bincount(third, minlength=5).double() / 3000
    torch.testing.assert_close(freq[[0, 2, 4]], torch.full((3,), 1 / 3, dtype=torch.float64), atol=0.05, rtol=0)


def test_stochastic_low_temperature_tends_to_greedy():
    w = torch.tensor([1e-30, 0.2, 0.3, 0.5, 0.0])
    scores = w.expand(500, 1, 5).contiguous()
    keys = torch.zeros(500, 1, 5, 1)
    inp = make_input(keys, keys, torch.zeros(500, 1, 1, 1), recent=0, seed=0, evictions=torch.arange(500))
    prio = StochasticSelector(temperature=1e-3).priority(scores, inp)
    top = prio.topk(4, dim=-1).indices[:, 0]
    assert bool((top[:, 0] == 3).all()) and bool((top[:, 1] == 2).all())
    # a positive weight, however small, still ranks above a zero weight
    assert bool((top[:, 3] == 0).all())


def test_stochastic_policy_sampling_frequencies_end_to_end():
    # budget = recent + 1: exactly one slot is sampled among C=4 candidates, per row.
    policy = kvpolicy.load_policy({
        "name": "one", "schedule": {"budget": 3, "recent": 2, "interval": 4, "window": 1},
        "scorer": {"type": "attention", "pooling": "none"}, "selector": {"type": "stochastic"},
    })
    rows = 4000
    keys = torch.zeros(rows, 1, 6, 2)
    keys[:, 0, :4, 0] = torch.log(torch.tensor([1.0, 2.0, 3.0, 4.0]))  # softmax = [.1,.2,.3,.4]
    q = torch.zeros(rows, 1, 1, 2)
    q[..., 0] = 2**0.5  # cancels the 1/sqrt(D) scale
    kept = policy.select(keys, keys, q, seed=0, evictions=torch.arange(rows))
    assert bool((kept[..., 1:] == torch.tensor([4, 5])).all())
    freq = torch.bincount(kept[:, 0, 0], minlength=4).double() / rows
    torch.testing.assert_close(freq, torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64), atol=0.03, rtol=0)


def test_leverage_resample_policy_differs_between_calls_fixed_does_not():
    k, v, q = make_tensors(b=2, hkv=2, hq=2, n=100, d=16, seed=3)
    dkv = kvpolicy.load_policy("vase-dkv", budget=40, recent=8, window=8, interval=8)
    cur = kvpolicy.load_policy("curdkv", budget=40, recent=8, window=8, interval=8)
    assert not torch.equal(dkv.select(k, v, q), dkv.select(k, v, q, evictions=1))
    assert torch.equal(cur.select(k, v, q), cur.select(k, v, q, evictions=1))
    assert dkv.stochastic and not cur.stochastic
    # identical rows at different evictions get different projections under resample, and at the
    # same eviction the same ones (a row's draws depend on that row alone)
    k2, v2 = k[:1].expand(2, -1, -1, -1), v[:1].expand(2, -1, -1, -1)
    resample = LeverageScorer(projection="resample")
    scores = resample.score(make_input(k2, v2, q, recent=8, evictions=torch.tensor([0, 1])))
    assert not torch.allclose(scores[0], scores[1])
    scores = resample.score(make_input(k2, v2, q, recent=8, evictions=torch.tensor([1, 1])))
    torch.testing.assert_close(scores[0], scores[1])
    fixed = LeverageScorer(projection="fixed").score(make_input(k2, v2, q, recent=8))
    torch.testing.assert_close(fixed[0], fixed[1])
