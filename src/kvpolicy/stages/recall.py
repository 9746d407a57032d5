"""What a recall scorer reads: the page summaries a slow tier keeps, and the step's queries.

A two-tier policy (``PolicyConfig.recall``, ``kvpolicy.tiers``) does not drop what eviction
evicts: each eviction's evicted tokens go, in pages of ``P``, to a slow tier, and each page leaves
a few summaries in the fast tier. Every ``interval`` decode steps a *recall scorer* ranks the slow
tier's pages from those summaries alone (no evicted key is read), and the best pages are brought
back into a recall buffer that attention reads beside the kept slots.

A recall scorer is an ordinary ``Scorer`` that also declares ``recall_summaries`` (the summary
kinds below it reads) and implements ``score_summaries(RecallInput)``: ``quest`` (key bounds) and
``landmark`` (page means) do. The summary kinds are this module's ``SUMMARIES``: pure functions
of one page's keys, computed once, when the page is written (a page never changes after).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

#: A summary kind: ``(keys [..., P, D], valid [..., P] bool) -> [..., D]``, the page's summary
#: over its valid slots (every page holds at least one).
SummaryFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _key_min(keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return keys.float().masked_fill(~valid[..., None], float("inf")).amin(-2)


def _key_max(keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return keys.float().masked_fill(~valid[..., None], float("-inf")).amax(-2)


def _key_mean(keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    w = valid[..., None].float()
    return (keys.float() * w).sum(-2) / w.sum(-2).clamp(min=1.0)


#: Every summary kind a slow tier can keep, by name: ``key_min`` and ``key_max`` (per-channel key
#: bounds: Quest's and ArkVale's digest), ``key_mean`` (the page's mean key: ShadowKV's landmark).
#: Each is ``[D]`` per page. A slow tier keeps the kinds its recall scorer reads.
SUMMARIES: Mapping[str, SummaryFn] = {"key_min": _key_min, "key_max": _key_max, "key_mean": _key_mean}

#: How each summary kind rounds when a tier stores it in fewer bits (``recall.summary_precision``,
#: ``kvpolicy.tiers.slow.quantise``): a lower bound down, an upper bound up (so Quest's bound stays
#: a bound), a mean to nearest.
ROUNDING: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "key_min": torch.floor, "key_max": torch.ceil, "key_mean": torch.round,
}


@dataclass(frozen=True)
class RecallInput:
    """One recall of some rows of one layer: the step's queries and the slow tier's pages.

    Shapes: ``B`` rows, ``Hkv`` KV heads, ``G`` query heads per KV head, ``Np`` page slots of
    the slow tier (some empty), ``D`` the head dimension.
    """

    #: ``[B, Hkv, G, D]``: the step's query (post-RoPE), query head ``h * G + g`` under KV head ``h``.
    queries: torch.Tensor
    #: ``[B, Hkv, Np, D]`` float32 per summary kind the scorer declared (``recall_summaries``).
    summaries: Mapping[str, torch.Tensor]
    #: ``[B, Hkv, Np]`` bool: which page slots hold a page. The caller never recalls an empty one,
    #: whatever it scores.
    page_valid: torch.Tensor
    #: The softmax scale of the model's attention.
    scaling: float

    @property
    def group_size(self) -> int:
        return self.queries.shape[2]
