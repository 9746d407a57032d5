"""What the merge stages share: each evicted slot's most similar kept slot, and folding weighted
values into the kept slots they were assigned to. Pure tensor code over ``[B, Hkv, N]``."""

from __future__ import annotations

import torch

#: Keys are divided by their norm clamped to at least this (kvpress ``MergingPress``'s ``1e-6``).
NORM_EPS = 1e-6


def nearest_kept(
    keys: torch.Tensor, keep: torch.Tensor, sources: torch.Tensor, tile_elements: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For every slot, the kept slot of its row and head whose key is most cosine-similar, in
    float32: ``(similarity [B, Hkv, N] float32, target [B, Hkv, N] long)``. Only ``sources``
    ``[B, Hkv, N]`` bool entries are computed (elsewhere: similarity ``-inf``, target 0). Of equal
    similarities the lowest slot wins. Computed in tiles of at most ``tile_elements`` similarities
    (``[B, Hkv, tile, N]``), never a whole ``[N, N]`` matrix."""
    b, h, n, _ = keys.shape
    k = keys.float()
    k = k / k.norm(dim=-1, keepdim=True).clamp_min(NORM_EPS)
    sim = torch.full((b, h, n), float("-inf"), device=keys.device)
    target = torch.zeros((b, h, n), dtype=torch.long, device=keys.device)
    if not bool(sources.any()):
        return sim, target
    not_kept = ~keep[:, :, None, :]
    cols = torch.nonzero(sources.any(1).any(0)).flatten()  # slots some row and head merges
    tile = max(1, tile_elements // max(1, b * h * n))
    for c0 in range(0, cols.numel(), tile):
        c = cols[c0 : c0 + tile]
        s = torch.matmul(k[:, :, c], k.transpose(-1, -2)).masked_fill_(not_kept, float("-inf"))  # [B, Hkv, c, N]
        best, idx = s.max(dim=-1)
        sim[:, :, c], target[:, :, c] = best, idx
    sim = sim.masked_fill(~sources, float("-inf"))
    return sim, target.masked_fill(~sources, 0)


def fold(
    values: torch.Tensor, weights: torch.Tensor, target: torch.Tensor, merging: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sums into each slot the weighted values of the slots ``merging [B, Hkv, N]`` assigns to it
    (``target``): ``(sum of w * v [B, Hkv, N, Dv] float32, sum of w [B, Hkv, N] float32, hit [B,
    Hkv, N] bool)``, ``hit`` True where at least one slot merged in (exact: counted, not summed)."""
    v = values.float()
    w = torch.where(merging, weights.float(), 0.0)
    idx = target.masked_fill(~merging, 0)
    num = torch.zeros_like(v).scatter_add_(2, idx[..., None].expand_as(v), w[..., None] * v)
    den = torch.zeros_like(w).scatter_add_(2, idx, w)
    hits = torch.zeros(idx.shape, dtype=torch.int32, device=idx.device).scatter_add_(2, idx, merging.int())
    return num, den, hits > 0
