"""Quest's page-level upper bound of the attention logit."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from .base import EvictionInput, Scorer
from .current_attention import newest_query


class QuestScorer(Scorer):
    """Scores pages of ``page_size`` candidate slots by an upper bound of ``q . k`` (Quest).

    Candidates ``[0, C)`` are cut into pages of ``P`` slots from slot 0 (the last one may be
    short). Each page is summarised by the per-channel minimum and maximum of its valid keys;
    for the current query ``q`` (each row's newest valid window entry),
    ``bound = sum_d max(q_d * min_d, q_d * max_d) = q+ . max + q- . min`` is at least ``q . k``
    for every key of the page. The ``G`` query heads of a KV head are reduced with
    ``group_reduce`` (``max`` keeps it an upper bound for every head). Every slot of a page gets
    the page's bound (scaled by ``1 / sqrt(D)``), so a greedy selector takes pages whole except,
    at most, the last one it reaches. The dot products read ``2 C / P`` summaries instead of
    ``C`` keys, and in select mode the cache maintains the summaries of full pages as tokens
    arrive (``EvictionInput.key_pages``), so only the last, short page is reduced from the keys.
    Min and max are exact, so both ways give the same scores. Scores can be negative: use a
    greedy selector.
    """

    type_name: ClassVar[str] = "quest"
    reads_queries: ClassVar[bool] = True

    page_size: int = Field(16, ge=1, le=4096, description="Slots per page (Quest: 16).")
    group_reduce: Literal["max", "mean"] = "max"

    @property
    def may_be_negative(self) -> bool:
        return True

    @property
    def key_page_sizes(self) -> frozenset[int]:
        return frozenset({self.page_size})

    def page_bounds(self, inp: EvictionInput) -> torch.Tensor:
        """``[B, Hkv, G, ceil(C / P)]`` float32: each query head's bound of ``q . k`` per page
        (``-inf`` for a page without a valid slot)."""
        return self._page_bounds(inp)[0]

    def _page_bounds(self, inp: EvictionInput) -> tuple[torch.Tensor, torch.Tensor]:
        """``page_bounds`` and the ``[B, Hkv, pages]`` bool mask of pages without a valid slot."""
        b, hkv, _, d = inp.keys.shape
        c, p = inp.num_candidates, self.page_size
        keys = inp.keys[:, :, :c].float()  # a view for float32 caches
        valid = inp.slot_valid[..., :c]
        if bool(valid.all()):  # the usual case: reduce the keys as they are, no masked copies
            lo = hi = keys
        else:
            lo = keys.masked_fill(~valid[..., None], float("inf"))
            hi = keys.masked_fill(~valid[..., None], float("-inf"))
        full = c // p
        cached = (inp.key_pages or {}).get(p)
        if cached is not None and cached[0].shape[2] >= full and bool(valid.all()):
            # Summaries the cache maintains as tokens arrive: no pass over the candidates' keys.
            kmin, kmax = cached[0][:, :, :full].float(), cached[1][:, :, :full].float()
        else:
            kmin = lo[:, :, : full * p].unflatten(2, (full, p)).amin(3)  # [B, Hkv, pages, D]
            kmax = hi[:, :, : full * p].unflatten(2, (full, p)).amax(3)
        if full * p < c:  # the last, short page
            kmin = torch.cat([kmin, lo[:, :, full * p :].amin(2, keepdim=True)], dim=2)
            kmax = torch.cat([kmax, hi[:, :, full * p :].amax(2, keepdim=True)], dim=2)
        empty = torch.isinf(kmin[..., 0]) & (kmin[..., 0] > 0)  # [B, Hkv, pages]: no valid slot
        if bool(empty.any()):
            kmin, kmax = kmin.masked_fill(empty[..., None], 0.0), kmax.masked_fill(empty[..., None], 0.0)
        q, _ = newest_query(inp)
        q = q.float().view(b, hkv, inp.group_size, d)
        bound = q.clamp(min=0) @ kmax.transpose(-1, -2) + q.clamp(max=0) @ kmin.transpose(-1, -2)
        return bound.masked_fill(empty[:, :, None, :], float("-inf")), empty

    def score(self, inp: EvictionInput) -> torch.Tensor:
        b, hkv, n, d = inp.keys.shape
        c = inp.num_candidates
        out = inp.keys.new_zeros(b, hkv, n, dtype=torch.float32)
        if c == 0:
            return out
        bounds, empty = self._page_bounds(inp)
        bounds = bounds * d**-0.5
        per_page = bounds.amax(2) if self.group_reduce == "max" else bounds.mean(2)
        _, has_query = newest_query(inp)
        # Pages without a valid slot hold padding only, which later stages never read. Only those
        # are zeroed: an inf or NaN bound elsewhere is a float32 overflow, which the guard reports.
        per_page = per_page.masked_fill(empty | ~has_query[:, None, None], 0.0)
        out[..., :c] = per_page.repeat_interleave(self.page_size, dim=-1)[..., :c]
        return out
