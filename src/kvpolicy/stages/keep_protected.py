"""Keep the protected slots only (StreamingLLM)."""

from __future__ import annotations

from typing import ClassVar

import torch

from .base import EvictionInput, Selector


class KeepProtectedSelector(Selector):
    """Keeps exactly the protected slots (sinks and recent buffer) and reads no score.

    The policy must protect exactly ``budget`` slots (checked at load); if padding leaves fewer
    protected slots in a row, the most recent remaining candidates fill it up.
    """

    type_name: ClassVar[str] = "keep_protected"
    reads_values: ClassVar[bool] = False
    needs_scores: ClassVar[bool] = False

    def priority(self, scores: torch.Tensor | None, inp: EvictionInput) -> torch.Tensor:
        idx = torch.arange(inp.num_slots, device=inp.keys.device, dtype=torch.float32)
        return idx.expand(inp.batch, inp.num_kv_heads, -1)
