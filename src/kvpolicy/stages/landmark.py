"""Page landmarks: the current query's dot product with each page's mean key (ShadowKV's)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

import torch
from pydantic import Field

from .base import EvictionInput, Scorer
from .current_attention import newest_query

if TYPE_CHECKING:
    from .recall import RecallInput


class LandmarkScorer(Scorer):
    """Scores pages of ``page_size`` candidate slots by ``q . mean(k)``, the page's landmark.

    Candidates ``[0, C)`` are cut into pages of ``P`` slots from slot 0 (the last one may be
    short); each page's landmark is the mean of its valid keys, and the current query ``q`` (each
    row's newest valid window entry) scores it ``q . landmark / sqrt(D)``, reduced over the ``G``
    query heads of a KV head with ``group_reduce``. Every slot of a page gets the page's score.
    As a recall scorer (``PolicyConfig.recall``) it reads the slow tier's ``key_mean`` summaries:
    one ``D``-vector per page, half the key bounds Quest reads. Unlike Quest's bound it is no
    upper bound: a page whose keys point in many directions has a small landmark (ShadowKV keeps
    such outlier pages in the fast tier; here eviction decides what stays). Scores can be
    negative: use a greedy selector.
    """

    type_name: ClassVar[str] = "landmark"
    reads_values: ClassVar[bool] = False
    reads_queries: ClassVar[bool] = True
    recall_summaries: ClassVar[frozenset[str]] = frozenset({"key_mean"})

    page_size: int = Field(8, ge=1, le=4096, description="Slots per page (ShadowKV's chunks: 8).")
    group_reduce: Literal["max", "mean"] = "max"

    @property
    def may_be_negative(self) -> bool:
        return True

    def _reduce(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.amax(2) if self.group_reduce == "max" else logits.mean(2)

    def score(self, inp: EvictionInput) -> torch.Tensor:
        b, hkv, n, d = inp.keys.shape
        c, p = inp.num_candidates, self.page_size
        out = inp.keys.new_zeros(b, hkv, n, dtype=torch.float32)
        if c == 0:
            return out
        pages = -(-c // p)
        pad = pages * p - c
        keys = torch.nn.functional.pad(inp.keys[:, :, :c].float(), (0, 0, 0, pad))
        valid = torch.nn.functional.pad(inp.slot_valid[..., :c], (0, pad), value=False)
        w = valid[..., None].float()
        means = (keys * w).unflatten(2, (pages, p)).sum(3) / w.unflatten(2, (pages, p)).sum(3).clamp(min=1.0)
        q, has_query = newest_query(inp)
        q = q.float().view(b, hkv, inp.group_size, d)
        per_page = self._reduce(q @ means.transpose(-1, -2) * d**-0.5)  # [B, Hkv, pages]
        per_page = per_page.masked_fill(~has_query[:, None, None], 0.0)
        out[..., :c] = per_page.repeat_interleave(p, dim=-1)[..., :c]
        return out

    def score_summaries(self, inp: RecallInput) -> torch.Tensor:
        # Empty page slots' scores are never read (the guard sets them to -inf): no mask here.
        means = inp.summaries["key_mean"]
        return self._reduce(inp.queries.float() @ means.transpose(-1, -2) * inp.scaling)
