"""Slot storage: the static per-slot buffers of a group of layers, what one step writes into
them, and the gathers that compact them. Pure tensor code: no schedule, no policy.

Every per-slot buffer is ``[Lyr, B, Hkv, cap, ...]``: every head of a row has ``cap`` slots. How a
group's rows and heads use those slots is its layout's business (``kvpolicy.layouts``): even
rows, per-head runs (each layer's ``[B, Hkv * cap]`` slots read as one flat run per row, head
after head: the same memory), or select mode's full rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .query_ring import RingClaim

if TYPE_CHECKING:
    from .stages.base import StateField


class SlotBuffers:
    """The per-slot buffers of the layers of one group, each an attribute named in ``fill``
    (with what an empty slot holds): keys ``[Lyr, B, Hkv, cap, D]``, values ``[Lyr, B, Hkv, cap,
    Dv]`` and positions ``[Lyr, B, Hkv, cap]`` (-1: no token). Layouts move every one of them
    together (write, grow, compact, reorder rows, count bytes), so a field added here is carried
    along by each layout."""

    def __init__(
        self, num_layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, value_dim: int,
        dtype: torch.dtype, device: torch.device, state: Mapping[str, StateField] | None = None,
    ) -> None:
        shape = (num_layers, batch, kv_heads, capacity)
        self.keys = torch.zeros(*shape, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros(*shape, value_dim, dtype=dtype, device=device)
        self.positions = torch.full(shape, -1, dtype=torch.long, device=device)
        self.fill: dict[str, float] = {"keys": 0, "values": 0, "positions": -1}
        #: Per-(row, KV head) state fields ``[Lyr, B, Hkv]``: moved with rows, not with slots.
        self.head_state: dict[str, torch.Tensor] = {}
        self.head_fill: dict[str, float] = {}
        #: Every state field's ``StateField``: fresh values come from its ``initial_values``.
        self.state_specs: dict[str, StateField] = dict(state or {})
        #: Whether a per-slot field starts at its token's position (``initial="position"``):
        #: ``new_tokens`` then needs the new tokens' positions.
        self.needs_positions = any(spec.initial == "position" for spec in self.state_specs.values())
        empty = torch.full((), -1, dtype=torch.long)  # an empty slot's position
        for name, spec in self.state_specs.items():
            if spec.per == "slot":
                setattr(self, name, spec.initial_values(self.positions))  # every slot empty
                self.fill[name] = spec.initial_values(empty).item()
            else:
                self.head_state[name] = spec.initial_head_values(shape[:3], device)
                self.head_fill[name] = spec.initial_head_values((), "cpu").item()

    @property
    def slot_state(self) -> tuple[str, ...]:
        """Names of the per-slot state fields (every field but keys, values and positions)."""
        return tuple(name for name in self.fill if name not in ("keys", "values", "positions"))

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    def replace(self, name: str, tensor: torch.Tensor) -> None:
        """Field ``name`` is ``tensor`` from now on (grown, reordered)."""
        setattr(self, name, tensor)

    def tensors(self) -> tuple[tuple[str, torch.Tensor], ...]:
        """Every per-slot buffer, ``(name, tensor)``."""
        return tuple((name, getattr(self, name)) for name in self.fill)

    def empty(self, name: str, capacity: int) -> torch.Tensor:
        """A new buffer for field ``name`` with ``capacity`` slots, every slot empty."""
        old: torch.Tensor = getattr(self, name)
        return old.new_full((*old.shape[:3], capacity, *old.shape[4:]), self.fill[name])

    def grow(self, capacity: int) -> None:
        """Reallocate to ``capacity`` slots, each slot where it was (only for a chunk that cannot
        fit; never per token)."""
        for name, old in self.tensors():
            new = self.empty(name, capacity)
            new[:, :, :, : old.shape[3]] = old
            self.replace(name, new)

    def nbytes(self) -> int:
        tensors = [t for _, t in self.tensors()] + list(self.head_state.values())
        return sum(t.numel() * t.element_size() for t in tensors)

    def slot_nbytes(self) -> int:
        """Bytes one slot of one head takes in every per-slot buffer (key, value, position and
        per-slot state): what ``held_bytes`` counts per held token and head."""
        return sum(t[0, 0, 0, 0].numel() * t.element_size() for _, t in self.tensors()) if self.capacity else 0

    def held_bytes(self, held_slots: int) -> int:
        """Bytes of ``held_slots`` held slots (summed over layers, rows and KV heads), plus the
        per-head state: ``nbytes`` with the buffers' room counted only where it holds a token."""
        return held_slots * self.slot_nbytes() + sum(t.numel() * t.element_size() for t in self.head_state.values())

    def select_rows(self, index: torch.Tensor) -> None:
        """Gather batch rows ``index [B']``: in place when the batch size is unchanged."""
        for name, old in self.tensors():
            new = old.index_select(1, index.to(old.device))
            if new.shape == old.shape:
                old.copy_(new)
            else:
                self.replace(name, new)
        for name, old in self.head_state.items():
            self.head_state[name] = old.index_select(1, index.to(old.device))

    def new_tokens(self, batch: int, tokens: int, positions: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The per-slot state of ``tokens`` new tokens of ``batch`` rows, each field's
        ``StateField.initial_values`` (``[B, Hkv, T]`` views expanded over the heads; empty
        without state). ``positions [B, T]`` long: each new token's position (-1 for padding),
        needed when ``needs_positions`` (None: constant fields only)."""
        out: dict[str, torch.Tensor] = {}
        if not self.slot_state:
            return out
        if positions is None and self.needs_positions:
            raise ValueError("a state field starts at its token's position: new_tokens needs the positions")
        for name in self.slot_state:
            t: torch.Tensor = getattr(self, name)
            if self.state_specs[name].initial == "position":
                assert positions is not None
                fresh = self.state_specs[name].initial_values(positions.to(t.device)[:, None, :])  # [B, 1, T]
            else:  # a constant: one element, expanded (a decode step allocates nothing per layer)
                fresh = t.new_full((), self.fill[name])
            out[name] = fresh.expand(batch, t.shape[2], tokens)
        return out


@dataclass(frozen=True)
class Contiguous:
    """Every row appends the step's ``T`` tokens, all real, at row slots ``[start, start + T)``:
    one slice for every row (the decoding hot path). Every held slot is a real token and the new
    ones are the last ``T``, so queries attend plainly causally (no mask)."""

    start: int


@dataclass(frozen=True)
class Scattered:
    """Rows append at different slots, or the step holds padding: real token ``cols[i]`` of row
    ``rows[i]`` goes to the row's slot ``slots[i]`` (``[nnz]`` device tensors). Query ``t`` of
    row ``b`` attends the row slots below ``sees[b, t]`` (``[B, T]``), which ``mask [B, 1, T,
    L]`` spells out over the ``L`` row slots held after the step."""

    rows: torch.Tensor
    cols: torch.Tensor
    slots: torch.Tensor
    sees: torch.Tensor
    mask: torch.Tensor

    @classmethod
    def of(
        cls, before: torch.Tensor, t: int, token_valid: torch.Tensor | None, length: int, device: torch.device,
    ) -> Scattered:
        """A step of ``t`` tokens (``token_valid [B, T]``, None: all real) after rows holding
        ``before [B]`` (host) slots, ``length`` row slots held after it by the longest row."""
        b = before.shape[0]
        before_dev = before.to(device)
        if token_valid is None:  # every token real, rows holding different counts
            rank = torch.arange(t, device=device).expand(b, t)
            rows = torch.arange(b, device=device).repeat_interleave(t)
            cols = torch.arange(t, device=device).repeat(b)
            real = torch.ones(b, t, dtype=torch.bool, device=device)
        else:
            real = token_valid.to(device)
            rank = real.long().cumsum(-1) - 1  # index of each real token among its row's new ones
            rows, cols = real.nonzero(as_tuple=True)
        slot = torch.arange(length, device=device)
        # A real query of rank p sees its row's held slots and the first p + 1 new ones.
        sees = torch.where(real, before_dev[:, None] + rank + 1, 0)  # [B, T]
        mask = slot[None, None, :] < sees[:, :, None]  # [B, T, L]
        # A padding query, or a row holding no slot yet, attends slot 0: finite, never read.
        mask |= ~mask.any(-1, keepdim=True) & (slot == 0)
        return cls(rows, cols, before_dev[rows] + rank[rows, cols], sees, mask[:, None])


@dataclass(frozen=True)
class StepPlan:
    """Where one step's ``T`` tokens go, and what its queries may attend (the same on every layer).

    Slots are row slots: the index a slot has if every head holds the row's tokens (the
    per-head layout maps them to its runs). ``placement`` says where the tokens go, ``ring``
    which query-window entries they claim; row slots ``[written_from, written_to)`` of some row
    receive the step's tokens.
    """

    tokens: int
    batch: int
    placement: Contiguous | Scattered
    ring: RingClaim
    written_from: int
    written_to: int

    @property
    def mask(self) -> torch.Tensor | None:
        """``[B, 1, T, L]`` bool over the row slots held after the step, or None: plain causal
        attention (every row holds the same slots and the new tokens are the last ``T``)."""
        return None if isinstance(self.placement, Contiguous) else self.placement.mask


def compact_rows(
    buffers: SlotBuffers, rows: slice | torch.Tensor, kept: torch.Tensor, count: int,
    sources: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Gather slots ``kept [Lyr, R, Hkv, K]`` of every layer of ``rows`` to the front, in place.

    The rows all hold ``count`` slots, and their positions are written out. ``kept`` is
    ascending, so slot ``kept[j] >= j``; each gather reads every kept slot into a ``K``-slot
    temporary before the write, so the source is never overwritten early. With a slice of rows
    the reads are views; with an index (rows out of phase with the batch) those rows are copied.
    ``sources`` replaces some fields' held slots (``[Lyr, R, Hkv, count]``: the state an
    eviction brought up to date) before the gather.
    """
    k = kept.shape[-1]
    for name, buf in buffers.tensors():
        src = sources[name] if sources and name in sources else block(buf, rows, count)
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


def gather_pages(x: torch.Tensor, rows: slice | torch.Tensor, pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Whole pages of ``P = page_size`` slots from slot 0 of ``x [B, Hkv, cap, D]`` (a layer's
    buffer): for ``rows`` (a slice, or ``R`` device indices) the pages ``pages [R, Hkv, k]``
    (each below ``ceil(cap / P)``), as ``[R, Hkv, k * P, D]``, page after page.

    A contiguous ``x`` of whole pages (``cap % P == 0``, as select mode allocates under a page
    choice) is read as ``[B * Hkv * cap / P, P * D]`` rows, one ``index_select`` of ``k`` rows
    per head: no index per slot is built and the rows are not copied out first. Otherwise the
    ``[B, Hkv, cap // P, P, D]`` view is indexed (a last, short page cannot be read then)."""
    b, hkv, cap, d = x.shape
    device = pages.device
    row_index = torch.arange(b, device=device)[rows] if isinstance(rows, slice) else rows.to(device)
    heads = torch.arange(hkv, device=device)
    whole = cap // page_size
    shape = (row_index.numel(), hkv, pages.shape[-1] * page_size, d)
    if cap % page_size == 0 and x.is_contiguous():
        first = (row_index[:, None] * hkv + heads) * whole  # [R, Hkv]: each head's first page
        return x.view(-1, page_size * d).index_select(0, (first[..., None] + pages).flatten()).view(shape)
    paged = x[:, :, : whole * page_size].unflatten(2, (whole, page_size))  # [B, Hkv, cap // P, P, D]
    return paged[row_index[:, None, None], heads[None, :, None], pages].reshape(shape)


def block(t: torch.Tensor, rows: slice | torch.Tensor, count: int) -> torch.Tensor:
    """``t[:, rows, :, :count]`` of a ``[Lyr, B, Hkv, cap, ...]`` buffer: a view for a slice of
    rows, an indexed copy otherwise."""
    if isinstance(rows, slice):
        return t[:, rows, :, :count]
    return t[:, rows.to(t.device), :, :count]
