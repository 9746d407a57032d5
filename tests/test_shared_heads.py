"""``shared_heads``: one score per layer shared by every KV head (kvpress's ChunkKV), and the check
that stages combining the heads slot by slot (it, and ``current_attention`` with ``head_reduce:
layer``) only ever see heads that hold the same tokens."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import make_input, make_tensors, random_steps

from kvpolicy import EvictingCache, PolicyError, SelectionError, load_policy
from kvpolicy.policy import Policy
from kvpolicy.stages import AttentionScorer, SharedHeadsScorer


def _policy(scorer: dict, **extra) -> object:
    return load_policy({"name": "shared", "schedule": {"budget": 16, "recent": 4, "interval": 4, "window": 4},
                        "scorer": scorer, "selector": "greedy", **extra})


SHARED = {"type": "shared_heads", "scorer": {"type": "attention", "pooling": "none"}}


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_scores_are_the_heads_sum_or_mean_for_every_head(reduce):
    k, v, q = make_tensors(b=2, hkv=3, hq=6, n=20, w=4, seed=3)
    slot_valid = torch.ones(2, 3, 20, dtype=torch.bool)
    slot_valid[1, :, :5] = False  # left padding, the same in every head
    inp = make_input(k, v, q, recent=4, budget=12, slot_valid=slot_valid)
    inner = AttentionScorer(pooling="none").score(inp)
    got = SharedHeadsScorer(scorer=AttentionScorer(pooling="none"), reduce=reduce).score(inp)
    masked = torch.where(slot_valid, inner, 0.0)
    want = masked.sum(1) if reduce == "sum" else masked.mean(1)
    for h in range(3):
        torch.testing.assert_close(got[:, h], want)


def test_every_head_keeps_the_same_tokens_through_many_evictions():
    policy = _policy(SHARED, reservations=[{"type": "sinks", "n": 2}])
    assert policy.couples_heads
    cache = EvictingCache(policy, num_layers=1)
    for k, v, q, _ in random_steps(2, 3, 6, 8, prompt=20, n=40, seed=4):
        cache.attend(0, q, k, v)
        view = cache.layers[0]
        assert torch.equal(view.positions, view.positions[:, :1].expand_as(view.positions))
    assert cache.stats()[0].evictions >= 8


COMBINING = pytest.mark.parametrize("scorer", [SHARED, {"type": "current_attention", "head_reduce": "layer"}],
                                    ids=["shared_heads", "current_attention_layer"])
RANGE = {"type": "top_scores", "scorer": {"type": "value_magnitude", "metric": "range"}, "n": 4}


@COMBINING
@pytest.mark.parametrize(("extra", "apart"), [
    ({"selector": "stochastic"}, "selector 'stochastic'"),  # per-head draws
    ({"reservations": [RANGE]}, "reservations[0] 'top_scores'"),  # per-head scores
    ({"allocation": {"type": "duo", "path": "builtin:smollm2-135m-passkey.yaml", "streaming_fraction": 0.5, "sinks": 2}}, "allocation 'duo'"),  # per-head shares
    ({"combine": "value_magnitude"}, "scorer 'combination'"),  # a per-head term beside it
])
def test_a_policy_known_to_choose_per_head_is_refused_at_load(scorer, extra, apart):
    """The heads would hold different tokens after the first eviction and the second would stop:
    refused at load instead, naming the stage that combines the heads and the one that decides per head."""
    extra = dict(extra)
    if "combine" in extra:  # combination[shared, per-head]
        scorer = {"type": "combination", "terms": [{"weight": 1.0, "scorer": scorer},
                                                   {"weight": 1.0, "scorer": {"type": extra.pop("combine")}}]}
    with pytest.raises(PolicyError, match=rf"scorer '{scorer_name(scorer)}' combines the KV heads slot by slot.*"
                                          rf"{re.escape(apart)} decides per head"):
        _policy(scorer, **extra)


def scorer_name(scorer: dict) -> str:
    return scorer["terms"][0]["scorer"]["type"] if scorer["type"] == "combination" else scorer["type"]


@COMBINING
@pytest.mark.parametrize("extra", [
    {"reservations": [{"type": "sinks", "n": 2}]},
    {"reservations": [{**RANGE, "scorer": SHARED}]},  # a Range of shared scores
    {"selector": {"type": "chunks", "chunk_size": 4}},
    {"allocation": {"type": "adaptive"}},
    {"selector": "stochastic", "mode": "select"},  # select mode evicts nothing: every head holds every token
    {"combine": {"type": "normalized", "scorer": SHARED}},
])
def test_policies_that_keep_the_heads_alike_load(scorer, extra):
    extra = dict(extra)
    if "combine" in extra:
        scorer = {"type": "combination", "terms": [{"weight": 1.0, "scorer": scorer},
                                                   {"weight": 0.5, "scorer": extra.pop("combine")}]}
    _policy(scorer, **extra)


@COMBINING
def test_heads_that_hold_different_tokens_are_refused_at_the_eviction(scorer):
    """Past load's checks (a plugin's stage that chooses per head, here a Range reservation put in
    place of the loaded one), the heads keep different tokens at the first eviction; at the next,
    the stage that combines them slot by slot refuses with a SelectionError naming itself."""
    policy = _policy(scorer, reservations=[{"type": "sinks", "n": 2}])
    per_head = _policy({"type": "key_norm"}, reservations=[RANGE]).config.reservations
    config = policy.config.model_copy(update={"reservations": per_head})
    cache = EvictingCache(Policy(config), num_layers=1)
    name = scorer["type"]
    with pytest.raises(SelectionError, match=rf"scorer '{name}' combines the KV heads slot by slot.*differ"):
        for k, v, q, _ in random_steps(1, 2, 4, 8, prompt=20, n=12, seed=5):
            cache.attend(0, q, k, v)
    assert cache.stats()[0].evictions >= 1  # the first eviction ran: the heads were aligned then


def test_what_is_checked_is_the_tokens_held_not_the_configuration():
    """Ada-KV's per-head budgets over scores that are the same in every head give every head the
    same count and the same tokens: nothing to refuse, and the heads stay aligned."""
    policy = _policy(SHARED, allocation={"type": "adaptive"})
    cache = EvictingCache(policy, num_layers=1)
    for k, v, q, _ in random_steps(1, 2, 4, 8, prompt=20, n=12, seed=6):
        cache.attend(0, q, k, v)
        view = cache.layers[0]
        assert torch.equal(view.positions[:, 0], view.positions[:, 1])
    assert cache.stats()[0].evictions >= 2


def test_select_with_heads_of_different_tokens_is_refused():
    k, v, q = make_tensors(b=1, hkv=2, hq=4, n=20, w=4, seed=7)
    positions = torch.arange(20).expand(1, 2, 20).clone()
    positions[0, 1] += 3  # head 1 holds other tokens
    with pytest.raises(SelectionError, match="scorer 'shared_heads' combines the KV heads slot by slot"):
        _policy(SHARED).select(k, v, q, positions=positions)
    assert _policy(SHARED).select(k, v, q).shape == (1, 2, 16)  # aligned heads: fine
