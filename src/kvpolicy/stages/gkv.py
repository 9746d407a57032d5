"""G-KV's final score: its smoothed attention score, less its key redundancy."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from pydantic import Field

from .base import EvictionInput, Scorer
from .guards import run_scorer
from .spec import ScorerSpec

if TYPE_CHECKING:
    from ..schedule import Schedule


class GKVScorer(Scorer):
    """``mix_lambda * attention - (1 - mix_lambda) * redundancy`` (G-KV's mix, ``mix_lambda`` 0.5).

    The same sum a two-term ``combination`` computes, written with the two scorers as fields of
    their own: a stage that keeps state (``smoothed_attention``) must be reachable from the
    policy through stage-valued fields for its state to be kept, and a combination's scorers sit
    inside its ``terms`` entries, which are not stages.
    """

    type_name: ClassVar[str] = "gkv"

    attention: ScorerSpec
    redundancy: ScorerSpec
    mix_lambda: float = Field(0.5, ge=0.0, le=1.0, allow_inf_nan=False, description="Weight of the attention term.")

    def _terms(self) -> tuple[Scorer, Scorer]:
        return self.attention, self.redundancy

    @property
    def stochastic(self) -> bool:  # type: ignore[override]
        return any(t.stochastic for t in self._terms())

    @property
    def draws_per_layer(self) -> bool:  # type: ignore[override]
        return any(t.draws_per_layer for t in self._terms())

    @property
    def reads_queries(self) -> bool:  # type: ignore[override]
        return any(t.reads_queries for t in self._terms())

    @property
    def may_be_negative(self) -> bool:
        return self.mix_lambda < 1.0 or self.attention.may_be_negative

    @property
    def couples_heads(self) -> bool:
        return any(t.couples_heads for t in self._terms())

    @property
    def key_page_sizes(self) -> frozenset[int]:
        return self.attention.key_page_sizes | self.redundancy.key_page_sizes

    def validate_schedule(self, schedule: Schedule) -> None:
        for t in self._terms():
            t.validate_schedule(schedule)

    def score(self, inp: EvictionInput) -> torch.Tensor:
        where = f" ({{}} of scorer {self.type_name!r})"
        attention = run_scorer(self.attention, inp, where=where.format("attention")).float()
        redundancy = run_scorer(self.redundancy, inp, where=where.format("redundancy")).float()
        return self.mix_lambda * attention - (1.0 - self.mix_lambda) * redundancy
