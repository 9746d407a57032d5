"""The KeyDiff scorer: a key is worth keeping when it points away from the others."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from kvpolicy import EvictionInput, Scorer

Anchor = Literal["normalized_mean", "mean"]


class KeyDiffScorer(Scorer):
    """Key diversity (KeyDiff): ``score_j = -cos(K_j, anchor)`` per row and KV head.

    The anchor is the mean of the valid candidate keys of the row and head: of the keys scaled
    to unit length (``normalized_mean``, the default, so long keys do not dominate the
    direction) or of the raw keys (``mean``). Keys far from the anchor are kept; keys that
    repeat the common direction are evicted first. Needs no queries and no attention weights,
    so it works with any attention kernel and a ``window`` of 0.

    Scores lie in ``[-1, 1]``; padding slots and the recent buffer score 0.
    """

    type_name: ClassVar[str] = "keydiff"

    anchor: Anchor = Field("normalized_mean", description="Mean of unit-length keys, or of raw keys.")
    eps: float = Field(
        1e-8, gt=0.0, allow_inf_nan=False, description="Added to norms so that zero keys score 0 (finite)."
    )

    @property
    def may_be_negative(self) -> bool:
        return True

    def score(self, inp: EvictionInput) -> torch.Tensor:
        return keydiff_scores(inp.keys, inp.candidate_mask, self.anchor, self.eps)


def keydiff_scores(
    keys: torch.Tensor, candidates: torch.Tensor, anchor: Anchor = "normalized_mean", eps: float = 1e-8
) -> torch.Tensor:
    """``[B, H, N, D]`` keys and ``[B, H, N]`` (or ``[B, 1, N]``) bool candidates -> ``[B, H, N]`` float32 scores.

    ``-cos(K_j, a)`` for candidate slots, with ``a`` the mean over the candidates of the row and
    head (of unit keys or raw keys); 0 elsewhere. A row without candidates scores 0 throughout.
    """
    k = keys.float()
    unit = k / (k.norm(dim=-1, keepdim=True) + eps)
    weight = candidates.to(k.dtype).expand(k.shape[:3])[..., None]  # [B, H, N, 1]
    summed = ((unit if anchor == "normalized_mean" else k) * weight).sum(2)  # [B, H, D]
    center = summed / weight.sum(2).clamp_min(1.0)
    center_unit = center / (center.norm(dim=-1, keepdim=True) + eps)
    cosine = torch.matmul(unit, center_unit[..., None]).squeeze(-1)  # [B, H, N]
    return torch.where(weight[..., 0] > 0, -cosine, torch.zeros_like(cosine))
