"""Heads of a row holding different numbers of slots, in the same memory as even ones.

Under a per-head allocation (Ada-KV, head profiles) each head of a row keeps its own count after
an eviction, and all heads then append the same tokens. The layer's ``[B, Hkv, cap]`` slots are
read as one flat run of ``Hkv * cap`` slots per row, head after head, each head's slots followed
by the same free room ``cap - L`` (``L``: the row's mean count, what the schedule counts). So the
buffers hold exactly the kept slots plus the append headroom, and nothing is padded up to the
largest head.

One number per (layer, row, head) says where everything is: the head's **deficit**
``d = L - len``, constant between evictions (the head and the row grow together). Row slot ``s``
(the index a slot would have if every head held ``L``) of head ``h`` lives at flat slot
``shift_h + s`` with ``shift_h = h * cap - (d_0 + ... + d_h)``, for ``s`` in ``[d_h, L)``. With every
deficit 0 that is ``h * cap + s``: the even layout, slot for slot.

``HeadLayout`` is that addressing, and the only code that computes flat slots; the per-head
layout (``kvpolicy.layouts.HeadRuns``) reads and moves slots through it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .attend import attend_heads  # noqa: F401  (its documented home before kvpolicy.attend)


def own_columns(own: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The one column order of heads holding different counts, for every engine (a policy's
    seeded draws depend on it): each head's ``own [...]`` held slots right-aligned in ``width``
    columns, oldest first. Returns ``(j, valid)``, ``[..., width]`` each: column ``c`` holds the
    head's slot ``j = c - (width - own)`` (counted from its oldest), a slot where ``j >= 0``."""
    j = torch.arange(width, device=own.device) - (width - own[..., None])
    return j, j >= 0


class ReadPlan(NamedTuple):
    """What every step of a per-head group needs, fixed between evictions (``HeadLayout``)."""

    capacity: int  # the slots per head it was built for
    origin: torch.Tensor  # [Lyr, B, Hkv]: where row slot 0 of each head would be, in the layer's [B * Hkv * cap]
    first: torch.Tensor  # [Lyr, B, Hkv]: each head's first held slot, likewise
    cols: torch.Tensor  # 0 .. Hkv * cap - 1
    most: list[int]  # each layer's largest surplus over its rows (host ints)


class FlatMove(NamedTuple):
    """Slot moves within each (layer, row) flat run of ``Hkv * cap`` slots: ``[M]`` device
    indices, slot ``src[m]`` of layer ``layers[m]``, row ``rows[m]`` goes to slot ``dst[m]``."""

    layers: torch.Tensor
    rows: torch.Tensor
    src: torch.Tensor
    dst: torch.Tensor

    def apply(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Move the slots of ``source [Lyr, B, Hkv, cap, ...]`` into ``target`` (``source``
        itself to move in place: every moved slot is read before any is written)."""
        flat = target.flatten(2, 3)
        src = flat if source is target else source.flatten(2, 3)
        flat[self.layers, self.rows, self.dst] = src[self.layers, self.rows, self.src]


class HeadLayout:
    """Deficits ``[Lyr, B, Hkv]`` (long, on the buffers' device) of a per-head layer group."""

    def __init__(self, num_layers: int, batch: int, kv_heads: int, device: torch.device) -> None:
        self.deficit = torch.zeros(num_layers, batch, kv_heads, dtype=torch.long, device=device)
        self.even = True  # every deficit is 0 (before the first eviction): the even code paths apply
        self._shift: tuple[int, torch.Tensor] | None = None
        self._surplus: torch.Tensor | None = None
        self._reads: ReadPlan | None = None

    def _changed(self) -> None:
        self._shift = self._surplus = self._reads = None

    def set_deficit(self, layers: slice, rows: slice | torch.Tensor, deficit: torch.Tensor) -> None:
        """After an eviction: the new deficits of ``rows`` on every layer."""
        self.deficit[layers, rows] = deficit
        self.even = False
        self._changed()

    def surplus(self) -> torch.Tensor:
        """``[Lyr, B]`` on the host: slots the fullest head of each (layer, row) holds beyond the
        row's count. Constant between evictions (all heads grow together), so reading it syncs
        once per eviction, not once per step."""
        if self._surplus is None:
            self._surplus = (-self.deficit).amax(-1).cpu()
        return self._surplus

    def shift(self, capacity: int) -> torch.Tensor:
        """``[Lyr, B, Hkv]``: flat slot of row slot ``s`` of head ``h`` is ``shift[..., h] + s``."""
        if self._shift is None or self._shift[0] != capacity:
            h = torch.arange(self.deficit.shape[-1], device=self.deficit.device)
            self._shift = (capacity, h * capacity - self.deficit.cumsum(-1))
        return self._shift[1]

    def slots(
        self, capacity: int, counts: torch.Tensor, width: int, layers: slice | torch.Tensor = slice(None),
        rows: slice | torch.Tensor = slice(None),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every head's slots, right-aligned in ``width`` columns: ``(flat [Lyr, R, Hkv, width],
        valid [Lyr, R, Hkv, width])``. Column ``p`` of a row holding ``L = counts[r]`` is row slot
        ``p + L - width``; columns before the head's first slot are invalid (flat index 0)."""
        shift = self.shift(capacity)[layers][:, rows]
        deficit = self.deficit[layers][:, rows]
        j, valid = own_columns(counts.to(shift.device)[:, None] - deficit, width)  # row slot d_h + j
        flat = torch.where(valid, (shift + deficit)[..., None] + j, 0)
        return flat, valid

    def width(
        self, counts: torch.Tensor, rows: slice | torch.Tensor = slice(None), layers: slice = slice(None),
    ) -> int:
        """Slots held by the fullest head of these rows (``counts [R]``, on the host) on these layers."""
        rows = rows.cpu() if isinstance(rows, torch.Tensor) else rows
        return int((counts.cpu()[None, :] + self.surplus()[layers][:, rows]).max())

    def _read_plan(self, capacity: int) -> ReadPlan:
        """What every step needs, fixed between evictions (built once after each)."""
        if self._reads is None or self._reads.capacity != capacity:
            b, hkv = self.deficit.shape[1:]
            origin = self.shift(capacity) + torch.arange(b, device=self.deficit.device)[:, None] * (hkv * capacity)
            cols = torch.arange(hkv * capacity, device=self.deficit.device)
            self._reads = ReadPlan(capacity, origin, origin + self.deficit, cols, self.surplus().amax(1).tolist())
        return self._reads

    def append_index(self, capacity: int, layer: int, start: int, tokens: int) -> torch.Tensor:
        """``[B * Hkv * T]``: where row slots ``start .. start + T - 1`` of every head of ``layer``
        live in its ``[B * Hkv * cap]`` slots (a step appending the same slots to every row)."""
        reads = self._read_plan(capacity)
        return (reads.origin[layer][..., None] + reads.cols[start : start + tokens]).flatten()

    def runs_index(self, capacity: int, row_slots: torch.Tensor) -> torch.Tensor:
        """``[Lyr, B, Hkv, n]``: where row slots ``row_slots [n]`` (device) of every head live in
        its row's ``[Hkv * cap]`` slots."""
        return self.shift(capacity)[..., None] + row_slots

    def scatter_index(self, capacity: int, layer: int, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """``[nnz, Hkv]``: where row slot ``slots[i]`` of row ``rows[i]`` lives in each head's run
        of ``layer`` (within the row's ``[Hkv * cap]`` slots)."""
        return self.shift(capacity)[layer][rows] + slots[:, None]

    def regrown(self, capacity: int, new_capacity: int, counts: torch.Tensor) -> FlatMove:
        """Where every held slot goes when each head's run grows from ``capacity`` to
        ``new_capacity`` slots (rows holding ``counts [B]``): head ``h``'s slots move by
        ``h * (new_capacity - capacity)``."""
        flat, valid = self.slots(capacity, counts, self.width(counts))
        moved = flat + torch.arange(flat.shape[2], device=flat.device)[:, None] * (new_capacity - capacity)
        lyr, row, _, _ = valid.nonzero(as_tuple=True)
        return FlatMove(lyr, row, flat[valid], moved[valid])

    def compaction(
        self, capacity: int, budget: int, flat: torch.Tensor, keep: torch.Tensor, row_of: torch.Tensor,
    ) -> FlatMove:
        """Where the kept slots go after an eviction of some rows: ``flat [Lyr, R, Hkv, W]`` the
        slots the policy saw (``slots``), ``keep`` (same shape) the ones it kept, ``row_of [R]``
        their batch rows (device). A kept slot's new place is its rank among its row's kept slots
        plus the free room ``cap - budget`` of every head before it (the rows then hold
        ``budget``)."""
        hkv = keep.shape[2]
        rank = keep.flatten(2).long().cumsum(-1).view(keep.shape) - 1
        dest = rank + torch.arange(hkv, device=keep.device)[:, None] * (capacity - budget)
        l_idx, r_idx, _, _ = keep.nonzero(as_tuple=True)
        return FlatMove(l_idx, row_of[r_idx], flat[keep], dest[keep])

    def band(
        self, capacity: int, layer: int, counts: torch.Tensor | int, sees: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What attention over ``layer`` reads: each head's slots in ``W`` columns (its fullest
        head's count), ``(index [B, Hkv, W] into the layer's [B * Hkv * cap] slots, mask [B, Hkv,
        T, W])``. Column ``p`` is the head's ``p``-th held slot (row slot ``d_h + p``).

        ``counts``: each row's count, ``[B]`` on the host, or one int when every row holds the
        same; ``sees [B, T]`` (device): row slots below ``sees[b, t]`` are visible to query ``t``
        (None: a decode step, every held slot). Columns past a head's count point at its first
        slot and are masked: what they gather is a held slot's data, which gets weight 0.
        """
        reads = self._read_plan(capacity)
        first, deficit, cols = reads.first[layer], self.deficit[layer], reads.cols
        if isinstance(counts, int):
            width = counts + reads.most[layer]
            held = counts - deficit  # [B, Hkv]
        else:
            width = int((counts + self.surplus()[layer]).max())
            held = counts.to(deficit.device)[:, None] - deficit
        cols = cols[:width]
        valid = cols < held[..., None]  # [B, Hkv, W]
        index = torch.where(valid, first[..., None] + cols, first[..., None])
        if sees is None:
            return index, valid[:, :, None, :]
        row_slot = cols + deficit[..., None]  # [B, Hkv, W]
        mask = valid[:, :, None, :] & (row_slot[:, :, None, :] < sees[:, None, :, None])  # [B, Hkv, T, W]
        # A padding query (it sees nothing) attends its head's first slot: finite, never read.
        return index, mask | (~mask.any(-1, keepdim=True) & (cols == 0))

    def select_rows(self, index: torch.Tensor) -> None:
        self.deficit = self.deficit.index_select(1, index)
        self._changed()

