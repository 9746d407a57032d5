"""The executor: runs the policy over a layer group's slots, each due eviction and each choice.

It evicts the due rows of a ``LayerGroup``: every layer of the group at once, stacked on the
batch axis as a free view (one scorer call, one top-k, one gather for all of them), on whatever
device the group's buffers live on. The policy chooses; the group's layout shows it the slots and
compacts what it keeps (``kvpolicy.layouts``); every input the policy sees is built here, by
``Executor.eviction_input``.

Timing the policy's work: set ``executor.timer`` (``cache.evicting.executor`` of a
``KVPolicyCache``, ``cache.executor`` of an ``EvictingCache``) to a callable that takes the kind
of work and returns a context manager; the executor runs each due eviction inside
``timer("evict")`` and each selection inside ``timer("select")``. The evaluation harness and the
benchmarks time the policy this way (``kvpolicy.eval.cost.PolicyTimer``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch

from .layouts.base import HeldSlots
from .layouts.select import ChosenSlots
from .policy import Policy, eviction_input
from .stages.base import EvictionInput
from .state import LayerGroup

__all__ = ["ChosenSlots", "Executor"]


class Executor:
    """Evicts due rows of a policy's layer groups, with the cache's seed."""

    def __init__(self, policy: Policy, seed: int) -> None:
        self.policy = policy
        self.seed = seed
        #: Optional hook around the policy's work: ``with timer("evict")`` wraps each due eviction
        #: (every layer of a group), ``with timer("select")`` each ``selected_slots`` call (one
        #: layer's step in select mode). None, the default, costs one attribute test per call.
        self.timer: Callable[[str], AbstractContextManager[Any]] | None = None

    def evict(self, group: LayerGroup) -> int:
        """Evict every due row of ``group`` (all its layers); return how many rows evicted."""
        if not group.any_due:
            return 0
        if self.timer is None:
            return self._evict_due(group)
        with self.timer("evict"):
            return self._evict_due(group)

    def _evict_due(self, group: LayerGroup) -> int:
        group.require_complete("evict")
        group.materialise_positions()
        due = group.due.clone()
        for rows, count in group.layout.eviction_classes(due):
            row_sel: slice | torch.Tensor = slice(None) if rows.numel() == group.batch else rows.to(group.device)
            group.evicted(rows, group.layout.evict(rows, row_sel, count))
        group.eviction_steps += 1
        return int(due.sum())

    def eviction_input(
        self, group: LayerGroup, rows: torch.Tensor, row_sel: slice | torch.Tensor, held: HeldSlots, *,
        layer: int | None = None, key_pages: Mapping[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> EvictionInput:
        """What the policy sees of ``rows`` (host ``[R]``; ``row_sel``: all rows, or them on the
        device) on every layer of ``group`` stacked layer-major on the batch axis (an eviction),
        or on one ``layer`` (select mode's choice): their ``held`` slots (the layout's), the query
        window, the schedule's budget, and each stacked row's layer, draw count and stream (its
        seeds). The one builder of an eviction's or a choice's input."""
        draws, streams = group.layout.draw_counts()[rows], group.rows.streams[rows]
        layer_idx: int | torch.Tensor
        if layer is None:
            layers, n_layers = slice(None), group.layer_ids.numel()
            layer_idx = group.layer_ids.repeat_interleave(rows.numel())
            draws, streams = draws.repeat(n_layers), streams.repeat(n_layers)
        else:
            i = group.member[layer]
            layers, layer_idx = slice(i, i + 1), layer
        queries, query_valid = group.ring.windows(layers, row_sel)
        schedule = group.schedule
        return eviction_input(
            held.fields["keys"], held.fields["values"], queries, budget=schedule.budget, recent=schedule.recent,
            seed=self.seed, slot_valid=held.valid, query_valid=query_valid, positions=held.fields["positions"],
            layer_idx=layer_idx, evictions=draws, streams=streams, key_pages=key_pages,
        )

    def selected_slots(self, group: LayerGroup, layer: int) -> list[ChosenSlots]:
        """Select mode, one decode step of ``layer``: what each class of rows attends
        (``SelectRows.chosen_slots``, which runs the policy for the rows that choose anew)."""
        if self.timer is None:
            return group.layout.chosen_slots(layer)
        with self.timer("select"):
            return group.layout.chosen_slots(layer)
