"""Select mode: rows keep every token, and each decode step attends the slots the policy chose."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

import torch

from ..attend import attend
from ..eviction import Kept
from ..schedule import Phase
from ..selection import SELECT_GROWTH, SelectionState, page_plan, page_slots, select_capacity
from ..slots import Contiguous, StepPlan, block, gather_pages, gather_slots
from ..stages import guards
from ..stages.base import StateField
from .base import ChosenSlots, GroupState, HeldSlots, RowClass, SlotView
from .even import EvenRows


class RowPhase(NamedTuple):
    """Rows at the same point of select mode's cycle: they hold ``held`` slots, chose when they
    held ``selected_at`` (-1: never), and choose anew at this step or not (``reselect``)."""

    held: int
    reselect: bool
    selected_at: int
    rows: torch.Tensor  # host [R]


class Chooser(Protocol):
    """Select mode's choice for some rows of one layer (``Executor.choose``: the policy runs
    there, never in the layout): ``rows`` host ``[R]``, ``row_sel`` them on the device (or all),
    ``held`` their slots, ``key_pages`` their page summaries."""

    def __call__(
        self, group: Any, layer: int, rows: torch.Tensor, row_sel: slice | torch.Tensor, held: HeldSlots,
        key_pages: Mapping[int, tuple[torch.Tensor, torch.Tensor]],
    ) -> Kept: ...


class SelectRows(EvenRows):
    """Select mode: even rows that never evict (``due`` is never true; the buffers grow
    geometrically, ``select_growth``). A decode step after the prompt attends only the slots
    the policy chose for each layer (anew every ``interval`` steps, ``SelectionState``), gathered,
    so its cost is that of ``budget`` slots; a multi-token chunk attends densely.

    Keys and values are checked as they enter the cache (``admit``), not at each choice. Under a
    per-head allocation each head chooses its own count out of the layer's pool.
    """

    select: SelectionState

    def __init__(
        self, group: GroupState, keys: torch.Tensor, values: torch.Tensor, needed: int,
        state_fields: Mapping[str, StateField], *, choose: Chooser, page_sizes: frozenset[int], per_head: bool,
        growth: float = SELECT_GROWTH, page_choice: int | None = None,
    ) -> None:
        self.growth = growth
        self.page_choice = page_choice
        self.choose = choose
        self._observed: list[torch.Tensor] = []  # rows whose state a choice updated in this step
        super().__init__(group, keys, values, needed, state_fields)
        b, h = keys.shape[:2]
        self.select = SelectionState(
            len(group.layer_ids), b, h, group.schedule.budget, self.buffers.capacity, page_sizes, keys, per_head=per_head,
            page_choice=page_choice,
        )

    @classmethod
    def admit(
        cls, layer: int, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None,
        token_valid: torch.Tensor | None, window: int,
    ) -> None:
        guards.check_appended(layer, keys, values, queries, token_valid, window)

    # -- the schedule ---------------------------------------------------------------------------
    def capacity_for(self, needed: int) -> int:
        """Every token is kept: ``select_growth`` times ``needed`` (at least ``SELECT_MIN_GROWTH``
        more); under a page choice, rounded up to whole pages (a layer's buffer is then whole
        pages, read as such)."""
        capacity = select_capacity(needed, self.growth)
        if self.page_choice is not None:
            capacity = -(-capacity // self.page_choice) * self.page_choice
        return capacity

    def due(self, after: Any, tokens: Any, phase: Phase, added: Any) -> Any:
        return torch.zeros_like(after, dtype=torch.bool) if isinstance(after, torch.Tensor) else False

    def begin_step(self, t: int) -> None:
        group = self.group
        alike = group.rows.alike
        # While rows are alike, their count is one int (reading .counts would leave the fast path).
        counts = alike.held if alike is not None else group.rows.counts
        self.select.plan(t, counts, group.phase, group.schedule)

    def tokens_to_next_eviction(self) -> int:
        """How many tokens one chunk may hold and still attend exactly as step by step: chunks
        attend densely, exact up to the budget; then every decode step selects (1)."""
        return max(1, self.group.schedule.budget - int(self.group.counts.max()))

    def draw_counts(self) -> torch.Tensor:
        """The choices each row made before this step (they key its draws as evictions do)."""
        return self.select.choices

    # -- storage --------------------------------------------------------------------------------
    def write(self, i: int, new: Mapping[str, torch.Tensor], plan: StepPlan) -> None:
        """As even rows, and the page summaries of the pages written into follow."""
        super().write(i, new, plan)
        if self.select.key_pages:
            counts = None if isinstance(plan.placement, Contiguous) else self.group.rows.counts
            self.select.summarise_pages(i, self.buffers.keys[i], plan, counts)

    def grow(self, capacity: int) -> None:
        super().grow(capacity)
        self.select.grow(capacity)

    def select_rows(self, host: torch.Tensor, dev: torch.Tensor) -> None:
        super().select_rows(host, dev)
        self.select.select_rows(host, dev)

    def nbytes(self) -> int:
        """The slot buffers, the selections and the page summaries."""
        return super().nbytes() + self.select.nbytes()

    # -- reading --------------------------------------------------------------------------------
    @property
    def selecting(self) -> bool:
        """Whether this step attends a selection (a decode step after the prompt)."""
        return self.group.plan.tokens == 1 and self.group.phase == "decode"

    def attend(self, layer: int, queries: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """A decode step: attention of ``queries [B, Hq, 1, D]`` over the slots ``chosen_slots``
        gives each row, gathered (so the cost is that of ``budget`` slots)."""
        if not self.selecting:
            return super().attend(layer, queries, scaling)
        i = self.group.member[layer]
        keys, values = self.buffers.keys[i : i + 1], self.buffers.values[i : i + 1]
        out = queries.new_empty(*queries.shape[:-1], values.shape[-1])  # values may be wider than keys
        for row_sel, count, index, valid, pages, page_size, tail in self.chosen_slots(layer):
            if pages is not None:  # whole pages read as pages of the buffers, the tail's pages last
                tail_pages = torch.arange(tail // page_size, -(-count // page_size), device=pages.device)
                wanted = torch.cat([pages, tail_pages.expand(*pages.shape[:2], -1)], dim=-1)
                attended = pages.shape[-1] * page_size + count - tail  # the last page's slots past count are cut
                k, v = (gather_pages(t[0], row_sel, wanted, page_size)[:, :, :attended] for t in (keys, values))
                out[row_sel] = attend(queries[row_sel], k, v, scaling=scaling)
                continue
            k, v = block(keys, row_sel, count)[0], block(values, row_sel, count)[0]
            if index is not None:
                k, v = gather_slots(k, index), gather_slots(v, index)
            mask = None if valid is None else valid[:, :, None, :]  # per KV head (per-head allocations)
            out[row_sel] = attend(queries[row_sel], k, v, scaling=scaling, mask=mask)
        return out

    def attended(self, layer: int) -> SlotView:
        """Every held slot, of which only the chosen ones are valid at a decode step."""
        view = self.slots(layer)
        if not self.selecting:
            return view
        valid = view.valid.clone()
        for row_sel, count, index, _, pages, page_size, tail in self.chosen_slots(layer):
            if pages is not None:
                index = page_slots(pages, page_size, tail, count)
            if index is not None:  # columns past a head's count repeat a chosen slot
                valid[row_sel] = torch.zeros_like(valid[row_sel]).scatter_(-1, index, True)
        return view._replace(valid=valid)

    def chosen_slots(self, layer: int) -> list[ChosenSlots]:
        """One decode step of ``layer``: per phase of rows ``ChosenSlots(rows, held, slots,
        valid)`` (under a page choice ``ChosenSlots(rows, held, None, None, pages, P, tail)``), ``slots [R, Hkv, K]`` the slots the rows attend (the ``budget`` chosen by the
        policy plus the tokens appended since the choice), or None for rows holding ``budget``
        slots or fewer (they attend all). Under a per-head allocation heads choose different
        counts and ``valid [R, Hkv, K]`` says which columns count (else None). Rows that choose
        anew at this step run the policy on this layer's slots first; rows holding different
        counts run apart, each as it would alone."""
        group, select = self.group, self.select
        i, budget, device = group.member[layer], group.schedule.budget, self.buffers.keys.device
        out: list[ChosenSlots] = []
        for count, fresh, chosen_at, rows in self._row_phases():
            row_sel: slice | torch.Tensor = slice(None) if rows.numel() == group.batch else rows.to(device)
            if count <= budget:
                out.append(ChosenSlots(row_sel, count, None, None))
                continue
            if fresh:
                self._choose(layer, RowClass(rows, count), row_sel)
            if select.page_choice is not None:  # whole pages, then the tail (as chosen at chosen_at)
                k, first_tail = page_plan(chosen_at, budget, group.schedule.recent, select.page_choice)
                pages = select.pages[i, row_sel, :, :k]
                out.append(ChosenSlots(row_sel, count, None, None, pages, select.page_choice, first_tail))
                continue
            chosen = select.selection[i, row_sel]
            tail = torch.arange(chosen_at, count, device=device).expand(*chosen.shape[:2], -1)
            index = torch.cat([chosen, tail], dim=-1)
            valid = None
            if select.per_head:  # columns past a head's count repeat its first chosen slot
                cols = torch.arange(index.shape[-1], device=device)
                counts = select.head_counts[i, row_sel][..., None]
                valid = (cols < counts) | (cols >= chosen.shape[-1])
            out.append(ChosenSlots(row_sel, count, index, valid))
        if self._observed and group.complete:  # the step's last layer chose: every layer's state saw it
            self.settle_observed()
        return out

    def _choose(self, layer: int, rows: RowClass, row_sel: slice | torch.Tensor) -> None:
        """Run the policy on ``layer``'s slots of ``rows`` and store its choice."""
        select, count = self.select, rows.held
        i = self.group.member[layer]
        fields = {
            name: block(t[i : i + 1], row_sel, count)[0] for name, t in self.buffers.tensors() if name != "positions"
        }
        for name, t in self.buffers.head_state.items():
            fields[name] = t[i, row_sel]
        shape = (*fields["keys"].shape[:2], count)
        device = self.buffers.keys.device
        # Rows are packed and nothing is evicted: every slot is valid and slots are positions
        # (views, nothing computed).
        fields["positions"] = torch.arange(count, device=device).expand(shape)
        held = HeldSlots(fields, torch.ones((), dtype=torch.bool, device=device).expand(shape))
        key_pages = {p: (lo[i, row_sel], hi[i, row_sel]) for p, (lo, hi) in select.key_pages.items()}
        kept = self.choose(self.group, layer, rows.rows, row_sel, held, key_pages)
        if kept.state:  # the state saw this layer's new queries (the step's included) first
            self._store_state(i, row_sel, kept.state)
            self._observed.append(rows.rows)
        if kept.pages is not None:  # a page choice: its pages, the tail follows from the count
            select.pages[i, row_sel, :, : kept.pages.shape[-1]] = kept.pages
            return
        if kept.slots is None:  # per head: each head chose its own count out of the layer's pool
            assert kept.keep is not None and kept.counts is not None
            select.store_heads(i, row_sel, kept.keep, kept.counts)
            return
        select.selection[i, row_sel] = kept.slots

    def _store_state(self, i: int, row_sel: slice | torch.Tensor, state: Mapping[str, torch.Tensor]) -> None:
        where = row_sel if isinstance(row_sel, slice) else row_sel.to(self.buffers.keys.device)
        for name, t in state.items():
            if name in self.buffers.head_state:
                self.buffers.head_state[name][i, where] = t
            else:
                getattr(self.buffers, name)[i, where, :, : t.shape[-1]] = t

    def settle_observed(self) -> None:
        """Rows that chose during the last step had every layer's state brought up to date then."""
        for rows in self._observed:
            self.group.rows.mark_observed(rows)
        self._observed.clear()

    def _row_phases(self) -> list[RowPhase]:
        """Rows that share a count and a point in the cycle; one phase while every row is alike
        (the usual case)."""
        group, select = self.group, self.select
        reselect, selected_at = select.reselect, select.selected_at
        if group.batch_alike and bool((reselect == reselect[0]).all() and (selected_at == selected_at[0]).all()):
            return [RowPhase(int(group.extent_now), bool(reselect[0]), int(selected_at[0]), torch.arange(group.batch))]
        counts = group.counts
        phases = []
        for count, fresh, chosen_at in torch.stack([counts, reselect.long(), selected_at]).unique(dim=1).t().tolist():
            rows = ((counts == count) & (reselect == bool(fresh)) & (selected_at == chosen_at)).nonzero().squeeze(1)
            phases.append(RowPhase(count, bool(fresh), chosen_at, rows))
        return phases
