"""Reading and compacting a request's slots inside vLLM's paged KV cache: pure tensor functions.

The CPU backend (its ``vec`` kernels, float32) stores each layer as ``[num_blocks, Hkv,
block_size, 2 * D]``, which holds, per block and head, the block's keys transposed (``[D,
block_size]``: element ``d`` of the key at offset ``o`` sits at ``d * block_size + o``) followed
by its values (``[block_size, D]``). The worker checks this once against the first keys and
values vLLM writes, and refuses to run on any other layout. Slot ``s`` of a request lives in block ``block_table[s // block_size]`` at
offset ``s % block_size``. Nothing here knows about requests, schedules or policies.
"""

from __future__ import annotations

import torch


def split_kv(layer_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``[num_blocks, Hkv, D, block_size]`` and values ``[num_blocks, Hkv, block_size, D]``
    of one layer (views)."""
    nb, h, bs, d2 = layer_cache.shape
    d = d2 // 2
    kv = layer_cache.view(nb, h, 2, bs * d)
    return kv[:, :, 0].view(nb, h, d, bs), kv[:, :, 1].view(nb, h, bs, d)


def slot_address(block_tables: torch.Tensor, n: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block, offset)`` ``[R, n]`` of slots ``0 .. n-1`` of every row of ``block_tables [R, max_blocks]``."""
    slot = torch.arange(n, device=block_tables.device)
    blocks = block_tables[:, slot // block_size].long()
    return blocks, (slot % block_size).expand_as(blocks)


def gather_slots(layer_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[R, Hkv, n, D]`` of the slots at ``(blocks, offsets) [R, n]``."""
    keys, values = split_kv(layer_cache)
    # Advanced indices apart from each other (slices between): the result is [R, n, Hkv, D].
    k = keys[blocks, :, :, offsets].transpose(1, 2)
    v = values[blocks, :, offsets].transpose(1, 2)
    return k, v


def compact(
    layer_caches: list[torch.Tensor],
    block_tables: torch.Tensor,
    gathered: list[tuple[torch.Tensor, torch.Tensor]],
    kept: torch.Tensor,
    block_size: int,
) -> None:
    """Move each row's kept slots to the front of its blocks, in order, in place.

    Args:
        layer_caches: one ``[num_blocks, Hkv, block_size, 2 * D]`` tensor per layer.
        block_tables: ``[R, max_blocks]`` the rows' block tables.
        gathered: per layer, the rows' ``(keys, values) [R, Hkv, N, D]`` as ``gather_slots``
            read them (copies: writing the cache does not change them).
        kept: ``[Lyr, R, Hkv, K]`` ascending indices into ``gathered``'s slots, per layer, row and head.
    """
    lyr, r, h, k = kept.shape
    dst_blocks, dst_off = slot_address(block_tables, k, block_size)
    for cache, (ks, vs), idx in zip(layer_caches, gathered, kept, strict=True):
        idx = idx.unsqueeze(-1).expand(r, h, k, ks.shape[-1])
        keys, values = split_kv(cache)
        keys[dst_blocks, :, :, dst_off] = ks.gather(2, idx).transpose(1, 2)  # [R, K, Hkv, D]
        values[dst_blocks, :, dst_off] = vs.gather(2, idx).transpose(1, 2)
