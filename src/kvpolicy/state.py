"""The cache's state: the per-row bookkeeping of a group of layers, over its layout's slots.

Nothing here imports transformers, and nothing here chooses what to evict (the executor runs the
policy) or knows where a row's tokens are in memory (the group's layout does, ``kvpolicy.layouts``).

A ``LayerGroup`` is every layer that shares one set of slot buffers (same shape, dtype, device and
budget). Layers of one model see the same tokens, so everything per row is stored **once per
group**, in the parts it is made of: ``RowCounters`` (slots held, tokens seen, due flags),
``QueryRing`` (the window of recent queries), and the layout (the slot buffers, and what a layout
needs besides: per-head addressing, select mode's choices). A layer is an index on the buffers'
layer axis and a count of the steps it has written. One decoding step is:

1. ``begin_step`` (the first layer's append): plans where the step's tokens go and which slots
   each query may attend, once for every layer (``StepPlan``), and asks the layout whether an
   eviction is due after it (``Schedule.due``: the one place that rule is written);
2. ``write`` for each layer: its keys, values and queries, into the planned slots;
3. after the last layer, the rows that are due are evicted by the executor before the next
   step begins.

Rows are **packed**: row ``r`` holds its ``counts[r]`` real tokens in the first ``counts[r]`` row
slots, in position order, and padding is never stored. Positions are stored lazily: a slot
appended since the row's last eviction holds the token at ``slot + (tokens[r] - counts[r])``, so
the decode step writes no position; ``materialise_positions`` writes them out when an eviction or
a reader needs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .eviction import is_long_step
from .heads import HeadLayout
from .layouts import CacheStateError as CacheStateError
from .layouts import LayoutChoice, SlotLayout
from .query_ring import QueryRing
from .rows import RowCounters
from .schedule import Phase, Schedule, step_phase
from .selection import SELECT_GROWTH as SELECT_GROWTH
from .selection import SELECT_MIN_GROWTH as SELECT_MIN_GROWTH
from .selection import SelectionState
from .selection import check_select_growth as check_select_growth
from .selection import select_capacity as select_capacity
from .slots import Contiguous, Scattered, SlotBuffers, StepPlan


@dataclass
class EvictionStats:
    """Public counters of one layer."""

    evictions: int = 0  # eviction steps (one step may evict several rows)
    tokens_seen: int = 0  # padded positions appended (the same for every row)
    slots_held: int = 0  # the slot extent: slots held by the longest row
    slots_evicted: int = 0  # slots dropped, summed over batch rows (by the rows' counts: not per head)
    #: Slots held now summed over batch rows and KV heads (what memory holds; under a threshold
    #: or a per-head allocation heads hold different counts), and the fewest and most one head holds.
    head_slots_held: int = 0
    head_slots_fewest: int = 0
    head_slots_most: int = 0


class LayerGroup:
    """The layers sharing one set of slot buffers, and their per-row state, stored once.

    Built by the first append of its first layer (``keys [B, Hkv, T, D]``, ``values``,
    ``query_heads`` of the window, ``token_valid [B, T]`` or None), which begins the first step;
    ``layout`` builds the group's layout (``kvpolicy.layouts.layout_for``).
    """

    def __init__(
        self,
        schedule: Schedule,
        layer_ids: Sequence[int],
        keys: torch.Tensor,
        values: torch.Tensor,
        query_heads: int,
        token_valid: torch.Tensor | None,
        layout: LayoutChoice,
        prompt_tokens: int | None = None,
    ) -> None:
        b, _, t, _ = keys.shape
        self.schedule = schedule
        self.member = {layer: i for i, layer in enumerate(layer_ids)}  # global index -> buffer index
        self.layer_ids = torch.tensor(list(layer_ids), dtype=torch.long)
        self.rows = RowCounters(b)
        self.ring = QueryRing(len(layer_ids), b, query_heads, schedule.window, keys)
        added = _added(token_valid, b, t)
        #: Runs the policy over the group's slots (``kvpolicy.executor.Executor``).
        self.executor = layout.executor
        self.layout: SlotLayout = layout.build(self, keys, values, int(added.max()))
        self.buffers: SlotBuffers = self.layout.buffers  # the layout's (one object for the group's life)
        self.extent_now = self.extent_before = 0  # slots held by the longest row, after / before the step
        self.tokens_seen = 0  # padded positions, after the current step
        self.tokens_seen_before = 0
        #: The prompt's token positions: this cache's first step, unless a longer prompt was
        #: declared (``EvictingCache.expect_prompt``: fed in chunks). ``step_phase`` reads it, the
        #: rule vLLM's ledger asks too, with each request's own prompt length.
        self.prompt_tokens = t if prompt_tokens is None else prompt_tokens
        #: The phase of the current step (``step_phase``).
        self.phase: Phase = self._phase(t)
        self.steps = 0  # steps begun
        self.layer_steps = [0] * len(layer_ids)  # steps each layer has written
        self.eviction_steps = 0
        self.slots_evicted = 0
        #: A step too long for the window under a stateful policy: its queries' (positions, valid).
        self.long_step: tuple[torch.Tensor, torch.Tensor] | None = None
        #: ``[B, T]`` long positions of the step's tokens (-1: padding), for state fields that
        #: start at their token's position (``StateField(initial="position")``); else None.
        self.new_positions: torch.Tensor | None = None
        self.plan = self._plan(t, token_valid, added)

    # -- properties ---------------------------------------------------------------------------
    @property
    def heads(self) -> HeadLayout | None:
        """Per-head runs' addressing, for inspection (None under another layout)."""
        return self.layout.heads

    @property
    def select(self) -> SelectionState | None:
        """Select mode's choices, for inspection (None under another layout)."""
        return self.layout.select

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

    def extent(self, layer: int) -> int:
        """The slot extent of ``layer``: slots held by its longest row."""
        return self.extent_now if self.written(layer) else self.extent_before

    def memory_bytes(self) -> int:
        """Bytes of the layout (slot buffers and, in select mode, the selections and page
        summaries) and the query window."""
        return self.layout.nbytes() + self.ring.nbytes()

    def held_bytes(self) -> int:
        """``memory_bytes`` with the slot buffers counted only where they hold a token
        (``SlotLayout.held_bytes``): what the cache holds, rather than the room it has."""
        return self.layout.held_bytes() + self.ring.nbytes()

    def head_counts(self, layer: int) -> torch.Tensor:
        """``[B, Hkv]`` long (host): slots each KV head of each row holds on ``layer``."""
        return self.layout.held_counts(layer)

    # -- a step -------------------------------------------------------------------------------
    def begin_step(self, t: int, token_valid: torch.Tensor | None) -> None:
        """Plan the next step of ``T`` tokens (validity ``[B, T]`` or None) for every layer."""
        self.require_complete("begin a step")
        if self.any_due:
            raise CacheStateError("an eviction is due: the executor must run before the next step")
        self.plan = self._plan(t, token_valid, None if token_valid is None else _added(token_valid, self.batch, t))
        self.layout.begin_step(t)

    def _reserve(self, needed: int) -> None:
        """Grow the slot buffers if ``needed`` slots per head do not fit."""
        if needed > self.buffers.capacity:
            self.layout.grow(self.layout.capacity_for(needed))

    def _plan(self, t: int, token_valid: torch.Tensor | None, added: torch.Tensor | None) -> StepPlan:
        """The step's plan (``added [B]``: real tokens per row, host; None: ``t`` each), and the
        rows' counters advanced past it."""
        b, device = self.batch, self.device
        self._check_prompt_end(t)
        if token_valid is not None and added is not None and bool((added == t).all()):
            token_valid = None  # every token real: the plain path
        if token_valid is None and self.rows.alike is not None:
            return self._plan_alike(t)
        if added is None:
            added = torch.full((b,), t, dtype=torch.long)
        before = self.rows.counts
        after = before + added
        needed = int(after.max())
        self._reserve(needed)
        placement: Contiguous | Scattered
        if token_valid is None and bool((before == before[0]).all()):
            placement = Contiguous(int(before[0]))
        else:
            placement = Scattered.of(before, t, token_valid, needed, device)
        ring = self.ring.advance(t, token_valid)
        self.phase = self._phase(t)
        if self.phase != "decode":
            self.rows.prompt += added.to(self.rows.prompt.device)  # each row's real prompt tokens
        self._plan_long_step(t, token_valid)
        self._plan_new_positions(t, token_valid)
        self.rows.advance(after, added, self.layout.due(after, self.rows.tokens + added, self.phase, added))
        if self.long_step is not None:
            self.rows.mark_observed(slice(None))
        self.extent_before, self.extent_now = self.extent_now, needed
        self.tokens_seen_before, self.tokens_seen = self.tokens_seen, self.tokens_seen + t
        self.steps += 1
        return StepPlan(
            tokens=t, batch=b, placement=placement, ring=ring, written_from=int(before.min()), written_to=needed
        )

    def _plan_alike(self, t: int) -> StepPlan:
        """``_plan`` when every row holds the same slots and every new token is real: ints only."""
        alike = self.rows.alike
        assert alike is not None
        self._check_prompt_end(t)
        count = alike.held
        after = count + t
        self._reserve(after)  # growing reads the rows through RowCounters.held(): the fast path stays
        ring = self.ring.advance(t, None)
        self._plan_long_step(t, None)
        self._plan_new_positions(t, None)
        self.phase = self._phase(t)
        if self.phase != "decode":
            self.rows.prompt += t
        self.rows.advance_alike(t, bool(self.layout.due(after, alike.tokens + t, self.phase, t)))
        if self.long_step is not None:
            self.rows.mark_observed(slice(None))
        self.extent_before, self.extent_now = count, after
        self.tokens_seen_before, self.tokens_seen = self.tokens_seen, self.tokens_seen + t
        self.steps += 1
        return StepPlan(
            tokens=t, batch=self.batch, placement=Contiguous(count), ring=ring, written_from=count, written_to=after
        )

    def _phase(self, t: int) -> Phase:
        """The phase of the step of ``t`` tokens being planned (``step_phase``)."""
        return step_phase(self.tokens_seen, self.tokens_seen + t, self.prompt_tokens)

    def _check_prompt_end(self, t: int) -> None:
        """A declared prompt ends a step: one that ran on past it would be part prompt, part
        decode, which no engine's prompt step is."""
        if self.tokens_seen < self.prompt_tokens < self.tokens_seen + t:
            raise ValueError(
                f"the prompt was declared as {self.prompt_tokens} tokens (expect_prompt), but this step runs from "
                f"{self.tokens_seen} to {self.tokens_seen + t}: end a step at the prompt's end"
            )

    def _plan_long_step(self, t: int, token_valid: torch.Tensor | None) -> None:
        """A step with more queries than the window holds, under a policy that keeps state: each
        layer's state sees all of them as the layer is written (``Executor.observe_step``), from
        the token positions and validity set here (before the rows' counters advance)."""
        self.long_step = None
        if not is_long_step(t, self.schedule.window) or not self.executor.policy.observes_queries:
            return
        device = self.device
        before = self.rows.seen().to(device)[:, None]
        if token_valid is None:
            valid = torch.ones(self.batch, t, dtype=torch.bool, device=device)
        else:
            valid = token_valid.to(device)
        positions = torch.where(valid, before + valid.long().cumsum(-1) - 1, -1)
        self.long_step = (positions, valid)

    def _plan_new_positions(self, t: int, token_valid: torch.Tensor | None) -> None:
        """The positions of the step's tokens, when a state field starts at its token's position
        (before the rows' counters advance; a long step's, computed just before, are reused)."""
        self.new_positions = None
        if not self.buffers.needs_positions:
            return
        if self.long_step is not None:
            self.new_positions = self.long_step[0]
            return
        device = self.device
        before = self.rows.seen().to(device)[:, None]
        if token_valid is None:
            self.new_positions = before + torch.arange(t, device=device)
        else:
            valid = token_valid.to(device)
            self.new_positions = torch.where(valid, before + valid.long().cumsum(-1) - 1, -1)

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
                f"{plan.batch} rows of {plan.tokens} tokens, which it has not written (a forward was "
                "interrupted, or refused: call reset() before reusing the cache)"
            )
        new = {"keys": keys, "values": values}
        if self.buffers.slot_state:  # a new token's state starts at its field's initial value
            new.update(self.buffers.new_tokens(plan.batch, plan.tokens, self.new_positions))
        if (plan.ring.take or self.long_step is not None) and queries is None:
            raise ValueError(f"layer {layer}: the policy keeps a window of queries; pass the step's queries")
        self.layout.write(i, new, plan)
        self.layer_steps[i] = self.steps  # the layer's slots now include the step's (observe_step reads them)
        if self.long_step is not None:  # before the ring keeps only the step's last queries
            assert queries is not None
            try:
                self.executor.observe_step(self, layer, queries, *self.long_step)
            except BaseException:
                # The keys are written but the state missed these queries: the layer counts as
                # not written, so the next step asks for reset() instead of going on with it.
                self.layer_steps[i] = self.steps - 1
                raise
        if plan.ring.take:
            assert queries is not None
            self.ring.write(i, queries, plan.ring)

    def require_complete(self, action: str) -> None:
        if not self.complete:
            behind = [layer for layer, i in self.member.items() if self.layer_steps[i] != self.steps]
            raise CacheStateError(
                f"cannot {action}: layers {behind[:8]} did not write the last step. A forward was interrupted, "
                "or the cache serves a model with another number of layers. Call reset() before reusing it."
            )

    # -- views --------------------------------------------------------------------------------
    def materialise_positions(self) -> None:
        """Write out the positions of slots appended since each row's last eviction (and ``-1``
        past each row's count), on every layer: ``position = slot + tokens - counts``. Safe in
        mid-step: a layer that has not written the step yet gets its new slots' positions early."""
        rows = self.rows
        was_alike = rows.alike is not None
        if not (bool((rows.stored == rows.counts).all()) and rows.stored.numel()):
            self.layout.materialise_positions()
            rows.stored = rows.counts.clone()
        if was_alike:
            rows.resume_alike()  # reading the counts left the int fast path; nothing changed them

    def window(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s query window in time order: ``[B, Hq, W, D]`` and its ``[B, W]`` validity."""
        return self.ring.windows(slice(self.member[layer], self.member[layer] + 1), slice(None))

    # -- row operations -------------------------------------------------------------------------
    def evicted(self, rows: torch.Tensor, kept: int) -> None:
        """Book-keeping after the layout compacted ``rows`` (host ``[R]``) to ``kept`` slots."""
        self.slots_evicted += self.rows.evicted(rows, kept)
        self.extent_now = self.extent_before = int(self.rows.counts.max())

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows ``index [B']`` in that order (beam reordering, repeats, dropping rows)."""
        self.require_complete("reorder rows")
        host = index.cpu()
        dev = index.to(self.device)
        self.layout.select_rows(host, dev)
        self.rows.select_rows(host)
        self.extent_now = self.extent_before = int(self.rows.counts.max()) if host.numel() else 0
        self.ring.select_rows(dev)

    def stats(self, layer: int) -> EvictionStats:
        written = self.written(layer)
        heads = self.head_counts(layer)
        return EvictionStats(
            evictions=self.eviction_steps,
            tokens_seen=self.tokens_seen if written else self.tokens_seen_before,
            slots_held=self.extent(layer),
            slots_evicted=self.slots_evicted,
            head_slots_held=int(heads.sum()),
            head_slots_fewest=int(heads.min()) if heads.numel() else 0,
            head_slots_most=int(heads.max()) if heads.numel() else 0,
        )


def _added(token_valid: torch.Tensor | None, batch: int, t: int) -> torch.Tensor:
    """``[B]`` host long: real tokens per row in a chunk (one sync for a padded chunk)."""
    if token_valid is None:
        return torch.full((batch,), t, dtype=torch.long)
    return token_valid.sum(-1).cpu()
