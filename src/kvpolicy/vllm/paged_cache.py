"""The requests' slots in vLLM's paged KV cache: the paged store of the vLLM integration. Pure torch.

``PagedCache`` gathers a request's slots through its block table, hands them to the eviction core
(``kvpolicy.eviction``: the ``evict``, ``observe``, ``observe_long_step`` and every-query rules
``EvictingCache`` runs, on inputs from the one builder ``kvpolicy.policy.eviction_input``) and
compacts what the core keeps to the front of the request's blocks. It asks the core's rules of
*when* (``kvpolicy.schedule``, ``kvpolicy.eviction``) through the slot ledger
(``kvpolicy.vllm.ledger``), which the scheduler replays too. Of its own it keeps one
``RequestRecord`` per request (``kvpolicy.vllm.requests``) and the query rings. Per-head budgets
address each head's lane (``kvpolicy.vllm.lanes``). Nothing here imports vLLM: the worker feeds
it each step's requests, queries and block tables; ``tests/test_vllm_parity.py`` drives it
directly against ``EvictingCache``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch

from .. import driver, eviction
from ..eviction import Kept
from ..inputs import unread_values
from ..policy import Policy, eviction_input
from ..schedule import Schedule
from ..stages.base import EvictionInput
from ..stages.model_facts import ModelFacts
from . import lanes, paged
from .block_kernel import CpuBlocks
from .budgets import decides_from_prompt
from .lanes import HeadAttention, Lanes, LaneStep
from .ledger import BlocksDisagree, SlotLedger, compaction
from .paged import KV, Gathered, slot_address
from .refusals import worker_refusal
from .requests import (
    BlockTable,
    Evicted,
    HeldRequests,
    KeptSlots,
    LongStep,
    Placement,
    QueryCapture,
    RequestClass,
    RequestPolicy,
    RequestQueryRing,
    RequestRecord,
    StepRequests,
    evicting_policy,
    kept_slots_of,
    stacked_state,
    stored_state,
)
from .settings import PerPolicy, Resolved
from .support import KVPolicyVLLMError
from .trace import EvictionTrace


class PagedCache:
    """Every request's slots in the paged cache of one worker (one tensor-parallel rank).

    Args:
        kv: per layer, its keys and values ``[num_blocks, block_size, Hkv, D]`` (cache views).
        layer_ids: the model's index of each layer of ``kv`` (what keys per-layer draws).
        q_heads: the attention's query heads on this rank.
        head_dim: the attention's head size.
        block_size: slots per block.
        head_offset: the model's index of this rank's first KV head (tensor parallelism).
        prefix_caching: whether vLLM's prefix cache may share a request's blocks (then a first
            eviction writes into fresh blocks, never into shared ones).
        policy_of: a request's resolved policy (its own, else the server's), asked once per request.
        trace: a folder receiving every eviction (``kvpolicy.vllm.trace``).
        rank: this worker's tensor-parallel rank.
        model_facts: this rank's share of the model's facts, for policies that read the model;
            each policy is checked against them when first loaded (``check_policy``).
        per_head_refusal: why this engine cannot attend heads of uneven counts (None: it can).
        model_layers: set when this cache serves one KV-cache group of a per-layer server: its one
            layer (``layer_ids[0]`` of ``model_layers``) runs that layer's schedule; else None.
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
        self.kv, self.layers = kv, len(kv)
        self.layer_ids = list(layer_ids)
        self.q_heads, self.head_dim, self.block_size = q_heads, head_dim, block_size
        self.kv_heads = int(kv[0][0].shape[2])
        self.device, self.dtype = kv[0][0].device, kv[0][0].dtype
        self.head_offset, self.prefix_caching = head_offset, prefix_caching
        self.resolve = policy_of
        self.ledger = SlotLedger()
        self.policies: PerPolicy[str | None, RequestPolicy] = PerPolicy()  # by resolved policy YAML
        self.records: dict[str, RequestRecord] = {}  # by request
        self.rings: dict[int, RequestQueryRing] = {}  # by window size
        # This step's chunks longer than their window under state that sees every query (seen layer
        # by layer), and requests whose heads hold different counts, with rows of one-token steps.
        self.long_steps: dict[str, LongStep] = {}
        self.head_attention: HeadAttention | None = None
        self.head_decodes: list[int] = []
        self.plan: StepRequests | None = None
        self.captures: list[QueryCapture] = []
        self.trace = None if trace is None else EvictionTrace(trace, rank)
        self.rank, self.step = rank, 0
        self.model_facts = model_facts
        self.per_head_refusal = per_head_refusal

    # -- requests joining and leaving -------------------------------------------------------
    def drop(self, req_id: str) -> None:
        """Forget a request (finished, or about to be resubmitted under the same id)."""
        self.ledger.reset(req_id)
        record = self.records.pop(req_id, None)
        if record is not None and record.policy.window in self.rings:
            self.rings[record.policy.window].drop(req_id)

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
        """A resolved policy as this cache runs it (``RequestPolicy.load``), once per distinct policy."""
        layer = None if self.model_layers is None else (self.layer_ids[0], self.model_layers)
        return self.policies.get_or_make(r.policy_yaml,
                                         lambda: RequestPolicy.load(r, self.check_policy, self.kv_heads, layer))

    def check_policy(self, policy: Policy | None) -> None:
        """Refuse a policy this rank cannot serve (``refusals.worker_refusal``'s reason)."""
        why = worker_refusal(policy, self.model_facts, head_dim=self.head_dim, kv_heads=self.kv_heads,
                             head_offset=self.head_offset, q_heads=self.q_heads, per_head=self.per_head_refusal)
        if why is not None:
            raise KVPolicyVLLMError(why)

    def _ring(self, window: int) -> RequestQueryRing:
        ring = self.rings.get(window)
        if ring is None:
            ring = self.rings[window] = RequestQueryRing(window, self.layers, self.q_heads, self.head_dim,
                                                         self.dtype, self.device)
        return ring

    # -- before the forward -----------------------------------------------------------------
    def begin_step(self, plan: StepRequests, table: BlockTable) -> None:
        """Before a forward of ``plan``'s requests: where each request's last ``window`` queries
        go in its ring, and, for policies whose state sees every query, the updates due before
        this step's queries push unseen ones out of the window (``eviction.must_observe``)."""
        self.plan = plan
        self.captures = []
        self.head_attention, self.head_decodes = None, []
        req_ids = plan.req_ids
        if not req_ids:
            return
        by_window: dict[int, list[int]] = {}  # batch rows by their policy's query window
        uneven: list[int] = []  # rows whose heads hold different counts
        observing: list[int] = []  # rows whose policy's state sees every query
        for i, (req_id, prompt_len) in enumerate(zip(req_ids, plan.prompt_len.tolist(), strict=True)):
            record = self.record(req_id)  # made (its policy looked up) when first seen
            record.prompt_len, rp = prompt_len, record.policy
            if record.uneven:
                uneven.append(i)
            if rp.window:
                by_window.setdefault(rp.window, []).append(i)
            if rp.policy is not None and rp.policy.observes_queries:
                observing.append(i)
        self.head_attention = self._plan_head_attention(plan, uneven, table)
        for w, rows in sorted(by_window.items()):
            take, pos, flat = plan.last_queries(np.array(rows, dtype=np.int64), w, self.device)
            ring = self._ring(w)
            ring_rows = np.repeat(np.array([ring.row(req_ids[i]) for i in rows], dtype=np.int64), take)
            self.captures.append(QueryCapture.plan(ring, torch.from_numpy(ring_rows).to(self.device), pos, flat))
        self._plan_state(plan, observing, table)

    def _plan_state(self, plan: StepRequests, observing: list[int], table: BlockTable) -> None:
        """Bring the state of the ``observing`` rows up to date before this step's queries push
        unseen ones out of their window, and plan their long steps (``LongStep``)."""
        self.long_steps = {}
        pending: dict[tuple[str, int], list[tuple[int, str]]] = {}
        ends = np.cumsum(plan.scheduled)
        for i in observing:
            req_id = plan.req_ids[i]
            record = self.records[req_id]
            rp = record.policy
            window, ledger = rp.window, self.ledger.get(req_id)
            tokens, done = int(plan.scheduled[i]), int(plan.computed_before[i])
            if eviction.must_observe(done - record.observed, tokens, window):
                pending.setdefault((rp.resolved.policy_yaml or "", ledger.slots), []).append((i, req_id))
            if eviction.is_long_step(tokens, window):
                self.long_steps[req_id] = LongStep(i, int(ends[i]) - tokens, tokens, done, ledger.offset,
                                                   ledger.slots + tokens)
        for (_, count), group in sorted(pending.items()):
            rp = self.records[group[0][1]].policy
            driver.observe(self, evicting_policy(rp), [RequestClass(rp, count, group, table)])
        for req_id, step in self.long_steps.items():  # seen as planned (``eviction.is_long_step``), as the caches do
            self.records[req_id].observed = step.before + step.tokens

    # -- during the forward -----------------------------------------------------------------
    def capture_queries(self, layer: int, query: torch.Tensor) -> None:
        """Layer ``layer``'s post-RoPE queries of this step (``[T, Hq * D]`` or ``[T, Hq, D]``)."""
        if not self.captures:
            return
        q = query.view(query.shape[0], self.q_heads * self.head_dim)
        for cap in self.captures:
            cap.write(layer, q)

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
            keys_all, values_all = self._gather_layers(table, torch.tensor([step.row]), n, [layer],
                                                       values=policy.reads_values)
            keys = keys_all[0]
            values = unread_values(keys) if values_all is None else values_all[0]
            slots = self._slots(req_id, step.offset, n)
            state = {name: t[layer : layer + 1] for name, t in slots.state.items()}
            for name, t in record.head_fields(self.layers, self.kv_heads, self.device).items():
                state[name] = t[layer : layer + 1]
            queries = q[step.first : step.first + step.tokens].to(keys.dtype).permute(1, 0, 2)[None]  # [1, Hq, T, D]
            positions = torch.arange(step.before, step.before + step.tokens, device=self.device)[None]
            inp = self._input(rp, keys, values, queries[:, :, :0], None, slots.positions[layer : layer + 1],
                              [self.layer_ids[layer]], evictions=[0], state=state, req_ids=[req_id])
            new = eviction.observe_long_step(policy, inp, queries, positions, torch.ones_like(positions, dtype=torch.bool))
            per_slot = {}
            for name, t in new.items():
                if name in slots.state:
                    full = slots.state[name].clone()
                    full[layer] = t[0]
                    per_slot[name] = full
                else:
                    record.head_fields(self.layers, self.kv_heads, self.device)[name][layer] = t[0]
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
        after = (plan.computed_before + plan.scheduled).tolist()
        for i, (req_id, tokens, prompt_len) in enumerate(zip(plan.req_ids, after, plan.prompt_len.tolist(), strict=True)):
            self.record(req_id)  # tracked in the ledger under its policy's schedule
            if self.ledger.advance(req_id, tokens, prompt_len):
                due.append((i, req_id))
        return due

    def evict_due(self, due: list[tuple[int, str]], table: BlockTable) -> list[Evicted]:
        """Evict the ``due`` requests (``advance_step``), grouped by policy, slot count and budget
        (each evicts exactly as it would alone). Returns the requests that evicted, with their
        new block tables (already written to ``table``)."""
        # Grouped by policy and slot count, and by what the eviction keeps: even rows by the budget,
        # per-head budgets by their view's width (their draws are their own); even groups first.
        groups: dict[tuple[bool, str, int, int], list[tuple[int, str]]] = {}
        for i, req_id in due:
            rp, entry = self.records[req_id].policy, self.ledger.get(req_id)
            per_head = rp.policy is not None and rp.policy.per_head
            shape = self._lanes(req_id).width(entry.held) if per_head else entry.evicts_to().budget
            groups.setdefault((per_head, rp.resolved.policy_yaml or "", entry.held, shape), []).append((i, req_id))
        out: list[Evicted] = []
        for (_, _, count, _), group in sorted(groups.items()):
            rp = self.records[group[0][1]].policy
            for evicted in driver.evict(self, evicting_policy(rp), [RequestClass(rp, count, group, table)]):
                out += evicted
        return out

    # -- the step driver's store (``kvpolicy.driver.SlotStore``: ``gather``, ``compact``, ``write_state``, ``observed``)
    def gather(self, rows: RequestClass) -> HeldRequests:
        return self.gather_requests(rows.policy, rows.held, rows.members, rows.table)

    def compact(self, rows: RequestClass, held: HeldRequests, kept: Kept) -> list[Evicted]:
        """What an eviction of ``held``'s requests kept, compacted to the front of each request's
        blocks (under per-head budgets, of each head's lane: ``_place_heads``), and the blocks past
        them dropped from its block table.

        Under prefix caching a request's first eviction writes the kept slots into the fresh
        blocks the scheduler appended for it (``kvpolicy.vllm.scheduler``), never into its old
        blocks, which other requests may read or the prefix cache hand out again; the request's
        block table becomes those fresh blocks."""
        rp, n, table = rows.policy, rows.held, rows.table
        policy = evicting_policy(rp)
        place = self._place_heads(policy, held, kept, n) if policy.per_head else self._place_even(policy, held, kept)
        new_tables = [self._kept_blocks(table, int(held.rows[j]), req_id, held.states[j].evictions == 0, n, place.room)
                      for j, req_id in enumerate(held.req_ids)]
        dst = torch.tensor(new_tables, dtype=torch.long, device=self.device)
        sources = table.get_cpu_tensor()[held.rows].to(self.device)  # the blocks read (values not gathered)
        start = None
        if place.counts is None and kept.values is None:  # even and unmerged: what stays in place is not rewritten
            start = paged.in_place(place.order) * (sources[:, : dst.shape[1]] == dst).all(-1)
        paged.compact(self.kv, dst, place.gathered, place.order, self.block_size, start, sources, place.columns)
        out = []
        for j, req_id in enumerate(held.req_ids):
            if place.counts is not None:
                self.records[req_id].counted_heads(place.counts[:, j].clone())
            out.append(self._evicted(req_id, int(held.rows[j]), place.slots[j], new_tables[j], table))
        if self.trace is not None:  # per head, the kept mask [B, Hkv, N] and each head's count
            self.trace.eviction(step=self.step, head_offset=self.head_offset, layers=self.layer_ids, resolved=rp.resolved,
                                states=held.states, requests=held.req_ids, slots_before=n, inp=held.inp, kept=place.traced,
                                counts=kept.counts if policy.per_head else None,
                                held=[kept_slots_of(self.records[q]).positions for q in held.req_ids])
        return out

    def _place_even(self, policy: Policy, held: HeldRequests, kept: Kept) -> Placement:
        """Where an eviction of even rows puts what it keeps: every head's ``k`` kept slots, in
        order, with their merged values where the policy merges."""
        lyr, r = self.layers, len(held.req_ids)
        if kept.slots is None:
            raise KVPolicyVLLMError(f"policy {policy.name!r} kept a count per head, yet its eviction is even")
        slots = held.slots
        if policy.keeps_state:
            slots = stored_state([self.records[q] for q in held.req_ids], slots, lyr, self.kv_heads, self.device, kept.state)
        order = kept.slots.view(lyr, r, self.kv_heads, kept.slots.shape[-1])
        gathered = held.gathered
        if kept.values is not None:  # a merge: the kept slots' merged values go to the blocks
            merged = kept.values.view(lyr, r, *kept.values.shape[1:])
            gathered = [(g[0], merged[i]) for i, g in enumerate(gathered)]
        return Placement(order, order.shape[-1], gathered, [x.take(order[:, j]) for j, x in enumerate(slots)],
                         None, kept.slots)

    def _place_heads(self, policy: Policy, held: HeldRequests, kept: Kept, n: int) -> Placement:
        """Where an eviction under per-head budgets puts what it keeps: each head's kept slots
        (its own count) at the front of its lane, in the order the policy saw them; the request
        then holds the room the ledger reserves for the fullest head (``ledger.kept_held``)."""
        lyr, r = self.layers, len(held.req_ids)
        if held.positions is None or kept.keep is None or kept.counts is None:
            raise KVPolicyVLLMError(f"policy {policy.name!r}: a per-head eviction gave no count per head")
        counts = kept.counts.view(lyr, r, self.kv_heads).cpu()
        room = held.states[0].kept_room(n)
        if int(counts.max()) > room:
            raise KVPolicyVLLMError(
                f"policy {policy.name!r}: a head kept {int(counts.max())} slots, more than the {room} its requests "
                f"reserve ({held.req_ids}); the allocation's head_cap does not bound it"
            )
        width, most = kept.keep.shape[-1], int(counts.max())
        order = lanes.kept_order(kept.keep.view(lyr, r, self.kv_heads, width), most)  # [Lyr, R, Hkv, most]
        # The positions and per-slot state move with the kept slots, padded to the room; per-head state stays.
        past = torch.arange(most, device=self.device) >= counts.to(self.device)[..., None]
        positions = lanes.padded(held.positions.gather(-1, order).masked_fill(past, -1), room, -1)
        per_slot = {name: lanes.padded(t.view(lyr, r, self.kv_heads, width).gather(-1, order), room, 0)
                    for name, t in kept.state.items() if name in held.slots[0].state}
        slots = [KeptSlots(positions[:, j].clone(), {k: t[:, j].clone() for k, t in per_slot.items()}) for j in range(r)]
        per_head = {name: t for name, t in kept.state.items() if name not in per_slot}
        slots = stored_state([self.records[q] for q in held.req_ids], slots, lyr, self.kv_heads, self.device, per_head)
        return Placement(order, room, held.gathered, slots, counts, kept.keep, held.columns)

    def _evicted(self, req_id: str, row: int, kept: KeptSlots, blocks: list[int], table: BlockTable) -> Evicted:
        """A request's eviction recorded (both layouts): what it keeps per slot, the ledger's
        count, and its new block table."""
        self.records[req_id].kept = kept
        self.ledger.evicted(req_id)
        table.add_row(blocks, row)
        return Evicted(row, req_id, blocks)

    def write_state(self, rows: RequestClass, held: HeldRequests, state: Mapping[str, torch.Tensor]) -> None:
        """An updated ``state`` of ``held``'s requests (as gathered, every layer), stored with
        their kept slots, moving none."""
        records = [self.records[q] for q in held.req_ids]
        for record, kept in zip(records, stored_state(records, held.slots, self.layers, self.kv_heads, self.device, state),
                                strict=True):
            record.kept = kept

    def observed(self, rows: RequestClass) -> None:
        """The requests' state has seen every query so far (their tokens, as the ledger counts them)."""
        for _, req_id in rows.members:
            self.records[req_id].observed = self.ledger.get(req_id).tokens

    # -- per-head budgets (each head's lane of the request's blocks: ``kvpolicy.vllm.lanes``) ------
    def _lanes(self, req_id: str) -> Lanes:
        """The request's heads since its last eviction (even before its first)."""
        record = self.records[req_id]
        if record.head_counts is None or record.kept is None:
            return Lanes.even(self.layers, self.kv_heads)
        return Lanes(record.head_counts, record.kept.count)

    def _plan_head_attention(self, plan: StepRequests, rows: list[int], table: BlockTable) -> HeadAttention | None:
        """Where each layer's attention of this step's requests with uneven heads (batch ``rows``)
        reads (None: no such request)."""
        self.head_decodes = [i for i in rows if int(plan.scheduled[i]) == 1]
        if not rows:
            return None
        ends = np.cumsum(plan.scheduled)
        steps = [LaneStep(self._lanes(plan.req_ids[i]), self.ledger.get(plan.req_ids[i]).held + int(plan.scheduled[i]),
                          int(plan.scheduled[i]), int(ends[i])) for i in rows]  # held: after this step's tokens
        return lanes.plan_attention(steps, table.get_cpu_tensor()[torch.tensor(rows)].long(), self.block_size,
                                    self.device)

    def skipped_rows(self) -> list[int]:
        """The rows attended by ``attend_heads`` alone (one-token steps), which vLLM's kernel skips."""
        return self.head_decodes

    def attend_heads(self, layer: int, query: torch.Tensor, output: torch.Tensor, scale: float,
                     kernel: CpuBlocks | None = None) -> None:
        """Layer ``layer``'s attention of this step's requests whose heads hold different counts, over
        each head's own slots (``lanes.attend``, by ``kernel`` where it can), written over their rows
        of ``output`` (``[T, Hq * D]`` or ``[T, Hq, D]``), its keys in (``moved_tokens``)."""
        if self.head_attention is not None:
            lanes.attend(self.head_attention, layer, self.kv[layer], query, output, scale, self.q_heads,
                         self.head_dim, kernel)

    def moved_tokens(self, layer: int) -> None:
        """After vLLM's cache write of ``layer``: each head's new tokens to its own slots' end."""
        if self.head_attention is not None:
            lanes.move_tokens(self.head_attention, layer, self.kv[layer])

    # -- the input --------------------------------------------------------------------------
    def gather_requests(self, rp: RequestPolicy, n: int, group: list[tuple[int, str]], table: BlockTable) -> HeldRequests:
        """What ``group``'s requests (batch row, request id; ``n`` slots each, policy ``rp``)
        hold, and the eviction input of every layer and request, layer-major. Under per-head
        budgets, every head's own slots, right-aligned in the width of the fullest head (the
        same for the whole group: ``Lanes.columns``)."""
        policy = evicting_policy(rp)
        rows = torch.tensor([i for i, _ in group], dtype=torch.long)
        req_ids = [r for _, r in group]
        states = [self.ledger.get(q) for q in req_ids]
        slots = [self._slots(q, s.offset, n) for q, s in zip(req_ids, states, strict=True)]
        positions = torch.stack([x.positions for x in slots], dim=1)  # [Lyr, R, Hkv, n]
        state = stacked_state([self.records[q] for q in req_ids], slots, self.layers, self.kv_heads, self.device)
        slot_valid = columns = None
        if policy.per_head:
            cols = lanes.LaneColumns.of([self._lanes(q) for q in req_ids], n, self.device)
            tables = table.get_cpu_tensor()[rows].long().to(self.device)
            keys_all, values_all = cols.read(self.kv, tables, self.block_size, values=policy.reads_values)
            positions = positions.gather(-1, cols.field).masked_fill(~cols.valid, -1)
            state = {name: cols.take(t.view(self.layers, len(group), *t.shape[1:])).flatten(0, 1)
                     if name in slots[0].state else t for name, t in state.items()}  # each column's, as read
            slot_valid, columns = cols.valid.flatten(0, 1), cols.slot
        else:
            keys_all, values_all = self._gather_layers(table, rows, n, values=policy.reads_values)
        gathered: list[Gathered] = [(k, None if values_all is None else values_all[i]) for i, k in enumerate(keys_all)]
        keys = keys_all.flatten(0, 1)  # [Lyr * R, Hkv, N, D], layer-major
        # where no stage reads them, their shape alone: the compaction reads them from the blocks
        values = unread_values(keys) if values_all is None else values_all.flatten(0, 1)
        tokens = [s.tokens for s in states]
        queries, query_valid = self.window(policy.schedule.window, req_ids, torch.tensor(tokens), slice(None))
        inp = self._input(
            rp, keys, values, queries, query_valid, positions.flatten(0, 1), self.layer_ids,
            [s.evictions for s in states], state=state, req_ids=req_ids, tokens=tokens, slot_valid=slot_valid,
            schedule=states[0].evicts_to(),
        )
        return HeldRequests(rows, req_ids, states, slots, gathered, inp, positions if policy.per_head else None,
                            columns)

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
        policy = evicting_policy(rp)
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
        prompt_lengths = None
        if req_ids is not None:
            prompts = [self.records[q].prompt_len for q in req_ids]
            if all(p is not None for p in prompts):
                prompt_lengths = torch.tensor(prompts, dtype=torch.long).repeat(lyr)
        return eviction_input(
            keys, values, queries, budget=schedule.budget, recent=schedule.recent,
            seed=policy.resolve_seed(rp.resolved.seed), slot_valid=slot_valid, query_valid=query_valid, positions=positions,
            layer_idx=layer_idx, evictions=torch.tensor(evictions, dtype=torch.long).repeat(lyr),
            head_offset=self.head_offset, query_positions=query_positions, query_new=query_new,
            state=None if state is None or not policy.keeps_state else policy.nest_state(state),
            model=self.model_facts if policy.needs_model else None, prompt_lengths=prompt_lengths,
        )

    def _gather_layers(self, table: BlockTable, rows: torch.Tensor, n: int, layers: list[int] | None = None, *,
                       values: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``rows``' first ``n`` slots of every layer (or of ``layers``), keys and values
        ``[Lyr, R, Hkv, n, D]`` (copies; values None unless ``values``)."""
        blocks, offs = slot_address(table.get_cpu_tensor()[rows].to(self.device), n, self.block_size)
        return paged.gather_layers(self.kv if layers is None else [self.kv[i] for i in layers], blocks, offs,
                                   values=values)

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
        return self.gather_requests(self.records[req_id].policy, entry.held, [(row, req_id)], table).inp

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

    def window(self, w: int, req_ids: list[str], tokens: torch.Tensor, layers: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """The requests' last ``w`` queries of ``layers`` after ``tokens [R]`` each, oldest first and
        layer-major as their keys are (``RequestQueryRing.read``): ``[Lyr * R, Hq, W, D]``, and
        which entries hold a query ``[Lyr * R, W]``."""
        if w == 0:
            rows = len(range(*layers.indices(self.layers))) * len(req_ids)
            return (torch.zeros(rows, self.q_heads, 0, self.head_dim, dtype=self.dtype, device=self.device),
                    torch.zeros(rows, 0, dtype=torch.bool, device=self.device))
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
