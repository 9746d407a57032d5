"""The reasoning protocol's measures: pass@k, math answers checked with math-verify, loop signals.

Pure functions on strings and token lists; nothing here runs a model. Used by the ``lm`` metric
(:mod:`kvpolicy.eval.metrics.lm`, ``kvpolicy eval --lm-tasks``), the ``fidelity`` metric and the
lm-eval model, and usable on any saved records.

Definitions (also in ``docs/evaluation.md``):

- **pass@k** of one problem with ``n`` samples of which ``c`` are correct: the unbiased estimator
  ``1 - C(n - c, k) / C(n, k)`` (the chance that ``k`` of the ``n`` samples, drawn without
  replacement, hold a correct one); a task's pass@k is its mean over problems. pass@1 is then
  the mean correctness over all samples.
- **repeated n-gram share**: of a generation's n-grams, the share that repeat an earlier one.
- **loop**: the generation *ends* in a block of ``p`` tokens repeated back to back, covering its
  last ``S`` tokens with ``S >= min_repeats * p`` and ``S >= min_span``, for some period
  ``p <= max_period`` (defaults 3, 64 and 1024). The smallest such ``p`` is the loop's period;
  ``S`` (the longest suffix with that period) its span.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "Loop",
    "extract_gold",
    "find_loop",
    "math_equal",
    "pass_at_k",
    "pass_at_k_mean",
    "repeated_ngram_share",
    "strip_thinking",
]


# -- pass@k --------------------------------------------------------------------------------------
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem: ``n`` samples, ``c`` correct (Chen et al., 2021).

    ``1 - C(n - c, k) / C(n, k)``, computed as ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)``
    (no large binomials). ``k`` must lie in ``1..n``.
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs between 1 and n={n} samples per problem")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_at_k_mean(correct: Mapping[str, Sequence[bool]] | Mapping[int, Sequence[bool]], k: int) -> float:
    """Mean pass@k over problems, each a list of its samples' correctness (NaN without problems)."""
    values = [pass_at_k(len(v), sum(bool(x) for x in v), k) for v in correct.values()]
    return float(sum(values) / len(values)) if values else float("nan")


# -- answers -------------------------------------------------------------------------------------
def strip_thinking(text: str, think_end: str | None) -> str:
    """The answer part of a generation: the text after the last ``think_end`` (e.g. ``</think>``),
    stripped of leading whitespace; the whole text when there is no marker."""
    if think_end and think_end in text:
        return text.rsplit(think_end, 1)[1].lstrip()
    return text


def extract_gold(target: object) -> str:
    """A task's reference answer as LaTeX math-verify can parse.

    GSM8K-style targets (a worked solution ending ``#### 42``) give what follows the last
    ``####`` (thousands separators dropped); a target already holding ``$...$`` or ``\\boxed``
    is kept; anything else is wrapped in ``$...$``.
    """
    text = str(target[0] if isinstance(target, list | tuple) and target else target).strip()
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip().replace(",", "")
    if "$" in text or "\\boxed" in text:
        return text
    return f"${text}$"


def _timeouts() -> int | None:
    # math-verify times out with SIGALRM, which only the main thread may set.
    return 5 if threading.current_thread() is threading.main_thread() else None


def math_equal(response: str, target: object) -> bool:
    """Whether ``response``'s final answer equals the reference ``target``, by math-verify.

    The answer is what math-verify extracts from the response (a ``\\boxed{}`` first, else the
    last LaTeX or plain expression); equality is symbolic (``1/2`` = ``0.5`` = ``\\frac{2}{4}``).
    A response with no parsable answer is wrong.
    """
    from math_verify import parse, verify

    timeout = _timeouts()
    gold = parse(extract_gold(target), parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"math-verify cannot parse the reference answer {target!r}")
    pred = parse(response, parsing_timeout=timeout)
    if not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=timeout))


# -- repetition and loops ------------------------------------------------------------------------
def repeated_ngram_share(tokens: Sequence[int], n: int = 4) -> float:
    """Share of the sequence's n-grams that repeat an earlier n-gram (0 without repeats, towards 1
    in a repetition loop)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0
    return (len(grams) - len(set(grams))) / len(grams)


@dataclass(frozen=True)
class Loop:
    """A generation's closing loop: a block of ``period`` tokens repeated over its last ``span``."""

    period: int
    span: int

    @property
    def repeats(self) -> float:
        return self.span / self.period


def _periodic_suffix(a: np.ndarray, p: int) -> int:
    """Length of the longest suffix of ``a`` with period ``p`` (at least ``min(p, len(a))``)."""
    n = a.shape[0]
    if n <= p:
        return n
    same = a[p:] == a[:-p]  # same[i]: a[i + p] == a[i]
    breaks = np.flatnonzero(~same)
    if breaks.size == 0:
        return n
    return int(n - (breaks[-1] + 1))


def find_loop(
    tokens: Sequence[int] | np.ndarray,
    *,
    max_period: int = 1024,
    min_repeats: int = 3,
    min_span: int = 64,
) -> Loop | None:
    """The loop the generation ends in, or None (see the module docstring for the definition).

    Cost: one comparison of at most ``max(min_repeats * p, min_span)`` tokens per period ``p``.
    """
    a = np.asarray(tokens, dtype=np.int64)
    n = a.shape[0]
    for p in range(1, max_period + 1):
        need = max(min_repeats * p, min_span)
        if need > n:
            break
        seg = a[n - need :]
        if np.array_equal(seg[p:], seg[:-p]):
            return Loop(p, _periodic_suffix(a, p))
    return None


# -- summaries -----------------------------------------------------------------------------------
def share(flags: Iterable[bool]) -> float:
    """Share of true flags (NaN when empty)."""
    values = [bool(f) for f in flags]
    return sum(values) / len(values) if values else float("nan")
