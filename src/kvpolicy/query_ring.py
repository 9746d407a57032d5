"""The window of recent post-RoPE queries that attention scorers read: a ring per layer.

``time_order`` is the one rule of reading a ring oldest first, for a cache's layer group
(``QueryRing``) and for vLLM's per-request rings (``kvpolicy.vllm.requests.RequestQueryRing``)."""

from __future__ import annotations

from typing import NamedTuple

import torch


def time_order(next_entry: int | torch.Tensor, window: int, device: torch.device | None = None) -> torch.Tensor:
    """The entries of a ``window``-entry ring written in turn, oldest first, when ``next_entry``
    is the one written next (the oldest): ``[W]`` long for an int, ``[R, W]`` for ``[R]`` rings.
    A ring written one entry per token has ``next_entry = tokens % window``."""
    steps = torch.arange(window, device=device)
    if isinstance(next_entry, torch.Tensor):
        return (next_entry.to(steps.device)[:, None] + steps) % window
    return (steps + next_entry) % window


def filled(tokens: torch.Tensor, window: int) -> torch.Tensor:
    """``[R, W]`` bool: which entries, oldest first (``time_order``), of rings written one entry
    per token hold a query after ``tokens [R]`` tokens (the newest ``min(tokens, W)``)."""
    return tokens[:, None] - window + torch.arange(window, device=tokens.device) >= 0


class Repack(NamedTuple):
    """One row's window after a step whose padding would leave a hole in it: ring ``entries``
    ``[k]`` (its newest ``k``, oldest first) take ``sources`` ``[k]``, an old entry ``e`` as ``e``
    and the step's query ``i`` as ``W + i``."""

    row: int
    entries: torch.Tensor
    sources: torch.Tensor


class RingClaim(NamedTuple):
    """The ring entries a step's queries take: its last ``take = min(T, W)`` queries go to
    ``entries`` (a slice for one entry, else ``[take]`` device indices); rows whose padding came
    after real queries are rewritten whole (``repacks``)."""

    entries: slice | torch.Tensor
    take: int
    repacks: tuple[Repack, ...] = ()


class QueryRing:
    """The last ``W`` queries of every layer of a group, ``[Lyr, B, Hq, W, D]``, and which ring
    entries hold a real query (``[B, W]``, shared by the layers: they see the same tokens)."""

    def __init__(self, num_layers: int, batch: int, query_heads: int, window: int, like: torch.Tensor) -> None:
        self.queries = like.new_zeros(num_layers, batch, query_heads, window, like.shape[-1])
        self.valid = torch.zeros(batch, window, dtype=torch.bool, device=like.device)
        self.next = 0

    @property
    def window(self) -> int:
        return self.queries.shape[3]

    def advance(self, t: int, token_valid: torch.Tensor | None) -> RingClaim:
        """Claim the ring entries of a step's last ``min(T, W)`` queries.

        The entries are shared by the rows, so a padding query takes one too, marked invalid. A
        row's window must hold its last ``W`` real queries, as it would alone: where padding
        comes after real queries (a padding token mid-decode, padding inside a chunk), the
        step's hole would push a real query out, so that row's window is rewritten whole
        (``Repack``), its real queries oldest first at the newest entries."""
        w = self.window
        take = min(t, w)
        if take == 1:
            entries: slice | torch.Tensor = slice(self.next, self.next + 1)
        else:
            entries = (torch.arange(take, device=self.valid.device) + self.next) % w
        if not take:
            return RingClaim(entries, take)
        repacks: tuple[Repack, ...] = ()
        if token_valid is not None:
            real = token_valid.to(self.valid.device)
            old = self.valid.index_select(1, time_order(self.next, w, self.valid.device))  # [B, W] oldest first
            joined = torch.cat([old, real], dim=1)  # [B, W + T]: the row's queries, oldest first
            # The shared entries leave the row joined's last W, holes included; alone it keeps its
            # last min(W, real) real queries, at the newest entries.
            real_count = joined.sum(dim=1, keepdim=True).clamp_max(w)
            alone = torch.arange(w, device=joined.device) >= w - real_count  # [B, W]
            rows = (joined[:, -w:] != alone).any(dim=1).nonzero().flatten().tolist()
            repacks = tuple(self._repack(r, joined[r], take) for r in rows)
            self.valid[:, entries] = real[:, t - take:]
        else:
            self.valid[:, entries] = True
        self.next = (self.next + take) % w
        for repack in repacks:
            self.valid[repack.row] = False
            self.valid[repack.row, repack.entries] = True
        return RingClaim(entries, take, repacks)

    def _repack(self, row: int, joined: torch.Tensor, take: int) -> Repack:
        """``row``'s window after the step: its last ``W`` real queries of ``joined [W + T]``
        (the old window oldest first, then the step's queries), at the newest entries."""
        w = self.window
        kept = joined.nonzero().flatten()[-w:]  # positions in joined, oldest first
        old_order = time_order(self.next, w, joined.device)
        sources = torch.where(kept < w, old_order[kept.clamp_max(w - 1)], kept)  # old entry, or W + query
        new_order = time_order((self.next + take) % w, w, joined.device)
        return Repack(row, new_order[w - kept.numel():], sources)

    def write(self, layer: int, queries: torch.Tensor, claim: RingClaim) -> None:
        """Store the last ``claim.take`` of ``queries [B, Hq, T, D]`` at the claimed entries."""
        take = claim.take
        if not claim.repacks:  # every row alike: one write (the decode fast path)
            self.queries[layer, :, :, claim.entries] = queries[:, :, queries.shape[2] - take:].to(self.queries.dtype)
            return
        ring = self.queries[layer]  # [B, Hq, W, D]
        olds = [ring[r.row].clone() for r in claim.repacks]  # before the claimed entries are written over
        ring[:, :, claim.entries] = queries[:, :, queries.shape[2] - take:].to(self.queries.dtype)
        for repack, old in zip(claim.repacks, olds, strict=True):
            both = torch.cat([old, queries[repack.row].to(old.dtype)], dim=1)  # [Hq, W + T, D]
            ring[repack.row, :, repack.entries] = both.index_select(1, repack.sources.to(both.device))

    def windows(self, layers: slice, rows: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The windows of ``layers`` and ``rows``, stacked layer-major on the batch axis, in time
        order: ``[Lyr * R, Hq, W, D]`` and ``[Lyr * R, W]``."""
        order = time_order(self.next, self.window, self.valid.device)
        ring = self.queries[layers][:, rows].index_select(3, order)
        valid = self.valid[rows].index_select(1, order)
        return ring.flatten(0, 1), valid.repeat(ring.shape[0], 1)

    def select_rows(self, index: torch.Tensor) -> None:
        self.queries = self.queries.index_select(1, index)
        self.valid = self.valid.index_select(0, index)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.queries, self.valid))
