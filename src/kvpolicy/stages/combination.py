"""A weighted sum of scorers, e.g. R-KV's ``lambda * attention - (1 - lambda) * redundancy``."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from ..documents import refuse_lax_scalar
from .base import EvictionInput, Scorer
from .guards import run_scorer
from .spec import ScorerSpec


class WeightedTerm(BaseModel):
    """One term of a combination: ``weight * scorer``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _strict_scalars(cls, value: Any, info: ValidationInfo) -> Any:
        return refuse_lax_scalar(cls, info.field_name, value)

    weight: float = Field(..., allow_inf_nan=False, description="A finite float (inf or nan is refused).")
    scorer: ScorerSpec


class CombinationScorer(Scorer):
    """``sum_i weight_i * score_i`` over its terms."""

    type_name: ClassVar[str] = "combination"
    reads_values: ClassVar[bool] = False

    terms: Annotated[list[WeightedTerm], Field(min_length=1)]

    @property
    def may_be_negative(self) -> bool:
        return any(t.weight < 0 or t.scorer.may_be_negative for t in self.terms)

    @property
    def heads_alike(self) -> bool:
        return all(t.scorer.heads_alike for t in self.terms)

    def score(self, inp: EvictionInput) -> torch.Tensor:
        # Each term checked on its own (a [B, N] term would broadcast in the sum; a non-finite one
        # is named), one synchronisation per term.
        total = None
        for i, term in enumerate(self.terms):
            s = run_scorer(term.scorer, inp, where=f" (terms[{i}] of scorer {self.type_name!r})") * term.weight
            total = s if total is None else total.add_(s)
        if total is None:  # never: terms has at least one entry
            raise ValueError("a combination needs at least one term")
        return total

    def describe(self):
        return {
            "type": self.type_name,
            "terms": [{"weight": t.weight, "scorer": t.scorer.describe()} for t in self.terms],
        }
