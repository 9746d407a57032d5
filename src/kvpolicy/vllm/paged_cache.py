"""The requests' slots in vLLM's paged KV cache, and what a policy keeps beside them: pure torch.

``PagedCache`` is the paged layout of the vLLM integration. It gathers a request's slots through
its block table, hands them to the eviction core (``kvpolicy.eviction``: the same ``evict``,
``observe``, ``observe_long_step`` and every-query rule that ``EvictingCache`` runs), and
compacts what the core keeps to the front of the request's blocks. Of its own it keeps only what
paging and vLLM's request lifecycle need:

- a ring of each request's last ``window`` post-RoPE queries per layer (``RequestQueryRing``);
- each request's per-slot fields, its kept slots' token positions and the policy's per-slot
  state (``KeptSlots``), and the policy's per-head state;
- the slot ledger (``kvpolicy.vllm.ledger``), the one rule the scheduler and every worker share.

Nothing here imports vLLM: the worker (``kvpolicy.vllm.worker``) feeds it each step's requests,
queries and block tables; the tests drive it directly against ``EvictingCache``
(``tests/test_vllm_parity.py``). It is not a ``kvpolicy.layouts.SlotLayout``: those serve a
fixed batch of rows stepped together, where requests here join, leave, are preempted and resumed
at every step; both layouts meet at the core and at ``kvpolicy.policy.eviction_input``, where
every decision is made.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from .. import eviction
from ..attend import attend_heads
from ..documents import PolicyError
from ..heads import own_columns
from ..policy import Policy, eviction_input
from ..query_ring import filled, time_order
from ..schedule import Schedule
from ..stages.base import EvictionInput, StateField
from ..stages.model_facts import ModelFacts
from .ledger import BlocksDisagree, SlotLedger, compaction, kept_held
from .paged import KV, compact, gather_paged, slot_address
from .settings import KVPolicyVLLMError, Resolved, decides_from_prompt, group_head_caps, group_schedules

#: How many eviction inputs a trace folder receives per process (for parity checks).
TRACE_SAVES = int(os.environ.get("KVPOLICY_VLLM_TRACE_SAVES", "4"))


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

    def tokens_after(self, i: int) -> int:
        return int(self.computed_before[i] + self.scheduled[i])


@dataclass(frozen=True)
class QueryCapture:
    """Where this step's last ``window`` queries of each request go in its ring (``[T]`` each)."""

    ring: RequestQueryRing
    ring_rows: torch.Tensor  # the request's ring row
    ring_pos: torch.Tensor  # the position in the ring: token index modulo window
    token_idx: torch.Tensor  # the query's row in this step's flattened tokens


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
        win = self.tensor[rows][:, layers]  # [R, Lyr, W, Hq, D]
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
    """A policy as this worker runs it: loaded once per distinct resolved policy."""

    resolved: Resolved
    policy: Policy | None  # None: the request never evicts
    schedule: Schedule | None = None  # this cache's layers' schedule under it (per-layer budgets: its layer's)
    head_cap: int | None = None  # its per-head bound in this cache's layers (``settings.group_head_caps``)


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
    #: last eviction; None: every head holds every slot of the block table.
    head_counts: torch.Tensor | None = None
    #: Layer budgets decided from the prompt (CAKE): its layer schedule from its first eviction on
    #: (kept through preemption, for the replay), and whether its block table keeps the blocks past
    #: its kept slots until the scheduler, which learns the budget from the step's output, frees them.
    decided: Schedule | None = None
    untrimmed: bool = False
    #: Made by ``resume``: the eviction points its recompute replays, handed to the ledger when the
    #: request next runs (``tracked`` then).
    replay: list[int] | None = None
    tracked: bool = False


@dataclass(frozen=True)
class Evicted:
    """One request's eviction: its batch row and the block table it now has."""

    row: int
    req_id: str
    blocks: list[int]


@dataclass(frozen=True)
class HeadAttention:
    """This step's requests whose heads hold different counts (per-head budgets), and what each
    layer's attention over their own slots reads (``PagedCache.attend_heads``). Per layer ``l``
    of ``[Lyr, B, Hkv, W]``: column ``w`` of a head is its kept slot ``w`` (the front of its lane),
    then its slots appended since the last eviction (from the reserved room's end on); the padding
    between them is in no column."""

    token_idx: torch.Tensor  # [B, T] each query's row in the step's flattened tokens (0 past a chunk)
    token_valid: torch.Tensor  # [B, T] which of those hold a query of the request
    blocks: torch.Tensor  # [Lyr, B, Hkv, W] the block of each column's slot
    offsets: torch.Tensor  # [Lyr, B, Hkv, W] its offset in the block
    heads: torch.Tensor  # [Lyr, B, Hkv, W] its KV head
    mask: torch.Tensor  # [Lyr, B, Hkv, T, W] bool: the columns query t attends (causal over appended slots)


@dataclass(frozen=True)
class HeldRequests:
    """Some requests' slots as an eviction reads them (``PagedCache._gather_requests``)."""

    rows: torch.Tensor  # their batch rows
    req_ids: list[str]
    states: list[Any]  # their ledger entries (``RequestSlots``)
    slots: list[KeptSlots]  # their per-slot fields, kept then fresh
    gathered: list[KV]  # per layer, their keys and values [R, Hkv, N, D] (copies)
    inp: EvictionInput
    positions: torch.Tensor | None = None  # per-head budgets: [Lyr, R, Hkv, N] each column's token (-1: none)


class PagedCache:
    """Every request's slots in the paged cache of one worker (one tensor-parallel rank).

    Args:
        kv: per layer, its keys and values ``[num_blocks, block_size, Hkv, D]`` (cache views:
            ``kvpolicy.vllm.layout.BlockLayout.split``).
        layer_ids: the model's index of each layer of ``kv`` (what keys per-layer draws).
        q_heads: the attention's query heads on this rank.
        head_dim: the attention's head size.
        block_size: slots per block.
        head_offset: the model's index of this rank's first KV head (tensor parallelism).
        prefix_caching: whether vLLM's prefix cache may share a request's blocks (then a first
            eviction writes into fresh blocks, never into shared ones).
        policy_of: a request's resolved policy (its own, else the server's), asked once per request.
        trace: a folder receiving a record of every eviction, and its first inputs.
        rank: this worker's tensor-parallel rank (names the trace files).
        model_facts: what the stages of a policy that reads the model may ask of it
            (``Policy.needs_model``): the facts of this rank's share of the model
            (``kvpolicy.vllm.facts.model_facts``), handed to every eviction. Each policy is checked
            against them when first loaded (``check_policy``), with ``KVPolicyCache``'s errors.
        per_head_refusal: why this engine's attention cannot attend heads of uneven counts
            (``attend_heads``: plain softmax attention only); a per-head policy is then refused
            when first loaded. None: it can.
        model_layers: set when this cache serves one KV-cache group of a server under per-layer
            budgets (``kvpolicy.vllm.layer_spec``): its one layer (``layer_ids[0]`` of a model of
            ``model_layers``) keeps that layer's budget and runs that layer's schedule
            (``settings.group_schedules``), in a block table of its own. None: the cache serves
            every layer, in the one block table they share.
    """

    def __init__(
        self, kv: list[KV], layer_ids: list[int], *, q_heads: int, head_dim: int, block_size: int,
        policy_of: Callable[[str], Resolved], head_offset: int = 0, prefix_caching: bool = False,
        trace: Path | None = None, rank: int = 0, model_facts: ModelFacts | None = None,
        per_head_refusal: str | None = None, model_layers: int | None = None,
    ) -> None:
        if model_layers is not None and len(layer_ids) != 1:
            raise ValueError(f"a per-layer KV-cache group holds one layer, got layers {layer_ids}")
        self.model_layers = model_layers
        self.kv = kv
        self.layer_ids = list(layer_ids)
        self.q_heads, self.head_dim, self.block_size = q_heads, head_dim, block_size
        self.kv_heads = int(kv[0][0].shape[2])
        self.device, self.dtype = kv[0][0].device, kv[0][0].dtype
        self.head_offset, self.prefix_caching = head_offset, prefix_caching
        self.resolve = policy_of
        self.ledger = SlotLedger()
        self.policies: dict[str | None, RequestPolicy] = {}  # by resolved policy YAML
        self.records: dict[str, RequestRecord] = {}  # by request
        self.rings: dict[int, RequestQueryRing] = {}  # by window size
        # This step's requests whose chunk is longer than their window, under a policy whose state
        # sees every query (seen layer by layer, as the chunk is computed), and those whose heads
        # hold different counts (per-head budgets).
        self.long_steps: dict[str, LongStep] = {}
        self.head_attention: HeadAttention | None = None
        self.plan: StepRequests | None = None
        self.captures: list[QueryCapture] = []
        self.trace, self.rank, self.saves, self.step = trace, rank, 0, 0
        self.model_facts = model_facts
        self.per_head_refusal = per_head_refusal
        if trace is not None:
            trace.mkdir(parents=True, exist_ok=True)

    @property
    def layers(self) -> int:
        return len(self.kv)

    # -- requests joining and leaving -------------------------------------------------------
    def drop(self, req_id: str) -> None:
        """Forget a request (finished, or about to be resubmitted under the same id)."""
        self.ledger.reset(req_id)
        record = self.records.pop(req_id, None)
        if record is not None and record.policy.policy is not None:
            ring = self.rings.get(record.policy.policy.schedule.window)
            if ring is not None:
                ring.drop(req_id)

    def resume(self, req_id: str) -> list[int] | None:
        """A preempted request, now recomputed into fresh blocks: it replays its evictions (the
        scheduler ends its steps at the same points), from this worker's own record of them, and
        keeps the layer budget its first run decided. Returns the eviction points it will replay
        (None: none recorded)."""
        old = self.records.get(req_id)
        plan = self.ledger.replay_plan(req_id)
        if plan is None and old is not None:
            plan = old.replay  # preempted again before it ran
        self.drop(req_id)
        if old is not None:
            self.records[req_id] = RequestRecord(old.policy, decided=old.decided, replay=plan)
        return plan

    def record(self, req_id: str) -> RequestRecord:
        """The request's record: made (its policy looked up) when first seen, and tracked in the
        ledger from then on."""
        record = self.records.get(req_id)
        if record is not None and record.tracked:
            return record
        if record is None:
            record = self.records[req_id] = RequestRecord(self._policy_plan(self.resolve(req_id)))
        rp = record.policy
        self.ledger.resume(req_id, rp.schedule, record.replay, rp.head_cap, from_prompt=decides_from_prompt(rp.policy),
                           layer_schedule=record.decided)
        record.replay, record.tracked = None, True
        return record

    def request_policy(self, req_id: str) -> RequestPolicy:
        """The request's policy (``record``)."""
        return self.record(req_id).policy

    def _policy_plan(self, r: Resolved) -> RequestPolicy:
        """A resolved policy as this cache runs it, loaded and checked once per distinct policy."""
        rp = self.policies.get(r.policy_yaml)
        if rp is None:
            policy = r.policy()
            self.check_policy(policy)
            # Every layer's KV-cache group, or this one layer's (of a model of model_layers).
            groups = None if self.model_layers is None else list(range(self.model_layers))
            schedules = group_schedules(policy, groups, self.kv_heads)
            caps = group_head_caps(policy, groups, self.kv_heads)
            mine = 0 if groups is None else self.layer_ids[0]
            rp = self.policies[r.policy_yaml] = RequestPolicy(r, policy, schedules[mine], caps[mine])
        return rp

    def check_policy(self, policy: Policy | None) -> None:
        """Refuse a policy whose stages read model facts these cannot give (``KVPolicyVLLMError``
        with ``Policy.check_model_facts``'s message: a fact missing, or a calibration file for
        another model), for this rank's KV heads; and a per-head policy where heads of uneven
        counts cannot be attended here (``per_head_refusal``)."""
        if policy is not None and policy.per_head and self.per_head_refusal is not None:
            raise KVPolicyVLLMError(f"policy {policy.name!r} keeps a count of its own per head, which this model's "
                                    f"attention cannot serve: {self.per_head_refusal}")
        if policy is None or not policy.needs_model:
            return
        try:
            policy.check_model_facts(self.model_facts, head_dim=self.head_dim, num_kv_heads=self.kv_heads,
                                     head_offset=self.head_offset, q_heads=self.q_heads)
        except PolicyError as exc:
            raise KVPolicyVLLMError(f"policy {policy.name!r} cannot serve this model:\n{exc}") from None

    def _ring(self, window: int) -> RequestQueryRing:
        ring = self.rings.get(window)
        if ring is None:
            ring = self.rings[window] = RequestQueryRing(window, self.layers, self.q_heads, self.head_dim,
                                                         self.dtype, self.device)
        return ring

    def _window_size(self, req_id: str) -> int:
        policy = self.request_policy(req_id).policy
        return 0 if policy is None else policy.schedule.window

    # -- before the forward -----------------------------------------------------------------
    def begin_step(self, plan: StepRequests, table: BlockTable) -> None:
        """Before a forward of ``plan``'s requests: where each request's last ``window`` queries
        go in its ring, and, for policies whose state sees every query, the updates due before
        this step's queries push unseen ones out of the window (``eviction.must_observe``)."""
        self.plan = plan
        self.captures = []
        self.head_attention = None
        req_ids, n, before = plan.req_ids, plan.scheduled, plan.computed_before
        if not req_ids:
            return
        # The last min(n, w) tokens of each request in this step; a query of token t goes to ring
        # position t % w, so the ring always holds the request's last w queries.
        windows = np.array([self._window_size(r) for r in req_ids], dtype=np.int64)  # each request's record made
        self.head_attention = self._plan_head_attention(plan, table)
        ends = np.cumsum(n)
        dev = self.device
        for w in sorted(set(windows.tolist()) - {0}):
            idx = np.flatnonzero(windows == w)
            take = np.minimum(n[idx], w)
            rep = np.repeat(idx, take)
            j = np.arange(int(take.sum())) - np.repeat(np.cumsum(take) - take, take)
            flat = ends[rep] - np.repeat(take, take) + j
            pos = (before[rep] + n[rep] - np.repeat(take, take) + j) % w
            ring = self._ring(w)
            rows = np.repeat(np.array([ring.row(req_ids[i]) for i in idx], dtype=np.int64), take)
            self.captures.append(QueryCapture(ring, torch.from_numpy(rows).to(dev), torch.from_numpy(pos).to(dev),
                                              torch.from_numpy(flat).to(dev)))
        self._plan_state(req_ids, n, before, table)

    def _plan_state(self, req_ids: list[str], n: np.ndarray, before: np.ndarray, table: BlockTable) -> None:
        self.long_steps = {}
        pending: dict[tuple[str, int], list[tuple[int, str]]] = {}
        ends = np.cumsum(n)
        for i, req_id in enumerate(req_ids):
            record = self.records[req_id]
            rp = record.policy
            if rp.policy is None or not rp.policy.observes_queries:
                continue
            window, ledger = rp.policy.schedule.window, self.ledger.get(req_id)
            tokens, done = int(n[i]), int(before[i])
            if eviction.must_observe(done - record.observed, tokens, window):
                pending.setdefault((rp.resolved.policy_yaml or "", ledger.slots), []).append((i, req_id))
            if eviction.is_long_step(tokens, window):
                self.long_steps[req_id] = LongStep(i, int(ends[i]) - tokens, tokens, done, ledger.offset,
                                                   ledger.slots + tokens)
        for (_, count), group in sorted(pending.items()):
            self._observe(self.records[group[0][1]].policy, count, group, table)
        for req_id, step in self.long_steps.items():  # seen as planned (``eviction.is_long_step``), as the caches do
            self.records[req_id].observed = step.before + step.tokens

    # -- during the forward -----------------------------------------------------------------
    def capture_queries(self, layer: int, query: torch.Tensor) -> None:
        """Layer ``layer``'s post-RoPE queries of this step (``[T, Hq * D]`` or ``[T, Hq, D]``)."""
        if not self.captures:
            return
        q = query.view(query.shape[0], self.q_heads, self.head_dim)
        for cap in self.captures:
            cap.ring.tensor[cap.ring_rows, layer, cap.ring_pos] = q[cap.token_idx].to(self.dtype)

    def after_attention(self, layer: int, query: torch.Tensor, table: BlockTable) -> None:
        """After a layer's attention, for the requests whose chunk is longer than their window
        (``LongStep``): the state sees each of the chunk's queries over the layer's slots (written
        by now), before the ring keeps only the last ``window`` (``eviction.observe_long_step``)."""
        if not self.long_steps:
            return
        q = query.view(query.shape[0], self.q_heads, self.head_dim)
        for req_id, step in self.long_steps.items():
            record = self.records[req_id]
            rp = record.policy
            policy = rp.policy
            if policy is None:
                raise KVPolicyVLLMError(f"request {req_id}: a long step planned for a request that never evicts")
            n = step.slots_after
            keys, values = self._gather(table, torch.tensor([step.row]), n, [layer])
            slots = self._slots(req_id, step.offset, n)
            state = {name: t[layer : layer + 1] for name, t in slots.state.items()}
            for name, t in self._heads(record, policy).items():
                state[name] = t[layer : layer + 1]
            queries = q[step.first : step.first + step.tokens].to(keys.dtype).permute(1, 0, 2)[None]  # [1, Hq, T, D]
            positions = torch.arange(step.before, step.before + step.tokens, device=self.device)[None]
            inp = self._input(rp, keys, values, queries[:, :, :0], None, slots.positions[layer : layer + 1],
                              [self.layer_ids[layer]], evictions=[0], state=state)
            new = eviction.observe_long_step(policy, inp, queries, positions, torch.ones_like(positions, dtype=torch.bool))
            per_slot = {}
            for name, t in new.items():
                if name in slots.state:
                    full = slots.state[name].clone()
                    full[layer] = t[0]
                    per_slot[name] = full
                else:
                    self._heads(record, policy)[name][layer] = t[0]
            record.kept = slots.with_state(per_slot)

    # -- after the forward ------------------------------------------------------------------
    def end_step(self, table: BlockTable) -> list[Evicted]:
        """After the forward: advance each request on its policy's schedule and evict the due
        ones, grouped by policy and slot count (each evicts exactly as it would alone). Returns
        the requests that evicted, with their new block tables (already written to ``table``)."""
        return self.evict_due(self.advance_step(), table)

    def advance_step(self) -> list[tuple[int, str]]:
        """After the forward: advance each request of the step on its schedule; returns the due
        ones (batch row, request id), for ``evict_due`` (``decide_layer_budgets`` in between)."""
        plan, self.plan = self.plan, None
        if plan is None:
            return []
        self.step += 1
        self.long_steps = {}
        due: list[tuple[int, str]] = []
        for i, req_id in enumerate(plan.req_ids):
            self.request_policy(req_id)  # tracked in the ledger under its policy's schedule
            if self.ledger.advance(req_id, plan.tokens_after(i), int(plan.prompt_len[i])):
                due.append((i, req_id))
        return due

    def evict_due(self, due: list[tuple[int, str]], table: BlockTable) -> list[Evicted]:
        """Evict the ``due`` requests (``advance_step``), grouped by policy, slot count and budget
        (each evicts exactly as it would alone). Returns the requests that evicted, with their
        new block tables (already written to ``table``)."""
        groups: dict[tuple[str, int, int], list[tuple[int, str]]] = {}
        groups_w: dict[tuple[str, int, int], list[tuple[int, str]]] = {}
        for i, req_id in due:
            rp, entry = self.records[req_id].policy, self.ledger.get(req_id)
            held, name = entry.held, rp.resolved.policy_yaml or ""
            if rp.policy is not None and rp.policy.per_head:  # grouped by its view's width too: its draws are its own
                groups_w.setdefault((name, held, self._head_width(req_id, held)), []).append((i, req_id))
                continue
            groups.setdefault((name, held, evicts_to(entry).budget), []).append((i, req_id))
        out: list[Evicted] = []
        for (_, count, _), group in sorted(groups.items()):
            out += self._evict(self.records[group[0][1]].policy, count, group, table)
        for (_, count, _), group in sorted(groups_w.items()):
            out += self._evict_heads(self.records[group[0][1]].policy, count, group, table)
        return out

    def _evict(self, rp: RequestPolicy, n: int, group: list[tuple[int, str]], table: BlockTable) -> list[Evicted]:
        """Evict the requests of ``group`` (batch row, request id), which all run ``rp`` and hold
        ``n`` slots: one ``eviction.evict`` over every layer and request, the kept slots compacted
        to the front of the request's blocks, and the blocks past them dropped from its block table.

        Under prefix caching a request's first eviction writes the kept slots into the fresh
        blocks the scheduler appended for it (``kvpolicy.vllm.scheduler``), never into its old
        blocks, which other requests may read or the prefix cache hand out again; the request's
        block table becomes those fresh blocks."""
        policy = _evicting(rp)
        held = self._gather_requests(rp, n, group, table)
        rows, req_ids, states, slots, inp = held.rows, held.req_ids, held.states, held.slots, held.inp
        lyr, r = self.layers, len(group)
        kept = eviction.evict(policy, inp)
        if kept.slots is None:
            raise KVPolicyVLLMError(f"policy {policy.name!r} kept a count per head: it evicts through _evict_heads")
        if policy.keeps_state:
            slots = self._keep_state(req_ids, slots, kept.state)
        k = kept.slots.shape[-1]
        per_req = kept.slots.view(lyr, r, self.kv_heads, k)
        new_tables = [self._kept_blocks(table, int(rows[j]), req_id, states[j].evictions == 0, n, k)
                      for j, req_id in enumerate(req_ids)]
        dst = torch.tensor(new_tables, dtype=torch.long, device=self.device)
        gathered = held.gathered
        if kept.values is not None:  # a merge: the kept slots' merged values go to the blocks
            merged = kept.values.view(lyr, r, *kept.values.shape[1:])
            gathered = [(g[0], merged[i]) for i, g in enumerate(gathered)]
        compact(self.kv, dst, gathered, per_req, self.block_size)
        out = [self._evicted(req_id, int(rows[j]), states[j].tokens, slots[j].take(per_req[:, j]), new_tables[j], table)
               for j, req_id in enumerate(req_ids)]
        if self.trace is not None:
            self._write_trace(rp, req_ids, states, n, inp, kept.slots)
        return out

    def _evicted(self, req_id: str, row: int, tokens: int, kept: KeptSlots, blocks: list[int],
                 table: BlockTable) -> Evicted:
        """A request's eviction recorded (both layouts): what it keeps per slot, its state up to
        date with every query so far, the ledger's count, and its new block table."""
        record = self.records[req_id]
        record.kept, record.observed = kept, tokens
        self.ledger.evicted(req_id)
        table.add_row(blocks, row)
        return Evicted(row, req_id, blocks)

    def _observe(self, rp: RequestPolicy, n: int, group: list[tuple[int, str]], table: BlockTable) -> None:
        """Bring the state of ``group``'s requests (batch row, request id; ``n`` slots each) up to
        date with their window's unseen queries, every layer at once, evicting nothing: before
        this step's queries push unseen ones out of the window."""
        policy = _evicting(rp)
        held = self._gather_requests(rp, n, group, table)
        req_ids, states, slots, inp = held.req_ids, held.states, held.slots, held.inp
        new = eviction.observe(policy, inp)
        for req_id, x, s in zip(req_ids, self._keep_state(req_ids, slots, new), states, strict=True):
            record = self.records[req_id]
            record.kept, record.observed = x, s.tokens

    # -- per-head budgets ---------------------------------------------------------------------
    # A request under a per-head allocation (Ada-KV) holds, after an eviction, each head's own
    # kept slots at the front of that head's lane of its blocks, then padding up to the room the
    # ledger reserved for the fullest head (``RequestSlots.reserve``), then the slots appended
    # since (vLLM writes a token at one slot for every head). The padding is never read: the
    # eviction input and attention address each head's own slots.
    def _head_counts(self, req_id: str) -> tuple[torch.Tensor, int]:
        """Each head's kept count ``[Lyr, Hkv]`` and where the appended slots start (0, 0 before
        the first eviction: every head holds every slot)."""
        record = self.records[req_id]
        if record.head_counts is None or record.kept is None:
            return torch.zeros(self.layers, self.kv_heads, dtype=torch.long), 0
        return record.head_counts, record.kept.count

    def _head_width(self, req_id: str, n: int) -> int:
        """Slots the fullest head of any layer holds when the request holds ``n`` block-table slots."""
        counts, start = self._head_counts(req_id)
        return int(counts.max()) + n - start

    def _head_columns(self, req_id: str, n: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slot, valid)`` ``[Lyr, Hkv, width]``: each head's own slots right-aligned in
        ``width`` columns (as ``EvictingCache``'s per-head layout hands them to a policy): its kept
        slots, then those appended since. An empty column points at slot 0 of head 0 (what the
        per-head layout reads there too: flat slot 0), and is invalid."""
        counts, start = self._head_counts(req_id)
        j, valid = own_columns(counts + (n - start), width)  # the head's slot j, oldest first
        slot = torch.where(j < counts[..., None], j, start + j - counts[..., None])
        return torch.where(valid, slot, 0), valid

    def _gather_heads(self, rp: RequestPolicy, n: int, group: list[tuple[int, str]], table: BlockTable) -> HeldRequests:
        """``_gather_requests`` under per-head budgets: every head's own slots, right-aligned in
        the width of the fullest head (the same for the whole group)."""
        policy = _evicting(rp)
        rows = torch.tensor([i for i, _ in group], dtype=torch.long)
        req_ids = [r for _, r in group]
        width = self._head_width(req_ids[0], n)
        cols = [self._head_columns(q, n, width) for q in req_ids]
        slot = torch.stack([c[0] for c in cols], dim=1)  # [Lyr, R, Hkv, W]
        valid = torch.stack([c[1] for c in cols], dim=1)
        heads = torch.where(valid, torch.arange(self.kv_heads)[:, None], 0)
        tables = table.get_cpu_tensor()[rows].long()  # [R, max_blocks]
        blocks = tables[torch.arange(len(group))[None, :, None, None], slot // self.block_size]
        dev = self.device
        blocks, offs, heads_d = blocks.to(dev), (slot % self.block_size).to(dev), heads.to(dev)
        gathered = [(k[blocks[i], offs[i], heads_d[i]], v[blocks[i], offs[i], heads_d[i]])
                    for i, (k, v) in enumerate(self.kv)]  # [R, Hkv, W, D] per layer
        keys = torch.stack([g[0] for g in gathered]).flatten(0, 1)
        values = torch.stack([g[1] for g in gathered]).flatten(0, 1)
        states = [self.ledger.get(q) for q in req_ids]
        slots = [self._slots(q, s.offset, n) for q, s in zip(req_ids, states, strict=True)]
        positions = torch.stack([x.positions for x in slots], dim=1)  # [Lyr, R, Hkv, n]
        positions = positions.gather(-1, slot.to(dev)).masked_fill(~valid.to(dev), -1)
        tokens = [s.tokens for s in states]
        queries, query_valid = self._window(policy.schedule.window, req_ids, tokens, keys)
        state = None
        if policy.keeps_state:  # per slot: each column's, as the keys are read (an empty one: head 0's slot 0)
            lyr_i = torch.arange(self.layers, device=dev)[:, None, None, None]
            row_i = torch.arange(len(group), device=dev)[None, :, None, None]
            state = self._state_of(req_ids, slots, policy)
            state = {name: t.view(self.layers, len(group), *t.shape[1:])[lyr_i, row_i, heads_d, slot.to(dev)].flatten(0, 1)
                     if name in slots[0].state else t for name, t in state.items()}
        inp = self._input(
            rp, keys, values, queries, query_valid, positions.flatten(0, 1), self.layer_ids,
            [s.evictions for s in states], state=state, req_ids=req_ids, tokens=tokens,
            slot_valid=valid.to(dev).flatten(0, 1),
        )
        return HeldRequests(rows, req_ids, states, slots, gathered, inp, positions)

    def _evict_heads(self, rp: RequestPolicy, n: int, group: list[tuple[int, str]], table: BlockTable) -> list[Evicted]:
        """``_evict`` under per-head budgets: each head's kept slots (its own count) compacted to
        the front of its lane, in the order the policy saw them; the request then holds the room
        the ledger reserves for the fullest head (``ledger.kept_held``), and the blocks past it go."""
        policy = _evicting(rp)
        held = self._gather_heads(rp, n, group, table)
        rows, req_ids, states, inp = held.rows, held.req_ids, held.states, held.inp
        lyr, r = self.layers, len(group)
        kept = eviction.evict(policy, inp)
        if held.positions is None or kept.keep is None or kept.counts is None:
            raise KVPolicyVLLMError(f"policy {policy.name!r}: a per-head eviction gave no count per head")
        counts = kept.counts.view(lyr, r, self.kv_heads).cpu()
        room = kept_room(states[0], n)
        if int(counts.max()) > room:
            raise KVPolicyVLLMError(
                f"policy {policy.name!r}: a head kept {int(counts.max())} slots, more than the {room} its requests "
                f"reserve ({req_ids}); the allocation's head_cap does not bound it"
            )
        width = kept.keep.shape[-1]
        keep = kept.keep.view(lyr, r, self.kv_heads, width)
        most = int(counts.max())
        # Each head's kept columns first, in column order; the columns after its count are padding.
        order = (~keep).to(torch.uint8).sort(dim=-1, stable=True).indices[..., :most]
        new_tables = [self._kept_blocks(table, int(rows[j]), req_id, states[j].evictions == 0, n, room)
                      for j, req_id in enumerate(req_ids)]
        dst = torch.tensor(new_tables, dtype=torch.long, device=self.device)
        compact(self.kv, dst, held.gathered, order, self.block_size)
        positions = held.positions.gather(-1, order)  # [Lyr, R, Hkv, most]
        positions = positions.masked_fill(torch.arange(most, device=self.device) >= counts.to(self.device)[..., None], -1)
        positions = torch.nn.functional.pad(positions, (0, room - most), value=-1)
        per_slot: dict[str, torch.Tensor] = {}
        for name, t in kept.state.items():  # the new state, moved with the kept slots
            if name in held.slots[0].state:
                t = t.view(lyr, r, self.kv_heads, width).gather(-1, order)
                per_slot[name] = torch.nn.functional.pad(t, (0, room - most))
            else:
                for j, req_id in enumerate(req_ids):
                    self._heads(self.records[req_id], policy)[name] = t.view(lyr, r, -1)[:, j].clone()
        out = []
        for j, req_id in enumerate(req_ids):
            self.records[req_id].head_counts = counts[:, j].clone()
            kept_j = KeptSlots(positions[:, j].clone(), {k: t[:, j].clone() for k, t in per_slot.items()})
            out.append(self._evicted(req_id, int(rows[j]), states[j].tokens, kept_j, new_tables[j], table))
        if self.trace is not None:
            self._write_trace(rp, req_ids, states, n, inp, kept.keep, counts=kept.counts)
        return out

    def _plan_head_attention(self, plan: StepRequests, table: BlockTable) -> HeadAttention | None:
        """Where each layer's attention of this step's requests with uneven heads reads (None: no such request)."""
        rows = [i for i, q in enumerate(plan.req_ids) if self._uneven(self.records[q])]
        if not rows:
            return None
        ends = np.cumsum(plan.scheduled)
        t_max = int(max(plan.scheduled[i] for i in rows))
        parts = []
        for i in rows:
            q, t = plan.req_ids[i], int(plan.scheduled[i])
            counts, start = self._head_counts(q)
            appended = self.ledger.get(q).held + t - start  # after this step's tokens are written
            own = counts + appended
            width = int(own.max())
            parts.append((i, q, t, counts, start, appended, own, width))
        width = max(p[-1] for p in parts)
        cols = torch.arange(width)
        b = len(rows)
        tables = table.get_cpu_tensor()[torch.tensor(rows)].long()
        token_idx = torch.zeros(b, t_max, dtype=torch.long)
        token_valid = torch.zeros(b, t_max, dtype=torch.bool)
        slot = torch.zeros(self.layers, b, self.kv_heads, width, dtype=torch.long)
        mask = torch.zeros(self.layers, b, self.kv_heads, t_max, width, dtype=torch.bool)
        steps = torch.arange(t_max)
        for j, (i, _, t, counts, start, appended, own, _) in enumerate(parts):
            token_idx[j, :t] = torch.arange(int(ends[i]) - t, int(ends[i]))
            token_valid[j, :t] = True
            k = counts[..., None]  # [Lyr, Hkv, 1]
            slot[:, j] = torch.where(cols < k, cols, start + cols - k)
            fresh = cols - k  # [Lyr, Hkv, W]: index among the appended slots (negative: a kept one)
            sees = (cols < own[..., None])[..., None, :] & (fresh[..., None, :] <= (appended - t) + steps[:, None])
            sees &= (steps < t)[:, None]
            mask[:, j] = sees
        mask[..., 0] |= ~mask.any(-1)  # a query past its request's chunk attends column 0: finite, dropped
        slot = torch.where(mask.any(-2), slot, 0)
        blocks = tables[torch.arange(b)[None, :, None, None], slot // self.block_size]
        heads = torch.arange(self.kv_heads)[:, None].expand_as(slot)
        dev = self.device
        return HeadAttention(token_idx.to(dev), token_valid.to(dev), blocks.to(dev), (slot % self.block_size).to(dev),
                             heads.to(dev), mask.to(dev))

    @staticmethod
    def _uneven(record: RequestRecord) -> bool:
        """Whether the request's heads hold different counts (some head fewer than its room)."""
        counts, kept = record.head_counts, record.kept
        return counts is not None and kept is not None and bool((counts < kept.count).any())

    def attend_heads(self, layer: int, query: torch.Tensor, output: torch.Tensor, scale: float) -> None:
        """Layer ``layer``'s attention of this step's requests whose heads hold different counts,
        over each head's own slots only (``kvpolicy.attend.attend_heads``), written over what the
        engine's kernel wrote for them in ``output`` (``[T, Hq * D]`` or ``[T, Hq, D]``): that
        kernel reads one length per request, padding included. Call it after the layer's keys
        and values are in the cache."""
        plan = self.head_attention
        if plan is None:
            return
        b, t = plan.token_idx.shape
        q = query.view(query.shape[0], self.q_heads, self.head_dim)[plan.token_idx]  # [B, T, Hq, D]
        keys, values = self.kv[layer]
        blocks, offs, heads = plan.blocks[layer], plan.offsets[layer], plan.heads[layer]
        k, v = keys[blocks, offs, heads], values[blocks, offs, heads]  # [B, Hkv, W, D]
        width = k.shape[2]
        index = torch.arange(b * self.kv_heads * width, device=self.device).view(b, self.kv_heads, width)
        out = attend_heads(q.transpose(1, 2).to(k.dtype), k.flatten(0, 2), v.flatten(0, 2), index, plan.mask[layer],
                           scaling=scale)  # [B, Hq, T, Dv]
        rows = output.view(output.shape[0], self.q_heads, -1)
        rows[plan.token_idx[plan.token_valid]] = out.transpose(1, 2)[plan.token_valid].to(rows.dtype)

    # -- the input --------------------------------------------------------------------------
    def _gather_requests(self, rp: RequestPolicy, n: int, group: list[tuple[int, str]], table: BlockTable) -> HeldRequests:
        """What ``group``'s requests (batch row, request id; ``n`` slots each, policy ``rp``)
        hold, and the eviction input of every layer and request, layer-major."""
        policy = _evicting(rp)
        rows = torch.tensor([i for i, _ in group], dtype=torch.long)
        req_ids = [r for _, r in group]
        gathered = self._gather_layers(table, rows, n)
        keys = torch.stack([g[0] for g in gathered]).flatten(0, 1)  # [Lyr * R, Hkv, N, D], layer-major
        values = torch.stack([g[1] for g in gathered]).flatten(0, 1)
        states = [self.ledger.get(q) for q in req_ids]
        slots = [self._slots(q, s.offset, n) for q, s in zip(req_ids, states, strict=True)]
        tokens = [s.tokens for s in states]
        queries, query_valid = self._window(policy.schedule.window, req_ids, tokens, keys)
        positions = torch.stack([x.positions for x in slots], dim=1).flatten(0, 1)
        inp = self._input(
            rp, keys, values, queries, query_valid, positions, self.layer_ids, [s.evictions for s in states],
            state=self._state_of(req_ids, slots, policy), req_ids=req_ids, tokens=tokens,
            schedule=evicts_to(states[0]),
        )
        return HeldRequests(rows, req_ids, states, slots, gathered, inp)

    def _input(
        self, rp: RequestPolicy, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor,
        query_valid: torch.Tensor | None, positions: torch.Tensor, layer_ids: list[int], evictions: list[int], *,
        state: Mapping[str, torch.Tensor] | None, req_ids: list[str] | None = None, tokens: list[int] | None = None,
        slot_valid: torch.Tensor | None = None, schedule: Schedule | None = None,
    ) -> EvictionInput:
        """The eviction input of requests stacked layer-major (``[len(layer_ids) * R, ...]``),
        through ``kvpolicy.policy.eviction_input``: each row's layer and eviction count key its
        draws, as ``EvictingCache`` keys a row's. With ``tokens`` (each request's tokens so far),
        the window's positions and new queries follow ``eviction.new_queries``. ``schedule``: the
        one the eviction keeps (a request's layer budget decided from its prompt); else ``rp``'s."""
        policy = _evicting(rp)
        lyr = len(layer_ids)
        layer_idx = torch.tensor(layer_ids, dtype=torch.long).repeat_interleave(len(evictions))
        query_positions = query_new = None
        if query_valid is None:
            query_valid = torch.ones(keys.shape[0], queries.shape[2], dtype=torch.bool, device=self.device)
        if tokens is not None and req_ids is not None:
            seen = torch.tensor(tokens, dtype=torch.long).repeat(lyr)
            observed = torch.tensor([self.records[q].observed for q in req_ids], dtype=torch.long).repeat(lyr)
            query_positions, query_new = eviction.new_queries(policy, query_valid, seen, observed)
        schedule = schedule or rp.schedule or policy.schedule  # a layer's own budget under per-layer budgets
        return eviction_input(
            keys, values, queries, budget=schedule.budget, recent=schedule.recent,
            seed=policy.resolve_seed(rp.resolved.seed), slot_valid=slot_valid, query_valid=query_valid, positions=positions,
            layer_idx=layer_idx, evictions=torch.tensor(evictions, dtype=torch.long).repeat(lyr),
            head_offset=self.head_offset, query_positions=query_positions, query_new=query_new,
            state=None if state is None or not policy.keeps_state else policy.nest_state(state),
            model=self.model_facts if policy.needs_model else None,
        )

    def _gather(self, table: BlockTable, rows: torch.Tensor, n: int, layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[len(layers) * R, Hkv, n, D]`` of ``rows``' first ``n`` slots."""
        got = self._gather_layers(table, rows, n, layers)
        return torch.cat([g[0] for g in got]), torch.cat([g[1] for g in got])

    def _gather_layers(self, table: BlockTable, rows: torch.Tensor, n: int, layers: list[int] | None = None) -> list[KV]:
        """Per layer, ``rows``' first ``n`` slots ``[R, Hkv, n, D]`` (copies)."""
        blocks, offs = slot_address(table.get_cpu_tensor()[rows].to(self.device), n, self.block_size)
        return [gather_paged(self.kv[i], blocks, offs) for i in (range(self.layers) if layers is None else layers)]

    def _kept_blocks(self, table: BlockTable, row: int, req_id: str, first: bool, n: int, kept: int) -> list[int]:
        """The blocks a request holding ``n`` slots keeps ``kept`` of them in (``ledger.compaction``,
        the scheduler's rule too)."""
        held = int(table.num_blocks_per_row[row])
        ids = [int(b) for b in table.get_cpu_tensor()[row, :held]]
        if self.records[req_id].untrimmed:  # compacted in place; the scheduler frees the blocks past them (trimmed)
            if held < -(-n // self.block_size):
                raise BlocksDisagree(f"request {req_id} holds {held} blocks for {n} slots (the scheduler and this "
                                     "worker disagree)")
            return ids
        return compaction(ids, n, kept, self.block_size, fresh=self.prefix_caching and first, req_id=req_id).kept

    def trimmed(self, req_id: str, ids: list[int], keep: int) -> list[int]:
        """The first ``keep`` of a request's blocks ``ids``: the scheduler freed the blocks past its
        kept slots once it learned the layer budget of its first eviction (``untrimmed``)."""
        record = self.records.get(req_id)
        if record is None or not record.untrimmed:
            raise KVPolicyVLLMError(f"request {req_id}: the scheduler trimmed blocks this worker did not keep for it")
        need = -(-self.ledger.get(req_id).held // self.block_size) if self.ledger.tracks(req_id) else 0
        if not need <= keep <= len(ids):
            raise KVPolicyVLLMError(f"request {req_id}: the scheduler keeps {keep} of its {len(ids)} blocks, this "
                                    f"worker needs {need} (the scheduler and this worker disagree)")
        record.untrimmed = False
        return ids[:keep]

    def layer_input(self, row: int, req_id: str, table: BlockTable) -> EvictionInput:
        """A due request's eviction input on this cache's one layer (per-layer budgets), as its
        next eviction reads it: what ``decide_layer_budgets`` hands the policy for each layer."""
        entry = self.ledger.get(req_id)
        return self._gather_requests(self.records[req_id].policy, entry.held, [(row, req_id)], table).inp

    def decided_here(self, req_id: str, schedule: Schedule) -> None:
        """The request's layer schedule, decided from its prompt at this step's eviction: its
        eviction keeps that budget, and its block table keeps its blocks until ``trimmed``."""
        record = self.records[req_id]
        record.decided, record.untrimmed = schedule, True
        self.ledger.get(req_id).layer_schedule = schedule

    def decided_budget(self, req_id: str) -> int:
        """The layer budget decided for the request from its prompt (``decided_here``); 0: none."""
        record = self.records.get(req_id)
        return 0 if record is None or record.decided is None else record.decided.budget

    def _window(
        self, w: int, req_ids: list[str], tokens: list[int], keys: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The requests' last ``w`` queries ``[Lyr * R, Hq, W, D]``, layer-major like the keys, oldest
        query first (as ``EvictingCache`` keeps them), and which entries hold a query ``[Lyr * R, W]``."""
        if w == 0:
            return keys.new_zeros(self.layers * len(req_ids), self.q_heads, 0, self.head_dim), None
        return self.window(w, req_ids, torch.tensor(tokens, dtype=torch.long), slice(None))

    def window(self, w: int, req_ids: list[str], tokens: torch.Tensor, layers: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """The requests' last ``w`` queries of ``layers`` after ``tokens [R]`` each
        (``RequestQueryRing.read``: ``[Lyr * R, Hq, W, D]`` oldest first, and ``[Lyr * R, W]``)."""
        return self.rings[w].read(req_ids, tokens, layers)

    def _slots(self, req_id: str, offset: int, n: int) -> KeptSlots:
        """The per-slot fields ``[Lyr, Hkv, N]`` of the request's ``n`` slots: kept, then fresh."""
        record = self.records[req_id]
        kept = record.kept
        start = 0 if kept is None else kept.count
        policy = record.policy.policy
        fields = None if policy is None else {name: spec for name, (_, _, spec) in policy.state_fields.items()}
        fresh = KeptSlots.fresh(start, n, offset, self.layers, self.kv_heads, self.device, fields)
        return KeptSlots.extend(kept, fresh)

    # -- a policy's state ---------------------------------------------------------------------
    def _heads(self, record: RequestRecord, policy: Policy) -> dict[str, torch.Tensor]:
        """The request's per-head state fields, ``[Lyr, Hkv]`` each (initial on first use)."""
        if record.head_state is None:
            record.head_state = {
                name: spec.initial_head_values((self.layers, self.kv_heads), self.device)
                for name, (_, _, spec) in policy.state_fields.items() if spec.per == "head"
            }
        return record.head_state

    def _state_of(self, req_ids: list[str], slots: list[KeptSlots], policy: Policy) -> dict[str, torch.Tensor]:
        """The requests' state, layer-major on the batch axis as the keys are: ``[Lyr * R, Hkv, N]``
        per slot, ``[Lyr * R, Hkv]`` per head."""
        state = {name: torch.stack([x.state[name] for x in slots], dim=1).flatten(0, 1) for name in slots[0].state}
        for name in policy.state_fields:
            if name not in state:
                state[name] = torch.stack([self._heads(self.records[q], policy)[name] for q in req_ids], dim=1).flatten(0, 1)
        return state

    def _keep_state(self, req_ids: list[str], slots: list[KeptSlots], state: Mapping[str, torch.Tensor]) -> list[KeptSlots]:
        """Store the requests' new state (as ``_state_of`` lays it out): per-head fields in their
        records, and the requests' slots with their new per-slot fields, returned."""
        lyr, r = self.layers, len(req_ids)
        out = []
        for j, (req_id, x) in enumerate(zip(req_ids, slots, strict=True)):
            per_slot = {name: t.view(lyr, r, *t.shape[1:])[:, j] for name, t in state.items() if name in x.state}
            record = self.records[req_id]
            for name, t in state.items():
                if name not in x.state:
                    policy = _evicting(record.policy)
                    self._heads(record, policy)[name] = t.view(lyr, r, -1)[:, j].clone()
            out.append(x.with_state(per_slot))
        return out

    def _write_trace(self, rp: RequestPolicy, req_ids: list[str], states: list[Any], n: int, inp: Any,
                     kept: torch.Tensor, counts: torch.Tensor | None = None) -> None:
        """``kept``: the kept slots ``[B, Hkv, K]``, or under per-head budgets the kept mask
        ``[B, Hkv, N]`` with each head's ``counts [B, Hkv]``."""
        if self.trace is None:
            return
        entry = self.ledger.get(req_ids[0])
        schedule = entry.schedule  # an evicting request's, so never None here
        record = {
            "step": self.step, "rank": self.rank, "head_offset": self.head_offset, "layers": self.layer_ids,
            "policy": rp.resolved.source,
            "budget": None if schedule is None else schedule.budget,  # its layer's, when decided from its prompt
            "requests": req_ids, "slots_before": n,
            "kept": int(kept.shape[-1]) if counts is None else entry.held,
            "head_counts": None if counts is None else counts.view(self.layers, len(req_ids), -1).transpose(0, 1).tolist(),
            "tokens": [s.tokens for s in states], "evictions_after": [s.evictions for s in states],
            # what each request's cache holds after this eviction (token index per layer, head and slot)
            "kept_digest": [_digest(_kept(self.records[q]).positions) for q in req_ids],
        }
        with open(self.trace / f"worker-{self.rank}-{os.getpid()}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.saves < TRACE_SAVES:
            self.saves += 1
            torch.save(
                {"keys": inp.keys, "values": inp.values, "queries": inp.queries, "query_valid": inp.query_valid,
                 "positions": inp.positions, "layer_idx": inp.seed_key.layer_idx, "evictions": inp.seed_key.evictions,
                 "kept": kept, "requests": req_ids, "seed": rp.resolved.seed, "policy_yaml": rp.resolved.policy_yaml,
                 "head_offset": self.head_offset, "slot_valid": inp.slot_valid, "head_counts": counts},
                self.trace / f"evict-{self.rank}-{os.getpid()}-{self.saves}.pt",
            )


def _evicting(rp: RequestPolicy) -> Policy:
    """The policy of a request that evicts (the ledger never makes one without a schedule due)."""
    if rp.policy is None:
        raise KVPolicyVLLMError(f"policy {rp.resolved.source!r} never evicts, yet a request of it was due")
    return rp.policy


def _kept(record: RequestRecord) -> KeptSlots:
    if record.kept is None:
        raise KVPolicyVLLMError("a request that evicted has no kept slots recorded")
    return record.kept


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.to(torch.int64).cpu().numpy().tobytes()).hexdigest()[:16]


def evicts_to(state: Any) -> Schedule:
    """The schedule whose budget a request's next eviction keeps (a ledger entry with a schedule):
    its own, or at a first eviction that decided its layer budget, that layer's."""
    if state.from_prompt and state.evictions == 0 and state.layer_schedule is not None:
        return state.layer_schedule
    if state.schedule is None:
        raise KVPolicyVLLMError("a request that never evicts was due")
    return state.schedule


def decide_layer_budgets(caches: list[PagedCache], dues: list[list[tuple[int, str]]],
                         tables: list[BlockTable]) -> dict[str, list[int]]:
    """Layer budgets decided from the prompt (``Allocation.from_prompt``: CAKE), for the requests
    of this step whose first eviction is due: from every layer's slots and query window of the
    request alone (``Policy.prompt_schedules``, as ``EvictingCache`` decides for a batch of one),
    given to each layer's cache before any evicts. ``caches``: one per KV-cache group, each holding
    one layer, in layer order; ``dues``, ``tables``: each one's ``advance_step`` and block table.
    Returns each deciding request's budgets, by layer (what the scheduler is told)."""
    out: dict[str, list[int]] = {}
    first = caches[0]
    for row, req_id in dues[0]:
        entry = first.ledger.get(req_id)
        if not entry.from_prompt or entry.evictions or entry.layer_schedule is not None:
            continue
        if len(caches) != first.model_layers or any(c.layers != 1 for c in caches):
            raise KVPolicyVLLMError(f"request {req_id}: layer budgets decided from the prompt need a KV-cache group "
                                    "per layer (a server started with a per-layer policy)")
        if any((row, req_id) not in due for due in dues):  # they all ran the policy's schedule on its tokens
            raise KVPolicyVLLMError(f"request {req_id}: its layers are not all due at its first eviction")
        policy = _evicting(first.records[req_id].policy)
        inputs = [c.layer_input(row, req_id, t) for c, t in zip(caches, tables, strict=True)]
        schedules = policy.prompt_schedules(inputs)
        for cache, schedule in zip(caches, schedules, strict=True):
            cache.decided_here(req_id, schedule)
        out[req_id] = [s.budget for s in schedules]
    return out


def kept_room(state: Any, n: int) -> int:
    """The block-table slots a request of ``state`` (a ledger entry holding ``n``) keeps through its
    eviction: the room for its fullest head (``kvpolicy.vllm.ledger.kept_held``)."""
    if state.schedule is None:
        raise KVPolicyVLLMError("a request that never evicts was due")
    return kept_held(state.schedule, state.head_cap, n)
