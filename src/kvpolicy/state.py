"""The cache's state: the per-row bookkeeping of a group of layers, over their slot buffers.

Nothing here imports transformers, and nothing here chooses what to evict (the executor does).

A ``LayerGroup`` is every layer that shares one ``SlotBuffers`` (same shape, dtype, device and
budget). Layers of one model see the same tokens, so everything per row is stored **once per
group**, in the parts it is made of: ``RowCounters`` (slots held, tokens seen, due flags),
``QueryRing`` (the window of recent queries), ``SelectionState`` (select mode only). A layer is an
index on the buffers' layer axis and a count of the steps it has written. One decoding step is:

1. ``begin_step`` (the first layer's append): plans where the step's tokens go and which slots
   each query may attend, once for every layer (``StepPlan``), and asks the schedule whether an
   eviction is due after it (``Schedule.due``: the one place that rule is written);
2. ``write`` for each layer: its keys, values and queries, into the planned slots;
3. after the last layer, the rows that are due are evicted by the executor before the next
   step begins.

Rows are **packed**: row ``r`` holds its ``counts[r]`` real tokens in slots ``[0, counts[r])``
in position order, on every layer and head, and padding is never stored. So slot validity is
``slot < counts[r]`` and needs no buffer. Positions are stored lazily: a slot appended since the
row's last eviction holds the token at ``slot + (tokens[r] - counts[r])``, so the decode step
writes no position; ``materialise_positions`` writes them out when an eviction or a reader
needs them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .heads import HeadLayout
from .query_ring import QueryRing
from .rows import RowCounters
from .schedule import Schedule
from .selection import SelectionState
from .slots import SlotBuffers, StepPlan

#: Select mode keeps every token. When a chunk does not fit, the buffers grow to ``growth`` times
#: the slots it needs (``EvictingCache(select_growth=...)``), and by at least
#: ``SELECT_MIN_GROWTH`` slots: geometric growth, so the copies cost a bounded number of slot
#: copies per appended token (``1 / (growth - 1)``, amortised) and the unused headroom stays
#: below ``growth - 1`` of the cache.
SELECT_GROWTH = 1.1
SELECT_MIN_GROWTH = 16


class CacheStateError(RuntimeError):
    """The cache was used out of order: layers out of step (an interrupted forward, or a cache
    built for another model), or an operation that needs a finished step. ``reset()`` recovers."""


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
        per_head: bool = False,
        select_growth: float = SELECT_GROWTH,
    ) -> None:
        b, h, t, d = keys.shape
        self.schedule = schedule
        self.select_growth = select_growth
        self.member = {layer: i for i, layer in enumerate(layer_ids)}  # global index -> buffer index
        self.layer_ids = torch.tensor(list(layer_ids), dtype=torch.long)
        self.select_mode = select_mode
        added = _added(token_valid, b, t)
        self.buffers = SlotBuffers(
            len(layer_ids), b, h, self._capacity(int(added.max())), d, values.shape[-1], keys.dtype, keys.device
        )
        self.rows = RowCounters(b)
        # Per-head allocations: heads of a row hold different counts after an eviction (select
        # mode evicts nothing: its heads choose different counts, see SelectionState).
        self.heads = HeadLayout(len(layer_ids), b, h, keys.device) if per_head and not select_mode else None
        self.ring = QueryRing(len(layer_ids), b, query_heads, schedule.window, keys)
        self.select: SelectionState | None = None
        if select_mode:
            self.select = SelectionState(
                len(layer_ids), b, h, schedule.budget, self.buffers.capacity, page_sizes, keys, per_head=per_head
            )
        self.extent_now = self.extent_before = 0  # slots held by the longest row, after / before the step
        self.tokens_seen = 0  # padded positions, after the current step
        self.tokens_seen_before = 0
        self.steps = 0  # steps begun
        self.layer_steps = [0] * len(layer_ids)  # steps each layer has written
        self.eviction_steps = 0
        self.slots_evicted = 0
        self.plan = self._plan(t, token_valid, added)

    # -- properties ---------------------------------------------------------------------------
    @property
    def counts(self) -> torch.Tensor:
        """``[B]`` slots held per row (after the current step)."""
        return self.rows.counts

    @property
    def due(self) -> torch.Tensor:
        return self.rows.due

    @property
    def any_due(self) -> bool:
        return self.rows.any_due

    @property
    def batch_alike(self) -> bool:
        """Whether every row holds the same slots after the same tokens (the int fast path)."""
        return self.rows.alike is not None

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
        return self.rows.counts if self.written(layer) else self.rows.counts_before

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
        return self.buffers.nbytes() + self.ring.nbytes() + (self.select.nbytes() if self.select else 0)

    # -- a step -------------------------------------------------------------------------------
    def begin_step(self, t: int, token_valid: torch.Tensor | None) -> None:
        """Plan the next step of ``T`` tokens (validity ``[B, T]`` or None) for every layer."""
        self.require_complete("begin a step")
        if self.any_due:
            raise CacheStateError("an eviction is due: the executor must run before the next step")
        self.plan = self._plan(t, token_valid, None if token_valid is None else _added(token_valid, self.batch, t))
        if self.select is not None:
            alike = self.rows.alike
            # While rows are alike, their count is one int (reading .counts would leave the fast path).
            counts = alike.held if alike is not None else self.rows.counts
            self.select.plan(t, counts, self.tokens_seen_before, self.schedule)

    def _due(self, after, tokens, is_prompt: bool):
        """``Schedule.due`` for this step (ints or ``[B]`` tensors); select mode never evicts."""
        if self.select_mode:
            return torch.zeros_like(after, dtype=torch.bool) if isinstance(after, torch.Tensor) else False
        return self.schedule.due(after, tokens, prompt=is_prompt)

    def _plan(self, t: int, token_valid: torch.Tensor | None, added: torch.Tensor | None) -> StepPlan:
        b, device = self.batch, self.device
        if token_valid is not None and added is not None and bool((added == t).all()):
            token_valid = None  # every token real: the plain path
        if token_valid is None and self.rows.alike is not None:
            return self._plan_alike(t)
        if added is None:
            added = torch.full((b,), t, dtype=torch.long)
        before = self.rows.counts
        after = before + added
        needed = int(after.max())
        if needed > self.buffers.capacity:
            self._grow(self._capacity(needed))
        uniform = token_valid is None and bool((before == before[0]).all())
        start = rows = cols = slots = mask = sees = None
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
        ring_slots, take = self.ring.advance(t, token_valid)
        is_prompt = self.tokens_seen == 0
        self.rows.advance(after, added, self._due(after, self.rows.tokens + added, is_prompt))
        self.extent_before, self.extent_now = self.extent_now, needed
        self.tokens_seen_before, self.tokens_seen = self.tokens_seen, self.tokens_seen + t
        self.steps += 1
        return StepPlan(t, b, start, rows, cols, slots, mask, ring_slots, take, int(before.min()), needed, sees)

    def _plan_alike(self, t: int) -> StepPlan:
        """``_plan`` when every row holds the same slots and every new token is real: ints only."""
        alike = self.rows.alike
        assert alike is not None
        count, tokens = alike.held, alike.tokens
        after = count + t
        if after > self.buffers.capacity:
            self._grow(self._capacity(after))
        ring_slots, take = self.ring.advance(t, None)
        self.rows.advance_alike(t, bool(self._due(after, tokens + t, self.tokens_seen == 0)))
        self.extent_before, self.extent_now = count, after
        self.tokens_seen_before, self.tokens_seen = self.tokens_seen, self.tokens_seen + t
        self.steps += 1
        return StepPlan(t, self.batch, count, None, None, None, None, ring_slots, take, count, after)

    @property
    def selecting(self) -> bool:
        """Whether this step attends a selection (select mode, a decode step after the prompt)."""
        return self.select_mode and self.plan.tokens == 1 and self.tokens_seen_before > 0

    @property
    def uneven(self) -> bool:
        """Whether heads of a row hold different counts (the flat per-head layout applies)."""
        return self.heads is not None and not self.heads.even

    def _grow(self, capacity: int) -> None:
        """Grow the slot buffers (and the page summaries with them) to ``capacity`` slots."""
        if self.uneven:
            self._grow_heads(capacity)
            return
        self.buffers.grow(capacity)
        if self.select is not None:
            self.select.grow(capacity)

    def _grow_heads(self, capacity: int) -> None:
        """``_grow`` of a flat per-head layout: head ``h``'s slots move by ``h * (capacity - cap)``."""
        heads, buf, old_cap = self.heads, self.buffers, self.buffers.capacity
        assert heads is not None
        counts = self.rows.counts
        flat, valid = heads.slots(old_cap, counts, heads.width(counts))
        moved = flat + torch.arange(flat.shape[2], device=flat.device)[:, None] * (capacity - old_cap)
        lyr, row, _, _ = valid.nonzero(as_tuple=True)
        src, dst = flat[valid], moved[valid]
        for name, old in buf.tensors():
            new = old.new_full((*old.shape[:3], capacity, *old.shape[4:]), -1 if name == "positions" else 0)
            old_flat, new_flat = old.flatten(2, 3), new.flatten(2, 3)
            new_flat[lyr, row, dst] = old_flat[lyr, row, src]
            setattr(buf, name, new)

    def _capacity(self, needed: int) -> int:
        """Slots to allocate for ``needed``: the schedule's static capacity when evicting; in
        select mode, where every token is kept, ``select_growth`` times ``needed`` (at least
        ``SELECT_MIN_GROWTH`` more)."""
        if self.select_mode:
            return select_capacity(needed, self.select_growth)
        return self.schedule.capacity_for(needed)

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
        if self.uneven:
            self._write_heads(i, keys, values)
        elif plan.start is not None:
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
            self.ring.write(i, queries, plan.ring_slots, plan.ring_take)
        if self.select is not None and self.select.key_pages:
            counts = None if plan.start is not None else self.rows.counts
            self.select.summarise_pages(i, buf.keys[i], plan, counts)
        self.layer_steps[i] = self.steps

    def _write_heads(self, i: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """``write`` into a flat per-head layout: row slot ``s`` of head ``h`` at ``shift[h] + s``."""
        plan, buf, heads = self.plan, self.buffers, self.heads
        assert heads is not None
        if plan.start is not None:  # every row appends the same slots: one index for all
            where = heads.append_index(buf.capacity, i, plan.start, plan.tokens)
            buf.keys[i].flatten(0, 2).index_copy_(0, where, keys.flatten(0, 2))
            buf.values[i].flatten(0, 2).index_copy_(0, where, values.flatten(0, 2))
            return
        shift = heads.shift(buf.capacity)[i]
        if plan.rows is not None and plan.slots is not None and plan.cols is not None:
            where = shift[plan.rows] + plan.slots[:, None]  # [nnz, Hkv]
            for name, new in (("keys", keys), ("values", values)):
                getattr(buf, name)[i].flatten(1, 2)[plan.rows[:, None], where] = new[plan.rows, :, plan.cols]

    def head_band(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat per-head layout: what attention over ``layer`` reads this step (``HeadLayout.band``):
        ``(index [B, Hkv, W], mask [B, Hkv, T, W])``."""
        plan, heads = self.plan, self.heads
        assert heads is not None
        if plan.sees is not None:
            sees = plan.sees  # a padded step: each query's own visible row slots
        elif plan.tokens == 1:
            sees = None  # a decode step sees every held slot
        else:
            sees = (torch.arange(plan.tokens, device=self.device) + (plan.start or 0) + 1).expand(plan.batch, -1)
        alike = self.rows.alike  # while rows are alike their count is one int (the fast path stays)
        if alike is not None:
            counts: torch.Tensor | int = alike.held if self.written(layer) else alike.before
        else:
            counts = self.counts_of(layer)
        return heads.band(self.buffers.capacity, self.member[layer], counts, sees)

    def flat_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat per-head layout: ``layer``'s keys ``[B * Hkv * cap, D]`` and values, row after
        row, every head in turn (what ``head_band``'s index addresses)."""
        i = self.member[layer]
        return self.buffers.keys[i].flatten(0, 2), self.buffers.values[i].flatten(0, 2)

    def head_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Flat per-head layout: copies of ``layer``'s keys, values and positions ``[B, Hkv, N,
        ...]`` with each head's slots right-aligned in ``N`` columns (its fullest head), and
        their ``[B, Hkv, N]`` validity. The newest slots are the last columns of every head."""
        heads, i, cap = self.heads, self.member[layer], self.buffers.capacity
        assert heads is not None
        counts = self.counts_of(layer)
        self.materialise_positions()
        flat, valid = heads.slots(cap, counts, heads.width(counts), layers=slice(i, i + 1))
        flat, valid = flat[0], valid[0]
        out = []
        for name, t in self.buffers.tensors():
            src = t[i].flatten(1, 2)
            if name == "positions":
                out.append(torch.gather(src, 1, flat.flatten(1)).view(flat.shape).masked_fill(~valid, -1))
            else:
                out.append(torch.gather(src, 1, flat.flatten(1)[..., None].expand(-1, -1, src.shape[-1]))
                           .view(*flat.shape, -1) * valid[..., None])
        return out[0], out[1], out[2], valid

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
        rows = self.rows
        if bool((rows.stored == rows.counts).all()) and rows.stored.numel():
            return
        if self.uneven:
            self._materialise_heads()
            return
        length = int(rows.counts.max())
        dev = self.device
        slot = torch.arange(length, device=dev)
        stored, counts = rows.stored.to(dev)[:, None], rows.counts.to(dev)[:, None]
        derived = torch.where(slot < counts, slot + (rows.tokens.to(dev)[:, None] - counts), -1)  # [B, L]
        pos = self.buffers.positions[:, :, :, :length]
        pos.copy_(torch.where((slot >= stored)[None, :, None, :], derived[None, :, None, :], pos))
        rows.stored = rows.counts.clone()

    def _materialise_heads(self) -> None:
        """``materialise_positions`` in a flat per-head layout (slots past a count are not reset)."""
        rows, dev, cap = self.rows, self.device, self.buffers.capacity
        first, last = int(rows.stored.min()), int(rows.counts.max())
        row_slot = torch.arange(first, last, device=dev)
        stored, counts = rows.stored.to(dev)[:, None], rows.counts.to(dev)[:, None]
        needed = (row_slot >= stored) & (row_slot < counts)  # [B, n]
        derived = row_slot + (rows.tokens.to(dev)[:, None] - counts)
        where = self.heads.shift(cap)[..., None] + row_slot  # type: ignore[union-attr]  # [Lyr, B, Hkv, n]
        mask = needed[None, :, None, :].expand_as(where)
        lyr, row, head, col = mask.nonzero(as_tuple=True)
        self.buffers.positions.flatten(2, 3)[lyr, row, where[mask]] = derived[row, col]
        rows.stored = rows.counts.clone()

    def window(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s query window in time order: ``[B, Hq, W, D]`` and its ``[B, W]`` validity."""
        return self.ring.windows(slice(self.member[layer], self.member[layer] + 1), slice(None))

    # -- row operations -------------------------------------------------------------------------
    def evicted(self, rows: torch.Tensor, kept: int) -> None:
        """Book-keeping after the executor compacted ``rows`` (host ``[R]``) to ``kept`` slots."""
        self.slots_evicted += self.rows.evicted(rows, kept)
        self.extent_now = self.extent_before = int(self.rows.counts.max())

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows ``index [B']`` in that order (beam reordering, repeats, dropping rows)."""
        self.require_complete("reorder rows")
        host = index.cpu()
        dev = index.to(self.device)
        self.buffers.select_rows(index)
        self.rows.select_rows(host)
        if self.heads is not None:
            self.heads.select_rows(dev)
        if self.select is not None:
            self.select.select_rows(host, dev)
        self.extent_now = self.extent_before = int(self.rows.counts.max()) if host.numel() else 0
        self.ring.select_rows(dev)

    def stats(self, layer: int) -> EvictionStats:
        written = self.written(layer)
        return EvictionStats(
            evictions=self.eviction_steps,
            tokens_seen=self.tokens_seen if written else self.tokens_seen_before,
            slots_held=self.extent(layer),
            slots_evicted=self.slots_evicted,
        )


def select_capacity(needed: int, growth: float) -> int:
    """Select mode's allocation for ``needed`` slots: ``ceil(needed * growth)``, and at least
    ``needed + SELECT_MIN_GROWTH``."""
    return max(needed + SELECT_MIN_GROWTH, math.ceil(needed * growth))


def check_select_growth(growth: object) -> float:
    """``growth`` as a float in ``(1, 16]``, or a ``ValueError`` saying why not."""
    if isinstance(growth, bool) or not isinstance(growth, (int, float)) or not 1.0 < growth <= 16.0:
        raise ValueError(
            f"select_growth must be a number in (1, 16] (select mode's buffers grow to that many times the "
            f"slots needed; 1.1 keeps 10 % headroom), got {growth!r}"
        )
    return float(growth)


def _added(token_valid: torch.Tensor | None, batch: int, t: int) -> torch.Tensor:
    """``[B]`` host long: real tokens per row in a chunk (one sync for a padded chunk)."""
    if token_valid is None:
        return torch.full((batch,), t, dtype=torch.long)
    return token_valid.sum(-1).cpu()
