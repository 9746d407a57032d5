"""Even rows: every head of a row holds the row's tokens, in the same slots."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch

from ..attend import attend
from ..eviction import Kept
from ..schedule import Phase
from ..slots import Contiguous, StepPlan, block, compact_rows
from .base import HeldSlots, RowClass, SlotLayout, SlotView


class EvenRows(SlotLayout):
    """Row ``r`` holds its ``counts[r]`` real tokens in slots ``[0, counts[r])`` of every head, in
    position order (a uniform or per-layer allocation: heads keep the same number of tokens).

    Slot validity is ``slot < counts[r]`` and needs no buffer; attention reads views of the
    buffers with the step's one mask; an eviction keeps the same number of slots per head and
    gathers them to the front.
    """

    def capacity_for(self, needed: int) -> int:
        return self.group.schedule.capacity_for(needed)

    def due(self, after: Any, tokens: Any, phase: Phase, added: Any) -> Any:
        return self.group.schedule.step_due(after, tokens, phase, added)

    def tokens_to_next_eviction(self) -> int:
        group = self.group
        if group.any_due:
            return 0
        counts, tokens = group.rows.counts.tolist(), group.rows.tokens.tolist()
        return min(group.schedule.tokens_to_eviction(int(c), int(t)) for c, t in zip(counts, tokens, strict=True))

    # -- storage --------------------------------------------------------------------------------
    def write(self, i: int, new: Mapping[str, torch.Tensor], plan: StepPlan) -> None:
        buffers, place = self.buffers, plan.placement
        if isinstance(place, Contiguous):
            where = slice(place.start, place.start + plan.tokens)
            for name, x in new.items():
                getattr(buffers, name)[i, :, :, where] = x
        else:  # [nnz, Hkv, ...] real tokens scattered to each row's next free slots
            for name, x in new.items():
                getattr(buffers, name)[i][place.rows, :, place.slots] = x[place.rows, :, place.cols]

    def grow(self, capacity: int) -> None:
        self.buffers.grow(capacity)

    def materialise_positions(self) -> None:
        """``position = slot + tokens - counts`` for slots past each row's ``stored``, and ``-1``
        past each row's count, on every layer and head."""
        rows = self.group.rows
        length = int(rows.counts.max())
        dev = self.buffers.keys.device
        slot = torch.arange(length, device=dev)
        stored, counts = rows.stored.to(dev)[:, None], rows.counts.to(dev)[:, None]
        derived = torch.where(slot < counts, slot + (rows.tokens.to(dev)[:, None] - counts), -1)  # [B, L]
        pos = self.buffers.positions[:, :, :, :length]
        pos.copy_(torch.where((slot >= stored)[None, :, None, :], derived[None, :, None, :], pos))

    # -- reading --------------------------------------------------------------------------------
    def _held(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s keys and values, ``[B, Hkv, L, D]`` views (``L`` its extent)."""
        i, length = self.group.member[layer], self.group.extent(layer)
        return self.buffers.keys[i, :, :, :length], self.buffers.values[i, :, :, :length]

    def _valid(self, layer: int) -> torch.Tensor:
        """``[B, 1, L]`` bool: slot ``s`` of row ``r`` holds a token iff ``s < counts[r]``."""
        group, dev = self.group, self.buffers.keys.device
        alike = group.rows.alike
        if alike is not None:  # one count for every row (reading the [B] counts would leave the fast path)
            count = alike.held if group.written(layer) else alike.before
            return torch.ones(group.batch, 1, count, dtype=torch.bool, device=dev)
        counts = group.counts_of(layer)
        slot = torch.arange(int(counts.max()), device=dev)
        return (slot < counts.to(dev)[:, None])[:, None, :]

    def attend(self, layer: int, queries: torch.Tensor, scaling: float | None) -> torch.Tensor:
        keys, values = self._held(layer)
        return attend(queries, keys, values, scaling=scaling, mask=self.group.plan.mask)

    def slots(self, layer: int) -> SlotView:
        keys, values = self._held(layer)
        return SlotView(keys, values, self._valid(layer).expand(-1, keys.shape[1], -1))

    def positions(self, layer: int) -> torch.Tensor:
        group = self.group
        group.materialise_positions()
        return self.buffers.positions[group.member[layer], :, :, : group.extent(layer)]

    # -- eviction -------------------------------------------------------------------------------
    def eviction_classes(self, due: torch.Tensor) -> list[RowClass]:
        """Rows holding different counts (different prompt lengths) are evicted apart, each as it
        would be alone; in the usual case every row is due with one count: one class."""
        counts = self.group.counts
        return [RowClass((due & (counts == c)).nonzero().squeeze(1), int(c)) for c in counts[due].unique().tolist()]

    def compact(self, rows: torch.Tensor, row_sel: slice | torch.Tensor, count: int, held: HeldSlots, kept: Kept) -> int:
        """The kept slots ``[Lyr, R, Hkv, K]`` gathered to the front in place, their new state with them."""
        assert kept.slots is not None  # even rows: every head keeps the same count
        lead = (self.buffers.keys.shape[0], rows.numel())
        slots = kept.slots.unflatten(0, lead)
        slot_state = {k: v.unflatten(0, lead) for k, v in kept.writes.items() if k not in self.buffers.head_state}
        compact_rows(self.buffers, row_sel, slots, count, sources=slot_state)
        self._store_head_state(row_sel, kept.state)
        return slots.shape[-1]

    # -- state ----------------------------------------------------------------------------------
    def gather_rows(self, rows: torch.Tensor, row_sel: slice | torch.Tensor, count: int) -> HeldSlots:
        fields = {name: block(t, row_sel, count).flatten(0, 1) for name, t in self.buffers.tensors()}
        for name, t in self.buffers.head_state.items():
            fields[name] = t[:, row_sel].flatten(0, 1)
        return HeldSlots(fields, None, store=partial(self._store_rows_state, rows, row_sel))

    def _store_rows_state(self, rows: torch.Tensor, row_sel: slice | torch.Tensor, state: Mapping[str, torch.Tensor]) -> None:
        n_layers = self.buffers.keys.shape[0]
        for name, t in state.items():
            if name in self.buffers.head_state:
                continue
            count = t.shape[-1]
            buf = getattr(self.buffers, name)
            where = row_sel if isinstance(row_sel, slice) else row_sel.to(buf.device)
            buf[:, where, :, :count] = t.unflatten(0, (n_layers, rows.numel()))
        self._store_head_state(row_sel, state)

    def _store_head_state(self, row_sel: slice | torch.Tensor, state: Mapping[str, torch.Tensor]) -> None:
        head_state = self.buffers.head_state
        for name, t in state.items():
            if name in head_state:
                where = row_sel if isinstance(row_sel, slice) else row_sel.to(t.device)
                head_state[name][:, where] = t.unflatten(0, (head_state[name].shape[0], -1))

    def gather_layer(self, layer: int) -> HeldSlots:
        i, length = self.group.member[layer], self.group.extent(layer)
        self.group.materialise_positions()
        fields = {name: t[i, :, :, :length] for name, t in self.buffers.tensors()}
        for name, t in self.buffers.head_state.items():
            fields[name] = t[i]
        valid = self._valid(layer).expand(-1, self.buffers.keys.shape[2], -1)
        return HeldSlots(fields, valid, store=partial(self._store_layer_state, layer))

    def _store_layer_state(self, layer: int, state: Mapping[str, torch.Tensor]) -> None:
        i = self.group.member[layer]
        for name, t in state.items():
            if name in self.buffers.head_state:
                self.buffers.head_state[name][i] = t
            else:
                getattr(self.buffers, name)[i, :, :, : t.shape[-1]] = t
