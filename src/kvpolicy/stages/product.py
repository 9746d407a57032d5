"""A product of scorers, e.g. CriticalKV's ``(attention + epsilon) * ||v W_o||_1``."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from ..documents import refuse_lax_scalar
from .base import EvictionInput, Scorer
from .guards import run_scorer
from .spec import ScorerSpec


class Factor(BaseModel):
    """One factor of a product: ``scorer + offset``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _strict_scalars(cls, value: Any, info: ValidationInfo) -> Any:
        return refuse_lax_scalar(cls, info.field_name, value)

    scorer: ScorerSpec
    offset: float = Field(0.0, allow_inf_nan=False, description="Added to the scores before multiplying.")


class ProductScorer(Scorer):
    """``prod_i (score_i + offset_i)`` over its factors: one score reweighted by another."""

    type_name: ClassVar[str] = "product"
    reads_values: ClassVar[bool] = False

    factors: Annotated[list[Factor], Field(min_length=1)]

    @property
    def may_be_negative(self) -> bool:
        return any(f.offset < 0 or f.scorer.may_be_negative for f in self.factors)

    @property
    def heads_alike(self) -> bool:
        return all(f.scorer.heads_alike for f in self.factors)

    def score(self, inp: EvictionInput) -> torch.Tensor:
        total = None
        for i, factor in enumerate(self.factors):
            s = run_scorer(factor.scorer, inp, where=f" (factors[{i}] of scorer {self.type_name!r})")
            s = s + factor.offset
            total = s if total is None else total.mul_(s)
        if total is None:  # never: factors has at least one entry
            raise ValueError("a product needs at least one factor")
        return total

    def describe(self):
        return {
            "type": self.type_name,
            "factors": [{"scorer": f.scorer.describe(), "offset": f.offset} for f in self.factors],
        }
