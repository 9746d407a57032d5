"""An explicit budget per layer, or relative weights per layer."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

from pydantic import Field, field_validator

from .base import Allocation


class LayerListAllocation(Allocation):
    """Per-layer shares from a list with one entry per layer.

    ``budgets`` are read as weights: layer ``l`` keeps ``total * budgets[l] / sum(budgets)``
    slots per head, rounded to ints adding up to the total (largest remainders), where the
    total is ``num_layers * budget``. So a list of budgets that already averages ``budget``
    is kept as written.
    """

    type_name: ClassVar[str] = "layers"
    reads_values: ClassVar[bool] = False

    budgets: list[float] = Field(..., min_length=1, max_length=4096, description="One weight or budget per layer.")

    @field_validator("budgets", mode="before")
    @classmethod
    def _numbers(cls, value: object) -> object:
        """Refuse, by entry, what pydantic's lax mode would convert, as a scalar field does
        (``documents.refuse_lax_scalar``): ``true`` read as 1, the string ``'3'`` as 3."""
        if isinstance(value, (list, tuple)):
            for i, b in enumerate(value):
                if isinstance(b, bool):
                    raise ValueError(f"budgets[{i}] must be a number, got {str(b).lower()} (a boolean)")
                if isinstance(b, str):
                    raise ValueError(f"budgets[{i}] must be a number, got the string {b!r}: write it unquoted")
        return value

    @field_validator("budgets")
    @classmethod
    def _positive(cls, value: list[float]) -> list[float]:
        for i, b in enumerate(value):
            if not math.isfinite(b) or b <= 0:
                raise ValueError(f"budgets[{i}] = {b}: every layer's share must be a finite number above 0")
        return value

    def check_model(self, num_layers: int, num_kv_heads: int) -> None:
        if len(self.budgets) != num_layers:
            raise ValueError(
                f"allocation.budgets has {len(self.budgets)} entries but the model has {num_layers} layers"
            )

    def layer_budgets(self, budget: int, num_layers: int, recent: int) -> list[int]:
        self.check_model(num_layers, 0)
        weights = self.budgets
        total = sum(weights)
        shares = [b * budget * num_layers / total for b in weights]
        if not all(math.isfinite(x) for x in shares):  # the sum or a product overflowed: the same weights, scaled
            top = max(weights)
            weights = [b / top for b in weights]
            total = sum(weights)
            shares = [b * budget * num_layers / total for b in weights]
        return largest_remainder(shares, budget * num_layers)


def largest_remainder(shares: Sequence[float], total: int) -> list[int]:
    """Round non-negative ``shares`` to ints adding up to ``total`` (Hamilton's method: floors,
    then one more to the largest remainders, earlier entries first on ties)."""
    floors = [math.floor(s) for s in shares]
    left = total - sum(floors)
    order = sorted(range(len(shares)), key=lambda i: (-(shares[i] - floors[i]), i))
    for i in order[: max(0, left)]:
        floors[i] += 1
    return floors
