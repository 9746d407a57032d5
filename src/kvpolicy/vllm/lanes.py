"""Per-head budgets in vLLM's blocks: each KV head's lane of a request's blocks. Pure addressing.

A request under a per-head allocation (Ada-KV, DuoAttention) holds, after an eviction, each
head's own kept slots at the front of that head's lane of its blocks, then padding up to the room
the ledger reserved for the fullest head (``RequestSlots.reserve``), then the slots appended since
(vLLM writes a token at one slot for every head). The padding is never read: the eviction input
and attention address each head's own slots, in the column order every engine shares
(``kvpolicy.heads.own_columns``: a policy's seeded draws depend on it).

Nothing here knows requests, policies or vLLM: ``Lanes`` is one request's heads, the functions
compute block-table slots, columns and masks from it (``kvpolicy.vllm.paged_cache`` calls them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attend import attend_heads
from ..heads import own_columns
from .paged import KV


@dataclass(frozen=True)
class Lanes:
    """One request's heads: each head's kept count ``counts [Lyr, Hkv]`` (host) and the
    block-table slot where the slots appended since its last eviction start (the room for the
    fullest head). Before a first eviction every head holds every slot: ``even``."""

    counts: torch.Tensor
    start: int

    @staticmethod
    def even(layers: int, kv_heads: int) -> Lanes:
        return Lanes(torch.zeros(layers, kv_heads, dtype=torch.long), 0)

    def own(self, held: int) -> torch.Tensor:
        """``[Lyr, Hkv]``: slots each head holds when the request holds ``held`` block-table slots."""
        return self.counts + (held - self.start)

    def width(self, held: int) -> int:
        """Slots the fullest head of any layer holds when the request holds ``held`` block-table slots."""
        return int(self.counts.max()) + held - self.start

    def columns(self, held: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slot, valid)`` ``[Lyr, Hkv, width]``: each head's own slots right-aligned in ``width``
        columns (``own_columns``, as ``EvictingCache``'s per-head layout hands them to a policy),
        as block-table slots: its kept ones, then those appended since. An empty column points at
        slot 0 and is invalid."""
        j, valid = own_columns(self.own(held), width)  # the head's slot j, oldest first
        k = self.counts[..., None]
        slot = torch.where(j < k, j, self.start + j - k)
        return torch.where(valid, slot, 0), valid


def kept_order(keep: torch.Tensor, most: int) -> torch.Tensor:
    """``[..., most]``: the columns of each head's kept slots (``keep [..., W]`` bool), in column
    order, first; the columns after a head's count are padding (what it kept fewer of)."""
    return (~keep).to(torch.uint8).sort(dim=-1, stable=True).indices[..., :most]


def padded(t: torch.Tensor, room: int, value: float) -> torch.Tensor:
    """``t [..., most]`` (each head's kept columns, ``kept_order``) padded with ``value`` to the
    ``room`` every head's lane holds after the eviction."""
    return torch.nn.functional.pad(t, (0, room - t.shape[-1]), value=value)


@dataclass(frozen=True)
class HeadAttention:
    """This step's requests whose heads hold different counts, and what each layer's attention
    over their own slots reads (``plan_attention``). Per layer ``l`` of ``[Lyr, B, Hkv, W]``:
    column ``w`` of a head is its kept slot ``w`` (the front of its lane), then its slots appended
    since the last eviction (from the reserved room's end on); the padding between them is in no
    column."""

    token_idx: torch.Tensor  # [B, T] each query's row in the step's flattened tokens (0 past a chunk)
    token_valid: torch.Tensor  # [B, T] which of those hold a query of the request
    blocks: torch.Tensor  # [Lyr, B, Hkv, W] the block of each column's slot
    offsets: torch.Tensor  # [Lyr, B, Hkv, W] its offset in the block
    heads: torch.Tensor  # [Lyr, B, Hkv, W] its KV head
    mask: torch.Tensor  # [Lyr, B, Hkv, T, W] bool: the columns query t attends (causal over appended slots)


@dataclass(frozen=True)
class LaneStep:
    """One request of the step, for ``plan_attention``: its lanes, its block-table slots held
    after the step's ``tokens`` are written, and its last token's row in the step's flattened tokens."""

    lanes: Lanes
    held: int
    tokens: int
    end: int


def plan_attention(steps: list[LaneStep], tables: torch.Tensor, block_size: int, device: torch.device) -> HeadAttention:
    """Where each layer's attention of ``steps`` reads: each head's own slots (``tables [B,
    max_blocks]``, the requests' block tables), causal over the step's appended slots."""
    layers, kv_heads = steps[0].lanes.counts.shape
    t_max = max(s.tokens for s in steps)
    width = max(int(s.lanes.own(s.held).max()) for s in steps)
    cols = torch.arange(width)
    b = len(steps)
    token_idx = torch.zeros(b, t_max, dtype=torch.long)
    token_valid = torch.zeros(b, t_max, dtype=torch.bool)
    slot = torch.zeros(layers, b, kv_heads, width, dtype=torch.long)
    mask = torch.zeros(layers, b, kv_heads, t_max, width, dtype=torch.bool)
    queries = torch.arange(t_max)
    for j, s in enumerate(steps):
        t, counts, appended = s.tokens, s.lanes.counts, s.held - s.lanes.start
        token_idx[j, :t] = torch.arange(s.end - t, s.end)
        token_valid[j, :t] = True
        k = counts[..., None]  # [Lyr, Hkv, 1]
        slot[:, j] = torch.where(cols < k, cols, s.lanes.start + cols - k)
        fresh = cols - k  # [Lyr, Hkv, W]: index among the appended slots (negative: a kept one)
        sees = (cols < (counts + appended)[..., None])[..., None, :] & (
            fresh[..., None, :] <= (appended - t) + queries[:, None])
        mask[:, j] = sees & (queries < t)[:, None]
    mask[..., 0] |= ~mask.any(-1)  # a query past its request's chunk attends column 0: finite, dropped
    slot = torch.where(mask.any(-2), slot, 0)
    blocks = tables[torch.arange(b)[None, :, None, None], slot // block_size]
    heads = torch.arange(kv_heads)[:, None].expand_as(slot)
    return HeadAttention(token_idx.to(device), token_valid.to(device), blocks.to(device),
                         (slot % block_size).to(device), heads.to(device), mask.to(device))


def attend(plan: HeadAttention, layer: int, kv: KV, query: torch.Tensor, output: torch.Tensor, scale: float,
           q_heads: int, head_dim: int) -> None:
    """Layer ``layer``'s attention of ``plan``'s requests over each head's own slots only
    (``kvpolicy.attend.attend_heads``), written over their rows of ``output`` (``[T, Hq * D]`` or
    ``[T, Hq, D]``); ``kv``: the layer's keys and values, ``query`` its ``[T, Hq * D]`` queries."""
    b, _ = plan.token_idx.shape
    q = query.view(query.shape[0], q_heads, head_dim)[plan.token_idx]  # [B, T, Hq, D]
    keys, values = kv
    blocks, offsets, heads = plan.blocks[layer], plan.offsets[layer], plan.heads[layer]
    k, v = keys[blocks, offsets, heads], values[blocks, offsets, heads]  # [B, Hkv, W, D]
    kv_heads, width = k.shape[1], k.shape[2]
    index = torch.arange(b * kv_heads * width, device=k.device).view(b, kv_heads, width)
    out = attend_heads(q.transpose(1, 2).to(k.dtype), k.flatten(0, 2), v.flatten(0, 2), index, plan.mask[layer],
                       scaling=scale)  # [B, Hq, T, Dv]
    rows = output.view(output.shape[0], q_heads, -1)
    rows[plan.token_idx[plan.token_valid]] = out.transpose(1, 2)[plan.token_valid].to(rows.dtype)
