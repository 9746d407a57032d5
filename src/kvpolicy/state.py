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

    evictions: int = 0  # eviction steps (one step may evict several rows)
    tokens_seen: int = 0  # padded positions appended (the same for every row)
    slots_held: int = 0  # the slot extent: slots held by the longest row
    slots_evicted: int = 0  # slots dropped, summed over batch rows


@dataclass
class LayerState:
    """One attention layer's cache: a view of layer ``index`` in shared ``SlotBuffers``.

    Rows are **packed**: row ``r`` holds its ``counts[r]`` real tokens in slots ``[0, counts[r])``,
    in position order, and padding is never stored. Each row follows the schedule on its own
    counts, exactly as if it were decoded alone; rows of a batch whose counts differ (different
    prompt lengths) simply evict at different steps.

    The public flow for a decoding step is ``append`` (new keys/values, with padding flags),
    ``record_queries`` (the step's post-RoPE queries), then attention over ``keys``, ``values``
    and ``valid``. When the schedule fires for a row after an append, the row is due; the
    executor evicts due rows before the next append, so the kept set is chosen with the query of
    the token that triggered it in the window.
    """

    schedule: Schedule
    layer_idx: int = 0
    buffers: SlotBuffers | None = None
    index: int = 0  # this layer's position on the buffers' layer axis
    seed: int = 0
    stats: EvictionStats = field(default_factory=EvictionStats)
    counts: list[int] = field(default_factory=list)  # slots held per row (host side)
    real_tokens: list[int] = field(default_factory=list)  # real tokens seen per row
    due_rows: list[bool] = field(default_factory=list)
    # [B, T] positions of the last chunk's tokens (-1: padding); None after a plain decode step.
    last_query_positions: torch.Tensor | None = None
    queries: torch.Tensor | None = None  # [B, Hq, W, D] ring of recent queries
    query_valid: torch.Tensor | None = None  # [B, W]
    query_next: int = 0

    # -- views ----------------------------------------------------------------------------
    @property
    def is_allocated(self) -> bool:
        return self.buffers is not None

    @property
    def length(self) -> int:
        """The slot extent: slots held by the longest row."""
        return max(self.counts, default=0)

    @property
    def ragged(self) -> bool:
        """True when rows hold different numbers of slots (the shorter ones are masked)."""
        return len(set(self.counts)) > 1

    @property
    def eviction_due(self) -> bool:
        return any(self.due_rows)

    @property
    def keys(self) -> torch.Tensor:
        """``[B, Hkv, L, D]`` view of the held slots (``L`` = the longest row's count)."""
        return self.buffers.keys[self.index, :, :, : self.length]

    @property
    def values(self) -> torch.Tensor:
        return self.buffers.values[self.index, :, :, : self.length]

    @property
    def valid(self) -> torch.Tensor:
        """``[B, Hkv, L]`` bool: slot ``s`` of row ``r`` is valid iff ``s < counts[r]``."""
        return self.buffers.valid[self.index, :, :, : self.length]

    @property
    def positions(self) -> torch.Tensor:
        """``[B, Hkv, L]`` long: index of each slot's token among its row's real tokens (-1: empty)."""
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
        """Write a chunk of ``T`` new tokens: keys/values ``[B, Hkv, T, D]``, ``token_valid [B, T]``.

        Each row's real tokens go right after its held slots; padding tokens are dropped.
        """
        if self.eviction_due:
            raise RuntimeError(
                f"layer {self.layer_idx}: an eviction is due; run the executor before appending more tokens"
            )
        if self.buffers is None:
            self.allocate(keys, values)
        b, h, t, _ = keys.shape
        buf = self.buffers
        if (b, h) != tuple(buf.keys.shape[1:3]) or keys.shape[-1] != buf.keys.shape[-1]:
            raise ValueError(
                f"layer {self.layer_idx}: keys {tuple(keys.shape)} do not match the cache's "
                f"[B={buf.keys.shape[1]}, Hkv={buf.keys.shape[2]}, T, D={buf.keys.shape[4]}]"
            )
        if not self.counts:
            self.counts, self.real_tokens, self.due_rows = [0] * b, [0] * b, [False] * b
        is_prompt = self.stats.tokens_seen == 0
        if token_valid is not None:
            token_valid = token_valid.to(device=keys.device, dtype=torch.bool)
            added = token_valid.sum(-1).tolist()  # one sync per padded chunk (prefill), none when decoding
            if all(a == t for a in added):
                token_valid = None
        else:
            added = [t] * b
        start = self.counts[0]
        needed = max(c + a for c, a in zip(self.counts, added, strict=True))
        if needed > buf.capacity:
            buf.grow(self.schedule.capacity_for(needed))
        i = self.index
        if token_valid is None and not self.ragged:
            # Every row appends the same T real tokens at the same slots: plain slice writes.
            sl = slice(start, start + t)
            buf.keys[i, :, :, sl] = keys
            buf.values[i, :, :, sl] = values
            buf.valid[i, :, :, sl] = True
            if len(set(self.real_tokens)) == 1:  # the decoding hot path: no host-to-device tensor
                first = self.real_tokens[0]
                if t == 1:
                    buf.positions[i, :, :, start] = first
                    qpos = None
                else:
                    qpos = torch.arange(first, first + t, device=keys.device).expand(b, t)
                    buf.positions[i, :, :, sl] = qpos[:, None, :]
            else:
                seen = torch.tensor(self.real_tokens, device=keys.device)
                qpos = seen[:, None] + torch.arange(t, device=keys.device)
                buf.positions[i, :, :, sl] = qpos[:, None, :]
        else:
            seen = torch.tensor(self.real_tokens, device=keys.device)
            if token_valid is None:
                token_valid = torch.ones(b, t, dtype=torch.bool, device=keys.device)
            rank = token_valid.long().cumsum(-1) - 1  # index of each real token in its row's chunk
            qpos = torch.where(token_valid, seen[:, None] + rank, -1)
            rows, cols = token_valid.nonzero(as_tuple=True)
            slots = torch.tensor(self.counts, device=keys.device)[rows] + rank[rows, cols]
            # [nnz, Hkv, D] rows of the chunk scattered to each row's next free slots.
            buf.keys[i][rows, :, slots] = keys[rows, :, cols]
            buf.values[i][rows, :, slots] = values[rows, :, cols]
            buf.valid[i][rows, :, slots] = True
            buf.positions[i][rows, :, slots] = qpos[rows, cols][:, None]
        self.last_query_positions = qpos
        self.counts = [c + a for c, a in zip(self.counts, added, strict=True)]
        self.real_tokens = [r + a for r, a in zip(self.real_tokens, added, strict=True)]
        self.stats.tokens_seen += t
        self.stats.slots_held = self.length
        sched = self.schedule
        if is_prompt:
            # Prefill never evicts by default; with compress_prompt a long prompt is compressed
            # once it is in, before the first decoded token is appended.
            self.due_rows = [sched.compress_prompt and c > sched.budget for c in self.counts]
        else:
            # Decode steps, and later chunks that end exactly where token-by-token decoding would
            # evict (what lets the harness feed long texts interval by interval, exactly).
            self.due_rows = [sched.fires(c, r) for c, r in zip(self.counts, self.real_tokens, strict=True)]

    def record_queries(self, queries: torch.Tensor, query_valid: torch.Tensor | None = None) -> None:
        """Push a chunk's post-RoPE queries ``[B, Hq, T, D]`` into the ring (last ``window`` kept)."""
        w = self.schedule.window
        if w == 0:
            return
        b, hq, t, d = queries.shape
        if self.queries is None:
            self.queries = queries.new_zeros(b, hq, w, d)
            self.query_valid = torch.zeros(b, w, dtype=torch.bool, device=queries.device)
        take = min(t, w)
        if take == 1:  # the decoding hot path: one ring slot, plain indexing
            self.queries[:, :, self.query_next] = queries[:, :, -1]
            self.query_valid[:, self.query_next] = True if query_valid is None else query_valid[:, -1]
        else:
            if query_valid is None:
                query_valid = torch.ones(b, t, dtype=torch.bool, device=queries.device)
            slots = (torch.arange(take, device=queries.device) + self.query_next) % w
            self.queries[:, :, slots] = queries[:, :, t - take :].to(self.queries.dtype)
            self.query_valid[:, slots] = query_valid[:, t - take :].to(self.query_valid.device)
        self.query_next = (self.query_next + take) % w

    def evicted(self, rows: list[int], kept: int) -> None:
        """Book-keeping after the executor compacted ``rows`` to ``kept`` slots each."""
        for r in rows:
            self.stats.slots_evicted += self.counts[r] - kept
            self.counts[r] = kept
            self.due_rows[r] = False
        self.stats.slots_held = self.length
        self.stats.evictions += 1

    def select_rows(self, index: torch.Tensor) -> None:
        """Gather the per-row state that is not in the shared buffers (``SlotBuffers.select_rows``
        handles those): counts, real-token counts and the query window."""
        host = index.tolist()
        if self.counts:
            self.counts = [self.counts[r] for r in host]
            self.real_tokens = [self.real_tokens[r] for r in host]
            self.due_rows = [self.due_rows[r] for r in host]
        if self.queries is not None:
            self.queries = self.queries.index_select(0, index.to(self.queries.device))
            self.query_valid = self.query_valid.index_select(0, index.to(self.query_valid.device))

    def reset(self) -> None:
        """Forget every token (buffers stay allocated)."""
        self.counts, self.real_tokens, self.due_rows = [], [], []
        self.queries = self.query_valid = self.last_query_positions = None
        self.query_next = 0
        self.stats = EvictionStats()
        if self.buffers is not None:
            self.buffers.valid[self.index] = False
            self.buffers.positions[self.index] = -1


def compact_rows(
    buffers: SlotBuffers, layers: slice | torch.Tensor, rows: slice | torch.Tensor, kept: torch.Tensor, count: int
) -> None:
    """Gather slots ``kept [Lyr, R, Hkv, K]`` of the given layers and rows to the front, in place.

    The rows all hold ``count`` slots. ``kept`` is ascending, so slot ``kept[j] >= j``; each
    gather reads every kept slot into a ``K``-slot temporary before the write, so the source is
    never overwritten early. With slices the reads are views; with index tensors (rows out of
    phase with the rest of the batch) only those rows are copied.
    """
    k = kept.shape[-1]
    by_index = isinstance(layers, torch.Tensor) or isinstance(rows, torch.Tensor)
    if by_index:
        lyr = _as_index(layers, buffers.keys.shape[0], kept.device)[:, None]
        row = _as_index(rows, buffers.keys.shape[1], kept.device)[None, :]
    for name in ("keys", "values", "valid", "positions"):
        buf = getattr(buffers, name)
        src = block(buf, layers, rows, count)
        idx = kept[..., None].expand(*kept.shape, src.shape[-1]) if src.dim() == 5 else kept
        gathered = torch.gather(src, 3, idx)
        if by_index:
            buf[lyr, row, :, :k] = gathered
        else:
            buf[layers, rows, :, :k] = gathered
    # Freed slots only need to stop counting as tokens; their keys/values are overwritten later.
    for name, empty in (("valid", False), ("positions", -1)):
        buf = getattr(buffers, name)
        if by_index:
            buf[lyr, row, :, k:count] = empty
        else:
            buf[layers, rows, :, k:count] = empty


def block(t: torch.Tensor, layers: slice | torch.Tensor, rows: slice | torch.Tensor, count: int) -> torch.Tensor:
    """``t[layers, rows, :, :count]`` of a ``[Lyr, B, Hkv, cap, ...]`` buffer: a view when both
    selections are slices, an indexed copy otherwise."""
    if isinstance(layers, slice) and isinstance(rows, slice):
        return t[layers, rows, :, :count]
    lyr = _as_index(layers, t.shape[0], t.device)[:, None]
    row = _as_index(rows, t.shape[1], t.device)[None, :]
    return t[lyr, row, :, :count]


def _as_index(sel: slice | torch.Tensor, size: int, device: torch.device) -> torch.Tensor:
    if isinstance(sel, torch.Tensor):
        return sel.to(device)
    return torch.arange(size, device=device)[sel]
