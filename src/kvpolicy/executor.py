"""The executor: the only code that moves cache memory.

It evicts the due rows of a ``LayerGroup``: every layer of the group at once, stacked on the
batch axis as a free view (one scorer call, one top-k, one gather for all of them), on whatever
device the group's buffers live on. The policy chooses; the executor compacts.

Timing the policy's work: set ``executor.timer`` (``cache.evicting.executor`` of a
``KVPolicyCache``, ``cache.executor`` of an ``EvictingCache``) to a callable that takes the kind
of work and returns a context manager; the executor runs each due eviction inside
``timer("evict")`` and each selection inside ``timer("select")``. The evaluation harness and the
benchmarks time the policy this way (``kvpolicy.eval.cost.PolicyTimer``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any, NamedTuple

import torch

from .attend import attend
from .policy import Policy, eviction_input
from .selection import SelectionState, choose_directly
from .slots import block, compact_rows, gather_slots
from .stages.base import EvictionInput
from .state import CacheStateError, LayerGroup


class ChosenSlots(NamedTuple):
    """What one class of rows attends at a select-mode decode step of one layer."""

    rows: slice | torch.Tensor  # the rows (a slice of all, or device indices)
    held: int  # slots each of them holds
    slots: torch.Tensor | None  # [R, Hkv, K] the slots attended; None: all ``held``
    valid: torch.Tensor | None  # [R, Hkv, K] bool, which columns of ``slots`` count; None: all


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
        # Rows holding different counts (different prompt lengths) are evicted apart, each as it
        # would be alone; in the usual case every row is due with one count and this runs once.
        # Under a per-head allocation the policy sees each row's heads right-aligned in as many
        # columns as its fullest head holds: rows are grouped by that width too, so that a row's
        # view, and so its random draws, are those it has alone.
        counts = group.counts
        if group.heads is None:
            classes = counts[due].unique()[:, None]
            evict_rows = self._evict_rows
        else:
            fullest = counts + group.heads.surplus().amax(0)
            classes = torch.stack([counts, fullest], 1)[due].unique(dim=0)
            evict_rows = self._evict_heads
        for count, *width in classes.tolist():
            rows = due & (counts == count)
            if width:
                rows &= fullest == width[0]
            evict_rows(group, rows.nonzero().squeeze(1), int(count))
        group.eviction_steps += 1
        return int(due.sum())

    def _evict_rows(self, group: LayerGroup, rows: torch.Tensor, count: int) -> None:
        """Run the policy on ``rows`` (host ``[R]``, all holding ``count`` slots) of every layer
        of ``group`` at once and compact them."""
        buffers = group.buffers
        n_layers, n_rows = buffers.keys.shape[0], rows.numel()
        row_sel: slice | torch.Tensor = slice(None) if n_rows == group.batch else rows
        queries, query_valid = group.ring.windows(slice(None), row_sel)
        if queries.shape[2] == 0:  # no window: a well-formed empty one
            queries = buffers.keys.new_zeros(n_layers * n_rows, buffers.keys.shape[2], 0, buffers.keys.shape[-1])
        schedule = group.schedule
        inp = eviction_input(
            block(buffers.keys, row_sel, count).flatten(0, 1),
            block(buffers.values, row_sel, count).flatten(0, 1),
            queries,
            budget=schedule.budget,
            recent=schedule.recent,
            seed=self.seed,
            query_valid=query_valid,
            positions=block(buffers.positions, row_sel, count).flatten(0, 1),
            layer_idx=group.layer_ids.repeat_interleave(n_rows),
            evictions=group.rows.evictions[rows].repeat(n_layers),
            streams=group.rows.streams[rows].repeat(n_layers),
        )
        kept = self.policy.select_from(inp).unflatten(0, (n_layers, n_rows))
        compact_rows(buffers, row_sel, kept, count)
        group.evicted(rows, kept.shape[-1])

    def _evict_heads(self, group: LayerGroup, rows: torch.Tensor, count: int) -> None:
        """``_evict_rows`` under a per-head allocation: the policy sees each head's slots
        right-aligned (``HeadLayout.slots``), keeps ``counts[h]`` per head, and the kept slots
        are written to the rows' new flat layout (head ``h`` from ``h * (cap - budget)`` plus the
        slots kept by the heads before it)."""
        heads, buffers = group.heads, group.buffers
        assert heads is not None
        cap, schedule = buffers.capacity, group.schedule
        n_layers, n_rows, hkv = buffers.keys.shape[0], rows.numel(), buffers.keys.shape[2]
        row_sel: slice | torch.Tensor = slice(None) if n_rows == group.batch else rows.to(group.device)
        counts = torch.full((n_rows,), count, dtype=torch.long)
        flat, valid = heads.slots(cap, counts, heads.width(counts, row_sel), rows=row_sel)  # [Lyr, R, Hkv, N]
        width = flat.shape[-1]
        row_of = torch.arange(group.batch, device=group.device)[row_sel]
        lyr = torch.arange(n_layers, device=group.device)[:, None, None]
        picked = []
        for _, t in buffers.tensors():
            src = t.flatten(2, 3)[lyr, row_of[None, :, None], flat.flatten(2)]  # [Lyr, R, Hkv * N, ...]
            picked.append(src.view(n_layers, n_rows, hkv, width, *t.shape[4:]).flatten(0, 1))
        queries, query_valid = group.ring.windows(slice(None), row_sel)
        if queries.shape[2] == 0:
            queries = buffers.keys.new_zeros(n_layers * n_rows, group.ring.queries.shape[2], 0, buffers.keys.shape[-1])
        inp = eviction_input(
            picked[0], picked[1], queries, budget=schedule.budget, recent=schedule.recent, seed=self.seed,
            slot_valid=valid.flatten(0, 1), query_valid=query_valid,
            positions=picked[2].masked_fill(~valid.flatten(0, 1), -1),
            layer_idx=group.layer_ids.repeat_interleave(n_rows), evictions=group.rows.evictions[rows].repeat(n_layers),
            streams=group.rows.streams[rows].repeat(n_layers),
        )
        keep, kept_counts = self.policy.select_heads_from(inp)
        keep = keep.view(n_layers, n_rows, hkv, width)
        budget = inp.budget
        # Destination: the kept slot's rank among the row's kept slots, plus the free room of the
        # heads before it.
        rank = keep.flatten(2).long().cumsum(-1).view(keep.shape) - 1
        dest = rank + torch.arange(hkv, device=keep.device)[:, None] * (cap - budget)
        l_idx, r_idx, _, _ = keep.nonzero(as_tuple=True)
        b_idx = row_of[r_idx]
        src, dst = flat[keep], dest[keep]
        for _, t in buffers.tensors():
            view = t.flatten(2, 3)
            view[l_idx, b_idx, dst] = view[l_idx, b_idx, src]
        heads.set_deficit(slice(None), row_sel, budget - kept_counts.view(n_layers, n_rows, hkv))
        group.evicted(rows, budget)

    def selected_slots(self, group: LayerGroup, layer: int) -> list[ChosenSlots]:
        """Select mode, one decode step of ``layer``: per class of rows ``ChosenSlots(rows, held,
        slots, valid)``, ``slots [R, Hkv, K]`` the slots the rows attend (the ``budget`` chosen by
        the policy plus the tokens appended since the choice), or None for rows holding
        ``budget`` slots or fewer (they attend all). Under a per-head allocation heads choose
        different counts and ``valid [R, Hkv, K]`` says which columns count (else None). Rows
        that choose anew at this step run the policy on this layer's slots first; rows holding
        different counts run apart, each as it would alone."""
        if self.timer is None:
            return self._selected_slots(group, layer)
        with self.timer("select"):
            return self._selected_slots(group, layer)

    def _selected_slots(self, group: LayerGroup, layer: int) -> list[ChosenSlots]:
        i = group.member[layer]
        select = _selection_state(group)
        budget = group.schedule.budget
        keys, values = group.buffers.keys[i : i + 1], group.buffers.values[i : i + 1]
        out: list[ChosenSlots] = []
        for count, fresh, chosen_at, rows in _row_classes(group):
            row_sel: slice | torch.Tensor = slice(None) if rows.numel() == group.batch else rows.to(group.device)
            if count <= budget:
                out.append(ChosenSlots(row_sel, count, None, None))
                continue
            if fresh:
                window, window_valid = group.ring.windows(slice(i, i + 1), row_sel)
                held_keys = block(keys, row_sel, count)[0]
                shape = (*held_keys.shape[:2], count)
                # Rows are packed and nothing is evicted: every slot is valid and slots are
                # positions (views, nothing computed).
                inp = eviction_input(
                    held_keys, block(values, row_sel, count)[0], window, budget=budget,
                    recent=group.schedule.recent, seed=self.seed, query_valid=window_valid,
                    slot_valid=torch.ones((), dtype=torch.bool, device=group.device).expand(shape),
                    positions=torch.arange(count, device=group.device).expand(shape), layer_idx=layer,
                    evictions=select.choices[rows], streams=group.rows.streams[rows],
                    key_pages={p: (lo[i, row_sel], hi[i, row_sel]) for p, (lo, hi) in select.key_pages.items()},
                )
                if select.per_head:  # each head chooses its own count out of the layer's pool
                    select.store_heads(i, row_sel, *self.policy.select_heads_from(_with_own_masks(inp)))
                else:
                    kept = choose_directly(self.policy, inp)
                    if kept is None:  # every token was checked as it entered the cache
                        kept = self.policy.select_from(_with_own_masks(inp), inputs_checked=True)
                    select.selection[i, row_sel] = kept
            chosen = select.selection[i, row_sel]
            tail = torch.arange(chosen_at, count, device=group.device).expand(*chosen.shape[:2], -1)
            index = torch.cat([chosen, tail], dim=-1)
            valid = None
            if select.per_head:  # columns past a head's count repeat its first chosen slot
                cols = torch.arange(index.shape[-1], device=group.device)
                counts = select.head_counts[i, row_sel][..., None]
                valid = (cols < counts) | (cols >= chosen.shape[-1])
            out.append(ChosenSlots(row_sel, count, index, valid))
        return out

    def attend_selected(
        self, group: LayerGroup, layer: int, queries: torch.Tensor, scaling: float | None
    ) -> torch.Tensor:
        """Select mode: attention of one decode step's ``queries [B, Hq, 1, D]`` over the slots
        ``selected_slots`` gives each row, gathered (so the cost is that of ``budget`` slots)."""
        i = group.member[layer]
        keys, values = group.buffers.keys[i : i + 1], group.buffers.values[i : i + 1]
        out = queries.new_empty(queries.shape)
        for row_sel, count, index, valid in self.selected_slots(group, layer):
            k, v = block(keys, row_sel, count)[0], block(values, row_sel, count)[0]
            if index is not None:
                k, v = gather_slots(k, index), gather_slots(v, index)
            mask = None if valid is None else valid[:, :, None, :]  # per KV head (per-head allocations)
            out[row_sel] = attend(queries[row_sel], k, v, scaling=scaling, mask=mask)
        return out


def _row_classes(group: LayerGroup) -> list[tuple[int, bool, int, torch.Tensor]]:
    """Select mode: rows that share a count and a selection state, ``(count, reselect,
    selected_at, rows [R])``; one class while every row is alike (the usual case)."""
    select = _selection_state(group)
    reselect, selected_at = select.reselect, select.selected_at
    if group.batch_alike and bool((reselect == reselect[0]).all() and (selected_at == selected_at[0]).all()):
        count = int(group.extent_now)
        return [(count, bool(reselect[0]), int(selected_at[0]), torch.arange(group.batch))]
    counts = group.counts
    classes = []
    for count, fresh, chosen_at in torch.stack([counts, reselect.long(), selected_at]).unique(dim=1).t().tolist():
        rows = ((counts == count) & (reselect == bool(fresh)) & (selected_at == chosen_at)).nonzero().squeeze(1)
        classes.append((count, bool(fresh), chosen_at, rows))
    return classes


def _with_own_masks(inp: EvictionInput) -> EvictionInput:
    """Select mode's input with ``slot_valid`` and ``positions`` as tensors of their own (they are
    expanded views): a policy's stages, plugins included, get them as an eviction gives them."""
    return replace(inp, slot_valid=inp.slot_valid.contiguous(), positions=inp.positions.contiguous())


def _selection_state(group: LayerGroup) -> SelectionState:
    if group.select is None:
        raise CacheStateError("a select-mode step on a group that is not in select mode")
    return group.select
