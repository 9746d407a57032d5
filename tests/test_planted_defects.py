"""Planted defects: an eviction that updates a stage's state twice, or not at all, is caught in
either engine: vLLM's paged cache by the kept-slot parity harness, the transformers-free cache
by the float64 token-loop references. (The G-KV case is the defect vLLM's worker once had: it
updated the state, then ranked by a second update.)"""

from __future__ import annotations

from dataclasses import replace

import pytest
import test_gkv
import test_stateful
from test_vllm_parity import Request, decode_all, resolved, run_and_check

from kvpolicy import eviction
from kvpolicy.eviction import Kept

REAL_EVICT = eviction.evict


def evict_updating_twice(policy, inp, **kwargs) -> Kept:
    once, _ = policy.observe(inp)
    return REAL_EVICT(policy, replace(inp, state=once.state), **kwargs)


def evict_without_update(policy, inp, **kwargs) -> Kept:
    flat = {} if inp.state is None else {
        name: inp.state[key][field] for name, (key, field, _) in policy.state_fields.items()
    }
    if policy.allocation.per_head:
        keep, counts = policy.select_heads_from(inp)
        return Kept(None, keep, counts, flat)
    return Kept(policy.select_from(inp), None, None, flat)


DEFECTS = {"updated twice": evict_updating_twice, "not updated": evict_without_update}


@pytest.mark.parametrize("defect", DEFECTS)
@pytest.mark.parametrize("name", ["gkv", "h2o"])
def test_the_parity_harness_catches_a_state_update_defect_in_vllms_paged_cache(name, defect, monkeypatch):
    def plant() -> None:  # the references have run: only the paged cache evicts with the defect
        monkeypatch.setattr(eviction, "evict", DEFECTS[defect])

    with pytest.raises(AssertionError, match="differ|state|keys"):
        run_and_check([Request("a", resolved(name), 21, 70)], decode_all, after_references=plant)


@pytest.mark.parametrize("defect", DEFECTS)
def test_the_float64_references_catch_a_state_update_defect_in_the_cache(defect, monkeypatch):
    monkeypatch.setattr(eviction, "evict", DEFECTS[defect])
    with pytest.raises(AssertionError):
        test_gkv.test_gkv_cache_equals_float64_reference(2, 6, False, "slots")
    with pytest.raises(AssertionError):
        test_stateful.test_h2o_cache_equals_float64_reference(2, 6, False, 4, 4)


def test_without_a_defect_both_checks_pass():
    run_and_check([Request("a", resolved("gkv"), 21, 70)], decode_all)
    test_gkv.test_gkv_cache_equals_float64_reference(2, 6, False, "slots")
    test_stateful.test_h2o_cache_equals_float64_reference(2, 6, False, 4, 4)
