"""How much a value can move the residual stream: its norm through the output projection (CriticalKV)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal

import torch
from pydantic import Field

from .base import EvictionInput, Scorer, StateField
from .model_facts import Fact

#: Each slot's norm, computed once, when its token first meets an eviction (-1: not yet).
_STATE = {"norm": StateField(torch.float32, -1.0)}


class OutputValueNormScorer(Scorer):
    """``||v_j W_o^h||_p`` per slot, reduced over the ``G`` query heads ``h`` of its KV head.

    ``W_o^h`` ``[D, hidden]`` is query head ``h``'s slice of the layer's output projection (the
    model fact ``output_projection``): ``v_j W_o^h`` is what value ``j`` adds to the residual
    stream per unit of attention. CriticalKV (arXiv 2502.03805) weighs attention scores by it,
    with the L1 norm and the mean over the group.

    A token's norm depends on its value and its layer only, so it is computed once and kept as
    state (``norm``, per slot, ``-1`` until computed): each eviction projects only the tokens
    that arrived since the last one, ``N x hidden`` work per query head at the first eviction and
    about ``interval x hidden`` after it.
    """

    type_name: ClassVar[str] = "output_value_norm"
    needs_model: ClassVar[frozenset[Fact]] = frozenset({"output_projection"})

    norm: Literal[1, 2] = Field(1, description="The norm over the hidden dimension: 1 (CriticalKV) or 2.")
    group_reduce: Literal["mean", "max"] = Field("mean", description="Over the query heads of a KV head.")
    tile_elements: int = Field(
        1 << 20, ge=1, le=1 << 28,
        description="Projected entries computed per tile (performance only; results do not depend on it).",
    )

    state_updates: ClassVar[Literal["every_query", "eviction"]] = "eviction"

    @property
    def state_fields(self) -> Mapping[str, StateField]:
        return _STATE

    def update_state(self, inp: EvictionInput) -> Mapping[str, torch.Tensor]:
        known = inp.state_of(self)["norm"]
        todo = inp.slot_valid & (known < 0)
        columns = todo.flatten(0, 1).any(0).nonzero()
        if columns.numel() == 0:
            return {"norm": known}
        first = int(columns[0])  # new tokens sit after the kept ones: project from the first
        fresh = torch.where(todo[..., first:], self.norms(inp, first), known[..., first:])
        return {"norm": fresh if first == 0 else torch.cat([known[..., :first], fresh], -1)}

    def score(self, inp: EvictionInput) -> torch.Tensor:
        return inp.state_of(self)["norm"].clamp_min(0.0)  # padding slots stay at -1: never read

    def norms(self, inp: EvictionInput, first: int = 0) -> torch.Tensor:
        """``[B, Hkv, N - first]`` float32: the norm of every slot from ``first`` on, computed."""
        facts = inp.facts(self)
        b, hkv, n, d = inp.values.shape
        g = inp.group_size
        out = torch.zeros(b, hkv, n - first, dtype=torch.float32, device=inp.values.device)
        for layer, rows in inp.rows_by_layer():  # a shard of the heads reads its own heads' slices
            weight = facts.output_projection_heads(layer, inp.head_offset, hkv)
            weight = weight.to(device=inp.values.device, dtype=torch.float32)
            hidden = weight.shape[-1]
            weight = weight.view(hkv, g, d, hidden)
            values = inp.values[rows, :, first:]  # [R, Hkv, N - first, D]
            # One KV head at a time, in tiles of slots: its weight slice stays in cache while
            # the tiles pass (a tile over every head re-read the whole projection per tile).
            chunk = max(1, self.tile_elements // max(1, rows.numel() * g * hidden))
            for h in range(hkv):
                for s0 in range(0, n - first, chunk):
                    v = values[:, h, s0 : s0 + chunk].float()
                    projected = torch.einsum("rnd,gde->rgne", v, weight[h])  # [R, G, n, hidden]
                    norms = projected.abs_().sum(-1) if self.norm == 1 else projected.norm(dim=-1)  # a fresh tensor: abs in place
                    reduced = norms.mean(1) if self.group_reduce == "mean" else norms.amax(1)
                    out[rows, h, s0 : s0 + chunk] = reduced
        return out
