"""The engine-core side: block accounting that follows each request's slots, not its tokens.

The scheduler replays the workers' ``SlotLedger`` (``kvpolicy.vllm.ledger``): after each step
(``Scheduler.update_from_output``, wrapped) a request that is due for eviction gives back the
blocks past its kept slots to vLLM's ``BlockPool``; and every later allocation for it
(``SingleTypeKVCacheManager.get_num_blocks_to_allocate`` / ``allocate_new_blocks``, wrapped)
counts its slots, ``num_computed_tokens`` minus the tokens evicted so far. A request's entry goes
when vLLM frees its blocks (finished, aborted or preempted). Each request runs its own policy's
schedule (``settings.request_policy``: its own, else the server's).

**With prefix caching on**, a request's blocks may be read by other requests (prefix-cache hits)
or handed out again later (cached blocks in the free queue): compaction must never write them.
Until its first eviction every full block of a request is (or is about to be) in the prefix
cache, so at the step after which a request first evicts, its allocation asks vLLM for
``ceil(budget / block_size)`` more blocks (``copy_blocks``: counted and allocated by vLLM like any
other, so vLLM waits or preempts as usual when they are short); the workers compact the kept
slots into those fresh blocks, and the request then drops all its old blocks: each goes back to
the pool when its last reader lets go, its cached contents unchanged. After its first eviction a
request's blocks are never cached (``caches``), so later evictions compact in place, as with
prefix caching off. See docs/vllm.md ("Prefix caching") for why this is safe.

**When the accounting happens.** A request's eviction is accounted when the step that makes it
due is *scheduled* (``Scheduler.schedule``, wrapped), not when its output comes back: the rule
depends only on token counts, which the scheduler knows then. The blocks it frees can go to
other requests from the next scheduled step on, which every worker runs after this step's
eviction. So the accounting is the same whether vLLM schedules the next step before this one's
output is back (async scheduling) or after.

**Per-layer budgets** (``budgets.per_layer``: PyramidKV). The server's layers then have a
KV-cache group each (``kvpolicy.vllm.layer_spec``), and each group a ledger of its own on that
layer's schedule (``budgets.group_schedules``; under per-head counts with that layer's room
for its fullest head, ``budgets.group_head_caps``: DuoAttention's largest head share):
allocations for a group's manager count that group's slots, and a group that evicts gives back
its own blocks past its kept slots.

**Layer budgets decided from the prompt** (``budgets.decides_from_prompt``: CAKE, on a server
with a group per layer). The workers decide a request's layer budgets at its first eviction, from
its own prompt (``kvpolicy.vllm.paged_cache.decide_layer_budgets``); the scheduler cannot, so that
eviction leaves its ledger entries awaiting them (``SlotLedger.evicted``), holding every block.
When that step's output is back (``after_update``; at the latest when the request is preempted)
it asks the workers (``collective_rpc``, ``worker.reported_layer_budgets``), applies each group's
eviction (``SlotLedger.decide``, which also replays any step scheduled meanwhile), frees the blocks
past the kept slots, and tells the workers which blocks each group keeps (``worker.trim_blocks``)
before it schedules another step; their block tables then match its own again. The budgets stay
on the vLLM ``Request`` (``BUDGETS_ATTR``): a recompute after preemption replays them.

**Admission keeps room for every admitted request's peak** (``admission_reserve``, under
first-come-first-served scheduling): vLLM's check that a waiting request's whole sequence fits the
free blocks also counts what it and each running request may still take before they evict again
(bounded, and reached within an interval). A request admitted into that room would be the first
preempted (the last admitted) when they grow, and recomputed from its prompt.

**Preemption replays evictions.** A preempted request keeps its eviction points
(``SlotLedger.replay_plan``, kept on the vLLM ``Request``); when vLLM recomputes it, each step's
tokens for it are capped to end at the next point (``replay_cap``), so it evicts at exactly the
points it did and never holds more slots than it did uninterrupted (see ``kvpolicy.vllm.ledger``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..schedule import Schedule
from . import contract
from .ledger import SlotLedger, compaction, kept_held, peak_bound, prefix_hit_cap, replay_boundary
from .plans import PolicyPlan, cdiv
from .settings import PerPolicy, Resolved, request_policy
from .support import KVPolicyInvariantError, KVPolicyVLLMError
from .trace import SchedulerCounts, SchedulerTrace

#: The scheduler state of this engine-core process (one scheduler per engine core), None when inactive.
_STATE: SchedulerEviction | None = None


@dataclass(frozen=True)
class Workers:
    """What the engine core learns of its workers once, when they start evicting (``ask``),
    before the scheduler exists or any request arrives: the executor, through which the scheduler
    asks them for the layer budgets they decided (``worker.reported_layer_budgets``); the model
    facts some rank cannot give, with the first such rank's reason; and each rank's fingerprint
    of the model's heads it holds (``ModelFingerprint.to_dict``, None: none). With the last two
    a request whose policy needs a fact the workers lack, or whose calibration was measured on
    another model, is refused alone (``refusals.model_refusal``)."""

    executor: Any = None
    missing_facts: Mapping[str, str] = field(default_factory=dict)
    fingerprints: Sequence[Mapping[str, Any] | None] = ()

    @staticmethod
    def ask(executor: Any) -> Workers:
        from .worker import worker_facts

        missing: dict[str, str] = {}
        fingerprints = []
        for rank_missing, fingerprint in executor.collective_rpc(worker_facts):  # one answer per rank
            for fact, why in rank_missing.items():
                missing.setdefault(fact, why)
            fingerprints.append(fingerprint)
        return Workers(executor, missing, fingerprints)


#: The workers of this engine-core process, with the configuration of the engine they serve
#: (``set_workers``): a scheduler takes them for that engine only (``workers_of``).
_WORKERS: tuple[Any, Workers] | None = None


def set_workers(executor: Any) -> None:
    global _WORKERS
    contract.check(executor, contract.EXECUTOR)
    _WORKERS = (executor.vllm_config, Workers.ask(executor))


def workers_of(vllm_config: Any) -> Workers:
    """The workers asked at the start-up of the engine of ``vllm_config``; refused when they were
    not (its scheduler would take another engine's answers, or none, for requests' model facts)."""
    if _WORKERS is None or _WORKERS[0] is not vllm_config:
        raise KVPolicyInvariantError(
            "the engine's workers were not asked for their model facts before its scheduler was built "
            "(vLLM's Executor.initialize_from_config did not run for this engine)")
    return _WORKERS[1]


def ledgers() -> list[SlotLedger]:
    """The ledger of each KV-cache group (one, unless the server keeps per-layer budgets)."""
    return [] if _STATE is None else _STATE.ledgers


def state() -> SchedulerEviction | None:
    return _STATE


#: Where a preempted request's eviction points wait for its recompute (an attribute of vLLM's
#: ``Request``: it lives and dies with the request).
REPLAY_ATTR = "_kvpolicy_replay"
#: Where a request's ``PolicyPlan`` stays once resolved (likewise).
PLAN_ATTR = "_kvpolicy_plan"
#: Where a request's layer budgets decided from its prompt stay (by KV-cache group), for its replays.
BUDGETS_ATTR = "_kvpolicy_layer_budgets"
#: Where a request's peak slots per KV-cache group stay (``counted_slots``; likewise).
PEAKS_ATTR = "_kvpolicy_peaks"


class SchedulerEviction:
    def __init__(self, scheduler: Any, resolved: Resolved) -> None:
        global _STATE
        self.scheduler = scheduler
        self.resolved = resolved
        # One KV-cache group shared by every layer, or (a server under per-layer budgets,
        # ``kvpolicy.vllm.layer_spec``) a group per layer: group g is layer group_layers[g], and
        # keeps a ledger of its own, on that layer's schedule (``budgets.group_schedules``).
        groups = scheduler.kv_cache_config.kv_cache_groups
        self.group_layers: list[int] | None = None
        if len(groups) > 1:
            self.group_layers = [int(getattr(g.kv_cache_spec, "kvpolicy_layer", -1)) for g in groups]
            if min(self.group_layers) < 0 or sorted(self.group_layers) != list(range(len(groups))):
                raise KVPolicyVLLMError(f"expected one KV cache group per layer (per-layer budgets) or one in all, "
                                        f"got {len(groups)} groups of layers {self.group_layers}")
        self.ledgers = [SlotLedger() for _ in groups]
        self.ledger = self.ledgers[0]
        self.plans: PerPolicy[str | None, PolicyPlan] = PerPolicy()  # each distinct policy's, by its resolved YAML
        self.prefix_caching = bool(scheduler.vllm_config.cache_config.enable_prefix_caching)
        _STATE = self
        self.trace = SchedulerTrace(Path(resolved.trace)) if resolved.trace else None
        self.counts = SchedulerCounts()
        self.step = 0
        self.workers = workers_of(scheduler.vllm_config)  # asked at start-up, before this scheduler existed
        # Admission keeps room for every admitted request's peak (``admission_reserve``) under
        # first-come-first-served scheduling only.
        self.reserves_peaks = scheduler.policy.value == "fcfs"
        #: Requests whose first eviction's layer budgets the workers decide (``decides_from_prompt``),
        #: by id: the scheduler output of the step that evicts, until the budgets are back.
        self.awaiting: dict[str, Any] = {}

    def plan(self, request: Any) -> PolicyPlan:
        """The request's policy as this server runs it: resolved from its sampling parameters once
        (kept on the request, ``PLAN_ATTR``), planned once per distinct policy (``PolicyPlan``)."""
        plan = request.__dict__.get(PLAN_ATTR)
        if plan is None:
            r = request_policy(request.sampling_params.extra_args, self.resolved)  # raises for unresolved settings
            plan = self.plans.get_or_make(r.policy_yaml, lambda: PolicyPlan.build(
                r, self.scheduler.vllm_config, self.group_layers, self.workers.missing_facts,
                self.workers.fingerprints))
            request.__dict__[PLAN_ATTR] = plan
        return plan

    def _group_schedules(self, request: Any) -> list[Schedule | None]:
        """The schedule of each KV-cache group for the request (``budgets.group_schedules``)."""
        plan = self.plan(request)
        if not plan.group_schedules:  # admitted requests never get here (``admit``)
            raise KVPolicyVLLMError(f"request {request.request_id}: {plan.refusal}")
        return plan.group_schedules

    def _tracked(self, req_id: str) -> bool:
        """Track a request the scheduler knows (on its first allocation); False for unknown ids."""
        if self.ledger.tracks(req_id):
            return True
        request = self.scheduler.requests.get(req_id)
        if request is None:
            return False
        self._track(request)
        return True

    def _track(self, request: Any) -> None:
        # The plan stays on the request (replaced at its next preemption): a recompute whose
        # first allocation fails is tracked again later and its prefix hit must stay capped.
        plans = request.__dict__.get(REPLAY_ATTR)
        policy_plan = self.plan(request)
        caps, from_prompt = policy_plan.head_caps, policy_plan.from_prompt
        budgets = request.__dict__.get(BUDGETS_ATTR)  # decided in an earlier run: its replay keeps them
        for g, (ledger, schedule) in enumerate(zip(self.ledgers, self._group_schedules(request), strict=True)):
            layer = None if budgets is None or schedule is None else schedule.model_copy(update={"budget": budgets[g]})
            ledger.resume(request.request_id, schedule, None if plans is None else plans[g], caps[g],
                          from_prompt=from_prompt, layer_schedule=layer)

    # -- preemption -------------------------------------------------------------------------
    def on_preempt(self, request: Any) -> None:
        """Before vLLM frees a preempted request: keep each group's eviction points for the recompute."""
        if request.request_id in self.awaiting:  # its eviction points depend on the budgets
            self._decide([request.request_id])
        found = [ledger.replay_plan(request.request_id) for ledger in self.ledgers]
        plans: list[list[int] | None] | None = found
        if found[0] is None and not self.ledger.tracks(request.request_id):
            plans = request.__dict__.get(REPLAY_ATTR)  # preempted again before it was scheduled
        elif all(p is None for p in found):
            plans = None
        if plans is not None:
            plans = [p or [] for p in plans]
            request.__dict__[REPLAY_ATTR] = plans
            self.counts.preempted += 1
            self.counts.preempted_after_evicting += any(plans)

    def replay_cap(self, request: Any, computed: int, num_new: int) -> int:
        """``num_new`` tokens scheduled for a request from ``computed``, capped so that a request
        being recomputed after preemption ends the step at its next eviction point or prompt end."""
        entries = [ledger.requests.get(request.request_id) for ledger in self.ledgers]
        entry = entries[0]
        stored = request.__dict__.get(REPLAY_ATTR)
        # Every group's eviction points bound the chunks: a chunk never crosses one of them.
        if entry is not None:
            plan: list[int] | None = sorted({p for e in entries if e is not None for p in e.replay})
        else:
            plan = None if stored is None else sorted({p for group in stored for p in group})
        if plan is None or (entry is not None and all(e is None or e.schedule is None for e in entries)):
            return self._select_cap(request, computed, num_new)
        if entry is not None and not plan and computed >= request.num_prompt_tokens:
            return num_new
        end = replay_boundary(plan, int(request.num_prompt_tokens), computed)
        if end is None:
            return num_new
        capped = min(num_new, end - computed)
        self.counts.replay_cuts += capped < num_new
        return capped

    def _select_cap(self, request: Any, computed: int, num_new: int) -> int:
        """A select-mode request (``kvpolicy.vllm.select``) computes every token past its prompt
        and its budget in a step of its own, as it decoded it: a recompute after preemption then
        attends the same selections (a chunk would attend densely). Its prompt and the tokens
        before its budget may come in chunks (they attended every slot)."""
        budget = self.plan(request).select_budget
        if budget is None:
            return num_new
        end = max(int(request.num_prompt_tokens), budget)
        capped = min(num_new, end - computed) if computed < end else 1
        self.counts.replay_cuts += capped < num_new
        return capped

    def counted_slots(self, req_id: str, num_tokens: int, group: int = 0) -> int:
        """Slots of KV-cache group ``group`` to allocate for a request to reach ``num_tokens``
        tokens: its tokens less those the group evicted, and never more than its schedule's peak.
        (The peak binds only vLLM's admission check that a request's whole sequence fits the pool:
        a request recomputed after preemption replays its evictions and never holds its whole
        sequence.)"""
        entry = self.ledgers[group].requests.get(req_id)
        slots = num_tokens if entry is None else num_tokens - entry.offset
        request = self.scheduler.requests.get(req_id)
        bound = None if request is None else self._peak(request, group)
        return slots if bound is None else min(bound, slots)

    def _peak(self, request: Any, group: int) -> int | None:
        """The most slots of KV-cache group ``group`` the request holds at once (``peak_bound``);
        None: no bound (it never evicts there, or it awaits the layer budget its first eviction
        decides, holding every slot until then)."""
        entry = self.ledgers[group].requests.get(request.request_id)
        if entry is not None and entry.awaiting:
            return None
        bound = self._peak_bounds(request)[group]
        if bound is not None and entry is not None and entry.layer_schedule is not None:  # decided from its prompt
            cap = self.plan(request).head_caps[group]
            bound = max(bound, peak_bound(entry.layer_schedule, int(request.num_prompt_tokens), cap))
        return bound

    def admission_reserve(self, manager: Any, req_id: str, counted: int) -> int:
        """Blocks of ``manager``'s KV-cache group that vLLM's check that the waiting request
        ``req_id`` fits (which counts ``counted`` blocks for its sequence so far) must also find
        free: the room of each running request and of ``req_id`` to its peak (or to its whole
        length, if shorter), less the blocks each holds or is counted. Requests without a bound (no
        eviction, select mode) count nothing, as vLLM counts nothing for growth; under priority
        scheduling nothing counts (vLLM admits and preempts by priority: its choice)."""
        if not self.reserves_peaks:
            return 0
        group, size = int(manager.kv_cache_group_id), int(manager.block_size)
        held = manager.req_to_blocks

        def room(request: Any, blocks: int) -> int:
            peak = self._peak(request, group)
            if peak is None:
                return 0
            longest = request.sampling_params.max_tokens
            if longest is not None:
                peak = min(peak, int(request.num_prompt_tokens) + int(longest))
            return max(0, cdiv(peak, size) - blocks)

        reserve = sum(room(r, len(held.get(r.request_id, ()))) for r in self.scheduler.running if r.request_id != req_id)
        waiting = self.scheduler.requests.get(req_id)
        if waiting is not None:
            reserve += room(waiting, len(held.get(req_id, ())) + counted)
        return reserve

    def _peak_bounds(self, request: Any) -> list[int | None]:
        """Each group's ``peak_bound`` for the request (None: that group never evicts it), worked
        out once per request (kept on it, ``PEAKS_ATTR``): vLLM asks every group twice a step."""
        bounds = request.__dict__.get(PEAKS_ATTR)
        if bounds is None:
            prompt, caps = int(request.num_prompt_tokens), self.plan(request).head_caps
            bounds = [None if s is None else peak_bound(s, prompt, cap)
                      for s, cap in zip(self._group_schedules(request), caps, strict=True)]
            request.__dict__[PEAKS_ATTR] = bounds
        return bounds

    # -- admission ------------------------------------------------------------------------------
    def admit(self, request: Any) -> None:
        """Refuse, alone, a request the engine cannot serve (``KVPolicyVLLMError``): kvpolicy
        settings the front end did not resolve, or what ``PolicyPlan.request_refusal`` refuses
        (a policy this server cannot serve, a prompt its policy must keep whole and its budget
        cannot hold, more blocks than the KV pool has)."""
        plan = self.plan(request)  # raises for unresolved settings
        manager = self.scheduler.kv_cache_manager
        refusal = plan.request_refusal(int(request.num_prompt_tokens), request.sampling_params.max_tokens,
                                       manager.block_pool.num_gpu_blocks,
                                       manager.coordinator.single_type_managers[0].block_size, self.prefix_caching)
        if refusal is not None:
            raise KVPolicyVLLMError(f"request {request.request_id}: {refusal}")

    # -- prefix caching ---------------------------------------------------------------------
    def copy_blocks(self, req_id: str, num_tokens: int, block_size: int, group: int = 0) -> int:
        """Fresh blocks of KV-cache group ``group`` to allocate with this step's for a request
        that first evicts after it (prefix caching: one group only, ``refusals.per_layer_refusals``)."""
        if not self.prefix_caching or not self._tracked(req_id):
            return 0
        ledger = self.ledgers[group]
        entry = ledger.get(req_id)
        if entry.schedule is None or entry.evictions:
            return 0
        prompt = self.scheduler.requests[req_id].num_prompt_tokens
        if not ledger.would_fire(req_id, num_tokens, prompt):
            return 0
        return cdiv(kept_held(entry.schedule, entry.head_cap, entry.held + num_tokens - entry.tokens), block_size)

    def caches(self, req_id: str) -> bool:
        """Whether vLLM may put the request's full blocks in the prefix cache: not once it has
        evicted (its slot ``s`` no longer holds token ``s``), nor, under select mode, once it
        computes the tokens it attends a selection for (their keys are not full attention's, which
        another request with the same tokens would expect)."""
        if any(ledger.requests[req_id].evictions for ledger in self.ledgers if ledger.tracks(req_id)):
            return False
        request = self.scheduler.requests.get(req_id)
        if request is None:
            return True
        budget = self.plan(request).select_budget
        return budget is None or request.num_computed_tokens < max(int(request.num_prompt_tokens), budget)

    def computed_blocks(self, request: Any, found: Any, hit: int, block_size: int) -> tuple[Any, int]:
        """A new request's prefix-cache hit (``found`` blocks per group, ``hit`` tokens), shortened
        where its first eviction needs queries of the hit tokens (``prefix_hit_cap``)."""
        plan = self.plan(request)
        schedule = plan.schedule
        cap = prefix_hit_cap(schedule, request.num_prompt_tokens)
        if plan.sees_every_query:
            # Its state must see every prompt query, and a hit's tokens are never computed: it
            # computes its whole prompt (exact; it still fills the prefix cache for others).
            cap = 0
        if schedule is not None and REPLAY_ATTR in request.__dict__:
            # A recompute starts its ledger at the hit: the hit must end inside the prompt, as a
            # new request's does (the prompt's end is a replay boundary).
            inside = int(request.num_prompt_tokens) - 1
            cap = inside if cap is None else min(cap, inside)
        if cap is not None and hit > cap:
            hit = cap // block_size * block_size
            found = tuple(group[: hit // block_size] for group in found)
            self.counts.hits_capped += 1
        self.counts.prefix_queried += int(request.num_tokens)
        self.counts.prefix_hit += hit
        return found, hit

    # -- each scheduled step ----------------------------------------------------------------
    def after_schedule(self, scheduler_output: Any) -> None:
        """Account the evictions the step just scheduled will make (the workers run them after
        its forward): the request's kept slots stay, the blocks past them go back to the pool."""
        sched = self.scheduler
        managers = sched.kv_cache_manager.coordinator.single_type_managers
        evicted = 0
        for req_id in scheduler_output.num_scheduled_tokens:
            request = sched.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if not self.ledger.tracks(req_id):
                self._track(request)
            any_group = False
            # Each KV-cache group (every layer, or one layer under per-layer budgets) runs its own
            # ledger entry: a group that evicts gives back the blocks past its own kept slots.
            for ledger, mgr in zip(self.ledgers, managers, strict=True):
                if not ledger.advance(req_id, request.num_computed_tokens, request.num_prompt_tokens):
                    continue
                any_group = True
                entry = ledger.get(req_id)
                held, first = entry.held, entry.evictions == 0
                kept = ledger.evicted(req_id)
                if entry.awaiting:  # the workers decide what it keeps: its blocks stay until they say
                    self.awaiting.setdefault(req_id, scheduler_output)
                    continue
                self._trim(mgr, req_id, held, kept, first)
            evicted += any_group
        if self.trace is not None:  # written when the step's output is back (at most a few steps in flight)
            self.trace.scheduled(scheduler_output, evicted)

    def _trim(self, mgr: Any, req_id: str, held: int, kept: int, first: bool) -> None:
        """A group's blocks of a request that evicted from ``held`` block-table slots to ``kept``."""
        blocks = mgr.req_to_blocks.get(req_id)
        if not blocks:
            return
        moved = compaction(blocks, held, kept, mgr.block_size, fresh=self.prefix_caching and first,
                           req_id=f"{req_id} (group {mgr.kv_cache_group_id})")
        blocks[:] = moved.kept
        tail, copied = moved.freed, moved.copied
        if tail:  # freed tail first: vLLM evicts cached blocks from the free queue in that order
            mgr.block_pool.free_blocks(reversed(tail))
        if copied:  # released: each returns to the pool when its last reader lets go
            mgr.block_pool.free_blocks(reversed(copied))
        self.counts.blocks_freed += len(tail) + len(copied)
        self.counts.blocks_copied += len(copied)

    def _decide(self, req_ids: list[str]) -> None:
        """The layer budgets the workers decided for these awaiting requests' first evictions:
        each group's eviction applied, the blocks past its kept slots freed, and the workers told
        which blocks each group keeps, before another step is scheduled."""
        executor = self.workers.executor
        if executor is None:
            raise KVPolicyInvariantError("the scheduler cannot ask the workers for layer budgets (no executor)")
        from .worker import reported_layer_budgets, trim_blocks

        reported = executor.collective_rpc(reported_layer_budgets, args=(req_ids,))[0]  # every rank decides alike
        managers = self.scheduler.kv_cache_manager.coordinator.single_type_managers
        keep: dict[str, list[int]] = {}
        for req_id in req_ids:
            self.awaiting.pop(req_id, None)
            budgets = reported.get(req_id)
            if budgets is None or len(budgets) != len(self.ledgers):
                raise RuntimeError(f"kvpolicy: request {req_id}: the workers report layer budgets {budgets} for its "
                                   f"first eviction, for {len(self.ledgers)} KV-cache groups")
            request = self.scheduler.requests.get(req_id)
            if request is None:  # finished: its blocks are gone
                continue
            request.__dict__[BUDGETS_ATTR] = budgets
            if not self.ledger.tracks(req_id):
                continue
            for ledger, mgr, budget in zip(self.ledgers, managers, budgets, strict=True):
                held, kept = ledger.decide(req_id, ledger.get(req_id).evicts_to().model_copy(update={"budget": budget}))
                self._trim(mgr, req_id, held, kept, first=False)
            keep[req_id] = [len(mgr.req_to_blocks.get(req_id, ())) for mgr in managers]
        if keep:
            executor.collective_rpc(trim_blocks, args=(keep,))

    def after_update(self, scheduler_output: Any) -> None:
        """After a step's output came back: the layer budgets decided in it, and the trace record."""
        ready = [r for r, out in self.awaiting.items() if out is scheduler_output]
        if ready:
            self._decide(ready)
        self.step += 1
        if self.trace is not None:
            self.trace.write(self.scheduler, scheduler_output, self.step, self.counts)


def init_scheduler(scheduler: Any) -> None:
    resolved = Resolved.from_additional_config(scheduler.vllm_config.additional_config)
    if resolved is None:
        return
    scheduler.__dict__["_kvpolicy"] = SchedulerEviction(scheduler, resolved)


def state_of(scheduler: Any) -> SchedulerEviction | None:
    return scheduler.__dict__.get("_kvpolicy")
