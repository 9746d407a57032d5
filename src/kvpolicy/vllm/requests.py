"""What vLLM's worker keeps per request beside its blocks, and what one step of requests is: pure torch.

``RequestRecord`` is everything the paged cache (``kvpolicy.vllm.paged_cache``) keeps for one
request: its policy as this worker runs it (``RequestPolicy``, one per distinct policy), its kept
slots' per-slot fields (``KeptSlots``, the one place they live), its per-head state, how much of
it the state has seen, and what preemption carries over. ``RequestQueryRing`` holds every
request's last ``window`` queries. Nothing here imports vLLM or decides anything: the core does
(``kvpolicy.eviction``), the ledger counts (``kvpolicy.vllm.ledger``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from ..policy import Policy
from ..query_ring import filled, time_order
from ..schedule import Schedule
from ..stages.base import EvictionInput, StateField
from .budgets import group_head_caps, group_schedules
from .paged import Gathered
from .settings import Resolved
from .support import KVPolicyVLLMError


class BlockTable(Protocol):
    """What ``PagedCache`` reads and writes of the runner's block table (vLLM's ``BlockTable``
    of the one KV-cache group): the rows' block ids, how many each row holds, and a row rewritten."""

    num_blocks_per_row: Any  # [max_reqs] ints

    def get_cpu_tensor(self) -> torch.Tensor: ...  # [max_reqs, max_blocks] int
    def add_row(self, block_ids: list[int], row_idx: int) -> None: ...


@dataclass(frozen=True)
class StepRequests:
    """The requests of the step being run, in the model runner's batch order (``[R]`` arrays)."""

    req_ids: list[str]
    scheduled: np.ndarray  # tokens computed for each request in this step
    computed_before: np.ndarray  # tokens each request had computed before this step
    prompt_len: np.ndarray
    _last_queries: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def last_queries(self, rows: np.ndarray, window: int, device: torch.device
                     ) -> tuple[np.ndarray, torch.Tensor, torch.Tensor | None]:
        """The last ``min(scheduled, window)`` tokens of the requests at batch ``rows``: how many
        each has, then per token its ring position (token ``t`` goes to ``t % window``: a ring
        keeps the last ``window``) and its row in the step's flattened tokens (None where they
        are the first rows in order, as when every request decodes one token). Once per step:
        every KV-cache group of a per-layer server asks alike."""
        key = (window, rows.tobytes(), device)
        found = self._last_queries.get(key)
        if found is None:
            n = self.scheduled
            take = np.minimum(n[rows], window)
            rep, last = np.repeat(rows, take), np.repeat(take, take)
            j = np.arange(int(take.sum())) - np.repeat(np.cumsum(take) - take, take)
            flat = np.cumsum(n)[rep] - last + j
            pos = (self.computed_before[rep] + n[rep] - last + j) % window
            in_order = bool(np.array_equal(flat, np.arange(flat.size)))
            found = self._last_queries[key] = (take, torch.from_numpy(pos).to(device),
                                               None if in_order else torch.from_numpy(flat).to(device))
        return found


@dataclass(frozen=True)
class QueryCapture:
    """Where this step's last ``window`` queries of each request go in its ring: one copy per
    layer (a layer's queries arrive one at a time, inside the forward), planned once per step."""

    ring_rows: torch.Tensor  # [rows * layers * window, Hq * D]: the ring, read flat
    dest: torch.Tensor  # [layers, T]: each captured query's row of ``ring_rows``, per layer
    token_idx: torch.Tensor | None  # [T]: their rows in the step's flattened tokens; None: the first T, in order

    @classmethod
    def plan(cls, ring: RequestQueryRing, rows: torch.Tensor, pos: torch.Tensor, token_idx: torch.Tensor | None
             ) -> QueryCapture:
        """Token ``token_idx[i]`` (None: ``i``) of the step goes to ring row ``rows[i]`` at position ``pos[i]``."""
        first = rows * (ring.layers * ring.window) + pos  # layer 0's ring row of each query
        dest = first[None, :] + torch.arange(ring.layers, device=first.device)[:, None] * ring.window
        return cls(ring.tensor.view(-1, ring.q_heads * ring.head_dim), dest, token_idx)

    def write(self, layer: int, query: torch.Tensor) -> None:
        """Layer ``layer``'s queries of the step (``[T_step, Hq * D]``, rows past the step's tokens ignored)."""
        q = query[: self.dest.shape[1]] if self.token_idx is None else query.index_select(0, self.token_idx)
        self.ring_rows.index_copy_(0, self.dest[layer], q.to(self.ring_rows.dtype))


class RequestQueryRing:
    """The last ``window`` post-RoPE queries of each request using it, per layer:
    ``tensor [rows, layers, window, Hq, D]``, on the cache's device; a row per request, rows are
    reused. (Not ``kvpolicy.query_ring.QueryRing``, the ring of a cache's layer group.)"""

    def __init__(self, window: int, layers: int, q_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.window, self.layers, self.q_heads, self.head_dim = window, layers, q_heads, head_dim
        self.tensor = torch.zeros(0, layers, window, q_heads, head_dim, dtype=dtype, device=device)
        self.row_of: dict[str, int] = {}
        self.free_rows: list[int] = []

    def row(self, req_id: str) -> int:
        row = self.row_of.get(req_id)
        if row is not None:
            return row
        if not self.free_rows:
            old = self.tensor.shape[0]
            new = max(8, 2 * old)
            grown = self.tensor.new_zeros(new, self.layers, self.window, self.q_heads, self.head_dim)
            grown[:old] = self.tensor
            self.tensor = grown
            self.free_rows.extend(range(new - 1, old - 1, -1))
        row = self.row_of[req_id] = self.free_rows.pop()
        return row

    def drop(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.free_rows.append(row)

    def read(self, req_ids: list[str], tokens: torch.Tensor, layers: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """The requests' last ``window`` queries of ``layers`` after ``tokens [R]`` tokens each, oldest
        first (``kvpolicy.query_ring.time_order``: a query of token ``t`` sits at ``t % window``), stacked
        layer-major as an eviction's keys are: ``[Lyr * R, Hq, W, D]``, and which entries hold a query
        ``[Lyr * R, W]``."""
        rows = torch.tensor([self.row_of[q] for q in req_ids], dtype=torch.long, device=self.tensor.device)
        order = time_order(tokens % self.window, self.window, self.tensor.device)  # [R, W]
        win = self.tensor[:, layers][rows]  # [R, Lyr, W, Hq, D]: only the layers read are copied
        win = win.gather(2, order[:, None, :, None, None].expand_as(win))
        valid = filled(tokens.to(self.tensor.device), self.window)
        return win.permute(1, 0, 3, 2, 4).flatten(0, 1), valid.repeat(win.shape[1], 1)


@dataclass(frozen=True)
class KeptSlots:
    """What is kept per slot of a request beside vLLM's keys and values, for its first ``K``
    slots (those kept at its last eviction, or every slot its policy's state was last brought up
    to date over): ``[Lyr, Hkv, K]`` tensors that move with the slots.

    Every per-slot field lives here, and only here: ``fresh`` says what a slot appended since
    holds, ``extend`` joins the kept and the fresh slots for an eviction's input, and ``take``
    keeps the chosen ones. The fields are the token positions and the policy's per-slot state
    (``Policy.state_fields``, by stored name)."""

    positions: torch.Tensor  # token index of each slot
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # the policy's per-slot state

    @property
    def count(self) -> int:
        return self.positions.shape[-1]

    @staticmethod
    def fresh(
        start: int, n: int, offset: int, layers: int, heads: int, device: torch.device,
        fields: Mapping[str, StateField] | None = None,
    ) -> KeptSlots:
        """Slots ``start .. n-1`` appended since: slot ``s`` holds token ``s + offset``, and each
        state field its initial value (``StateField.initial_values``)."""
        pos = (torch.arange(start, n, device=device) + offset).expand(layers, heads, n - start).clone()
        state = {name: spec.initial_values(pos) for name, spec in (fields or {}).items() if spec.per == "slot"}
        return KeptSlots(pos, state)

    @staticmethod
    def extend(kept: KeptSlots | None, fresh: KeptSlots) -> KeptSlots:
        if kept is None:
            return fresh
        state = {name: torch.cat([kept.state[name], t], dim=-1) for name, t in fresh.state.items()}
        return KeptSlots(torch.cat([kept.positions, fresh.positions], dim=-1), state)

    def with_state(self, state: Mapping[str, torch.Tensor]) -> KeptSlots:
        """These slots with some state fields replaced (``[Lyr, Hkv, K]`` each)."""
        return KeptSlots(self.positions, {**self.state, **{k: v for k, v in state.items() if k in self.state}})

    def take(self, idx: torch.Tensor) -> KeptSlots:
        """The slots at ``idx [Lyr, Hkv, K]`` (a copy)."""
        return KeptSlots(self.positions.gather(-1, idx), {name: t.gather(-1, idx) for name, t in self.state.items()})


@dataclass(frozen=True)
class LongStep:
    """A request whose chunk in this step holds more tokens than its policy's window, under a
    policy whose state sees every query: where its queries are, and its slots after the chunk."""

    row: int  # its row in the runner's batch
    first: int  # its first token's index in the step's flattened tokens
    tokens: int  # tokens in its chunk
    before: int  # tokens it had computed before the chunk (the first one's position)
    offset: int  # tokens evicted so far
    slots_after: int  # slots it holds once the chunk is written


@dataclass(frozen=True)
class RequestPolicy:
    """A policy as this worker runs it: loaded once per distinct resolved policy (``load``)."""

    resolved: Resolved
    policy: Policy | None  # None: the request never evicts
    schedule: Schedule | None = None  # this cache's layers' schedule under it (per-layer budgets: its layer's)
    head_cap: int | None = None  # its per-head bound in this cache's layers (``budgets.group_head_caps``)

    @property
    def window(self) -> int:
        """Queries its stages read (0: it never evicts)."""
        return 0 if self.policy is None else self.policy.schedule.window

    @staticmethod
    def load(resolved: Resolved, check: Callable[[Policy | None], None], kv_heads: int,
             layer: tuple[int, int] | None) -> RequestPolicy:
        """``resolved`` loaded and ``check``ed, with the schedule and per-head bound of the cache's
        layers: every layer's (one KV-cache group), or ``layer = (index, model layers)``'s, a
        per-layer group's (``budgets.group_schedules``, ``budgets.group_head_caps``)."""
        policy = resolved.policy()
        check(policy)
        groups = None if layer is None else list(range(layer[1]))
        mine = 0 if layer is None else layer[0]
        schedules = group_schedules(policy, groups, kv_heads)
        return RequestPolicy(resolved, policy, schedules[mine], group_head_caps(policy, groups, kv_heads)[mine])


@dataclass
class RequestRecord:
    """Everything this worker keeps for one request beside its blocks and its query ring row:
    made once, when the request is first seen (``PagedCache.record``), and dropped once
    (``PagedCache.drop``). A preempted request's record is made anew by ``resume``, carrying
    only its policy, the eviction points its recompute replays and its decided layer schedule."""

    policy: RequestPolicy
    #: Per-slot fields of its first ``kept.count`` slots (kept at its last eviction, or every slot
    #: its state was last brought up to date over); None before either.
    kept: KeptSlots | None = None
    #: A policy that keeps state: its per-head fields ``[Lyr, Hkv]`` (made on first use), and how
    #: many of its tokens' queries the state has seen.
    head_state: dict[str, torch.Tensor] | None = None
    observed: int = 0
    #: Per-head budgets (``Policy.per_head``): each head's kept count ``[Lyr, Hkv]`` (host) since its
    #: last eviction, and the fewest of them (read at every step: ``uneven``); None: every head
    #: holds every slot of the block table.
    head_counts: torch.Tensor | None = None
    fewest_head: int | None = None
    #: Layer budgets decided from the prompt (CAKE): its layer schedule from its first eviction on
    #: (kept through preemption, for the replay), and whether its block table keeps the blocks past
    #: its kept slots until the scheduler, which learns the budget from the step's output, frees them.
    decided: Schedule | None = None
    untrimmed: bool = False
    #: Made by ``resume``: the eviction points its recompute replays, handed to the ledger when the
    #: request next runs (``tracked`` then).
    replay: list[int] | None = None
    tracked: bool = False
    #: The request's prompt tokens (vLLM's ``num_prompt_tokens``), set by every step that runs it
    #: (``PagedCache.begin_step``): what a stage reading the prompt gets (``prompt_lengths``).
    prompt_len: int | None = None

    def counted_heads(self, counts: torch.Tensor) -> None:
        """Each head's kept count ``[Lyr, Hkv]`` after an eviction under per-head budgets."""
        self.head_counts, self.fewest_head = counts, int(counts.min())

    @property
    def uneven(self) -> bool:
        """Whether the request's heads hold different counts (some head fewer than its room)."""
        return self.fewest_head is not None and self.kept is not None and self.fewest_head < self.kept.count

    def head_fields(self, layers: int, kv_heads: int, device: torch.device) -> dict[str, torch.Tensor]:
        """The request's per-head state fields, ``[Lyr, Hkv]`` each (initial on first use)."""
        if self.head_state is None:
            policy = evicting_policy(self.policy)
            self.head_state = {name: spec.initial_head_values((layers, kv_heads), device)
                               for name, (_, _, spec) in policy.state_fields.items() if spec.per == "head"}
        return self.head_state


@dataclass(frozen=True)
class Evicted:
    """One request's eviction: its batch row and the block table it now has."""

    row: int
    req_id: str
    blocks: list[int]


class RequestClass(NamedTuple):
    """Requests of one policy holding one count, evicted or updated together (each as it would
    alone): the step driver's class of rows in vLLM (``kvpolicy.driver``), with this step's
    block ``table``."""

    policy: RequestPolicy
    held: int  # slots each holds
    members: list[tuple[int, str]]  # (batch row, request id)
    table: BlockTable


@dataclass(frozen=True)
class HeldRequests:
    """Some requests' slots as an eviction reads them (``PagedCache.gather_requests``)."""

    rows: torch.Tensor  # their batch rows
    req_ids: list[str]
    states: list[Any]  # their ledger entries (``RequestSlots``)
    slots: list[KeptSlots]  # their per-slot fields, kept then fresh
    gathered: list[Gathered]  # per layer, their keys and values [R, Hkv, N, D] (copies; values None: not read)
    inp: EvictionInput
    positions: torch.Tensor | None = None  # per-head budgets: [Lyr, R, Hkv, N] each column's token (-1: none)
    columns: torch.Tensor | None = None  # per-head budgets: [Lyr, R, Hkv, N] each column's slot in its lane


@dataclass
class Placement:
    """Where one eviction of some requests puts what it keeps (``PagedCache._place_even``,
    ``_place_heads``): each head's kept slots in order ``[Lyr, R, Hkv, k]``, the slots a request
    holds after it (``room``), the keys and values to compact (merged where the policy merges),
    each request's per-slot fields, each head's count under per-head budgets (``[Lyr, R, Hkv]``,
    host; else None), and what the trace records of the choice."""

    order: torch.Tensor
    room: int
    gathered: list[Gathered]
    slots: list[KeptSlots]
    counts: torch.Tensor | None
    traced: torch.Tensor
    columns: torch.Tensor | None = None  # per-head budgets: where ``order``'s columns are in each lane


def evicting_policy(rp: RequestPolicy) -> Policy:
    """The policy of a request that evicts (the ledger never makes one without a schedule due)."""
    if rp.policy is None:
        raise KVPolicyVLLMError(f"policy {rp.resolved.source!r} never evicts, yet a request of it was due")
    return rp.policy


def kept_slots_of(record: RequestRecord) -> KeptSlots:
    """The kept slots of a request that evicted."""
    if record.kept is None:
        raise KVPolicyVLLMError("a request that evicted has no kept slots recorded")
    return record.kept


def stacked_state(records: list[RequestRecord], slots: list[KeptSlots], layers: int, kv_heads: int,
                  device: torch.device) -> dict[str, torch.Tensor]:
    """Some requests' state, layer-major on the batch axis as their keys are: ``[Lyr * R, Hkv, N]``
    per slot (``slots``: each request's, kept then fresh), ``[Lyr * R, Hkv]`` per head."""
    state = {name: torch.stack([x.state[name] for x in slots], dim=1).flatten(0, 1) for name in slots[0].state}
    for name in evicting_policy(records[0].policy).state_fields:
        if name not in state:
            fields = [r.head_fields(layers, kv_heads, device)[name] for r in records]
            state[name] = torch.stack(fields, dim=1).flatten(0, 1)
    return state


def stored_state(records: list[RequestRecord], slots: list[KeptSlots], layers: int, kv_heads: int,
                 device: torch.device, state: Mapping[str, torch.Tensor]) -> list[KeptSlots]:
    """The requests' new ``state`` (as ``stacked_state`` lays it out) stored: per-head fields in
    their records, and each request's ``slots`` with its new per-slot fields, returned."""
    r = len(records)
    out = []
    for j, (record, x) in enumerate(zip(records, slots, strict=True)):
        per_slot = {name: t.view(layers, r, *t.shape[1:])[:, j] for name, t in state.items() if name in x.state}
        for name, t in state.items():
            if name not in x.state:
                record.head_fields(layers, kv_heads, device)[name] = t.view(layers, r, -1)[:, j].clone()
        out.append(x.with_state(per_slot))
    return out
