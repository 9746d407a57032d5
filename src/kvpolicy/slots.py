"""Slot storage: the static key/value/position buffers of a group of layers, what one step writes
into them, and the gathers that compact them. Pure tensor code: no schedule, no policy.

Keys are ``[Lyr, B, Hkv, cap, D]``: every head of a row has ``cap`` slots. Under a per-head
allocation heads of a row hold different counts, and each layer's ``[B, Hkv * cap]`` slots are
then read as one flat run per row, head after head (``kvpolicy.heads.HeadLayout``): the same
memory, so nothing is padded up to the largest head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class SlotBuffers:
    """Keys ``[Lyr, B, Hkv, cap, D]``, values ``[Lyr, B, Hkv, cap, Dv]`` and positions
    ``[Lyr, B, Hkv, cap]`` of the layers of one group."""

    def __init__(
        self, num_layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, value_dim: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        shape = (num_layers, batch, kv_heads, capacity)
        self.keys = torch.zeros(*shape, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros(*shape, value_dim, dtype=dtype, device=device)
        self.positions = torch.full(shape, -1, dtype=torch.long, device=device)

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    def tensors(self) -> tuple[tuple[str, torch.Tensor], ...]:
        return (("keys", self.keys), ("values", self.values), ("positions", self.positions))

    def grow(self, capacity: int) -> None:
        """Reallocate to ``capacity`` slots (only for a chunk that cannot fit; never per token)."""
        for name, old in self.tensors():
            new = old.new_full((*old.shape[:3], capacity, *old.shape[4:]), -1 if name == "positions" else 0)
            new[:, :, :, : old.shape[3]] = old
            setattr(self, name, new)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors())

    def select_rows(self, index: torch.Tensor) -> None:
        """Gather batch rows ``index [B']``: in place when the batch size is unchanged."""
        for name, old in self.tensors():
            new = old.index_select(1, index.to(old.device))
            if new.shape == old.shape:
                old.copy_(new)
            else:
                setattr(self, name, new)


@dataclass(frozen=True)
class StepPlan:
    """Where one step's ``T`` tokens go, and what its queries may attend (the same on every layer).

    Row slots: real token ``cols[i]`` of row ``rows[i]`` goes to the row's slot ``slots[i]``
    (``slots`` counts the row's tokens held, as if every head held them all). When every row
    appends ``T`` real tokens after the same count, ``start`` is that count and the scatter is
    None (the decoding hot path). ``mask`` is ``[B, 1, T, L]`` bool over the row slots after the
    step, or None when every row holds the same slots and the new tokens are the last ``T`` of
    them (plain causal attention). ``sees [B, T]`` (with ``mask``): the row slots below it are
    what each query attends.
    """

    tokens: int
    batch: int
    start: int | None
    rows: torch.Tensor | None
    cols: torch.Tensor | None
    slots: torch.Tensor | None
    mask: torch.Tensor | None
    ring_slots: slice | torch.Tensor
    ring_take: int
    written_from: int = 0  # row slots [written_from, written_to) of some row receive the step's tokens
    written_to: int = 0
    sees: torch.Tensor | None = None


def compact_rows(buffers: SlotBuffers, rows: slice | torch.Tensor, kept: torch.Tensor, count: int) -> None:
    """Gather slots ``kept [Lyr, R, Hkv, K]`` of every layer of ``rows`` to the front, in place.

    The rows all hold ``count`` slots, and their positions are written out. ``kept`` is
    ascending, so slot ``kept[j] >= j``; each gather reads every kept slot into a ``K``-slot
    temporary before the write, so the source is never overwritten early. With a slice of rows
    the reads are views; with an index (rows out of phase with the batch) those rows are copied.
    """
    k = kept.shape[-1]
    for _, buf in buffers.tensors():
        src = block(buf, rows, count)
        gathered = gather_slots(src, kept) if src.dim() == 5 else torch.gather(src, 3, kept)
        if isinstance(rows, slice):
            buf[:, rows, :, :k] = gathered
        else:
            buf[:, rows.to(buf.device), :, :k] = gathered


def gather_slots(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x [..., N, D]`` at slots ``index [..., K]``: ``[..., K, D]``, what ``torch.gather`` along
    ``N`` with the index expanded over ``D`` gives.

    Why not ``gather``: it reads a ``[..., K, D]`` index. Here each slot is one row of ``D``
    contiguous numbers in ``x``'s storage (a view of the cache's buffers, whatever its leading
    strides), so one ``index_select`` of rows with a ``[... * K]`` index does it, several times
    faster. Falls back to ``gather`` for layouts where slots are not such rows.
    """
    *lead, n, d = x.shape
    strides = x.stride()
    if x.dim() < 2 or strides[-1] != 1 or strides[-2] != d or any(s % d for s in strides[:-2]):
        return torch.gather(x, -2, index[..., None].expand(*index.shape, d))
    offset = torch.zeros((), dtype=torch.long, device=x.device)
    for axis, (size, stride) in enumerate(zip(lead, strides[:-2], strict=True)):
        shape = [1] * len(lead)
        shape[axis] = size
        offset = offset + torch.arange(size, device=x.device).view(shape) * (stride // d)
    rows = (offset[..., None] + index.to(x.device)).reshape(-1)
    last = sum((size - 1) * (stride // d) for size, stride in zip(lead, strides[:-2], strict=True)) + n
    flat = x.as_strided((last, d), (d, 1))  # every slot row of x, as one [rows, D] view
    return flat.index_select(0, rows).view(*index.shape, d)


def block(t: torch.Tensor, rows: slice | torch.Tensor, count: int) -> torch.Tensor:
    """``t[:, rows, :, :count]`` of a ``[Lyr, B, Hkv, cap, ...]`` buffer: a view for a slice of
    rows, an indexed copy otherwise."""
    if isinstance(rows, slice):
        return t[:, rows, :, :count]
    return t[:, rows.to(t.device), :, :count]
