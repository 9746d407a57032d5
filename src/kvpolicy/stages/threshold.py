"""Threshold selection: each head keeps every candidate whose score passes a threshold (DMS-style)."""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field

from .base import EvictionInput, Selector


class ThresholdSelector(Selector):
    """Keeps, per row and KV head, every candidate (a valid, unprotected slot) whose score is at
    least ``threshold``, behind the protected slots (recent buffer, reservations), which are
    always kept. The number kept is then clamped, in score order, to ``[floor, cap]``: a head
    whose passing candidates are fewer than ``floor`` keeps its ``floor`` best candidates anyway
    (all of them if it has fewer), and one with more than ``cap`` keeps its ``cap`` best.

    Counts therefore differ by head and by row, and a policy with this selector runs per head
    (``Policy.per_head``): the per-head layout holds each head's own count, and the schedule's
    ``budget`` is the pool every head's slots are sized by (``cap`` defaults to all of it: the
    budget less the protected slots). Ties at the cap are broken as every ranking is (lower slot
    first). The priority is the score itself, so what passes is the top of the ranking."""

    type_name: ClassVar[str] = "threshold"
    reads_values: ClassVar[bool] = False
    sets_counts: ClassVar[bool] = True

    threshold: float = Field(
        ..., allow_inf_nan=False, description="Candidates scoring at least this are kept (finite)."
    )
    floor: int = Field(
        0, ge=0, le=1 << 24, description="Candidates each head keeps at least, the best ones, passing or not."
    )
    cap: int | None = Field(
        None, ge=0, le=1 << 24,
        description="Candidates each head keeps at most, the best ones (default: the budget less the protected slots).",
    )

    def check_pool(self, budget: int, protected: int) -> None:
        room = budget - protected
        if self.cap is not None and self.floor > self.cap:
            raise ValueError(f"selector.floor ({self.floor}) is above selector.cap ({self.cap}): no count fits both")
        if self.cap is not None and self.cap > room:
            raise ValueError(
                f"selector.cap ({self.cap}) is above the room the budget leaves after the protected slots "
                f"({budget} - {protected} = {room}): the budget sizes each head's pool, so raise "
                f"schedule.budget to at least {protected + self.cap} or lower the cap"
            )
        if self.floor > room:
            raise ValueError(
                f"selector.floor ({self.floor}) is above the room the budget leaves after the protected slots "
                f"({budget} - {protected} = {room})"
            )

    def priority(self, scores: torch.Tensor | None, inp: EvictionInput) -> torch.Tensor:
        if scores is None:  # never: needs_scores is True, so the executor always passes them
            raise ValueError(f"the {self.type_name!r} selector needs scores")
        return scores

    def head_counts(self, priority: torch.Tensor, protected: torch.Tensor, inp: EvictionInput) -> torch.Tensor:
        finite = (priority > float("-inf")) & ~protected  # the eligible candidates
        eligible = finite.sum(-1)
        passing = (finite & (priority >= self.threshold)).sum(-1)
        n_protected = protected.sum(-1)
        room = (inp.budget - n_protected).clamp(min=0)
        cap = room if self.cap is None else room.clamp(max=self.cap)
        keep = passing.clamp(min=self.floor)
        keep = torch.minimum(torch.minimum(keep, cap), eligible)
        return n_protected + keep
