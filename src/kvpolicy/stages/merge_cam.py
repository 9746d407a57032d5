"""CaM (cache merging, ICML 2024; kvpress ``CAMPress``): an evicted token's value folded into the
kept tokens that follow it, under a Bernoulli draw from its accumulated attention."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal

import torch
from pydantic import Field

from .accumulated_attention import new_query_attention
from .base import EvictionInput, Merge, MergeResult, StateField

_STATE = {"attention": StateField(torch.float32, 0.0)}


class CamMerge(Merge):
    """Each evicted token ``i`` may merge into its window: the ``merge_budget`` kept slots of its
    row and KV head that follow it in position order (fewer near the end; none: no merge).

    It merges with probability ``p_i = clamp(A_i / mean(A over the window), 0, 1)`` (``A``: the
    attention each token has accumulated, this stage's state, as ``accumulated_attention`` sums
    it; NaN counts as 0, inf as 1), and then adds ``v_i / |window|`` to every value of the window.
    Keys are unchanged (RoPE-safe); slots nothing merged into keep their values exactly.

    Departures from kvpress's ``CAMPress``, by design: the Bernoulli draws come from each row's
    seeded stream (``inp.head_uniform``, stream ``"cam"``), not from torch's global generator, so a
    row's merges are reproducible and independent of the batch; every token the eviction drops
    is a candidate (kvpress takes the ``k`` highest-scoring evicted, ``k`` the tokens added since
    the last compression, which on a schedule of evictions every ``interval`` tokens is all of
    them); and each KV head merges over its own kept set (kvpress averages the scores over the
    heads so that all keep the same slots; a policy with a head-shared scorer does the same).
    ``A`` counts every query the state has seen, prompt queries included.
    """

    type_name: ClassVar[str] = "cam"
    stochastic: ClassVar[bool] = True
    reads_queries: ClassVar[bool] = True

    merge_budget: int = Field(32, ge=1, le=1 << 20, description="Kept slots each evicted token merges into (>= 1).")
    #: How a KV head's query heads combine (kvpress's CAMPress averages them).
    group_reduce: Literal["sum", "mean", "max"] = "mean"
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

    def merge_probability(self, inp: EvictionInput, keep: torch.Tensor) -> torch.Tensor:
        """``[B, Hkv, N]`` float32: each evicted slot's merge probability (0 elsewhere)."""
        return self._windows(inp, keep)[2]

    def merge(self, inp: EvictionInput, keep: torch.Tensor) -> MergeResult:
        u = inp.head_uniform(inp.num_slots, stream=self.type_name)  # [B, Hkv, N] in (0, 1)
        values = self.merge_with(inp, keep, u < self.merge_probability(inp, keep))
        return MergeResult(values, {"attention": inp.state_of(self)["attention"]})

    def merge_with(self, inp: EvictionInput, keep: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
        """The merged values ``[B, Hkv, N, Dv]`` float32 when ``draws [B, Hkv, N]`` bool says which
        evicted slots merge (their Bernoulli outcomes; read on evicted slots with a window only):
        the draw is the only random part, so a test may hand it kvpress's mask."""
        b, h, n, dv = inp.values.shape
        start, width, _, order = self._windows(inp, keep)
        merging = inp.slot_valid & ~keep & (width > 0) & draws
        v = inp.values.float()
        share = torch.where(merging, 1.0 / width.clamp_min(1).float(), 0.0)[..., None] * v  # [B, Hkv, N, Dv]
        # Range-add over kept ranks: + share at the window's first rank, - share past its last.
        lo = torch.where(merging, start, n)
        hi = torch.where(merging, start + width, n)
        delta = torch.zeros(b, h, n + 1, dv, device=v.device)
        delta.scatter_add_(2, lo[..., None].expand(b, h, n, dv), share)
        delta.scatter_add_(2, hi[..., None].expand(b, h, n, dv), -share)
        count = torch.zeros(b, h, n + 1, dtype=torch.int32, device=v.device)
        count.scatter_add_(2, lo, merging.int()).scatter_add_(2, hi, -merging.int())
        added, touched = delta.cumsum(2)[:, :, :n], count.cumsum(2)[:, :, :n] > 0  # by kept rank
        rank = self._kept_rank(inp, keep, order)  # [B, Hkv, N] each kept slot's rank (0 elsewhere)
        got = added.gather(2, rank[..., None].expand(b, h, n, dv))
        hit = keep & touched.gather(2, rank)
        return torch.where(hit[..., None], v + got, v)

    @staticmethod
    def _kept_rank(inp: EvictionInput, keep: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        keep_s = keep.gather(-1, order)
        rank_s = keep_s.long().cumsum(-1) - 1
        rank = torch.empty_like(rank_s).scatter_(-1, order, rank_s)
        return torch.where(keep, rank, 0)

    def _windows(self, inp: EvictionInput, keep: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(start, width, p, order)`` ``[B, Hkv, N]`` in slot order: the rank among the kept (in
        position order) of the first kept slot after each slot, its window's size, its merge
        probability (evicted slots; 0 elsewhere), and the slots sorted by position (padding last)."""
        valid, n = inp.slot_valid, inp.num_slots
        pos = torch.where(valid, inp.positions, torch.iinfo(torch.long).max)
        order = pos.argsort(dim=-1, stable=True)
        keep_s = keep.gather(-1, order)
        start_s = keep_s.long().cumsum(-1) - keep_s.long()  # kept slots before each sorted slot
        width_s = (keep_s.sum(-1, keepdim=True) - start_s).clamp(0, self.merge_budget)
        # Mean accumulated attention over each window, from prefix sums over the kept ranks (float64).
        attention = inp.state_of(self)["attention"].double()
        by_rank = torch.zeros(*keep.shape[:2], n + 1, dtype=torch.float64, device=keep.device)
        rank_s = torch.where(keep_s, start_s, n)
        by_rank.scatter_(-1, rank_s, attention.gather(-1, order) * keep_s)
        prefix = torch.nn.functional.pad(by_rank[..., :n].cumsum(-1), (1, 0))
        total = prefix.gather(-1, (start_s + width_s).clamp_max(n)) - prefix.gather(-1, start_s.clamp_max(n))
        mean = total / width_s.double()
        p_s = torch.nan_to_num(attention.gather(-1, order) / mean, nan=0.0, posinf=1.0, neginf=0.0).clamp(0.0, 1.0)
        start, width, p = (torch.empty_like(x).scatter_(-1, order, x) for x in (start_s, width_s, p_s))
        evicted = valid & ~keep & (width > 0)
        return start, width, torch.where(evicted, p, 0.0).float(), order
