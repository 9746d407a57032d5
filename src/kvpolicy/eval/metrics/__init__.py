"""The metrics a run can select: one module per metric, each a ``Metric`` (:mod:`.base`).

==================  ===========================================================================
``perplexity``      streaming perplexity of a long text, and its ratio to the full cache
``fidelity``        greedy generation against the full cache's: agreement, divergence, repeats
``passkey``         retrieval of a key written before filler that evicts like decoded tokens
``accuracy``        pass@1 on reasoning-gym tasks
``reconstruction``  attention output over the slots one eviction keeps, against all slots
``speed``           decode tokens/s, peak memory and KV-cache bytes
``lm``              lm-evaluation-harness tasks under the reasoning protocol
==================  ===========================================================================
"""

from __future__ import annotations

from ..config import EvalConfig, EvalError
from .accuracy import Accuracy
from .base import Column, Metric, MetricResult, RunContext
from .fidelity import Fidelity
from .lm import LMTasks
from .passkey import Passkey
from .perplexity import Perplexity
from .reconstruction import Reconstruction
from .speed import Speed

METRICS: dict[str, type[Metric]] = {
    cls.name: cls for cls in (Perplexity, Fidelity, Passkey, Accuracy, Reconstruction, Speed, LMTasks)
}

__all__ = ["METRICS", "Column", "Metric", "MetricResult", "RunContext", "get_metrics"]


def get_metrics(names: list[str], config: EvalConfig) -> list[Metric]:
    """The metrics called ``names`` (in order, duplicates dropped), built for ``config``."""
    unknown = [n for n in names if n not in METRICS]
    if unknown:
        raise EvalError(f"unknown metric(s) {', '.join(map(repr, unknown))}; available: {', '.join(METRICS)}")
    if not names:
        raise EvalError("no metric selected")
    return [METRICS[n](config) for n in dict.fromkeys(names)]
