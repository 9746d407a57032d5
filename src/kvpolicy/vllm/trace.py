"""The traces: a worker's record of every eviction, and its first inputs, for parity checks; the
engine core's record of every step (``SchedulerTrace``).

Set by the server setting ``trace`` (a folder): each worker appends one JSON line per eviction to
``worker-<rank>-<pid>-<serial>.jsonl`` and saves the inputs of its first
``KVPOLICY_VLLM_TRACE_SAVES`` evictions (default 4) as ``evict-<rank>-<pid>-<serial>-<n>.pt``,
which the engine tests check against ``Policy.select`` on the same tensors. ``serial`` tells apart
the engines one process runs (vLLM's in-process engine core), which would otherwise write over
each other's saves.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import operator
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..stages.base import EvictionInput

_SERIAL = itertools.count()


def trace_stem(kind: str) -> str:
    """A trace file's name without suffix, ``<kind>-<pid>-<serial>``: one per trace writer of the
    process, so engines run one after another in one process never share a file."""
    return f"{kind}-{os.getpid()}-{next(_SERIAL)}"


class EvictionTrace:
    """The trace folder of one worker (tensor-parallel ``rank``)."""

    def __init__(self, folder: Path, rank: int) -> None:
        self.folder, self.rank, self.saves = folder, rank, 0
        # read when the trace starts, so a process that set it after importing kvpolicy is heard
        self.save_limit = int(os.environ.get("KVPOLICY_VLLM_TRACE_SAVES", "4"))
        self.stem = trace_stem(str(rank))
        folder.mkdir(parents=True, exist_ok=True)

    def record(self, entry: dict[str, Any]) -> None:
        with open(self.folder / f"worker-{self.stem}.jsonl", "a") as f:
            f.write(json.dumps(entry) + "\n")

    def save_input(self, inp: EvictionInput, **choice: Any) -> None:
        """An eviction's input and what it kept (``choice``: the kept slots, the requests, the seed,
        the policy...), while fewer than ``save_limit`` are saved."""
        if self.saves < self.save_limit:
            self.saves += 1
            key = inp.seed_key
            tensors = {"keys": inp.keys, "values": inp.values, "queries": inp.queries, "query_valid": inp.query_valid,
                       "positions": inp.positions, "layer_idx": None if key is None else key.layer_idx,
                       "evictions": None if key is None else key.evictions, "slot_valid": inp.slot_valid, **choice}
            torch.save(tensors, self.folder / f"evict-{self.stem}-{self.saves}.pt")


    def eviction(self, *, step: int, head_offset: int, layers: list[int], resolved: Any, states: list[Any],
                 requests: list[str], slots_before: int, inp: EvictionInput, kept: torch.Tensor,
                 counts: torch.Tensor | None, held: list[torch.Tensor]) -> None:
        """One eviction of ``requests`` (their ledger entries ``states`` after it; ``held``: each
        one's kept token positions per layer, head and slot): a JSON line, and its input saved."""
        entry = states[0]
        self.record({
            "step": step, "rank": self.rank, "head_offset": head_offset, "layers": layers, "policy": resolved.source,
            "budget": None if entry.schedule is None else entry.schedule.budget,  # its layer's, when decided from its prompt
            "requests": requests, "slots_before": slots_before,
            "kept": int(kept.shape[-1]) if counts is None else entry.held,
            "head_counts": None if counts is None else counts.view(len(layers), len(requests), -1).transpose(0, 1).tolist(),
            "tokens": [s.tokens for s in states], "evictions_after": [s.evictions for s in states],
            "kept_digest": [digest(p) for p in held],  # what each request's cache holds after this eviction
        })
        self.save_input(inp, kept=kept, requests=requests, seed=resolved.seed, policy_yaml=resolved.policy_yaml,
                        head_offset=head_offset, head_counts=counts)


def digest(t: torch.Tensor) -> str:
    """A short digest of an integer tensor (what a request's cache holds: its kept token positions)."""
    return hashlib.sha1(t.to(torch.int64).cpu().numpy().tobytes()).hexdigest()[:16]


_IS_NULL = operator.attrgetter("is_null")  # vLLM's KVCacheBlock.is_null


@dataclass
class SchedulerCounts:
    """Running totals the scheduler keeps for its trace (``SchedulerTrace``: ``<name>_total``)."""

    blocks_freed: int = 0  # blocks given back to the pool past the kept slots, and copied-from ones
    blocks_copied: int = 0  # fresh blocks compaction wrote instead of cached ones
    hits_capped: int = 0  # prefix-cache hits shortened to keep a query window computed
    prefix_queried: int = 0  # prompt tokens looked up in the prefix cache (new requests)
    prefix_hit: int = 0  # of which found there
    preempted: int = 0  # requests preempted (with a schedule)
    preempted_after_evicting: int = 0
    replay_cuts: int = 0  # steps of a request cut to end at its eviction point (vLLM may ask again)


class SchedulerTrace:
    """The engine core's trace: one JSON line per step, ``scheduler-<pid>-<serial>.jsonl`` in the
    trace folder, with the pool's use, each KV-cache group's and each request's blocks, and the
    scheduler's ``SchedulerCounts``. A step's evicting requests are noted when it is scheduled
    (``scheduled``) and written with the rest when its output is back (``write``): under async
    scheduling a few steps are in flight."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"{trace_stem('scheduler')}.jsonl"
        self.pending: list[tuple[Any, int]] = []  # (scheduler output, requests evicting), the last 8

    def scheduled(self, scheduler_output: Any, evicted: int) -> None:
        self.pending = [*self.pending[-7:], (scheduler_output, evicted)]

    def write(self, scheduler: Any, scheduler_output: Any, step: int, counts: SchedulerCounts) -> None:
        """The record of the step whose output just came back, read from vLLM's ``scheduler``."""
        evicted = 0
        for i, (out, n) in enumerate(self.pending):
            if out is scheduler_output:
                evicted = n
                del self.pending[i]
                break
        managers = scheduler.kv_cache_manager.coordinator.single_type_managers
        pool = scheduler.kv_cache_manager.block_pool
        # One pass over every group's blocks (distinct blocks: under prefix caching several requests
        # may hold the same block; a request's count leaves out the null block, which is no block).
        group_ids: list[set[int]] = []
        held: collections.Counter[str] = collections.Counter()
        for m in managers:
            ids: set[int] = set()
            for r, blocks in m.req_to_blocks.items():
                ids.update(map(id, blocks))
                held[r] += len(blocks) - sum(map(_IS_NULL, blocks))
            group_ids.append(ids)
        record = {
            "step": step, "time": time.time(), "running": len(scheduler.running),
            "waiting": len(scheduler.waiting), "free_blocks": pool.get_num_free_blocks(),
            "total_blocks": pool.num_gpu_blocks - 1, "evicted": evicted,
            "held_blocks": len(set().union(*group_ids)),
            # per KV-cache group (a layer's, under per-layer budgets): blocks its requests hold
            "group_blocks": [len(ids) for ids in group_ids],
            # per running request: blocks held in all its groups
            "request_blocks": {r: held[r] for r in scheduler.requests},
            "requests": len(scheduler.requests),
            "resumed": len(scheduler_output.scheduled_cached_reqs.resumed_req_ids),
            "scheduled_tokens": int(scheduler_output.total_num_scheduled_tokens),
            **{f"{name}_total": value for name, value in asdict(counts).items()},
            "async": bool(scheduler.scheduler_config.async_scheduling),
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
