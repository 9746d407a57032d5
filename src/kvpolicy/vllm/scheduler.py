"""The engine-core side: block accounting that follows each request's slots, not its tokens.

The scheduler replays the workers' ``SlotLedger`` (``kvpolicy.vllm.ledger``): after each step
(``Scheduler.update_from_output``, wrapped) a request that is due for eviction gives back the
blocks past its kept slots to vLLM's ``BlockPool``; and every later allocation for it
(``SingleTypeKVCacheManager.get_num_blocks_to_allocate`` / ``allocate_new_blocks``, wrapped)
counts its slots, ``num_computed_tokens`` minus the tokens evicted so far. A request's entry goes
when vLLM frees its blocks (finished, aborted or preempted). Each request runs its own policy's
schedule (``settings.request_policy``: its own, else the server's).

**With prefix caching on**, a request's blocks may be read by other requests (prefix-cache hits)
or handed out again later (cached blocks in the free queue): compaction must never write them.
Until its first eviction every full block of a request is (or is about to be) in the prefix
cache, so at the step after which a request first evicts, its allocation asks vLLM for
``ceil(budget / block_size)`` more blocks (``copy_blocks``: counted and allocated by vLLM like any
other, so vLLM waits or preempts as usual when they are short); the workers compact the kept
slots into those fresh blocks, and the request then drops all its old blocks: each goes back to
the pool when its last reader lets go, its cached contents unchanged. After its first eviction a
request's blocks are never cached (``caches``), so later evictions compact in place, as with
prefix caching off. See docs/vllm.md ("Prefix caching") for why this is safe.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from ..schedule import Schedule
from .ledger import SlotLedger, prefix_hit_cap
from .settings import Resolved, request_policy

#: The scheduler state of this engine-core process (one scheduler per engine core), None when inactive.
_STATE: SchedulerEviction | None = None


def ledger() -> SlotLedger | None:
    return None if _STATE is None else _STATE.ledger


def state() -> SchedulerEviction | None:
    return _STATE


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SchedulerEviction:
    def __init__(self, scheduler: Any, resolved: Resolved) -> None:
        global _STATE
        self.scheduler = scheduler
        self.resolved = resolved
        self.ledger = SlotLedger()
        self.schedules: dict[str | None, Schedule | None] = {}  # by resolved policy YAML
        self.prefix_caching = bool(scheduler.vllm_config.cache_config.enable_prefix_caching)
        _STATE = self
        self.trace = Path(resolved.trace) / f"scheduler-{os.getpid()}.jsonl" if resolved.trace else None
        if self.trace is not None:
            self.trace.parent.mkdir(parents=True, exist_ok=True)
        self.step = 0
        self.blocks_freed = 0
        self.blocks_copied = 0  # fresh blocks compaction wrote instead of cached ones
        self.hits_capped = 0  # prefix-cache hits shortened to keep a query window computed
        self.prefix_queried = 0  # prompt tokens looked up in the prefix cache (new requests)
        self.prefix_hit = 0  # of which found there

    def _schedule(self, request: Any) -> Schedule | None:
        r = request_policy(request.sampling_params.extra_args, self.resolved)
        if r.policy_yaml not in self.schedules:
            policy = r.policy()
            self.schedules[r.policy_yaml] = None if policy is None else policy.schedule
        return self.schedules[r.policy_yaml]

    def _tracked(self, req_id: str) -> bool:
        """Track a request the scheduler knows (on its first allocation); False for unknown ids."""
        if self.ledger.tracks(req_id):
            return True
        request = self.scheduler.requests.get(req_id)
        if request is None:
            return False
        self.ledger.track(req_id, self._schedule(request))
        return True

    # -- prefix caching ---------------------------------------------------------------------
    def copy_blocks(self, req_id: str, num_tokens: int, block_size: int) -> int:
        """Fresh blocks to allocate with this step's for a request that first evicts after it."""
        if not self.prefix_caching or not self._tracked(req_id):
            return 0
        entry = self.ledger.get(req_id)
        if entry.schedule is None or entry.evictions:
            return 0
        prompt = self.scheduler.requests[req_id].num_prompt_tokens
        if not self.ledger.would_fire(req_id, num_tokens, prompt):
            return 0
        return cdiv(entry.schedule.budget, block_size)

    def caches(self, req_id: str) -> bool:
        """Whether vLLM may put the request's full blocks in the prefix cache: not once it has
        evicted (its slot ``s`` no longer holds token ``s``)."""
        entry = self.ledger.requests.get(req_id)
        return entry is None or entry.evictions == 0

    def computed_blocks(self, request: Any, found: Any, hit: int, block_size: int) -> tuple[Any, int]:
        """A new request's prefix-cache hit (``found`` blocks per group, ``hit`` tokens), shortened
        where its first eviction needs queries of the hit tokens (``prefix_hit_cap``)."""
        cap = prefix_hit_cap(self._schedule(request), request.num_prompt_tokens)
        if cap is not None and hit > cap:
            hit = cap // block_size * block_size
            found = tuple(group[: hit // block_size] for group in found)
            self.hits_capped += 1
        self.prefix_queried += int(request.num_tokens)
        self.prefix_hit += hit
        return found, hit

    # -- after each step --------------------------------------------------------------------
    def after_update(self, scheduler_output: Any) -> None:
        sched = self.scheduler
        managers = sched.kv_cache_manager.coordinator.single_type_managers
        evicted = 0
        for req_id in scheduler_output.num_scheduled_tokens:
            request = sched.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if not self.ledger.tracks(req_id):
                self.ledger.track(req_id, self._schedule(request))
            if not self.ledger.advance(req_id, request.num_computed_tokens, request.num_prompt_tokens):
                continue
            entry = self.ledger.get(req_id)
            held, first = entry.slots, entry.evictions == 0
            kept = self.ledger.evicted(req_id)
            evicted += 1
            for mgr in managers:
                blocks = mgr.req_to_blocks.get(req_id)
                if not blocks:
                    continue
                keep, needed = cdiv(kept, mgr.block_size), cdiv(held, mgr.block_size)
                copies = len(blocks) - needed  # fresh blocks allocated for this eviction (copy_blocks)
                expected = keep if self.prefix_caching and first else 0
                if copies != expected:
                    raise RuntimeError(
                        f"kvpolicy: request {req_id} holds {len(blocks)} blocks for {held} slots; "
                        f"expected {needed} + {expected} fresh"
                    )
                # The kept slots now live in blocks[needed:] (fresh) + blocks[copies:keep] (compacted in place).
                old, fresh = blocks[:needed], blocks[needed:]
                blocks[:] = fresh + old[copies:keep]
                tail, copied = old[keep:], old[:copies]
                if tail:  # freed tail first: vLLM evicts cached blocks from the free queue in that order
                    mgr.block_pool.free_blocks(reversed(tail))
                if copied:  # released: each returns to the pool when its last reader lets go
                    mgr.block_pool.free_blocks(reversed(copied))
                self.blocks_freed += len(tail) + len(copied)
                self.blocks_copied += len(copied)
        self.step += 1
        if self.trace is not None:
            self._write_trace(scheduler_output, managers, evicted)

    def _write_trace(self, scheduler_output: Any, managers: Any, evicted: int) -> None:
        assert self.trace is not None
        sched = self.scheduler
        pool = sched.kv_cache_manager.block_pool
        record = {
            "step": self.step, "time": time.time(), "running": len(sched.running),
            "waiting": len(sched.waiting), "free_blocks": pool.get_num_free_blocks(),
            "total_blocks": pool.num_gpu_blocks - 1, "evicted": evicted,
            "blocks_freed_total": self.blocks_freed, "blocks_copied_total": self.blocks_copied,
            # distinct blocks: under prefix caching several requests may hold the same block
            "held_blocks": len({id(b) for m in managers for bs in m.req_to_blocks.values() for b in bs}),
            "requests": len(sched.requests),
            "resumed": len(scheduler_output.scheduled_cached_reqs.resumed_req_ids),
            "scheduled_tokens": int(scheduler_output.total_num_scheduled_tokens),
            "hits_capped_total": self.hits_capped, "prefix_queried_total": self.prefix_queried,
            "prefix_hit_total": self.prefix_hit,
        }
        with open(self.trace, "a") as f:
            f.write(json.dumps(record) + "\n")


def init_scheduler(scheduler: Any) -> None:
    resolved = Resolved.from_additional_config(scheduler.vllm_config.additional_config)
    if resolved is None:
        return
    scheduler.__dict__["_kvpolicy"] = SchedulerEviction(scheduler, resolved)


def state_of(scheduler: Any) -> SchedulerEviction | None:
    return scheduler.__dict__.get("_kvpolicy")
