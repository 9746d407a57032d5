"""Accumulated attention (H2O's heavy hitters): a stage that keeps state across evictions."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal

import torch
from pydantic import Field

from .attention import window_attention
from .base import EvictionInput, Scorer, StateField

_STATE = {"attention": StateField(torch.float32, 0.0)}


class AccumulatedAttentionScorer(Scorer):
    """The attention each token has received from every query since it arrived, summed.

    State: ``attention [B, Hkv, N]`` float32 per slot, 0 for a new token. Each query adds its
    softmax over the slots it saw at its own step (every held slot up to its position, its own
    included: ``window_attention(softmax_over="all")``), reduced over the ``G`` query heads of
    the KV head (``group_reduce``, default the sum). The cache feeds every query exactly once,
    so the state is H2O's accumulated score however evictions and the window fall (see
    ``docs/concepts.md``, "Stages that remember"). The score is the state.
    """

    type_name: ClassVar[str] = "accumulated_attention"
    reads_values: ClassVar[bool] = False
    reads_queries: ClassVar[bool] = True

    group_reduce: Literal["sum", "mean", "max"] = "sum"
    tile_elements: int = Field(
        1 << 20, ge=1, le=1 << 26,
        description="Logits computed per tile (performance only; results do not depend on it).",
    )

    @property
    def state_fields(self) -> Mapping[str, StateField]:
        return _STATE

    def update_state(self, inp: EvictionInput) -> Mapping[str, torch.Tensor]:
        added = new_query_attention(inp, self.group_reduce, self.tile_elements)
        return {"attention": inp.state_of(self)["attention"] + added}

    def score(self, inp: EvictionInput) -> torch.Tensor:
        return inp.state_of(self)["attention"]


def new_query_attention(
    inp: EvictionInput, group_reduce: Literal["sum", "mean", "max"], tile_elements: int
) -> torch.Tensor:
    """``[B, Hkv, N]`` float32: the softmax attention the window's new queries (``inp.query_new``)
    give each slot, over every slot each saw, reduced over a KV head's query heads (``sum``,
    ``mean`` or ``max``): what one update adds to an accumulated attention."""
    probs = window_attention(
        inp, inp.query_new.float(), softmax_over="all", group_reduce=group_reduce,
        group_reduce_at="after_softmax", tile_elements=tile_elements,
    )
    if group_reduce == "sum":
        return probs.sum(2)
    if group_reduce == "mean":
        return probs.mean(2)
    return probs.amax(2)
