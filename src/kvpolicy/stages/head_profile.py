"""Per-head budgets from a head profile (HeadKV, DuoAttention): fixed shares, measured offline."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from pydantic import Field, PrivateAttr, model_validator

from ..profile_format import HeadProfile
from .adaptive import share_the_rest
from .base import Allocation, EvictionInput
from .layer_list import largest_remainder


class ProfileAllocation(Allocation):
    """Every head gets ``floor * budget`` slots, and the rest of the model's total goes to the
    heads in proportion to their weight in a head profile (``kvpolicy profile`` measures one;
    ``retrieval`` heads weigh 1, ``streaming`` heads 0 and keep only the floor).

    The shares are fixed: layer ``l``'s budget is the mean of its heads' shares, and head ``h``
    keeps its share at every eviction. A head that holds fewer slots than its share (the first
    evictions) keeps all of them, and the rest goes to the other heads' best candidates, so
    every eviction still keeps the layer's total. A share below the head's protected slots
    (its recent buffer and reservations) is refused when the cache is built: ``floor * budget``
    must cover them.
    """

    type_name: ClassVar[str] = "profile"
    reads_values: ClassVar[bool] = False
    per_head: ClassVar[bool] = True

    path: str = Field(..., min_length=1, description="The head profile file (YAML or JSON; see `kvpolicy profile`).")
    floor: float = Field(
        0.2, ge=0.0, le=1.0, allow_inf_nan=False, description="Fraction of the budget every head keeps; at most 1."
    )
    _profile: Any = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _load(self) -> ProfileAllocation:
        try:
            self._profile = HeadProfile.load(self.path)
        except ValueError as exc:  # ProfileError: one line per problem, with the file's lines
            problems = getattr(exc, "problems", [str(exc)])
            raise ValueError(f"cannot use the head profile {self.path}: {'; '.join(problems)}") from None
        return self

    def check_model(self, num_layers: int, num_kv_heads: int) -> None:
        p = self._profile
        if num_kv_heads:
            p.check_shape(num_layers, num_kv_heads)
        elif p.num_layers != num_layers:
            p.check_shape(num_layers, p.num_kv_heads)

    def _shares(self) -> torch.Tensor:
        """``[L, Hkv]`` float64 share of each head per unit of budget: ``floor`` plus its part
        of the pool, ``(1 - floor) * L * Hkv * weight / sum of weights``."""
        weights = self._profile.head_weights()
        return self.floor + (1 - self.floor) * weights.numel() * weights / weights.sum()

    @property
    def heads_alike(self) -> bool:
        return False  # fixed shares differ by head

    def layer_budgets(self, budget: int, num_layers: int, recent: int) -> list[int]:
        self.check_model(num_layers, 0)
        shares = self._shares()
        return largest_remainder((budget * shares.mean(1)).tolist(), budget * num_layers)

    def head_budgets(self, layer: int, layer_budget: int, recent: int = 0) -> list[int]:
        """The shares of ``layer``'s heads when the layer keeps ``Hkv * layer_budget`` slots
        (``recent`` plays no part: the floor must cover it, as ``layer_schedules`` checks)."""
        row = self._shares()[layer]
        return largest_remainder((row * (row.numel() * layer_budget / row.sum())).tolist(), row.numel() * layer_budget)

    def head_counts(self, priority: torch.Tensor, protected: torch.Tensor, inp: EvictionInput) -> torch.Tensor:
        tables: dict[int, list[int]] = {}
        for layer in inp.layer_index.tolist():
            if layer not in tables:
                tables[layer] = self.head_budgets(layer, inp.budget)
        share = torch.tensor([tables[layer] for layer in inp.layer_index.tolist()], device=priority.device)
        held = (priority > float("-inf")).sum(-1)
        guaranteed = torch.maximum(protected.sum(-1), torch.minimum(share, held))  # protected slots stay kept
        return share_the_rest(priority, guaranteed, priority.shape[1] * inp.budget)
