"""Decoding a causal LM through a cache: one loop for every metric and the lm-eval model.

Two ways in, one decoding loop (``decode``) and one sampling path (:mod:`.sampling`):

- ``Stream``: one sequence (batch 1) through a fresh cache. ``Stream.feed`` appends text in
  chunks that end exactly where token-by-token decoding would evict, so it evicts the same slots
  and is far faster: eviction fires after an append that leaves a layer with ``L > budget`` slots
  and the counted length a multiple of ``interval``, so a multi-token chunk after the prompt
  evicts only if it *ends* on such a point; ``feed`` asks the cache how many tokens remain to its
  next eviction (``EvictingCache.tokens_to_next_eviction``) and ends each chunk there.
  ``Stream.generate`` then decodes token by token.
- ``generate_batch``: a left-padded batch of prompts, prefilled at once and decoded together the
  way ``model.generate`` does (2-D padding mask, position ids counted from each row's first real
  token). Finished rows leave the batch (``cache.batch_select_indices``), so a batch of long
  reasoning traces does not keep decoding padding for the rows that stopped early; its cost
  (wall time, time in due evictions, the most KV bytes held; a two-tier policy's tiers and the
  bytes it moved) is measured as it runs (:mod:`.cost`).

Per step, ``decode`` picks every active row's token (``next_tokens``: greedy, or seeded per
sample), asks the ``StopRule`` which rows are done, drops them, and feeds the rest one token.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from ..policy import Policy
from .cost import BatchStats, PolicyTimer, cache_tier_stats, sync, time_policy
from .sampling import SamplingParams, StopRule, next_tokens

if TYPE_CHECKING:
    from transformers import DynamicCache

    from ..hf import KVPolicyCache

MAX_CHUNK = 256


# -- the model and its cache ------------------------------------------------------------------------
def cache_argument(model: Any) -> str:
    """``cache`` from transformers 5.24 on, ``past_key_values`` before (still accepted, deprecated)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def input_device(model: Any) -> torch.device:
    """Where the model takes its input ids (the embedding's device, also with ``device_map``)."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is not None and hasattr(emb, "weight"):
        return emb.weight.device
    return next(model.parameters()).device


def new_cache(
    model: Any, policy: Policy | None, base_attn: str = "sdpa", *, seed: int | None = None,
    independent_rows: bool = False,
) -> DynamicCache | KVPolicyCache:
    """A fresh cache for ``model``: the policy's ``KVPolicyCache`` (``seed`` and
    ``independent_rows`` as there), or for ``policy=None`` the full cache, a ``DynamicCache``
    with the model set back to its own attention kernel ``base_attn``."""
    if policy is None:
        from transformers import DynamicCache

        if model.config._attn_implementation != base_attn:
            model.set_attn_implementation(base_attn)
        return DynamicCache(config=model.config)
    from ..hf import KVPolicyCache

    return KVPolicyCache(policy, model, seed=seed, independent_rows=independent_rows)


def stop_token_ids(tokenizer: Any, model: Any) -> frozenset[int]:
    """Every end-of-sequence id the model, its generation config or the tokenizer declares."""
    ids = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list | tuple):
            ids.update(int(e) for e in eos)
    for name in ("<|im_end|>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(name) if hasattr(tokenizer, "convert_tokens_to_ids") else None
        if isinstance(tid, int) and tid != getattr(tokenizer, "unk_token_id", None):
            ids.add(tid)
    return frozenset(ids)


# -- the decoding loop ----------------------------------------------------------------------------------
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


class Rows(Protocol):
    """What ``decode`` feeds: rows decoding together through one cache."""

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one token per active row (``tokens [R]``); return the next logits ``[R, V]``."""
        ...

    def keep(self, index: torch.Tensor) -> None:
        """Only the active rows at ``index [R']`` (long) go on."""
        ...


def decode(
    rows: Rows,
    logits: torch.Tensor,
    params: SamplingParams,
    keys: torch.Tensor,
    stop_rule: StopRule,
    thinking: Sequence[bool],
    *,
    start: float,
    on_finish: Callable[[Generation], None] | None = None,
) -> list[Generation]:
    """Decode from ``logits [B, V]`` (after each row's prompt) until every row stops.

    ``keys [B]`` are the rows' sample keys; ``thinking[r]``: row ``r`` starts inside a reasoning
    trace; ``start`` is the ``time.perf_counter()`` that ``Generation.seconds`` counts from.
    ``on_finish`` is called for each row as soon as it stops. Returns one ``Generation`` per row.
    """
    states = [stop_rule.new_state(t) for t in thinking]
    tokens: list[list[int]] = [[] for _ in thinking]
    active = list(range(len(thinking)))
    done: dict[int, Generation] = {}
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
            gone = set(finished)
            index = torch.tensor([j for j in range(len(active)) if j not in gone], dtype=torch.long,
                                 device=keys.device)
            rows.keep(index)
            keys, chosen = keys[index], chosen[index]
            active = [active[j] for j in index.tolist()]
        logits = rows.step(chosen)
    return [done[r] for r in range(len(thinking))]  # the last step stops every row ("length")


# -- one sequence ---------------------------------------------------------------------------------
class Stream:
    """One sequence decoded by ``model`` through a fresh cache (``new_cache``): the policy's
    ``KVPolicyCache``, or a ``DynamicCache`` for the full-cache baseline (``policy=None``).

    Chunks end where the cache says its next eviction falls.
    """

    def __init__(self, model: Any, policy: Policy | None, base_attn: str = "sdpa") -> None:
        self.model = model
        self.policy = policy
        self.cache = new_cache(model, policy, base_attn)  # a KVPolicyCache exactly when policy is set
        self._cache_arg = cache_argument(model)
        self.seen = 0
        self.device = next(model.parameters()).device

    def next_chunk(self, remaining: int, max_chunk: int = MAX_CHUNK) -> int:
        """The next chunk's size: never past the cache's next eviction point, nor ``max_chunk``."""
        size = min(remaining, max_chunk)
        if self.policy is not None:
            evicting = cast("KVPolicyCache", self.cache).evicting
            evicting.evict_due()  # what the chunk's first append would do; then the count is exact
            size = min(size, evicting.tokens_to_next_eviction() or size)
        return size

    def evictions(self) -> int:
        """Evictions summed over layers (0 for the full cache)."""
        if self.policy is None:
            return 0
        return sum(s.evictions for s in cast("KVPolicyCache", self.cache).stats())

    def _forward(self, ids: list[int] | torch.Tensor, all_logits: bool) -> torch.Tensor:
        x = torch.as_tensor(ids, dtype=torch.long, device=self.device).view(1, -1)
        kwargs = {self._cache_arg: self.cache, "logits_to_keep": 0 if all_logits else 1}
        out = self.model(input_ids=x, use_cache=True, **kwargs)
        self.seen += x.shape[1]
        return out.logits[0].float()

    @torch.inference_mode()
    def feed(
        self,
        ids: list[int],
        on_logits: Callable[[int, torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Append ``ids`` (the first call is the prompt, one chunk; later ones in exact chunks).

        ``on_logits(offset, logits [T, V])`` receives every chunk's logits (offset into ``ids``).
        Returns the logits after the last token ``[V]``.
        """
        if not ids:
            raise ValueError("nothing to feed")
        offset, last = 0, None
        while offset < len(ids):
            size = len(ids) if self.seen == 0 else self.next_chunk(len(ids) - offset)
            logits = self._forward(ids[offset : offset + size], on_logits is not None)
            if on_logits is not None:
                on_logits(offset, logits)
            last = logits[-1]
            offset += size
        return cast(torch.Tensor, last)  # ids is not empty: the loop ran

    # ``Rows``, for ``decode``: one row that never leaves (it stops the loop when it stops).
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._forward(tokens, False)

    def keep(self, index: torch.Tensor) -> None:
        raise AssertionError("a single row never leaves a running decode")

    @torch.inference_mode()
    def generate(
        self,
        logits: torch.Tensor,
        params: SamplingParams,
        stop_ids: set[int] | frozenset[int] = frozenset(),
        *,
        key: int = 0,
    ) -> tuple[list[int], float]:
        """Decode token by token from ``logits [V]`` (after ``feed``) under ``params`` (no stop
        strings), drawing with the sample key ``key`` when sampling.

        Returns the new tokens (the stop token included) and the decode time in seconds.
        """
        start = time.perf_counter()
        keys = torch.tensor([key], dtype=torch.long, device=logits.device)
        (gen,) = decode(self, logits[None], params, keys, StopRule(None, stop_ids, params), [False], start=start)
        sync(self.device)
        return gen.tokens, time.perf_counter() - start


# -- a batch ----------------------------------------------------------------------------------------
class _Batch:
    """Left-padded rows decoding together: the padding mask and each row's next position."""

    def __init__(self, model: Any, cache: Any, mask: torch.Tensor, next_pos: torch.Tensor, seen: int,
                 stats: BatchStats) -> None:
        self.model, self.cache, self.stats = model, cache, stats
        self.mask, self.next_pos, self.seen = mask, next_pos, seen
        self.cache_kw = {cache_argument(model): cache}

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        out = self.model(input_ids=tokens[:, None], attention_mask=self.mask[:, : self.seen],
                         position_ids=self.next_pos[:, None], use_cache=True, logits_to_keep=1, **self.cache_kw)
        self.next_pos = self.next_pos + 1
        return out.logits[:, -1, :]

    def keep(self, index: torch.Tensor) -> None:
        self.stats.hold(self.cache)  # the most held, before rows leave
        self.cache.batch_select_indices(index)
        self.mask, self.next_pos = self.mask[index], self.next_pos[index]


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
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    mask = torch.zeros(b, width + params.max_new_tokens, dtype=torch.long)
    mask[:, width:] = 1
    for r, p in enumerate(prompts):
        ids[r, width - len(p.ids) :] = torch.as_tensor(list(p.ids), dtype=torch.long)
        mask[r, width - len(p.ids) : width] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask[:, :width].cumsum(-1) - 1).clamp_(min=0)
    keys = torch.tensor([p.key for p in prompts], dtype=torch.long, device=device)
    stats = BatchStats(rows=b, prompt_tokens=sum(len(p.ids) for p in prompts))
    tiers_before = cache_tier_stats(cache)  # a two-tier policy's counters (None: one tier)

    with time_policy(cache, PolicyTimer(device, kinds=("evict",))) as timer:
        sync(device)
        start = time.perf_counter()
        out = model(input_ids=ids, attention_mask=mask[:, :width], position_ids=positions,
                    use_cache=True, logits_to_keep=1, **{cache_argument(model): cache})
        stats.hold(cache)
        sync(device)
        stats.prefill_seconds = time.perf_counter() - start
        rows = _Batch(model, cache, mask, positions[:, -1] + 1, width, stats)
        gens = decode(rows, out.logits[:, -1, :], params, keys, StopRule(tokenizer, eos_ids, params),
                      [p.thinking for p in prompts], start=start, on_finish=on_finish)
        stats.hold(cache)
        sync(device)
        stats.seconds = time.perf_counter() - start
    stats.evict_seconds = timer.seconds["evict"]
    stats.new_tokens = sum(len(g.tokens) for g in gens)
    tiers_now = cache_tier_stats(cache)
    if stats.tiers is not None and tiers_now is not None:  # each row fed all its tokens but its last
        stats.tiers.spent(tiers_now, tiers_before, stats.new_tokens - len(gens))
    if hasattr(cache, "stats"):
        stats.evictions = sum(s.evictions for s in cache.stats())
    return gens, stats
