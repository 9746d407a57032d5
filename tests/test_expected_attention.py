"""The built-in ``expected-attention`` policy and its ``expected_attention`` scorer against a float64
loop reference (``reference.expected_attention``: rotation matrices built entry by entry), and runs
in a cache (through ``generate()``: test_methods_generate.py)."""

from __future__ import annotations

import pytest
import reference as ref
import torch
from helpers import make_tensors, model_facts

import kvpolicy
from kvpolicy.policy import eviction_input
from kvpolicy.stages import ExpectedAttentionScorer
from kvpolicy.stages.model_facts import ModelFacts, apply_rope


def _rotated_queries(b, hq, w, d, positions, seed):
    """Post-RoPE queries of pre-RoPE ones with a shared mean (so the statistics mean something)."""
    g = torch.Generator().manual_seed(seed)
    pre = torch.randn(b, hq, w, d, generator=g) + 2 * torch.randn(1, hq, 1, d, generator=g)
    cos, sin = ModelFacts.standard_rope(d)(positions)
    return apply_rope(pre, cos[:, None], sin[:, None])


def test_defaults_follow_kvpress():
    policy = kvpolicy.load_policy("expected-attention")
    s = policy.schedule
    assert (s.budget, s.recent, s.interval, s.window, s.compress_prompt) == (1024, 64, 64, 64, True)
    sc = policy.config.scorer
    assert (sc.n_future_positions, sc.n_sink, sc.use_covariance, sc.use_vnorm, sc.epsilon, sc.softmax_over) == (
        512, 4, True, True, 0.0, "all")
    assert [(r.type_name, r.n) for r in policy.config.reservations] == [("sinks", 4)]
    assert policy.needs_model == {"rope"}


@pytest.mark.parametrize("options", [
    {},
    {"use_covariance": False},
    {"use_vnorm": False, "n_sink": 0},
    {"epsilon": 0.01, "softmax_over": "candidates", "n_future_positions": 3, "tile_elements": 50},
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "defaults")
@pytest.mark.parametrize("shape", [(2, 2, 4, 30, 6), (1, 1, 3, 21, 5)], ids=lambda s: "x".join(map(str, s)))
def test_scores_match_reference(shape, options):
    b, hkv, hq, n, w = shape
    d = 8
    k, v, _ = make_tensors(b=b, hkv=hkv, hq=hq, n=n, d=d, w=0, seed=n)
    qpos = torch.arange(n - w, n).expand(b, w)
    q = _rotated_queries(b, hq, w, d, qpos, seed=n)
    query_valid = torch.ones(b, w, dtype=torch.bool)
    query_valid[0, 0] = False  # an entry without a query weighs nothing
    scorer = ExpectedAttentionScorer(**{"n_future_positions": 16, **options})
    inp = eviction_input(k, v, q, budget=12, recent=4, seed=0, query_valid=query_valid,
                         model=model_facts(1, hkv, hq, d))
    got = scorer.score(inp).double()
    want = ref.expected_attention(
        k, v, q, inp.query_positions, query_valid, n_future=scorer.n_future_positions, n_sink=scorer.n_sink,
        use_covariance=scorer.use_covariance, use_vnorm=scorer.use_vnorm, epsilon=scorer.epsilon,
        candidates=n - 4 if scorer.softmax_over == "candidates" else None,
    )
    torch.testing.assert_close(got, want, rtol=2e-4, atol=1e-6)


def test_padded_rows_use_their_own_positions():
    """A left-padded row scores its real tokens as the same row alone: statistics, rotations and
    the softmax follow token positions, not slots."""
    d, n, pad = 8, 26, 5
    k, v, _ = make_tensors(b=1, hkv=2, hq=4, n=n, d=d, w=0, seed=3)
    q = _rotated_queries(1, 4, 4, d, torch.arange(n - 4, n)[None], seed=3)
    facts = model_facts(1, 2, 4, d)
    scorer = ExpectedAttentionScorer(n_future_positions=32)
    alone = scorer.score(eviction_input(k, v, q, budget=10, recent=4, seed=0, model=facts))
    kp = torch.cat([torch.randn(1, 2, pad, d), k], 2)
    vp = torch.cat([torch.randn(1, 2, pad, d), v], 2)
    slot_valid = torch.arange(n + pad)[None] >= pad
    padded = scorer.score(eviction_input(kp, vp, q, budget=10, recent=4, seed=0, slot_valid=slot_valid, model=facts))
    torch.testing.assert_close(padded[..., pad:], alone, rtol=1e-5, atol=1e-7)
    assert bool((padded[..., :pad] == 0).all())


def test_the_policy_keeps_the_reference_slots():
    d, n, budget = 8, 60, 24
    k, v, _ = make_tensors(b=2, hkv=2, hq=4, n=n, d=d, w=0, seed=11)
    q = _rotated_queries(2, 4, 8, d, torch.arange(n - 8, n).expand(2, 8), seed=11)
    policy = kvpolicy.load_policy("expected-attention", budget=budget, recent=8, window=8, interval=8)
    kept = policy.select(k, v, q, model=model_facts(1, 2, 4, d))
    scores = ref.expected_attention(k, v, q, torch.arange(n - 8, n).expand(2, 8), n_future=512, n_sink=4)
    want = ref.select(scores, budget=budget, recent=8, sinks=4)
    assert [[set(h.tolist()) for h in row] for row in kept] == [[set(h) for h in row] for row in want]
