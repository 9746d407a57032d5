"""What a run costs: KV-cache bytes, peak memory, and the time spent in the policy.

One function per measure, shared by the metrics, the decoding loop, the lm-eval model and the
benchmarks:

- ``cache_bytes``: the bytes a cache has room for now (static buffers and query windows of a
  ``KVPolicyCache``; the grown key/value tensors of a ``DynamicCache``);
- ``cache_held_bytes``: of those, the bytes holding tokens (``KVPolicyCache.held_bytes``: under a
  threshold or a per-head allocation heads hold fewer slots than the room they have);
- ``cache_tier_stats`` / ``TierCost``: a two-tier policy's tiers (``kvpolicy.tiers.TierStats``),
  read at the same points as the bytes held: the most each tier held, the bytes moved from the
  slow tier to the fast one per decoded token, the recall hit rate (None for any other cache);
- ``reset_peak_memory`` / ``peak_memory_mib``: the CUDA allocator's peak on a GPU, the process's
  resident high-water mark on the CPU;
- ``PolicyTimer`` / ``time_policy``: seconds spent in the policy's work, through the executor's
  timing hook (``kvpolicy.executor.Executor.timer``); ``runs_policy`` tells kvpolicy's caches
  from the full cache, ``executor_of`` finds a policy cache's executor (or refuses);
- ``BatchStats`` / ``CostTracker``: what one decoded batch cost, summed over a run.
"""

from __future__ import annotations

import platform
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..executor import Executor
    from ..tiers import TierStats

KINDS = ("evict", "select")


# -- memory ---------------------------------------------------------------------------------------
def cache_bytes(cache: Any) -> int:
    """Bytes the cache holds now: ``memory_bytes()`` of a ``KVPolicyCache`` (static buffers and
    query windows), else the key and value tensors of every layer (a ``DynamicCache``)."""
    if hasattr(cache, "memory_bytes"):
        return int(cache.memory_bytes())
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def cache_held_bytes(cache: Any) -> int:
    """Bytes of what the cache holds now: ``held_bytes()`` of a ``KVPolicyCache`` (slot buffers
    counted where a slot holds a token of a head), else ``cache_bytes`` (a ``DynamicCache`` holds
    exactly its tensors)."""
    if hasattr(cache, "held_bytes"):
        return int(cache.held_bytes())
    return cache_bytes(cache)


def cache_tier_stats(cache: Any) -> TierStats | None:
    """A two-tier policy's tiers now (``tier_stats()`` of a ``KVPolicyCache`` or an
    ``EvictingCache``); None for a policy without a ``recall`` block and for the full cache."""
    read = getattr(cache, "tier_stats", None)
    return None if read is None else read()


@dataclass
class TierCost:
    """What a two-tier cache's tiers cost over a batch or a run, from ``TierStats`` readings
    taken where the memory figures are read: the most bytes each tier held at once (the fast
    tier: kept slots, recall buffer and summaries), and the counters (bytes moved each way, pages
    recalled, hits, pages dropped) with the decoded tokens they were spent on, summed."""

    fast_bytes: int = 0  # the most held at once
    slow_bytes: int = 0
    moved_bytes: int = 0  # slow tier -> recall buffer
    written_bytes: int = 0  # evicted pages, fast tier -> slow tier
    pages_recalled: int = 0  # hits included
    hits: int = 0
    pages_dropped: int = 0
    decode_tokens: int = 0  # row-tokens decoded one at a time (what the moved bytes are per)

    def held(self, now: TierStats | None) -> None:
        """Raise the peaks to a reading ``now``."""
        if now is not None:
            self.fast_bytes = max(self.fast_bytes, now.fast_bytes)
            self.slow_bytes = max(self.slow_bytes, now.slow_bytes)

    def spent(self, now: TierStats, since: TierStats | None, decode_tokens: int) -> None:
        """Add the counters between two readings (``since`` None: the cache's start) and the
        ``decode_tokens`` decoded between them."""
        for name in ("moved_bytes", "written_bytes", "pages_recalled", "hits", "pages_dropped"):
            before = 0 if since is None else getattr(since, name)
            setattr(self, name, getattr(self, name) + getattr(now, name) - before)
        self.decode_tokens += decode_tokens

    def add(self, other: TierCost) -> None:
        self.fast_bytes = max(self.fast_bytes, other.fast_bytes)
        self.slow_bytes = max(self.slow_bytes, other.slow_bytes)
        for name in ("moved_bytes", "written_bytes", "pages_recalled", "hits", "pages_dropped", "decode_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def moved_per_token(self) -> float:
        """Bytes moved from the slow tier to the fast one per decoded token (NaN: none decoded)."""
        return self.moved_bytes / self.decode_tokens if self.decode_tokens else float("nan")

    @property
    def hit_rate(self) -> float:
        """Recalled pages that were in the recall buffer already (NaN: no page recalled)."""
        return self.hits / self.pages_recalled if self.pages_recalled else float("nan")

    def values(self, prefix: str = "") -> dict[str, float | int]:
        """The figures a run reports (``prefix`` + ``fast_mib``, ``slow_mib``, ``moved_kib_tok``,
        ``hit_rate``: the tier columns; the counters beside them)."""
        return {
            f"{prefix}fast_mib": self.fast_bytes / 2**20,
            f"{prefix}slow_mib": self.slow_bytes / 2**20,
            f"{prefix}moved_kib_tok": self.moved_per_token / 2**10,
            f"{prefix}hit_rate": self.hit_rate,
            f"{prefix}moved_bytes": self.moved_bytes,
            f"{prefix}written_bytes": self.written_bytes,
            f"{prefix}pages_recalled": self.pages_recalled,
            f"{prefix}recall_hits": self.hits,
            f"{prefix}pages_dropped": self.pages_dropped,
            f"{prefix}decode_tokens": self.decode_tokens,
        }


def reset_peak_memory(device: str) -> None:
    """Reset the peak-memory counter (CUDA allocator, or the process's VmHWM on Linux)."""
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # not Linux, or not allowed: the peak then covers the whole process


def peak_memory_mib(device: str) -> float:
    """Peak memory since the last reset: allocated on CUDA, resident (RSS) on the CPU."""
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if platform.system() == "Darwin" else peak / 1024


# -- time in the policy -------------------------------------------------------------------------------
def sync(device: torch.device | None) -> None:
    """Wait for the device's queued work (CUDA), so that a wall-clock reading covers it."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


class PolicyTimer:
    """Seconds and calls of the policy's work, by kind: ``"evict"`` (a due eviction of a layer
    group) and ``"select"`` (one layer's selection in select mode).

    An ``Executor.timer``: the executor calls it around that work. Only the kinds in ``kinds``
    are timed (the others run untouched), and the device is synchronised before and after each
    timed call only, so timing due evictions leaves every other decoding step asynchronous.
    """

    def __init__(self, device: torch.device | None = None, kinds: tuple[str, ...] = KINDS) -> None:
        unknown = set(kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown kind(s) of policy work {sorted(unknown)}; known: {', '.join(KINDS)}")
        self.device = device
        self.kinds = kinds
        self.seconds = dict.fromkeys(KINDS, 0.0)
        self.calls = dict.fromkeys(KINDS, 0)

    def __call__(self, kind: str) -> Any:
        if kind not in self.kinds:
            return nullcontext()
        return self._timed(kind)

    @contextmanager
    def _timed(self, kind: str) -> Iterator[None]:
        sync(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            sync(self.device)
            self.seconds[kind] += time.perf_counter() - start
            self.calls[kind] += 1

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


def _is_kvpolicy_cache(cache: Any) -> bool:
    from ..hf.cache import KVPolicyCache  # here: transformers is imported only when a cache needs it

    return isinstance(cache, KVPolicyCache)


def runs_policy(cache: Any) -> bool:
    """Whether ``cache`` runs a policy: True for kvpolicy's caches (``KVPolicyCache``,
    ``EvictingCache``), False for transformers' own (``DynamicCache``, ``StaticCache``: the full
    cache). Anything else is a TypeError: what it does is not known, so its cost is not either."""
    from ..evicting import EvictingCache

    if isinstance(cache, EvictingCache) or _is_kvpolicy_cache(cache):
        return True
    from transformers.cache_utils import Cache

    if isinstance(cache, Cache):
        return False
    raise TypeError(
        f"cannot tell whether a {type(cache).__name__} runs a policy: expected a KVPolicyCache or an "
        "EvictingCache (a policy), or a transformers Cache such as DynamicCache (the full cache)"
    )


def executor_of(cache: Any) -> Executor:
    """The ``Executor`` that runs the policy of ``cache``: ``cache.evicting.executor`` of a
    ``KVPolicyCache``, ``cache.executor`` of an ``EvictingCache``. Anything else, the full cache
    included, is a TypeError naming what was looked for: a cache without a policy is told apart
    by ``runs_policy``, never by an attribute that is not there."""
    from ..evicting import EvictingCache
    from ..executor import Executor

    if isinstance(cache, EvictingCache):
        where, found = "executor", getattr(cache, "executor", None)
    elif _is_kvpolicy_cache(cache):
        where = "evicting.executor"
        found = getattr(getattr(cache, "evicting", None), "executor", None)
    else:
        raise TypeError(f"a {type(cache).__name__} has no policy executor: it is looked for as "
                        "`.evicting.executor` of a KVPolicyCache or `.executor` of an EvictingCache")
    if not isinstance(found, Executor):
        got = "missing" if found is None else f"a {type(found).__name__}"
        raise TypeError(f"{type(cache).__name__}.{where} is {got}, not the Executor that runs its policy")
    return found


@contextmanager
def time_policy(cache: Any, timer: PolicyTimer) -> Iterator[PolicyTimer]:
    """Install ``timer`` as the hook of the executor of ``cache`` (``executor_of``) for the block.
    The full cache (a transformers cache, ``runs_policy`` False) runs no policy: the timer then
    stays at zero. A cache that is neither is a TypeError."""
    if not runs_policy(cache):
        yield timer
        return
    executor = executor_of(cache)
    if executor.timer is not None:
        raise RuntimeError("this cache's executor already has a timer")
    executor.timer = timer
    try:
        yield timer
    finally:
        executor.timer = None


# -- per batch, per run ---------------------------------------------------------------------------
@dataclass
class BatchStats:
    """What one batch cost."""

    rows: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    evict_seconds: float = 0.0  # in due evictions (the executor's timing hook)
    kv_bytes: int = 0  # the most room the cache had at once (cache_bytes)
    held_bytes: int = 0  # the most it held at once (cache_held_bytes), at the same points
    evictions: int = 0
    tiers: TierCost | None = None  # a two-tier policy's (cache_tier_stats), at the same points

    def hold(self, cache: Any) -> None:
        """Raise the most bytes held (the room, what is held, each tier's) to the cache's now."""
        self.kv_bytes = max(self.kv_bytes, cache_bytes(cache))
        self.held_bytes = max(self.held_bytes, cache_held_bytes(cache))
        now = cache_tier_stats(cache)
        if now is not None:
            if self.tiers is None:
                self.tiers = TierCost()
            self.tiers.held(now)

    def add(self, other: BatchStats) -> None:
        self.rows += other.rows
        self.prompt_tokens += other.prompt_tokens
        self.new_tokens += other.new_tokens
        self.seconds += other.seconds
        self.prefill_seconds += other.prefill_seconds
        self.evict_seconds += other.evict_seconds
        self.kv_bytes = max(self.kv_bytes, other.kv_bytes)
        self.held_bytes = max(self.held_bytes, other.held_bytes)
        self.evictions += other.evictions
        if other.tiers is not None:
            if self.tiers is None:
                self.tiers = TierCost()
            self.tiers.add(other.tiers)


@dataclass
class CostTracker:
    """Sums ``BatchStats`` over a run and reads the device's peak memory."""

    device: torch.device
    total: BatchStats = field(default_factory=BatchStats)

    def reset(self) -> None:
        self.total = BatchStats()
        reset_peak_memory(str(self.device))

    def add(self, stats: BatchStats) -> None:
        self.total.add(stats)

    def summary(self) -> dict[str, float | None]:
        """The run's cost; a two-tier policy's tier figures too (``TierCost.values``). When nothing
        was generated (every sample recorded by an earlier session) nothing was measured: every
        figure but the counts is NaN, never the zero of an empty total or an idle process's peak."""
        t = self.total
        if not t.new_tokens:
            nan = float("nan")
            return {"tokens_per_s": nan, "peak_mib": nan, "kv_mib": nan, "kv_held_mib": nan, "evict_share": nan,
                    "new_tokens": t.new_tokens, "seconds": t.seconds}
        out: dict[str, float | None] = {
            "tokens_per_s": t.new_tokens / t.seconds if t.seconds > 0 else float("nan"),
            "peak_mib": peak_memory_mib(str(self.device)),
            "kv_mib": t.kv_bytes / 2**20,
            "kv_held_mib": t.held_bytes / 2**20,
            "evict_share": t.evict_seconds / t.seconds if t.seconds > 0 else float("nan"),
            "new_tokens": t.new_tokens,
            "seconds": t.seconds,
        }
        if t.tiers is not None:
            out.update(t.tiers.values())
        return out
