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
    most = int(sources.sum(-1).max())
    if most == 0:
        return sim, target
    # Each head's sources first (an eviction drops few of the slots it holds): [B, Hkv, S] of them.
    picked = sources.to(torch.int8).argsort(dim=-1, descending=True, stable=True)[..., :most]
    real = sources.gather(-1, picked)
    not_kept = ~keep[:, :, None, :]
    tile = max(1, tile_elements // max(1, b * h * n))
    best_all, idx_all = [], []
    for c0 in range(0, most, tile):
        rows = picked[..., c0 : c0 + tile]
        src = k.gather(2, rows[..., None].expand(*rows.shape, k.shape[-1]))
        s = torch.matmul(src, k.transpose(-1, -2)).masked_fill_(not_kept, float("-inf"))  # [B, Hkv, tile, N]
        best, idx = s.max(dim=-1)
        best_all.append(best)
        idx_all.append(idx)
    best, idx = torch.cat(best_all, -1), torch.cat(idx_all, -1)
    sim.scatter_(-1, picked, torch.where(real, best, float("-inf")))
    target.scatter_(-1, picked, torch.where(real, idx, 0))
    return sim, target

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
