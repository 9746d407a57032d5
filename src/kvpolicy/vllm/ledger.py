"""Slots held versus tokens seen, per request: the one rule the scheduler and every worker share.

vLLM's scheduler (engine-core process) and its workers (one process per tensor-parallel rank)
never exchange eviction results. They do not need to: when eviction fires depends only on the
policy's schedule and on each request's token counts, and every rank keeps exactly ``budget``
slots per request, so each process replays the same ``SlotLedger`` and agrees on every request's
slot count, and so on its number of blocks, at every step.

**Per-head budgets** (Ada-KV, DuoAttention: ``head_cap``). Heads of a layer then keep different
counts, decided from data the scheduler never sees; all heads of a layer share its block table,
and vLLM writes a new token at one slot for every head. So after each eviction a request holds,
in its block table, room for the fullest head any data could give (``head_cap``, from the
allocation's floor and the layer's total, ``Allocation.head_cap``; under per-layer groups each
group's own, ``budgets.group_head_caps``) but never more than it held: ``held = slots + reserve``,
where ``slots`` is still the mean count its schedule runs on (what ``EvictingCache`` counts). The
room is the same for every process, whatever the heads kept.

Each request carries its own schedule (requests may name their own policies); ``None`` for a
request that never evicts.

**Per-layer budgets** (PyramidKV). A server whose layers keep budgets of their own has a KV-cache
group, so a block table, per layer; the scheduler and every worker then keep one ``SlotLedger``
per group, each request's entry there on that layer's schedule
(``kvpolicy.vllm.budgets.group_schedules``). The rule is the same: ``Schedule.due`` on the
group's own slots and budget, as ``EvictingCache`` runs it per layer group.

**Layer budgets decided from the prompt** (CAKE: ``budgets.decides_from_prompt``). Every layer
runs the policy's own schedule until the request's first eviction, where the workers decide each
layer's budget from what it holds (``Policy.prompt_schedules``); from then on each group's entry
runs its layer's schedule (``RequestSlots.layer_schedule``). The workers know it at once; the
scheduler learns it when that step's output is back, and until then the entry awaits it
(``RequestSlots.awaiting``: it holds every slot, and ``decide`` then applies the eviction).

**Replay after preemption.** vLLM recomputes a preempted request from its tokens. Each entry
records where its evictions fell (``evicted_at``); ``replay_plan`` turns that into the chunk
boundaries a resumed request is recomputed by (the prompt's end and every eviction point), and
``resume`` starts a new entry that must evict at exactly those points again: its cache is then
the one it had, and it never holds more than an uninterrupted run does. The scheduler and every
worker replay the same plan from their own ledgers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..schedule import Schedule, step_phase


@dataclass
class RequestSlots:
    schedule: Schedule | None = None  # the request's policy's schedule; None: it never evicts
    tokens: int = 0  # tokens whose keys and values were computed (RoPE positions 0 .. tokens-1)
    slots: int = 0  # slots held in the request's blocks
    evictions: int = 0
    evicted_at: list[int] = field(default_factory=list)  # token counts after which it evicted
    replay: list[int] = field(default_factory=list)  # eviction points still to replay (ascending)
    head_cap: int | None = None  # the most slots one head may keep at an eviction (per-head budgets)
    reserve: int = 0  # block-table slots held beyond ``slots``: room for the fullest head (per-head budgets)
    from_prompt: bool = False  # its layer budgets are decided at its first eviction (CAKE)
    layer_schedule: Schedule | None = None  # from_prompt: the schedule from its first eviction on, once known
    awaiting_held: int | None = None  # awaiting: slots held at the first eviction, whose budget is not known yet
    awaited_steps: list[tuple[int, int]] = field(default_factory=list)  # awaiting: (tokens after, prompt) of each step since

    @property
    def awaiting(self) -> bool:
        """Whether the request evicted and this process does not know yet what it kept (the
        scheduler, until the workers report the layer budgets of a ``from_prompt`` request)."""
        return self.awaiting_held is not None

    @property
    def held(self) -> int:
        """Slots of the request's block table in use: the mean count and the per-head room."""
        return self.slots + self.reserve

    def evicts_to(self) -> Schedule:
        """The schedule whose budget the request's next eviction keeps: its own, or at a first
        eviction that decided its layer budget (``from_prompt``), that layer's."""
        if self.from_prompt and self.evictions == 0 and self.layer_schedule is not None:
            return self.layer_schedule
        if self.schedule is None:
            raise RuntimeError("kvpolicy: a request that never evicts was due")
        return self.schedule

    def kept_room(self, held: int) -> int:
        """The block-table slots the request, holding ``held``, keeps through its next eviction
        (``kept_held``: under per-head budgets the room for its fullest head)."""
        if self.schedule is None:
            raise RuntimeError("kvpolicy: a request that never evicts was due")
        return kept_held(self.schedule, self.head_cap, held)

    @property
    def offset(self) -> int:
        """Tokens evicted so far, less the per-head room: block-table slot ``s`` appended since the
        last eviction holds token ``s + offset``."""
        return self.tokens - self.held


class SlotLedger:
    """Per-request slot accounting, each request under its own schedule (no tensors, no vLLM)."""

    def __init__(self) -> None:
        self.requests: dict[str, RequestSlots] = {}

    def track(self, req_id: str, schedule: Schedule | None, head_cap: int | None = None, *,
              from_prompt: bool = False, layer_schedule: Schedule | None = None) -> RequestSlots:
        """Start counting a request (again, after a reset) under ``schedule`` (``head_cap``: its
        policy's per-head bound, ``kvpolicy.vllm.budgets.head_cap``; ``from_prompt``: its layer
        budgets are decided at its first eviction, ``layer_schedule`` when already known)."""
        state = self.requests[req_id] = RequestSlots(schedule, head_cap=head_cap, from_prompt=from_prompt,
                                                     layer_schedule=layer_schedule)
        return state

    def get(self, req_id: str) -> RequestSlots:
        state = self.requests.get(req_id)
        if state is None:
            raise KeyError(f"request {req_id} is not tracked (SlotLedger.track it first)")
        return state

    def tracks(self, req_id: str) -> bool:
        return req_id in self.requests

    def offset(self, req_id: str) -> int:
        state = self.requests.get(req_id)
        return 0 if state is None else state.offset

    def reset(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    def replay_plan(self, req_id: str) -> list[int] | None:
        """The eviction points a preempted request must replay: those it had, then those of an
        earlier plan it had not reached again (preempted during a replay). None: nothing to
        replay (not tracked, or it never evicts)."""
        state = self.requests.get(req_id)
        if state is None or state.schedule is None:
            return None
        return [*state.evicted_at, *(p for p in state.replay if p > state.tokens)]

    def resume(self, req_id: str, schedule: Schedule | None, plan: list[int] | None,
               head_cap: int | None = None, *, from_prompt: bool = False,
               layer_schedule: Schedule | None = None) -> RequestSlots:
        """Track a request recomputed after preemption: a fresh count that must evict at ``plan``
        (a ``from_prompt`` request with the ``layer_schedule`` its first run decided)."""
        state = self.track(req_id, schedule, head_cap, from_prompt=from_prompt, layer_schedule=layer_schedule)
        state.replay = list(plan or [])
        return state

    def advance(self, req_id: str, tokens_after: int, prompt_len: int, *, probe: bool = False) -> bool:
        """Record a step that brought the request to ``tokens_after`` computed tokens; True when
        it is now due for eviction.

        The schedule runs on the request's own tokens, as ``EvictingCache`` does for a row, by
        ``Schedule.step_due`` and ``step_phase`` (the rules the caches ask): a prefill chunk
        never evicts, the step that completes the prompt evicts only when the policy compresses
        long prompts, every later step when ``Schedule.due`` says so.
        """
        state = self.get(req_id)
        before = state.tokens
        added = tokens_after - before
        if added < 0:
            raise RuntimeError(f"request {req_id}: token count went back from {before} to {tokens_after}")
        state.slots += added
        state.tokens = tokens_after
        sched = state.schedule
        if sched is None:
            return False
        if state.awaiting:  # whether it is due depends on its layer's budget: decided in ``decide``
            state.awaited_steps.append((tokens_after, prompt_len))
            return False
        due = bool(sched.step_due(state.slots, state.tokens, step_phase(before, tokens_after, prompt_len), added))
        if state.replay:
            # A replay chunk never crosses an eviction point, and fires exactly at each one.
            point = state.replay[0]
            if probe and tokens_after >= point:
                return True  # vLLM asking whether a whole recompute fits: it evicts on the way
            if tokens_after > point or due != (tokens_after == point):
                raise RuntimeError(
                    f"request {req_id}: replay after preemption diverged at {tokens_after} tokens "
                    f"(next eviction point {point}, due {due})"
                )
        return due

    def would_fire(self, req_id: str, tokens_after: int, prompt_len: int) -> bool:
        """Whether ``advance`` to ``tokens_after`` would make the request due, without recording it."""
        state = self.get(req_id)
        saved = replace(state)
        try:
            return self.advance(req_id, tokens_after, prompt_len, probe=True)
        finally:
            state.__dict__.update(saved.__dict__)  # in place: callers may hold the entry

    def evicted(self, req_id: str) -> int:
        """Record an eviction; returns the block-table slots the request holds after it."""
        state = self.requests[req_id]
        if state.schedule is None:
            raise RuntimeError(f"request {req_id} has no schedule: it never evicts")
        if state.from_prompt and state.evictions == 0:
            if state.layer_schedule is None:  # what it kept is known once the workers report its budget (decide)
                state.awaiting_held = state.held
            else:
                state.schedule = state.layer_schedule
        if not state.awaiting:
            _keep(state)
        state.evictions += 1
        state.evicted_at.append(state.tokens)
        if state.replay and state.replay[0] == state.tokens:
            state.replay.pop(0)
        return state.held

    def decide(self, req_id: str, layer_schedule: Schedule) -> tuple[int, int]:
        """The layer budget of an awaiting request's first eviction, now known: it kept
        ``budget`` of the slots it held then, and runs ``layer_schedule`` from then on; the steps
        recorded since are replayed on it (each eviction they make is recorded as usual). Returns
        the block-table slots it held before and holds now."""
        state = self.get(req_id)
        if state.awaiting_held is None:
            raise RuntimeError(f"request {req_id} awaits no layer budget")
        before, steps = state.held, state.awaited_steps
        state.schedule = state.layer_schedule = layer_schedule
        state.tokens, state.slots, state.reserve = state.evicted_at[0], state.awaiting_held, 0
        state.awaiting_held, state.awaited_steps = None, []
        _keep(state)
        for tokens_after, prompt_len in steps:
            if self.advance(req_id, tokens_after, prompt_len):
                self.evicted(req_id)
        return before, state.held


def _keep(state: RequestSlots) -> None:
    """The slots an eviction leaves: ``budget``, and under per-head budgets the room for the fullest head."""
    held = state.kept_room(state.held)
    state.slots = min(state.slots, state.evicts_to().budget)
    state.reserve = held - state.slots


def kept_held(schedule: Schedule, head_cap: int | None, held: int) -> int:
    """Block-table slots a request holding ``held`` keeps through an eviction: ``budget``, or
    under per-head budgets room for the fullest head, ``head_cap``, at most what it held (a head
    never keeps more slots than it holds, and none holds more than the block table's)."""
    if head_cap is None:
        return min(held, schedule.budget)
    return min(held, head_cap)


class BlocksDisagree(RuntimeError):
    """A request's blocks are not what its ledger entry says it holds: the scheduler and a worker
    disagree (a bug, never a user's error: the engine must stop rather than read wrong slots)."""


@dataclass(frozen=True)
class Compaction:
    """What an eviction does to a request's blocks (``compaction``): ``kept``, its block table
    after (the fresh blocks, then its own first blocks that were compacted in place); ``freed``,
    its blocks past the kept slots; ``copied``, its old first blocks whose slots were copied into
    the fresh ones (released: another reader may still hold them)."""

    kept: list[int]
    freed: list[int]
    copied: list[int]


def compaction(blocks: list[int], held: int, kept: int, block_size: int, *, fresh: bool, req_id: str) -> Compaction:
    """The one block-order rule of an eviction, for the scheduler (which frees blocks) and every
    worker (which moves the kept slots): a request holding ``held`` block-table slots in
    ``blocks`` keeps ``kept`` (``kept_held``). Under prefix caching its first eviction
    (``fresh``) writes the kept slots into the ``ceil(kept / block_size)`` fresh blocks the
    scheduler appended to ``blocks`` (never into old ones, which the prefix cache may share);
    otherwise they are compacted in place, into its first blocks."""
    keep, needed = -(-kept // block_size), -(-held // block_size)
    copies = len(blocks) - needed  # the fresh blocks appended for this eviction
    expected = keep if fresh else 0
    if copies != expected:
        raise BlocksDisagree(
            f"kvpolicy: request {req_id} holds {len(blocks)} blocks for {held} slots; expected {needed} + "
            f"{expected} fresh (the scheduler and a worker disagree)"
        )
    old, new = blocks[:needed], blocks[needed:]
    return Compaction(new + old[copies:keep], old[keep:], old[:copies])


def replay_boundary(plan: list[int], prompt_len: int, computed: int) -> int | None:
    """Where the chunk of a request being recomputed from ``computed`` tokens must end at the
    latest: the next eviction point, or the prompt's end (prefill and decode follow different
    rules). None: no boundary ahead."""
    ahead = [p for p in (prompt_len, *plan) if p > computed]
    return min(ahead) if ahead else None


def peak_slots(schedule: Schedule | None, prompt_len: int, total: int, head_cap: int | None = None) -> int:
    """The most slots a request of ``prompt_len`` prompt tokens and ``total`` tokens in all holds
    at once under ``schedule`` (None: no eviction, every token), replays after preemption included
    (``head_cap``: per-head budgets, whose room for the fullest head adds up to ``head_cap - budget``)."""
    return total if schedule is None else min(peak_bound(schedule, prompt_len, head_cap), total)


def peak_bound(schedule: Schedule, prompt_len: int, head_cap: int | None = None) -> int:
    """``peak_slots`` of a request long enough to reach it: what its length does not change."""
    peak = schedule.capacity_for(prompt_len)
    if schedule.compress_prompt and prompt_len > schedule.budget:
        peak = max(prompt_len, schedule.capacity_for(schedule.budget))
    if head_cap is not None:
        peak += max(0, head_cap - schedule.budget)
    return peak


def prefix_hit_cap(schedule: Schedule | None, prompt_len: int) -> int | None:
    """The most prompt tokens a request may take from vLLM's prefix cache (None: no limit).

    A request attends with queries it computed itself: a prefix-cache hit skips computing the
    hit tokens, so their queries never reach the request's query window. Its first eviction must
    find its last ``window`` queries computed, as they are when the request runs without prefix
    caching: the hit may not reach into them. Only a first eviction at most ``window`` tokens
    after the prompt can be affected, so the schedule is probed that far.
    """
    if schedule is None or schedule.window == 0:
        return None
    w = schedule.window
    probe = SlotLedger()
    probe.track("probe", schedule)
    for tokens in (prompt_len, *range(prompt_len + 1, prompt_len + w + 1)):
        if probe.advance("probe", tokens, prompt_len):
            return max(0, tokens - w)
    return None
