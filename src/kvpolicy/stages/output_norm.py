"""How much a value can move the residual stream: its norm through the output projection (CriticalKV)."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from .base import EvictionInput, Scorer
from .model_facts import Fact


class OutputValueNormScorer(Scorer):
    """``||v_j W_o^h||_p`` per slot, reduced over the ``G`` query heads ``h`` of its KV head.

    ``W_o^h`` ``[D, hidden]`` is query head ``h``'s slice of the layer's output projection (the
    model fact ``output_projection``): ``v_j W_o^h`` is what value ``j`` adds to the residual
    stream per unit of attention. CriticalKV (arXiv 2502.03805) weighs attention scores by it,
    with the L1 norm and the mean over the group.
    """

    type_name: ClassVar[str] = "output_value_norm"
    needs_model: ClassVar[frozenset[Fact]] = frozenset({"output_projection"})

    norm: Literal[1, 2] = Field(1, description="The norm over the hidden dimension: 1 (CriticalKV) or 2.")
    group_reduce: Literal["mean", "max"] = Field("mean", description="Over the query heads of a KV head.")
    tile_elements: int = Field(
        1 << 24, ge=1, le=1 << 28,
        description="Projected entries computed per tile (performance only; results do not depend on it).",
    )

    def score(self, inp: EvictionInput) -> torch.Tensor:
        facts = inp.facts(self)
        b, hkv, n, d = inp.values.shape
        g = inp.group_size
        out = torch.zeros(b, hkv, n, dtype=torch.float32, device=inp.values.device)
        first = inp.head_offset * g  # a shard of the heads reads its own heads' slices
        for layer, rows in inp.rows_by_layer():
            weight = facts.output_projection(layer)[first : first + hkv * g]
            weight = weight.to(device=inp.values.device, dtype=torch.float32)
            hidden = weight.shape[-1]
            weight = weight.view(hkv, g, d, hidden)
            values = inp.values[rows]  # [R, Hkv, N, D]
            chunk = max(1, self.tile_elements // max(1, rows.numel() * hkv * g * hidden))
            for s0 in range(0, n, chunk):
                v = values[:, :, s0 : s0 + chunk].float()
                projected = torch.einsum("rhnd,hgde->rhgne", v, weight)  # [R, Hkv, G, n, hidden]
                norms = projected.abs().sum(-1) if self.norm == 1 else projected.norm(dim=-1)
                reduced = norms.mean(2) if self.group_reduce == "mean" else norms.amax(2)
                out[rows, :, s0 : s0 + chunk] = reduced
        return out
