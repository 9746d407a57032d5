"""Evaluation harness: compare eviction policies and budgets on one model.

``kvpolicy eval`` (see :mod:`kvpolicy.eval.cli`) runs the metrics of :mod:`kvpolicy.eval.suites`
for every (policy, budget) pair plus the full cache, and writes a run folder with
``metrics.json``, the resolved ``config.yaml``, per-example ``predictions.jsonl`` and plots.
"""

from .config import EvalConfig, EvalError
from .runner import run_eval

__all__ = ["EvalConfig", "EvalError", "run_eval"]
