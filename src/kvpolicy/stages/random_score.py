"""Uniform random scores (ablation baseline)."""

from __future__ import annotations

from typing import ClassVar

import torch

from .base import EvictionInput, Scorer


class RandomScorer(Scorer):
    """Independent ``U(0, 1)`` scores from the eviction's generator: greedy top-k over them is a
    uniformly random choice of the slots to keep."""

    type_name: ClassVar[str] = "random"
    stochastic: ClassVar[bool] = True

    def score(self, inp: EvictionInput) -> torch.Tensor:
        device = inp.generator.device if inp.generator is not None else torch.device("cpu")
        shape = (inp.batch, inp.num_kv_heads, inp.num_slots)
        return torch.rand(shape, generator=inp.generator, device=device).to(inp.keys.device)
