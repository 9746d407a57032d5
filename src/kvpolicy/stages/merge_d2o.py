"""D2O's token-level merge (arXiv 2406.13035): an evicted token merges into its most similar kept
token when the similarity passes a threshold kept as an exponential moving average, with
similarity-derived weights that persist per slot."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar, Literal

import torch
from pydantic import Field

from .base import EvictionInput, Merge, MergeResult, StateField
from .merging import fold, nearest_kept

_STATE = {
    "weight": StateField(torch.float32, 1.0),  # tokens each slot stands for (1: never merged into)
    "threshold": StateField(torch.float32, 0.0, per="head"),  # the moving similarity threshold
    "evictions": StateField(torch.int64, 0, per="head"),  # evictions that set it (0: none yet)
}


class D2OMerge(Merge):
    """Each evicted token ``e`` finds the kept token ``t`` of its row and KV head with the most
    cosine-similar key (``s_e``, float32; of equal ones the lowest slot).

    The threshold, per row and head: ``s_bar``, the mean of ``s_e`` over the head's evicted
    tokens at this eviction, sets it at the head's first eviction; after that ``threshold =
    ema * threshold + (1 - ema) * s_bar``. The token merges if ``s_e >= threshold`` (the updated
    one). A kept value becomes the weighted mean ``(e * m_t * v_t + sum exp(s_e) m_e v_e) / (e *
    m_t + sum exp(s_e) m_e)``: D2O's weights ``exp(s_e) / (sum exp(s) + e)``, the target weighing
    ``exp(1)`` (its similarity to itself), with ``m``, the per-slot state ``weight`` (tokens a slot
    stands for, 1 for a fresh one), so that a slot that already absorbed tokens weighs as many
    against newcomers; it grows by ``sum m_e exp(s_e - 1)``, keeping the mean's total weight.

    Keys are unchanged (RoPE-safe; D2O's paper averages keys too, which mixes rotations of
    different positions). D2O's layer-level budgets (from attention density) are not part of this
    stage: combine it with an allocation.
    """

    type_name: ClassVar[str] = "d2o"

    ema: float = Field(
        0.5, ge=0.0, lt=1.0, allow_inf_nan=False,
        description="Weight of the previous threshold in its moving average, in [0, 1).",
    )
    tile_elements: int = Field(
        1 << 22, ge=1, le=1 << 28,
        description="Similarities computed per tile (performance only; results do not depend on it).",
    )

    @property
    def state_fields(self) -> Mapping[str, StateField]:
        return _STATE

    state_updates: ClassVar[Literal["every_query", "eviction"]] = "eviction"

    def update_state(self, inp: EvictionInput) -> Mapping[str, torch.Tensor]:
        return dict(inp.state_of(self))  # the state changes only when tokens merge (``merge``)

    def merge(self, inp: EvictionInput, keep: torch.Tensor) -> MergeResult:
        state = inp.state_of(self)
        mass, threshold, evictions = state["weight"].float(), state["threshold"], state["evictions"]
        evicted = inp.slot_valid & ~keep
        sim, target = nearest_kept(inp.keys, keep, evicted, self.tile_elements)
        n_evicted = evicted.sum(-1)
        s_bar = torch.where(evicted, sim, 0.0).sum(-1) / n_evicted.clamp_min(1)
        moved = torch.where(evictions > 0, self.ema * threshold + (1.0 - self.ema) * s_bar, s_bar)
        has = (n_evicted > 0) & (keep & inp.slot_valid).any(-1)  # a head keeping nothing has nowhere to merge
        threshold = torch.where(has, moved, threshold).float()
        merging = evicted & has[..., None] & (sim >= threshold[..., None])
        weight = torch.exp(torch.where(merging, sim, 0.0)) * mass
        v = inp.values.float()
        num, den, hit = fold(v, weight, target, merging)
        own = math.e * mass
        out = torch.where(hit[..., None], (own[..., None] * v + num) / (own + den)[..., None], v)
        new_mass = torch.where(hit, mass + den / math.e, mass)
        return MergeResult(out, {"weight": new_mass, "threshold": threshold, "evictions": evictions + has.long()})
