"""``perplexity``: streaming perplexity of a long text under eviction, and its ratio to the full cache.

The text's first ``prefill`` tokens are the prompt; the rest is fed in chunks that end exactly
where token-by-token decoding evicts (``Stream.feed``), so every logit is the one decoding would
see.
"""

from __future__ import annotations

import math

import torch

from ..config import EvalError
from .base import Column, Metric, MetricResult, max_budget, need_text


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of each target: ``logits [T, V]`` predict ``targets [T]``."""
    return torch.nn.functional.cross_entropy(logits.float(), targets.long(), reduction="none")


def perplexity(nll_sum: float, count: int) -> float:
    """``exp(mean NLL)``."""
    if count <= 0:
        raise ValueError("perplexity of zero tokens")
    return math.exp(nll_sum / count)


class Perplexity(Metric):
    """Perplexity of a long text fed through the cache in exact interval-aligned chunks."""

    name = "perplexity"
    help = "streaming perplexity of a long text under eviction, and its ratio to the full cache"
    needs_reference = True
    columns = [
        Column("ppl", "PPL", "{:.2f}", "lower"),
        Column("ppl_ratio", "PPL / full", "{:.4f}", "lower", ranked=True),
    ]

    def prepare(self, tokenizer, text, policies):
        s = self.config.perplexity
        if s.prefill >= s.tokens:
            raise EvalError(f"perplexity.prefill ({s.prefill}) must be below perplexity.tokens ({s.tokens})")
        if policies and s.tokens <= max_budget(policies):
            raise EvalError(
                f"perplexity.tokens ({s.tokens}) must exceed the largest budget ({max_budget(policies)}) "
                "or nothing is ever evicted"
            )
        need_text(text, s.tokens, "perplexity")
        self.ids = text[: s.tokens]

    def run(self, ctx, policy, reference):
        s = self.config.perplexity
        stream = ctx.stream(policy)
        targets = torch.tensor(self.ids, device=ctx.device)
        nll = torch.zeros(len(self.ids) - 1)

        def collect(start: int, logits: torch.Tensor, base: int) -> None:
            # logits at text position p predict token p + 1
            pos = base + start
            stop = min(pos + logits.shape[0], len(self.ids) - 1)
            if stop > pos:
                nll[pos:stop] = token_nll(logits[: stop - pos], targets[pos + 1 : stop + 1]).cpu()

        stream.feed(self.ids[: s.prefill], lambda o, lg: collect(o, lg, 0))
        stream.feed(self.ids[s.prefill :], lambda o, lg: collect(o, lg, s.prefill))
        total = float(nll.sum())
        count = nll.numel()
        values = {"ppl": perplexity(total, count), "nll": total / count, "evictions": stream.evictions()}
        if reference is None:
            values["ppl_ratio"] = 1.0
            return MetricResult(values, reference={"nll": values["nll"]})
        values["ppl_ratio"] = math.exp(values["nll"] - reference["nll"])
        return MetricResult(values)
