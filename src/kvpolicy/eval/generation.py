"""Batched, seeded generation through a ``KVPolicyCache`` (or the full cache), row by row exact.

``generate_batch`` decodes a left-padded batch of prompts with one cache, the way
``model.generate`` does (2-D padding mask, position ids counted from each row's first real
token), with three differences that the reasoning protocol needs:

- **Sampling draws are per sample, not per batch.** Row ``r`` draws its token at step ``t`` by
  inverse-CDF sampling with one uniform number that is a pure function of ``(prompt.key, t)``
  (:func:`kvpolicy.seeds.uniform`, counter-based). A sample therefore gets the same tokens in
  any batch, at any batch position, on CPU or GPU (up to the logits' own float differences), and
  a resumed run regenerates exactly the samples it lost.
- **Finished rows leave the batch** (``cache.batch_select_indices``): a batch of long reasoning
  traces does not keep decoding padding for the rows that stopped early.
- **Cost is measured as it runs**: wall time, the time spent evicting (the cache executor's
  ``evict`` timed, synchronising the device only around real evictions) and the cache's bytes.

Stop rules, per row: an end-of-sequence token; a stop string in the *answer* (with a
``think_end`` marker such as ``</think>``, stop strings are only looked for after it: a
reasoning trace may contain "Question:" or a blank line); ``max_new_tokens``. None applies
before ``min_new_tokens`` (throughput runs set it to ``max_new_tokens``).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..seeds import combine, uniform
from .decoding import cache_argument, full_cache_bytes

SAMPLE_STREAM = "kvpolicy.eval.sample"


@dataclass(frozen=True)
class SamplingParams:
    """How to decode: greedy when ``temperature`` is 0, else temperature / top-k / top-p sampling."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    think_end: str | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def sampling(self) -> bool:
        return self.temperature > 0


@dataclass(frozen=True)
class Prompt:
    """One row to generate: its token ids, its sample key (the seed of its sampling draws), and
    whether it starts inside a reasoning trace (stop strings then wait for ``think_end``)."""

    ids: Sequence[int]
    key: int = 0
    thinking: bool = False


@dataclass
class Generation:
    """One finished row: ``index`` into the batch's prompts, the new tokens (the stop token
    included), why it stopped (``"eos"``, ``"stop"`` or ``"length"``) and when (seconds from the
    batch's start)."""

    index: int
    tokens: list[int]
    finish: str
    seconds: float

    @property
    def ended(self) -> bool:
        """It stopped by itself (end of sequence or a stop string), not at the token limit."""
        return self.finish != "length"


@dataclass
class BatchStats:
    """What one batch cost."""

    rows: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    evict_seconds: float | None = 0.0  # None: the cache offered nothing to time
    kv_bytes: int = 0  # the most the cache held at once
    evictions: int = 0

    def add(self, other: BatchStats) -> None:
        self.rows += other.rows
        self.prompt_tokens += other.prompt_tokens
        self.new_tokens += other.new_tokens
        self.seconds += other.seconds
        self.prefill_seconds += other.prefill_seconds
        if self.evict_seconds is None or other.evict_seconds is None:
            self.evict_seconds = None
        else:
            self.evict_seconds += other.evict_seconds
        self.kv_bytes = max(self.kv_bytes, other.kv_bytes)
        self.evictions += other.evictions


def sample_key(*parts: object) -> int:
    """A stable signed 64-bit key from any printable parts (e.g. seed, task, doc id, sample)."""
    digest = hashlib.blake2b(repr(parts).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


# -- one decoding step ----------------------------------------------------------------------------
def next_tokens(logits: torch.Tensor, params: SamplingParams, keys: torch.Tensor, step: int) -> torch.Tensor:
    """The next token of each row, ``[B]`` long, from ``logits [B, V]``.

    Greedy: ``argmax``. Sampling: temperature, then top-k, then top-p (the smallest set of most
    likely tokens whose mass reaches ``top_p``), then inverse-CDF sampling with the uniform
    number ``uniform(combine(keys[r], step))`` of row ``r``.
    """
    if not params.sampling:
        return logits.argmax(-1)
    x = logits.float() / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = x.topk(params.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs, order = torch.softmax(x, dim=-1).sort(dim=-1, descending=True)
    if params.top_p < 1.0:
        before = probs.cumsum(-1) - probs  # mass of the more likely tokens
        probs = probs.masked_fill(before >= params.top_p, 0.0)
    cdf = probs.double().cumsum(-1)
    u = uniform(combine(keys.to(cdf.device), step), (1,), SAMPLE_STREAM).double() * cdf[:, -1:]
    pick = torch.searchsorted(cdf, u).clamp_(max=vocab - 1)
    return order.gather(-1, pick).squeeze(-1)


@dataclass
class _RowState:
    answer_from: int | None  # where the answer starts; None while a ``think_end`` marker is awaited


class StopRule:
    """Decides, after each new token, whether a row is done (see the module docstring)."""

    def __init__(self, tokenizer: Any, eos_ids: Sequence[int] | frozenset[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.eos = frozenset(int(e) for e in eos_ids)
        self.params = params
        self.stop = tuple(s for s in params.stop if s)
        longest = max((len(s) for s in (*self.stop, params.think_end or "")), default=0)
        self.window = longest + 8  # tokens: a string of c characters spans at most c tokens

    def new_state(self, thinking: bool) -> _RowState:
        return _RowState(None if thinking and self.params.think_end else 0)

    def __call__(self, tokens: list[int], state: _RowState) -> str | None:
        n = len(tokens)
        p = self.params
        if n >= p.min_new_tokens:
            if tokens[-1] in self.eos:
                return "eos"
            if self.stop:
                if state.answer_from is None:
                    assert p.think_end is not None
                    if p.think_end in self._tail(tokens, 0):
                        state.answer_from = n
                elif any(s in self._tail(tokens, state.answer_from) for s in self.stop):
                    return "stop"
        if n >= p.max_new_tokens:
            return "length"
        return None

    def _tail(self, tokens: list[int], start: int) -> str:
        return self.tokenizer.decode(tokens[max(start, len(tokens) - self.window) :], skip_special_tokens=False)


# -- timing evictions ------------------------------------------------------------------------------
@dataclass
class _Timer:
    seconds: float | None = 0.0


@contextmanager
def eviction_timer(cache: Any, device: torch.device) -> Iterator[_Timer]:
    """Time the cache's evictions: wraps ``cache.evicting.executor.evict`` on this instance (the
    one place a ``KVPolicyCache`` evicts), synchronising the device around due evictions only.
    Yields a timer whose ``seconds`` is None when the cache has no such executor (full cache: 0)."""
    executor = getattr(getattr(cache, "evicting", None), "executor", None)
    if executor is None:  # the full cache never evicts
        yield _Timer(0.0)
        return
    original = getattr(executor, "evict", None)
    if original is None:
        yield _Timer(None)
        return
    timer = _Timer(0.0)

    def timed(group: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(group, "any_due", True):
            return original(group, *args, **kwargs)
        _sync(device)
        start = time.perf_counter()
        out = original(group, *args, **kwargs)
        _sync(device)
        assert timer.seconds is not None
        timer.seconds += time.perf_counter() - start
        return out

    executor.evict = timed
    try:
        yield timer
    finally:
        del executor.evict  # the class's method again


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cache_bytes(cache: Any) -> int:
    """Bytes the cache holds now: static buffers of a ``KVPolicyCache``, tensors of a ``DynamicCache``."""
    if hasattr(cache, "memory_bytes"):
        return int(cache.memory_bytes())
    return full_cache_bytes(cache)


def input_device(model: Any) -> torch.device:
    """Where the model takes its input ids (the embedding's device, also with ``device_map``)."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is not None and hasattr(emb, "weight"):
        return emb.weight.device
    return next(model.parameters()).device


# -- the batch ----------------------------------------------------------------------------------
@torch.inference_mode()
def generate_batch(
    model: Any,
    cache: Any,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    params: SamplingParams,
    eos_ids: Sequence[int] | frozenset[int],
    *,
    pad_id: int = 0,
    on_finish: Callable[[Generation], None] | None = None,
) -> tuple[list[Generation], BatchStats]:
    """Decode ``prompts`` as one left-padded batch through ``cache`` (fresh, built for ``model``).

    Returns one ``Generation`` per prompt (in prompt order) and the batch's ``BatchStats``.
    ``on_finish`` is called for each row as soon as it stops (to save it at once).
    """
    if not prompts:
        return [], BatchStats()
    if any(len(p.ids) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    device = input_device(model)
    b, width = len(prompts), max(len(p.ids) for p in prompts)
    total = width + params.max_new_tokens
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    mask = torch.zeros(b, total, dtype=torch.long)
    mask[:, width:] = 1
    for r, p in enumerate(prompts):
        ids[r, width - len(p.ids) :] = torch.as_tensor(list(p.ids), dtype=torch.long)
        mask[r, width - len(p.ids) : width] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask[:, :width].cumsum(-1) - 1).clamp_(min=0)
    next_pos = positions[:, -1] + 1
    keys = torch.tensor([p.key for p in prompts], dtype=torch.long, device=device)
    cache_kw = {cache_argument(model): cache}
    stop_rule = StopRule(tokenizer, eos_ids, params)
    states = [stop_rule.new_state(p.thinking) for p in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    active = list(range(b))
    done: dict[int, Generation] = {}
    stats = BatchStats(rows=b, prompt_tokens=sum(len(p.ids) for p in prompts))

    with eviction_timer(cache, device) as timer:
        _sync(device)
        start = time.perf_counter()
        out = model(input_ids=ids, attention_mask=mask[:, :width], position_ids=positions,
                    use_cache=True, logits_to_keep=1, **cache_kw)
        logits = out.logits[:, -1, :]
        seen = width
        stats.kv_bytes = cache_bytes(cache)
        _sync(device)
        stats.prefill_seconds = time.perf_counter() - start
        for step in range(params.max_new_tokens):
            chosen = next_tokens(logits, params, keys, step)
            finished = []
            for j, (row, tok) in enumerate(zip(active, chosen.tolist(), strict=True)):
                tokens[row].append(int(tok))
                reason = stop_rule(tokens[row], states[row])
                if reason is not None:
                    gen = Generation(row, tokens[row], reason, time.perf_counter() - start)
                    done[row] = gen
                    finished.append(j)
                    if on_finish is not None:
                        on_finish(gen)
            if len(finished) == len(active):
                break
            if finished:
                stats.kv_bytes = max(stats.kv_bytes, cache_bytes(cache))
                gone = set(finished)
                keep = [j for j in range(len(active)) if j not in gone]
                index = torch.tensor(keep, dtype=torch.long, device=device)
                cache.batch_select_indices(index)
                mask, next_pos, keys, chosen = mask[index], next_pos[index], keys[index], chosen[index]
                active = [active[j] for j in keep]
            seen += 1
            out = model(input_ids=chosen[:, None], attention_mask=mask[:, :seen], position_ids=next_pos[:, None],
                        use_cache=True, logits_to_keep=1, **cache_kw)
            logits = out.logits[:, -1, :]
            next_pos = next_pos + 1
        stats.kv_bytes = max(stats.kv_bytes, cache_bytes(cache))
        _sync(device)
        stats.seconds = time.perf_counter() - start
    stats.evict_seconds = timer.seconds
    stats.new_tokens = sum(len(t) for t in tokens)
    if hasattr(cache, "stats"):
        stats.evictions = sum(s.evictions for s in cache.stats())
    return [done[r] for r in range(b)], stats


@dataclass
class CostTracker:
    """Sums ``BatchStats`` over a run and reads the device's peak memory."""

    device: torch.device
    total: BatchStats = field(default_factory=BatchStats)

    def reset(self) -> None:
        from .suites import reset_peak_memory

        self.total = BatchStats()
        reset_peak_memory(str(self.device))

    def add(self, stats: BatchStats) -> None:
        self.total.add(stats)

    def summary(self) -> dict[str, float | None]:
        from .suites import peak_memory_mib

        t = self.total
        evict = t.evict_seconds
        return {
            "tokens_per_s": t.new_tokens / t.seconds if t.seconds > 0 else float("nan"),
            "peak_mib": peak_memory_mib(str(self.device)),
            "kv_mib": t.kv_bytes / 2**20,
            "evict_share": (evict / t.seconds if t.seconds > 0 else float("nan")) if evict is not None else None,
            "new_tokens": t.new_tokens,
            "seconds": t.seconds,
        }
