"""What a metric is: a small class with one job, run once per (policy, budget) pair.

A metric first ``prepare``s its inputs from the tokenizer (raising ``EvalError`` on bad input,
before the model is loaded), then ``run``s once with the full cache (``policy=None``; what it
returns as ``reference`` is handed to every later run) and once per (policy, budget) pair. It
reports ``values`` under the keys of its ``columns`` (and any others, kept in ``metrics.json``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ...policy import Policy
from ..config import EvalConfig, EvalError
from ..decoding import Stream


@dataclass(frozen=True)
class Column:
    """One reported number: its key in the results, table label, format and which way is better."""

    key: str
    label: str
    fmt: str = "{:.3f}"
    better: str = ""  # "higher", "lower" or "" (informational)
    ranked: bool = False  # a quality measure in the ranking (``ranking.md``); not cost, not a raw figure
    optional: bool = False  # shown only where some row reports it (a two-tier policy's tiers)

    def format(self, value: Any) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        return self.fmt.format(value)


def tier_columns(prefix: str = "") -> list[Column]:
    """A two-tier policy's tier figures (``kvpolicy.eval.cost.TierCost.values``), beside a
    metric's memory figures: optional columns, which a run without such a policy never shows."""
    return [
        Column(f"{prefix}fast_mib", "fast MiB", "{:.2f}", "lower", optional=True),
        Column(f"{prefix}slow_mib", "slow MiB", "{:.2f}", "", optional=True),
        Column(f"{prefix}moved_kib_tok", "moved KiB/tok", "{:.1f}", "lower", optional=True),
        Column(f"{prefix}hit_rate", "recall hits", "{:.2f}", "", optional=True),
    ]


@dataclass
class MetricResult:
    values: dict[str, Any]
    predictions: list[dict[str, Any]] = field(default_factory=list)
    reference: dict[str, Any] | None = None  # from the full-cache run, for the policy runs


@dataclass
class RunContext:
    """What the metrics share during a run."""

    config: EvalConfig
    model: Any
    tokenizer: Any
    device: str
    stop_ids: frozenset[int]
    base_attn: str = "sdpa"
    folder: Path | None = None  # the run folder (metrics that record per-sample files write there)
    progress: bool = True

    def stream(self, policy: Policy | None) -> Stream:
        return Stream(self.model, policy, self.base_attn)

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


class Metric:
    name: ClassVar[str]
    help: ClassVar[str]
    columns: ClassVar[list[Column]]
    needs_text: ClassVar[bool] = True  # reads the long text (the run then checks it is long enough)
    needs_reference: ClassVar[bool] = False  # its policy runs compare with the full cache's ``reference``

    def __init__(self, config: EvalConfig) -> None:
        self.config = config

    def runs_at(self, budget: int | None) -> bool:
        """Whether this metric runs for a pair at ``budget`` (None: the full cache, always): its
        settings' ``budgets``, when it has them, limit it to some of the run's budgets."""
        chosen = getattr(getattr(self.config, self.name, None), "budgets", None)
        return budget is None or chosen is None or budget in chosen

    def prepare(self, tokenizer, text: list[int], policies: list[Policy]) -> None:
        """Build the inputs; raise ``EvalError`` if they cannot measure ``policies``."""

    def run(self, ctx: RunContext, policy: Policy | None, reference: dict | None) -> MetricResult:
        raise NotImplementedError


def need_text(text: list[int], n: int, what: str) -> None:
    if len(text) < n:
        raise EvalError(f"the text has {len(text)} tokens but {what} needs {n}: give a longer --text")


def max_budget(policies: list[Policy]) -> int:
    return max((p.budget for p in policies), default=0)


def mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else float("nan")
