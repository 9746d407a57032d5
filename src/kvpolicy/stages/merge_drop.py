"""Drop: an evicted token is gone (the default merge, every policy without merging)."""

from __future__ import annotations

from typing import ClassVar

import torch

from .base import EvictionInput, Merge, MergeResult


class DropMerge(Merge):
    """Merges nothing: the eviction core never calls it, and every policy keeps exactly what it
    kept before merge stages existed."""

    type_name: ClassVar[str] = "drop"
    reads_values: ClassVar[bool] = False
    merges: ClassVar[bool] = False

    def merge(self, inp: EvictionInput, keep: torch.Tensor) -> MergeResult:
        return MergeResult(inp.values, {})
