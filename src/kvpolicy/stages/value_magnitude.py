"""Value magnitude: Range (VaSE), variance or L2 norm of each value vector."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch

from .base import EvictionInput, Scorer


class ValueMagnitudeScorer(Scorer):
    """Per-slot magnitude of the raw value vector over the head dimension.

    ``range``: ``max_d V - min_d V`` (VaSE); ``variance``: population variance over ``d``;
    ``l2``: Euclidean norm.
    """

    type_name: ClassVar[str] = "value_magnitude"

    metric: Literal["range", "variance", "l2"] = "range"

    def score(self, inp: EvictionInput) -> torch.Tensor:
        return value_magnitude(inp.values, self.metric)


def value_magnitude(values: torch.Tensor, metric: str) -> torch.Tensor:
    """``[B, H, N, D] -> [B, H, N]`` float32 magnitude of each value vector."""
    v = values.float()
    if metric == "range":
        return v.amax(dim=-1).sub_(v.amin(dim=-1))  # two reductions beat one aminmax on CPU
    if metric == "variance":
        return v.var(dim=-1, unbiased=False)
    return v.norm(dim=-1)
