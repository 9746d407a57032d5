"""Stochastic sampling without replacement in proportion to the score (VaSE-AttnV)."""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field

from .base import EvictionInput, Selector


class StochasticSelector(Selector):
    """Samples the free slots without replacement, with probability proportional to the score.

    Implemented as Gumbel-top-k: the top ``k`` of ``log(score) / temperature + Gumbel`` is
    distributed exactly like ``k`` successive multinomial draws without replacement from
    ``score ** (1 / temperature)`` (``temperature=1``, VaSE's setting, is proportional to the
    score; ``temperature -> 0`` tends to greedy). Zero-score slots are only taken, uniformly at
    random, once every positive-score slot is kept. Scores must be non-negative.
    """

    type_name: ClassVar[str] = "stochastic"
    reads_values: ClassVar[bool] = False
    stochastic: ClassVar[bool] = True

    temperature: float = Field(1.0, gt=0.0, allow_inf_nan=False, description="A finite float above 0.")

    @property
    def heads_alike(self) -> bool:
        return False  # each head draws its own Gumbel keys

    def priority(self, scores: torch.Tensor | None, inp: EvictionInput) -> torch.Tensor:
        if scores is None:  # never: needs_scores is True, so the executor always passes them
            raise ValueError(f"the {self.type_name!r} selector needs scores")
        cand = inp.candidate_mask
        if bool((scores < 0).logical_and_(cand).any()):
            raise ValueError(
                "the stochastic selector samples in proportion to the score and needs non-negative "
                f"scores; got a minimum of {float(scores[cand].min()):.4g}"
            )
        u = inp.head_uniform(inp.num_slots, stream=self.type_name)  # in (0, 1)
        gumbel = -torch.log(-torch.log(u))
        # Positive weights: log(w) / T + Gumbel, kept above -1e38 however small T is. Zero weights:
        # uniformly random order in [-3.4e38, -1.7e38], below every positive weight (a fixed
        # floor such as -1e4 is not: log(1e-30) / 0.001 is far below it) and above -inf, which
        # marks slots that are not eligible at all.
        positive = (scores.clamp_min(1e-38).log() / self.temperature + gumbel).clamp_min_(-1e38)
        zero = u.add(1.0).mul_(torch.finfo(torch.float32).min / 2)
        return torch.where(scores > 0, positive, zero)
