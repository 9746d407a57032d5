"""Ada-KV: the heads of a layer share its slots by score, after a guaranteed floor each."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from pydantic import Field

from .base import Allocation, EvictionInput


class AdaptiveAllocation(Allocation):
    """Ada-KV's rule, over whatever priorities the policy's scorer and selector give.

    At each eviction of a layer (per batch row), every KV head first keeps its protected slots
    and its best candidates up to a floor of ``ceil(floor * budget)`` slots; the rest of the
    layer's ``Hkv * budget`` slots go to the highest priorities across all its heads together,
    so heads whose scores are spread take slots from heads whose scores are concentrated.
    Priorities are per KV head, so for GQA the scores are the group-reduced ones (as Ada-KV
    does). With a stochastic selector the priorities are Gumbel keys, and the pooled top-k
    samples without replacement across the heads of the layer.
    """

    type_name: ClassVar[str] = "adaptive"
    reads_values: ClassVar[bool] = False
    per_head: ClassVar[bool] = True
    layer_budgets_differ: ClassVar[bool] = False

    floor: float = Field(
        0.2, ge=0.0, le=1.0, allow_inf_nan=False,
        description="Fraction of the budget every head keeps at least (Ada-KV's safeguard: 0.2); at most 1.",
    )

    def head_counts(self, priority: torch.Tensor, protected: torch.Tensor, inp: EvictionInput) -> torch.Tensor:
        valid = (priority > float("-inf")).sum(-1)  # [B, Hkv] slots a head can keep
        guaranteed = torch.maximum(protected.sum(-1), valid.clamp(max=math.ceil(self.floor * inp.budget)))
        return share_the_rest(priority, guaranteed, priority.shape[1] * inp.budget)

    def head_cap(self, budget: int, num_kv_heads: int) -> int:
        """The layer's ``Hkv * budget`` less the floor of every other head: each head holds at
        least its floor at every eviction (it held all of its slots, at least ``budget``, at the
        first), and keeps at least that, so no head keeps more than this."""
        return num_kv_heads * budget - (num_kv_heads - 1) * math.ceil(self.floor * budget)


def share_the_rest(priority: torch.Tensor, guaranteed: torch.Tensor, total: int) -> torch.Tensor:
    """``[B, Hkv]`` counts: each head's ``guaranteed`` best slots, then the rest of ``total`` to
    the highest ``priority [B, Hkv, N]`` left across the heads of the row (ties: lower head and
    slot first). ``-inf`` marks slots that may not be kept."""
    b, h, n = priority.shape
    ranked = priority.sort(dim=-1, descending=True, stable=True).values
    rank = torch.arange(n, device=priority.device)
    in_pool = (rank >= guaranteed[..., None]) & (ranked > float("-inf"))
    pool = torch.where(in_pool, ranked, float("-inf")).flatten(1)  # [B, Hkv * N]
    order = pool.sort(dim=-1, descending=True, stable=True).indices
    left = (total - guaranteed.sum(-1)).clamp(min=0)  # [B]
    taken = (torch.arange(h * n, device=priority.device) < left[:, None]) & (
        pool.gather(1, order) > float("-inf")
    )
    extra = torch.zeros(b, h, dtype=torch.long, device=priority.device)
    extra.scatter_add_(1, order // n, taken.long())
    return guaranteed + extra
