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

The ring and the per-slot positions are the only state kept beside vLLM's own; both live on the
KV cache's device. The cache is read and written through ``BlockLayout`` (``kvpolicy.vllm.layout``),
from the layout vLLM resolved for the server and the backend's block interior.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..policy import Policy
from .layout import BlockLayout, LayoutError
from .ledger import SlotLedger
from .paged import compact, gather_slots, slot_address
from .settings import KVPolicyVLLMError, Resolved

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
    """Where this step's last ``window`` queries of each request go in the ring (``[T]`` each)."""

    ring_rows: torch.Tensor  # the request's ring row
    ring_pos: torch.Tensor  # the position in the ring: token index modulo window
    token_idx: torch.Tensor  # the query's row in this step's flattened tokens

#: The worker state of this process (one model runner per worker process).
_ACTIVE: WorkerEviction | None = None
#: How many eviction inputs a trace folder receives per process (for parity checks).
TRACE_SAVES = int(os.environ.get("KVPOLICY_VLLM_TRACE_SAVES", "4"))


class WorkerEviction:
    def __init__(self, runner: Any, resolved: Resolved) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        self.runner = runner
        self.resolved = resolved
        self.policy: Policy = resolved.policy()
        self.schedule = self.policy.schedule
        self.ledger = SlotLedger(self.schedule)
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
        self.window = self.schedule.window
        self.dtype = self.caches[0].dtype
        self.ring: torch.Tensor | None = None  # [rows, layers, W, Hq, D]
        self.ring_row: dict[str, int] = {}
        self.free_rows: list[int] = []
        self.kept_pos: dict[str, torch.Tensor] = {}  # req -> [layers, Hkv, K] positions of kept slots
        self.plan: StepRequests | None = None
        self.capture: QueryCapture | None = None
        self.layout_checked = False
        # Under tensor parallelism this rank holds KV heads [head_offset, head_offset + kv_heads) of
        # the model's (start-up refuses a TP size that does not divide them): it evicts those
        # alone, drawing what an unsharded run draws for them (Policy.select's head_offset).
        from vllm.distributed import get_tensor_model_parallel_rank

        self.rank = int(get_tensor_model_parallel_rank())
        self.head_offset = self.rank * self.kv_heads
        self.trace = Path(resolved.trace) if resolved.trace else None
        self.saves = 0
        if self.trace is not None:
            self.trace.mkdir(parents=True, exist_ok=True)

    # -- requests joining and leaving -------------------------------------------------------
    def on_update_states(self, scheduler_output: Any) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self._drop(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            self._drop(new.req_id)  # a new request, or one resubmitted under the same id
        for req_id in scheduler_output.scheduled_cached_reqs.resumed_req_ids:
            state = self.ledger.requests.get(req_id)
            if state is not None and state.evictions and self.rank == 0:
                # Exactness would need the evicted cache back; vLLM recomputes from the tokens.
                logger.warning(
                    "kvpolicy: request %s was preempted after %d eviction(s); vLLM recomputes its cache "
                    "from its %d tokens (full attention over them, then eviction again), so its "
                    "continuation may differ from an uninterrupted run. Give the KV cache more blocks "
                    "or lower max_num_seqs to avoid preemption.", req_id, state.evictions, state.tokens,
                )
            self._drop(req_id)  # preempted: vLLM recomputes it from scratch into fresh blocks

    def _drop(self, req_id: str) -> None:
        self.ledger.reset(req_id)
        self.kept_pos.pop(req_id, None)
        row = self.ring_row.pop(req_id, None)
        if row is not None:
            self.free_rows.append(row)

    def _row(self, req_id: str) -> int:
        row = self.ring_row.get(req_id)
        if row is not None:
            return row
        if not self.free_rows:
            old = 0 if self.ring is None else self.ring.shape[0]
            new = max(8, 2 * old)
            grown = torch.zeros(new, len(self.caches), self.window, self.q_heads, self.head_dim, dtype=self.dtype,
                                device=self.device)
            if self.ring is not None:
                grown[:old] = self.ring
            self.ring = grown
            self.free_rows.extend(range(new - 1, old - 1, -1))
        row = self.ring_row[req_id] = self.free_rows.pop()
        return row

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
        self.capture = None
        w = self.window
        if w > 0 and num_reqs:
            # The last min(n, w) tokens of each request in this step; a query of token t goes to
            # ring position t % w, so the ring always holds the request's last w queries.
            take = np.minimum(n, w)
            ends = np.cumsum(n)
            rep = np.repeat(np.arange(num_reqs), take)
            j = np.arange(int(take.sum())) - np.repeat(np.cumsum(take) - take, take)
            flat = ends[rep] - take[rep] + j
            pos = (before[rep] + n[rep] - take[rep] + j) % w
            rows = np.array([self._row(r) for r in req_ids], dtype=np.int64)[rep]
            dev = self.device
            self.capture = QueryCapture(torch.from_numpy(rows).to(dev), torch.from_numpy(pos).to(dev),
                                        torch.from_numpy(flat).to(dev))

    # -- during the forward -----------------------------------------------------------------
    def capture_queries(self, layer_name: str, query: torch.Tensor) -> None:
        if self.capture is None or self.ring is None:
            return
        layer = self.layer_of.get(layer_name)
        if layer is None:
            return
        cap = self.capture
        q = query.view(query.shape[0], self.q_heads, self.head_dim)
        self.ring[cap.ring_rows, layer, cap.ring_pos] = q[cap.token_idx].to(self.dtype)

    def check_layout(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Once: the cache holds what this module assumes (a plain, unpacked layout)."""
        self.layout_checked = True
        if key.shape[0] == 0 or int(slot_mapping[0]) < 0:
            self.layout_checked = False
            return
        slot = int(slot_mapping[0])
        blocks = torch.tensor([[slot // self.block_size]], device=self.device)
        offs = torch.tensor([[slot % self.block_size]], device=self.device)
        k, v = gather_slots(self.layout.split(kv_cache), blocks, offs)
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
        due: list[tuple[int, str]] = []
        for i, req_id in enumerate(plan.req_ids):
            if self.ledger.advance(req_id, plan.tokens_after(i), int(plan.prompt_len[i])):
                due.append((i, req_id))
        if not due:
            return
        by_count: dict[int, list[tuple[int, str]]] = {}
        for i, req_id in due:
            by_count.setdefault(self.ledger.get(req_id).slots, []).append((i, req_id))
        for count, group in sorted(by_count.items()):
            self._evict(count, group)

    def _evict(self, n: int, group: list[tuple[int, str]]) -> None:
        """Evict the requests of ``group`` (batch row, request id), which all hold ``n`` slots:
        one ``Policy.select`` over every layer and request, the kept slots compacted in place, and
        the blocks past them dropped from the requests' block tables."""
        runner = self.runner
        table = runner.input_batch.block_table.block_tables[0]
        rows = torch.tensor([i for i, _ in group], dtype=torch.long)
        req_ids = [r for _, r in group]
        r = len(group)
        lyr = len(self.caches)
        bt = table.get_cpu_tensor()[rows].to(self.device)
        blocks, offs = slot_address(bt, n, self.block_size)
        gathered = [gather_slots(kv, blocks, offs) for kv in self.kv]
        keys = torch.stack([g[0] for g in gathered]).flatten(0, 1)  # [Lyr * R, Hkv, N, D], layer-major
        values = torch.stack([g[1] for g in gathered]).flatten(0, 1)
        states = [self.ledger.get(q) for q in req_ids]
        positions = torch.stack([self._positions(q, s.offset, n) for q, s in zip(req_ids, states, strict=True)], dim=1)
        queries, query_valid = self._window(req_ids, [s.tokens for s in states], keys)
        layer_idx = torch.tensor(self.layer_ids, dtype=torch.long, device=self.device).repeat_interleave(r)
        evictions = torch.tensor([s.evictions for s in states], dtype=torch.long, device=self.device).repeat(lyr)
        flat_pos = positions.flatten(0, 1)
        kept = self.policy.select(
            keys, values, queries, query_valid=query_valid, positions=flat_pos,
            layer_idx=layer_idx, evictions=evictions, seed=self.resolved.seed, head_offset=self.head_offset,
        )
        k = kept.shape[-1]
        compact(self.kv, bt, gathered, kept.view(lyr, r, self.kv_heads, k), self.block_size)
        new_pos = flat_pos.gather(2, kept).view(lyr, r, self.kv_heads, k)
        keep_blocks = -(-k // self.block_size)
        for j, req_id in enumerate(req_ids):
            self.kept_pos[req_id] = new_pos[:, j].clone()
            self.ledger.evicted(req_id)
            row = int(rows[j])
            table.num_blocks_per_row[row] = min(int(table.num_blocks_per_row[row]), keep_blocks)
            state = runner.requests.get(req_id)
            if state is not None:
                for ids in state.block_ids:
                    del ids[keep_blocks:]
        if self.trace is not None:
            self._write_trace(req_ids, states, n, keys, values, queries, query_valid, flat_pos, layer_idx, evictions, kept)

    def _window(
        self, req_ids: list[str], tokens: list[int], keys: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The requests' query windows ``[Lyr * R, Hq, W, D]``, layer-major like the keys, oldest
        query first (as ``EvictingCache`` keeps them), and which entries hold a query ``[Lyr * R, W]``."""
        lyr, r, w = len(self.caches), len(req_ids), self.window
        if w == 0 or self.ring is None:
            return keys.new_zeros(lyr * r, self.q_heads, 0, self.head_dim), None
        ring_rows = torch.tensor([self.ring_row[q] for q in req_ids], dtype=torch.long, device=self.device)
        seen = torch.tensor(tokens, dtype=torch.long, device=self.device)
        steps = torch.arange(w, device=self.device)
        order = (seen[:, None] + steps) % w
        win = self.ring[ring_rows]  # [R, Lyr, W, Hq, D]
        win = win.gather(2, order[:, None, :, None, None].expand_as(win))
        queries = win.permute(1, 0, 3, 2, 4).flatten(0, 1)
        valid = (seen[:, None] - w + steps) >= 0
        return queries, valid.repeat(lyr, 1)

    def _positions(self, req_id: str, offset: int, n: int) -> torch.Tensor:
        """``[Lyr, Hkv, N]`` token index of each slot of the request."""
        kept = self.kept_pos.get(req_id)
        start = 0 if kept is None else kept.shape[-1]
        fresh = (torch.arange(start, n, device=self.device) + offset).expand(len(self.caches), self.kv_heads, n - start)
        return fresh.clone() if kept is None else torch.cat([kept, fresh], dim=-1)

    def _write_trace(self, req_ids, states, n, keys, values, queries, query_valid, positions, layer_idx, evictions, kept) -> None:
        assert self.trace is not None
        record = {
            "rank": self.rank, "head_offset": self.head_offset, "requests": req_ids, "slots_before": n,
            "kept": int(kept.shape[-1]),
            "tokens": [s.tokens for s in states], "evictions_after": [s.evictions for s in states],
        }
        with open(self.trace / f"worker-{self.rank}-{os.getpid()}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.saves < TRACE_SAVES:
            self.saves += 1
            torch.save(
                {"keys": keys, "values": values, "queries": queries, "query_valid": query_valid,
                 "positions": positions, "layer_idx": layer_idx, "evictions": evictions, "kept": kept,
                 "requests": req_ids, "seed": self.resolved.seed, "policy_yaml": self.resolved.policy_yaml,
                 "head_offset": self.head_offset},
                self.trace / f"evict-{self.rank}-{os.getpid()}-{self.saves}.pt",
            )


# -- wrappers installed on vLLM's classes at plugin load (see kvpolicy.vllm.hooks) ------------------
def state_of(runner: Any) -> WorkerEviction | None:
    return runner.__dict__.get("_kvpolicy")


def init_runner(runner: Any) -> None:
    """After ``initialize_kv_cache``: switch eviction on for this runner if the server asked."""
    global _ACTIVE
    resolved = Resolved.from_additional_config(runner.vllm_config.additional_config)
    if resolved is None:
        return
    state = WorkerEviction(runner, resolved)
    from .hooks import install_backend

    for impl_cls in state.impl_classes:
        install_backend(impl_cls)
    runner.__dict__["_kvpolicy"] = state
    _ACTIVE = state


def active() -> WorkerEviction | None:
    return _ACTIVE
