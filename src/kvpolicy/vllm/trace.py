"""A worker's eviction trace: a record of every eviction, and its first inputs, for parity checks.

Set by the server setting ``trace`` (a folder): each worker appends one JSON line per eviction to
``worker-<rank>-<pid>-<serial>.jsonl`` and saves the inputs of its first
``KVPOLICY_VLLM_TRACE_SAVES`` evictions (default 4) as ``evict-<rank>-<pid>-<serial>-<n>.pt``,
which the engine tests check against ``Policy.select`` on the same tensors. ``serial`` tells apart
the engines one process runs (vLLM's in-process engine core), which would otherwise write over
each other's saves.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
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
