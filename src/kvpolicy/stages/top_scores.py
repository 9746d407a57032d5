"""Reserve the top slots of a scorer, e.g. VaSE's largest value Range."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from pydantic import Field

from .base import EvictionInput, Reservation
from .guards import run_scorer
from .spec import ScorerSpec

if TYPE_CHECKING:
    from ..schedule import Schedule


class TopScoresReservation(Reservation):
    """Protects the ``n`` candidates with the largest scores of ``scorer``.

    ``n`` is a slot count (int) or a fraction of the budget (float in ``(0, 1]``; VaSE reserves
    ``budget / 4`` value-Range slots). With ``include_prior`` (VaSE: sinks counted in it), candidate
    slots already protected by earlier reservations count towards ``n``, so the stage adds
    ``n - already_protected`` slots.
    """

    type_name: ClassVar[str] = "top_scores"
    reads_values: ClassVar[bool] = False

    scorer: ScorerSpec
    n: int | float = Field(
        0.25,
        le=1 << 24,
        allow_inf_nan=False,
        description="Slots (int >= 0; at most 2**24, the largest budget) or fraction of the budget "
        "(0 < f <= 1; finite).",
    )
    include_prior: bool = True
    count_recent: bool = Field(False, description="Count the recent buffer's slots towards n.")

    def count(self, budget: int) -> int:
        if isinstance(self.n, float):
            if not 0.0 < self.n <= 1.0:
                raise ValueError(f"n as a fraction of the budget must lie in (0, 1], got {self.n}")
            return int(self.n * budget)
        if self.n < 0:
            raise ValueError(f"n must not be negative, got {self.n}")
        return self.n

    @property
    def heads_alike(self) -> bool:
        return self.scorer.heads_alike

    def reserved_count(self, budget: int) -> int:
        return self.count(budget)

    def reserved_beside(self, budget: int, recent: int) -> int:
        n = self.count(budget)
        return max(0, n - recent) if self.count_recent else n  # a full recent buffer counts towards n

    def validate_schedule(self, schedule: Schedule) -> None:
        self.count(schedule.budget)

    def reserve(self, inp: EvictionInput, protected: torch.Tensor) -> torch.Tensor:
        n = self.count(inp.budget)
        cand = inp.candidate_mask
        need = torch.full(protected.shape[:2], n, device=protected.device)
        if self.include_prior:
            need = (need - (protected & cand).sum(-1)).clamp_min(0)
        if self.count_recent:
            recent = inp.slot_valid & (torch.arange(inp.num_slots, device=cand.device) >= inp.num_candidates)
            need = (need - recent.sum(-1)).clamp_min(0)
        open_slots = cand & ~protected
        need = torch.minimum(need, open_slots.sum(-1))
        kmax = int(need.max()) if need.numel() else 0
        if kmax == 0:
            return torch.zeros_like(protected)
        scores = run_scorer(self.scorer, inp, where=f" (in reservation {self.type_name!r})")
        scores = scores.masked_fill(~open_slots, float("-inf"))
        top = scores.topk(kmax, dim=-1).indices  # [B, H, kmax]
        take = torch.arange(kmax, device=top.device) < need[..., None]
        out = torch.zeros_like(protected)
        out.scatter_(-1, top, take)
        return out
