"""The eviction core: what one eviction (or one update between evictions) does with the slots a
cache holds, for every engine.

Every engine that evicts, ``EvictingCache`` and ``KVPolicyCache`` (through the executor and its
layouts) and vLLM's worker (through its paged cache), gathers a layer's held slots into an
``EvictionInput`` (``kvpolicy.policy.eviction_input``, the one builder), hands it here, and
moves memory by what comes back. Nothing here reads or writes a cache.

The rules that decide when a policy's state is updated live here too, once:

- ``evict``: every stateful stage's update runs exactly once (``Policy.observe``), then the
  policy ranks by the updated state;
- ``observe``: an update between evictions (stages updated once per eviction keep their state);
- ``new_queries``: which window queries the state has not seen (the every-query rule);
- ``must_observe`` / ``is_long_step``: when a step's tokens would push unseen queries out of the
  window, and when a step has more queries than the window holds;
- ``observe_long_step``: such a step's queries seen in chunks, never a ``[T, T]`` matrix.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .policy import Policy
from .selection import choose_directly, choose_pages
from .stages import guards
from .stages.base import EvictionInput, window_positions

__all__ = [
    "OBSERVE_ELEMENTS", "Kept", "choose", "evict", "is_long_step", "must_observe", "new_queries", "observe",
    "observe_long_step",
]

#: Logits per chunk when a long step's queries update a policy's state (``observe_long_step``):
#: ``[B, Hq, chunk, N]`` float32, about 16 MiB.
OBSERVE_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class Kept:
    """What one eviction keeps of the ``N`` slots of its input, and the policy's new state.

    ``slots [B, Hkv, K]``: ascending kept slots, the same count on every head (a uniform or
    per-layer allocation); None under a per-head allocation or a threshold (``Policy.per_head``), which gives ``keep [B, Hkv, N]``
    bool and ``counts [B, Hkv]`` instead. ``state``: every state field by stored name
    (``Policy.state_fields``) over the input's ``N`` slots, after this eviction's update, before
    any slot is dropped (empty for a policy that keeps none): the caller moves it with the slots
    it keeps. ``values``: under a policy that merges (``PolicyConfig.merge``), every slot's value
    after the merge (``[B, Hkv, N, Dv]``, the cache's dtype; only kept slots differ from the
    input's), computed once here; None when nothing is merged (``drop``).

    ``pages [B, Hkv, k]``: select mode's page choice (a scorer that declares
    ``Scorer.choice_page_size``), the whole candidate pages chosen, ascending, with ``slots``,
    ``keep`` and ``counts`` None: the choice attends them and the tail
    (``kvpolicy.selection.page_plan``)."""

    slots: torch.Tensor | None
    keep: torch.Tensor | None
    counts: torch.Tensor | None
    state: dict[str, torch.Tensor]
    values: torch.Tensor | None = None
    pages: torch.Tensor | None = None

    @property
    def writes(self) -> dict[str, torch.Tensor]:
        """The per-slot fields a layout writes before it moves the kept slots: the state, and the
        merged values where there are any (every layout writes them by name, as a state field)."""
        if self.values is None:
            return self.state
        return {**self.state, "values": self.values}


def evict(policy: Policy, inp: EvictionInput, *, inputs_checked: bool = False) -> Kept:
    """One eviction of ``inp``: the state brought up to date with the window's new queries
    (``inp.query_new``), every stateful stage's update applied exactly once, then the slots kept
    ranked by that state. ``inputs_checked``: the caller refused non-finite inputs already."""
    inp, state = policy.observe(inp)
    checked = inputs_checked or bool(state)  # observe checked the inputs before any stage read them
    if policy.per_head:
        keep, counts = policy.select_heads_from(inp, inputs_checked=checked)
        return merged(policy, inp, Kept(None, keep, counts, state))
    return merged(policy, inp, Kept(policy.select_from(inp, inputs_checked=checked), None, None, state))


def merged(policy: Policy, inp: EvictionInput, kept: Kept) -> Kept:
    """``kept`` with the policy's merge applied (``PolicyConfig.merge``): the kept slots' new
    values and the merge's state. Unchanged under ``drop``, the default."""
    merge = policy.config.merge
    if not merge.merges:
        return kept
    keep = kept.keep
    if keep is None:
        assert kept.slots is not None
        keep = torch.zeros(inp.slot_valid.shape, dtype=torch.bool, device=inp.keys.device).scatter_(-1, kept.slots, True)
    values, fields = guards.run_merge(merge, inp, keep)
    state = dict(kept.state)
    for name, (key, field, _) in policy.state_fields.items():
        if key == merge.state_key and field in fields:
            state[name] = fields[field]
    return replace(kept, state=state, values=values)


def choose(policy: Policy, inp: EvictionInput) -> Kept:
    """Select mode's choice of ``inp``'s slots (nothing is evicted): as ``evict``, with the
    scorer's direct choice where it declares one (``kvpolicy.selection.choose_directly``), or
    its page choice (``Kept.pages``, ``kvpolicy.selection.choose_pages``) where it declares
    that. The keys, values and queries were checked as they entered the cache."""
    state: dict[str, torch.Tensor] = {}
    if policy.keeps_state:  # the state sees this layer's new queries (the step's included) first
        inp, state = policy.observe(inp)
    if policy.chooses_pages is not None:  # whole pages, ranked by page (config checked the composition)
        return Kept(None, None, None, state, pages=choose_pages(policy, inp))
    if policy.per_head:  # each head chooses its own count out of the layer's pool
        keep, counts = policy.select_heads_from(_with_own_masks(inp))
        return Kept(None, keep, counts, state)
    slots = choose_directly(policy, inp)
    if slots is None:
        slots = policy.select_from(_with_own_masks(inp), inputs_checked=True)
    return Kept(slots, None, None, state)


def _with_own_masks(inp: EvictionInput) -> EvictionInput:
    """Select mode's input with ``slot_valid`` and ``positions`` as tensors of their own (they are
    expanded views): a policy's stages, plugins included, get them as an eviction gives them."""
    return replace(inp, slot_valid=inp.slot_valid.contiguous(), positions=inp.positions.contiguous())


def observe(policy: Policy, inp: EvictionInput) -> dict[str, torch.Tensor]:
    """An update between evictions: stages that see every query take the window's new ones;
    stages updated once per eviction keep their state (left out). The new fields, by stored name."""
    return policy.observe(inp, eviction=False)[1]


def observe_long_step(
    policy: Policy, inp: EvictionInput, queries: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """A step with more queries than the window holds (``is_long_step``), on one layer as it is
    written: the state of ``inp``'s slots (the step's own included; its window is not read) sees
    each of ``queries [B, Hq, T, D]`` (token ``positions [B, T]``, ``valid [B, T]``) in time order,
    in chunks of at most ``OBSERVE_ELEMENTS`` logits. The new fields, by stored name."""
    b, hq, t, _ = queries.shape
    chunk = max(1, min(t, OBSERVE_ELEMENTS // max(1, b * hq * inp.num_slots)))
    state, fields = inp.state, dict[str, torch.Tensor]()
    for c0 in range(0, t, chunk):
        c1 = min(t, c0 + chunk)
        part = replace(
            inp, queries=queries[:, :, c0:c1], query_valid=valid[:, c0:c1], query_positions=positions[:, c0:c1],
            query_new=valid[:, c0:c1], state=state,
        )
        part, fields = policy.observe(part, eviction=False)
        state = part.state
    return fields


def new_queries(
    policy: Policy, query_valid: torch.Tensor, tokens: torch.Tensor, observed: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(query_positions, query_new)``, each ``[B, W]``, for a window ``query_valid [B, W]`` of
    rows that have seen ``tokens [B]`` real tokens and whose state has seen the queries of the
    first ``observed [B]``: a window holds a row's latest queries, so its newest valid entry is
    token ``tokens - 1``. Under a policy whose stages are updated once per eviction every valid
    entry is new (they see the window as it is at each eviction)."""
    positions = window_positions(query_valid, tokens)
    if not policy.observes_queries:
        return positions, query_valid
    return positions, query_valid & (positions >= observed.to(query_valid.device)[:, None])


def must_observe(unseen: torch.Tensor | int, tokens: torch.Tensor | int, window: int) -> torch.Tensor | bool:
    """Whether a row whose state has not seen its last ``unseen`` queries must be updated before a
    step of ``tokens`` tokens: the step would push some of them out of a ``window``-query ring.
    (Ints or ``[B]`` tensors.)"""
    return (unseen > 0) & (unseen + tokens > window)


def is_long_step(tokens: int, window: int) -> bool:
    """Whether a step of ``tokens`` holds more queries than a ``window``-query ring keeps: its
    queries are then seen layer by layer as they are written (``observe_long_step``), so every
    engine counts the step as observed from its plan on (``LayerGroup`` and vLLM's
    ``PagedCache.begin_step`` alike): no eviction or update comes between a plan and its forward."""
    return tokens > window
