"""PyramidKV: per-layer budgets falling linearly with depth around the same mean."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from .base import Allocation
from .layer_list import largest_remainder


class PyramidAllocation(Allocation):
    """Layer budgets on a straight line from the first layer to the last, total kept.

    Every layer keeps the recent buffer ``r``; the line runs over the rest, as in PyramidKV's
    code: with ``m`` layers and mean budget ``k``, the last layer gets ``r + (k - r) / beta`` and
    the first ``r + 2(k - r) - (k - r) / beta``; layers in between lie on the line, rounded to
    ints that still add up to ``m * k`` (largest remainders). ``beta`` sets the steepness
    (PyramidKV's code uses 20); ``beta = 1`` is uniform.
    """

    type_name: ClassVar[str] = "pyramid"
    reads_values: ClassVar[bool] = False

    beta: float = Field(20.0, ge=1.0, le=1e6, allow_inf_nan=False, description="Steepness: the last layer keeps budget / beta.")

    def layer_budgets(self, budget: int, num_layers: int, recent: int) -> list[int]:
        if num_layers == 1:
            return [budget]
        share = budget - recent
        top = share / self.beta
        bottom = 2 * share - top
        line = [recent + bottom + (top - bottom) * i / (num_layers - 1) for i in range(num_layers)]
        return largest_remainder(line, budget * num_layers)
