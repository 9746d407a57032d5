"""The recall buffer: the slow tier's pages brought back into the fast tier, and what it costs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .slow import SlowTier


def recall_due(tokens: torch.Tensor, interval: int) -> torch.Tensor:
    """``[B]`` bool: which rows recall at a decode step after which they have seen ``tokens [B]``
    real tokens: every ``interval``-th token (each row by its own count, so a row recalls in a
    padded batch when it would alone). The one rule of when a recall happens."""
    return tokens % interval == 0


@dataclass(frozen=True)
class TierStats:
    """A two-tier cache's tiers, summed over its layer groups (``EvictingCache.tier_stats``).

    Bytes held are the buffers' room. The fast tier holds the kept slots (``fast_bytes`` is the
    whole fast tier: kept slots, recall buffer and summaries), the slow tier the evicted pages.
    The counters run from the cache's start (``reset`` starts them again): a step's figures are
    the difference of two readings."""

    fast_bytes: int
    recall_bytes: int  # the recall buffer (in fast_bytes)
    summary_bytes: int  # the slow tier's summaries and page bookkeeping (in fast_bytes)
    slow_bytes: int
    moved_bytes: int  # copied from the slow tier into the recall buffer
    written_bytes: int  # copied from the fast tier into the slow tier (evicted pages)
    pages_recalled: int  # pages chosen by recalls, hits included
    hits: int  # chosen pages that were in the recall buffer already (nothing moved)
    pages_dropped: int  # pages a full slow tier let go for good

    def __add__(self, other: TierStats) -> TierStats:
        return TierStats(*(a + b for a, b in zip(self.astuple(), other.astuple(), strict=True)))

    def astuple(self) -> tuple[int, ...]:
        return (self.fast_bytes, self.recall_bytes, self.summary_bytes, self.slow_bytes, self.moved_bytes,
                self.written_bytes, self.pages_recalled, self.hits, self.pages_dropped)


class RecallBuffer:
    """Per layer, row and KV head, ``budget // P`` page slots of recalled tokens (``keys [Lyr, B,
    Hkv, budget, D]``, ``values``, ``positions``: -1 where none), in the fast tier, and which
    slow-tier page slot each holds (``pages [Lyr, B, Hkv, budget // P]``, -1: none).

    A recall keeps the pages it chooses again where they are (a hit moves nothing) and copies
    only the others in, into the slots of the pages it let go."""

    def __init__(
        self, layers: int, batch: int, kv_heads: int, budget: int, page_size: int, keys: torch.Tensor,
        values: torch.Tensor,
    ) -> None:
        self.page_size = page_size
        dev = keys.device
        self.keys = keys.new_zeros(layers, batch, kv_heads, budget, keys.shape[-1])
        self.values = values.new_zeros(layers, batch, kv_heads, budget, values.shape[-1])
        self.positions = torch.full((layers, batch, kv_heads, budget), -1, dtype=torch.long, device=dev)
        self.pages = torch.full((layers, batch, kv_heads, budget // page_size), -1, dtype=torch.long, device=dev)
        self.moved_bytes = 0
        self.pages_recalled = 0  # pages chosen by recalls, hits included
        self.hits = 0  # chosen pages that were in the buffer already (nothing moved)
        #: Whether any page was ever recalled (before that, attention skips the empty buffer).
        self.filled = False
        #: Per layer: whether every slot of every row holds a token (attention then masks none).
        self.full = [False] * layers

    @property
    def page_slots(self) -> int:
        return self.pages.shape[-1]

    def load(self, layer: int, rows: slice | torch.Tensor, chosen: torch.Tensor, slow: SlowTier) -> None:
        """Hold the slow tier's page slots ``chosen [R, Hkv, k]`` (-1: none) for ``rows`` of ``layer``."""
        prev = self.pages[layer, rows]  # [R, Hkv, n]
        n, p = self.page_slots, self.page_size
        if chosen.shape[-1] < n:  # fewer pages than the buffer holds: the rest stays empty
            chosen = torch.nn.functional.pad(chosen, (0, n - chosen.shape[-1]), value=-1)
        valid = chosen >= 0
        same = (chosen[..., :, None] == prev[..., None, :]) & valid[..., :, None]  # [R, Hkv, n, n]
        hit, stays = same.any(-1), same.any(-2)  # chosen pages already held; held pages chosen again
        incoming = valid & ~hit
        let_go = (prev >= 0) & ~stays
        # One synchronisation: the counters, and whether anything changes at all.
        chosen_n, hits_n, incoming_n, let_go_n = torch.stack([valid, hit, incoming, let_go]).flatten(1).sum(1).tolist()
        self.pages_recalled += chosen_n
        self.hits += hits_n
        self.filled = True
        # While the slow tier holds whole pages only, a slot holds a token iff its page slot does.
        self.full[layer] = isinstance(rows, slice) and chosen_n == valid.numel() and slow.whole_pages
        if not incoming_n and not let_go_n:  # the buffer holds just the choice
            return
        # The j-th incoming page of a head goes into its j-th slot that does not stay: both
        # ``nonzero`` lists run head by head in slot order, and hold as many entries per head.
        free = ~stays
        into = free & (free.cumsum(-1) <= incoming.sum(-1, keepdim=True))
        new_pages = torch.where(stays, prev, -1)
        source = chosen[incoming]  # [M] slow-tier page slots, head by head
        new_pages[into] = source
        self.pages[layer, rows] = new_pages
        # Slots let go and not refilled hold no token (after the load a head holds as many pages as
        # it chose, so some slot is empty only where fewer pages were chosen than the buffer holds).
        if let_go_n and chosen_n < valid.numel():
            positions = self.positions[layer, rows].unflatten(-1, (n, p))
            positions.masked_fill_((new_pages < 0)[..., None], -1)
            self.positions[layer, rows] = positions.flatten(-2)
        if not incoming_n:
            return
        r_idx, h_idx, slot = into.nonzero(as_tuple=True)
        if isinstance(rows, torch.Tensor):
            r_idx = rows[r_idx]
        b, h = slow.page_valid.shape[1:3]
        head = (layer * b + r_idx) * h + h_idx  # [M] flat (layer, row, head)
        keys, values, pos = slow.gather(head * slow.page_slots + source)
        dev, nonblocking = self.keys.device, keys.is_pinned()
        dest = head * n + slot
        self.keys.view(-1, p, keys.shape[-1]).index_copy_(0, dest, keys.to(dev, non_blocking=nonblocking))
        self.values.view(-1, p, values.shape[-1]).index_copy_(0, dest, values.to(dev, non_blocking=nonblocking))
        self.positions.view(-1, p).index_copy_(0, dest, pos.to(dev, non_blocking=nonblocking))
        slow.copied_out()
        self.moved_bytes += incoming_n * p * (keys.shape[-1] * keys.element_size()
                                              + values.shape[-1] * values.element_size() + pos.element_size())

    def forget(self, dropped: torch.Tensor) -> None:
        """Let go of the pages a full slow tier dropped (``dropped [Lyr, B, Hkv, Np]`` bool)."""
        held = self.pages >= 0
        gone = dropped.gather(-1, self.pages.clamp(min=0)) & held
        if not bool(gone.any()):
            return
        self.full = [False] * len(self.full)
        self.pages.masked_fill_(gone, -1)
        self.positions.masked_fill_(gone.repeat_interleave(self.page_size, dim=-1), -1)

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``layer``'s recalled ``keys [B, Hkv, budget, D]``, ``values`` and ``valid`` (bool; None:
        every slot holds a token)."""
        return self.keys[layer], self.values[layer], None if self.full[layer] else self.positions[layer] >= 0

    def select_rows(self, dev: torch.Tensor) -> None:
        self.full = [False] * len(self.full)
        self.keys, self.values, self.positions, self.pages = (
            t.index_select(1, dev) for t in (self.keys, self.values, self.positions, self.pages))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.positions, self.pages))
