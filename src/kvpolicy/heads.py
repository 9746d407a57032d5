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
"""

from __future__ import annotations

import torch


class HeadLayout:
    """Deficits ``[Lyr, B, Hkv]`` (long, on the buffers' device) of a per-head layer group."""

    def __init__(self, num_layers: int, batch: int, kv_heads: int, device: torch.device) -> None:
        self.deficit = torch.zeros(num_layers, batch, kv_heads, dtype=torch.long, device=device)
        self.even = True  # every deficit is 0 (before the first eviction): the even code paths apply
        self._shift: tuple[int, torch.Tensor] | None = None

    def set_deficit(self, layers: slice, rows: slice | torch.Tensor, deficit: torch.Tensor) -> None:
        """After an eviction: the new deficits of ``rows`` on every layer."""
        self.deficit[layers, rows] = deficit
        self.even = False
        self._shift = None

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
        row_slot = torch.arange(width, device=shift.device) + (counts.to(shift.device)[:, None] - width)  # [R, W]
        valid = row_slot[None, :, None, :] >= deficit[..., None]
        flat = torch.where(valid, shift[..., None] + row_slot[None, :, None, :], 0)
        return flat, valid

    def width(self, counts: torch.Tensor, rows: slice | torch.Tensor = slice(None)) -> int:
        """Slots held by the fullest head of these rows (``counts [R]``), on any layer (one sync)."""
        return int((counts.to(self.deficit.device)[None, :, None] - self.deficit[:, rows]).max())

    def select_rows(self, index: torch.Tensor) -> None:
        self.deficit = self.deficit.index_select(1, index)
        self._shift = None


def attend_heads(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor,
    *,
    scaling: float | None = None,
) -> torch.Tensor:
    """Exact attention over a flat per-head layout.

    Args:
        query: ``[B, Hq, T, D]``; query head ``h*G + g`` reads KV head ``h``.
        keys: ``[B, S, D]`` one row's slots, every head's in turn; values ``[B, S, Dv]``.
        visible: ``[B, Hkv, T, S]`` bool, which flat slots each KV head's query ``t`` attends.

    Returns ``[B, Hq, T, Dv]``. One matrix product scores every head's queries against the whole
    row (the ragged heads cannot be batched as equal blocks), masked to the head's own slots.
    """
    b, hq, t, d = query.shape
    s, hkv = keys.shape[1], visible.shape[1]
    g = hq // hkv
    scale = d**-0.5 if scaling is None else scaling
    scores = torch.matmul(query.reshape(b, hq * t, d) * scale, keys.transpose(1, 2)).view(b, hkv, g, t, s)
    scores = scores.masked_fill_(~visible[:, :, None], float("-inf"))
    # Softmax in float32 at least (half-precision caches), as attention kernels do.
    weights = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1).to(values.dtype)
    return torch.matmul(weights.view(b, hq * t, s), values).view(b, hq, t, values.shape[-1])
