"""The measures themselves, as small pure functions on tensors and token lists.

Nothing here runs a model: :mod:`kvpolicy.eval.suites` feeds the model and calls these.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import torch

# -- perplexity ----------------------------------------------------------------------------------------


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of each target: ``logits [T, V]`` predict ``targets [T]``."""
    return torch.nn.functional.cross_entropy(logits.float(), targets.long(), reduction="none")


def perplexity(nll_sum: float, count: int) -> float:
    """``exp(mean NLL)``."""
    if count <= 0:
        raise ValueError("perplexity of zero tokens")
    return math.exp(nll_sum / count)


# -- generation fidelity -------------------------------------------------------------------------------


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


def repeated_ngram_share(tokens: Sequence[int], n: int = 4) -> float:
    """Share of the sequence's n-grams that repeat an earlier n-gram (0 without repeats, towards 1
    in a repetition loop)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0
    return (len(grams) - len(set(grams))) / len(grams)


# -- passkey -------------------------------------------------------------------------------------------

_DIGITS = re.compile(r"\d+")


def parse_passkey(text: str) -> str | None:
    """The first run of digits in a generated answer, or None."""
    m = _DIGITS.search(text.replace(",", ""))
    return m.group(0) if m else None


def passkey_correct(text: str, passkey: str) -> bool:
    return parse_passkey(text) == passkey


# -- attention reconstruction --------------------------------------------------------------------------


def attention_output(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    scaling: float | None = None,
) -> torch.Tensor:
    """Causal attention output ``[B, Hq, Q, Dv]`` of ``queries [B, Hq, Q, D]`` over ``keys``/``values``
    ``[B, Hkv, N, D]`` (grouped-query heads: head ``h`` reads KV head ``h // (Hq / Hkv)``).

    ``query_pos [Q]`` and ``key_pos [B, Hkv, N]`` are token positions: a query sees keys at or
    before its own position.
    """
    b, hq, q, d = queries.shape
    hkv = keys.shape[1]
    group = hq // hkv
    scaling = d**-0.5 if scaling is None else scaling
    k = keys.float().repeat_interleave(group, dim=1)
    v = values.float().repeat_interleave(group, dim=1)
    kp = key_pos.repeat_interleave(group, dim=1)  # [B, Hq, N]
    logits = queries.float() @ k.transpose(-1, -2) * scaling  # [B, Hq, Q, N]
    visible = kp[:, :, None, :] <= query_pos.view(1, 1, q, 1)
    logits = logits.masked_fill(~visible, float("-inf"))
    return torch.softmax(logits, dim=-1) @ v


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """``||approx - exact|| / ||exact||`` (Frobenius)."""
    denom = exact.float().norm()
    if float(denom) == 0.0:
        return 0.0 if float(approx.float().norm()) == 0.0 else math.inf
    return float((approx.float() - exact.float()).norm() / denom)


def reconstruction_error(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    kept: torch.Tensor,
    scaling: float | None = None,
) -> float:
    """Relative error of the last ``Q`` queries' attention output over the ``kept [B, Hkv, K]`` slots
    versus over all ``N`` slots (slot ``i`` holds token ``i``; queries are the last ``Q`` tokens)."""
    b, hkv, n, _ = keys.shape
    q = queries.shape[2]
    qpos = torch.arange(n - q, n, device=keys.device)
    all_pos = torch.arange(n, device=keys.device).expand(b, hkv, n)
    exact = attention_output(queries, keys, values, qpos, all_pos, scaling)
    gather = kept[..., None]
    k_kept = keys.gather(2, gather.expand(*kept.shape, keys.shape[-1]))
    v_kept = values.gather(2, gather.expand(*kept.shape, values.shape[-1]))
    approx = attention_output(queries, k_kept, v_kept, qpos, kept, scaling)
    return relative_error(approx, exact)


# -- summaries -----------------------------------------------------------------------------------------


def mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else float("nan")
