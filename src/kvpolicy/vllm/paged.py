"""Reading and compacting a request's slots inside vLLM's paged KV cache: pure tensor functions.

Every function takes a layer's keys and values as ``BlockLayout.split`` gives them (views
``[num_blocks, block_size, Hkv, D]`` of the cache, whatever layout the attention backend
declared: see ``kvpolicy.vllm.layout``), so reading and writing them reads and writes the cache.
Slot ``s`` of a request lives in block ``block_table[s // block_size]`` at offset
``s % block_size``. Nothing here knows about requests, schedules, policies or vLLM.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

KV = tuple[torch.Tensor, torch.Tensor]
#: Keys and values as an eviction gathered them: values None where no stage reads them.
Gathered = tuple[torch.Tensor, torch.Tensor | None]


def slot_address(block_tables: torch.Tensor, n: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block, offset)`` ``[R, n]`` of slots ``0 .. n-1`` of every row of ``block_tables [R, max_blocks]``."""
    slot = torch.arange(n, device=block_tables.device)
    blocks = block_tables[:, slot // block_size].long()
    return blocks, (slot % block_size).expand_as(blocks)


def gather_paged(kv: KV, blocks: torch.Tensor, offsets: torch.Tensor) -> KV:
    """Keys and values ``[R, Hkv, n, D]`` (copies) of the slots at ``(blocks, offsets) [R, n]``.

    (Not ``kvpolicy.slots.gather_slots``, which gathers slots of a cache's own buffers.)"""
    keys, values = kv
    return keys[blocks, offsets].transpose(1, 2), values[blocks, offsets].transpose(1, 2)


def gather_layers(layers: list[KV], blocks: torch.Tensor, offsets: torch.Tensor, *,
                  values: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every layer's keys and values ``[Lyr, R, Hkv, n, D]`` (copies; values None unless ``values``)
    of the slots at ``(blocks, offsets) [R, n]``, each layer's written into one tensor as it is
    read (stacking per-layer copies would copy them all again)."""
    r, n = blocks.shape
    out = []
    for which in (0, 1) if values else (0,):
        first = layers[0][which]
        stacked = torch.empty(len(layers), r, first.shape[2], n, first.shape[3], dtype=first.dtype, device=first.device)
        for i, layer in enumerate(layers):
            stacked[i].copy_(layer[which][blocks, offsets].transpose(1, 2))
        out.append(stacked)
    return out[0], out[1] if values else None


def compact(layers: list[KV], block_tables: torch.Tensor, gathered: list[Gathered], kept: torch.Tensor,
            block_size: int, start: torch.Tensor | None = None, sources: torch.Tensor | None = None,
            columns: torch.Tensor | None = None) -> None:
    """Move each row's kept slots to the front of its blocks, in order, in place.

    Args:
        layers: per layer, its keys and values ``[num_blocks, block_size, Hkv, D]`` (cache views).
        block_tables: ``[R, max_blocks]`` the rows' block tables.
        gathered: per layer, the rows' ``(keys, values) [R, Hkv, N, D]`` as ``gather_paged`` read them
            (copies: writing the cache does not change them); values None where they were not
            gathered: read from ``sources``.
        kept: ``[Lyr, R, Hkv, K]`` ascending indices into ``gathered``'s slots, per layer, row and head.
        start: ``[Lyr, R]`` the first slot written per layer and row: the slots before it already
            hold what they keep (``in_place``); None: every slot is written.
        sources: ``[R, max_blocks]`` the block tables the slots were gathered from (the old ones),
            for values not gathered.
        columns: ``[Lyr, R, Hkv, N]`` the slot each of ``gathered``'s columns was read from, where
            they are not the slots in order (per-head lanes: ``kvpolicy.vllm.lanes.LaneColumns``);
            None: column ``c`` is slot ``c``.
    """
    lyr, r, h, k = kept.shape
    dst_blocks, dst_off = slot_address(block_tables, k, block_size)
    heads = torch.arange(h, device=kept.device)
    slots = torch.arange(k, device=kept.device)
    for i, ((keys, values), (ks, vs), idx) in enumerate(zip(layers, gathered, kept, strict=True)):
        rows, cols = (slots >= (0 if start is None else start[i][:, None])).expand(r, k).nonzero(as_tuple=True)
        src = idx[rows, :, cols]  # [M, Hkv]: the slot each head keeps at column cols of row rows
        at = dst_blocks[rows, cols], dst_off[rows, cols]
        keys[at] = ks[rows[:, None], heads, src]  # [M, Hkv, D]
        if vs is not None:
            values[at] = vs[rows[:, None], heads, src]
        elif sources is None:
            raise ValueError("values not gathered and no source block tables to read them from")
        else:  # read before written: indexing on the right copies first
            slot = src if columns is None else columns[i][rows[:, None], heads, src]
            values[at] = values[sources[rows[:, None], slot // block_size], slot % block_size, heads]


def in_place(kept: torch.Tensor) -> torch.Tensor:
    """``[Lyr, R]``: how many leading slots an in-place ``compact`` to ``kept [Lyr, R, Hkv, K]``
    leaves where they are (every head keeps slot ``p`` as its ``p``-th): its ``start``."""
    k = kept.shape[-1]
    moved = (kept != torch.arange(k, device=kept.device)).any(dim=2)  # [Lyr, R, K]
    return torch.where(moved.any(-1), moved.to(torch.uint8).argmax(-1), k)


def __getattr__(name: str) -> Any:
    if name == "gather_slots":  # its name in kvpolicy 0.2; kvpolicy.slots.gather_slots is another function
        warnings.warn("kvpolicy.vllm.paged.gather_slots is now kvpolicy.vllm.paged.gather_paged",
                      DeprecationWarning, stacklevel=2)
        return gather_paged
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
