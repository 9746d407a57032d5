"""The executor: runs the policy over a layer group's slots, each due eviction and each choice.

It evicts the due rows of a ``LayerGroup``: every layer of the group at once, stacked on the
batch axis as a free view (one scorer call, one top-k, one gather for all of them), on whatever
device the group's buffers live on. The executor is the only caller of the policy here: the
group's layout gathers the slots (``gather_rows``), the eviction core decides
(``kvpolicy.eviction.evict``), the layout compacts what it keeps (``compact``). A group's
inputs are assembled by ``Executor.group_input`` from the group's counters, through
``kvpolicy.policy.eviction_input``, the one builder of every engine's inputs.

Timing the policy's work: set ``executor.timer`` (``cache.evicting.executor`` of a
``KVPolicyCache``, ``cache.executor`` of an ``EvictingCache``) to a callable that takes the kind
of work and returns a context manager; the executor runs each due eviction inside
``timer("evict")`` and each selection inside ``timer("select")``. The evaluation harness and the
benchmarks time the policy this way (``kvpolicy.eval.cost.PolicyTimer``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, NamedTuple

import torch

from . import driver, eviction
from .layouts.base import HeldSlots, RowClass
from .policy import Policy, eviction_input, keep_top
from .stages import guards
from .stages.base import EvictionInput
from .stages.model_facts import ModelFacts
from .stages.recall import RecallInput
from .state import LayerGroup

__all__ = ["Executor", "GroupStore"]


class Executor:
    """Evicts due rows of a policy's layer groups, with the cache's seed."""

    def __init__(self, policy: Policy, seed: int, model_facts: ModelFacts | None = None) -> None:
        self.policy = policy
        self.seed = seed
        #: What every input carries as ``EvictionInput.model`` (the cache checked it against the policy).
        self.model_facts = model_facts
        #: Optional hook around the policy's work: ``with timer("evict")`` wraps each due eviction
        #: (every layer of a group) and each update between evictions, ``with timer("select")``
        #: each select-mode choice (one layer's rows). None, the default, costs one attribute
        #: test per call.
        self.timer: Callable[[str], AbstractContextManager[Any]] | None = None

    def _timed(self, kind: str) -> AbstractContextManager[Any]:
        return nullcontext() if self.timer is None else self.timer(kind)

    def evict(self, group: LayerGroup) -> int:
        """Evict every due row of ``group`` (all its layers); return how many rows evicted."""
        if not group.any_due:
            return 0
        with self._timed("evict"):
            return self._evict_due(group)

    def before_step(self, group: LayerGroup, tokens: int) -> int:
        """Between two steps of ``group``, before one of ``tokens`` tokens: the due evictions, and
        for a policy that keeps state, an update of the rows whose window would otherwise lose
        queries the state has not seen (``eviction.must_observe``). So the state sees every query
        exactly once, over the slots held at its own step: nothing is evicted between a query's
        step and its update. Returns the rows evicted."""
        evicted = self.evict(group)
        if self.policy.observes_queries:
            group.layout.settle_observed()
            window = group.schedule.window
            most = group.rows.most_unobserved()
            if most is not None:  # the hot path: every row alike, one int
                if not eviction.must_observe(most, tokens, window):
                    return evicted
                stale = torch.ones(group.batch, dtype=torch.bool)
            else:
                stale = torch.as_tensor(eviction.must_observe(group.rows.unobserved(), tokens, window))
            if bool(stale.any()):
                with self._timed("evict"):
                    self._observe(group, stale)
        return evicted

    def _observe(self, group: LayerGroup, rows_mask: torch.Tensor) -> None:
        group.require_complete("update the policy's state")
        group.materialise_positions()
        driver.observe(GroupStore(self, group), self.policy, group.layout.eviction_classes(rows_mask))

    def observe_step(
        self, group: LayerGroup, layer: int, queries: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
    ) -> None:
        """A step too long for the window, on one ``layer`` as it is written: the state sees each
        of its queries (``[B, Hq, T, D]``, token ``positions [B, T]``, ``valid [B, T]``) over the
        layer's slots (``eviction.observe_long_step``)."""
        held = group.layout.gather_layer(layer)
        rows = torch.arange(queries.shape[0])
        inp = self.group_input(group, rows, slice(None), held, layer=layer, window=(queries, valid, positions))
        state = eviction.observe_long_step(self.policy, inp, queries, positions, valid)
        assert held.store is not None
        held.store(state)

    def _evict_due(self, group: LayerGroup) -> int:
        group.require_complete("evict")
        group.materialise_positions()
        due = group.due.clone()
        driver.evict(GroupStore(self, group), self.policy, group.layout.eviction_classes(due))
        group.eviction_steps += 1
        return int(due.sum())

    def choose(
        self, group: LayerGroup, layer: int, rows: torch.Tensor, row_sel: slice | torch.Tensor, held: HeldSlots,
        key_pages: Mapping[int, tuple[torch.Tensor, torch.Tensor]],
    ) -> eviction.Kept:
        """Select mode, one decode step of ``layer``: the choice of ``rows`` (their ``held``
        slots; ``key_pages``, their page summaries), by ``eviction.choose``."""
        with self._timed("select"):
            inp = self.group_input(group, rows, row_sel, held, layer=layer, key_pages=key_pages)
            return eviction.choose(self.policy, inp)

    def recall(self, group: LayerGroup, layer: int, inp: RecallInput, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A two-tier policy's recall on ``layer`` (``kvpolicy.layouts.TwoTierRows``): the recall
        scorer's page scores ``[R, Hkv, Np]`` (checked: ``guards.run_recall_scorer``; -inf on empty
        page slots) and the ``k`` best page slots ``[R, Hkv, k]``, ranked by ``keep_top`` (greedy)."""
        recall = self.policy.config.recall
        assert recall is not None  # only a two-tier layout asks
        with self._timed("select"):
            scores = guards.run_recall_scorer(recall.scorer, inp)
            return keep_top(scores, min(k, scores.shape[-1])), scores

    def group_input(
        self, group: LayerGroup, rows: torch.Tensor, row_sel: slice | torch.Tensor, held: HeldSlots, *,
        layer: int | None = None, key_pages: Mapping[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
        window: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> EvictionInput:
        """What the policy sees of ``rows`` (host ``[R]``; ``row_sel``: all rows, or them on the
        device) on every layer of ``group`` stacked layer-major on the batch axis (an eviction),
        or on one ``layer`` (select mode's choice, a long step): their ``held`` slots (the
        layout's), the query window, the schedule's budget, and each stacked row's layer, draw
        count, stream (its seeds) and prompt length, read off the group's counters and handed to
        ``kvpolicy.policy.eviction_input``.

        For a policy that keeps state, the input carries it (the fields of ``held`` stored under
        ``Policy.state_fields``), each window query's token position, and which queries the state
        has not seen (``eviction.new_queries``). ``window``: ``(queries, valid, positions)`` to read
        instead of the ring (a long step's queries, ``observe_step``)."""
        draws, streams = group.layout.draw_counts()[rows], group.rows.streams[rows]
        prompts = group.rows.prompt[rows]
        layer_idx: int | torch.Tensor
        if layer is None:
            layers, n_layers = slice(None), group.layer_ids.numel()
            layer_idx = group.layer_ids.repeat_interleave(rows.numel())
            draws, streams, prompts = draws.repeat(n_layers), streams.repeat(n_layers), prompts.repeat(n_layers)
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
                query_positions, query_new = eviction.new_queries(
                    self.policy, query_valid, group.rows.seen()[rows].repeat(reps), group.rows.observed[rows].repeat(reps),
                )
        schedule = group.schedule
        return eviction_input(
            held.fields["keys"], held.fields["values"], queries, budget=schedule.budget, recent=schedule.recent,
            seed=self.seed, slot_valid=held.valid, query_valid=query_valid, positions=held.fields["positions"],
            layer_idx=layer_idx, evictions=draws, streams=streams, key_pages=key_pages,
            query_positions=query_positions, query_new=query_new, state=state, model=self.model_facts,
            prompt_lengths=prompts,
        )


class GatheredRows(NamedTuple):
    """A class of a group's rows as gathered for the policy (``GroupStore.gather``)."""

    row_sel: slice | torch.Tensor  # all rows, or them on the group's device
    held: HeldSlots
    inp: EvictionInput


class GroupStore:
    """A ``LayerGroup`` as the step driver's ``kvpolicy.driver.SlotStore``: its layout gathers and
    compacts a class of rows (``RowClass``), its rows' counters count evictions and what the
    state has seen, and the executor builds the policy's input (``Executor.group_input``)."""

    def __init__(self, executor: Executor, group: LayerGroup) -> None:
        self.executor, self.group = executor, group

    def gather(self, rows: RowClass) -> GatheredRows:
        group = self.group
        row_sel: slice | torch.Tensor = slice(None) if rows.rows.numel() == group.batch else rows.rows.to(group.device)
        held = group.layout.gather_rows(rows.rows, row_sel, rows.held)
        return GatheredRows(row_sel, held, self.executor.group_input(group, rows.rows, row_sel, held))

    def compact(self, rows: RowClass, gathered: GatheredRows, kept: eviction.Kept) -> int:
        """Returns the slots each of ``rows`` holds now."""
        count = self.group.layout.compact(rows.rows, gathered.row_sel, rows.held, gathered.held, kept)
        self.group.evicted(rows.rows, count)
        return count

    def write_state(self, rows: RowClass, gathered: GatheredRows, state: Mapping[str, torch.Tensor]) -> None:
        if gathered.held.store is None:
            raise RuntimeError(f"{type(self.group.layout).__name__} gathered state it cannot store back")
        gathered.held.store(state)

    def observed(self, rows: RowClass) -> None:
        self.group.rows.mark_observed(rows.rows)
