"""Evaluation harness: compare eviction policies and budgets on one model.

``kvpolicy eval`` runs the metrics of :mod:`kvpolicy.eval.metrics` for every (policy, budget)
pair plus the full cache, and writes a run folder with ``metrics.json``, the resolved
``config.yaml``, per-example ``predictions.jsonl`` and plots.

The modules, read top-down (each imports only modules after it; ``tests/test_eval_imports.py``
keeps it so):

- ``cli``: the ``kvpolicy eval`` command line; ``runner``: check everything, then run each pair
  into the run folder; ``report``: the table and the plots.
- ``metrics``: one module per metric on a common base (``metrics.base``); ``lmeval``: the
  lm-evaluation-harness model that the ``lm`` metric runs.
- ``capture``: attention inputs of a full-cache forward; ``decoding``: the one decoding loop
  (``Stream`` for one sequence fed in exact chunks, ``generate_batch`` for padded batches);
  ``sampling``: the one sampling path and the stop rules; ``cost``: KV bytes, peak memory, time
  in the policy (through the executor's timing hook).
- ``progress`` (lines, ETAs), ``reasoning`` (pass@k, math answers, loops), ``records``
  (per-sample records on disk), ``models`` (loading the model), ``data`` (inputs as token ids),
  ``config`` (the run's settings).
"""

from .config import EvalConfig, EvalError
from .runner import run_eval

__all__ = ["EvalConfig", "EvalError", "run_eval"]
