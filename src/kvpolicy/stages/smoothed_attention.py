"""G-KV's attention score, smoothed across compressions: a stage that keeps state."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal

import torch
from pydantic import Field

from .attention import query_attention
from .base import EvictionInput, Scorer, StateField

#: The smoothed score of each token, as of the last eviction that scored it; -1 for a token no
#: eviction has scored yet (real scores are never negative).
_STATE = {"score": StateField(torch.float32, -1.0)}


class SmoothedAttentionScorer(Scorer):
    """The window's attention to each candidate, mixed with the score it had at the previous
    eviction (G-KV's global score).

    **Local score**: each window query's softmax over every slot it can see (causally, the
    window's own tokens included), reduced over the ``G`` query heads of the KV head per query
    (``group_reduce``, default the max), averaged over the valid window queries, read on the
    candidates and, with ``normalize``, divided by its largest value over the row and head's
    candidates.

    **State** (updated once per eviction, ``state_updates = "eviction"``): ``score [B, Hkv, N]``.
    A candidate that an earlier eviction scored mixes its old score ``o`` with the local one
    ``l``: ``max(alpha * o, l)`` (``smooth: max``), ``alpha * o + (1 - alpha) * l`` (``mean``) or
    ``alpha * o + l`` (``sum``, H2O-like with ``alpha: 1``); any other candidate takes ``l``. The
    mixed score is stored, and it is the score. Slots of the recent buffer are not scored, and
    are new at the next eviction.
    """

    type_name: ClassVar[str] = "smoothed_attention"
    reads_values: ClassVar[bool] = False
    reads_queries: ClassVar[bool] = True
    state_updates: ClassVar[Literal["every_query", "eviction"]] = "eviction"

    alpha: float = Field(0.8, ge=0.0, le=1.0, allow_inf_nan=False, description="Weight of the old score, in [0, 1].")
    smooth: Literal["max", "mean", "sum"] = "max"
    normalize: bool = Field(True, description="Divide the local score by its per-head maximum over the candidates.")
    group_reduce: Literal["max", "mean"] = "max"
    tile_elements: int = Field(
        1 << 22, ge=1, le=1 << 28,
        description="Attention weights computed per tile (performance only; results do not depend on it).",
    )

    @property
    def state_fields(self) -> Mapping[str, StateField]:
        return _STATE

    def update_state(self, inp: EvictionInput) -> Mapping[str, torch.Tensor]:
        old = inp.state_of(self)["score"]
        local = self.local_scores(inp).to(old.dtype)
        seen = old >= 0
        if self.smooth == "max":
            mixed = torch.maximum(self.alpha * old, local)
        elif self.smooth == "mean":
            mixed = self.alpha * old + (1.0 - self.alpha) * local
        else:
            mixed = self.alpha * old + local
        scored = torch.where(seen, mixed, local)
        return {"score": torch.where(inp.candidate_mask, scored, old)}

    def score(self, inp: EvictionInput) -> torch.Tensor:
        score = inp.state_of(self)["score"]
        return torch.where(inp.candidate_mask, score, torch.zeros_like(score))

    def local_scores(self, inp: EvictionInput) -> torch.Tensor:
        """``[B, Hkv, N]`` float32: the local score on the candidates, 0 elsewhere."""
        b, hkv, n, _ = inp.keys.shape
        g, w = inp.group_size, inp.queries.shape[2]
        weights = inp.query_valid.to(inp.keys.device).float()
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(1.0)  # mean over valid queries
        out = torch.zeros(b, hkv, n, dtype=torch.float32, device=inp.keys.device)
        rows = max(1, self.tile_elements // max(1, hkv * g * w * n))
        for b0 in range(0, b, rows):  # bounded memory: [rows, Hkv, G, W, N] at a time
            r = slice(b0, min(b, b0 + rows))
            probs = query_attention(inp, r, group_reduce=self.group_reduce)  # [R, Hkv, W, N]
            out[r] = torch.einsum("bhwn,bw->bhn", probs, weights[r].to(probs.dtype)).float()
        cand = inp.candidate_mask
        out = torch.where(cand, out, torch.zeros_like(out))
        if self.normalize:
            top = out.amax(-1, keepdim=True)
            out = torch.where(top > 0, out / torch.where(top > 0, top, torch.ones_like(top)), out)
        return out
