"""A scorer divided by its largest magnitude per row and head (G-KV's normalised redundancy)."""

from __future__ import annotations

from typing import ClassVar

import torch

from .base import EvictionInput, Scorer
from .guards import run_scorer
from .spec import ScorerSpec


class NormalizedScorer(Scorer):
    """``scorer``'s scores divided, per row and KV head, by their largest magnitude over the
    valid candidates, so that terms of a ``combination`` weigh on one scale (G-KV divides R-KV's
    redundancy by its maximum before mixing it with the attention score). Order and sign are
    kept; a head whose scores are all 0 stays 0."""

    type_name: ClassVar[str] = "normalized"
    reads_values: ClassVar[bool] = False

    scorer: ScorerSpec

    @property
    def may_be_negative(self) -> bool:
        return self.scorer.may_be_negative

    @property
    def heads_alike(self) -> bool:
        return self.scorer.heads_alike

    def score(self, inp: EvictionInput) -> torch.Tensor:
        scores = run_scorer(self.scorer, inp, where=f" (in scorer {self.type_name!r})").float()
        cand = inp.candidate_mask
        scores = torch.where(cand, scores, torch.zeros_like(scores))
        top = scores.abs().amax(-1, keepdim=True)
        return scores / torch.where(top > 0, top, torch.ones_like(top))
