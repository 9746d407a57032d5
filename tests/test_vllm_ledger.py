"""kvpolicy.vllm's slot ledger: the schedule per request, as the scheduler and workers replay it."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvpolicy import load_policy
from kvpolicy.schedule import Schedule
from kvpolicy.vllm.ledger import SlotLedger, prefix_hit_cap


def test_ledger_follows_the_schedule_per_request():
    sched = load_policy("snapkv", budget=128).schedule  # interval 64
    led = SlotLedger()
    led.track("a", sched)
    led.track("b", sched)
    assert not led.advance("a", 300, 300)  # a long prompt never evicts (no compress_prompt)
    fired = [t for t in range(301, 600) if led.advance("a", t, 300) and led.evicted("a")]
    assert fired[0] == 320 and all(b - a == 64 for a, b in zip(fired, fired[1:], strict=False))
    assert led.get("a").offset == 599 - led.get("a").slots
    # Chunked prefill: chunks never evict; the decode steps after it do.
    assert not led.advance("b", 100, 150) and not led.advance("b", 150, 150)
    assert [t for t in range(151, 260) if led.advance("b", t, 150) and led.evicted("b")] == [192, 256]


def test_offsets_count_evicted_tokens_and_reset_forgets_a_request():
    led = SlotLedger()
    led.track("r", load_policy("snapkv", budget=32, recent=8, interval=16, window=8).schedule)
    for t in range(1, 49):
        if led.advance("r", t, 1):
            assert led.evicted("r") == 32
    state = led.get("r")
    assert (state.tokens, state.slots, state.evictions) == (48, 32, 1)  # fired at 48 slots
    assert led.offset("r") == 16 and led.offset("unknown") == 0
    led.reset("r")
    assert led.offset("r") == 0 and not led.tracks("r")
    with pytest.raises(KeyError, match="not tracked"):
        led.advance("r", 49, 1)


def test_compress_prompt_evicts_with_the_last_chunk_only():
    led = SlotLedger()
    led.track("p", load_policy("snapkv", budget=64, recent=16, compress_prompt=True).schedule)
    assert not led.advance("p", 100, 300)
    assert not led.advance("p", 200, 300)
    assert led.advance("p", 300, 300) and led.evicted("p") == 64
    short = SlotLedger()
    short.track("s", load_policy("snapkv", budget=64, recent=16, compress_prompt=True).schedule)
    assert not short.advance("s", 40, 40)  # a prompt under the budget is not compressed


def test_token_count_going_back_is_an_error():
    led = SlotLedger()
    led.track("r", load_policy("snapkv", budget=128).schedule)
    led.advance("r", 10, 10)
    with pytest.raises(RuntimeError, match="went back"):
        led.advance("r", 5, 10)


def test_each_request_follows_its_own_schedule_and_none_never_evicts():
    """Requests under different policies in one ledger: each fires exactly where it fires alone."""
    scheds = {
        "snap128": load_policy("snapkv", budget=128).schedule,
        "stream64": load_policy("streamingllm", budget=64).schedule,
        "vase256": load_policy("vase-attnv", budget=256).schedule,
        "full": None,
    }

    def fires(ledger, req, prompt, upto):
        return [t for t in range(prompt + 1, upto) if ledger.advance(req, t, prompt) and ledger.evicted(req)]

    alone = {}
    for name, sched in scheds.items():
        led = SlotLedger()
        led.track(name, sched)
        led.advance(name, 40, 40)
        alone[name] = fires(led, name, 40, 700)
    mixed = SlotLedger()
    for name, sched in scheds.items():
        mixed.track(name, sched)
        mixed.advance(name, 40, 40)
    got = {name: [] for name in scheds}
    for t in range(41, 700):  # one step at a time, all requests interleaved
        for name in scheds:
            if mixed.advance(name, t, 40):
                mixed.evicted(name)
                got[name].append(t)
    assert got == alone
    assert alone["full"] == [] and mixed.get("full").slots == 699 and mixed.offset("full") == 0
    assert alone["snap128"][0] == 192 and alone["stream64"] and alone["vase256"]
    assert mixed.get("stream64").slots <= 64 + scheds["stream64"].interval
    with pytest.raises(RuntimeError, match="never evicts"):
        mixed.evicted("full")


def test_would_fire_records_nothing():
    led = SlotLedger()
    led.track("r", load_policy("snapkv", budget=128).schedule)
    led.advance("r", 100, 100)
    before = led.get("r")
    assert led.would_fire("r", 192, 100) and not led.would_fire("r", 150, 100)
    assert led.get("r") == before and led.get("r").tokens == 100


def test_prefix_hit_cap_keeps_the_first_evictions_queries_computed():
    snap = load_policy("snapkv", budget=128).schedule  # window 64, interval 64
    # prompt 250: the first eviction is at 256 tokens; its window starts at 192
    assert prefix_hit_cap(snap, 250) == 192
    # prompt 100: first eviction at 192, window from 128 > the prompt: any hit is fine
    assert prefix_hit_cap(snap, 100) is None
    # prompt compression: the prompt itself is evicted, its last 64 queries are needed
    comp = load_policy("snapkv", budget=128, compress_prompt=True).schedule
    assert prefix_hit_cap(comp, 300) == 236
    # no window (streamingllm) or no policy: no limit
    assert prefix_hit_cap(load_policy("streamingllm", budget=64).schedule, 250) is None
    assert prefix_hit_cap(None, 250) is None


def _run(led, req, prompt, upto, chunks=None):
    """Advance ``req`` to ``upto`` tokens: the prompt in one step, then one token per step (or
    the given chunk ends); returns the token counts at which it evicted."""
    fired = []
    ends = chunks if chunks is not None else [prompt, *range(prompt + 1, upto + 1)]
    for t in ends:
        if led.advance(req, t, prompt):
            led.evicted(req)
            fired.append(t)
    return fired


def test_a_replay_in_chunks_ending_at_the_eviction_points_evicts_exactly_there():
    from kvpolicy.vllm.ledger import replay_boundary

    for sched in (load_policy("snapkv", budget=32, recent=8, interval=16, window=8).schedule,
                  load_policy("rkv", budget=48).schedule,  # count: tokens
                  load_policy("snapkv", budget=32, recent=8, interval=16, window=8, compress_prompt=True).schedule):
        led = SlotLedger()
        led.track("r", sched)
        fired = _run(led, "r", 40, 300)
        assert fired and led.get("r").evicted_at == fired
        plan = led.replay_plan("r")
        assert plan == fired
        # The recompute: chunks end at the prompt and at every eviction point (a step may end
        # earlier, as when the token budget runs out: here every 7 tokens), never past one.
        led.reset("r")
        led.resume("r", sched, plan)
        t, chunks = 0, []
        while t < 300:
            end = replay_boundary(plan, 40, t) or 300
            t = min(end, t + 7, 300)
            chunks.append(t)
        assert _run(led, "r", 40, 300, chunks) == fired
        assert led.get("r").replay == [] and led.get("r").slots <= sched.capacity_for(40)


def test_a_replay_that_would_cross_an_eviction_point_is_an_error():
    sched = load_policy("snapkv", budget=32, recent=8, interval=16, window=8).schedule
    led = SlotLedger()
    led.track("r", sched)
    plan = _run(led, "r", 10, 100)
    led.resume("r", sched, plan)
    led.advance("r", 10, 10)
    with pytest.raises(RuntimeError, match="replay after preemption diverged"):
        led.advance("r", plan[0] + 1, 10)


def test_preempted_during_a_replay_keeps_the_points_not_yet_replayed():
    sched = load_policy("snapkv", budget=32, recent=8, interval=16, window=8).schedule
    led = SlotLedger()
    led.track("r", sched)
    plan = _run(led, "r", 10, 200)
    led.resume("r", sched, plan)
    _run(led, "r", 10, 200, [10, plan[0], plan[1]])
    assert led.replay_plan("r") == plan  # replayed two, the rest still ahead
    none = SlotLedger()
    none.track("n", None)
    assert none.replay_plan("n") is None and led.replay_plan("unknown") is None


def test_peak_slots_and_the_pool_check():
    from kvpolicy.vllm.ledger import peak_slots
    from kvpolicy.vllm.plans import pool_refusal, request_need_blocks

    snap = load_policy("snapkv", budget=128).schedule  # interval 64
    assert peak_slots(snap, 40, 10_000) == 192 and peak_slots(snap, 300, 10_000) == 320
    assert peak_slots(snap, 40, 100) == 100  # a short request never reaches the peak
    assert peak_slots(None, 40, 500) == 500
    comp = load_policy("snapkv", budget=128, compress_prompt=True).schedule
    assert peak_slots(comp, 1000, 5000) == 1000
    # blocks: the peak, plus the fresh blocks of a first eviction under prefix caching
    assert request_need_blocks(snap, 40, 10_000, 32, False) == 6
    assert request_need_blocks(snap, 40, 10_000, 32, True) == 6 + 4
    assert pool_refusal([snap], 40, 30_000, 6, 32, False) is None  # 30k tokens in 6 blocks
    msg = pool_refusal([None], 40, 300, 6, 32, False)
    assert msg is not None and "no eviction" in msg and "11 KV blocks" in msg
    assert "prompt of 1000 tokens" in pool_refusal([snap], 1000, 10, 6, 32, False)


def test_would_fire_on_a_replay_looks_past_its_points_without_error():
    sched = load_policy("snapkv", budget=32, recent=8, interval=16, window=8).schedule
    led = SlotLedger()
    led.track("r", sched)
    plan = _run(led, "r", 10, 100)
    led.resume("r", sched, plan)
    assert led.would_fire("r", 100, 10)  # vLLM's whole-sequence admission check
    assert not led.would_fire("r", plan[0] - 1, 10) and led.would_fire("r", plan[0], 10)


def test_the_pool_check_counts_every_layers_blocks_under_per_layer_budgets():
    """A block of a per-layer KV-cache group holds one layer: a request needs each layer's blocks."""
    from kvpolicy.vllm.budgets import group_schedules
    from kvpolicy.vllm.plans import pool_refusal, request_need_blocks

    pyramid = load_policy("pyramidkv", budget=96, recent=16, interval=32, window=32)
    per = group_schedules(pyramid, list(range(4)), 2)
    need = sum(request_need_blocks(s, 40, 10_000, 32, False) for s in per)
    assert need > 4 * request_need_blocks(per[-1], 40, 10_000, 32, False)
    assert pool_refusal(per, 40, 10_000, need, 32, False) is None
    msg = pool_refusal(per, 40, 10_000, need - 1, 32, False)
    assert msg is not None and f"needs {need} KV blocks" in msg


@settings(max_examples=300, deadline=None)
@given(budget=st.integers(5, 60), recent=st.integers(0, 4), interval=st.integers(1, 16),
       count=st.sampled_from(["slots", "tokens"]), compress=st.booleans(), prompt=st.integers(1, 90),
       layer_budget=st.integers(5, 120), delay=st.integers(0, 3), chunk=st.integers(1, 7))
def test_a_layer_budget_learned_late_gives_the_ledger_of_one_known_from_the_start(
        budget, recent, interval, count, compress, prompt, layer_budget, delay, chunk):
    """The scheduler learns a CAKE request's layer budget ``delay`` steps after its first eviction
    (``SlotLedger.decide``, the steps in between replayed); the workers know it at once. Once
    learned, both ledgers agree on every count and eviction point; before, the awaiting one holds
    every slot it had (it frees nothing it may still need)."""
    assume(recent < budget and recent < layer_budget)
    nominal = Schedule(budget=budget, recent=recent, interval=interval, window=0, count=count,
                       compress_prompt=compress)
    layer = nominal.model_copy(update={"budget": layer_budget})
    known, late = SlotLedger(), SlotLedger()
    known.track("r", nominal, from_prompt=True, layer_schedule=layer)
    late.track("r", nominal, from_prompt=True)
    steps = [min(t, prompt) for t in range(chunk, prompt + chunk, chunk)] + list(range(prompt + 1, prompt + 120))
    waited = None
    for tokens in steps:
        for led in (known, late):
            if led.advance("r", tokens, prompt):
                led.evicted("r")
        k, a = known.get("r"), late.get("r")
        if a.awaiting:
            waited = 0 if waited is None else waited + 1
            assert a.held >= k.held and a.tokens == k.tokens
            if waited < delay:
                continue
            before, after = late.decide("r", layer)
            assert before >= after == k.held
        assert (a.slots, a.reserve, a.evicted_at, a.schedule) == (k.slots, k.reserve, k.evicted_at, k.schedule)
    assert waited is None or late.get("r").schedule == layer


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(["snapkv", "ada-snapkv", "pyramidkv", "cake"]), budget=st.sampled_from([96, 128, 160]),
       prompt=st.integers(1, 300), data=st.data())
def test_the_schedulers_slot_count_is_each_groups_peak_of_the_slots_it_holds(name, budget, prompt, data):
    """``SchedulerEviction.counted_slots``, what vLLM's allocation is asked of each KV-cache group
    at every step: the request's tokens less what the group evicted, capped by its peak
    (``peak_slots`` of the group's schedule and per-head room, and of a layer schedule decided
    from the prompt). Its per-request bounds are worked out once; the count must stay this."""
    from types import SimpleNamespace

    from kvpolicy.vllm import scheduler as sched_mod
    from kvpolicy.vllm.budgets import per_layer
    from kvpolicy.vllm.ledger import peak_slots
    from kvpolicy.vllm.settings import resolve, resolve_request

    layers = 4
    resolved = resolve({"policy": name, "budget": budget})
    grouped = per_layer(resolved.policy())
    specs = [SimpleNamespace(kvpolicy_layer=i) for i in range(layers)] if grouped else [None]
    config = SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=False, block_size=16),
                             model_config=SimpleNamespace(get_num_kv_heads=lambda parallel: 2,
                                                          get_num_layers=lambda parallel: layers),
                             parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1))
    scheduler = SimpleNamespace(vllm_config=config, requests={}, policy=SimpleNamespace(value="fcfs"),
                                kv_cache_config=SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s)
                                                                                 for s in specs]))
    saved = sched_mod._STATE, sched_mod._WORKERS
    sched_mod._WORKERS = (config, sched_mod.Workers())  # as start-up asks them
    try:
        state = sched_mod.SchedulerEviction(scheduler, resolved)
        request = scheduler.requests["r"] = SimpleNamespace(
            request_id="r", num_prompt_tokens=prompt,
            sampling_params=SimpleNamespace(extra_args=resolve_request({"kvpolicy": {"policy": name, "budget": budget}})))
        plan = state.plan(request)
        assert plan.refusal is None
        for step in range(3):  # untracked, then tracked with tokens evicted, then a layer budget decided
            if step == 1:
                state._track(request)
            for g, ledger in enumerate(state.ledgers):
                entry = ledger.requests.get("r")
                if step >= 1 and entry is not None:
                    entry.tokens = data.draw(st.integers(prompt, prompt + 400), label="tokens")
                    entry.slots = data.draw(st.integers(0, entry.tokens), label="slots")
                if step == 2 and entry is not None and plan.from_prompt:
                    entry.layer_schedule = entry.schedule.model_copy(
                        update={"budget": data.draw(st.integers(entry.schedule.recent + 1, 2 * budget), label="layer")})
                num_tokens = data.draw(st.integers(max(prompt, 0 if entry is None else entry.tokens),
                                                   prompt + 500), label="num_tokens")
                slots = num_tokens - (0 if entry is None else entry.offset)
                expected = peak_slots(plan.group_schedules[g], prompt, slots, plan.head_caps[g])
                if entry is not None and entry.layer_schedule is not None:
                    expected = max(expected, peak_slots(entry.layer_schedule, prompt, slots, plan.head_caps[g]))
                assert state.counted_slots("r", num_tokens, g) == expected
    finally:
        sched_mod._STATE, sched_mod._WORKERS = saved


@pytest.mark.parametrize("order", ["fcfs", "priority"])
def test_admission_keeps_room_for_every_admitted_requests_peak_under_first_come_first_served(order):
    """``SchedulerEviction.admission_reserve``, added to vLLM's check that a waiting request fits
    (which counts its sequence so far): each running request's room to its peak (``snapkv`` at
    128: 128 + 64 slots, 6 blocks of 32; a request of 10 + 40 tokens never holds more than 50, 2
    blocks), less the blocks it holds, and the waiting request's own room past what the check
    counts for it; nothing for a request that never evicts; nothing at all under priority
    scheduling, where vLLM admits and preempts by priority."""
    from types import SimpleNamespace

    from kvpolicy.vllm import scheduler as sched_mod
    from kvpolicy.vllm.settings import resolve, resolve_request

    resolved = resolve({"policy": "snapkv", "budget": 128})
    config = SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=False, block_size=32),
                             model_config=SimpleNamespace(get_num_kv_heads=lambda parallel: 2),
                             parallel_config=SimpleNamespace(tensor_parallel_size=1))

    def request(req_id, prompt, max_tokens, settings=None):
        extra = None if settings is None else resolve_request({"kvpolicy": settings})
        return SimpleNamespace(request_id=req_id, num_prompt_tokens=prompt,
                               sampling_params=SimpleNamespace(extra_args=extra, max_tokens=max_tokens))

    running = [request("grown", 32, 500), request("full", 32, 500), request("plain", 32, 500, "none"),
               request("short", 10, 40)]
    waiting = [request("new", 32, 500), request("tiny", 20, 10)]
    held = {"grown": 4, "full": 6, "plain": 9, "short": 1}
    scheduler = SimpleNamespace(vllm_config=config, requests={r.request_id: r for r in running + waiting},
                                running=running, policy=SimpleNamespace(value=order),
                                kv_cache_config=SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=None)]))
    manager = SimpleNamespace(kv_cache_group_id=0, block_size=32,
                              req_to_blocks={r: list(range(n)) for r, n in held.items()})
    saved = sched_mod._STATE, sched_mod._WORKERS
    sched_mod._WORKERS = (config, sched_mod.Workers())  # as start-up asks them
    try:
        state = sched_mod.SchedulerEviction(scheduler, resolved)
        fcfs = order == "fcfs"
        others = (6 - 4) + (6 - 6) + 0 + (2 - 1)
        # its prompt counted as 1 block: 5 more to its peak; 20 + 10 tokens fit the 1 block counted
        assert state.admission_reserve(manager, "new", 1) == (others + 5 if fcfs else 0)
        assert state.admission_reserve(manager, "tiny", 1) == (others if fcfs else 0)
        running.pop(0)  # the grown request finished: its room goes with it
        assert state.admission_reserve(manager, "new", 1) == (1 + 5 if fcfs else 0)
    finally:
        sched_mod._STATE, sched_mod._WORKERS = saved
