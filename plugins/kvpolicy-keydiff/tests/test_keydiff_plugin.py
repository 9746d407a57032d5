"""Tests of the KeyDiff plugin: the scorer by hand, and discovery through its real entry point."""

from __future__ import annotations

import math
import warnings
from importlib.metadata import EntryPoint, entry_points

import pytest
import torch
from kvpolicy_keydiff import KeyDiffScorer, keydiff_scores

import kvpolicy
from kvpolicy.registry import AUTOLOAD_ENV, PluginLoadWarning, Registry, reset_registry
from kvpolicy.stages.base import EvictionInput


@pytest.fixture(autouse=True)
def fresh_registry():
    reset_registry()
    yield
    reset_registry()


def make_input(
    keys: torch.Tensor, num_candidates: int, slot_valid: torch.Tensor | None = None
) -> EvictionInput:
    b, h, n, d = keys.shape
    if slot_valid is None:
        slot_valid = torch.ones(b, n, dtype=torch.bool)
    slot_valid = slot_valid[:, None, :].expand(b, h, n)  # per head, as the executor passes it
    return EvictionInput(
        keys=keys,
        values=keys.clone(),
        queries=torch.zeros(b, h, 0, d),
        budget=n - 1,
        num_candidates=num_candidates,
        slot_valid=slot_valid,
        query_valid=torch.zeros(b, 0, dtype=torch.bool),
        positions=torch.where(slot_valid, slot_valid.long().cumsum(-1) - 1, -1),
    )


# -- the scorer, checked by hand ---------------------------------------------------------------
def test_scores_by_hand_normalized_mean():
    # Candidates [2,0], [1,0], [0,1]; unit keys [1,0], [1,0], [0,1]; anchor (2/3, 1/3) ~ (2, 1)/sqrt5.
    # The last slot is the recent buffer: it scores 0 and does not move the anchor.
    keys = torch.tensor([[2.0, 0.0], [1.0, 0.0], [0.0, 1.0], [-5.0, -5.0]]).view(1, 1, 4, 2)
    scores = KeyDiffScorer().score(make_input(keys, num_candidates=3))
    s5 = math.sqrt(5.0)
    assert scores.shape == (1, 1, 4)
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores[0, 0], torch.tensor([-2 / s5, -2 / s5, -1 / s5, 0.0]))


def test_scores_by_hand_raw_mean():
    # Raw mean of [2,0], [1,0], [0,1] is (1, 1/3) ~ (3, 1)/sqrt10.
    keys = torch.tensor([[2.0, 0.0], [1.0, 0.0], [0.0, 1.0], [-5.0, -5.0]]).view(1, 1, 4, 2)
    scores = KeyDiffScorer(anchor="mean").score(make_input(keys, num_candidates=3))
    s10 = math.sqrt(10.0)
    torch.testing.assert_close(scores[0, 0], torch.tensor([-3 / s10, -3 / s10, -1 / s10, 0.0]))


def test_padding_neither_scores_nor_moves_the_anchor():
    keys = torch.tensor([[100.0, 0.0], [0.0, 1.0], [0.0, 1.0], [1.0, 1.0], [3.0, 3.0]]).view(1, 1, 5, 2)
    valid = torch.tensor([[False, True, True, True, True]])
    scores = KeyDiffScorer().score(make_input(keys, num_candidates=4, slot_valid=valid))
    # Candidates [0,1], [0,1], [1,1]: unit mean (s/3, (2+s)/3) with s = 1/sqrt2.
    s = 1 / math.sqrt(2.0)
    center = torch.tensor([s, 2 + s])
    center = center / center.norm()
    expected = torch.tensor([0.0, -center[1], -center[1], -(center @ torch.tensor([s, s])), 0.0])
    torch.testing.assert_close(scores[0, 0], expected)


def test_vectorised_over_rows_and_heads_matches_a_loop():
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(3, 2, 12, 8, generator=gen)
    valid = torch.rand(3, 12, generator=gen) > 0.2
    inp = make_input(keys, num_candidates=9, slot_valid=valid)
    batched = KeyDiffScorer().score(inp)
    for b in range(3):
        for h in range(2):
            cand = inp.candidate_mask[b, h]
            unit = keys[b, h] / keys[b, h].norm(dim=-1, keepdim=True)
            center = unit[cand].mean(0)
            expected = torch.where(cand, -(unit @ center) / center.norm(), torch.zeros(12))
            torch.testing.assert_close(batched[b, h], expected, rtol=1e-5, atol=1e-6)


def test_row_without_candidates_scores_zero():
    keys = torch.randn(1, 2, 4, 3)
    out = keydiff_scores(keys, torch.zeros(1, 1, 4, dtype=torch.bool))
    assert torch.equal(out, torch.zeros(1, 2, 4))


def test_fields_are_validated():
    with pytest.raises(ValueError):
        KeyDiffScorer(anchor="median")
    with pytest.raises(ValueError):
        KeyDiffScorer(eps=0.0)


@pytest.mark.parametrize("eps", ["inf", "nan"])
def test_non_finite_eps_is_refused_by_name(eps):
    """Found from outside: ``eps: .inf`` loaded (load_policy promises finite floats only), and then
    every key's unit vector was 0, every score 0, and the policy kept the first candidates
    whatever the keys."""
    with pytest.raises(ValueError, match="eps"):
        KeyDiffScorer(eps=float(eps))
    text = f"name: k\nschedule: {{budget: 8, recent: 2, window: 0}}\nscorer: {{type: keydiff, eps: .{eps}}}\nselector: greedy\n"
    with pytest.raises(kvpolicy.PolicyError, match="scorer.eps"):
        kvpolicy.load_policy(text)


# -- in a policy -------------------------------------------------------------------------------
def test_policy_keeps_the_odd_key_out():
    # Six candidates along +x, one along +y: with one candidate slot to keep, +y survives.
    keys = torch.tensor([[1.0, 0.0]] * 3 + [[0.0, 1.0]] + [[1.0, 0.1]] * 3 + [[1.0, 1.0]] * 2).view(
        1, 1, 9, 2
    )
    policy = kvpolicy.load_policy(
        {
            "name": "keydiff-test",
            "schedule": {"budget": 3, "recent": 2, "interval": 1, "window": 0},
            "scorer": {"type": "keydiff"},
            "selector": {"type": "greedy"},
        }
    )
    kept = policy.select(keys, keys, torch.zeros(1, 1, 0, 2))
    assert kept.tolist() == [[[3, 7, 8]]]


def test_named_policy_loads_with_overrides():
    policy = kvpolicy.load_policy("keydiff", budget=256)
    assert policy.budget == 256
    assert policy.schedule.recent == 64
    cfg = policy.config
    assert cfg.scorer.type_name == "keydiff"
    assert [r.describe() for r in cfg.reservations] == [{"type": "sinks", "n": 4}]
    assert cfg.selector.type_name == "greedy"
    keys = torch.randn(2, 3, 300, 16)
    kept = policy.select(keys, keys, torch.randn(2, 6, 0, 16))
    assert kept.shape == (2, 3, 256)
    assert bool((kept[..., :4] == torch.arange(4)).all())  # sinks
    assert bool((kept[..., -64:] == torch.arange(236, 300)).all())  # recent buffer


# -- discovery through the installed entry point -----------------------------------------------
def installed_entry_point() -> EntryPoint:
    matches = [ep for ep in entry_points(group="kvpolicy") if ep.name == "keydiff"]
    assert matches, "kvpolicy-keydiff is not installed: pip install -e plugins/kvpolicy-keydiff"
    return matches[0]


def test_entry_point_is_installed():
    assert installed_entry_point().value == "kvpolicy_keydiff.plugin"


def test_the_plugin_declares_a_contract_kvpolicy_loads():
    """KeyDiff declares the contract this kvpolicy implements (4), which loads contract 2 and 3
    plugins too."""
    from kvpolicy_keydiff import plugin

    from kvpolicy.hookspecs import ACCEPTED_CONTRACTS

    assert plugin.kvpolicy_contract() == 4 == kvpolicy.PLUGIN_CONTRACT and {2, 3, 4} <= ACCEPTED_CONTRACTS


def test_registry_discovers_the_plugin():
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginLoadWarning)
        registry = Registry()
    scorer = registry.stages["scorer"]["keydiff"]
    assert scorer.plugin == "keydiff"
    assert scorer.obj is KeyDiffScorer
    assert registry.policies["keydiff"].plugin == "keydiff"
    assert "keydiff" in kvpolicy.available_policies()


def test_broken_entry_point_warns_and_others_still_load(monkeypatch):
    import kvpolicy.registry as registry_module

    broken = EntryPoint(name="broken-plugin", value="kvpolicy_no_such_module.plugin", group="kvpolicy")
    real = list(entry_points(group="kvpolicy"))
    monkeypatch.setattr(registry_module, "entry_points", lambda group: [broken, *real])
    with pytest.warns(PluginLoadWarning, match="broken-plugin"):
        registry = Registry()
    assert "keydiff" in registry.stages["scorer"]
    assert "vase-attnv" in registry.policies


def test_autoload_can_be_disabled(monkeypatch):
    monkeypatch.setenv(AUTOLOAD_ENV, "1")
    registry = Registry()
    assert "keydiff" not in registry.stages["scorer"]
    assert "keydiff" not in registry.policies
    assert "attention" in registry.stages["scorer"]


def test_schema_offers_the_plugin_scorer():
    from kvpolicy.schema import policy_json_schema

    schema = policy_json_schema()
    variant = schema["$defs"]["scorer.keydiff"]
    assert variant["properties"]["type"]["const"] == "keydiff"
    assert variant["x-kvpolicy-plugin"] == "keydiff"
    assert set(variant["properties"]["anchor"]["enum"]) == {"normalized_mean", "mean"}
