"""How a layer group's rows and heads use its slots: one layout per group, chosen once.

- ``EvenRows``: every head of a row holds the row's tokens (uniform and per-layer allocations).
- ``HeadRuns``: heads of a row hold different counts after an eviction, each row's slots read
  as one flat run, head after head (per-head allocations: Ada-KV, head profiles).
- ``SelectRows``: select mode: every token kept, each decode step attends the policy's choice.
- ``TwoTierRows``: even rows whose evicted tokens go to a slow tier, recalled by the policy's
  ``recall`` block (``kvpolicy.tiers``).

Each implements ``SlotLayout``: how a step's slots are written, how the buffers grow, what
attention reads, how an eviction compacts, how rows are reordered, the bytes held. ``layout_for``
is the one place that picks a layout, from the policy; nothing else asks which one a group has.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..policy import Policy
from ..selection import SELECT_GROWTH
from .base import (
    CacheStateError,
    ChosenSlots,
    GroupRunner,
    GroupState,
    HeldSlots,
    RowClass,
    SlotLayout,
    SlotView,
)
from .even import EvenRows
from .head_runs import HeadRuns
from .select import Chooser, RowPhase, SelectRows
from .two_tier import Recaller, TwoTierRows

__all__ = [
    "CacheStateError",
    "Chooser",
    "ChosenSlots",
    "EvenRows",
    "GroupRunner",
    "GroupState",
    "HeadRuns",
    "HeldSlots",
    "LayoutChoice",
    "RowClass",
    "RowPhase",
    "SelectRows",
    "SlotLayout",
    "SlotView",
    "Recaller",
    "TwoTierRows",
    "layout_for",
]


@dataclass(frozen=True)
class LayoutChoice:
    """The layout every group of one cache is built with, and its options."""

    kind: type[SlotLayout]
    #: The executor that runs the policy over the groups' slots (layouts never see the policy).
    executor: GroupRunner
    options: Mapping[str, Any] = field(default_factory=dict)

    def build(self, group: GroupState, keys: torch.Tensor, values: torch.Tensor, needed: int) -> SlotLayout:
        """The layout of a new ``group`` whose first step needs ``needed`` slots (``keys`` and
        ``values``: the first step's, for shapes, dtype and device)."""
        fields = {name: spec for name, (_, _, spec) in self.executor.policy.state_fields.items()}
        return self.kind(group, keys, values, needed, fields, **self.options)


def layout_for(policy: Policy, executor: GroupRunner, select_growth: float = SELECT_GROWTH) -> LayoutChoice:
    """The layout of ``policy``'s groups: select mode's, two tiers for a ``recall`` block,
    per-head runs for a per-head allocation, else even rows."""
    if policy.config.mode == "select":
        options = {"page_sizes": policy.key_page_sizes, "per_head": policy.per_head, "growth": select_growth,
                   "choose": executor.choose, "page_choice": policy.chooses_pages}
        return LayoutChoice(SelectRows, executor, options)
    recall = policy.config.recall
    if recall is not None:  # evict mode, even rows (the config refuses the rest)
        return LayoutChoice(TwoTierRows, executor, {"recall": recall, "rank": executor.recall})
    if policy.per_head:
        return LayoutChoice(HeadRuns, executor)
    return LayoutChoice(EvenRows, executor)
