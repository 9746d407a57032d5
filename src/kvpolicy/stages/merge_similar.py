"""Merge into the most similar survivor: kvpress ``MergingPress``'s rule (after D2O and Token Merging)."""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field

from .base import EvictionInput, Merge, MergeResult
from .merging import fold, nearest_kept

#: Added to the norms in the merge weight (kvpress's ``1e-6``): a zero value weighs nothing.
WEIGHT_EPS = 1e-6


class SimilarMerge(Merge):
    """Each evicted token folds into the kept token of its row and KV head whose key is most
    cosine-similar (float32; of equal similarities the lowest slot).

    Its weight is ``max(sim, 0) * |v_e| / (|v_e| + |v_t| + 1e-6)`` (value L2 norms), and it merges
    only if ``sim >= similarity_threshold`` and, when ``merge_fraction < 1``, ``sim`` reaches the
    ``1 - merge_fraction`` quantile (linear interpolation, as ``torch.quantile``) of its head's
    evicted similarities, those below the threshold counted as ``-inf`` (kvpress's rule: about
    the top ``merge_fraction`` of them). A kept value
    that some token merged into becomes ``(v_t + sum w_e v_e) / (1 + sum w_e)``; every other
    value, and every key (RoPE-safe), is unchanged. No memory of earlier merges: at a later
    eviction a slot that absorbed many tokens weighs 1 against newcomers (``d2o`` keeps weights).
    """

    type_name: ClassVar[str] = "similar"

    similarity_threshold: float = Field(
        0.0, ge=-1.0, le=1.0, allow_inf_nan=False,
        description="Least cosine similarity to merge, in [-1, 1] (weights are 0 below 0 anyway).",
    )
    merge_fraction: float = Field(
        1.0, gt=0.0, le=1.0, allow_inf_nan=False,
        description="Share of each head's evicted tokens that may merge (the most similar), in (0, 1].",
    )
    tile_elements: int = Field(
        1 << 22, ge=1, le=1 << 28,
        description="Similarities computed per tile (performance only; results do not depend on it).",
    )

    def merge(self, inp: EvictionInput, keep: torch.Tensor) -> MergeResult:
        evicted = inp.slot_valid & ~keep
        sim, target = nearest_kept(inp.keys, keep, evicted, self.tile_elements)
        merging = evicted & (sim >= self.similarity_threshold)
        if self.merge_fraction < 1.0:
            merging &= sim >= self._quantile(torch.where(merging, sim, float("-inf")), evicted)
        v = inp.values.float()
        norm = v.norm(dim=-1)
        weight = sim.clamp_min(0.0) * norm / (norm + norm.gather(-1, target) + WEIGHT_EPS)
        num, den, hit = fold(v, weight, target, merging)
        out = torch.where(hit[..., None], (v + num) / (1.0 + den[..., None]), v)
        return MergeResult(out, {})

    def _quantile(self, sim: torch.Tensor, evicted: torch.Tensor) -> torch.Tensor:
        """``[B, Hkv, 1]``: the ``1 - merge_fraction`` quantile of each head's evicted ``sim``, as
        ``torch.quantile`` computes it over them (float32 ranks, ``lerp`` between neighbours)."""
        ordered = torch.where(evicted, sim, float("inf")).sort(dim=-1).values  # evicted first, ascending
        count = evicted.sum(-1, keepdim=True)
        q = torch.tensor(1.0 - self.merge_fraction, dtype=torch.float32, device=sim.device)
        rank = q * (count - 1).clamp_min(0).float()
        below, above = rank.long(), rank.ceil().long()
        low = ordered.gather(-1, below)
        # From a -inf neighbour (a token below similarity_threshold) lerp gives NaN, which no
        # similarity reaches: the quantile there is -inf, as the interpolation tends to.
        return torch.where(torch.isneginf(low), low, low.lerp(ordered.gather(-1, above), rank - below))
