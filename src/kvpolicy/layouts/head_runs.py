"""Per-head runs: heads of a row holding different numbers of slots (``kvpolicy.heads``)."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

import torch

from ..attend import attend_heads
from ..eviction import Kept
from ..heads import HeadLayout
from ..slots import Contiguous, StepPlan
from ..stages.base import StateField
from .base import GroupState, HeldSlots, RowClass, SlotView
from .even import EvenRows


class HeadRuns(EvenRows):
    """A per-head allocation (Ada-KV, head profiles): after an eviction each head of a row keeps
    its own count, and each row's ``[Hkv, cap]`` slots are read as one flat run, head after head
    (``HeadLayout``: every flat address is computed there).

    Until the first eviction every head holds the row's tokens (``heads.even``): the memory is
    then the even layout's slot for slot, and the even rows' code runs (called as
    ``EvenRows.method(self, ...)``: one call less than ``super()`` on the decode path).
    """

    heads: HeadLayout

    def __init__(
        self, group: GroupState, keys: torch.Tensor, values: torch.Tensor, needed: int,
        state_fields: Mapping[str, StateField],
    ) -> None:
        super().__init__(group, keys, values, needed, state_fields)
        self.heads = HeadLayout(len(group.layer_ids), keys.shape[0], keys.shape[1], keys.device)

    def _counts(self, layer: int) -> torch.Tensor | int:
        """Each row's count on ``layer`` (``[B]`` host), or one int while rows are alike."""
        group = self.group
        alike = group.rows.alike  # while rows are alike their count is one int (the fast path stays)
        if alike is not None:
            return alike.held if group.written(layer) else alike.before
        return group.counts_of(layer)

    def held_counts(self, layer: int) -> torch.Tensor:
        """Each head's own count: the row's less the head's deficit."""
        if self.heads.even:
            return EvenRows.held_counts(self, layer)
        return self.group.counts_of(layer)[:, None] - self.heads.deficit[self.group.member[layer]].cpu()

    # -- storage --------------------------------------------------------------------------------
    def write(self, i: int, new: Mapping[str, torch.Tensor], plan: StepPlan) -> None:
        """Row slot ``s`` of head ``h`` goes to flat slot ``shift[h] + s``."""
        if self.heads.even:
            EvenRows.write(self, i, new, plan)
            return
        buffers, place, cap = self.buffers, plan.placement, self.buffers.capacity
        if isinstance(place, Contiguous):  # every row appends the same slots: one index for all
            where = self.heads.append_index(cap, i, place.start, plan.tokens)
            for name, x in new.items():
                getattr(buffers, name)[i].flatten(0, 2).index_copy_(0, where, x.flatten(0, 2))
        else:
            at = self.heads.scatter_index(cap, i, place.rows, place.slots)  # [nnz, Hkv]
            for name, x in new.items():
                getattr(buffers, name)[i].flatten(1, 2)[place.rows[:, None], at] = x[place.rows, :, place.cols]

    def grow(self, capacity: int) -> None:
        """Each head's run grows by ``capacity - cap`` slots: head ``h``'s slots move by
        ``h * (capacity - cap)``."""
        if self.heads.even:
            EvenRows.grow(self, capacity)
            return
        buffers = self.buffers
        # held(): growing inside a step planned on the rows' fast path must not leave it
        move = self.heads.regrown(buffers.capacity, capacity, self.group.rows.held())
        for name, old in buffers.tensors():
            new = buffers.empty(name, capacity)
            move.apply(old, new)
            buffers.replace(name, new)

    def materialise_positions(self) -> None:
        """As the even rows', at each head's flat slots (slots past a count are not reset)."""
        if self.heads.even:
            EvenRows.materialise_positions(self)
            return
        rows, dev, cap = self.group.rows, self.buffers.keys.device, self.buffers.capacity
        first, last = int(rows.stored.min()), int(rows.counts.max())
        row_slot = torch.arange(first, last, device=dev)
        stored, counts = rows.stored.to(dev)[:, None], rows.counts.to(dev)[:, None]
        needed = (row_slot >= stored) & (row_slot < counts)  # [B, n]
        derived = row_slot + (rows.tokens.to(dev)[:, None] - counts)
        where = self.heads.runs_index(cap, row_slot)  # [Lyr, B, Hkv, n]
        mask = needed[None, :, None, :].expand_as(where)
        lyr, row, _, col = mask.nonzero(as_tuple=True)
        self.buffers.positions.flatten(2, 3)[lyr, row, where[mask]] = derived[row, col]

    def select_rows(self, host: torch.Tensor, dev: torch.Tensor) -> None:
        super().select_rows(host, dev)
        self.heads.select_rows(dev)

    # -- reading --------------------------------------------------------------------------------
    def attend(self, layer: int, queries: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """Each head's own slots, read in place through ``HeadLayout.band`` (``attend_heads``)."""
        if self.heads.even:
            return EvenRows.attend(self, layer, queries, scaling)
        group, plan = self.group, self.group.plan
        place = plan.placement
        if not isinstance(place, Contiguous):
            sees: torch.Tensor | None = place.sees  # a padded step: each query's own visible row slots
        elif plan.tokens == 1:
            sees = None  # a decode step sees every held slot
        else:
            sees = (torch.arange(plan.tokens, device=self.buffers.keys.device) + place.start + 1).expand(plan.batch, -1)
        i = group.member[layer]
        index, mask = self.heads.band(self.buffers.capacity, i, self._counts(layer), sees)
        keys, values = self.buffers.keys[i].flatten(0, 2), self.buffers.values[i].flatten(0, 2)
        return attend_heads(queries, keys, values, index, mask, scaling=scaling)

    def _gathered(self, layer: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Copies of ``layer``'s per-slot buffers ``[B, Hkv, N, ...]`` with each head's slots
        right-aligned in ``N`` columns (its fullest head), and their ``[B, Hkv, N]`` validity.
        The newest slots are the last columns of every head; empty columns hold zeros (positions:
        their ``fill``, -1)."""
        i, cap = self.group.member[layer], self.buffers.capacity
        counts = self.group.counts_of(layer)
        self.group.materialise_positions()
        flat, valid = self.heads.slots(cap, counts, self.heads.width(counts), layers=slice(i, i + 1))
        flat, valid = flat[0], valid[0]
        out = {}
        for name, t in self.buffers.tensors():
            src = t[i].flatten(1, 2)
            if src.dim() == 2:  # one number per slot (positions)
                fill = self.buffers.fill[name]
                out[name] = torch.gather(src, 1, flat.flatten(1)).view(flat.shape).masked_fill(~valid, fill)
            else:
                out[name] = (torch.gather(src, 1, flat.flatten(1)[..., None].expand(-1, -1, src.shape[-1]))
                             .view(*flat.shape, -1) * valid[..., None])
        return out, valid

    def slots(self, layer: int) -> SlotView:
        """Copies with each head's slots right-aligned in as many columns as its fullest head
        holds (``attend`` reads in place)."""
        if self.heads.even:
            return EvenRows.slots(self, layer)
        fields, valid = self._gathered(layer)
        return SlotView(fields["keys"], fields["values"], valid)

    def positions(self, layer: int) -> torch.Tensor:
        if self.heads.even:
            return EvenRows.positions(self, layer)
        return self._gathered(layer)[0]["positions"]

    # -- eviction -------------------------------------------------------------------------------
    def eviction_classes(self, due: torch.Tensor) -> list[RowClass]:
        """The policy sees each row's heads right-aligned in as many columns as its fullest head
        holds: rows are grouped by that width as well as by count, so that a row's view, and so
        its random draws, are those it has alone."""
        counts = self.group.counts
        fullest = counts + self.heads.surplus().amax(0)
        classes = torch.stack([counts, fullest], 1)[due].unique(dim=0)
        return [
            RowClass((due & (counts == count) & (fullest == width)).nonzero().squeeze(1), count)
            for count, width in classes.tolist()
        ]

    def compact(self, rows: torch.Tensor, row_sel: slice | torch.Tensor, count: int, held: HeldSlots, kept: Kept) -> int:
        """The new state written to the slots it was read from, then each head's ``counts[h]``
        kept slots moved to the rows' new runs (``HeadLayout.compaction``); the rows then hold
        ``budget`` (a head keeping fewer, under a threshold, holds ``budget - deficit``)."""
        heads, buffers, group = self.heads, self.buffers, self.group
        assert kept.keep is not None and kept.counts is not None  # per-head runs: a per-head allocation
        n_layers, n_rows, hkv = buffers.keys.shape[0], rows.numel(), buffers.keys.shape[2]
        if held.address is None:  # read as even rows (before the first eviction): address them per head
            held = self._picked(rows, row_sel, count, fields=held.fields)
        flat = held.address
        assert held.store is not None  # _picked always says how to store
        held.store(kept.writes)  # the new state, and merged values where the policy merges
        # The rows hold the budget (every head's pool): a per-head allocation's counts add up to
        # Hkv * budget, a threshold's to less (each head's count below it is carried as its deficit).
        budget = min(count, self.group.schedule.budget)
        keep = kept.keep.view(n_layers, n_rows, hkv, flat.shape[-1])
        row_of = torch.arange(group.batch, device=flat.device)[row_sel]
        move = heads.compaction(buffers.capacity, budget, flat, keep, row_of)
        for _, t in buffers.tensors():
            move.apply(t, t)
        heads.set_deficit(slice(None), row_sel, budget - kept.counts.view(n_layers, n_rows, hkv))
        return budget

    # -- state ----------------------------------------------------------------------------------
    def _picked(
        self, rows: torch.Tensor, row_sel: slice | torch.Tensor, count: int,
        fields: Mapping[str, torch.Tensor] | None = None,
    ) -> HeldSlots:
        """``gather_rows`` with each column's flat slot ``[Lyr, R, Hkv, N]`` as its ``address``
        (``fields``: already read, only the addresses are wanted)."""
        heads, buffers, group = self.heads, self.buffers, self.group
        cap = buffers.capacity
        n_layers, n_rows, hkv = buffers.keys.shape[0], rows.numel(), buffers.keys.shape[2]
        counts = torch.full((n_rows,), count, dtype=torch.long)
        flat, valid = heads.slots(cap, counts, heads.width(counts, row_sel), rows=row_sel)  # [Lyr, R, Hkv, N]
        slot_valid = valid.flatten(0, 1)
        store = partial(self._store_picked, row_sel, flat, slot_valid)
        if fields is not None:
            return HeldSlots(fields, slot_valid, flat, store)
        width = flat.shape[-1]
        row_of = torch.arange(group.batch, device=flat.device)[row_sel]
        lyr = torch.arange(n_layers, device=flat.device)[:, None, None]
        picked = {}
        for name, t in buffers.tensors():
            src = t.flatten(2, 3)[lyr, row_of[None, :, None], flat.flatten(2)]  # [Lyr, R, Hkv * N, ...]
            picked[name] = src.view(n_layers, n_rows, hkv, width, *t.shape[4:]).flatten(0, 1)
        for name, t in buffers.head_state.items():
            picked[name] = t[:, row_sel].flatten(0, 1)
        picked["positions"] = picked["positions"].masked_fill(~slot_valid, -1)
        return HeldSlots(picked, slot_valid, flat, store)

    def _store_picked(
        self, row_sel: slice | torch.Tensor, flat: torch.Tensor, slot_valid: torch.Tensor,
        state: Mapping[str, torch.Tensor],
    ) -> None:
        """Write state read through ``_picked`` back to the flat slots it came from (valid
        columns only: an empty column's address may hold another head's token)."""
        buffers = self.buffers
        valid = slot_valid.view(flat.shape)
        lyr, r, h, c = valid.nonzero(as_tuple=True)
        row_of = torch.arange(self.group.batch, device=flat.device)[row_sel]
        for name, t in state.items():
            if name in buffers.head_state:
                where = row_sel if isinstance(row_sel, slice) else row_sel.to(t.device)
                buffers.head_state[name][:, where] = t.view(*flat.shape[:3])
                continue
            dst = getattr(buffers, name).flatten(2, 3)
            dst[lyr, row_of[r], flat[lyr, r, h, c]] = t.view(*flat.shape, *t.shape[3:])[lyr, r, h, c]

    def gather_rows(self, rows: torch.Tensor, row_sel: slice | torch.Tensor, count: int) -> HeldSlots:
        if self.heads.even:
            return EvenRows.gather_rows(self, rows, row_sel, count)
        return self._picked(rows, row_sel, count)

    def gather_layer(self, layer: int) -> HeldSlots:
        if self.heads.even:
            return EvenRows.gather_layer(self, layer)
        fields, valid = self._gathered(layer)
        i = self.group.member[layer]
        for name, t in self.buffers.head_state.items():
            fields[name] = t[i]
        return HeldSlots(fields, valid, store=partial(self._store_layer_state, layer))

    def _store_layer_state(self, layer: int, state: Mapping[str, torch.Tensor]) -> None:
        if self.heads.even:
            EvenRows._store_layer_state(self, layer, state)
            return
        i, cap = self.group.member[layer], self.buffers.capacity
        counts = self.group.counts_of(layer)
        flat, valid = self.heads.slots(cap, counts, self.heads.width(counts), layers=slice(i, i + 1))
        flat, valid = flat[0], valid[0]  # [B, Hkv, N]
        b, h, c = valid.nonzero(as_tuple=True)
        for name, t in state.items():
            if name in self.buffers.head_state:
                self.buffers.head_state[name][i] = t
            else:
                getattr(self.buffers, name)[i].flatten(1, 2)[b, flat[b, h, c]] = t[b, h, c]
