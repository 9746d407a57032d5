"""Per-head budgets in vLLM's blocks: each KV head's lane of a request's blocks. Pure addressing.

A request under a per-head allocation (Ada-KV, DuoAttention) holds, after an eviction, each
head's own kept slots at the front of that head's lane of its blocks, and the room the ledger
reserved for the fullest head (``RequestSlots.reserve``) behind them. vLLM writes a new token at
one block-table slot for every head, past that room; each head's copy is then moved to the end of
the head's own slots (``token_moves``), so a head's slots are always the first ``own`` of its lane:
what vLLM's kernel reads as one sequence per head (``kvpolicy.vllm.block_kernel``), and what the
eviction input addresses, in the column order every engine shares (``kvpolicy.heads.own_columns``:
a policy's seeded draws depend on it). Past a head's own slots its lane holds nothing it reads.

Nothing here knows requests, policies or vLLM: ``Lanes`` is one request's heads, the functions
compute block-table slots, columns and masks from it (``kvpolicy.vllm.paged_cache`` calls them).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from ..attend import attend_heads
from ..heads import own_columns
from .paged import KV

if TYPE_CHECKING:
    from .block_kernel import CpuBlocks


@dataclass(frozen=True)
class Lanes:
    """One request's heads: each head's kept count ``counts [Lyr, Hkv]`` (host) and the
    block-table slot where vLLM writes the first token after the last eviction (the room for the
    fullest head). Before a first eviction every head holds every slot: ``even``."""

    counts: torch.Tensor
    start: int

    @staticmethod
    def even(layers: int, kv_heads: int) -> Lanes:
        return Lanes(torch.zeros(layers, kv_heads, dtype=torch.long), 0)

    def own(self, held: int) -> torch.Tensor:
        """``[Lyr, Hkv]``: slots each head holds when the request holds ``held`` block-table slots."""
        return own_slots(self.counts, held, self.start)

    def width(self, held: int) -> int:
        """Slots the fullest head of any layer holds when the request holds ``held`` block-table slots."""
        return int(self.counts.max()) + held - self.start

    def columns(self, held: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(slot, field, valid)`` ``[Lyr, Hkv, width]``: each head's own slots right-aligned in
        ``width`` columns (``own_columns``, as ``EvictingCache``'s per-head layout hands them to a
        policy), oldest first: its kept ones, then those appended since. ``slot``: where each is in
        the head's lane (its keys and values); ``field``: its index in the request's per-slot
        fields (positions, state), which keep the block-table order: the kept ones padded to the
        room, then the appended ones. An empty column points at 0 and is invalid."""
        j, valid = own_columns(self.own(held), width)  # the head's slot j, oldest first
        k = self.counts[..., None]
        field = torch.where(j < k, j, self.start + j - k)
        return torch.where(valid, j, 0), torch.where(valid, field, 0), valid

    def token_moves(self, held: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where a step's ``tokens`` new tokens go: vLLM wrote them at block-table slots ``src
        [T]`` (after the ``held`` slots held before the step), each head's copy belongs at ``dst
        [Lyr, Hkv, T]``, right after that head's own slots."""
        src = torch.arange(held, held + tokens)
        return src, self.own(held)[..., None] + torch.arange(tokens)


@dataclass(frozen=True)
class LaneColumns:
    """The heads of a group of requests as one eviction reads them (``Lanes.columns``, every
    request at once): ``[Lyr, R, Hkv, W]`` each, ``W`` the width of the group's fullest head."""

    slot: torch.Tensor  # where each column is in its head's lane
    field: torch.Tensor  # its index in the request's per-slot fields (positions, state)
    valid: torch.Tensor  # bool: whether it holds a slot (an empty column points at 0)

    @staticmethod
    def of(requests: list[Lanes], held: int, device: torch.device) -> LaneColumns:
        """The columns of ``requests``, each holding ``held`` block-table slots (one width for all:
        the first request's, which the group shares)."""
        width = requests[0].width(held)
        cols = [lanes.columns(held, width) for lanes in requests]
        slot, field, valid = (torch.stack([c[i] for c in cols], dim=1).to(device) for i in range(3))
        return LaneColumns(slot, field, valid)

    @cached_property
    def heads(self) -> torch.Tensor:
        """Each column's KV head (0 where empty)."""
        return torch.where(self.valid, torch.arange(self.valid.shape[2], device=self.valid.device)[:, None], 0)

    def read(self, kv: list[KV], tables: torch.Tensor, block_size: int, *,
             values: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every layer's keys and values of the columns ``[Lyr, R, Hkv, W, D]`` (copies; values
        None unless ``values``), as ``paged.gather_layers`` reads slots; ``kv``: per layer, its
        keys and values; ``tables [R, max_blocks]``: the requests' block tables."""
        blocks = tables[torch.arange(tables.shape[0], device=tables.device)[None, :, None, None], self.slot // block_size]
        offsets = self.slot % block_size
        out = []
        for which in (0, 1) if values else (0,):
            first = kv[0][which]
            read = first.new_empty(*self.slot.shape, first.shape[-1])
            for i, layer in enumerate(kv):  # each layer's written into one tensor as it is read, not stacked after
                read[i] = layer[which][blocks[i], offsets[i], self.heads[i]]
            out.append(read)
        return out[0], out[1] if values else None

    def take(self, per_slot: torch.Tensor) -> torch.Tensor:
        """A per-slot field ``[Lyr, R, Hkv, N]`` (block-table order) at each column: ``[Lyr, R, Hkv, W]``."""
        lyr, r = per_slot.shape[:2]
        lyr_i = torch.arange(lyr, device=per_slot.device)[:, None, None, None]
        row_i = torch.arange(r, device=per_slot.device)[None, :, None, None]
        return per_slot[lyr_i, row_i, self.heads, self.field]


def own_slots(counts: torch.Tensor, held: int | torch.Tensor, start: int | torch.Tensor) -> torch.Tensor:
    """Slots each head holds: its kept ``counts`` and every slot vLLM wrote since the room's
    ``start``, up to ``held`` (ints, or tensors broadcasting with ``counts``)."""
    return counts + (held - start)


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
    over their own slots reads (``plan_attention``): each head's lane holds its kept slots, then
    those appended since the last eviction, ``lengths`` of them. ``moves``: where the step's
    tokens, written by vLLM for every head at one slot, go in each head's lane
    (``Lanes.token_moves``). One-token steps read the lanes in place by vLLM's kernel, which
    needs no more; the addresses and causal mask of the gathering path (``gathered``) are built
    only when a layer asks for them."""

    token_idx: torch.Tensor  # [B, T] each query's row in the step's flattened tokens (0 past a chunk)
    token_valid: torch.Tensor  # [B, T] which of those hold a query of the request
    lengths: torch.Tensor  # [Lyr, B, Hkv] int32: slots each head holds after the step
    tables: torch.Tensor  # [B, max_blocks] the requests' block tables
    moves: TokenMoves
    decodes: bool  # whether every request of the plan writes one token
    max_blocks: int  # blocks that hold the fullest head's slots, of any request and layer
    own: torch.Tensor  # host [Lyr, B, Hkv]: ``lengths``, for ``gathered``
    tokens: torch.Tensor  # host [B]: each request's tokens in the step
    block_size: int

    @cached_property
    def gathered(self) -> GatheredLanes:
        """Column ``w`` of a head, per layer ``[Lyr, B, Hkv, W]``, is slot ``w`` of its lane; query
        ``t`` attends the head's own columns, causal over the step's appended ones."""
        own, t = self.own, self.tokens[None, :, None]
        t_max, width = self.token_idx.shape[1], int(own.max())
        cols, queries = torch.arange(width), torch.arange(t_max)
        first_new = (own - t)[..., None, None]  # the column of the step's first token
        mask = ((cols < own[..., None])[..., None, :] & (cols <= first_new + queries[:, None])
                & (queries < t[..., None])[..., None])  # [Lyr, B, Hkv, T, W]
        mask[..., 0] |= ~mask.any(-1)  # a query past its request's chunk attends column 0: finite, dropped
        slot = torch.where(mask.any(-2), cols, 0)
        device = self.tables.device
        slot_dev = slot.to(device)
        blocks = self.tables[torch.arange(own.shape[1], device=device)[None, :, None, None], slot_dev // self.block_size]
        heads = torch.arange(own.shape[2])[:, None].expand_as(slot)
        return GatheredLanes(blocks, slot_dev % self.block_size, heads.to(device), mask.to(device))


@dataclass(frozen=True)
class GatheredLanes:
    """Where the gathering path of ``HeadAttention`` reads, per layer ``[Lyr, B, Hkv, W]``."""

    blocks: torch.Tensor  # the block of each column's slot
    offsets: torch.Tensor  # its offset in the block
    heads: torch.Tensor  # its KV head
    mask: torch.Tensor  # [Lyr, B, Hkv, T, W] bool: the columns query t attends (causal over appended slots)


@dataclass(frozen=True)
class TokenMoves:
    """A step's tokens of ``plan_attention``'s requests, moved from where vLLM wrote them (block
    ``src_block``, offset ``src_offset``, every head) into each head's lane (``dst_block``,
    ``dst_offset`` per layer) by ``move_tokens``."""

    src_block: torch.Tensor  # [M]: M = a (request, token, head) each
    src_offset: torch.Tensor  # [M]
    head: torch.Tensor  # [M]
    dst_block: torch.Tensor  # [Lyr, M]
    dst_offset: torch.Tensor  # [Lyr, M]


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
    max_blocks]``, the requests' block tables), causal over the step's appended slots; and where
    the step's tokens move (``Lanes.token_moves``, every request at once)."""
    kv_heads = steps[0].lanes.counts.shape[1]
    t = torch.tensor([s.tokens for s in steps])
    held = torch.tensor([s.held for s in steps])
    end = torch.tensor([s.end for s in steps])
    # Each head's own slots after the step (``Lanes.own``), every request at once: [B, Lyr, Hkv].
    own = own_slots(torch.stack([s.lanes.counts for s in steps]), held[:, None, None],
                    torch.tensor([s.lanes.start for s in steps])[:, None, None])
    t_max = int(t.max())
    queries = torch.arange(t_max)
    token_valid = queries < t[:, None]
    token_idx = torch.where(token_valid, end[:, None] - t[:, None] + queries, 0)
    # The step's tokens, request-major (token k of request j), each moved per head: token-major, head-minor.
    row = torch.repeat_interleave(torch.arange(len(steps)), t)  # [N]
    k = torch.arange(row.numel()) - torch.repeat_interleave(torch.cumsum(t, 0) - t, t)
    src_slot = (held[row] - t[row] + k).repeat_interleave(kv_heads)  # where vLLM wrote it: [N * Hkv]
    dst_slot = (own[row] - (t[row] - k)[:, None, None]).transpose(0, 1).flatten(1)  # [Lyr, N * Hkv]
    row = row.repeat_interleave(kv_heads)
    moves = TokenMoves(tables[row, src_slot // block_size].to(device), (src_slot % block_size).to(device),
                       torch.arange(kv_heads).repeat(len(row) // kv_heads).to(device),
                       tables[row[None], dst_slot // block_size].to(device), (dst_slot % block_size).to(device))
    own = own.transpose(0, 1)  # [Lyr, B, Hkv]
    return HeadAttention(token_idx.to(device), token_valid.to(device), own.to(device=device, dtype=torch.int32),
                         tables.to(device), moves, t_max == 1, -(-int(own.max()) // block_size), own, t, block_size)


def _attend_in_place(plan: HeadAttention, layer: int, query: torch.Tensor, output: torch.Tensor, scale: float,
                     kernel: CpuBlocks, q_heads: int, head_dim: int) -> None:
    """``attend`` of one-token steps (``plan.decodes``) by ``kernel`` (vLLM's, reading the blocks in
    place): each (request, KV head) a sequence of the first ``lengths`` slots of its lane."""
    rows = plan.token_idx[:, 0]
    q = query.view(query.shape[0], q_heads, head_dim)[rows]  # [B, Hq, D]
    lengths = plan.lengths[layer]  # [B, Hkv]
    blocks = plan.tables[:, None, : plan.max_blocks].expand(-1, lengths.shape[1], -1)
    out = kernel(q, blocks, lengths, scale)  # [B, Hq, D]
    output.view(output.shape[0], q_heads, -1)[rows] = out.to(output.dtype)


def move_tokens(plan: HeadAttention, layer: int, kv: KV) -> None:
    """After vLLM wrote layer ``layer``'s keys and values of the step (``kv``): each head's copy of
    ``plan``'s requests' new tokens moved to the end of that head's own slots (``TokenMoves``)."""
    m = plan.moves
    for t in kv:
        t[m.dst_block[layer], m.dst_offset[layer], m.head] = t[m.src_block, m.src_offset, m.head]


def attend(plan: HeadAttention, layer: int, kv: KV, query: torch.Tensor, output: torch.Tensor, scale: float,
           q_heads: int, head_dim: int, kernel: CpuBlocks | None = None) -> None:
    """Layer ``layer``'s attention of ``plan``'s requests over each head's own slots only, written
    over their rows of ``output`` (``[T, Hq * D]`` or ``[T, Hq, D]``); ``kv``: the layer's keys and
    values, ``query`` its ``[T, Hq * D]`` queries. One-token steps are read in place by ``kernel``
    (vLLM's) where there is one; else, and for chunks, which a causal mask needs, each head's slots
    are gathered and attended by ``kvpolicy.attend.attend_heads``."""
    if kernel is not None and plan.decodes:
        _attend_in_place(plan, layer, query, output, scale, kernel, q_heads, head_dim)
        return
    b, _ = plan.token_idx.shape
    q = query.view(query.shape[0], q_heads, head_dim)[plan.token_idx]  # [B, T, Hq, D]
    keys, values = kv
    at = plan.gathered
    blocks, offsets, heads = at.blocks[layer], at.offsets[layer], at.heads[layer]
    k, v = keys[blocks, offsets, heads], values[blocks, offsets, heads]  # [B, Hkv, W, D]
    kv_heads, width = k.shape[1], k.shape[2]
    index = torch.arange(b * kv_heads * width, device=k.device).view(b, kv_heads, width)
    out = attend_heads(q.transpose(1, 2).to(k.dtype), k.flatten(0, 2), v.flatten(0, 2), index, at.mask[layer],
                       scaling=scale)  # [B, Hq, T, Dv]
    rows = output.view(output.shape[0], q_heads, -1)
    rows[plan.token_idx[plan.token_valid]] = out.transpose(1, 2)[plan.token_valid].to(rows.dtype)
