"""The interface every layout implements, and the records layouts hand out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

import torch

from ..eviction import Kept
from ..heads import HeadLayout
from ..policy import Policy
from ..query_ring import QueryRing
from ..rows import RowCounters
from ..schedule import Phase, Schedule
from ..selection import SelectionState
from ..slots import SlotBuffers, StepPlan
from ..stages.base import StateField
from ..stages.recall import RecallInput


class CacheStateError(RuntimeError):
    """The cache was used out of order: layers out of step (an interrupted forward, or a cache
    built for another model), or an operation that needs a finished step. ``reset()`` recovers."""


class SlotView(NamedTuple):
    """One layer's held slots as ``[B, Hkv, L, ...]`` tensors, ``L`` columns per head."""

    keys: torch.Tensor  # [B, Hkv, L, D]
    values: torch.Tensor  # [B, Hkv, L, Dv]
    valid: torch.Tensor  # [B, Hkv, L] bool: which columns hold a token


class HeldSlots(NamedTuple):
    """Some rows' slots as the policy sees them at an eviction or a choice, layers stacked on
    the batch axis: every per-slot buffer by name (``SlotBuffers.tensors``), ``[Lyr * R, Hkv,
    N, ...]``, and which slots hold a token (None: all of them)."""

    fields: Mapping[str, torch.Tensor]
    valid: torch.Tensor | None
    #: Where the layout read each column from (a layout's own; None: views of the buffers).
    address: Any = None
    #: Writes state fields, in this arrangement, back to the slots they were read from, moving
    #: none (the layout's; None where the slots carry no state to store).
    store: Callable[[Mapping[str, torch.Tensor]], None] | None = None


class RowClass(NamedTuple):
    """Due rows evicted together: each sees its slots as it would alone."""

    rows: torch.Tensor  # host [R]
    held: int  # slots each of them holds


class ChosenSlots(NamedTuple):
    """What one class of rows attends at a select-mode decode step of one layer."""

    rows: slice | torch.Tensor  # the rows (a slice of all, or device indices)
    held: int  # slots each of them holds
    slots: torch.Tensor | None  # [R, Hkv, K] the slots attended; None: all ``held`` (or ``pages``)
    valid: torch.Tensor | None  # [R, Hkv, K] bool, which columns of ``slots`` count; None: all
    #: A page choice (``kvpolicy.selection.page_plan``): the whole pages attended, ``[R, Hkv, k]``,
    #: with ``slots`` None; then the tail ``[tail, held)``. None: ``slots`` says it.
    pages: torch.Tensor | None = None
    page_size: int = 0
    tail: int = 0


class GroupState(Protocol):
    """What a layout reads of the group it serves (``kvpolicy.state.LayerGroup``, which holds
    the layout): the rows' counters, the step's plan, the schedule and which layers it holds."""

    schedule: Schedule
    member: dict[int, int]  # layer index -> buffer index
    layer_ids: torch.Tensor
    rows: RowCounters
    ring: QueryRing  # the window of queries (a two-tier layout's recall reads the step's)
    plan: StepPlan
    extent_now: int
    tokens_seen_before: int
    phase: Phase  # the current step's (``kvpolicy.schedule.step_phase``)

    @property
    def counts(self) -> torch.Tensor: ...
    @property
    def batch(self) -> int: ...
    @property
    def batch_alike(self) -> bool: ...
    @property
    def any_due(self) -> bool: ...
    @property
    def complete(self) -> bool: ...
    def counts_of(self, layer: int) -> torch.Tensor: ...
    def written(self, layer: int) -> bool: ...
    def extent(self, layer: int) -> int: ...
    def materialise_positions(self) -> None: ...


class GroupRunner(Protocol):
    """What a group asks of the executor that runs its policy (``kvpolicy.executor.Executor``):
    the policy, a long step's update as a layer is written, select mode's choice (handed to
    ``SelectRows``), a two-tier policy's recall (handed to ``TwoTierRows``). Layouts never call it: the executor calls them."""

    policy: Policy

    def observe_step(
        self, group: Any, layer: int, queries: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
    ) -> None: ...

    def choose(
        self, group: Any, layer: int, rows: torch.Tensor, row_sel: slice | torch.Tensor, held: HeldSlots,
        key_pages: Mapping[int, tuple[torch.Tensor, torch.Tensor]],
    ) -> Kept: ...

    def recall(self, group: Any, layer: int, inp: RecallInput, k: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class SlotLayout(ABC):
    """How one ``LayerGroup``'s rows and heads use its slots, chosen once when the group is built.

    A layout owns the group's per-slot buffers (``SlotBuffers``: keys, values, positions, and any
    field added there) and everything that depends on where a row's and a head's tokens are: how a
    step writes them, how the buffers grow, what attention reads, how an eviction compacts them,
    how rows are reordered, and the bytes they take. ``reset`` is dropping the group (and with it
    the layout). The group keeps what every layout shares: rows' counters, the query window, the
    step's plan, the schedule. Code outside a layout never asks which layout a group has.
    """

    #: A layout's own parts, for inspection (tests, benchmarks): per-head runs' addressing, select
    #: mode's choices. None where the layout has no such part; no code branches on them.
    heads: HeadLayout | None = None
    select: SelectionState | None = None

    def __init__(
        self, group: GroupState, keys: torch.Tensor, values: torch.Tensor, needed: int,
        state_fields: Mapping[str, StateField],
    ) -> None:
        b, h, _, d = keys.shape
        self.group = group
        self.buffers = SlotBuffers(
            len(group.layer_ids), b, h, self.capacity_for(needed), d, values.shape[-1], keys.dtype, keys.device,
            state=state_fields,
        )

    @classmethod  # noqa: B027  (a hook: most layouts refuse nothing)
    def admit(
        cls, layer: int, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None,
        token_valid: torch.Tensor | None, window: int,
    ) -> None:
        """Refuse a step's input before anything is stored (a layout that checks tokens as they
        enter). Nothing by default."""

    # -- the schedule ---------------------------------------------------------------------------
    @abstractmethod
    def capacity_for(self, needed: int) -> int:
        """Slots per head to allocate when ``needed`` do not fit."""

    @abstractmethod
    def due(self, after: Any, tokens: Any, phase: Phase, added: Any) -> Any:
        """Whether rows holding ``after`` slots after ``tokens`` real tokens, ``added`` of them by
        this step, evict (ints or ``[B]`` tensors) after a step of ``phase``, as ``Schedule.step_due``."""

    def begin_step(self, t: int) -> None:  # noqa: B027  (a hook)
        """After the group planned a step of ``t`` tokens. Nothing by default."""

    @abstractmethod
    def tokens_to_next_eviction(self) -> int:
        """``EvictingCache.tokens_to_next_eviction`` for this group."""

    def draw_counts(self) -> torch.Tensor:
        """``[B]`` host long: what keys each row's random draws (``Policy.select(evictions=...)``):
        the evictions it has had."""
        return self.group.rows.evictions

    # -- storage --------------------------------------------------------------------------------
    @abstractmethod
    def write(self, i: int, new: Mapping[str, torch.Tensor], plan: StepPlan) -> None:
        """Write layer ``i``'s (buffer index) part of a step where ``plan`` places it: ``new``
        holds per-slot fields by name, ``[B, Hkv, T, ...]`` each (keys and values)."""

    @abstractmethod
    def grow(self, capacity: int) -> None:
        """Reallocate every per-slot buffer to ``capacity`` slots per head, keeping what is held."""

    @abstractmethod
    def materialise_positions(self) -> None:
        """Write out the positions of the slots appended since each row's last eviction
        (``LayerGroup.materialise_positions``)."""

    def select_rows(self, host: torch.Tensor, dev: torch.Tensor) -> None:
        """Keep rows ``index [B']`` (on the host and on the device) in that order."""
        self.buffers.select_rows(dev)

    def nbytes(self) -> int:
        """Bytes held by the per-slot buffers and the layout's own state."""
        return self.buffers.nbytes()

    def held_counts(self, layer: int) -> torch.Tensor:
        """``[B, Hkv]`` long (host): the slots each KV head of each row holds on ``layer`` now
        (every head the row's count here; the per-head layout's differ by head)."""
        return self.group.counts_of(layer)[:, None].expand(-1, self.buffers.keys.shape[2]).clone()

    def held_bytes(self) -> int:
        """Bytes of the slots held now (``held_counts`` over the group's layers, each slot's key,
        value, position and state) and the layout's own state: at most ``nbytes``, which counts
        the buffers' whole room."""
        held = sum(int(self.held_counts(layer).sum()) for layer in self.group.member)
        return self.buffers.held_bytes(held) + self.nbytes() - self.buffers.nbytes()

    # -- reading --------------------------------------------------------------------------------
    @abstractmethod
    def attend(self, layer: int, queries: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """Attention of the step's ``queries [B, Hq, T, D]`` over ``layer``'s slots."""

    @abstractmethod
    def slots(self, layer: int) -> SlotView:
        """``layer``'s held slots (``LayerView.keys``, ``values``, ``valid``)."""

    @abstractmethod
    def positions(self, layer: int) -> torch.Tensor:
        """``[B, Hkv, L]`` long, the token index each column of ``slots(layer)`` holds (-1: none)."""

    def attended(self, layer: int) -> SlotView:
        """What the step's queries attend (``EvictingCache.step``): every held slot by default."""
        return self.slots(layer)

    # -- eviction -------------------------------------------------------------------------------
    @abstractmethod
    def eviction_classes(self, due: torch.Tensor) -> list[RowClass]:
        """The due rows (``due [B]`` host bool) in classes evicted together."""

    @abstractmethod
    def compact(self, rows: torch.Tensor, row_sel: slice | torch.Tensor, count: int, held: HeldSlots, kept: Kept) -> int:
        """Keep what the eviction ``kept`` of ``rows``' slots as ``gather_rows`` gave them (``held``;
        ``row_sel``: all rows, or them on the device): move the kept slots, with their new state
        (``kept.state``), into place, every layer at once; return the slots each row holds now."""

    # -- gathering (policies read slots through these) ---------------------------------------------
    @abstractmethod
    def gather_rows(self, rows: torch.Tensor, row_sel: slice | torch.Tensor, count: int) -> HeldSlots:
        """Every layer's slots of ``rows`` (holding ``count`` each) as the policy sees them at an
        eviction, layers stacked on the batch axis: every per-slot field and per-head state, and
        how to store a new state back (``HeldSlots.store``)."""

    @abstractmethod
    def gather_layer(self, layer: int) -> HeldSlots:
        """``layer``'s slots of every row, ``[B, Hkv, L, ...]``, every per-slot field and per-head
        state (what a long step's queries update, ``Executor.observe_step``; ``LayerView.state``),
        and how to store a new state back."""

    def settle_observed(self) -> None:  # noqa: B027  (a hook)
        """Record rows whose state a layout brought up to date during a step on every layer
        (select mode's choices), once the step's last layer has: before the next step at the
        latest. Nothing by default."""
