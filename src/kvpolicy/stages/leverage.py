"""Gaussian-projection leverage (CurDKV), optionally resampled at every eviction (VaSE-DKV)."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from .base import EvictionInput, Scorer


class LeverageScorer(Scorer):
    """Approximate leverage of keys and values under a random Gaussian projection.

    ``P`` is ``[D, r]`` with entries ``N(0, 1) / sqrt(r)``; ``k2_j = ||K_j P||^2``, ``v2_j =
    ||V_j P||^2``. The score is ``k2 * v2`` (``kv_product``), ``k2`` (``key``), ``v2``
    (``value``) or the mean of ``k2`` and ``v2`` each normalised to sum 1 (``mean``), finally
    normalised to sum 1 over the candidates of each row and head.

    ``projection="fixed"`` (CurDKV): one ``P`` per layer, derived from the layer's fixed seed, so
    every eviction of that layer reuses it. ``projection="resample"`` (VaSE-DKV): a fresh ``P``
    per batch row at every eviction, drawn from the eviction's generator. ``local_window`` (as in
    kvpress's CURPress; VaSE does not use it) normalises ``k2`` and ``v2`` within consecutive
    windows of that many slots first.
    """

    type_name: ClassVar[str] = "leverage"
    stochastic: ClassVar[bool] = True

    rank: int = Field(20, ge=1)
    mode: Literal["kv_product", "key", "value", "mean"] = "kv_product"
    projection: Literal["fixed", "resample"] = "fixed"
    local_window: int | None = Field(None, ge=1)

    def projections(self, inp: EvictionInput) -> torch.Tensor:
        """``[B, D, r]`` float32: the projection used for each batch row."""
        b, d = inp.batch, inp.head_dim
        if self.projection == "resample":
            p = torch.randn(b, d, self.rank, generator=inp.generator, device=_gen_device(inp))
        else:
            seeds = inp.layer_seed if inp.layer_seed is not None else torch.zeros(1, dtype=torch.long)
            per_layer = []
            for seed in seeds.tolist():  # one draw per stacked layer, not per row or head
                g = torch.Generator(device="cpu").manual_seed(int(seed))
                per_layer.append(torch.randn(d, self.rank, generator=g))
            rows = inp.rows_per_layer or b
            p = torch.stack(per_layer).repeat_interleave(rows, dim=0)
        return (p / self.rank**0.5).to(inp.keys.device)

    def score(self, inp: EvictionInput) -> torch.Tensor:
        c = inp.num_candidates
        p = self.projections(inp)[:, None]  # [B, 1, D, r]
        valid = inp.slot_valid[..., :c].float()
        k2 = v2 = None
        if self.mode != "value":
            k2 = _projected_sq_norm(inp.keys, p)[..., :c] * valid
        if self.mode != "key":
            v2 = _projected_sq_norm(inp.values, p)[..., :c] * valid
        if self.local_window is not None:
            k2 = None if k2 is None else _local_normalise(k2, self.local_window)
            v2 = None if v2 is None else _local_normalise(v2, self.local_window)
        if self.mode == "kv_product":
            s = k2 * v2
        elif self.mode == "key":
            s = k2
        elif self.mode == "value":
            s = v2
        else:
            s = 0.5 * (_normalise(k2) + _normalise(v2))
        out = s.new_zeros(inp.batch, inp.num_kv_heads, inp.num_slots)
        out[..., :c] = _normalise(s)
        return out


def _projected_sq_norm(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``||x_j P||^2`` per slot: ``[B, H, N, D] x [B, 1, D, r] -> [B, H, N]``.

    Projects every slot (the recent ones too, a few percent more work) so that the matmul reads
    the cache tensor as it is: slicing the candidates first would make the broadcast matmul copy it.
    """
    b, h, n, d = x.shape
    # One [H*N, D] x [D, r] product per batch row (P is shared by the heads of a row).
    y = torch.bmm(x.float().reshape(b, h * n, d), p.reshape(b, d, -1))
    return y.square_().sum(-1).view(b, h, n)


def _normalise(x: torch.Tensor) -> torch.Tensor:
    return x / x.sum(-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)


def _local_normalise(x: torch.Tensor, window: int) -> torch.Tensor:
    """Divide each entry by the sum of its window of ``window`` consecutive slots."""
    n = x.shape[-1]
    pad = (-n) % window
    padded = torch.nn.functional.pad(x, (0, pad))
    blocks = padded.unflatten(-1, (-1, window))
    blocks = blocks / blocks.sum(-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)
    return blocks.flatten(-2)[..., :n]


def _gen_device(inp: EvictionInput) -> torch.device:
    return inp.generator.device if inp.generator is not None else torch.device("cpu")
