"""Quest's page-level upper bound of the attention logit."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

import torch
from pydantic import Field

from .base import EvictionInput, Scorer
from .current_attention import newest_query

if TYPE_CHECKING:
    from ..schedule import Schedule
    from .recall import RecallInput


def side_by_side(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor | None:
    """``[..., 2D]``: ``lo`` and ``hi`` (``[..., D]`` each) as one view, each row ``[lo | hi]``,
    where they are the two halves of one tensor's rows (the page summaries select mode keeps);
    None otherwise."""
    d = lo.shape[-1]
    if (
        lo.shape != hi.shape or lo.stride() != hi.stride() or lo.dtype != hi.dtype or lo.device != hi.device
        or lo.stride(-1) != 1 or lo.untyped_storage().data_ptr() != hi.untyped_storage().data_ptr()
        or hi.storage_offset() != lo.storage_offset() + d
        or any(stride < 2 * d for size, stride in zip(lo.shape[:-1], lo.stride()[:-1], strict=True) if size > 1)
    ):
        return None
    return lo.as_strided((*lo.shape[:-1], 2 * d), lo.stride(), lo.storage_offset())


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

    ``granularity: page`` (select mode) is Quest's own rule, a *page choice*
    (``Scorer.choice_page_size``): each choice ranks the ``C // P`` whole candidate pages by
    their bound (``score_pages``, ``C / P`` numbers instead of ``C`` slots) and attends the best
    ``k`` of them whole, read as pages of the cache, plus the tail: the candidates' last, short
    page and the recent buffer (``kvpolicy.selection.page_plan``). It needs ``budget - recent``
    to be a multiple of ``page_size`` and at least one page. ``granularity: slot`` (the
    default) gives every slot its page's bound and lets the selector rank slots (a page may
    then be taken in part): it runs in both modes and under any greedy composition.
    """

    type_name: ClassVar[str] = "quest"
    reads_values: ClassVar[bool] = False
    reads_queries: ClassVar[bool] = True

    page_size: int = Field(16, ge=1, le=4096, description="Slots per page (Quest: 16).")
    group_reduce: Literal["max", "mean"] = "max"
    granularity: Literal["slot", "page"] = Field(
        "slot",
        description="slot: every slot scores its page's bound and the selector ranks slots. page: select "
        "mode attends whole pages, the best (budget - recent) / page_size of them by their bound, plus "
        "the recent buffer and the candidates' last, short page (Quest's own rule).",
    )

    recall_summaries: ClassVar[frozenset[str]] = frozenset({"key_min", "key_max"})
    packed_reads: ClassVar[Literal["slots", "short_page"]] = "short_page"  # score_packed: summaries, the short page

    def score_summaries(self, inp: RecallInput) -> torch.Tensor:
        """As a recall scorer: each slow-tier page's bound ``q+ . max + q- . min`` (scaled by
        ``inp.scaling``), reduced over the query heads of a KV head with ``group_reduce``."""
        q = inp.queries.float()
        signed = torch.cat([q.clamp(max=0), q.clamp(min=0)], dim=-1)  # [B, Hkv, G, 2D]
        lo, hi = inp.summaries["key_min"], inp.summaries["key_max"]
        both = side_by_side(lo, hi)  # a view where the tier keeps them side by side
        if both is None:
            both = torch.cat([lo, hi], dim=-1)  # [B, Hkv, Np, 2D]
        bounds = (signed @ both.transpose(-1, -2)) * inp.scaling
        return bounds.amax(2) if self.group_reduce == "max" else bounds.mean(2)

    def validate_schedule(self, schedule: Schedule) -> None:
        if self.granularity != "page":
            return
        free = schedule.budget - schedule.recent
        if free < self.page_size:
            raise ValueError(
                f"scorer.page_size {self.page_size} with granularity page needs schedule.budget ({schedule.budget}) "
                f"to hold the recent buffer ({schedule.recent}) and at least one whole page: budget >= "
                f"{schedule.recent + self.page_size}"
            )
        if free % self.page_size:
            raise ValueError(
                f"scorer.page_size {self.page_size} with granularity page must divide schedule.budget - "
                f"schedule.recent ({schedule.budget} - {schedule.recent} = {free}): the choice is in whole pages"
            )

    @property
    def choice_page_size(self) -> int | None:
        return self.page_size if self.granularity == "page" else None

    @property
    def may_be_negative(self) -> bool:
        return True

    @property
    def key_page_sizes(self) -> frozenset[int]:
        return frozenset({self.page_size})

    def page_bounds(self, inp: EvictionInput, *, every_slot_valid: bool | None = None) -> torch.Tensor:
        """``[B, Hkv, G, ceil(C / P)]`` float32: each query head's bound of ``q . k`` per page
        (``-inf`` for a page without a valid slot).

        ``every_slot_valid``: True when the caller knows every slot is valid (a select-mode
        cache's packed rows): nothing is masked and no synchronisation is needed; None checks.
        With the cache's page summaries (``inp.key_pages``) only the last, short page is reduced
        from the keys: nothing reads all ``C`` keys.
        """
        return self._page_bounds(inp, every_slot_valid)[0]

    def _page_bounds(
        self, inp: EvictionInput, every_slot_valid: bool | None, whole_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``page_bounds`` and the ``[B, Hkv, pages]`` bool mask of pages without a valid slot
        (None when every slot is valid). ``whole_only``: the ``C // P`` whole pages only."""
        b, hkv, _, d = inp.keys.shape
        c, p = inp.num_candidates, self.page_size
        valid = inp.slot_valid[..., :c]
        all_valid = bool(valid.all()) if every_slot_valid is None else every_slot_valid

        def reduce(start: int, stop: int, pages: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
            """Per-channel min and max of slots ``[start, stop)``: ``pages`` pages of ``length``."""
            keys = inp.keys[:, :, start:stop].float()  # a view for float32 caches
            if all_valid:  # the usual case: reduce the keys as they are, no masked copies
                lo = hi = keys
            else:
                lo = keys.masked_fill(~valid[..., start:stop, None], float("inf"))
                hi = keys.masked_fill(~valid[..., start:stop, None], float("-inf"))
            return lo.unflatten(2, (pages, length)).amin(3), hi.unflatten(2, (pages, length)).amax(3)

        full = c // p
        cached = (inp.key_pages or {}).get(p)
        if cached is not None and cached[0].shape[2] >= full and all_valid:
            # Summaries the cache maintains as tokens arrive: no pass over the candidates' keys.
            kmin, kmax = cached[0][:, :, :full].float(), cached[1][:, :, :full].float()
        else:
            kmin, kmax = reduce(0, full * p, full, p)  # [B, Hkv, pages, D]
        parts = [(kmin, kmax)]
        if full * p < c and not whole_only:  # the last, short page
            parts.append(reduce(full * p, c, 1, c - full * p))
        q, _ = newest_query(inp)
        q = q.float().view(b, hkv, inp.group_size, d)
        # q+ . max + q- . min as one product over [min | max] side by side: one pass over the
        # summaries (the cache keeps them side by side, so that is a view there).
        signed = torch.cat([q.clamp(max=0), q.clamp(min=0)], dim=-1)  # [B, Hkv, G, 2D]
        bounds, empties = [], []
        for lo, hi in parts:
            both = side_by_side(lo, hi)
            if both is None:
                both = torch.cat([lo, hi], dim=-1)
            if not all_valid:
                gone = torch.isinf(lo[..., 0]) & (lo[..., 0] > 0)  # [B, Hkv, pages]: no valid slot
                empties.append(gone)
                both = both.masked_fill(gone[..., None], 0.0)
            bounds.append(signed @ both.transpose(-1, -2))
        bound = bounds[0] if len(bounds) == 1 else torch.cat(bounds, dim=-1)
        if not empties:
            return bound, None
        empty = empties[0] if len(empties) == 1 else torch.cat(empties, dim=-1)
        return bound.masked_fill(empty[:, :, None, :], float("-inf")), empty

    def page_scores(self, inp: EvictionInput, *, every_slot_valid: bool | None = None) -> torch.Tensor:
        """``[B, Hkv, ceil(C / P)]`` float32: each page's score, which every slot of the page gets
        (``score`` repeats it). Pages without a valid slot hold padding only, which later stages
        never read: they score 0, as does every page of a row without a query. Needs ``C > 0``.
        ``every_slot_valid`` as in ``page_bounds``."""
        d = inp.keys.shape[-1]
        bounds, empty = self._page_bounds(inp, every_slot_valid)
        bounds = bounds * d**-0.5
        per_page = bounds.amax(2) if self.group_reduce == "max" else bounds.mean(2)
        _, has_query = newest_query(inp)
        # Only pages of padding (and rows without a query) are zeroed: an inf or NaN bound
        # elsewhere is a float32 overflow, which the guard reports.
        per_page = per_page.masked_fill(~has_query[:, None, None], 0.0)
        return per_page if empty is None else per_page.masked_fill(empty, 0.0)

    def score_pages(self, inp: EvictionInput) -> torch.Tensor:
        """``[B, Hkv, C // P]`` float32: the whole candidate pages' scores (``page_scores``
        without the last, short page), for select mode's page choice (``Scorer.score_pages``).
        Packed rows only: every slot valid, so the cache's page summaries are read and no key is."""
        d = inp.keys.shape[-1]
        if inp.num_candidates < self.page_size:
            return inp.keys.new_zeros((inp.batch, inp.num_kv_heads, 0), dtype=torch.float32)
        bounds = self._page_bounds(inp, True, whole_only=True)[0] * d**-0.5
        per_page = bounds.amax(2) if self.group_reduce == "max" else bounds.mean(2)
        _, has_query = newest_query(inp)
        return per_page.masked_fill(~has_query[:, None, None], 0.0)

    def score(self, inp: EvictionInput) -> torch.Tensor:
        b, hkv, n, _ = inp.keys.shape
        c = inp.num_candidates
        out = inp.keys.new_zeros(b, hkv, n, dtype=torch.float32)
        if c == 0:
            return out
        out[..., :c] = self.page_scores(inp).repeat_interleave(self.page_size, dim=-1)[..., :c]
        return out

    def score_packed(self, inp: EvictionInput) -> torch.Tensor:
        """``score`` on select mode's packed rows (``Scorer.score_packed``): the page scores
        (``C / P`` of them, from the cache's page summaries: no key is read but the last, short
        page's) written once into the candidates' scores, nothing masked. Always scores."""
        b, hkv, n, _ = inp.keys.shape
        c, p = inp.num_candidates, self.page_size
        out = inp.keys.new_empty((b, hkv, n), dtype=torch.float32)  # past the candidates: not read
        if c:
            pages = self.page_scores(inp, every_slot_valid=True)  # [B, Hkv, ceil(C / P)]
            full = c // p
            out[..., : full * p].unflatten(-1, (full, p)).copy_(pages[..., :full, None].expand(-1, -1, -1, p))
            if full * p < c:
                out[..., full * p : c] = pages[..., full:]
        return out
