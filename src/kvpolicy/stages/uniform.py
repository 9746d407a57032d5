"""Every layer and head keeps the policy's budget: the default allocation."""

from __future__ import annotations

from typing import ClassVar

from .base import Allocation


class UniformAllocation(Allocation):
    """Every layer and KV head keeps ``budget`` slots (what a policy without ``allocation`` does)."""

    type_name: ClassVar[str] = "uniform"
    reads_values: ClassVar[bool] = False

    @property
    def uneven(self) -> bool:
        return False
