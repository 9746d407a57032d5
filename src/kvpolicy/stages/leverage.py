"""Gaussian-projection leverage (CurDKV), optionally resampled at every eviction (VaSE-DKV)."""

from __future__ import annotations

from typing import ClassVar, Literal, cast

import torch
from pydantic import Field

from .base import EvictionInput, Scorer


class LeverageScorer(Scorer):
    """Approximate leverage of keys and values under a random Gaussian projection.

    ``P`` is ``[D, r]`` with entries ``N(0, 1) / sqrt(r)``; ``k2_j = ||K_j P||^2``, ``v2_j =
    ||V_j P||^2``. The score is ``k2 * v2`` (``kv_product``), ``k2`` (``key``), ``v2``
    (``value``) or the mean of ``k2`` and ``v2`` each normalised to sum 1 (``mean``), finally
    normalised to sum 1 over the candidates of each row and head.

    ``projection="fixed"`` (CurDKV): one ``P`` per layer, drawn from the layer's fixed seed, so
    every eviction of that layer reuses it (deterministic given the policy's seed).
    ``projection="resample"`` (VaSE-DKV): a fresh ``P`` per batch row at every eviction, drawn
    from the row's eviction seed. ``local_window`` (as in
    kvpress's CURPress; VaSE does not use it) normalises ``k2`` and ``v2`` within consecutive
    windows of that many slots first.
    """

    type_name: ClassVar[str] = "leverage"

    rank: int = Field(
        20, ge=1, le=4096, description="Columns of the projection; at most 4096 (beyond any head dimension)."
    )
    mode: Literal["kv_product", "key", "value", "mean"] = "kv_product"
    projection: Literal["fixed", "resample"] = "fixed"
    local_window: int | None = Field(
        None, ge=1, le=1 << 24, description="Slots per normalisation window; at most 2**24, the largest budget."
    )

    @property
    def stochastic(self) -> bool:  # type: ignore[override]
        return self.projection == "resample"

    @property
    def draws_per_layer(self) -> bool:  # type: ignore[override]
        return self.projection == "fixed"

    def projections(self, inp: EvictionInput) -> torch.Tensor:
        """``[B, D, r]`` float32: the projection used for each batch row."""
        per: Literal["eviction", "layer"] = "eviction" if self.projection == "resample" else "layer"
        p = inp.normal(inp.head_dim, self.rank, stream=self.type_name, per=per)
        return p / self.rank**0.5

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
        # Each mode computed the terms it reads just above.
        if self.mode == "kv_product":
            s = cast(torch.Tensor, k2) * cast(torch.Tensor, v2)
        elif self.mode == "key":
            s = cast(torch.Tensor, k2)
        elif self.mode == "value":
            s = cast(torch.Tensor, v2)
        else:
            s = 0.5 * (_normalise(cast(torch.Tensor, k2)) + _normalise(cast(torch.Tensor, v2)))
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
