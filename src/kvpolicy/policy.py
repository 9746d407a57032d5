"""A policy compiled from its config: the stage pipeline (observe, then scorer -> reservations ->
selector), and ``Policy.select``, one eviction over ``[B, Hkv, N, D]`` in one call.

The input it runs on is assembled in ``kvpolicy.inputs``, policies are loaded by
``kvpolicy.loading.load_policy``, every engine's eviction step is ``kvpolicy.eviction``; the
model-fact checks sit beside ``ModelFacts`` and the layer schedules beside ``Allocation``."""

from __future__ import annotations

import secrets
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import cached_property
from typing import Any

import torch

from .config import PolicyConfig, load_config
from .documents import PolicyError
from .inputs import MAX_HEAD_OFFSET, check_recent_padding, check_tensors, eviction_input
from .schedule import Schedule
from .stages import guards
from .stages.base import EvictionInput, Stage, StateField, state_field_names, window_positions
from .stages.model_facts import ModelFacts, check_model_facts

#: ``eviction_input``, ``MAX_HEAD_OFFSET`` and ``window_positions`` are re-exported from where
#: they live (``kvpolicy.inputs``, ``kvpolicy.stages.base``): their import path of kvpolicy 0.2.
__all__ = ["MAX_HEAD_OFFSET", "Policy", "eviction_input", "keep_top", "window_positions"]

class Policy:
    """Runs a policy's stages: scorer -> reservations -> selector, all rows and heads at once.

    A ``Policy`` is immutable, and ``select`` is a pure function of its arguments: stochastic
    stages draw from counter-based streams keyed by the policy's seed, the layer index and the
    row's eviction count (see ``kvpolicy.seeds``), never from a shared generator.
    """

    def __init__(self, config: PolicyConfig, source: Mapping[str, Any] | None = None) -> None:
        self.config = config
        # The mapping the config was validated from: overrides re-apply to it, so that relative
        # fields (StreamingLLM's ``recent: budget - 4``) follow an overridden budget.
        self._source = dict(source) if isinstance(source, Mapping) else None
        self._layer_schedules: dict[tuple[int, int | None], tuple[Schedule, ...]] = {}

    # -- descriptive ------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.config.name

    @property
    def schedule(self) -> Schedule:
        return self.config.schedule

    @property
    def key_page_sizes(self) -> frozenset[int]:
        """Page sizes of the key summaries the policy's stages read (see ``Stage.key_page_sizes``)."""
        return frozenset().union(*(s.key_page_sizes for s in self.stages))

    @property
    def chooses_pages(self) -> int | None:
        """The page size ``P`` when select mode chooses whole pages (the scorer's
        ``Scorer.choice_page_size``, e.g. ``quest`` with ``granularity: page``), else None."""
        scorer = self.config.scorer
        return None if scorer is None else scorer.choice_page_size

    @property
    def mode(self) -> str:
        """``"evict"`` or ``"select"`` (see ``PolicyConfig.mode``)."""
        return self.config.mode

    @property
    def budget(self) -> int:
        return self.config.schedule.budget

    @property
    def allocation(self):
        """The allocation stage (``uniform`` unless the policy file says otherwise)."""
        return self.config.allocation

    @property
    def per_head(self) -> bool:
        """Whether heads of a layer keep different numbers of slots: a per-head allocation
        (``Allocation.per_head``) or a selector that sets each head's count (``Selector.sets_counts``,
        a score threshold). Such a policy runs through ``select_heads`` and the per-head layout."""
        return self.config.allocation.per_head or self.config.selector.sets_counts

    @property
    def couples_heads(self) -> bool:
        """Whether a KV head's choice depends on the other heads of its layer: a per-head
        allocation (heads share the layer's slots) or a stage that reduces over all heads
        (``Stage.couples_heads``, e.g. TOVA's ``current_attention`` with ``head_reduce: layer``).
        A shard of the heads (a tensor-parallel rank) cannot then choose alone."""
        return self.config.allocation.per_head or any(s.couples_heads for s in self.stages)

    # -- state ------------------------------------------------------------------------------
    # Cached: the policy is immutable, and caches ask at every step.
    @cached_property
    def stages(self) -> list[Stage]:
        """Every stage of the policy, nested ones included (a combination's scorers, a
        reservation's scorer), each once, in file order."""
        cfg = self.config
        found: list[Stage] = []
        for stage in (cfg.scorer, *cfg.reservations, cfg.selector, cfg.allocation, cfg.merge):
            for s in stage.walk() if stage is not None else ():
                if not any(s is f for f in found):
                    found.append(s)
        return found

    @property
    def data_files(self) -> list[tuple[Stage, str, str]]:
        """The data files the policy's stages name (``Stage.data_files``, nested stages included):
        ``(stage, field, value as written)``."""
        return [(s, field, value) for s in self.stages for field, value in s.data_files.items()]

    @cached_property
    def stateful_stages(self) -> dict[str, Stage]:
        """The stages that keep state (``Stage.state_fields``), by ``state_key``: equal stages
        share one state."""
        return {s.state_key: s for s in self.stages if s.state_fields}

    @cached_property
    def state_fields(self) -> dict[str, tuple[str, str, StateField]]:
        """Every field of state the policy keeps, by the name a cache stores it under
        (``"<type_name>.<field>"``, stable when stages are added; see
        ``kvpolicy.stages.base.state_field_names``): ``(stage key, field, StateField)``."""
        return state_field_names(self.stateful_stages)

    @cached_property
    def needs_model(self) -> frozenset[str]:
        """The model facts the policy's stages read (``Stage.needs_model``, nested stages
        included): what a cache must be given (``check_model_facts``)."""
        return frozenset().union(*(s.needs_model for s in self.stages))

    @cached_property
    def reads_values(self) -> bool:
        """Whether a stage reads the cached values (``Stage.reads_values``, nested stages
        included). Where none does, an engine may pass values on the ``meta`` device (their shape
        only) and skip gathering them: vLLM's even evictions do (``kvpolicy.vllm.paged_cache``)."""
        return any(s.reads_values for s in self.stages)

    def check_values(self, inp: EvictionInput) -> None:
        """Refuse placeholder values (``meta``) where a stage reads them, naming the stages."""
        if inp.values.is_meta and self.reads_values:
            names = ", ".join(f"{s.kind} {s.type_name!r}" for s in self.stages if s.reads_values)
            raise ValueError(f"policy {self.name!r} reads the cached values ({names}), but was given a placeholder "
                             "on the meta device: pass the values")

    @cached_property
    def needs_prompt(self) -> bool:
        """Whether a stage reads each row's prompt length (``Stage.needs_prompt``, nested stages
        included): ``select`` then needs ``prompt_lengths=``."""
        return any(s.needs_prompt for s in self.stages)

    def _check_prompt_lengths(self, prompt_lengths: int | torch.Tensor | None) -> None:
        if prompt_lengths is None and self.needs_prompt:
            names = ", ".join(f"{s.kind} {s.type_name!r}" for s in self.stages if s.needs_prompt)
            raise ValueError(
                f"policy {self.name!r} reads each row's prompt length ({names}): pass prompt_lengths= "
                "(an int, or [B] ints: the real tokens of each row's prompt)"
            )

    def prompt_refusal(self, prompt_len: int, new_tokens: int | None = None) -> str | None:
        """Why a request whose prompt has ``prompt_len`` tokens cannot be served (a reservation
        that keeps the whole prompt, ``Reservation.prompt_refusal``, and a budget that cannot hold
        it beside the recent buffer and the other reservations), or None. ``new_tokens``: the most
        it generates; a request that never grows past the budget never evicts and is served.
        Asked by vLLM's front end before admission; a cache refuses at the eviction instead."""
        s = self.schedule
        if new_tokens is not None and prompt_len + new_tokens <= s.budget:
            return None
        reservations = self.config.reservations
        for r in reservations:
            room = s.budget - s.recent - sum(o.reserved_beside(s.budget, s.recent) for o in reservations if o is not r)
            why = r.prompt_refusal(prompt_len, room)
            if why is not None:
                return why
        return None

    def check_model_facts(
        self, facts: ModelFacts | None, *, num_layers: int | None = None, num_kv_heads: int | None = None,
        head_dim: int | None = None, head_offset: int | None = None, q_heads: int | None = None,
    ) -> None:
        """Refuse, before any work, model facts that cannot serve the policy: a fact a stage needs
        and ``facts`` lacks (or no facts at all), facts of another shape than the cache's, or a
        stage that cannot serve the model they describe (``Stage.check_model_facts``: a calibration
        file for another model). Nothing to check for a policy that needs no facts.

        A cache holding a share of the model's KV heads (a tensor-parallel rank) gives
        ``head_offset``, its first head: ``num_kv_heads`` and ``q_heads`` are then its own, and the
        facts must hold those heads' output projection (``ModelFacts.check_heads``).

        Raises:
            PolicyError: naming the stage and the missing fact or the field at fault.
        """
        check_model_facts(self.stages, facts, self.name, num_layers=num_layers, num_kv_heads=num_kv_heads,
                          head_dim=head_dim, head_offset=head_offset, q_heads=q_heads)

    def _check_facts_for_heads(self, facts: ModelFacts | None, head_offset: int, hkv: int, hq: int, d: int) -> None:
        """``check_model_facts`` for ``select``: the ``hkv`` KV heads given are the model's heads
        ``head_offset ..`` (all of them, or a tensor-parallel shard), with ``hq / hkv`` query heads each."""
        self.check_model_facts(facts, num_kv_heads=hkv, head_dim=d, head_offset=head_offset, q_heads=hq)

    @cached_property
    def keeps_state(self) -> bool:
        """Whether a stage keeps state across evictions (``Stage.state_fields``)."""
        return bool(self.stateful_stages)

    @cached_property
    def observes_queries(self) -> bool:
        """Whether a stage's state must see every query (``Stage.state_updates == "every_query"``):
        caches then update it between evictions too, before unseen queries leave the window."""
        return any(s.state_updates == "every_query" for s in self.stateful_stages.values())

    def nest_state(self, stored: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """``EvictionInput.state`` from fields stored under the names of ``state_fields``."""
        nested: dict[str, dict[str, torch.Tensor]] = {}
        for name, (key, field, _) in self.state_fields.items():
            nested.setdefault(key, {})[field] = stored[name]
        return nested

    def observe(self, inp: EvictionInput, *, eviction: bool = True) -> tuple[EvictionInput, dict[str, torch.Tensor]]:
        """Bring every stateful stage up to date with the window's new queries (``inp.query_new``):
        the input with the new state, and the new fields by stored name (``state_fields``). Each
        stage's update is checked (``guards.run_state_update``); nothing is stored here, so a
        refused update leaves the caller's state as it was. ``eviction``: whether an eviction (or
        a choice) follows; if not, stages that update only at evictions keep their state, and
        their fields are left out of the new fields: the caller's storage already holds them (and
        the input's state may be a view of it, which a store must not write onto itself).

        With state, the inputs are checked here (``guards.check_inputs``), before any stage reads
        them: the selection that follows may pass ``inputs_checked=True``."""
        if inp.state is None:
            return inp, {}
        self.check_values(inp)
        guards.check_inputs(inp)  # name bad keys, values or queries before a stage's state does
        nested = {
            key: guards.run_state_update(stage, inp) if eviction or stage.state_updates == "every_query"
            else dict(inp.state[key])
            for key, stage in self.stateful_stages.items()
        }
        updated = {key for key, stage in self.stateful_stages.items()
                   if eviction or stage.state_updates == "every_query"}
        flat = {name: nested[key][field] for name, (key, field, _) in self.state_fields.items() if key in updated}
        return replace(inp, state=nested), flat

    @property
    def stochastic(self) -> bool:
        """Whether the slots kept depend on random draws, not on the inputs alone.

        True when a stage draws afresh at every eviction (``Stage.stochastic``: the choice then
        depends on the seed and on each row's eviction count), or when the policy's ``seed`` is
        null and a stage draws per layer (``Stage.draws_per_layer``): a null seed is resolved
        afresh at every ``select`` call that passes no ``seed=`` (and for every cache), so even
        those draws change. When False, two ``select`` calls with the same tensors and
        ``layer_idx`` (and the same ``seed=``, if any) keep the same slots, whatever their
        ``evictions`` and ``streams``.
        """
        if any(s.stochastic for s in self.stages):
            return True
        return self.config.seed is None and any(s.draws_per_layer for s in self.stages)

    def __repr__(self) -> str:
        s = self.schedule
        return f"Policy({self.name!r}, budget={s.budget}, recent={s.recent}, interval={s.interval}, window={s.window})"

    def to_yaml(self) -> str:
        return self.config.to_yaml()

    def with_overrides(self, **overrides: Any) -> Policy:
        """A new policy with schedule or top-level fields replaced (``budget=512``)."""
        return Policy(*load_config(self._source if self._source is not None else self.config, overrides,
                                   name=self.name))

    def resolve_seed(self, seed: int | None = None) -> int:
        """``seed``, else the policy file's ``seed``, else a fresh one from the OS (``seed: null``
        in a policy file asks for unreproducible runs)."""
        if seed is None:
            seed = self.config.seed
        if seed is None:
            return secrets.randbits(63)
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 1 << 63:
            raise ValueError(f"seed must be an int in [0, 2**63 - 1], got {seed!r}")
        return seed

    # -- the algorithm ----------------------------------------------------------------------
    def select(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        queries: torch.Tensor,
        *,
        slot_valid: torch.Tensor | None = None,
        query_valid: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        layer_idx: int | torch.Tensor = 0,
        evictions: int | torch.Tensor = 0,
        streams: int | torch.Tensor = 0,
        seed: int | None = None,
        head_offset: int = 0,
        state: Mapping[str, torch.Tensor] | None = None,
        query_new: torch.Tensor | None = None,
        model: ModelFacts | None = None,
        prompt_lengths: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One eviction: the slots to keep among the ``N`` cached ones.

        Args:
            keys: ``[B, Hkv, N, D]`` post-RoPE keys; the last ``schedule.recent`` slots are the
                recent buffer.
            values: ``[B, Hkv, N, Dv]``.
            queries: ``[B, Hq, W, D]`` the window of recent post-RoPE queries, ``Hq % Hkv == 0``.
            slot_valid: ``[B, N]`` or ``[B, Hkv, N]`` bool, False for padding (default: all True);
                padding after a real slot among the last ``recent`` columns is refused (pad on the left).
            query_valid: ``[B, W]`` bool, False for window entries without a real query.
            positions: ``[B, N]`` or ``[B, Hkv, N]`` long token index of each slot among its row's
                real tokens (default: ``0 .. N-1``; ``-1`` for padding).
            layer_idx: the layer (an int, or ``[B]`` per row): keys the fixed per-layer draws.
            evictions: evictions each row has had before this one (an int or ``[B]``): keys the
                fresh per-eviction draws. ``EvictingCache`` passes the same three numbers, so
                ``select`` on a cache's state keeps exactly what the cache keeps.
            streams: each row's random stream (an int or ``[B]``; default 0: a row's draws depend
                on its own layer and evictions only, so identical rows draw identically).
            seed: overrides the policy's ``seed``.
            head_offset: the model's index of the first of the ``Hkv`` heads given (a
                tensor-parallel shard of the heads): per-head draws are keyed by the model's head,
                so each shard keeps what ``select`` on all heads keeps for those heads.
            state: for a policy whose stages keep state (``keeps_state``), its fields by stored
                name (``state_fields``: ``[B, Hkv, N]`` per slot, ``[B, Hkv]`` per head) as they
                were before this eviction (``LayerView.state`` of a cache); default: every field
                at its initial value (a fresh state). Brought up to date with ``query_new``
                (``[B, W]`` bool, default every valid window entry) before any stage scores.
            model: the model facts (``ModelFacts``) for a policy whose stages read them
                (``needs_model``: RoPE, the output projection); checked before any work.
                ``positions`` are then the keys' RoPE positions, and the window's queries are
                taken for the latest tokens (see ``eviction_input``'s ``query_positions``).
            prompt_lengths: each row's prompt tokens (an int or ``[B]``): the slots whose
                ``positions`` are below it hold the prompt. Required by a policy whose stages
                read it (``needs_prompt``, the ``prompt`` reservation); a cache gives its first
                step's real tokens per row (``LayerView.prompt_lengths``).

        Returns:
            ``[B, Hkv, K]`` long, ``K = min(N, budget)``: ascending slot indices, no duplicates,
            always containing every protected slot (recent buffer, sinks, reservations).
        """
        if self.per_head:
            why = (f"selector {self.config.selector.type_name!r}" if self.config.selector.sets_counts
                   else f"allocation {self.config.allocation.type_name!r}")
            raise ValueError(
                f"policy {self.name!r} keeps a different number of slots per head ({why}): use "
                "Policy.select_heads, which returns a keep mask and counts"
            )
        check_tensors(keys, values, queries, slot_valid, query_valid, positions)
        b, hkv, n, _ = keys.shape
        self._check_facts_for_heads(model, head_offset, hkv, queries.shape[1], keys.shape[3])
        self._check_prompt_lengths(prompt_lengths)
        if n <= self.budget:
            return torch.arange(n, device=keys.device).expand(b, hkv, n).clone()
        check_recent_padding(slot_valid, self.schedule.recent)
        inp = eviction_input(
            keys, values, queries, budget=self.budget, recent=self.schedule.recent,
            slot_valid=slot_valid, query_valid=query_valid, positions=positions,
            seed=self.resolve_seed(seed), layer_idx=layer_idx, evictions=evictions, streams=streams,
            head_offset=head_offset, query_new=query_new,
            state=self._given_state(state, b, hkv, n, keys.device, slot_valid, positions), model=model,
            prompt_lengths=prompt_lengths,
        )
        return self.select_from(self.observe(inp)[0])

    def _given_state(
        self, state: Mapping[str, torch.Tensor] | None, b: int, hkv: int, n: int, device: torch.device,
        slot_valid: torch.Tensor | None = None, positions: torch.Tensor | None = None,
    ) -> dict[str, dict[str, torch.Tensor]] | None:
        """``select``'s ``state=`` checked and nested (None: a fresh state), or None for a
        policy that keeps none (then ``state=`` is refused). A fresh field starts at
        ``StateField.initial_values`` of the input's positions (``select``'s defaults)."""
        fields = self.state_fields
        if not fields:
            if state:
                raise ValueError(f"policy {self.name!r} keeps no state, but state= was given ({sorted(state)})")
            return None
        state = dict(state or {})
        if state and set(state) != set(fields):
            raise ValueError(f"state= must hold exactly the policy's state fields {sorted(fields)}, got {sorted(state)}")
        stored = {}
        for name, (_, _, spec) in fields.items():
            shape = (b, hkv, n) if spec.per == "slot" else (b, hkv)
            t = state.get(name)
            if t is None and spec.per == "head":
                t = spec.initial_head_values(shape, device)
            elif t is None:
                if positions is None:  # select's default, as eviction_input fills it
                    valid = torch.ones(b, n, dtype=torch.bool, device=device) if slot_valid is None else slot_valid
                    positions = torch.where(valid, valid.long().cumsum(-1) - 1, -1)
                if positions.dim() == 2:
                    positions = positions[:, None, :].expand(b, hkv, n)
                t = spec.initial_values(positions.to(device))
            elif not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != spec.dtype:
                got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"state field {name!r} must be a {shape} {spec.dtype} tensor, got {got}")
            stored[name] = t.to(device)
        return self.nest_state(stored)

    def select_from(self, inp: EvictionInput, *, inputs_checked: bool = False) -> torch.Tensor:
        """``select`` on an already assembled (and shape-checked) ``EvictionInput``.

        ``inputs_checked``: the caller has refused non-finite keys, values and queries already
        (select mode checks each token once, as it enters the cache: ``guards.check_appended``),
        so they are not read again here.

        Every stage call is checked (``kvpolicy.stages.guards``): the result keeps every promise of
        ``select`` or a ``SelectionError`` (a ``ValueError``) names what is at fault:

        - inputs: keys, values or queries holding NaN or inf (padding included), or float64
          entries beyond float32's range (scores are float32: such inputs are refused, not
          rescaled); a recent buffer larger than the budget; an empty query window (``W = 0``)
          for a policy whose stages read the queries (``Stage.reads_queries``);
        - a stage's result that is not ``[B, Hkv, N]`` (never broadcast), of the wrong dtype or
          device; scores that are NaN or inf on a valid candidate (an overflow: float16 inputs
          are scored in float32, but float32 itself overflows near 3.4e38); NaN priorities;
        - a reservation that protects more slots than the budget keeps, or more candidate slots
          than its ``reserved_count`` declares.

        Protected slots are kept by construction: they rank at +inf, every eligible candidate at
        its priority clamped to float32's finite range, everything else at -inf.

        A policy whose scorer chooses whole pages (``chooses_pages``) is refused: it is ranked by
        page, not slot, in select mode's cache (``kvpolicy.selection.choose_pages``).
        """
        if self.chooses_pages is not None:
            raise guards.SelectionError(
                f"policy {self.name!r} chooses whole pages of {self.chooses_pages} slots (scorer granularity: "
                "page): select mode's cache ranks its pages (kvpolicy.selection.choose_pages); Policy.select ranks "
                "slots, so set scorer.granularity: slot to rank them"
            )
        priority, _ = self.priorities(inp, inputs_checked=inputs_checked)
        return keep_top(priority, inp.budget)

    def priorities(self, inp: EvictionInput, *, inputs_checked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The ranking of one eviction: ``[B, Hkv, N]`` float32 priorities (``+inf`` on protected
        slots, ``-inf`` on slots that may not be kept, the selector's clamped keys elsewhere) and
        the ``[B, Hkv, N]`` protected mask. Every stage call is checked (see ``select_from``)."""
        cfg = self.config
        b, hkv, n = inp.batch, inp.num_kv_heads, inp.num_slots
        self.check_values(inp)
        if inputs_checked:
            guards.check_recent(inp)
        else:
            guards.check_inputs(inp)
        if inp.queries.shape[2] == 0:
            guards.check_query_window(cfg.query_readers(), inp)
        slot_idx = torch.arange(n, device=inp.keys.device)
        protected = (slot_idx >= inp.num_candidates).expand(b, hkv, n).clone()
        for reservation in cfg.reservations:
            protected = guards.run_reservation(reservation, inp, protected)
        scores = None
        if cfg.selector.needs_scores:
            if cfg.scorer is None:  # never: PolicyConfig refuses a scoring selector without a scorer
                raise ValueError(f"selector {cfg.selector.type_name!r} ranks by score but the policy has no scorer")
            scores = guards.run_scorer(cfg.scorer, inp)
        eligible = inp.candidate_mask & ~protected
        priority = guards.run_selector(cfg.selector, scores, inp, eligible)
        priority = priority.clamp(-guards.F32_MAX, guards.F32_MAX)  # never ties with protection
        priority = torch.where(eligible, priority, float("-inf")).masked_fill_(protected, float("inf"))
        return priority, protected

    def select_heads_from(self, inp: EvictionInput, *, inputs_checked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One eviction under a per-head allocation: ``(keep [B, Hkv, N] bool, counts [B, Hkv])``.

        The allocation's ``head_counts`` says how many slots each head keeps (checked by
        ``kvpolicy.stages.guards.run_allocation``), or the selector's when it sets them
        (``Selector.sets_counts``, checked by ``guards.run_selector_counts``); each head keeps that
        many of its highest priorities, so protected slots always (they rank at ``+inf``).
        """
        priority, protected = self.priorities(inp, inputs_checked=inputs_checked)
        if self.config.selector.sets_counts:  # a threshold: each head's own count, at most the budget
            counts = guards.run_selector_counts(self.config.selector, priority, protected, inp)
        else:
            counts = guards.run_allocation(self.config.allocation, priority, protected, inp)
        order = priority.sort(dim=-1, descending=True, stable=True).indices
        rank_kept = torch.arange(inp.num_slots, device=priority.device) < counts[..., None]
        keep = torch.zeros_like(protected).scatter_(-1, order, rank_kept)
        return keep, counts

    def select_heads(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        queries: torch.Tensor,
        *,
        budget: int | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``select`` for any allocation: ``(keep [B, Hkv, N] bool, counts [B, Hkv] long)``.

        Arguments as ``select`` (``budget``: the layer's budget, default the schedule's). Under a
        uniform or per-layer allocation every head keeps ``min(N, budget)``, the slots ``select``
        returns (a row holding fewer valid slots than that keeps padding among them, never over a
        valid slot). A per-head allocation counts what each head keeps of its valid slots: a
        row's counts add up to ``Hkv * min(valid slots, budget)`` where every head holds as many.
        A threshold counts the protected slots it keeps, the recent buffer's padding among them
        where a row's left padding reaches into it. Under a selector that
        sets the counts (a threshold) each head keeps its own count, at most ``budget``, whatever
        ``N`` is (every slot, unscored, while none is a candidate: ``N <= recent``).
        """
        slot_valid, query_valid, positions = (kwargs.get(k) for k in ("slot_valid", "query_valid", "positions"))
        check_tensors(keys, values, queries, slot_valid, query_valid, positions)
        check_recent_padding(slot_valid, self.schedule.recent)
        b, hkv, n, _ = keys.shape
        self._check_facts_for_heads(kwargs.get("model"), kwargs.get("head_offset", 0), hkv, queries.shape[1],
                                    keys.shape[3])
        self._check_prompt_lengths(kwargs.get("prompt_lengths"))
        budget = self.budget if budget is None else budget
        if isinstance(budget, bool) or not isinstance(budget, int) or budget <= self.schedule.recent:
            raise ValueError(f"budget must be an int above the recent buffer ({self.schedule.recent}), got {budget!r}")
        seed = self.resolve_seed(kwargs.pop("seed", None))
        state = self._given_state(kwargs.pop("state", None), b, hkv, n, keys.device, slot_valid, positions)
        inp = eviction_input(
            keys, values, queries, budget=budget, recent=self.schedule.recent, seed=seed, state=state, **kwargs
        )
        inp = self.observe(inp)[0]
        if self.config.selector.sets_counts and inp.num_candidates > 0:  # a threshold applies however few are held
            return self.select_heads_from(inp)
        if n <= budget:  # every slot kept, nothing scored (a threshold's too, when none is a candidate)
            keep = torch.ones(b, hkv, n, dtype=torch.bool, device=keys.device)
            return keep, torch.full((b, hkv), n, dtype=torch.long, device=keys.device)
        if self.config.allocation.per_head:
            return self.select_heads_from(inp)
        kept = self.select_from(inp)
        keep = torch.zeros(b, hkv, n, dtype=torch.bool, device=keys.device).scatter_(-1, kept, True)
        return keep, torch.full((b, hkv), kept.shape[-1], dtype=torch.long, device=keys.device)

    def layer_schedules(self, num_layers: int, num_kv_heads: int | None = None) -> list[Schedule]:
        """Each layer's schedule under the policy's allocation (its ``budget`` is the layer's).

        Raises:
            PolicyError: the allocation cannot serve this model (a profile or a per-layer list
                for another shape), leaves a layer whose budget holds no candidate after the
                protected slots, or gives a layer a budget its stages refuse (the checks the
                policy's schedule passed at load: a chunk or a page larger than the layer's room);
                the problem names the ``allocation`` field and the layer.
        """
        key = (num_layers, num_kv_heads)
        if key not in self._layer_schedules:  # a pure function of the policy: every group of a vLLM worker asks
            self._layer_schedules[key] = tuple(self._checked(self.config.allocation.layer_schedules(
                self.schedule, self.config.reservations, num_layers, num_kv_heads, self.name
            )))
        return list(self._layer_schedules[key])

    def _checked(self, schedules: list[Schedule]) -> list[Schedule]:
        """``schedules``, once every layer's budget passes the load's checks of the policy's own
        (``PolicyConfig.check_schedule``): refused otherwise, naming each layer of a new budget."""
        problems, seen = [], {self.schedule.budget}
        for layer, schedule in enumerate(schedules):
            if schedule.budget in seen:
                continue
            seen.add(schedule.budget)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the policy's own schedule warned at load
                    self.config.check_schedule(schedule)
            except ValueError as exc:
                problems.append(f"allocation: layer {layer} gets a budget of {schedule.budget} slots: {exc}")
        if problems:
            raise PolicyError(problems, self.name)
        return schedules

    def prompt_schedules(self, inputs: Sequence[EvictionInput]) -> list[Schedule]:
        """``from_prompt`` allocations (CAKE): each layer's schedule from what every layer holds
        at the first eviction (``inputs[l]``: layer ``l``'s slots and query window), decided once.
        ``EvictingCache`` (every row of its batch at once) and vLLM's workers (each request alone,
        ``kvpolicy.vllm.paged_cache.decide_layer_budgets``) both decide through this.

        Raises:
            PolicyError: the allocation gave budgets that do not add up to the layers' total,
                leave a layer no candidate after the recent buffer, or that the layer's stages
                refuse (as ``layer_schedules``).
        """
        schedule = self.schedule
        budgets = self.config.allocation.prompt_budgets(schedule.budget, schedule.recent, inputs)
        layers = len(inputs)
        if len(budgets) != layers or sum(budgets) != layers * schedule.budget or min(budgets) <= schedule.recent:
            raise PolicyError(
                [f"allocation {self.config.allocation.type_name!r} gave the layer budgets {budgets}: {layers} "
                 f"budgets above the recent {schedule.recent}, adding up to {layers * schedule.budget}, were due"],
                self.name,
            )
        return self._checked([schedule.model_copy(update={"budget": b}) for b in budgets])


def keep_top(priority: torch.Tensor, k_keep: int) -> torch.Tensor:
    """The ``k_keep`` slots of largest ``priority [B, Hkv, N]``, ascending: ``[B, Hkv, k_keep]``.
    The one place that ranks, for ``Policy.select_from`` and select mode's direct paths alike
    (which of equal priorities are kept is up to ``topk``: the same call keeps the same ones)."""
    b, hkv, n = priority.shape
    if 2 * k_keep <= n:
        kept = priority.topk(k_keep, dim=-1, sorted=False).indices
        return kept.sort(dim=-1).values
    # Keeping most slots (the usual case: N = budget + interval): find the few to drop, and
    # read the kept ones off a mask, which comes out ascending without a sort.
    drop = priority.topk(n - k_keep, dim=-1, largest=False, sorted=False).indices
    keep = torch.ones_like(priority, dtype=torch.bool).scatter_(-1, drop, False)
    return keep.nonzero()[:, -1].view(b, hkv, k_keep)
