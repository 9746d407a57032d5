"""G-KV's final score: its smoothed attention score, less its key redundancy."""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field

from .base import EvictionInput, Scorer
from .guards import run_scorer
from .spec import ScorerSpec


class GKVScorer(Scorer):
    """``mix_lambda * attention - (1 - mix_lambda) * redundancy`` (G-KV's mix, ``mix_lambda`` 0.5).

    The same sum as a ``combination`` with weights ``mix_lambda`` and ``-(1 - mix_lambda)``
    (``tests/test_gkv.py`` checks that both keep the same slots, state included), kept as a stage
    of its own so that G-KV's policy file names the paper's one hyperparameter.
    """

    type_name: ClassVar[str] = "gkv"
    reads_values: ClassVar[bool] = False

    attention: ScorerSpec
    redundancy: ScorerSpec
    mix_lambda: float = Field(0.5, ge=0.0, le=1.0, allow_inf_nan=False, description="Weight of the attention term.")

    @property
    def may_be_negative(self) -> bool:
        return self.mix_lambda < 1.0 or self.attention.may_be_negative

    def score(self, inp: EvictionInput) -> torch.Tensor:
        where = f" ({{}} of scorer {self.type_name!r})"
        attention = run_scorer(self.attention, inp, where=where.format("attention")).float()
        redundancy = run_scorer(self.redundancy, inp, where=where.format("redundancy")).float()
        return self.mix_lambda * attention - (1.0 - self.mix_lambda) * redundancy
