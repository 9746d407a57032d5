"""The cache's state: static slot buffers and the per-row bookkeeping of a group of layers.

Nothing here imports transformers, and nothing here chooses what to evict (the executor does).

A ``LayerGroup`` is every layer that shares one ``SlotBuffers`` (same shape, dtype and device).
Layers of one model see the same tokens, so everything per row is stored **once per group**:
slots held, real tokens seen, evictions had, whether an eviction is due, the validity of the
query window. A layer is an index on the buffers' layer axis and a count of the steps it has
written. One decoding step is:

1. ``begin_step`` (the first layer's append): plans where the step's tokens go and which slots
   each query may attend, once for every layer;
2. ``write`` for each layer: its keys, values and queries, into the planned slots;
3. after the last layer, the rows that the schedule says are due are evicted by the executor
   before the next step begins.

Rows are **packed**: row ``r`` holds its ``counts[r]`` real tokens in slots ``[0, counts[r])``
in position order, on every layer and head, and padding is never stored. So slot validity is
``slot < counts[r]`` and needs no buffer. Positions are stored lazily: a slot appended since the
row's last eviction holds the token at ``slot + (tokens[r] - counts[r])``, so the decode step
writes no position; ``materialise_positions`` writes them out when an eviction or a reader
needs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .schedule import Schedule

#: Select mode keeps every token: buffers grow by whole chunks of this many slots.
SELECT_CHUNK = 1024


class CacheStateError(RuntimeError):
    """The cache was used out of order: layers out of step (an interrupted forward, or a cache
    built for another model), or an operation that needs a finished step. ``reset()`` recovers."""


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

    Either ``start`` (every row appends ``T`` real tokens at slots ``[start, start + T)``: the
    decoding hot path) or the scatter ``rows, cols, slots`` (real token ``cols[i]`` of row
    ``rows[i]`` goes to slot ``slots[i]``) is set. ``mask`` is ``[B, 1, T, L]`` bool over the
    slots after the step, or None when every row holds the same slots and the new tokens are
    the last ``T`` of them (plain causal attention).
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
    written_from: int = 0  # slots [written_from, written_to) of some row receive the step's tokens
    written_to: int = 0


@dataclass
class EvictionStats:
    """Public counters of one layer."""

    evictions: int = 0  # eviction steps (one step may evict several rows)
    tokens_seen: int = 0  # padded positions appended (the same for every row)
    slots_held: int = 0  # the slot extent: slots held by the longest row
    slots_evicted: int = 0  # slots dropped, summed over batch rows


class LayerGroup:
    """The layers sharing one ``SlotBuffers``, and their per-row state, stored once.

    Built by the first append of its first layer (``keys [B, Hkv, T, D]``, ``values``,
    ``query_heads`` of the window, ``token_valid [B, T]`` or None), which begins the first step.
    Per-row state lives on the host as ``[B]`` long tensors: the schedule is host control flow,
    and decoding then needs no device-to-host sync.
    """

    def __init__(
        self,
        schedule: Schedule,
        layer_ids: Sequence[int],
        keys: torch.Tensor,
        values: torch.Tensor,
        query_heads: int,
        token_valid: torch.Tensor | None,
        select_mode: bool = False,
        page_sizes: frozenset[int] = frozenset(),
    ) -> None:
        b, h, t, d = keys.shape
        self.schedule = schedule
        self.select_mode = select_mode
        self.member = {layer: i for i, layer in enumerate(layer_ids)}  # global index -> buffer index
        self.layer_ids = torch.tensor(list(layer_ids), dtype=torch.long)
        added = _added(token_valid, b, t)
        self.buffers = SlotBuffers(
            len(layer_ids), b, h, self._capacity(int(added.max())), d, values.shape[-1], keys.dtype, keys.device
        )
        w = schedule.window
        self.ring = keys.new_zeros(len(layer_ids), b, query_heads, w, d)
        self.ring_valid = torch.zeros(b, w, dtype=torch.bool, device=keys.device)
        self.ring_next = 0
        zeros = torch.zeros(b, dtype=torch.long)
        # Per-row counters, [B] host tensors. While every row holds the same slots after the same
        # tokens (no padding: the decoding hot path), ``_alike`` holds them as plain ints instead and
        # the tensors are filled in only when read (``_rows``).
        self._counts = zeros.clone()  # slots held per row, after the current step
        self._counts_before = zeros.clone()  # ... before it (what layers that did not write it yet hold)
        self._tokens = zeros.clone()  # real tokens seen per row
        self._due = torch.zeros(b, dtype=torch.bool)  # the schedule fired: evict before the next step
        self._alike: tuple[int, int, int, bool] | None = (0, 0, 0, False)  # count, before, tokens, due
        self.stored = zeros.clone()  # slots [0, stored) have their positions written out
        self.evictions = zeros.clone()  # evictions each row has had (keys its random draws)
        self.streams = zeros.clone()  # each row's random stream (see kvpolicy.seeds)
        self.extent_now = self.extent_before = 0  # slots held by the longest row, after / before the step
        self.tokens_seen = 0  # padded positions, after the current step
        self.tokens_seen_before = 0
        self.steps = 0  # steps begun
        self.layer_steps = [0] * len(layer_ids)  # steps each layer has written
        self.eviction_steps = 0
        self.slots_evicted = 0
        # Select mode: each layer's current selection [Lyr, B, Hkv, budget], the count each row held
        # when it was chosen (-1: none), and the rows that choose anew at this step.
        self.selection = torch.zeros(
            (len(layer_ids), b, h, schedule.budget) if select_mode else (0,), dtype=torch.long, device=keys.device
        )
        self.selected_at = torch.full((b,), -1, dtype=torch.long)
        self.reselect = torch.zeros(b, dtype=torch.bool)
        # Select mode: per page of P slots, the per-channel min and max of each layer's keys,
        # [Lyr, B, Hkv, pages, D], kept current as tokens arrive (EvictionInput.key_pages).
        self.key_pages: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if select_mode:
            for p in sorted(page_sizes):
                shape = (len(layer_ids), b, h, -(-self.buffers.capacity // p), d)
                self.key_pages[p] = (keys.new_zeros(shape), keys.new_zeros(shape))
        self.plan = self._plan(t, token_valid, added)

    # -- per-row counters ---------------------------------------------------------------------
    def _rows(self) -> None:
        """Fill the per-row tensors from the ints of the alike fast path, and leave it."""
        if self._alike is not None:
            count, before, tokens, due = self._alike
            self._counts.fill_(count)
            self._counts_before.fill_(before)
            self._tokens.fill_(tokens)
            self._due.fill_(due)
            self._alike = None

    def _check_alike(self) -> None:
        """Back to the fast path when every row holds the same slots after the same tokens."""
        c, t = self._counts, self._tokens
        if bool((c == c[0]).all() and (t == t[0]).all() and (self._counts_before == self._counts_before[0]).all()
                and (self._due == self._due[0]).all()):
            self._alike = (int(c[0]), int(self._counts_before[0]), int(t[0]), bool(self._due[0]))

    @property
    def counts(self) -> torch.Tensor:
        """``[B]`` slots held per row (after the current step)."""
        self._rows()
        return self._counts

    @property
    def counts_before(self) -> torch.Tensor:
        self._rows()
        return self._counts_before

    @property
    def tokens(self) -> torch.Tensor:
        """``[B]`` real tokens seen per row."""
        self._rows()
        return self._tokens

    @property
    def due(self) -> torch.Tensor:
        """``[B]`` bool: rows the schedule says must be evicted before the next step."""
        self._rows()
        return self._due

    @property
    def batch_alike(self) -> bool:
        """Whether every row holds the same slots after the same tokens (the int fast path)."""
        return self._alike is not None

    @property
    def any_due(self) -> bool:
        return self._alike[3] if self._alike is not None else bool(self._due.any())

    # -- properties ---------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return self.buffers.keys.shape[1]

    @property
    def device(self) -> torch.device:
        return self.buffers.keys.device

    @property
    def complete(self) -> bool:
        """Whether every layer of the group has written the current step."""
        return all(self.layer_steps[i] == self.steps for i in self.member.values())

    def fits(self, keys: torch.Tensor, values: torch.Tensor) -> bool:
        k, v = self.buffers.keys, self.buffers.values
        return (
            tuple(keys.shape[:2]) == tuple(k.shape[1:3]) and keys.shape[-1] == k.shape[-1]
            and values.shape[-1] == v.shape[-1] and keys.dtype == k.dtype and keys.device == k.device
        )

    def written(self, layer: int) -> bool:
        """Whether ``layer`` has written the current step."""
        return self.layer_steps[self.member[layer]] == self.steps

    def counts_of(self, layer: int) -> torch.Tensor:
        return self.counts if self.written(layer) else self.counts_before

    def slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s held keys and values, ``[B, Hkv, L, D]`` views (``L`` its extent)."""
        i, length = self.member[layer], self.extent(layer)
        return self.buffers.keys[i, :, :, :length], self.buffers.values[i, :, :, :length]

    def extent(self, layer: int) -> int:
        """The slot extent of ``layer``: slots held by its longest row."""
        return self.extent_now if self.written(layer) else self.extent_before

    def memory_bytes(self) -> int:
        """Bytes of the slot buffers, the query window and, in select mode, the selections and
        page summaries."""
        extra = [self.ring, self.ring_valid, self.selection, *(t for pair in self.key_pages.values() for t in pair)]
        return self.buffers.nbytes() + sum(t.numel() * t.element_size() for t in extra)

    # -- a step -------------------------------------------------------------------------------
    def begin_step(self, t: int, token_valid: torch.Tensor | None) -> None:
        """Plan the next step of ``T`` tokens (validity ``[B, T]`` or None) for every layer."""
        self.require_complete("begin a step")
        if self.any_due:
            raise CacheStateError("an eviction is due: the executor must run before the next step")
        self.plan = self._plan(t, token_valid, None if token_valid is None else _added(token_valid, self.batch, t))
        if self.select_mode:
            self._plan_selection(t)

    def _plan(self, t: int, token_valid: torch.Tensor | None, added: torch.Tensor | None) -> StepPlan:
        b, device = self.batch, self.device
        if token_valid is not None and added is not None and bool((added == t).all()):
            token_valid = None  # every token real: the plain path
        if token_valid is None and self._alike is not None:
            return self._plan_alike(t)
        if added is None:
            added = torch.full((b,), t, dtype=torch.long)
        before = self.counts
        after = before + added
        needed = int(after.max())
        if needed > self.buffers.capacity:
            self._grow(self._capacity(needed))
        uniform = token_valid is None and bool((before == before[0]).all())
        start = rows = cols = slots = mask = None
        if uniform:
            start = int(before[0])
        else:
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
            slots = before_dev[rows] + rank[rows, cols]
            slot = torch.arange(needed, device=device)
            # A real query of rank p sees its row's held slots and the first p + 1 new ones.
            sees = torch.where(real, before_dev[:, None] + rank + 1, 0)  # [B, T]
            mask = slot[None, None, :] < sees[:, :, None]  # [B, T, L]
            # A padding query, or a row holding no slot yet, attends slot 0: finite, never read.
            mask |= ~mask.any(-1, keepdim=True) & (slot == 0)
            mask = mask[:, None]
        ring_slots, take = self._advance_ring(t, token_valid)
        is_prompt = self.tokens_seen == 0
        self._counts_before, self._counts = before, after
        self._tokens = self._tokens + added
        self.extent_before, self.extent_now = self.extent_now, needed
        self.tokens_seen_before, self.tokens_seen = self.tokens_seen, self.tokens_seen + t
        self.steps += 1
        sched = self.schedule
        if self.select_mode:
            self._due = torch.zeros(b, dtype=torch.bool)  # select mode never evicts
        elif is_prompt:
            # Prefill never evicts, unless the policy compresses a long prompt once it is in.
            self._due = (after > sched.budget) & sched.compress_prompt
        else:
            # Decode steps, and later chunks that end exactly where token-by-token decoding would
            # evict (what lets the harness feed long texts interval by interval, exactly).
            self._due = sched.fires_rows(after, self._tokens)
        self._check_alike()
        return StepPlan(t, b, start, rows, cols, slots, mask, ring_slots, take, int(before.min()), needed)

    @property
    def selecting(self) -> bool:
        """Whether this step attends a selection (select mode, a decode step after the prompt)."""
        return self.select_mode and self.plan.tokens == 1 and self.tokens_seen_before > 0

    def _grow(self, capacity: int) -> None:
        """Grow the slot buffers (and the page summaries with them) to ``capacity`` slots."""
        self.buffers.grow(capacity)
        for p, (lo, hi) in list(self.key_pages.items()):
            pages = -(-capacity // p)
            grown = [t.new_zeros(*t.shape[:3], pages, t.shape[4]) for t in (lo, hi)]
            for new, old in zip(grown, (lo, hi), strict=True):
                new[:, :, :, : old.shape[3]] = old
            self.key_pages[p] = (grown[0], grown[1])

    def _summarise_pages(self, i: int) -> None:
        """Recompute layer ``i``'s page summaries over the pages this step wrote into: one page
        when decoding. Slots past a row's count are left out (+inf / -inf)."""
        plan = self.plan
        keys = self.buffers.keys[i]  # [B, Hkv, cap, D]
        for p, (lo, hi) in self.key_pages.items():
            first, last = plan.written_from // p, -(-plan.written_to // p)
            block = keys[:, :, first * p : last * p]
            pad = (last - first) * p - block.shape[2]
            if plan.start is not None:  # every row holds `written_to` slots
                full = plan.written_to % p == 0
                empty = (torch.arange(first * p, first * p + block.shape[2], device=keys.device) >= plan.written_to)
                empty = empty[None, None, :, None]
            else:
                full = False
                slot = torch.arange(first * p, first * p + block.shape[2], device=keys.device)
                empty = (slot >= self.counts.to(keys.device)[:, None])[:, None, :, None]  # [B, 1, S, 1]
            if full and pad == 0:
                low = high = block
            else:
                low = torch.nn.functional.pad(block.masked_fill(empty, float("inf")), (0, 0, 0, pad), value=float("inf"))
                high = torch.nn.functional.pad(block.masked_fill(empty, float("-inf")), (0, 0, 0, pad), value=float("-inf"))
            lo[i, :, :, first:last] = low.unflatten(2, (last - first, p)).amin(3)
            hi[i, :, :, first:last] = high.unflatten(2, (last - first, p)).amax(3)

    def _capacity(self, needed: int) -> int:
        """Slots to allocate for ``needed``: the schedule's static capacity when evicting; whole
        chunks of ``SELECT_CHUNK`` slots in select mode, where every token is kept."""
        if self.select_mode:
            return -(-needed // SELECT_CHUNK) * SELECT_CHUNK
        return self.schedule.capacity_for(needed)

    def _plan_selection(self, t: int) -> None:
        """Select mode: which rows choose their slots anew at this step. A decode step of a row
        holding more than ``budget`` slots does when it has no selection yet or chose ``interval``
        or more tokens ago; a multi-token chunk (prompt, later turn) is attended densely and makes
        the next decode step choose anew."""
        self.evictions += self.reselect  # the previous step's selections (they keyed its draws)
        if t > 1 or self.tokens_seen_before == 0:
            self.selected_at.fill_(-1)
            self.reselect = torch.zeros(self.batch, dtype=torch.bool)
            return
        # While rows are alike, their count is one int (reading .counts would leave the fast path).
        counts = self._alike[0] if self._alike is not None else self._counts
        sched = self.schedule
        stale = (self.selected_at < 0) | (counts - self.selected_at >= sched.interval)
        self.reselect = (counts > sched.budget) & stale
        self.selected_at = torch.where(self.reselect, counts, self.selected_at)

    def _plan_alike(self, t: int) -> StepPlan:
        """``_plan`` when every row holds the same slots and every new token is real: ints only."""
        count, _, tokens, _ = self._alike  # type: ignore[misc]
        after = count + t
        if after > self.buffers.capacity:
            self._grow(self._capacity(after))
        ring_slots, take = self._advance_ring(t, None)
        sched = self.schedule
        if self.select_mode:
            due = False
        elif self.tokens_seen == 0:
            due = sched.compress_prompt and after > sched.budget
        else:
            due = sched.fires(after, tokens + t)
        self._alike = (after, count, tokens + t, due)
        self.extent_before, self.extent_now = count, after
        self.tokens_seen_before, self.tokens_seen = self.tokens_seen, self.tokens_seen + t
        self.steps += 1
        return StepPlan(t, self.batch, count, None, None, None, None, ring_slots, take, count, after)

    def _advance_ring(self, t: int, token_valid: torch.Tensor | None) -> tuple[slice | torch.Tensor, int]:
        """Claim the query ring's slots for the step's last ``min(T, W)`` queries."""
        w = self.schedule.window
        take = min(t, w)
        if take == 1:
            ring_slots: slice | torch.Tensor = slice(self.ring_next, self.ring_next + 1)
        else:
            ring_slots = (torch.arange(take, device=self.device) + self.ring_next) % w
        if take:
            self.ring_valid[:, ring_slots] = True if token_valid is None else token_valid[:, t - take:].to(self.device)
            self.ring_next = (self.ring_next + take) % w
        return ring_slots, take

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None) -> None:
        """Write ``layer``'s part of the current step (shapes as planned)."""
        i = self.member[layer]
        if self.layer_steps[i] != self.steps - 1:
            raise CacheStateError(
                f"layer {layer} is out of step with its group (it wrote {self.layer_steps[i]} steps, the group "
                f"began {self.steps}): a forward was interrupted, or the cache serves a model with another layer "
                "layout. Call reset() before reusing the cache."
            )
        plan = self.plan
        if keys.shape[0] != plan.batch or keys.shape[2] != plan.tokens:
            raise CacheStateError(
                f"layer {layer} appends keys {tuple(keys.shape)} but this step was begun with "
                f"{plan.batch} rows of {plan.tokens} tokens"
            )
        buf = self.buffers
        if plan.start is not None:
            sl = slice(plan.start, plan.start + plan.tokens)
            buf.keys[i, :, :, sl] = keys
            buf.values[i, :, :, sl] = values
        else:
            # [nnz, Hkv, D] real tokens scattered to each row's next free slots.
            buf.keys[i][plan.rows, :, plan.slots] = keys[plan.rows, :, plan.cols]
            buf.values[i][plan.rows, :, plan.slots] = values[plan.rows, :, plan.cols]
        if plan.ring_take:
            if queries is None:
                raise ValueError(f"layer {layer}: the policy keeps a window of queries; pass the step's queries")
            self.ring[i, :, :, plan.ring_slots] = queries[:, :, plan.tokens - plan.ring_take:].to(self.ring.dtype)
        if self.key_pages:
            self._summarise_pages(i)
        self.layer_steps[i] = self.steps

    def require_complete(self, action: str) -> None:
        if not self.complete:
            behind = [layer for layer, i in self.member.items() if self.layer_steps[i] != self.steps]
            raise CacheStateError(
                f"cannot {action}: layers {behind[:8]} did not write the last step. A forward was interrupted, "
                "or the cache serves a model with another number of layers. Call reset() before reusing it."
            )

    # -- views --------------------------------------------------------------------------------
    def valid(self, layer: int) -> torch.Tensor:
        """``[B, 1, L]`` bool: slot ``s`` of row ``r`` holds a token iff ``s < counts[r]``."""
        counts = self.counts_of(layer)
        slot = torch.arange(int(counts.max()), device=self.device)
        return (slot < counts.to(self.device)[:, None])[:, None, :]

    def materialise_positions(self) -> None:
        """Write out the positions of slots appended since each row's last eviction (and ``-1``
        past each row's count), on every layer: ``position = slot + tokens - counts``. Safe in
        mid-step: a layer that has not written the step yet gets its new slots' positions early."""
        if bool((self.stored == self.counts).all()) and self.stored.numel():
            return
        length = int(self.counts.max())
        dev = self.device
        slot = torch.arange(length, device=dev)
        stored, counts = self.stored.to(dev)[:, None], self.counts.to(dev)[:, None]
        derived = torch.where(slot < counts, slot + (self.tokens.to(dev)[:, None] - counts), -1)  # [B, L]
        pos = self.buffers.positions[:, :, :, :length]
        pos.copy_(torch.where((slot >= stored)[None, :, None, :], derived[None, :, None, :], pos))
        self.stored = self.counts.clone()

    def window(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s query window in time order: ``[B, Hq, W, D]`` and its ``[B, W]`` validity."""
        return self.windows(slice(self.member[layer], self.member[layer] + 1), slice(None))

    def windows(self, layers: slice, rows: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The windows of buffer layers ``layers`` and ``rows``, stacked layer-major on the batch
        axis, in time order: ``[Lyr * R, Hq, W, D]`` and ``[Lyr * R, W]``."""
        w = self.ring.shape[3]
        order = (torch.arange(w, device=self.device) + self.ring_next) % w
        ring = self.ring[layers][:, rows].index_select(3, order)
        valid = self.ring_valid[rows].index_select(1, order)
        return ring.flatten(0, 1), valid.repeat(ring.shape[0], 1)

    # -- row operations -------------------------------------------------------------------------
    def evicted(self, rows: torch.Tensor, kept: int) -> None:
        """Book-keeping after the executor compacted ``rows`` (host ``[R]``) to ``kept`` slots."""
        self._rows()
        self.slots_evicted += int((self._counts[rows] - kept).sum())
        for t in (self._counts, self._counts_before, self.stored):
            t[rows] = kept
        self.evictions[rows] += 1
        self._due[rows] = False
        self.extent_now = self.extent_before = int(self._counts.max())
        self._check_alike()

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows ``index [B']`` in that order (beam reordering, repeats, dropping rows)."""
        self.require_complete("reorder rows")
        host = index.cpu()
        dev = index.to(self.device)
        self.buffers.select_rows(index)
        self._rows()
        for name in ("_counts", "_counts_before", "_tokens", "stored", "evictions", "streams", "_due",
                     "selected_at", "reselect"):
            setattr(self, name, getattr(self, name)[host])
        if self.select_mode:
            self.selection = self.selection.index_select(1, dev)
            self.key_pages = {p: (lo.index_select(1, dev), hi.index_select(1, dev)) for p, (lo, hi) in self.key_pages.items()}
        self.extent_now = self.extent_before = int(self._counts.max()) if host.numel() else 0
        if host.numel():
            self._check_alike()
        self.ring = self.ring.index_select(1, dev)
        self.ring_valid = self.ring_valid.index_select(0, dev)

    def stats(self, layer: int) -> EvictionStats:
        written = self.written(layer)
        return EvictionStats(
            evictions=self.eviction_steps,
            tokens_seen=self.tokens_seen if written else self.tokens_seen_before,
            slots_held=self.extent(layer),
            slots_evicted=self.slots_evicted,
        )


def _added(token_valid: torch.Tensor | None, batch: int, t: int) -> torch.Tensor:
    """``[B]`` host long: real tokens per row in a chunk (one sync for a padded chunk)."""
    if token_valid is None:
        return torch.full((batch,), t, dtype=torch.long)
    return token_valid.sum(-1).cpu()


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
