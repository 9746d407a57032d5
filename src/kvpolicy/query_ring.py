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


class RingClaim(NamedTuple):
    """The ring entries a step's queries take: its last ``take = min(T, W)`` queries go to
    ``entries`` (a slice for one entry, else ``[take]`` device indices)."""

    entries: slice | torch.Tensor
    take: int


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
        """Claim the ring entries of a step's last ``min(T, W)`` queries."""
        w = self.window
        take = min(t, w)
        if take == 1:
            entries: slice | torch.Tensor = slice(self.next, self.next + 1)
        else:
            entries = (torch.arange(take, device=self.valid.device) + self.next) % w
        if take:
            self.valid[:, entries] = True if token_valid is None else token_valid[:, t - take:].to(self.valid.device)
            self.next = (self.next + take) % w
        return RingClaim(entries, take)

    def write(self, layer: int, queries: torch.Tensor, claim: RingClaim) -> None:
        """Store the last ``claim.take`` of ``queries [B, Hq, T, D]`` at the claimed entries."""
        take = claim.take
        self.queries[layer, :, :, claim.entries] = queries[:, :, queries.shape[2] - take:].to(self.queries.dtype)

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
