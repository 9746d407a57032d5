"""Select mode's state: each layer's current choice of slots and the page summaries of its keys.

Select mode keeps every token; each decode step attends only the slots the policy chose (anew
every ``interval`` steps). Nothing here runs a policy: the executor does.
"""

from __future__ import annotations

import torch

from .schedule import Schedule
from .slots import StepPlan


class SelectionState:
    """Per layer ``selection [Lyr, B, Hkv, budget]`` (allocated at the first choice: a cache that
    never holds more than ``budget`` slots never chooses); per row the count it held when it chose
    (``selected_at``, -1: none) and whether it chooses anew at this step (``reselect``); per
    page of ``P`` slots the per-channel min and max of each layer's keys (``key_pages``)."""

    def __init__(
        self, num_layers: int, batch: int, kv_heads: int, budget: int, capacity: int,
        page_sizes: frozenset[int], like: torch.Tensor,
    ) -> None:
        self._selection_shape = (num_layers, batch, kv_heads, budget)
        self._selection: torch.Tensor | None = None
        self._device = like.device
        self.selected_at = torch.full((batch,), -1, dtype=torch.long)
        self.reselect = torch.zeros(batch, dtype=torch.bool)
        self.key_pages: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for p in sorted(page_sizes):
            shape = (num_layers, batch, kv_heads, -(-capacity // p), like.shape[-1])
            self.key_pages[p] = (like.new_zeros(shape), like.new_zeros(shape))

    @property
    def selection(self) -> torch.Tensor:
        """``[Lyr, B, Hkv, budget]`` long: each layer's chosen slots (ascending per row and head)."""
        if self._selection is None:
            self._selection = torch.zeros(self._selection_shape, dtype=torch.long, device=self._device)
        return self._selection

    def plan(self, t: int, counts: int | torch.Tensor, tokens_seen_before: int, schedule: Schedule) -> torch.Tensor:
        """Which rows choose anew at a step of ``t`` tokens; returns the rows that chose at the
        previous step (their choice keyed that step's draws: they count as an eviction).

        A decode step of a row holding more than ``budget`` slots chooses when it has no choice
        yet or chose ``interval`` or more tokens ago; a multi-token chunk (prompt, later turn) is
        attended densely and makes the next decode step choose anew."""
        previous = self.reselect
        batch = previous.shape[0]
        if t > 1 or tokens_seen_before == 0:
            self.selected_at.fill_(-1)
            self.reselect = torch.zeros(batch, dtype=torch.bool)
            return previous
        stale = (self.selected_at < 0) | (counts - self.selected_at >= schedule.interval)
        self.reselect = (counts > schedule.budget) & stale
        self.selected_at = torch.where(self.reselect, counts, self.selected_at)
        return previous

    def grow(self, capacity: int) -> None:
        for p, (lo, hi) in list(self.key_pages.items()):
            pages = -(-capacity // p)
            grown = [t.new_zeros(*t.shape[:3], pages, t.shape[4]) for t in (lo, hi)]
            for new, old in zip(grown, (lo, hi), strict=True):
                new[:, :, :, : old.shape[3]] = old
            self.key_pages[p] = (grown[0], grown[1])

    def summarise_pages(self, i: int, keys: torch.Tensor, plan: StepPlan, counts: torch.Tensor | None) -> None:
        """Recompute layer ``i``'s page summaries over the pages this step wrote into (one page
        when decoding), from its keys ``[B, Hkv, cap, D]``. Slots past a row's count (``counts``
        ``[B]``, or None when every row holds ``plan.written_to``) are left out (+inf / -inf)."""
        for p, (lo, hi) in self.key_pages.items():
            first, last = plan.written_from // p, -(-plan.written_to // p)
            block = keys[:, :, first * p : last * p]
            pad = (last - first) * p - block.shape[2]
            slot = torch.arange(first * p, first * p + block.shape[2], device=keys.device)
            if counts is None:
                full = plan.written_to % p == 0
                empty = (slot >= plan.written_to)[None, None, :, None]
            else:
                full = False
                empty = (slot >= counts.to(keys.device)[:, None])[:, None, :, None]  # [B, 1, S, 1]
            if full and pad == 0:
                low = high = block
            else:
                low = torch.nn.functional.pad(block.masked_fill(empty, float("inf")), (0, 0, 0, pad), value=float("inf"))
                high = torch.nn.functional.pad(block.masked_fill(empty, float("-inf")), (0, 0, 0, pad), value=float("-inf"))
            lo[i, :, :, first:last] = low.unflatten(2, (last - first, p)).amin(3)
            hi[i, :, :, first:last] = high.unflatten(2, (last - first, p)).amax(3)

    def select_rows(self, host: torch.Tensor, dev: torch.Tensor) -> None:
        self.selected_at = self.selected_at[host]
        self.reselect = self.reselect[host]
        lyr, _, hkv, budget = self._selection_shape
        self._selection_shape = (lyr, host.numel(), hkv, budget)
        if self._selection is not None:
            self._selection = self._selection.index_select(1, dev)
        self.key_pages = {p: (lo.index_select(1, dev), hi.index_select(1, dev)) for p, (lo, hi) in self.key_pages.items()}

    def nbytes(self) -> int:
        chosen = [] if self._selection is None else [self._selection]
        tensors = [*chosen, *(t for pair in self.key_pages.values() for t in pair)]
        return sum(t.numel() * t.element_size() for t in tensors)
