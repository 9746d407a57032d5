"""Select mode's state: each layer's current choice of slots and the page summaries of its keys.

Select mode keeps every token; each decode step attends only the slots the policy chose (anew
every ``interval`` steps). Nothing here runs a policy: the executor does.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .policy import Policy, keep_top
from .schedule import Phase, Schedule
from .slots import StepPlan
from .stages import guards
from .stages.base import EvictionInput, Scorer, declared_for

#: Select mode keeps every token. When a chunk does not fit, the buffers grow to ``growth`` times
#: the slots it needs (``EvictingCache(select_growth=...)``), and by at least
#: ``SELECT_MIN_GROWTH`` slots: geometric growth, so the copies cost a bounded number of slot
#: copies per appended token (``1 / (growth - 1)``, amortised) and the unused headroom stays
#: below ``growth - 1`` of the cache.
SELECT_GROWTH = 1.1
SELECT_MIN_GROWTH = 16


class SelectionState:
    """Per layer ``selection [Lyr, B, Hkv, budget]`` (allocated at the first choice: a cache that
    never holds more than ``budget`` slots never chooses); per row the count it held when it chose
    (``selected_at``, -1: none), whether it chooses anew at this step (``reselect``) and how many
    choices it made before this step (``choices``: what keys its random draws, as evictions do
    when evicting); per page of ``P`` slots the per-channel min and max of each layer's keys
    (``key_pages``).

    Under a per-head allocation (``per_head``) a head may choose up to the layer's whole pool,
    ``Hkv * budget`` slots: ``selection`` is ``[Lyr, B, Hkv, Hkv * budget]``, each head's chosen
    slots first (ascending), the columns past its count (``head_counts [Lyr, B, Hkv]``) repeating
    its first chosen slot, so that they gather real data and a mask leaves them out."""

    def __init__(
        self, num_layers: int, batch: int, kv_heads: int, budget: int, capacity: int,
        page_sizes: frozenset[int], like: torch.Tensor, per_head: bool = False, page_choice: int | None = None,
    ) -> None:
        self.per_head = per_head
        self._selection_shape = (num_layers, batch, kv_heads, kv_heads * budget if per_head else budget)
        self._selection: torch.Tensor | None = None
        self._head_counts: torch.Tensor | None = None
        self._device = like.device
        self.selected_at = torch.full((batch,), -1, dtype=torch.long)
        self.reselect = torch.zeros(batch, dtype=torch.bool)
        self.choices = torch.zeros(batch, dtype=torch.long)
        self.key_pages: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        #: Under a page choice (``page_choice``: its page size ``P``), each layer's chosen pages,
        #: ``[Lyr, B, Hkv, budget // P]``: the first ``k`` columns (``page_plan``) count.
        self.page_choice = page_choice
        self._pages: torch.Tensor | None = None
        #: Per page size, each page's min and max side by side, ``[Lyr, B, Hkv, pages, 2, D]``:
        #: ``key_pages`` holds views of its halves, which Quest reads in one pass.
        self._summaries: dict[int, torch.Tensor] = {}
        for p in sorted(page_sizes):
            self._keep_summaries(p, like.new_zeros((num_layers, batch, kv_heads, -(-capacity // p), 2, like.shape[-1])))

    @property
    def selection(self) -> torch.Tensor:
        """``[Lyr, B, Hkv, budget]`` long: each layer's chosen slots (ascending per row and head)."""
        if self._selection is None:
            self._selection = torch.zeros(self._selection_shape, dtype=torch.long, device=self._device)
        return self._selection

    @property
    def pages(self) -> torch.Tensor:
        """A page choice: ``[Lyr, B, Hkv, budget // P]`` long, each layer's chosen pages
        (ascending in the first ``k`` columns, ``page_plan``)."""
        if self.page_choice is None:
            raise ValueError("this selection chooses slots, not pages")
        if self._pages is None:
            lyr, b, hkv, budget = self._selection_shape
            self._pages = torch.zeros((lyr, b, hkv, budget // self.page_choice), dtype=torch.long, device=self._device)
        return self._pages

    @property
    def head_counts(self) -> torch.Tensor:
        """Per-head allocations: ``[Lyr, B, Hkv]`` long, the slots each head chose."""
        if self._head_counts is None:
            self._head_counts = torch.zeros(self._selection_shape[:3], dtype=torch.long, device=self._device)
        return self._head_counts

    def store_heads(self, i: int, rows: slice | torch.Tensor, keep: torch.Tensor, counts: torch.Tensor) -> None:
        """Per-head allocations: layer ``i``'s choice for ``rows``, ``keep [R, Hkv, N]`` bool with
        ``counts [R, Hkv]`` True per head (``Policy.select_heads_from``)."""
        width = self._selection_shape[3]
        # A stable sort of the keep flags puts each head's kept slots first, in ascending order.
        order = torch.sort(keep.to(torch.uint8), dim=-1, descending=True, stable=True).indices[..., :width]
        if order.shape[-1] < width:  # fewer slots held than the pool: the rest is padding
            order = torch.nn.functional.pad(order, (0, width - order.shape[-1]))
        past = torch.arange(width, device=order.device) >= counts[..., None]
        self.selection[i, rows] = torch.where(past, order[..., :1], order)
        self.head_counts[i, rows] = counts

    def plan(self, t: int, counts: int | torch.Tensor, phase: Phase, schedule: Schedule) -> None:
        """Which rows choose anew at a step of ``t`` tokens and ``phase`` (``choose_now``); the
        rows that chose at the previous step count that choice (it keyed that step's draws)."""
        self.choices += self.reselect
        now = choose_now(t, phase, counts, self.selected_at, schedule)
        if now is None:
            self.selected_at.fill_(-1)
            self.reselect = torch.zeros(self.reselect.shape[0], dtype=torch.bool)
            return
        self.selected_at, self.reselect = now

    def _keep_summaries(self, p: int, both: torch.Tensor) -> None:
        self._summaries[p] = both
        self.key_pages[p] = (both[..., 0, :], both[..., 1, :])

    def grow(self, capacity: int) -> None:
        for p, old in list(self._summaries.items()):
            grown = old.new_zeros(*old.shape[:3], -(-capacity // p), *old.shape[4:])
            grown[:, :, :, : old.shape[3]] = old
            self._keep_summaries(p, grown)

    def summarise_pages(self, i: int, keys: torch.Tensor, plan: StepPlan, counts: torch.Tensor | None) -> None:
        """Recompute layer ``i``'s page summaries over the pages this step wrote into (one page
        when decoding), from its keys ``[B, Hkv, cap, D]``. Slots past a row's count (``counts``
        ``[B]``, or None when every row holds ``plan.written_to``) are left out (+inf / -inf)."""
        if counts is None and plan.tokens == 1:  # a decode step of alike rows: fold in the one key
            self._fold_in(i, plan.written_from, keys[:, :, plan.written_from])
            return
        for p, (lo, hi) in self.key_pages.items():
            first, last = plan.written_from // p, -(-plan.written_to // p)
            block = keys[:, :, first * p : last * p]
            pad = (last - first) * p - block.shape[2]
            slot = torch.arange(first * p, first * p + block.shape[2], device=keys.device)
            if counts is None:
                full = plan.written_to % p == 0
                empty = (slot >= plan.written_to)[None, None, :, None]
            else:
                full = False
                empty = (slot >= counts.to(keys.device)[:, None])[:, None, :, None]  # [B, 1, S, 1]
            low, high = page_bounds(block, p) if full and pad == 0 else page_bounds(block, p, empty=empty, pad=pad)
            lo[i, :, :, first:last] = low
            hi[i, :, :, first:last] = high

    def _fold_in(self, i: int, s: int, key: torch.Tensor) -> None:
        """Layer ``i``'s page summaries after one key ``[B, Hkv, D]`` was appended at slot ``s``
        of every row: min and max are exact, so folding the key into its page's summary gives
        what reducing the page's keys gives, without reading them."""
        for p, (lo, hi) in self.key_pages.items():
            page = s // p
            if s % p == 0:  # the first slot of a page
                lo[i, :, :, page] = key
                hi[i, :, :, page] = key
            else:
                lo[i, :, :, page] = torch.minimum(lo[i, :, :, page], key)
                hi[i, :, :, page] = torch.maximum(hi[i, :, :, page], key)

    def select_rows(self, host: torch.Tensor, dev: torch.Tensor) -> None:
        self.selected_at = self.selected_at[host]
        self.reselect = self.reselect[host]
        self.choices = self.choices[host]
        lyr, _, hkv, budget = self._selection_shape
        self._selection_shape = (lyr, host.numel(), hkv, budget)
        if self._selection is not None:
            self._selection = self._selection.index_select(1, dev)
        if self._head_counts is not None:
            self._head_counts = self._head_counts.index_select(1, dev)
        if self._pages is not None:
            self._pages = self._pages.index_select(1, dev)
        for p, both in list(self._summaries.items()):
            self._keep_summaries(p, both.index_select(1, dev))

    def nbytes(self) -> int:
        chosen = [t for t in (self._selection, self._head_counts, self._pages) if t is not None]
        tensors = [*chosen, *self._summaries.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


def choose_directly(policy: Policy, inp: EvictionInput) -> torch.Tensor | None:
    """What ``policy.select_from(inp)`` keeps, ``[B, Hkv, K]``, in fewer passes, where the
    policy's stages declare it: a scorer that scores packed rows (``Scorer.score_packed``:
    ``quest``, ``current_attention``, any plugin scorer that defines it), a selector whose
    priority is the score (``Selector.priority_is_score``: ``greedy``) and no reservation; None
    for any other policy, or when the scorer declines this input (the caller then runs
    ``Policy.select_from``).

    For select mode's packed rows only: every slot of ``inp`` is valid and every token was
    checked as it entered the cache. The priorities are then the scorer's scores on the
    candidates (checked: ``guards.run_packed_scorer``) and +inf on the recent buffer, built
    without the masks ``select_from`` combines, and ranked by the same ``keep_top`` call: the
    same slots come out, ties included, as long as the scores are ``score``'s. Quest's come
    from the page summaries (no key is read); oracle top-k reads each key once (``q . K``).
    A declaration counts only where it was made for the method it speaks of: a subclass that
    overrides ``score`` (or ``priority``) without declaring again runs the full pipeline.
    """
    scorer = _direct_scorer(policy)
    if scorer is None:
        return None
    guards.check_recent(inp)
    scores = guards.run_packed_scorer(scorer, inp)
    if scores is None:
        return None
    # select_from's priorities: the candidates' scores (finite float32, so its clamp changes
    # none) and +inf on the recent buffer. A tensor of its own: the scorer's is left alone.
    c = inp.num_candidates
    priority = scores.new_empty(scores.shape)
    priority[..., :c] = scores[..., :c]
    priority[..., c:] = float("inf")
    return keep_top(priority, inp.budget)


def _direct_scorer(policy: Policy) -> Scorer | None:
    """The scorer ``choose_directly`` asks (its declarations made for the methods they speak of), or None."""
    cfg = policy.config
    scorer, selector = cfg.scorer, cfg.selector
    if cfg.reservations or scorer is None:
        return None
    if not (selector.priority_is_score and declared_for(type(selector), "priority_is_score", "priority")):
        return None
    if not declared_for(type(scorer), "score_packed", "score"):  # a scorer of none has Scorer's
        return None
    return scorer


def short_page_read(policy: Policy) -> int | None:
    """``P`` where select mode's slot choice of ``policy`` reads, of the slots, only the keys of
    the candidates' last, short page of ``P`` (``[(C // P) * P, C)``: ``Scorer.packed_reads``,
    declared for the ``score_packed`` that ``choose_directly`` asks, of a scorer naming the one
    page size ``P``), given page summaries of pages of ``P``; else None. An engine whose slots
    live elsewhere (vLLM's ``BlockSelection``) may then gather just those keys."""
    scorer = _direct_scorer(policy)
    if scorer is None or scorer.packed_reads != "short_page" or len(scorer.key_page_sizes) != 1:
        return None
    if not declared_for(type(scorer), "packed_reads", "score_packed"):
        return None
    (page,) = scorer.key_page_sizes
    return page


def page_plan(held: int, budget: int, recent: int, page_size: int) -> tuple[int, int]:
    """A page choice over ``held`` slots (``Scorer.choice_page_size`` ``P``): ``(k, tail)``, the
    number of whole candidate pages chosen and the first slot of the tail, which is always
    attended: ``tail = (C // P) * P`` with ``C = held - recent`` (the candidates' last, short
    page, then the recent buffer), and ``k`` the whole pages that fit the budget beside it,
    ``(budget - (held - tail)) // P`` (never more than the ``C // P`` pages there are). The
    slots attended, ``k * P + held - tail``, never exceed ``budget`` once ``held`` does."""
    full = (held - recent) // page_size
    tail = full * page_size
    return max(0, min(full, (budget - (held - tail)) // page_size)), tail


def choose_pages(policy: Policy, inp: EvictionInput) -> torch.Tensor:
    """Select mode's page choice (a scorer that declares ``Scorer.choice_page_size``) of a
    cache's packed rows: ``[B, Hkv, k]`` long, the ``k`` whole candidate pages of highest
    ``score_pages`` (checked: ``guards.run_page_scorer``), ascending, ranked by ``keep_top``
    (``k`` and the tail attended beside them: ``page_plan``). Nothing is ranked per slot."""
    scorer = policy.config.scorer
    page = None if scorer is None else scorer.choice_page_size
    if scorer is None or page is None:
        raise ValueError(f"policy {policy.name!r} does not choose pages (its scorer declares no choice_page_size)")
    guards.check_recent(inp)
    k, _ = page_plan(inp.num_slots, inp.budget, inp.num_slots - inp.num_candidates, page)
    scores = guards.run_page_scorer(scorer, inp, page)
    return keep_top(scores, k)


def choose_now(
    t: int, phase: Phase, held: Any, chosen_at: Any, schedule: Schedule,
) -> tuple[Any, Any] | None:
    """Select mode's one rule of when a choice is made, for a cache's rows (``SelectionState``)
    and vLLM's requests (``kvpolicy.vllm.select``) alike: ``(chosen_at, fresh)`` after a step of
    ``t`` tokens and ``phase`` (``kvpolicy.schedule.step_phase``) of rows holding ``held`` slots
    that chose at ``chosen_at`` (-1: no choice); ints or ``[B]`` tensors.

    A one-token decode step of a row holding more than ``budget`` slots chooses (``fresh``) when
    it has no choice yet or chose ``interval`` or more tokens ago. A multi-token chunk and every
    step of the prompt (a prompt prefilled in chunks included, even a one-token last chunk) attend
    densely: None, and the next decode step chooses anew."""
    if t > 1 or phase != "decode":
        return None
    stale = (chosen_at < 0) | (held - chosen_at >= schedule.interval)
    fresh = (held > schedule.budget) & stale
    if isinstance(fresh, torch.Tensor):
        return torch.where(fresh, held, chosen_at), fresh
    return (held if fresh else chosen_at), bool(fresh)


def page_bounds(
    keys: torch.Tensor, page_size: int, *, empty: torch.Tensor | None = None, pad: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The page summaries every engine keeps (Quest's): each page's per-channel minimum and
    maximum key, ``[..., pages, D]`` each, of ``keys [..., S, D]``, whose slot axis holds whole
    pages once ``pad`` slots are added at its end. The padding and the slots where ``empty``
    (broadcast to ``keys``) is true hold no token: they change neither bound."""
    low = high = keys
    if empty is not None:
        low, high = keys.masked_fill(empty, float("inf")), keys.masked_fill(empty, float("-inf"))
    if pad:
        low = torch.nn.functional.pad(low, (0, 0, 0, pad), value=float("inf"))
        high = torch.nn.functional.pad(high, (0, 0, 0, pad), value=float("-inf"))
    shape = (low.shape[-2] // page_size, page_size)
    return low.unflatten(-2, shape).amin(-2), high.unflatten(-2, shape).amax(-2)


def page_slots(pages: torch.Tensor, page_size: int, tail: int, held: int) -> torch.Tensor:
    """The slots a page choice attends, ``[..., k * P + held - tail]`` long: each chosen page's
    ``P`` slots (``pages [..., k]``, ascending), then the tail ``[tail, held)``: ascending."""
    within = torch.arange(page_size, device=pages.device)
    slots = (pages[..., None] * page_size + within).flatten(-2)
    rest = torch.arange(tail, held, device=pages.device).expand(*pages.shape[:-1], -1)
    return torch.cat([slots, rest], dim=-1)


def select_capacity(needed: int, growth: float) -> int:
    """Select mode's allocation for ``needed`` slots: ``ceil(needed * growth)``, and at least
    ``needed + SELECT_MIN_GROWTH``."""
    return max(needed + SELECT_MIN_GROWTH, math.ceil(needed * growth))


def check_select_growth(growth: object) -> float:
    """``growth`` as a float in ``(1, 16]``, or a ``ValueError`` saying why not."""
    if isinstance(growth, bool) or not isinstance(growth, (int, float)) or not 1.0 < growth <= 16.0:
        raise ValueError(
            f"select_growth must be a number in (1, 16] (select mode's buffers grow to that many times the "
            f"slots needed; 1.1 keeps 10 % headroom), got {growth!r}"
        )
    return float(growth)
