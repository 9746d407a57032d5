"""``passkey``: retrieval of a key written early, after filler fed through the evicting cache.

Prefill never evicts (for most policies), so the key sits in the prompt and the filler and
question are fed after it in exact chunks: they evict exactly as if the model had decoded them,
and the key must survive every eviction to be retrieved. The greedy answer's first number is the
model's answer.
"""

from __future__ import annotations

import re

from ..config import EvalError
from ..data import passkey_prompts
from ..sampling import SamplingParams
from .base import Column, Metric, MetricResult, max_budget, mean

_DIGITS = re.compile(r"\d+")


def parse_passkey(text: str) -> str | None:
    """The first run of digits in a generated answer, or None."""
    m = _DIGITS.search(text.replace(",", ""))
    return m.group(0) if m else None


def passkey_correct(text: str, passkey: str) -> bool:
    return parse_passkey(text) == passkey


class Passkey(Metric):
    """Passkey retrieval with the key in the prefill and the filler fed afterwards."""

    name = "passkey"
    help = "passkey retrieval accuracy at context lengths above the budget (key early, filler decoded)"
    columns = [Column("passkey", "passkey", "{:.2f}", "higher", ranked=True)]

    def prepare(self, tokenizer, text, policies):
        s = self.config.passkey
        top = max_budget(policies)
        for ctx_len in s.context:
            if policies and ctx_len <= top:
                raise EvalError(
                    f"passkey context {ctx_len} must exceed the largest budget ({top}) to test retrieval under eviction"
                )
        self.prompts = [p for c in s.context for p in passkey_prompts(tokenizer, c, s.samples, self.config.seed)]

    def run(self, ctx, policy, reference):
        greedy = SamplingParams(max_new_tokens=self.config.passkey.new_tokens)
        preds = []
        by_len: dict[int, list[float]] = {}
        for p in self.prompts:
            stream = ctx.stream(policy)
            stream.feed(p.prefix)
            tokens, _ = stream.generate(stream.feed(p.filler + p.suffix), greedy, ctx.stop_ids)
            text = ctx.decode(tokens)
            ok = passkey_correct(text, p.passkey)
            by_len.setdefault(p.context, []).append(float(ok))
            preds.append(
                {"passkey": p.passkey, "context": p.length, "output": text, "correct": ok, "evictions": stream.evictions()}
            )
        values = {"passkey": mean([x for v in by_len.values() for x in v])}
        values.update({f"passkey@{c}": mean(v) for c, v in by_len.items()})
        return MetricResult(values, preds)
