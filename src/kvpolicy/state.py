"""Static per-layer cache buffers: keys, values, slot validity and the window of recent queries.

Nothing here imports transformers. Buffers for several layers of one shape live in one
``SlotBuffers`` with a leading layer axis, so the executor can score and compact every layer that
is due in a single batched call without stacking copies. Capacity is fixed at the first append
(``schedule.capacity_for(prompt_len)``: ``budget + interval`` in steady state) and never changes
while decoding; only a later multi-token chunk that does not fit grows it, once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .schedule import Schedule


class SlotBuffers:
    """Keys ``[Lyr, B, Hkv, cap, D]``, values ``[Lyr, B, Hkv, cap, Dv]`` and per-slot metadata."""

    def __init__(
        self,
        num_layers: int,
        batch: int,
        kv_heads: int,
        capacity: int,
        head_dim: int,
        value_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, batch, kv_heads, capacity)
        self.keys = torch.zeros(*shape, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros(*shape, value_dim, dtype=dtype, device=device)
        self.valid = torch.zeros(shape, dtype=torch.bool, device=device)
        self.positions = torch.full(shape, -1, dtype=torch.long, device=device)

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    def grow(self, capacity: int) -> None:
        """Reallocate to ``capacity`` slots (only for a chunk that cannot fit; never per token)."""
        for name in ("keys", "values", "valid", "positions"):
            old = getattr(self, name)
            new = old.new_full((*old.shape[:3], capacity, *old.shape[4:]), -1 if name == "positions" else 0)
            new[:, :, :, : old.shape[3]] = old
            setattr(self, name, new)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.valid, self.positions))

    def select_rows(self, index: torch.Tensor) -> None:
        """Gather batch rows ``index [B']`` (reorder, repeat or drop rows: beam search, sampling).

        In place (same storage) when the batch size is unchanged; reallocated otherwise.
        """
        for name in ("keys", "values", "valid", "positions"):
            old = getattr(self, name)
            new = old.index_select(1, index.to(old.device))
            if new.shape == old.shape:
                old.copy_(new)
            else:
                setattr(self, name, new)


@dataclass
class EvictionStats:
    """Public counters of one layer."""

    evictions: int = 0
    tokens_seen: int = 0  # padded positions appended (the same for every row)
    slots_held: int = 0
    slots_evicted: int = 0


@dataclass
class LayerState:
    """One attention layer's cache: a view of layer ``index`` in shared ``SlotBuffers``.

    The public flow for a decoding step is ``append`` (new keys/values, with padding flags),
    ``record_queries`` (the step's post-RoPE queries), then attention over ``keys``, ``values``
    and ``valid``. When the schedule fires after an append, ``eviction_due`` turns True; the
    executor evicts before the next append, so the kept set is chosen with the query of the token
    that triggered it in the window.
    """

    schedule: Schedule
    layer_idx: int = 0
    buffers: SlotBuffers | None = None
    index: int = 0  # this layer's position on the buffers' layer axis
    length: int = 0
    seed: int = 0
    stats: EvictionStats = field(default_factory=EvictionStats)
    real_tokens: torch.Tensor | None = None  # [B] real (non-padding) tokens seen per row
    queries: torch.Tensor | None = None  # [B, Hq, W, D] ring of recent queries
    query_valid: torch.Tensor | None = None  # [B, W]
    query_next: int = 0
    eviction_due: bool = False

    # -- views ----------------------------------------------------------------------------
    @property
    def is_allocated(self) -> bool:
        return self.buffers is not None

    @property
    def keys(self) -> torch.Tensor:
        """``[B, Hkv, L, D]`` view of the held slots."""
        return self.buffers.keys[self.index, :, :, : self.length]

    @property
    def values(self) -> torch.Tensor:
        return self.buffers.values[self.index, :, :, : self.length]

    @property
    def valid(self) -> torch.Tensor:
        """``[B, Hkv, L]`` bool: which held slots are real tokens."""
        return self.buffers.valid[self.index, :, :, : self.length]

    @property
    def positions(self) -> torch.Tensor:
        """``[B, Hkv, L]`` long: index of each slot's token among its row's real tokens."""
        return self.buffers.positions[self.index, :, :, : self.length]

    def window(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The query window in time order: ``[B, Hq, W, D]`` and its ``[B, W]`` validity."""
        if self.queries is None:
            raise RuntimeError(
                f"layer {self.layer_idx}: no queries were recorded, but the policy's scorer needs a window"
            )
        order = (torch.arange(self.queries.shape[2], device=self.queries.device) + self.query_next) % self.queries.shape[2]
        return self.queries.index_select(2, order), self.query_valid.index_select(1, order)

    def memory_bytes(self) -> int:
        """Bytes of this layer's static buffers (its share of the shared ones) and query ring."""
        total = 0
        if self.buffers is not None:
            total += self.buffers.nbytes() // self.buffers.keys.shape[0]
        if self.queries is not None:
            total += self.queries.numel() * self.queries.element_size() + self.query_valid.numel()
        return total

    # -- writes ---------------------------------------------------------------------------
    def allocate(self, keys: torch.Tensor, values: torch.Tensor, num_layers: int = 1) -> SlotBuffers:
        """Allocate buffers sized for this first chunk (for ``num_layers`` layers sharing them)."""
        b, h, t, d = keys.shape
        self.buffers = SlotBuffers(
            num_layers, b, h, self.schedule.capacity_for(t), d, values.shape[-1], keys.dtype, keys.device
        )
        return self.buffers

    def append(self, keys: torch.Tensor, values: torch.Tensor, token_valid: torch.Tensor | None = None) -> None:
        """Write a chunk of ``T`` new tokens: keys/values ``[B, Hkv, T, D]``, ``token_valid [B, T]``."""
        if self.eviction_due:
            raise RuntimeError(
                f"layer {self.layer_idx}: an eviction is due; run the executor before appending more tokens"
            )
        if self.buffers is None:
            self.allocate(keys, values)
        b, h, t, _ = keys.shape
        is_prompt = self.stats.tokens_seen == 0
        buf = self.buffers
        if (b, h) != tuple(buf.keys.shape[1:3]) or keys.shape[-1] != buf.keys.shape[-1]:
            raise ValueError(
                f"layer {self.layer_idx}: keys {tuple(keys.shape)} do not match the cache's "
                f"[B={buf.keys.shape[1]}, Hkv={buf.keys.shape[2]}, T, D={buf.keys.shape[4]}]"
            )
        if self.length + t > buf.capacity:
            buf.grow(self.schedule.capacity_for(self.length + t))
        if token_valid is None:
            token_valid = torch.ones(b, t, dtype=torch.bool, device=keys.device)
        token_valid = token_valid.to(device=keys.device, dtype=torch.bool)
        if self.real_tokens is None:
            self.real_tokens = torch.zeros(b, dtype=torch.long, device=keys.device)
        sl = slice(self.length, self.length + t)
        buf.keys[self.index, :, :, sl] = keys
        buf.values[self.index, :, :, sl] = values
        buf.valid[self.index, :, :, sl] = token_valid[:, None, :]
        pos = self.real_tokens[:, None] + token_valid.long().cumsum(-1) - 1
        buf.positions[self.index, :, :, sl] = torch.where(token_valid, pos, -1)[:, None, :]
        self.real_tokens += token_valid.long().sum(-1)
        self.length += t
        self.stats.tokens_seen += t
        self.stats.slots_held = self.length
        if is_prompt:
            # Prefill never evicts by default; with compress_prompt a long prompt is compressed
            # once it is in, before the first decoded token is appended.
            self.eviction_due = self.schedule.compress_prompt and self.length > self.schedule.budget
        else:
            # Decode steps, and later chunks that end exactly where token-by-token decoding would
            # evict (what lets the harness feed long texts interval by interval, exactly).
            self.eviction_due = self.schedule.fires(self.length, self.stats.tokens_seen)

    def record_queries(self, queries: torch.Tensor, query_valid: torch.Tensor | None = None) -> None:
        """Push a chunk's post-RoPE queries ``[B, Hq, T, D]`` into the ring (last ``window`` kept)."""
        w = self.schedule.window
        if w == 0:
            return
        b, hq, t, d = queries.shape
        if self.queries is None:
            self.queries = queries.new_zeros(b, hq, w, d)
            self.query_valid = torch.zeros(b, w, dtype=torch.bool, device=queries.device)
        if query_valid is None:
            query_valid = torch.ones(b, t, dtype=torch.bool, device=queries.device)
        take = min(t, w)
        slots = (torch.arange(take, device=queries.device) + self.query_next) % w
        self.queries[:, :, slots] = queries[:, :, t - take :].to(self.queries.dtype)
        self.query_valid[:, slots] = query_valid[:, t - take :].to(self.query_valid.device)
        self.query_next = (self.query_next + take) % w

    def compact(self, kept: torch.Tensor) -> None:
        """Keep the slots ``kept [B, Hkv, K]`` (ascending), moved to the front, in place."""
        buffers, i = self.buffers, self.index
        compact_rows(buffers, slice(i, i + 1), kept.unsqueeze(0), self.length)
        self.stats.slots_evicted += self.length - kept.shape[-1]
        self.length = kept.shape[-1]
        self.stats.slots_held = self.length
        self.stats.evictions += 1
        self.eviction_due = False

    def select_rows(self, index: torch.Tensor) -> None:
        """Gather the per-row state that is not in the shared buffers (``SlotBuffers.select_rows``
        handles those): real-token counts and the query window."""
        if self.real_tokens is not None:
            self.real_tokens = self.real_tokens.index_select(0, index.to(self.real_tokens.device))
        if self.queries is not None:
            self.queries = self.queries.index_select(0, index.to(self.queries.device))
            self.query_valid = self.query_valid.index_select(0, index.to(self.query_valid.device))

    def reset(self) -> None:
        """Forget every token (buffers stay allocated)."""
        self.length = 0
        self.real_tokens = None
        self.queries = self.query_valid = None
        self.query_next = 0
        self.eviction_due = False
        self.stats = EvictionStats()
        if self.buffers is not None:
            self.buffers.valid[self.index] = False


def compact_rows(buffers: SlotBuffers, layers: slice, kept: torch.Tensor, length: int) -> None:
    """Gather slots ``kept [Lyr, B, Hkv, K]`` of layers ``layers`` to the buffer front, in place.

    ``kept`` is ascending per row, so slot ``kept[j] >= j``; the gather reads every kept slot
    into a ``K``-slot temporary before the write, so the source is never overwritten early.
    """
    k = kept.shape[-1]
    for name in ("keys", "values", "valid", "positions"):
        buf = getattr(buffers, name)[layers]
        src = buf[:, :, :, :length]
        if src.dim() == 5:
            idx = kept[..., None].expand(*kept.shape, src.shape[-1])
        else:
            idx = kept
        buf[:, :, :, :k] = torch.gather(src, 3, idx)
    # Freed slots only need to stop counting as tokens; their keys/values are overwritten later.
    buffers.valid[layers, :, :, k:length] = False
    buffers.positions[layers, :, :, k:length] = -1
