"""``fidelity``: greedy generation under eviction against the full cache's, on reasoning-gym prompts.

Per prompt: token agreement (the full cache's continuation fed through this cache,
teacher-forced: how often its argmax picks the reference's next token), the first step where
free-running generation leaves the full cache's, and the share of repeated 4-grams.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..data import check_task, task_prompts
from ..reasoning import repeated_ngram_share
from ..sampling import SamplingParams
from .base import Column, Metric, MetricResult, mean


def token_agreement(predicted: Sequence[int], reference: Sequence[int]) -> float:
    """Share of reference positions where ``predicted`` has the same token (missing ones disagree)."""
    if not reference:
        return 1.0
    same = sum(1 for p, r in zip(predicted, reference, strict=False) if p == r)
    return same / len(reference)


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first step where the sequences differ (the shorter length if one is a prefix of
    the other; their common length if they are equal)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


class Fidelity(Metric):
    """Greedy generation on reasoning-gym prompts against the full-cache run."""

    name = "fidelity"
    help = "greedy generation vs the full cache: token agreement, first divergence, repeated 4-grams"
    needs_reference = True
    columns = [
        Column("agreement", "agree", "{:.3f}", "higher", ranked=True),
        Column("first_divergence", "1st div", "{:.1f}", "higher", ranked=True),
        Column("repeat_4gram", "rep4", "{:.3f}", "lower"),
    ]

    def __init__(self, config) -> None:
        super().__init__(config)
        if not config.fidelity.free_running:  # teacher-forced agreement only (per instance, as lm's pass@k)
            self.columns = [c for c in type(self).columns if c.key == "agreement"]  # type: ignore[misc]

    def prepare(self, tokenizer, text, policies):
        s = self.config.fidelity
        check_task(s.task)
        self.prompts, _ = task_prompts(tokenizer, s.task, s.prompts, self.config.seed, s.shots)

    def run(self, ctx, policy, reference):
        s = self.config.fidelity
        greedy = SamplingParams(max_new_tokens=s.new_tokens)
        refs = reference["tokens"] if reference else None
        agreements, divergences, repeats, preds, generated = [], [], [], [], []
        free = s.free_running or refs is None  # the full cache's run always generates: it is the reference
        for i, prompt in enumerate(self.prompts):
            stream = ctx.stream(policy)
            pred: dict = {"task": prompt.task, "index": prompt.index, "prompt_tokens": len(prompt.ids)}
            if free:
                tokens, _ = stream.generate(stream.feed(prompt.ids), greedy, ctx.stop_ids)
                generated.append(tokens)
            ref = refs[i] if refs else tokens
            # Teacher-forced: the reference continuation fed through this cache (exact chunks);
            # how often would this cache have chosen the reference's next token?
            agreements.append(token_agreement(self._teacher_forced(ctx, policy, prompt.ids, ref, stream), ref))
            pred["agreement"] = agreements[-1]
            pred["reference_tokens"] = len(ref)
            if s.free_running:
                divergences.append(first_divergence(tokens, ref))
                repeats.append(repeated_ngram_share(tokens, 4))
                pred.update(output=ctx.decode(tokens), first_divergence=divergences[-1], repeat_4gram=repeats[-1])
            pred["evictions"] = stream.evictions()
            preds.append(pred)
        values = {"agreement": mean(agreements)}
        if s.free_running:
            values.update(first_divergence=mean(divergences), repeat_4gram=mean(repeats))
        return MetricResult(values, preds, reference=None if reference else {"tokens": generated})

    @staticmethod
    def _teacher_forced(ctx, policy, prompt: list[int], ref: list[int], used=None) -> list[int]:
        """The argmax after ``prompt`` and after each token of ``ref`` but the last, fed through a
        fresh cache (``used``, a stream nothing was fed to yet, is taken instead of a new one)."""
        stream = used if used is not None and used.seen == 0 else ctx.stream(policy)
        first = stream.feed(prompt)
        predicted = [int(first.argmax())]
        if len(ref) > 1:
            out = torch.empty(len(ref) - 1, dtype=torch.long)
            stream.feed(ref[:-1], lambda o, lg: out.__setitem__(slice(o, o + lg.shape[0]), lg.argmax(-1).cpu()))
            predicted += out.tolist()
        return predicted
