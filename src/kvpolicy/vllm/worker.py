"""The worker side: query windows, attention lengths and eviction inside a vLLM model runner.

One ``WorkerEviction`` lives in each worker process (one per tensor-parallel rank), attached to
its model runner. Per step it

1. before the forward (``GPUModelRunner._prepare_inputs``, wrapped): leaves RoPE positions
   counting real tokens, and makes the attention length the slots held (``seq_lens``) and the
   slot each new token is written to (``slot_mapping``) follow each request's slot count;
2. during the forward (the ``forward`` of each layer's attention backend, wrapped: where the
   attention op hands every backend its post-RoPE queries; see ``kvpolicy.vllm.hooks``): copies
   the last ``window`` queries of each request and layer into a per-request, per-layer ring;
3. after the forward (``GPUModelRunner.execute_model``, wrapped): advances each request on the
   policy's schedule; the due requests are evicted together: their slots are read from the paged
   cache for every layer, ``Policy.select`` runs once over ``[layers x requests, Hkv, N, D]``
   (one call per distinct slot count), the kept slots are compacted to the front of the
   request's blocks, and the blocks past the kept slots leave the request's block table (the
   scheduler returns the same blocks to vLLM's pool: see ``kvpolicy.vllm.scheduler``).

Each request runs its own policy (``settings.request_policy``: its own, else the server's); due
requests are grouped by policy and slot count, one ``Policy.select`` per group. Requests whose
policies look at different numbers of queries have rings of different widths.

The rings and the per-slot state of each request's kept slots (``KeptSlots``: today their token
positions) are the only state kept beside vLLM's own; both live on the KV cache's device. A
request resumed after preemption replays its evictions (``kvpolicy.vllm.ledger``): its rings and
kept slots are rebuilt by the replay, not stored across the preemption. The cache is read and written through ``BlockLayout`` (``kvpolicy.vllm.layout``),
from the layout vLLM resolved for the server and the backend's block interior.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..policy import Policy, window_positions
from ..stages.base import StateField
from .layout import BlockLayout, LayoutError
from .ledger import SlotLedger
from .paged import compact, gather_paged, slot_address
from .settings import KVPolicyVLLMError, Resolved, request_policy

logger = logging.getLogger(__name__)


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
        self.dtype, self.device = dtype, device
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


@dataclass(frozen=True)
class KeptSlots:
    """What the worker keeps per slot of a request beside vLLM's keys and values, for its first
    ``K`` slots (those kept at its last eviction, or every slot its policy's state was last
    brought up to date over): ``[Lyr, Hkv, K]`` tensors that move with the slots.

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
        state field its ``initial`` value."""
        pos = (torch.arange(start, n, device=device) + offset).expand(layers, heads, n - start)
        state = {name: torch.full((layers, heads, n - start), spec.initial, dtype=spec.dtype, device=device)
                 for name, spec in (fields or {}).items() if spec.per == "slot"}
        return KeptSlots(pos.clone(), state)

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


#: Logits per chunk when a long chunk's queries update a policy's state (``[Hq, chunk, N]``).
OBSERVE_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class RequestPolicy:
    """A policy as this worker runs it: loaded once per distinct resolved policy."""

    resolved: Resolved
    policy: Policy | None  # None: the request never evicts

#: The worker state of this process (one model runner per worker process).
_ACTIVE: WorkerEviction | None = None
#: How many eviction inputs a trace folder receives per process (for parity checks).
TRACE_SAVES = int(os.environ.get("KVPOLICY_VLLM_TRACE_SAVES", "4"))


class WorkerEviction:
    def __init__(self, runner: Any, resolved: Resolved) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        self.runner = runner
        self.resolved = resolved  # the server's policy: requests naming none run it
        self.policies: dict[str | None, RequestPolicy] = {}  # by resolved policy YAML
        self.policy_of: dict[str, RequestPolicy] = {}  # by request
        self.ledger = SlotLedger()
        groups = runner.kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise KVPolicyVLLMError(f"expected one KV cache group (full attention everywhere), got {len(groups)}")
        spec = groups[0].kv_cache_spec
        self.block_size = int(spec.block_size)
        names = sorted(groups[0].layer_names, key=extract_layer_index)
        ctx = runner.compilation_config.static_forward_context
        self.layer_of = {name: i for i, name in enumerate(names)}
        self.layer_ids = [extract_layer_index(n) for n in names]
        self.caches: list[torch.Tensor] = [ctx[n].kv_cache for n in names]
        if len({c.data_ptr() for c in self.caches}) != len(self.caches):
            raise KVPolicyVLLMError("layers sharing one KV cache tensor (KV sharing) are not supported")
        _, self.kv_heads, _, _ = self.caches[0].shape
        impl = ctx[names[0]].impl
        self.q_heads = int(impl.num_heads)
        self.head_dim = int(impl.head_size)
        backends = {ctx[n].attn_backend.get_name() for n in names}
        if len(backends) != 1:
            raise KVPolicyVLLMError(f"layers on different attention backends are not supported: {sorted(backends)}")
        try:
            self.layout = BlockLayout.for_backend(backends.pop(), runner.vllm_config.cache_config.kv_cache_layout,
                                                  self.head_dim)
            # [num_blocks, block_size, Hkv, D] views of every layer's keys and values
            self.kv = [self.layout.split(c) for c in self.caches]
        except LayoutError as exc:
            raise KVPolicyVLLMError(f"KV cache layout: {exc}") from None
        self.impl_classes = {type(ctx[n].impl) for n in names}
        self.device = self.caches[0].device
        self.prefix_caching = bool(runner.vllm_config.cache_config.enable_prefix_caching)
        self.dtype = self.caches[0].dtype
        self.rings: dict[int, RequestQueryRing] = {}  # by window size
        self.kept: dict[str, KeptSlots] = {}  # req -> per-slot state of its kept slots
        # A policy whose stages keep state (Policy.state_fields): per request, its per-head state
        # ([Lyr, Hkv] per field), how many of its tokens' queries the state has seen, and this
        # step's requests whose chunk is longer than their window (seen layer by layer, as the
        # chunk is computed: LongStep).
        self.head_state: dict[str, dict[str, torch.Tensor]] = {}
        self.observed: dict[str, int] = {}
        self.long_steps: dict[str, LongStep] = {}
        self.replays: dict[str, list[int]] = {}  # req -> eviction points its recompute must replay
        self.plan: StepRequests | None = None
        self.captures: list[QueryCapture] = []
        self.held_generators: dict[int, torch.Generator] = {}  # see _hold_generators
        self.layout_checked = False
        # Under tensor parallelism this rank holds KV heads [head_offset, head_offset + kv_heads) of
        # the model's (start-up refuses a TP size that does not divide them): it evicts those
        # alone, drawing what an unsharded run draws for them (Policy.select's head_offset).
        from vllm.distributed import get_tensor_model_parallel_rank

        self.rank = int(get_tensor_model_parallel_rank())
        self.head_offset = self.rank * self.kv_heads
        self.trace = Path(resolved.trace) if resolved.trace else None
        self.saves = 0
        self.step = 0  # forward passes run (the trace's step number)
        if self.trace is not None:
            self.trace.mkdir(parents=True, exist_ok=True)

    # -- requests joining and leaving -------------------------------------------------------
    def on_update_states(self, scheduler_output: Any) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self._drop(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            self._drop(new.req_id)  # a new request, or one resubmitted under the same id
        for req_id in scheduler_output.scheduled_cached_reqs.resumed_req_ids:
            # Preempted, now recomputed into fresh blocks: it replays its evictions (the scheduler
            # ends its steps at the same points), from this worker's own record of them.
            plan = self.ledger.replay_plan(req_id)
            if plan is None:
                plan = self.replays.get(req_id)  # preempted again before it ran
            self._drop(req_id)
            if plan is not None:
                self.replays[req_id] = plan
                if plan and self.rank == 0:
                    logger.info("kvpolicy: request %s resumes after preemption, replaying %d eviction(s)",
                                req_id, len(plan))

    def _drop(self, req_id: str) -> None:
        self.ledger.reset(req_id)
        self.kept.pop(req_id, None)
        self.head_state.pop(req_id, None)
        self.observed.pop(req_id, None)
        self.replays.pop(req_id, None)
        self.policy_of.pop(req_id, None)
        for ring in self.rings.values():
            ring.drop(req_id)

    def _policy(self, req_id: str) -> RequestPolicy:
        """The request's policy (looked up once per request), tracked in the ledger from here on."""
        known = self.policy_of.get(req_id)
        if known is not None:
            return known
        state = self.runner.requests.get(req_id)
        params = None if state is None else state.sampling_params
        r = request_policy(None if params is None else params.extra_args, self.resolved)
        rp = self.policies.get(r.policy_yaml)
        if rp is None:
            rp = self.policies[r.policy_yaml] = RequestPolicy(r, r.policy())
        self.policy_of[req_id] = rp
        if not self.ledger.tracks(req_id):
            self.ledger.resume(req_id, None if rp.policy is None else rp.policy.schedule, self.replays.pop(req_id, None))
        return rp

    def _ring(self, window: int) -> RequestQueryRing:
        ring = self.rings.get(window)
        if ring is None:
            ring = self.rings[window] = RequestQueryRing(window, len(self.caches), self.q_heads, self.head_dim,
                                                         self.dtype, self.device)
        return ring

    # -- before the forward -----------------------------------------------------------------
    def after_prepare_inputs(self, num_scheduled: np.ndarray) -> None:
        runner = self.runner
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        req_ids = list(batch.req_ids[:num_reqs])
        n = np.asarray(num_scheduled[:num_reqs], dtype=np.int64)
        before = batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        prompt = batch.num_prompt_tokens[:num_reqs].astype(np.int64)
        offsets = np.array([self.ledger.offset(r) for r in req_ids], dtype=np.int64)
        self.plan = StepRequests(req_ids, n, before, prompt)
        if offsets.any():
            total = int(n.sum())
            off_rows = torch.from_numpy(offsets)
            runner.seq_lens[:num_reqs] -= off_rows.to(runner.seq_lens.device, runner.seq_lens.dtype)
            runner.optimistic_seq_lens_cpu[:num_reqs] -= off_rows.to(runner.optimistic_seq_lens_cpu.dtype)
            per_token = torch.from_numpy(np.repeat(offsets, n)).to(runner.positions.device, runner.positions.dtype)
            slots = runner.positions[:total] - per_token
            batch.block_table.compute_slot_mapping(num_reqs, runner.query_start_loc.gpu[: num_reqs + 1], slots)
        self._hold_generators(num_reqs)
        self.captures = []
        if not num_reqs:
            return
        # The last min(n, w) tokens of each request in this step; a query of token t goes to ring
        # position t % w, so the ring always holds the request's last w queries.
        windows = np.array([self._window_size(r) for r in req_ids], dtype=np.int64)
        ends = np.cumsum(n)
        for w in sorted(set(windows.tolist()) - {0}):
            idx = np.flatnonzero(windows == w)
            take = np.minimum(n[idx], w)
            rep = np.repeat(idx, take)
            j = np.arange(int(take.sum())) - np.repeat(np.cumsum(take) - take, take)
            flat = ends[rep] - np.repeat(take, take) + j
            pos = (before[rep] + n[rep] - np.repeat(take, take) + j) % w
            ring = self._ring(w)
            rows = np.array([ring.row(req_ids[i]) for i in idx], dtype=np.int64)
            rows = np.repeat(rows, take)
            dev = self.device
            self.captures.append(QueryCapture(ring, torch.from_numpy(rows).to(dev), torch.from_numpy(pos).to(dev),
                                              torch.from_numpy(flat).to(dev)))
        self._plan_state(req_ids, n, before)

    def _plan_state(self, req_ids: list[str], n: np.ndarray, before: np.ndarray) -> None:
        """For requests whose policy's state sees every query: bring it up to date now (every
        layer, from the ring) where this step's tokens would push unseen queries out of the
        window, and note the chunks longer than the window (``LongStep``: seen as computed)."""
        self.long_steps = {}
        pending: dict[tuple[str, int], list[tuple[int, str]]] = {}
        ends = np.cumsum(n)
        for i, req_id in enumerate(req_ids):
            rp = self.policy_of[req_id]
            if rp.policy is None or not rp.policy.observes_queries:
                continue
            window, ledger = rp.policy.schedule.window, self.ledger.get(req_id)
            tokens, done = int(n[i]), int(before[i])
            unseen = done - self.observed.get(req_id, 0)
            if unseen > 0 and unseen + tokens > window:
                pending.setdefault((rp.resolved.policy_yaml or "", ledger.slots), []).append((i, req_id))
            if tokens > window:
                self.long_steps[req_id] = LongStep(i, int(ends[i]) - tokens, tokens, done, ledger.offset,
                                                   ledger.slots + tokens)
        for (_, count), group in sorted(pending.items()):
            self._observe(self.policy_of[group[0][1]], count, group)

    def _hold_generators(self, num_reqs: int) -> None:
        """Take the seeded generators of requests whose step ends inside their known tokens (a
        prefill chunk: vLLM discards what it samples for them) until sampling is done.

        vLLM rewinds such a generator with ``set_offset``, which CPU generators lack ("CPU
        Generator does not use offset"): a seeded request recomputed in chunks after preemption
        would stop the engine. Held back, the generator draws nothing for the discarded sample,
        which is what the rewind is for: the request samples as if the chunk had not happened."""
        self.held_generators = {}
        mask = getattr(self.runner, "discard_request_mask", None)
        gens = self.runner.input_batch.generators
        if mask is None or not gens:
            return
        for i in np.flatnonzero(mask.np[:num_reqs]).tolist():
            if i in gens:
                self.held_generators[i] = gens.pop(i)

    def restore_generators(self) -> None:
        if self.held_generators:
            self.runner.input_batch.generators.update(self.held_generators)
            self.held_generators = {}

    def _window_size(self, req_id: str) -> int:
        policy = self._policy(req_id).policy
        return 0 if policy is None else policy.schedule.window

    # -- during the forward -----------------------------------------------------------------
    def capture_queries(self, layer_name: str, query: torch.Tensor) -> None:
        if not self.captures:
            return
        layer = self.layer_of.get(layer_name)
        if layer is None:
            return
        q = query.view(query.shape[0], self.q_heads, self.head_dim)
        for cap in self.captures:
            cap.ring.tensor[cap.ring_rows, layer, cap.ring_pos] = q[cap.token_idx].to(self.dtype)

    def check_layout(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Once: the cache holds what this module assumes (a plain, unpacked layout)."""
        self.layout_checked = True
        if key.shape[0] == 0 or int(slot_mapping[0]) < 0:
            self.layout_checked = False
            return
        slot = int(slot_mapping[0])
        blocks = torch.tensor([[slot // self.block_size]], device=self.device)
        offs = torch.tensor([[slot % self.block_size]], device=self.device)
        k, v = gather_paged(self.layout.split(kv_cache), blocks, offs)
        if not (torch.equal(k[0, :, 0], key[0].view(self.kv_heads, -1).to(k.dtype))
                and torch.equal(v[0, :, 0], value[0].view(self.kv_heads, -1).to(v.dtype))):
            raise KVPolicyVLLMError(
                f"the KV cache does not hold the first keys where layout {self.layout.name} "
                f"({self.layout.interior}) puts them (a packed ISA layout?); cache dtype {kv_cache.dtype}: "
                "use dtype float32 or bfloat16 without AMX packing"
            )

    # -- after the forward ------------------------------------------------------------------
    def after_execute(self) -> None:
        plan, self.plan = self.plan, None
        if plan is None:
            return
        self.step += 1
        for i, req_id in enumerate(plan.req_ids):
            if req_id in self.long_steps:  # its chunk's queries were seen layer by layer
                self.observed[req_id] = plan.tokens_after(i)
        self.long_steps = {}
        due: list[tuple[int, str]] = []
        for i, req_id in enumerate(plan.req_ids):
            self._policy(req_id)  # tracked in the ledger under its policy's schedule
            if self.ledger.advance(req_id, plan.tokens_after(i), int(plan.prompt_len[i])):
                due.append((i, req_id))
        if not due:
            return
        # One select call per policy and slot count: a request evicts exactly as it would alone.
        groups: dict[tuple[str, int], list[tuple[int, str]]] = {}
        for i, req_id in due:
            key = (self.policy_of[req_id].resolved.policy_yaml or "", self.ledger.get(req_id).slots)
            groups.setdefault(key, []).append((i, req_id))
        for (_, count), group in sorted(groups.items()):
            self._evict(self.policy_of[group[0][1]], count, group)

    def _evict(self, rp: RequestPolicy, n: int, group: list[tuple[int, str]]) -> None:
        """Evict the requests of ``group`` (batch row, request id), which all run ``rp`` and hold
        ``n`` slots: one ``Policy.select`` over every layer and request, the kept slots compacted
        to the front of the request's blocks, and the blocks past them dropped from its block table.

        Under prefix caching a request's first eviction writes the kept slots into the fresh
        blocks the scheduler appended for it (``kvpolicy.vllm.scheduler``), never into its old
        blocks, which other requests may read or the prefix cache hand out again; the request's
        block table becomes those fresh blocks."""
        policy = rp.policy
        assert policy is not None  # the ledger never makes a request without a schedule due
        runner = self.runner
        table = runner.input_batch.block_table.block_tables[0]
        rows = torch.tensor([i for i, _ in group], dtype=torch.long)
        req_ids = [r for _, r in group]
        r = len(group)
        lyr = len(self.caches)
        bt = table.get_cpu_tensor()[rows].to(self.device)
        blocks, offs = slot_address(bt, n, self.block_size)
        gathered = [gather_paged(kv, blocks, offs) for kv in self.kv]
        keys = torch.stack([g[0] for g in gathered]).flatten(0, 1)  # [Lyr * R, Hkv, N, D], layer-major
        values = torch.stack([g[1] for g in gathered]).flatten(0, 1)
        states = [self.ledger.get(q) for q in req_ids]
        slots = [self._slots(q, s.offset, n) for q, s in zip(req_ids, states, strict=True)]
        positions = torch.stack([x.positions for x in slots], dim=1)
        queries, query_valid = self._window(policy.schedule.window, req_ids, [s.tokens for s in states], keys)
        layer_idx = torch.tensor(self.layer_ids, dtype=torch.long, device=self.device).repeat_interleave(r)
        evictions = torch.tensor([s.evictions for s in states], dtype=torch.long, device=self.device).repeat(lyr)
        flat_pos = positions.flatten(0, 1)
        stateful: dict[str, Any] = {}
        if policy.keeps_state:  # brought up to date with the window's unseen queries, then ranked by
            new = policy.updated_state(
                keys, values, queries, state=self._state_of(req_ids, slots, policy),
                query_new=self._query_new(req_ids, [s.tokens for s in states], query_valid),
                query_valid=query_valid, positions=flat_pos, layer_idx=layer_idx, evictions=evictions,
                seed=rp.resolved.seed, head_offset=self.head_offset,
            )
            slots = self._keep_state(req_ids, slots, new)
            stateful = {"state": new, "query_new": None if query_valid is None else torch.zeros_like(query_valid)}
            for req_id, s in zip(req_ids, states, strict=True):
                self.observed[req_id] = s.tokens
        kept = policy.select(
            keys, values, queries, query_valid=query_valid, positions=flat_pos,
            layer_idx=layer_idx, evictions=evictions, seed=rp.resolved.seed, head_offset=self.head_offset,
            **stateful,
        )
        k = kept.shape[-1]
        keep_blocks = -(-k // self.block_size)
        new_tables = [self._kept_blocks(table, int(rows[j]), req_id, states[j].evictions == 0, n, keep_blocks)
                      for j, req_id in enumerate(req_ids)]
        dst = torch.tensor(new_tables, dtype=torch.long, device=self.device)
        compact(self.kv, dst, gathered, kept.view(lyr, r, self.kv_heads, k), self.block_size)
        per_req = kept.view(lyr, r, self.kv_heads, k)
        for j, req_id in enumerate(req_ids):
            self.kept[req_id] = slots[j].take(per_req[:, j])
            self.ledger.evicted(req_id)
            table.add_row(new_tables[j], int(rows[j]))
            state = runner.requests.get(req_id)
            if state is not None:
                state.block_ids[0][:] = new_tables[j]
        if self.trace is not None:
            self._write_trace(rp, req_ids, states, n, keys, values, queries, query_valid, flat_pos, layer_idx,
                              evictions, kept)

    def _kept_blocks(self, table: Any, row: int, req_id: str, first: bool, n: int, keep: int) -> list[int]:
        """The blocks a request's ``keep`` blocks of kept slots go to: the fresh blocks appended
        for its first eviction under prefix caching, then its own first blocks (in place)."""
        held = int(table.num_blocks_per_row[row])
        ids = [int(b) for b in table.get_cpu_tensor()[row, :held]]
        needed = -(-n // self.block_size)
        copies = held - needed
        expected = keep if self.prefix_caching and first else 0
        if copies != expected:
            raise KVPolicyVLLMError(
                f"request {req_id} holds {held} blocks for {n} slots; expected {needed} + {expected} fresh "
                "(the scheduler and this worker disagree)"
            )
        return ids[needed:] + ids[copies:keep]

    def _window(
        self, w: int, req_ids: list[str], tokens: list[int], keys: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The requests' last ``w`` queries ``[Lyr * R, Hq, W, D]``, layer-major like the keys, oldest
        query first (as ``EvictingCache`` keeps them), and which entries hold a query ``[Lyr * R, W]``."""
        lyr, r = len(self.caches), len(req_ids)
        if w == 0:
            return keys.new_zeros(lyr * r, self.q_heads, 0, self.head_dim), None
        ring = self.rings[w]
        ring_rows = torch.tensor([ring.row_of[q] for q in req_ids], dtype=torch.long, device=self.device)
        seen = torch.tensor(tokens, dtype=torch.long, device=self.device)
        steps = torch.arange(w, device=self.device)
        order = (seen[:, None] + steps) % w
        win = ring.tensor[ring_rows]  # [R, Lyr, W, Hq, D]
        win = win.gather(2, order[:, None, :, None, None].expand_as(win))
        queries = win.permute(1, 0, 3, 2, 4).flatten(0, 1)
        valid = (seen[:, None] - w + steps) >= 0
        return queries, valid.repeat(lyr, 1)

    def _slots(self, req_id: str, offset: int, n: int) -> KeptSlots:
        """The per-slot state ``[Lyr, Hkv, N]`` of the request's ``n`` slots: kept, then fresh."""
        kept = self.kept.get(req_id)
        start = 0 if kept is None else kept.count
        policy = self.policy_of[req_id].policy
        fields = None if policy is None else {name: spec for name, (_, _, spec) in policy.state_fields.items()}
        fresh = KeptSlots.fresh(start, n, offset, len(self.caches), self.kv_heads, self.device, fields)
        return KeptSlots.extend(kept, fresh)

    # -- a policy's state ---------------------------------------------------------------------
    def _heads(self, req_id: str, policy: Policy) -> dict[str, torch.Tensor]:
        """The request's per-head state fields, ``[Lyr, Hkv]`` each (initial on first use)."""
        known = self.head_state.get(req_id)
        if known is None:
            known = self.head_state[req_id] = {
                name: torch.full((len(self.caches), self.kv_heads), spec.initial, dtype=spec.dtype, device=self.device)
                for name, (_, _, spec) in policy.state_fields.items() if spec.per == "head"
            }
        return known

    def _state_of(self, req_ids: list[str], slots: list[KeptSlots], policy: Policy) -> dict[str, torch.Tensor]:
        """The requests' state, layer-major on the batch axis as the keys are: ``[Lyr * R, Hkv, N]``
        per slot, ``[Lyr * R, Hkv]`` per head."""
        state = {name: torch.stack([x.state[name] for x in slots], dim=1).flatten(0, 1) for name in slots[0].state}
        for name in policy.state_fields:
            if name not in state:
                state[name] = torch.stack([self._heads(q, policy)[name] for q in req_ids], dim=1).flatten(0, 1)
        return state

    def _keep_state(self, req_ids: list[str], slots: list[KeptSlots], state: Mapping[str, torch.Tensor]) -> list[KeptSlots]:
        """Store the requests' new state (as ``_state_of`` lays it out): per-head fields here, and
        the requests' slots with their new per-slot fields, returned."""
        lyr, r = len(self.caches), len(req_ids)
        out = []
        for j, (req_id, x) in enumerate(zip(req_ids, slots, strict=True)):
            per_slot = {name: t.view(lyr, r, *t.shape[1:])[:, j] for name, t in state.items() if name in x.state}
            for name, t in state.items():
                if name not in x.state:
                    self.head_state[req_id][name] = t.view(lyr, r, -1)[:, j].clone()
            out.append(x.with_state(per_slot))
        return out

    def _query_new(self, req_ids: list[str], tokens: list[int], query_valid: torch.Tensor | None) -> torch.Tensor | None:
        """``[Lyr * R, W]``: the window queries the requests' state has not seen."""
        if query_valid is None:
            return None
        lyr = len(self.caches)
        seen = torch.tensor(tokens, dtype=torch.long, device=self.device).repeat(lyr)
        observed = torch.tensor([self.observed.get(q, 0) for q in req_ids], dtype=torch.long, device=self.device)
        positions = window_positions(query_valid, seen)
        return query_valid & (positions >= observed.repeat(lyr)[:, None])

    def _observe(self, rp: RequestPolicy, n: int, group: list[tuple[int, str]]) -> None:
        """Bring the state of ``group``'s requests (batch row, request id; ``n`` slots each) up to
        date with their window's unseen queries, every layer at once, evicting nothing: before
        this step's queries push unseen ones out of the window."""
        policy = rp.policy
        assert policy is not None
        table = self.runner.input_batch.block_table.block_tables[0]
        rows = torch.tensor([i for i, _ in group], dtype=torch.long)
        req_ids = [r for _, r in group]
        r = len(group)
        blocks, offs = slot_address(table.get_cpu_tensor()[rows].to(self.device), n, self.block_size)
        gathered = [gather_paged(kv, blocks, offs) for kv in self.kv]
        keys = torch.stack([g[0] for g in gathered]).flatten(0, 1)
        values = torch.stack([g[1] for g in gathered]).flatten(0, 1)
        states = [self.ledger.get(q) for q in req_ids]
        slots = [self._slots(q, s.offset, n) for q, s in zip(req_ids, states, strict=True)]
        positions = torch.stack([x.positions for x in slots], dim=1).flatten(0, 1)
        tokens = [s.tokens for s in states]
        queries, query_valid = self._window(policy.schedule.window, req_ids, tokens, keys)
        layer_idx = torch.tensor(self.layer_ids, dtype=torch.long, device=self.device).repeat_interleave(r)
        new = policy.updated_state(
            keys, values, queries, state=self._state_of(req_ids, slots, policy),
            query_new=self._query_new(req_ids, tokens, query_valid), eviction=False, query_valid=query_valid,
            positions=positions, layer_idx=layer_idx, seed=rp.resolved.seed, head_offset=self.head_offset,
        )
        for req_id, x, s in zip(req_ids, self._keep_state(req_ids, slots, new), states, strict=True):
            self.kept[req_id] = x
            self.observed[req_id] = s.tokens

    def after_attention(self, layer_name: str, query: torch.Tensor) -> None:
        """After a layer's attention, for the requests whose chunk is longer than their window
        (``LongStep``): the state sees each of the chunk's queries over the layer's slots (written
        by now), in chunks of queries, before the ring keeps only the last ``window``."""
        if not self.long_steps:
            return
        layer = self.layer_of.get(layer_name)
        if layer is None:
            return
        q = query.view(query.shape[0], self.q_heads, self.head_dim)
        table = self.runner.input_batch.block_table.block_tables[0]
        for req_id, step in self.long_steps.items():
            rp = self.policy_of[req_id]
            policy = rp.policy
            assert policy is not None
            n = step.slots_after
            blocks, offs = slot_address(table.get_cpu_tensor()[step.row : step.row + 1].to(self.device), n, self.block_size)
            keys, values = gather_paged(self.kv[layer], blocks, offs)  # [1, Hkv, N, D]
            slots = self._slots(req_id, step.offset, n)
            state = {name: t[layer : layer + 1] for name, t in slots.state.items()}
            for name, t in self._heads(req_id, policy).items():
                state[name] = t[layer : layer + 1]
            chunk = max(1, min(step.tokens, OBSERVE_ELEMENTS // max(1, self.q_heads * n)))
            for c0 in range(0, step.tokens, chunk):
                c1 = min(step.tokens, c0 + chunk)
                window = q[step.first + c0 : step.first + c1].to(keys.dtype).permute(1, 0, 2)[None]  # [1, Hq, c, D]
                state = policy.updated_state(
                    keys, values, window, state=state, eviction=False,
                    positions=slots.positions[layer : layer + 1],
                    query_positions=torch.arange(step.before + c0, step.before + c1, device=self.device)[None],
                    layer_idx=self.layer_ids[layer], seed=rp.resolved.seed, head_offset=self.head_offset,
                )
            per_slot = {}
            for name, t in state.items():
                if name in slots.state:
                    full = slots.state[name].clone()
                    full[layer] = t[0]
                    per_slot[name] = full
                else:
                    self.head_state[req_id][name][layer] = t[0]
            self.kept[req_id] = slots.with_state(per_slot)

    def _write_trace(self, rp, req_ids, states, n, keys, values, queries, query_valid, positions, layer_idx,
                     evictions, kept) -> None:
        assert self.trace is not None
        record = {
            "step": self.step, "rank": self.rank, "head_offset": self.head_offset, "layers": self.layer_ids,
            "policy": rp.resolved.source,
            "budget": None if rp.policy is None else rp.policy.budget, "requests": req_ids, "slots_before": n,
            "kept": int(kept.shape[-1]),
            "tokens": [s.tokens for s in states], "evictions_after": [s.evictions for s in states],
            # what each request's cache holds after this eviction (token index per layer, head and slot)
            "kept_digest": [_digest(self.kept[q].positions) for q in req_ids],
        }
        with open(self.trace / f"worker-{self.rank}-{os.getpid()}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.saves < TRACE_SAVES:
            self.saves += 1
            torch.save(
                {"keys": keys, "values": values, "queries": queries, "query_valid": query_valid,
                 "positions": positions, "layer_idx": layer_idx, "evictions": evictions, "kept": kept,
                 "requests": req_ids, "seed": rp.resolved.seed, "policy_yaml": rp.resolved.policy_yaml,
                 "head_offset": self.head_offset},
                self.trace / f"evict-{self.rank}-{os.getpid()}-{self.saves}.pt",
            )


def _digest(t: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha1(t.to(torch.int64).cpu().numpy().tobytes()).hexdigest()[:16]


# -- wrappers installed on vLLM's classes at plugin load (see kvpolicy.vllm.hooks) ------------------
def runner_eviction(runner: Any) -> WorkerEviction | None:
    """The ``WorkerEviction`` of a model runner, None when it does not evict."""
    return runner.__dict__.get("_kvpolicy")


def init_runner(runner: Any) -> WorkerEviction | None:
    """After ``initialize_kv_cache``: switch eviction on for this runner if the server asked.

    Returns the runner's state (None: no eviction); the caller (``kvpolicy.vllm.hooks``) then
    wraps its attention backends (``WorkerEviction.impl_classes``)."""
    global _ACTIVE
    resolved = Resolved.from_additional_config(runner.vllm_config.additional_config)
    if resolved is None:
        return None
    state = WorkerEviction(runner, resolved)
    runner.__dict__["_kvpolicy"] = state
    _ACTIVE = state
    return state


def active() -> WorkerEviction | None:
    return _ACTIVE
