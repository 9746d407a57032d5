"""The built-in ``cake`` policy: the ``cake`` allocation (layer budgets from each layer's prompt
attention, decided once every layer holds the prompt) and the ``cake_attention`` scorer, against
float64 loop references written from CAKE's code (antgroup/cakekv), in a cache (through
``generate()``: test_methods_generate.py)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import make_tensors

import kvpolicy
from kvpolicy import EvictingCache, PolicyError
from kvpolicy.policy import eviction_input
from kvpolicy.stages import CakeAllocation, CakeScorer
from kvpolicy.stages.cake import adjust_budgets


def _probs(K, Q, qpos, slot_pos, b, h, g, w, G):
    """One window query's softmax over the slots it sees (position at most its own), float64."""
    D = K.shape[-1]
    logits = [float(Q[b, h * G + g, w] @ K[b, h, j]) / math.sqrt(D) if slot_pos[j] <= qpos[b, w] else -math.inf
              for j in range(K.shape[2])]
    m = max(logits)
    e = [math.exp(x - m) if x != -math.inf else 0.0 for x in logits]
    return [x / sum(e) for x in e]


def ref_preference(K, Q, qpos, *, tau1=1.0, tau2=1.0, log=False):
    """CAKE's preference: entropy summed over rows, heads, window queries and the slots before the
    window; the unbiased variance over the window's queries, summed over rows, heads and those slots."""
    K, Q = K.double(), Q.double()
    B, Hkv, N, _ = K.shape
    G, W = Q.shape[1] // Hkv, Q.shape[2]
    H = V = 0.0
    for b in range(B):
        first = int(qpos[b].min())
        for h in range(Hkv):
            for g in range(G):
                rows = [_probs(K, Q, qpos, list(range(N)), b, h, g, w, G) for w in range(W)]
                for j in range(first):
                    col = [r[j] for r in rows]
                    H += -sum(a * math.log(a + 1e-10) for a in col)
                    mean = sum(col) / W
                    V += sum((a - mean) ** 2 for a in col) / (W - 1)
    return math.log(H) / tau1 + math.log(V) / tau2 if log else H ** (1 / tau1) * V ** (1 / tau2)


def ref_adjust(shares, total, cap):
    """The authors' adjust_budgets, step by step (numpy's order: excess, then the total)."""
    shares = list(shares)
    excess = sum(max(s - cap, 0) for s in shares)
    shares = [min(s, cap) for s in shares]

    def spread(amount, idx):
        per, rem = divmod(abs(amount), len(idx))
        for k, i in enumerate(idx):
            shares[i] += (1 if amount > 0 else -1) * (per + (k < rem))

    if excess > 0 and any(s < cap for s in shares):
        spread(excess, [i for i, s in enumerate(shares) if s < cap])
    diff = total - sum(shares)
    idx = [i for i, s in enumerate(shares) if (s < cap if diff > 0 else s > 1)]
    if diff and idx:
        spread(diff, idx)
    return shares


def test_defaults_follow_the_authors():
    policy = kvpolicy.load_policy("cake")
    s = policy.schedule
    assert (s.budget, s.recent, s.window, s.count, s.compress_prompt) == (1024, 32, 32, "tokens", True)
    assert (policy.allocation.type_name, policy.allocation.tau1, policy.allocation.tau2) == ("cake", 1.0, 1.0)
    assert (policy.config.scorer.gamma, policy.config.scorer.kernel) == (200.0, 5)


@pytest.mark.parametrize("shares, total, cap", [
    ([10, 0, 50], 60, 40), ([7, 7, 7, 7], 30, 100), ([30, 30, 1], 50, 20), ([5, 5, 5], 15, 5),
])
def test_adjust_budgets_is_the_authors(shares, total, cap):
    assert adjust_budgets(list(shares), total, cap) == ref_adjust(shares, total, cap)


@pytest.mark.parametrize("shape", [(2, 2, 4, 30, 5), (1, 1, 3, 23, 4)], ids=lambda s: "x".join(map(str, s)))
def test_preference_matches_reference(shape):
    b, hkv, hq, n, w = shape
    k, v, q = make_tensors(b=b, hkv=hkv, hq=hq, n=n, d=8, w=w, seed=n)
    q = 3 * q  # peakier attention
    inp = eviction_input(k, v, q, budget=12, recent=w, seed=0)
    for tau1, tau2 in ((1.0, 1.0), (1.6, 0.4)):
        got = CakeAllocation(tau1=tau1, tau2=tau2).preference(inp)
        want = ref_preference(k, q, inp.query_positions, tau1=tau1, tau2=tau2)
        assert math.isclose(got, want, rel_tol=1e-5), (got, want)


def test_token_score_matches_reference():
    b, hkv, hq, n, w = 2, 2, 4, 26, 4
    k, v, q = make_tensors(b=b, hkv=hkv, hq=hq, n=n, d=8, w=w, seed=3)
    inp = eviction_input(k, v, 3 * q, budget=12, recent=w, seed=0)
    got = CakeScorer(gamma=200.0, kernel=5).score(inp).double()
    G, c = hq // hkv, n - w
    for bi in range(b):
        for h in range(hkv):
            heads = []
            for g in range(G):
                rows = [_probs(k.double(), 3 * q.double(), inp.query_positions, list(range(n)), bi, h, g, x, G)
                        for x in range(w)]
                mean = [sum(r[j] for r in rows) / w for j in range(c)]
                var = [sum((r[j] - mean[j]) ** 2 for r in rows) / (w - 1) for j in range(c)]
                raw = [m + 200.0 * s for m, s in zip(mean, var, strict=True)]
                heads.append([sum(raw[max(0, j - 2): j + 3]) / 5 for j in range(c)])  # avg-pool 5, zero padding
            want = torch.tensor([sum(hd[j] for hd in heads) / G for j in range(c)], dtype=torch.float64)
            torch.testing.assert_close(got[bi, h, :c], want, rtol=1e-5, atol=1e-7)


def test_a_cache_decides_each_layers_budget_once_from_the_prompt():
    """After the prompt step, before the first eviction: every layer's budget is the reference's
    share of its preference (adjusted as the authors do), adding up to the uniform total; every
    layer is then cut to its own budget; a reset cache decides anew for a new prompt."""
    layers, budget, recent = 3, 20, 4
    policy = kvpolicy.load_policy("cake", budget=budget, recent=recent, window=recent, interval=4)
    cache = EvictingCache(policy, layers)
    for trial in range(2):
        g = torch.Generator().manual_seed(trial)
        prompt = [(torch.randn(1, 2, 40, 8, generator=g), torch.randn(1, 2, 40, 8, generator=g),
                   (1 + 2 * trial) * torch.randn(1, 4, 40, 8, generator=g)) for _ in range(layers)]
        for layer, (k, v, q) in enumerate(prompt):
            assert [s.budget for s in cache.schedules] == [budget] * layers  # provisional until every layer holds it
            cache.step(layer, k, v, q)
        prefs = [ref_preference(k, q[:, :, -recent:], torch.arange(40 - recent, 40)[None]) for k, _, q in prompt]
        shares = [int(p / sum(prefs) * (budget - recent) * layers) for p in prefs]
        want = [recent + s for s in ref_adjust(shares, (budget - recent) * layers, 40 - recent)]
        got = [s.budget for s in cache.schedules]
        assert got == want and sum(got) == budget * layers
        for _ in range(3):
            for layer in range(layers):
                cache.step(layer, torch.randn(1, 2, 1, 8, generator=g), torch.randn(1, 2, 1, 8, generator=g),
                           torch.randn(1, 4, 1, 8, generator=g))
        assert [cache.layers[i].counts[0] for i in range(layers)] == [b + 3 for b in got]
        cache.reset()


def test_a_small_tau_whose_preference_overflows_still_shares_the_total():
    """tau1 = 0.001 raises a dispersion above 2 to a power past 1000: P overflowed to inf, inf / inf
    is nan, and the first step stopped on a bare ValueError ('cannot convert float NaN to integer').
    The shares are now the same proportions taken from log P, and add up to the uniform total."""
    layers, budget, recent = 3, 20, 4
    doc = {**kvpolicy.load_policy("cake", budget=budget, recent=recent, window=recent, interval=4).config.to_dict(),
           "allocation": {"type": "cake", "tau1": 0.001, "tau2": 1.0}}
    cache = EvictingCache(kvpolicy.load_policy(doc), layers)
    g = torch.Generator().manual_seed(0)
    prompt = [(torch.randn(1, 2, 40, 8, generator=g), torch.randn(1, 2, 40, 8, generator=g),
               (1 + layer) * torch.randn(1, 4, 40, 8, generator=g)) for layer in range(layers)]
    for layer, (k, v, q) in enumerate(prompt):
        cache.step(layer, k, v, q)
    logs = [ref_preference(k, q[:, :, -recent:], torch.arange(40 - recent, 40)[None], tau1=0.001, log=True)
            for k, _, q in prompt]
    assert max(logs) > 709  # P itself is past float64's range
    prefs = [math.exp(x - max(logs)) for x in logs]
    shares = [int(p / sum(prefs) * (budget - recent) * layers) for p in prefs]
    want = [recent + s for s in ref_adjust(shares, (budget - recent) * layers, 40 - recent)]
    assert [s.budget for s in cache.schedules] == want and sum(want) == budget * layers


def test_budgets_decided_from_the_prompt_pass_the_stages_checks():
    """A layer budget CAKE decides at the prompt gets the checks the policy's budget got at load:
    a chunk larger than a layer's room is a PolicyError naming the layer there, not a ValueError
    from the selector at an eviction."""
    doc = {**kvpolicy.load_policy("cake", budget=20, recent=4, window=4, interval=4).config.to_dict(),
           "selector": {"type": "chunks", "chunk_size": 16}}  # fits the policy's 20 - 4 slots, not a smaller layer's
    cache = EvictingCache(kvpolicy.load_policy(doc), 2)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(PolicyError, match=r"allocation: layer 0 gets a budget of 12 slots: selector\.chunk_size"):
        for layer in range(2):
            cache.step(layer, torch.randn(1, 2, 40, 8, generator=g), torch.randn(1, 2, 40, 8, generator=g),
                       (1 + 4 * layer) * torch.randn(1, 4, 40, 8, generator=g))
        cache.evict_due()


@pytest.mark.parametrize("batch", [1, 2])
def test_a_batch_of_rows_deciding_budgets_together_is_said_out_loud(batch):
    """CAKE's budgets are the batch's (its reference sums the preference over the rows), so a row
    of a batch keeps other slots than alone, against the caches' "a row decodes as it would
    alone": a batch of more than one row is warned about when the budgets are decided; one row is not."""
    import warnings

    policy = kvpolicy.load_policy("cake", budget=20, recent=4, window=4, interval=4)
    cache = EvictingCache(policy, 2)
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for layer in range(2):
            cache.step(layer, torch.randn(batch, 2, 40, 8, generator=g), torch.randn(batch, 2, 40, 8, generator=g),
                       torch.randn(batch, 4, 40, 8, generator=g))
        cache.evict_due()
    said = [w for w in caught if issubclass(w.category, kvpolicy.PolicyWarning)]
    assert len(said) == (batch > 1)
    if said:
        assert "from the 2 rows of the batch together" in str(said[0].message)


@pytest.mark.parametrize("kernel", [2, 4])
def test_an_even_kernel_is_refused_at_load(kernel):
    """As the attention scorer's: an even kernel cannot pool aligned, refused naming the field
    before any work (it failed at the first eviction with a bare ValueError)."""
    doc = {"name": "x", "schedule": {"budget": 8, "recent": 2, "interval": 4, "window": 2},
           "scorer": {"type": "cake_attention", "kernel": kernel}, "selector": {"type": "greedy"}}
    with pytest.raises(PolicyError, match=rf"scorer\.kernel: kernel must be odd .* got {kernel}"):
        kvpolicy.load_policy(doc)


def test_select_mode_is_refused():
    with pytest.raises(PolicyError, match="evict mode only"):
        EvictingCache(kvpolicy.load_policy("cake@select", compress_prompt=False), 2)
