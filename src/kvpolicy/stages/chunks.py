"""Whole chunks of neighbouring tokens, kept by their summed score (ChunkKV)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from pydantic import Field

from .base import EvictionInput, Selector

if TYPE_CHECKING:
    from ..schedule import Schedule


class ChunkSelector(Selector):
    """Ranks chunks of ``chunk_size`` consecutive tokens by the sum of their slots' scores and
    keeps whole chunks, best first (ChunkKV, arXiv 2502.00299, Alg. 1).

    Chunks are fixed spans of token positions (``positions // chunk_size``), so a chunk is the
    same tokens at every eviction, whatever was evicted before it. A chunk's score is the sum of
    the scores of its valid candidate slots (recent-buffer slots are never candidates, so a chunk
    that straddles the buffer is scored on its older part). Every slot of a chunk gets a priority
    from one ranking: chunks by summed score (ties: the earlier chunk), then, inside a chunk, its
    slots by their own score (ties: the lower slot). Priorities are ranks, exact in float32, so the
    executor, which keeps the top priorities until the budget is full, takes whole chunks in order;
    the slots left over at the budget edge (fewer than a chunk) go to the best-scored slots of the
    next chunk. The selector does not see which slots reservations protect: their scores count in
    their chunk's sum like any other candidate's.
    """

    type_name: ClassVar[str] = "chunks"
    reads_values: ClassVar[bool] = False

    chunk_size: int = Field(
        10, ge=1, le=1 << 24, description="Tokens per chunk (ChunkKV's robust default: 10); at most the "
        "budget's candidate slots (budget - recent).",
    )

    def validate_schedule(self, schedule: Schedule) -> None:
        self._check_room(schedule.budget, schedule.recent)

    def _check_room(self, budget: int, recent: int) -> None:
        room = budget - recent
        if self.chunk_size > room:
            raise ValueError(
                f"selector.chunk_size ({self.chunk_size}) is larger than the slots the budget leaves "
                f"to chunks (budget {budget} - recent {recent} = {room}): not one whole chunk could be kept"
            )

    def priority(self, scores: torch.Tensor | None, inp: EvictionInput) -> torch.Tensor:
        if scores is None:  # never: needs_scores is True, so the executor always passes them
            raise ValueError(f"the {self.type_name!r} selector needs scores")
        # Every layer's schedule passed validate_schedule; this catches a budget given to Policy.select_heads.
        self._check_room(inp.budget, inp.num_slots - inp.num_candidates)
        b, h, n = scores.shape
        cand = inp.candidate_mask
        big = torch.iinfo(torch.long).max
        chunk = torch.where(cand, inp.positions.div(self.chunk_size, rounding_mode="floor"), big)
        token = torch.where(cand, scores.double(), 0.0)
        # Number the chunks of each row and head 0, 1, ... (ascending chunk id; non-candidates last).
        ids, by_id = chunk.sort(dim=-1, stable=True)
        seg = torch.zeros_like(ids)
        seg[..., 1:] = (ids[..., 1:] != ids[..., :-1]).long().cumsum(-1)
        segment = torch.empty_like(seg).scatter_(-1, by_id, seg)
        total = torch.zeros(b, h, n, dtype=torch.float64, device=scores.device).scatter_add_(-1, segment, token)
        chunk_score = torch.where(cand, total.gather(-1, segment), float("-inf"))
        # One ranking from stable sorts, least significant key first: slot, token score, chunk, chunk score.
        order = torch.arange(n, device=scores.device).expand(b, h, n)
        for key, descending in ((token, True), (segment, False), (chunk_score, True)):
            order = order.gather(-1, key.gather(-1, order).sort(dim=-1, stable=True, descending=descending).indices)
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(n, device=scores.device).expand(b, h, n))
        return (n - rank).float()
