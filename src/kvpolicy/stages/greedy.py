"""Greedy top-k selection."""

from __future__ import annotations

from typing import ClassVar

import torch

from .base import EvictionInput, Selector


class GreedySelector(Selector):
    """Keeps the unprotected candidates with the largest scores."""

    type_name: ClassVar[str] = "greedy"
    reads_values: ClassVar[bool] = False
    priority_is_score: ClassVar[bool] = True

    def priority(self, scores: torch.Tensor | None, inp: EvictionInput) -> torch.Tensor:
        if scores is None:  # never: needs_scores is True, so the executor always passes them
            raise ValueError(f"the {self.type_name!r} selector needs scores")
        return scores
