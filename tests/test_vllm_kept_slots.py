"""``kvpolicy.vllm.requests.KeptSlots``: the one place a request's per-slot fields live in vLLM
(positions and a policy's per-slot state), moved together (pure torch, no vLLM)."""

from __future__ import annotations

import torch

from kvpolicy.stages import StateField
from kvpolicy.vllm.requests import KeptSlots

FIELDS = {"stage_a.attention": StateField(torch.float32, 0.0), "stage_a.heads": StateField(torch.float32, 0.0, per="head"),
          "stage_b.last": StateField(torch.int64, -1)}


def test_fresh_slots_hold_positions_and_initial_state():
    fresh = KeptSlots.fresh(3, 7, 10, layers=2, heads=2, device=torch.device("cpu"), fields=FIELDS)
    assert fresh.count == 4 and fresh.positions[1, 1].tolist() == [13, 14, 15, 16]
    assert set(fresh.state) == {"stage_a.attention", "stage_b.last"}  # per-head fields live per request
    assert bool((fresh.state["stage_b.last"] == -1).all()) and fresh.state["stage_b.last"].dtype == torch.int64


def test_state_moves_with_the_slots_it_belongs_to():
    kept = KeptSlots.fresh(0, 3, 0, layers=1, heads=2, device=torch.device("cpu"), fields=FIELDS)
    kept = kept.with_state({"stage_a.attention": torch.tensor([[[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]])})
    slots = KeptSlots.extend(kept, KeptSlots.fresh(3, 5, 0, layers=1, heads=2, device=torch.device("cpu"), fields=FIELDS))
    assert slots.positions[0, 0].tolist() == [0, 1, 2, 3, 4]
    assert slots.state["stage_a.attention"][0, 1].tolist() == [4.0, 5.0, 6.0, 0.0, 0.0]
    taken = slots.take(torch.tensor([[[0, 2, 4], [1, 3, 4]]]))
    assert taken.positions.tolist() == [[[0, 2, 4], [1, 3, 4]]]
    assert taken.state["stage_a.attention"].tolist() == [[[1.0, 3.0, 0.0], [5.0, 0.0, 0.0]]]
    assert taken.state["stage_b.last"].tolist() == [[[-1, -1, -1], [-1, -1, -1]]]
