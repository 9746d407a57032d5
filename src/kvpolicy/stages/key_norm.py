"""Key norm scorer."""

from __future__ import annotations

from typing import ClassVar

import torch

from .base import EvictionInput, Scorer


class KeyNormScorer(Scorer):
    """``||K_j||_2`` per slot; with ``low_norm_first`` the *smallest* norms score highest (keys with
    low norm tend to draw the most attention, as observed in KNorm)."""

    type_name: ClassVar[str] = "key_norm"
    reads_values: ClassVar[bool] = False

    low_norm_first: bool = True

    def score(self, inp: EvictionInput) -> torch.Tensor:
        norms = inp.keys.float().norm(dim=-1)
        return -norms if self.low_norm_first else norms

    @property
    def may_be_negative(self) -> bool:
        return self.low_norm_first
