"""``speed``: decode throughput once the cache is in steady state, peak memory and KV-cache bytes
(the room the cache has, ``kv_mib``, and what it holds, ``kv_held_mib``: less under a threshold).
A two-tier policy (a ``recall`` block) also reports its tiers (``kvpolicy.eval.cost.TierCost``):
the most bytes the fast tier (kept slots, recall buffer, summaries) and the slow tier held, the
KiB moved from the slow tier to the fast one per decoded token, and the recall hit rate; other
policies report none of these, and the report shows no column for them.

With ``speed.batch`` 1, one sequence: ``context`` tokens fed (evicting as decoding would), then
``new_tokens`` greedy steps timed. Above 1, the throughput setting: ``batch`` rows of the same
prompt prefilled at once, then ``new_tokens`` steps each with no stopping (``generate_batch``),
with the share of decoding time spent in due evictions.
"""

from __future__ import annotations

from typing import Any

import torch

from ..cost import (
    TierCost,
    cache_bytes,
    cache_held_bytes,
    cache_tier_stats,
    peak_memory_mib,
    reset_peak_memory,
)
from ..decoding import Prompt, generate_batch, new_cache
from ..sampling import SamplingParams
from .base import Column, Metric, MetricResult, need_text, tier_columns


class Speed(Metric):
    """Decode throughput once the cache is in steady state, peak memory and KV-cache bytes."""

    name = "speed"
    help = "decode tokens/s, peak memory (RSS on CPU, allocated on GPU) and KV-cache bytes"
    columns = [
        Column("tokens_per_s", "tok/s", "{:.1f}", "higher"),
        Column("kv_mib", "KV MiB", "{:.2f}", "lower"),
        Column("kv_held_mib", "KV MiB held", "{:.2f}", "lower"),
        Column("peak_mib", "peak MiB", "{:.0f}", "lower"),
        *tier_columns(),
    ]

    def prepare(self, tokenizer, text, policies):
        s = self.config.speed
        need_text(text, s.context, "speed")
        self.ids = text[: s.context]

    def run(self, ctx, policy, reference):
        s = self.config.speed
        if s.batch > 1:
            return self._run_batched(ctx, policy)
        reset_peak_memory(ctx.device)
        stream = ctx.stream(policy)
        prefill = min(64, len(self.ids) - 1)
        stream.feed(self.ids[:prefill])
        logits = stream.feed(self.ids[prefill:])
        tiers_before = cache_tier_stats(stream.cache)
        tokens, seconds = stream.generate(logits, SamplingParams(max_new_tokens=s.new_tokens))
        forwards = max(len(tokens) - 1, 1)
        values = {
            "tokens_per_s": forwards / seconds if seconds > 0 else float("nan"),
            "kv_mib": cache_bytes(stream.cache) / 2**20,
            "kv_held_mib": cache_held_bytes(stream.cache) / 2**20,
            "peak_mib": peak_memory_mib(ctx.device),
        }
        tiers_now = cache_tier_stats(stream.cache)
        if tiers_now is not None:  # one row, whose tiers only grow: the last reading holds the most
            tiers = TierCost()
            tiers.held(tiers_before)
            tiers.held(tiers_now)
            tiers.spent(tiers_now, tiers_before, len(tokens) - 1)  # the timed decode steps
            values.update(tiers.values())
        return MetricResult(values)

    def _run_batched(self, ctx, policy):
        """``batch`` rows of the same prompt, prefilled at once, then ``new_tokens`` greedy steps each
        (no stopping): output tokens/s over the whole batch, as in the throughput setting."""
        s = self.config.speed
        reset_peak_memory(ctx.device)
        cache: Any = new_cache(ctx.model, policy, ctx.base_attn, independent_rows=True)
        params = SamplingParams(max_new_tokens=s.new_tokens, min_new_tokens=s.new_tokens)
        prompts = [Prompt(self.ids, key=r) for r in range(s.batch)]
        try:
            _, stats = generate_batch(ctx.model, cache, ctx.tokenizer, prompts, params, frozenset())
        except torch.cuda.OutOfMemoryError:
            # The full cache at long outputs: a finding, not a failure of the run.
            del cache
            torch.cuda.empty_cache()
            nan = float("nan")
            return MetricResult({"tokens_per_s": nan, "kv_mib": nan, "kv_held_mib": nan, "peak_mib": peak_memory_mib(ctx.device),
                                 "evict_share": None, "oom": True})
        decode = stats.seconds - stats.prefill_seconds
        steps = max(s.new_tokens - 1, 1)  # forwards after the prefill
        values = {
            "tokens_per_s": s.batch * steps / decode if decode > 0 else float("nan"),
            "kv_mib": stats.kv_bytes / 2**20,
            "kv_held_mib": stats.held_bytes / 2**20,
            "peak_mib": peak_memory_mib(ctx.device),
            "evict_share": stats.evict_seconds / decode if decode > 0 else None,
        }
        if stats.tiers is not None:
            values.update(stats.tiers.values())
        return MetricResult(values)
