"""Two tiers: even rows whose evicted tokens go to a slow tier, and a recall buffer beside them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch

from ..attend import attend, attend_split
from ..eviction import Kept
from ..slots import gather_slots
from ..stages.base import StateField
from ..stages.recall import RecallInput
from ..tiers import RecallBuffer, RecallConfig, SlowTier, TierStats, recall_due
from ..tiers.slow import similar_key_order
from .base import GroupState, HeldSlots, SlotView
from .even import EvenRows


class Recaller(Protocol):
    """A recall's ranking for some rows of one layer (``Executor.recall``: the policy's recall
    scorer runs there, never in the layout): the ``k`` best page slots ``[R, Hkv, k]`` (-1 where a
    row has fewer pages) and every page slot's score ``[R, Hkv, Np]``."""

    def __call__(self, group: Any, layer: int, inp: RecallInput, k: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class TwoTierRows(EvenRows):
    """Even rows (the kept slots, evicted as the policy says) plus two tiers (``kvpolicy.tiers``).

    At each eviction the slots evicted from each head go, in pages, to the group's ``SlowTier``.
    At a decode step where a row recalls (``recall_due``), each layer's recall scorer ranks that
    row's slow-tier pages against the step's query and the ``RecallBuffer`` takes the best; the
    step then attends the recall buffer and the kept slots. Other steps (the prompt, multi-token
    chunks, steps between recalls) attend the buffer as it stands: every recalled token precedes
    them. Once a row holds slow pages, chunks are one token long (``tokens_to_next_eviction``),
    as select mode's are once it chooses.
    """

    def __init__(
        self, group: GroupState, keys: torch.Tensor, values: torch.Tensor, needed: int,
        state_fields: Mapping[str, StateField], *, recall: RecallConfig, rank: Recaller,
    ) -> None:
        super().__init__(group, keys, values, needed, state_fields)
        layers = len(group.layer_ids)
        b, h = keys.shape[:2]
        self.recall = recall
        self.rank = rank
        capacity = None if recall.capacity is None else recall.capacity // recall.page_size
        self.slow = SlowTier(layers, b, h, recall.page_size, keys, values, recall.kept_summaries, capacity, recall.drop,
                             precision=recall.summary_precision)
        self.slots_recalled = recall.slots(group.schedule)
        self.buffer = RecallBuffer(layers, b, h, self.slots_recalled, recall.page_size, keys, values)
        self._recalling: torch.Tensor | None = None  # host [R]: rows recalling at this step
        self._recalled: set[int] = set()  # buffer indices of the layers that recalled at this step

    # -- the schedule ---------------------------------------------------------------------------
    def begin_step(self, t: int) -> None:
        super().begin_step(t)
        self._recalled.clear()
        self._recalling = None
        if not self.slots_recalled or t != 1 or self.group.phase != "decode":
            return
        rows = self.group.rows
        due = recall_due(rows.seen(), self.recall.interval) & (self.slow.pages_held > 0)
        if rows.alike is None:  # a row whose token is padding recalls nothing on its (meaningless) query
            due &= rows.counts > rows.counts_before
        if bool(due.any()):
            self._recalling = due.nonzero().squeeze(1)

    def tokens_to_next_eviction(self) -> int:
        """Even rows' count, and 1 once some row holds slow-tier pages (each token then recalls on
        its own query: only a one-token chunk attends as token by token does)."""
        base = super().tokens_to_next_eviction()
        if self.slots_recalled and bool((self.slow.pages_held > 0).any()):
            return min(base, 1)
        return base

    # -- eviction -------------------------------------------------------------------------------
    def compact(self, rows: torch.Tensor, row_sel: slice | torch.Tensor, count: int, held: HeldSlots, kept: Kept) -> int:
        """Even rows' compaction, after the evicted slots (every head's, in position order) were
        copied out to the slow tier."""
        assert kept.slots is not None  # config refuses per-head counts with recall
        fields = held.fields
        keep = torch.zeros(*kept.slots.shape[:2], count, dtype=torch.bool, device=kept.slots.device)
        keep.scatter_(-1, kept.slots, True)
        evicted = (~keep).nonzero()[:, -1].view(*kept.slots.shape[:2], count - kept.slots.shape[-1])
        lead = (self.buffers.keys.shape[0], rows.numel())
        out = [gather_slots(fields[name], evicted).unflatten(0, lead) for name in ("keys", "values")]
        positions = fields["positions"].gather(-1, evicted)
        if self.recall.pages == "similar_keys" and evicted.shape[-1]:
            keys = out[0].flatten(0, 2)  # [Lyr * R * Hkv, E, D]
            order = similar_key_order(keys, self.recall.page_size).view(*evicted.shape)
            out = [gather_slots(x, order.unflatten(0, lead)) for x in out]
            positions = positions.gather(-1, order)
        positions = positions.unflatten(0, lead)
        kept_count = super().compact(rows, row_sel, count, held, kept)
        dropped = self.slow.append(rows, out[0], out[1], positions)
        if dropped is not None:
            self.buffer.forget(dropped)
        return kept_count

    # -- reading --------------------------------------------------------------------------------
    def _recall(self, layer: int, query: torch.Tensor, scaling: float | None) -> None:
        """The rows recalling at this step, on ``layer``, once: ``query [B, Hq, D]``, the step's."""
        i = self.group.member[layer]
        if self._recalling is None or i in self._recalled:
            return
        self._recalled.add(i)
        rows = self._recalling
        b, hq, d = query.shape
        hkv = self.buffers.keys.shape[2]
        row_sel: slice | torch.Tensor = slice(None) if rows.numel() == b else rows.to(query.device)
        slow = self.slow
        page_valid = slow.page_valid[i, row_sel]
        inp = RecallInput(
            queries=query[row_sel].reshape(-1, hkv, hq // hkv, d),
            summaries=slow.read_summaries(i, row_sel, self.recall.scorer.recall_summaries),
            page_valid=page_valid,
            scaling=d**-0.5 if scaling is None else scaling,
        )
        k = min(self.buffer.page_slots, slow.page_slots)
        pages, scores = self.rank(self.group, layer, inp, k)
        if slow.drop == "lowest":  # what a full tier drops first (``drop: lowest``)
            slow.page_score[i, row_sel] = scores
        if int(slow.pages_held[rows].min()) < k:  # a row with fewer pages than k: its top k hold empty slots (-inf)
            pages = torch.where(page_valid.gather(-1, pages), pages, -1)
        self.buffer.load(i, row_sel, pages, slow)

    def _newest_query(self, layer: int) -> torch.Tensor:
        """``layer``'s newest ring entry ``[B, Hq, D]`` (the step's query, once the layer wrote it)."""
        ring = self.group.ring
        return ring.queries[self.group.member[layer], :, :, (ring.next - 1) % ring.window]

    def attend(self, layer: int, queries: torch.Tensor, scaling: float | None) -> torch.Tensor:
        self._recall(layer, queries[:, :, -1], scaling)
        if not self.buffer.filled:
            return super().attend(layer, queries, scaling)
        b, hq, t, _ = queries.shape
        if t == 1:  # a decode step: the recall buffer and the kept slots, each read where it is
            plan_mask = self.group.plan.mask  # [B, 1, 1, L], or None: every kept slot real
            kept = (*self._held(layer), None if plan_mask is None else plan_mask[:, :, 0])
            return attend_split(queries, self.buffer.view(self.group.member[layer]), kept, scaling=scaling)
        keys, values, valid = self._with_recalled(layer)
        hkv = keys.shape[1]
        fast = self._fast_mask(layer, t)  # [B or 1, 1, T, L]
        recalled = valid[:, :, : self.buffer.keys.shape[3]]  # [B, Hkv, Rb]
        # One mask per query head: the recalled slots' validity differs by KV head.
        per_head = recalled.repeat_interleave(hq // hkv, dim=1)[:, :, None, :].expand(b, hq, t, -1)
        mask = torch.cat([per_head, fast.expand(b, hq, t, -1)], dim=-1)
        return attend(queries, keys, values, scaling=scaling, mask=mask)

    def _fast_mask(self, layer: int, t: int) -> torch.Tensor:
        """The kept slots' mask, ``[B or 1, 1, T, L]``: the plan's, or (every slot real, the new
        tokens last) causal by slot."""
        plan_mask = self.group.plan.mask
        length = self.group.extent(layer)
        if plan_mask is not None:
            return plan_mask
        dev = self.buffers.keys.device
        q_idx = torch.arange(t, device=dev)
        return (torch.arange(length, device=dev) <= (length - t) + q_idx[:, None])[None, None]

    def _with_recalled(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The recall buffer, then the kept slots: ``keys [B, Hkv, Rb + L, D]``, ``values`` and
        ``valid [B, Hkv, Rb + L]``."""
        i = self.group.member[layer]
        rk, rv, rvalid = self.buffer.view(i)
        if rvalid is None:
            rvalid = torch.ones(rk.shape[:3], dtype=torch.bool, device=rk.device)
        view = self.slots(layer)
        return (torch.cat([rk, view.keys], dim=2), torch.cat([rv, view.values], dim=2),
                torch.cat([rvalid, view.valid], dim=2))

    def attended(self, layer: int) -> SlotView:
        """The recall buffer's slots, then the kept slots (what ``EvictingCache.step`` hands out)."""
        self._recall(layer, self._newest_query(layer), None)
        if not self.buffer.filled:
            return self.slots(layer)
        return SlotView(*self._with_recalled(layer))

    def attended_positions(self, layer: int) -> torch.Tensor:
        """``[B, Hkv, Rb + L]`` long: the token each column of ``attended(layer)`` holds (-1: none)."""
        i = self.group.member[layer]
        return torch.cat([self.buffer.positions[i], self.positions(layer)], dim=2)

    # -- rows and bytes -------------------------------------------------------------------------
    def select_rows(self, host: torch.Tensor, dev: torch.Tensor) -> None:
        super().select_rows(host, dev)
        self.slow.select_rows(host, dev)
        self.buffer.select_rows(dev)

    def nbytes(self) -> int:
        """The fast tier: the slot buffers, the recall buffer and the slow tier's summaries."""
        return super().nbytes() + self.buffer.nbytes() + self.slow.summary_bytes()

    def held_bytes(self) -> int:
        """The kept slots held (as even rows count them), the recall buffer and the summaries of
        the pages the slow tier holds: the fast tier as the policy uses it."""
        return self.buffers.held_bytes(sum(int(self.held_counts(layer).sum()) for layer in self.group.member)) + (
            self.buffer.nbytes() + self.slow.held_summary_bytes())

    def tier_stats(self) -> TierStats:
        buffer, slow = self.buffer, self.slow
        return TierStats(
            fast_bytes=self.nbytes(), recall_bytes=buffer.nbytes(), summary_bytes=slow.summary_bytes(),
            slow_bytes=slow.slow_bytes(), moved_bytes=buffer.moved_bytes, written_bytes=slow.bytes_written,
            pages_recalled=buffer.pages_recalled, hits=buffer.hits, pages_dropped=slow.pages_dropped,
        )
