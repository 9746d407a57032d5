"""Select mode over vLLM's blocks: each decode step attends only the whole blocks a page-choosing
policy chose, plus the recent tail; the full cache stays in the pool. Pure torch.

A select-mode request is accounted like the policy ``none`` (``budgets.evicting_schedule``: the
scheduler and every worker's ledger never evict it, and it holds every token's block). What
changes is its attention at a decode step: vLLM's attention backend computes the layer's output
over every slot, and ``BlockSelection.attend`` then replaces the rows of the requests that
select with attention (``kvpolicy.attend``) over the pages chosen by the transformers path's own
code (``kvpolicy.eviction.choose``, hence ``kvpolicy.selection.choose_pages`` and the scorer's
``score_pages``), read straight from the request's blocks, and the tail. vLLM's blocks are the
policy's pages: ``refusals.page_refusal`` refuses a policy whose page size is not the block size.

The rule of when a request chooses is the core's, per request (``kvpolicy.selection.choose_now``,
with ``kvpolicy.schedule.step_phase`` from the request's own prompt length, so a prompt prefilled
in chunks attends densely to its last chunk, as one prompt step does). Page summaries
(``kvpolicy.selection.page_bounds``: each whole block's per-channel minimum and maximum key, per
layer and KV head) are kept per request, incrementally: a page is reduced once, from the gathered
keys, at the first choice after it filled (nothing is evicted, so a full page never changes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from .. import eviction
from ..attend import attend
from ..policy import Policy, eviction_input
from ..schedule import step_phase
from ..selection import choose_now, page_bounds, page_plan, short_page_read
from .paged import KV, gather_paged, slot_address
from .paged_cache import PagedCache
from .refusals import page_refusal, select_refusal
from .requests import BlockTable, RequestPolicy, StepRequests
from .support import KVPolicyVLLMError


class BlockAttention(Protocol):
    """Attention of one query per request over whole blocks that each KV head lists.

    ``query [R, Hq, D]``; ``blocks [R, Hkv, m]``: block ids per KV head, in attention order;
    ``length``: the slots attended, the first ``length`` of the ``m`` blocks' (the last block may
    be partial); returns ``[R, Hq, D]``. ``gathered_blocks`` gathers the blocks and runs
    ``kvpolicy.attend``; an engine's own kernel may read them in place
    (``kvpolicy.vllm.block_kernel``)."""

    def __call__(self, query: torch.Tensor, blocks: torch.Tensor, length: int, scale: float) -> torch.Tensor: ...


def gathered_blocks(kv: KV) -> BlockAttention:
    """``BlockAttention`` over a layer's ``kv`` (``BlockLayout.split``'s views) by gathering the blocks."""
    keys_cache, values_cache = kv

    def attend_blocks(query: torch.Tensor, blocks: torch.Tensor, length: int, scale: float) -> torch.Tensor:
        heads = torch.arange(blocks.shape[1], device=blocks.device)[None, :, None]
        keys = keys_cache[blocks, :, heads].flatten(2, 3)[:, :, :length]  # [R, Hkv, length, D]
        values = values_cache[blocks, :, heads].flatten(2, 3)[:, :, :length]
        return attend(query.to(keys.dtype)[:, :, None], keys, values, scaling=scale)[:, :, 0]

    return attend_blocks


@dataclass
class RequestChoice:
    """One select-mode request's page summaries and current choice, per layer.

    ``summaries``: per page size ``P`` the policy's stages read (``Policy.key_page_sizes``),
    ``[Lyr, Hkv, pages, 2, D]``, each whole page's min and max key side by side (the form select
    mode's cache keeps, which Quest reads as one view), valid for the first ``summarised[P][l]``
    pages of layer ``l``. ``chosen [Lyr, Hkv, K]``: each layer's choice, whole pages under a page
    choice (``K = budget // P``, the first ``k`` count: ``page_plan``), else slots
    (``K = budget``, ascending). ``chosen_at``: slots held when it chose (-1: no choice);
    ``choices``: choices made before this step (they key a policy's draws, as in select mode's
    cache); ``fresh``: it chooses anew at this step."""

    summaries: dict[int, torch.Tensor]
    summarised: dict[int, list[int]]
    chosen: torch.Tensor
    chosen_at: int = -1
    choices: int = 0
    fresh: bool = False


@dataclass(frozen=True)
class SelectGroup:
    """This step's requests that attend a selection, alike: one policy, the same slots held, and
    the same point in the choice cycle (so one policy call serves them, as a phase of a select
    cache's rows does)."""

    rp: RequestPolicy
    held: int
    fresh: bool
    chosen_at: int
    rows: list[int]  # their rows in the runner's batch
    req_ids: list[str]
    tokens: torch.Tensor  # [R] each request's token in the step's flattened tokens (device)
    blocks: torch.Tensor  # [R, ceil(held / block_size)] each request's block ids (device)
    choices: list[RequestChoice] = field(default_factory=list)


class BlockSelection:
    """Select mode for the requests of one worker's ``PagedCache`` (its blocks, query rings,
    policies, layer ids and head offset). ``begin_step`` after ``PagedCache.begin_step``,
    ``attend`` after each attention layer's forward (its keys are in the blocks), ``end_step``
    after the forward, ``drop`` when a request leaves or is preempted (a resumed request
    recomputes its cache and chooses anew)."""

    def __init__(self, paged: PagedCache) -> None:
        self.paged = paged
        self.requests: dict[str, RequestChoice] = {}
        self.groups: list[SelectGroup] = []
        # A choice's keys where only the short page is read (``_short_page_keys``): NaN elsewhere.
        self._nan_keys = torch.empty(0, paged.kv_heads, 0, paged.head_dim, dtype=paged.dtype, device=paged.device)

    @property
    def selecting(self) -> bool:
        """Whether some request of this step attends a selection."""
        return bool(self.groups)

    def drop(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    def skipped_rows(self) -> list[int]:
        """The batch rows whose attention this step is ``attend``'s alone: the decode steps that
        attend a selection. The engine's kernel need not attend them (the worker shortens their
        attention length to one slot; ``attend`` writes every layer's output for them)."""
        return [row for group in self.groups for row in group.rows]

    def end_step(self) -> None:
        self.groups = []

    def begin_step(self, plan: StepRequests, table: BlockTable) -> None:
        """Which requests of ``plan`` attend a selection at this step, and which choose anew
        (``SelectionState.plan``'s rule, per request)."""
        paged = self.paged
        self.groups = []
        phases: dict[tuple[str, int, bool, int], list[tuple[int, str]]] = {}
        for i, req_id in enumerate(plan.req_ids):
            rp = paged.request_policy(req_id)
            policy = rp.policy
            if policy is None or policy.mode != "select":
                continue
            choice = self._request(req_id, policy)
            choice.choices += choice.fresh  # the choice of the last step counts
            before, t = int(plan.computed_before[i]), int(plan.scheduled[i])
            held = before + t  # nothing is evicted: slot s holds token s
            phase = step_phase(before, held, int(plan.prompt_len[i]))
            now = choose_now(t, phase, held, choice.chosen_at, policy.schedule)
            if now is None:  # a chunk attends densely (vLLM's output stands); the next decode step chooses anew
                choice.chosen_at, choice.fresh = -1, False
                continue
            choice.chosen_at, choice.fresh = now
            if held <= policy.schedule.budget:  # it attends every slot: vLLM's output stands
                continue
            key = (rp.resolved.policy_yaml or "", held, choice.fresh, choice.chosen_at)
            phases.setdefault(key, []).append((i, req_id))
        ends = np.cumsum(plan.scheduled)
        device = paged.device
        for (_, held, fresh, chosen_at), members in sorted(phases.items()):
            rows = torch.tensor([i for i, _ in members], dtype=torch.long)
            req_ids = [r for _, r in members]
            blocks = table.get_cpu_tensor()[rows, : -(-held // paged.block_size)].to(device=device, dtype=torch.long)
            tokens = torch.tensor([int(ends[i]) - 1 for i, _ in members], dtype=torch.long, device=device)
            self.groups.append(SelectGroup(paged.request_policy(req_ids[0]), held, fresh, chosen_at,
                                           [i for i, _ in members], req_ids, tokens,
                                           blocks, [self.requests[r] for r in req_ids]))

    def _request(self, req_id: str, policy: Policy) -> RequestChoice:
        known = self.requests.get(req_id)
        if known is not None:
            return known
        paged = self.paged
        why = select_refusal(policy) or page_refusal(policy, paged.block_size)
        if why is not None:  # the front end refuses these first: a worker never runs them
            raise KVPolicyVLLMError(why)
        lyr, hkv, d = paged.layers, paged.kv_heads, paged.head_dim
        page = policy.chooses_pages
        width = policy.budget if page is None else policy.budget // page
        sizes = sorted(policy.key_page_sizes | ({page} if page is not None else set()))
        choice = self.requests[req_id] = RequestChoice(
            summaries={p: torch.zeros(lyr, hkv, 0, 2, d, dtype=paged.dtype, device=paged.device) for p in sizes},
            summarised={p: [0] * lyr for p in sizes},
            chosen=torch.zeros(lyr, hkv, width, dtype=torch.long, device=paged.device),
        )
        return choice

    # -- during the forward -------------------------------------------------------------------
    def attend(self, layer: int, query: torch.Tensor, output: torch.Tensor, scaling: float,
               blocks_attention: BlockAttention | None = None) -> None:
        """After ``layer``'s attention: the selecting requests' rows of ``output`` (``[T, Hq * D]``
        or ``[T, Hq, D]``, vLLM's result over every slot) become attention of their ``query`` rows
        over the slots chosen for them, read from their blocks, and the tokens appended since the
        choice; the fresh ones choose first. A page choice attends whole blocks through
        ``blocks_attention`` (the engine's kernel; default ``gathered_blocks``), a slot choice
        gathers its slots for ``kvpolicy.attend``."""
        paged = self.paged
        q_all = query.view(query.shape[0], paged.q_heads, paged.head_dim)
        out = output.view(output.shape[0], paged.q_heads, -1)
        keys_cache, values_cache = paged.kv[layer]
        attend_blocks = blocks_attention or gathered_blocks(paged.kv[layer])
        bs = paged.block_size
        heads = torch.arange(paged.kv_heads, device=paged.device)[None, :, None]
        for group in self.groups:
            policy = group.rp.policy
            if policy is None:  # begin_step groups selecting requests only
                raise KVPolicyVLLMError(f"requests {group.req_ids} attend a selection without a policy")
            if group.fresh:
                self._choose(layer, group, policy)
            r, schedule = len(group.req_ids), policy.schedule
            if policy.chooses_pages is not None:  # whole blocks, then the tail's blocks (as chosen at chosen_at)
                k, first_tail = page_plan(group.chosen_at, schedule.budget, schedule.recent, bs)
                chosen = torch.stack([c.chosen[layer, :, :k] for c in group.choices])  # [R, Hkv, k]
                tail = torch.arange(first_tail // bs, -(-group.held // bs), device=chosen.device)
                wanted = torch.cat([chosen, tail.expand(r, paged.kv_heads, -1)], dim=-1)  # ascending pages
                ids = group.blocks.gather(1, wanted.flatten(1)).view_as(wanted)  # [R, Hkv, m] block ids
                attended = k * bs + group.held - first_tail  # the last block's slots past those held are cut
                result = attend_blocks(q_all[group.tokens], ids, attended, scaling)  # [R, Hq, D]
            else:  # the chosen slots, then the tokens appended since the choice
                chosen = torch.stack([c.chosen[layer] for c in group.choices])  # [R, Hkv, budget]
                since = torch.arange(group.chosen_at, group.held, device=chosen.device)
                slots = torch.cat([chosen, since.expand(r, paged.kv_heads, -1)], dim=-1)
                ids = group.blocks.gather(1, (slots // bs).flatten(1)).view_as(slots)
                keys = keys_cache[ids, slots % bs, heads]  # [R, Hkv, L, D]
                values = values_cache[ids, slots % bs, heads]
                q = q_all[group.tokens].to(keys.dtype)[:, :, None]  # [R, Hq, 1, D]
                result = attend(q, keys, values, scaling=scaling)[:, :, 0]  # [R, Hq, D]
            out[group.tokens] = result.to(out.dtype)

    def _choose(self, layer: int, group: SelectGroup, policy: Policy) -> None:
        """``group``'s choice on ``layer``: ``eviction.choose`` (select mode's own call) on the
        requests' slots, with their page summaries brought up to the pages filled by now."""
        paged = self.paged
        n, r = group.held, len(group.req_ids)
        key_pages = {}
        for p in group.choices[0].summaries:
            for j, c in enumerate(group.choices):
                self._summarise(c, layer, group.blocks[j], n, p)
            views = [c.summaries[p][layer, :, : n // p] for c in group.choices]
            both = views[0][None] if r == 1 else torch.stack(views)  # [R, Hkv, pages, 2, D] (one request: a view)
            key_pages[p] = (both[..., 0, :], both[..., 1, :])
        # A page choice reads the page summaries and the queries (``Scorer.score_pages``), and a
        # scorer declaring ``packed_reads: short_page`` (Quest) the candidates' last, short page's
        # keys besides: only those are gathered. NaN placeholders make a stage that reads more fail
        # loudly (the guards refuse non-finite scores) instead of reading zeros.
        nan = torch.full((), float("nan"), dtype=paged.dtype, device=paged.device).expand(r, paged.kv_heads, n, paged.head_dim)
        page = None if policy.chooses_pages is not None else short_page_read(policy)
        candidates = n - policy.schedule.recent
        short = range(0) if page is None else range((candidates // page) * page, candidates)  # the short page's slots
        if policy.chooses_pages is not None:
            keys = values = nan
        elif page is not None:
            keys, values = self._short_page_keys(layer, group, short), nan
        else:
            blocks, offs = slot_address(group.blocks, n, paged.block_size)
            keys, values = gather_paged(paged.kv[layer], blocks, offs)  # [R, Hkv, n, D]
        queries, query_valid = self._window(policy.schedule.window, layer, group)
        shape = (keys.shape[0], keys.shape[1], n)
        inp = eviction_input(
            keys, values, queries, budget=policy.budget, recent=policy.schedule.recent,
            seed=policy.resolve_seed(group.rp.resolved.seed), query_valid=query_valid,
            slot_valid=torch.ones((), dtype=torch.bool, device=keys.device).expand(shape),
            positions=torch.arange(n, device=keys.device).expand(shape),
            layer_idx=paged.layer_ids[layer], evictions=torch.tensor([c.choices for c in group.choices]),
            head_offset=paged.head_offset, key_pages=key_pages,
            model=paged.model_facts if policy.needs_model else None,
            prompt_lengths=self._prompt_lengths(group),
        )
        try:
            kept = eviction.choose(policy, inp)
        finally:
            if page is not None:  # the placeholder buffer is NaN again for the next choice, whatever happened
                keys[:, :, short.start : short.stop] = float("nan")
        chosen = kept.pages if kept.pages is not None else kept.slots
        if chosen is None:  # per-head counts: settings refuse them
            raise KVPolicyVLLMError(f"policy {policy.name!r} chose a count per head, which vLLM does not serve")
        for j, c in enumerate(group.choices):
            c.chosen[layer, :, : chosen.shape[-1]] = chosen[j]

    def _short_page_keys(self, layer: int, group: SelectGroup, short: range) -> torch.Tensor:
        """``[R, Hkv, n, D]``: NaN but for the keys of the slots ``short`` (the candidates' last,
        short page), read from the group's blocks into a NaN buffer kept across layers and steps
        (grown geometrically; the caller writes NaN over ``short`` again after the choice)."""
        paged = self.paged
        r, n = len(group.req_ids), group.held
        buf = self._nan_keys
        if buf.shape[0] < r or buf.shape[2] < n:
            shape = (max(r, buf.shape[0]), paged.kv_heads, max(n, 2 * buf.shape[2], 1024), paged.head_dim)
            buf = self._nan_keys = torch.full(shape, float("nan"), dtype=paged.dtype, device=paged.device)
        keys = buf[:r, :, :n]
        if len(short):
            slots = torch.arange(short.start, short.stop, device=group.blocks.device)
            ids = group.blocks[:, slots // paged.block_size]  # [R, S]
            keys[:, :, short.start : short.stop] = paged.kv[layer][0][ids, slots % paged.block_size].transpose(1, 2)
        return keys

    def _prompt_lengths(self, group: SelectGroup) -> torch.Tensor | None:
        """The group's requests' prompt tokens (``RequestRecord.prompt_len``), None if one is unknown."""
        prompts = [self.paged.records[q].prompt_len for q in group.req_ids]
        return None if any(p is None for p in prompts) else torch.tensor(prompts, dtype=torch.long)

    def _summarise(self, choice: RequestChoice, layer: int, blocks: torch.Tensor, n: int, p: int) -> None:
        """Layer ``layer``'s summaries of pages of ``p`` slots of ``choice`` for every whole page
        of the request's ``n`` slots (in ``blocks``), gathering and reducing only the pages filled since."""
        full, done = n // p, choice.summarised[p][layer]
        if full <= done:
            return
        bs = self.paged.block_size
        slots = torch.arange(done * p, full * p, device=blocks.device)
        keys = self.paged.kv[layer][0][blocks[slots // bs], slots % bs].transpose(0, 1)  # [Hkv, new slots, D]
        old = choice.summaries[p]
        if old.shape[2] < full:  # grow geometrically
            grown = old.new_zeros(*old.shape[:2], max(full, 2 * old.shape[2], 8), *old.shape[3:])
            grown[:, :, : old.shape[2]] = old
            choice.summaries[p] = old = grown
        low, high = page_bounds(keys, p)  # [Hkv, new, D] each
        old[layer, :, done:full, 0] = low
        old[layer, :, done:full, 1] = high
        choice.summarised[p][layer] = full

    def _window(self, w: int, layer: int, group: SelectGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's last ``w`` queries of ``layer`` ``[R, Hq, W, D]``, oldest first (as
        ``PagedCache`` reads an eviction's window), and which entries hold a query ``[R, W]``."""
        tokens = torch.full((len(group.req_ids),), group.held, dtype=torch.long)  # this step's query is in (captured first)
        return self.paged.window(w, group.req_ids, tokens, slice(layer, layer + 1))
