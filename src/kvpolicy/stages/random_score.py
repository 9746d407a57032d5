"""Uniform random scores (ablation baseline)."""

from __future__ import annotations

from typing import ClassVar

import torch

from .base import EvictionInput, Scorer


class RandomScorer(Scorer):
    """Independent ``U(0, 1)`` scores from each row's eviction seed: greedy top-k over them is a
    uniformly random choice of the slots to keep."""

    type_name: ClassVar[str] = "random"
    reads_values: ClassVar[bool] = False
    stochastic: ClassVar[bool] = True

    def score(self, inp: EvictionInput) -> torch.Tensor:
        return inp.head_uniform(inp.num_slots, stream=self.type_name)
