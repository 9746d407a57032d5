"""The engine-core side: block accounting that follows each request's slots, not its tokens.

The scheduler replays the workers' ``SlotLedger`` (``kvpolicy.vllm.ledger``): after each step
(``Scheduler.update_from_output``, wrapped) a request that is due for eviction gives back the
blocks past its kept slots to vLLM's ``BlockPool``; and every later allocation for it
(``SingleTypeKVCacheManager.get_num_blocks_to_allocate`` / ``allocate_new_blocks``, wrapped)
counts its slots, ``num_computed_tokens`` minus the tokens evicted so far. A request's entry goes
when vLLM frees its blocks (finished, aborted or preempted). Each request runs its own policy's
schedule (``settings.request_policy``: its own, else the server's).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from ..schedule import Schedule
from .ledger import SlotLedger
from .settings import Resolved, request_policy

#: The ledger of this engine-core process (one scheduler per engine core), None when inactive.
_LEDGER: SlotLedger | None = None


def ledger() -> SlotLedger | None:
    return _LEDGER


class SchedulerEviction:
    def __init__(self, scheduler: Any, resolved: Resolved) -> None:
        global _LEDGER
        self.scheduler = scheduler
        self.resolved = resolved
        self.ledger = SlotLedger()
        self.schedules: dict[str | None, Schedule | None] = {}  # by resolved policy YAML
        _LEDGER = self.ledger
        self.trace = Path(resolved.trace) / f"scheduler-{os.getpid()}.jsonl" if resolved.trace else None
        if self.trace is not None:
            self.trace.parent.mkdir(parents=True, exist_ok=True)
        self.step = 0
        self.blocks_freed = 0

    def _schedule(self, request: Any) -> Schedule | None:
        r = request_policy(request.sampling_params.extra_args, self.resolved)
        if r.policy_yaml not in self.schedules:
            policy = r.policy()
            self.schedules[r.policy_yaml] = None if policy is None else policy.schedule
        return self.schedules[r.policy_yaml]

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
            kept = self.ledger.evicted(req_id)
            evicted += 1
            for mgr in managers:
                blocks = mgr.req_to_blocks.get(req_id)
                if not blocks:
                    continue
                keep = -(-kept // mgr.block_size)
                tail = blocks[keep:]
                del blocks[keep:]
                if tail:
                    mgr.block_pool.free_blocks(reversed(tail))
                    self.blocks_freed += len(tail)
        self.step += 1
        if self.trace is not None:
            pool = sched.kv_cache_manager.block_pool
            record = {
                "step": self.step, "time": time.time(), "running": len(sched.running),
                "waiting": len(sched.waiting), "free_blocks": pool.get_num_free_blocks(),
                "total_blocks": pool.num_gpu_blocks - 1, "evicted": evicted,
                "blocks_freed_total": self.blocks_freed,
                "held_blocks": sum(len(b) for m in managers for b in m.req_to_blocks.values()),
                "requests": len(sched.requests),
                "resumed": len(scheduler_output.scheduled_cached_reqs.resumed_req_ids),
                "scheduled_tokens": int(scheduler_output.total_num_scheduled_tokens),
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
