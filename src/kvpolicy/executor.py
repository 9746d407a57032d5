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
from .policy import Policy, eviction_input, window_positions
from .stages.base import EvictionInput
from .stages.model_facts import ModelFacts
from .state import LayerGroup

__all__ = ["ChosenSlots", "Executor"]

#: Logits per chunk when a long step's queries update the policy's state (``observe_step``):
#: ``[B, Hq, chunk, N]`` float32, about 16 MiB.
OBSERVE_ELEMENTS = 1 << 22


class Executor:
    """Evicts due rows of a policy's layer groups, with the cache's seed."""

    def __init__(self, policy: Policy, seed: int, model_facts: ModelFacts | None = None) -> None:
        self.policy = policy
        self.seed = seed
        #: What every input carries as ``EvictionInput.model`` (the cache checked it against the policy).
        self.model_facts = model_facts
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

    def before_step(self, group: LayerGroup, tokens: int) -> int:
        """Between two steps of ``group``, before one of ``tokens`` tokens: the due evictions, and
        for a policy that keeps state, an update of the rows whose window would otherwise lose
        queries the state has not seen (``tokens`` more would push them out of the ring). So
        the state sees every query exactly once, over the slots held at its own step: nothing is
        evicted between a query's step and its update. Returns the rows evicted."""
        evicted = self.evict(group)
        if self.policy.observes_queries:
            group.layout.settle_observed()
            window = group.schedule.window
            most = group.rows.most_unobserved()
            if most is not None:  # the hot path: every row alike, one int
                if most <= 0 or most + tokens <= window:
                    return evicted
                stale = torch.ones(group.batch, dtype=torch.bool)
            else:
                unseen = group.rows.unobserved()
                stale = (unseen > 0) & (unseen + tokens > window)
            if bool(stale.any()):
                if self.timer is None:
                    self._observe(group, stale)
                else:
                    with self.timer("evict"):
                        self._observe(group, stale)
        return evicted

    def _observe(self, group: LayerGroup, rows_mask: torch.Tensor) -> None:
        group.require_complete("update the policy's state")
        group.materialise_positions()
        for rows, count in group.layout.eviction_classes(rows_mask):
            row_sel: slice | torch.Tensor = slice(None) if rows.numel() == group.batch else rows.to(group.device)
            group.layout.observe(rows, row_sel, count)
            group.rows.mark_observed(rows)

    def observe_step(
        self, group: LayerGroup, layer: int, queries: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
    ) -> None:
        """A step too long for the window, on one ``layer`` as it is written: the state sees each
        of its queries (``[B, Hq, T, D]``, token ``positions [B, T]``, ``valid [B, T]``) over the
        layer's slots, in chunks of queries (never a ``[T, T]`` matrix), in time order."""
        held = group.layout.layer_slots(layer)
        b, hq, t, _ = queries.shape
        n = held.fields["keys"].shape[2]
        chunk = max(1, min(t, OBSERVE_ELEMENTS // max(1, b * hq * n)))
        fields = dict(held.fields)
        rows = torch.arange(b)
        for c0 in range(0, t, chunk):
            c1 = min(t, c0 + chunk)
            inp = self.eviction_input(
                group, rows, slice(None), HeldSlots(fields, held.valid), layer=layer,
                window=(queries[:, :, c0:c1], valid[:, c0:c1], positions[:, c0:c1]),
            )
            _, updates = self.policy.observe(inp, eviction=False)
            fields.update(updates)
        group.layout.store_layer_state(layer, {name: fields[name] for name in self.policy.state_fields})

    def _evict_due(self, group: LayerGroup) -> int:
        group.require_complete("evict")
        group.materialise_positions()
        due = group.due.clone()
        for rows, count in group.layout.eviction_classes(due):
            row_sel: slice | torch.Tensor = slice(None) if rows.numel() == group.batch else rows.to(group.device)
            group.evicted(rows, group.layout.evict(rows, row_sel, count))
            group.rows.mark_observed(rows)  # the eviction brought their state up to date
        group.eviction_steps += 1
        return int(due.sum())

    def eviction_input(
        self, group: LayerGroup, rows: torch.Tensor, row_sel: slice | torch.Tensor, held: HeldSlots, *,
        layer: int | None = None, key_pages: Mapping[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
        window: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> EvictionInput:
        """What the policy sees of ``rows`` (host ``[R]``; ``row_sel``: all rows, or them on the
        device) on every layer of ``group`` stacked layer-major on the batch axis (an eviction),
        or on one ``layer`` (select mode's choice): their ``held`` slots (the layout's), the query
        window, the schedule's budget, and each stacked row's layer, draw count and stream (its
        seeds). The one builder of an eviction's or a choice's input.

        For a policy that keeps state, the input carries it (the fields of ``held`` stored under
        ``Policy.state_fields``), each window query's token position, and which queries the state
        has not seen (``query_new``). ``window``: ``(queries, valid, positions)`` to read instead
        of the ring (a long step's queries, ``observe_step``)."""
        draws, streams = group.layout.draw_counts()[rows], group.rows.streams[rows]
        layer_idx: int | torch.Tensor
        if layer is None:
            layers, n_layers = slice(None), group.layer_ids.numel()
            layer_idx = group.layer_ids.repeat_interleave(rows.numel())
            draws, streams = draws.repeat(n_layers), streams.repeat(n_layers)
        else:
            i = group.member[layer]
            layers, layer_idx = slice(i, i + 1), layer
        state = query_positions = query_new = None
        if window is not None:
            queries, query_valid, query_positions = window
            query_new = query_valid
        else:
            queries, query_valid = group.ring.windows(layers, row_sel)
        if self.policy.keeps_state:
            state = self.policy.nest_state(held.fields)
            if query_positions is None:
                reps = query_valid.shape[0] // rows.numel()
                tokens = group.rows.seen()[rows].repeat(reps)
                query_positions = window_positions(query_valid, tokens)
                observed = group.rows.observed[rows].repeat(reps).to(query_valid.device)
                query_new = query_valid & (query_positions >= observed[:, None])
                if not self.policy.observes_queries:  # stages updated once per eviction see the window
                    query_new = query_valid
        schedule = group.schedule
        return eviction_input(
            held.fields["keys"], held.fields["values"], queries, budget=schedule.budget, recent=schedule.recent,
            seed=self.seed, slot_valid=held.valid, query_valid=query_valid, positions=held.fields["positions"],
            layer_idx=layer_idx, evictions=draws, streams=streams, key_pages=key_pages,
            query_positions=query_positions, query_new=query_new, state=state, model=self.model_facts,
        )

    def selected_slots(self, group: LayerGroup, layer: int) -> list[ChosenSlots]:
        """Select mode, one decode step of ``layer``: what each class of rows attends
        (``SelectRows.chosen_slots``, which runs the policy for the rows that choose anew)."""
        if self.timer is None:
            return group.layout.chosen_slots(layer)
        with self.timer("select"):
            return group.layout.chosen_slots(layer)
