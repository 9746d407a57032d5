"""A scorer shared by every KV head of a layer: one decision per layer (kvpress's ChunkKV)."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch

from .base import EvictionInput, Scorer
from .guards import run_scorer
from .spec import ScorerSpec


class SharedHeadsScorer(Scorer):
    """``scorer``'s scores summed (or averaged) over the KV heads of each row, the same scores
    for every head, so that a deterministic selector keeps the same tokens in every head:
    kvpress's ``ChunkKVPress`` sums its base press's scores so, and every head keeps one set of
    chunks.

    Slot ``j`` is combined across heads, so every head of a row must hold the same tokens: true
    as long as the policy keeps the same slots in every head (greedy or chunk selection over
    these scores, position-based reservations), and checked at every eviction
    (``EvictionInput.require_same_tokens_in_every_head``). An evicting policy whose choice is
    known to differ by head (another scorer beside it in a combination, the stochastic selector,
    a Range reservation of per-head scores, fixed per-head shares) is refused at load
    (``combines_heads``). It couples the heads (``couples_heads``), so it is
    refused under tensor parallelism.
    """

    type_name: ClassVar[str] = "shared_heads"
    reads_values: ClassVar[bool] = False

    scorer: ScorerSpec
    reduce: Literal["sum", "mean"] = "sum"

    @property
    def may_be_negative(self) -> bool:
        return self.scorer.may_be_negative

    @property
    def couples_heads(self) -> bool:
        return True

    @property
    def combines_heads(self) -> bool:
        return True

    @property
    def heads_alike(self) -> bool:
        return True

    def score(self, inp: EvictionInput) -> torch.Tensor:
        inp.require_same_tokens_in_every_head(self)
        scores = run_scorer(self.scorer, inp, where=f" (in scorer {self.type_name!r})").float()
        scores = torch.where(inp.slot_valid, scores, 0.0)
        shared = scores.sum(1, keepdim=True) if self.reduce == "sum" else scores.mean(1, keepdim=True)
        return shared.expand_as(scores).contiguous()
