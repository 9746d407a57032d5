"""Select mode over vLLM's blocks (``kvpolicy.vllm.select``), without vLLM: the worker's paged cache
and block selection driven by a small engine that writes each step's keys and values where vLLM's
slot mapping puts them (blocks handed out in a shuffled order, so every read goes through the block
table), with several requests of different policies and lengths in one batch, one of them
prefilled in chunks. Each request is also run alone through ``EvictingCache`` in select mode (the
transformers path's cache): at every decode step and layer, the slots the paged run attends (the
blocks chosen, by the same ``kvpolicy.selection.choose_pages`` / ``eviction.choose``) and the
attention output equal the reference's exactly; a request that holds no more than its budget
keeps vLLM's own output."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from kvpolicy import EvictingCache, load_policy
from kvpolicy.attend import attend
from kvpolicy.selection import page_plan, page_slots
from kvpolicy.vllm.paged_cache import PagedCache
from kvpolicy.vllm.refusals import page_refusal, refuse_unservable
from kvpolicy.vllm.requests import StepRequests
from kvpolicy.vllm.select import BlockSelection
from kvpolicy.vllm.settings import KVPolicyVLLMError, Resolved

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS, HKV, HQ, D, BLOCK = 2, 2, 4, 16, 8


def quest_pages(budget: int = 40, recent: int = 8, page: int = BLOCK, **schedule) -> dict:
    """The shipped ``quest`` at page granularity with pages of ``page`` slots (a mapping)."""
    data = load_policy("quest", budget=budget, recent=recent, **schedule).config.to_dict()
    return {**data, "name": "quest-pages", "scorer": {**data["scorer"], "page_size": page, "granularity": "page"}}


def resolved(source, **overrides) -> Resolved:
    policy = load_policy(source, **overrides)
    seed = policy.resolve_seed()
    return Resolved(policy.with_overrides(seed=seed).to_yaml(), policy.name, seed)


@dataclass
class Request:
    req_id: str
    policy: Resolved
    prompt: int
    total: int
    keys: torch.Tensor = field(init=False)  # [Lyr, Hkv, T, D]
    values: torch.Tensor = field(init=False)
    queries: torch.Tensor = field(init=False)  # [Lyr, Hq, T, D]

    def __post_init__(self) -> None:
        g = torch.Generator().manual_seed(sum(map(ord, self.req_id)) * 31 + self.total)
        scale = 1 + 4 * (torch.rand(LAYERS, HKV, self.total, 1, generator=g) > 0.9)  # peaked attention
        self.keys = torch.randn(LAYERS, HKV, self.total, D, generator=g) * scale
        self.values = torch.randn(LAYERS, HKV, self.total, D, generator=g)
        self.queries = torch.randn(LAYERS, HQ, self.total, D, generator=g)


@dataclass(frozen=True)
class Decoded:
    """One decode step of one layer: the slots attended (None: all) and the output ``[Hq, D]``."""

    attended: torch.Tensor | None
    output: torch.Tensor


def reference(req: Request) -> dict[tuple[int, int], Decoded]:
    """The transformers path's select mode alone on the request: the prompt in one chunk, then
    token by token; per (token, layer) the slots attended and the output."""
    policy = load_policy(req.policy.policy_yaml)
    outputs = EvictingCache(policy, LAYERS, seed=req.policy.seed)
    masks = EvictingCache(policy, LAYERS, seed=req.policy.seed)
    got: dict[tuple[int, int], Decoded] = {}
    for a, b in itertools.pairwise([0, req.prompt, *range(req.prompt + 1, req.total + 1)]):
        for layer in range(LAYERS):
            k, v, q = (t[None, layer, :, a:b] for t in (req.keys, req.values, req.queries))
            out = outputs.attend(layer, q, k, v)
            _, _, valid = masks.step(layer, k, v, q)
            if b - a == 1:
                slots = None if bool(valid.all()) else torch.stack([valid[0, h].nonzero().flatten()
                                                                    for h in range(HKV)])
                got[(a, layer)] = Decoded(slots, out[0, :, 0])
    return got


class Table:
    """vLLM's block table as the paged cache reads it."""

    def __init__(self, rows: int, max_blocks: int) -> None:
        self.table = torch.zeros(rows, max_blocks, dtype=torch.int32)
        self.num_blocks_per_row = np.zeros(rows, dtype=np.int64)

    def get_cpu_tensor(self) -> torch.Tensor:
        return self.table

    def add_row(self, block_ids: list[int], row_idx: int) -> None:
        self.table[row_idx].zero_()
        self.table[row_idx, : len(block_ids)] = torch.tensor(block_ids, dtype=torch.int32)
        self.num_blocks_per_row[row_idx] = len(block_ids)


def attended_slots(choice, policy, layer: int, held: int) -> torch.Tensor:
    """``[Hkv, L]`` the slots a decode step holding ``held`` slots reads on ``layer`` under the
    request's current choice (``BlockSelection.attend``'s rule), ascending: the chosen pages'
    slots and the tail's (``page_plan`` as of the choice), or the chosen slots and those appended
    since."""
    assert choice.chosen_at > 0, "no choice to attend"
    page, s = policy.chooses_pages, policy.schedule
    if page is None:
        since = torch.arange(choice.chosen_at, held)
        return torch.cat([choice.chosen[layer], since.expand(choice.chosen.shape[1], -1)], dim=-1)
    k, tail = page_plan(choice.chosen_at, s.budget, s.recent, page)
    return page_slots(choice.chosen[layer, :, :k], page, tail, held)


class Engine:
    """vLLM around one worker: blocks, slot mapping, the attention backend's dense output, and
    the worker's hooks in vLLM's order (``begin_step``; per layer the query capture, the cache
    write, the backend's attention, ``BlockSelection.attend``; ``end_step``)."""

    def __init__(self, requests: list[Request], num_blocks: int = 512) -> None:
        self.requests = {r.req_id: r for r in requests}
        self.kv = [(torch.zeros(num_blocks, BLOCK, HKV, D), torch.zeros(num_blocks, BLOCK, HKV, D))
                   for _ in range(LAYERS)]
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(3)).tolist()
        self.blocks: dict[str, list[int]] = {r: [] for r in self.requests}
        self.computed = dict.fromkeys(self.requests, 0)
        self.paged = PagedCache(self.kv, list(range(LAYERS)), q_heads=HQ, head_dim=D, block_size=BLOCK,
                                policy_of=lambda r: self.requests[r].policy)
        self.select = BlockSelection(self.paged)
        self.decoded: dict[str, dict[tuple[int, int], Decoded]] = {r: {} for r in self.requests}

    def step(self, chunks: dict[str, int]) -> None:
        req_ids = list(chunks)
        n = np.array([chunks[r] for r in req_ids], dtype=np.int64)
        before = np.array([self.computed[r] for r in req_ids], dtype=np.int64)
        prompt = np.array([self.requests[r].prompt for r in req_ids], dtype=np.int64)
        for r, a, t in zip(req_ids, before, n, strict=True):
            while len(self.blocks[r]) * BLOCK < a + t:
                self.blocks[r].append(self.free.pop())
        table = Table(len(req_ids), 256)
        for i, r in enumerate(req_ids):
            table.add_row(self.blocks[r], i)
        plan = StepRequests(req_ids, n, before, prompt)
        self.paged.begin_step(plan, table)
        self.select.begin_step(plan, table)
        skipped = self.select.skipped_rows()  # the worker shortens their attention: the kernel's output is not theirs
        ends = np.cumsum(n)
        for layer in range(LAYERS):
            query = torch.cat([self.requests[r].queries[layer, :, int(a) : int(a + t)].transpose(0, 1)
                               for r, a, t in zip(req_ids, before, n, strict=True)])  # [T, Hq, D]
            self.paged.capture_queries(layer, query.flatten(1))
            keys, values = self.kv[layer]
            output = torch.empty(query.shape[0], HQ * D)
            for i, r in enumerate(req_ids):
                req, a, t = self.requests[r], int(before[i]), int(n[i])
                slots = torch.arange(a, a + t)
                ids = torch.tensor(self.blocks[r])[slots // BLOCK]
                keys[ids, slots % BLOCK] = req.keys[layer, :, a : a + t].transpose(0, 1)
                values[ids, slots % BLOCK] = req.values[layer, :, a : a + t].transpose(0, 1)
                # the backend's dense attention over every slot held (causal within the chunk)
                held = torch.arange(a + t)
                ids = torch.tensor(self.blocks[r])[held // BLOCK]
                k, v = keys[ids, held % BLOCK].transpose(0, 1)[None], values[ids, held % BLOCK].transpose(0, 1)[None]
                q = query[ends[i] - t : ends[i]].transpose(0, 1)[None]
                output[ends[i] - t : ends[i]] = attend(q, k, v)[0].transpose(0, 1).flatten(1)
                if i in skipped:  # what a kernel over one slot gives is not attention: attend must write it all
                    output[ends[i] - t : ends[i]] = float("nan")
            dense = output.clone()
            self.select.attend(layer, query.flatten(1), output, D**-0.5)
            for i, r in enumerate(req_ids):
                a, t = int(before[i]), int(n[i])
                if t == 1 and a >= self.requests[r].prompt:  # a decode step (a prompt's last chunk is not one)
                    out = output[ends[i] - 1].view(HQ, D)
                    choice = self.select.requests.get(r)
                    budget = load_policy(self.requests[r].policy.policy_yaml).budget
                    if a + 1 <= budget:
                        assert torch.equal(out, dense[ends[i] - 1].view(HQ, D)), "vLLM's own output stands"
                        slots = None
                    else:
                        assert choice is not None
                        slots = attended_slots(choice, self.requests[r].policy.policy(), layer, a + 1)
                    self.decoded[r][(a, layer)] = Decoded(slots, out)
        self.paged.end_step(table)
        self.select.end_step()
        for r, t in chunks.items():
            self.computed[r] += t


def run_and_check(requests: list[Request], chunked: dict[str, int] | None = None) -> int:
    """Run the requests in one batch (each prompt in one chunk, or in chunks of ``chunked[req]``
    tokens, then token by token) and check every decode step against each request's reference.
    Returns the number of steps that attended a selection."""
    refs = {r.req_id: reference(r) for r in requests}
    engine = Engine(requests)
    while any(engine.computed[r.req_id] < r.total for r in requests):
        chunks = {}
        for r in requests:
            done = engine.computed[r.req_id]
            if done >= r.total:
                continue
            size = (chunked or {}).get(r.req_id, r.prompt)
            chunks[r.req_id] = min(size, r.prompt - done) if done < r.prompt else 1
        engine.step(chunks)
    selected = 0
    for r in requests:
        want, got = refs[r.req_id], engine.decoded[r.req_id]
        assert set(got) == set(want), r.req_id
        for key, ref in want.items():
            mine = got[key]
            where = f"{r.req_id} ({r.policy.source}), token {key[0]}, layer {key[1]}"
            if ref.attended is None:
                assert mine.attended is None, f"{where}: the reference attends every slot"
            else:
                assert mine.attended is not None, f"{where}: the reference attends a selection"
                assert torch.equal(mine.attended.sort(-1).values, ref.attended), f"{where}: other slots attended"
                selected += 1
            torch.testing.assert_close(mine.output, ref.output, rtol=1e-5, atol=1e-6, msg=where)
    return selected


def test_quest_page_choice_attends_the_transformers_paths_blocks_and_output():
    """Quest at page granularity, pages = blocks of 8: 4 whole pages beside the recent 8, tails
    that are whole and short in turn; three requests of different lengths in one batch."""
    pol = resolved(quest_pages())
    requests = [Request("a", pol, 50, 130), Request("b", pol, 33, 100), Request("c", pol, 20, 90)]
    assert run_and_check(requests) >= LAYERS * 150


def test_page_choice_with_an_interval_reuses_its_blocks_and_grows_the_tail():
    pol = resolved(quest_pages(budget=40, recent=8, interval=4))
    assert run_and_check([Request("a", pol, 45, 110), Request("b", pol, 41, 80)]) >= LAYERS * 100


def test_policies_of_both_granularities_in_one_batch_with_a_chunked_prefill():
    """The shipped ``quest`` (slot granularity, pages of 16 over blocks of 8), ``oracle-topk``,
    ``snapkv@select`` (a 8-query window, interval 4) and the page choice, batched; one prompt in
    chunks of 16 (chunks attend densely, as the reference's prompt does)."""
    requests = [
        Request("quest", resolved("quest", budget=40, recent=8), 60, 120),
        Request("oracle", resolved("oracle-topk", budget=24, recent=4), 30, 90),
        Request("snap", resolved("snapkv@select", budget=32, recent=8, window=8, interval=4), 40, 100),
        Request("pages", resolved(quest_pages()), 64, 120),
    ]
    assert run_and_check(requests, chunked={"pages": 16, "quest": 25}) >= LAYERS * 200


def test_quest_at_block_pages_prefilled_in_chunks_of_256_attends_as_a_one_step_prompt():
    """Prompts of 900 and 1,000 tokens prefilled in chunks of 256, and one of 769 whose last
    chunk is a single token (``step_phase``: still the prompt, attended densely, as the
    reference's one-step prompt is), each decode step then attends the reference's blocks. A
    choice every 8 tokens: a choice made at that last chunk would shift every later one."""
    pol = resolved(quest_pages(budget=96, recent=16, interval=8))
    requests = [Request("a", pol, 900, 960), Request("b", pol, 1000, 1040), Request("c", pol, 769, 820)]
    chunked = {r.req_id: 256 for r in requests}
    assert run_and_check(requests, chunked=chunked) >= LAYERS * (60 + 40 + 51)


# -- what is served and refused --------------------------------------------------------------------
def test_page_choice_needs_pages_that_are_the_blocks():
    policy = load_policy(quest_pages(page=16, budget=48, recent=16))
    assert page_refusal(policy, 16) is None
    why = page_refusal(policy, 32)
    assert why is not None and "scorer.page_size" in why and "block_size=16" in why
    assert page_refusal(load_policy("quest"), 32) is None  # slot granularity reads slots, any block size
    assert page_refusal(load_policy("snapkv"), 32) is None


def test_a_page_choice_whose_pages_are_not_the_blocks_is_refused_by_the_worker():
    engine = Engine([Request("a", resolved(quest_pages(page=16, budget=48, recent=16)), 20, 30)])
    with pytest.raises(KVPolicyVLLMError, match="scorer.page_size"):
        engine.step({"a": 20})


def test_quest_at_slot_granularity_gathers_only_its_short_pages_keys(monkeypatch):
    """Quest's slot choice reads the page summaries and the keys of the candidates' last, short
    page (``Scorer.packed_reads``): the choice gathers no other slot, neither keys nor values
    (every slot gathered would fail here), and attends the reference's slots with its output;
    a policy reading every slot (``oracle-topk``) still gathers them."""
    import kvpolicy.vllm.select as select_mod
    from kvpolicy.selection import short_page_read

    assert short_page_read(load_policy("quest")) == 16 and short_page_read(load_policy("oracle-topk")) is None

    def every_slot(*args, **kwargs):
        raise AssertionError("the choice gathered every slot")

    monkeypatch.setattr(select_mod, "gather_paged", every_slot)
    pol = resolved("quest", budget=40, recent=8)
    assert run_and_check([Request("a", pol, 60, 120), Request("b", pol, 37, 100)], chunked={"a": 25}) >= LAYERS * 100
    with pytest.raises(AssertionError, match="gathered every slot"):
        run_and_check([Request("c", resolved("oracle-topk", budget=24, recent=4), 30, 40)])

    def failing(policy, inp):  # a choice that fails after the short page was read in
        assert inp.keys.isfinite().any()
        raise RuntimeError("the scorer failed")

    monkeypatch.setattr(select_mod.eviction, "choose", failing)
    engine = Engine([Request("d", pol, 45, 60)])
    engine.step({"d": 45})
    with pytest.raises(RuntimeError, match="the scorer failed"):
        engine.step({"d": 1})
    assert engine.select._nan_keys.numel() and engine.select._nan_keys.isnan().all()  # NaN again for the next choice


@pytest.mark.parametrize("source", ["quest", "oracle-topk", "snapkv@select", "vase-attnv@select"])
def test_slot_level_select_policies_are_served(source):
    """Each is let through and attends the reference's slots with its output, alone."""
    refuse_unservable(load_policy(source))
    pol = resolved(source, budget=24, recent=8, **({} if source in ("quest", "oracle-topk") else {"window": 8}))
    assert run_and_check([Request("a", pol, 30, 70)]) >= LAYERS * 40


@pytest.mark.parametrize("source,match", [
    ("h2o@select", "keep state"), ("ada-snapkv@select", "count per head"), ("pyramidkv@select", "unevenly"),
])
def test_select_policies_vllm_cannot_serve_are_refused_by_name(source, match):
    with pytest.raises(KVPolicyVLLMError, match=match):
        refuse_unservable(load_policy(source))


def test_a_page_budget_not_in_whole_pages_is_refused_at_load():
    with pytest.raises(Exception, match="must divide schedule.budget - schedule.recent"):
        load_policy(quest_pages(budget=44, recent=8))


# -- the scheduler: recomputes and the prefix cache ------------------------------------------------
def test_a_select_request_computes_each_selected_token_alone_and_caches_only_dense_blocks(monkeypatch):
    """A select-mode request recomputed after preemption attends the selections it decoded with:
    its steps end at ``max(prompt, budget)`` and go one token at a time after it; its blocks go to
    the prefix cache only while it computes tokens that attended every slot. Other requests are
    left alone."""
    from types import SimpleNamespace

    from kvpolicy.vllm import scheduler as sched_mod
    from kvpolicy.vllm.settings import resolve_request

    monkeypatch.setattr(sched_mod, "_STATE", None)
    requests: dict[str, SimpleNamespace] = {}
    model = SimpleNamespace(get_num_kv_heads=lambda parallel: 2)
    scheduler = SimpleNamespace(vllm_config=SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=True,
                                                                                         block_size=BLOCK),
                                                            model_config=model,
                                                            parallel_config=SimpleNamespace(tensor_parallel_size=1)),
                                requests=requests, policy=SimpleNamespace(value="fcfs"),  # one KV-cache group for every layer
                                kv_cache_config=SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=None)]))
    monkeypatch.setattr(sched_mod, "_WORKERS", (scheduler.vllm_config, sched_mod.Workers()))  # as start-up asks them
    state = sched_mod.SchedulerEviction(scheduler, Resolved(None, "none", 0))

    def request(req_id: str, settings, prompt: int) -> SimpleNamespace:
        extra = resolve_request({"kvpolicy": settings})
        r = requests[req_id] = SimpleNamespace(request_id=req_id, num_prompt_tokens=prompt, num_computed_tokens=0,
                                               sampling_params=SimpleNamespace(extra_args=extra))
        return r

    short = request("short", {"policy": quest_pages(budget=40, recent=8)}, 20)  # budget past the prompt
    long = request("long", {"policy": "quest", "budget": 40, "recent": 8}, 70)  # prompt past the budget
    full = request("full", "none", 20)
    assert [state.replay_cap(short, c, 100) for c in (0, 20, 39, 40, 41)] == [40, 20, 1, 1, 1]
    assert [state.replay_cap(long, c, 100) for c in (0, 69, 70, 90)] == [70, 1, 1, 1]
    assert state.replay_cap(full, 30, 100) == 100
    for computed, cached in ((0, True), (39, True), (40, False), (80, False)):
        short.num_computed_tokens = full.num_computed_tokens = computed
        assert state.caches("short") is cached and state.caches("full")


def test_the_engine_core_refuses_alone_a_page_choice_whose_pages_are_not_the_blocks(monkeypatch):
    """A request handed to the engine core past the front end is asked the front end's question
    (``PolicyPlan.request_refusal``): Quest by pages of 16 on blocks of 8 is refused by name, at
    admission, while pages of 8 and the slot-granular quest are admitted."""
    from types import SimpleNamespace

    from kvpolicy.vllm import scheduler as sched_mod
    from kvpolicy.vllm.settings import resolve_request

    monkeypatch.setattr(sched_mod, "_STATE", None)
    config = SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=False, block_size=BLOCK),
                             model_config=SimpleNamespace(get_num_kv_heads=lambda parallel: HKV),
                             parallel_config=SimpleNamespace(tensor_parallel_size=1))
    manager = SimpleNamespace(block_pool=SimpleNamespace(num_gpu_blocks=1000),
                              coordinator=SimpleNamespace(single_type_managers=[SimpleNamespace(block_size=BLOCK)]))
    scheduler = SimpleNamespace(vllm_config=config, requests={}, kv_cache_manager=manager, policy=SimpleNamespace(value="fcfs"),
                                kv_cache_config=SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=None)]))
    monkeypatch.setattr(sched_mod, "_WORKERS", (scheduler.vllm_config, sched_mod.Workers()))  # as start-up asks them
    state = sched_mod.SchedulerEviction(scheduler, Resolved(None, "none", 0))

    def request(settings) -> SimpleNamespace:
        return SimpleNamespace(request_id="r", num_prompt_tokens=20, sampling_params=SimpleNamespace(
            extra_args=resolve_request({"kvpolicy": settings}), max_tokens=50))

    with pytest.raises(KVPolicyVLLMError, match=f"request r: .*chooses pages of {2 * BLOCK} slots.*hold {BLOCK}"):
        state.admit(request({"policy": quest_pages(page=2 * BLOCK)}))
    state.admit(request({"policy": quest_pages(page=BLOCK)}))
    state.admit(request({"policy": "quest", "budget": 40, "recent": 8}))


def test_a_scheduler_takes_only_its_own_engines_workers(monkeypatch):
    """The workers' answers (missing model facts, fingerprints) are asked when an engine's executor
    starts; a scheduler built for another engine's configuration, or before any was asked, is
    refused rather than run on another engine's answers or none."""
    from types import SimpleNamespace

    from kvpolicy.vllm import scheduler as sched_mod
    from kvpolicy.vllm.support import KVPolicyInvariantError

    def scheduler() -> SimpleNamespace:  # an engine's scheduler, with its own configuration
        config = SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=False, block_size=BLOCK))
        return SimpleNamespace(vllm_config=config, requests={}, policy=SimpleNamespace(value="fcfs"),
                               kv_cache_config=SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=None)]))

    monkeypatch.setattr(sched_mod, "_STATE", None)
    asked = sched_mod.Workers(None, {"rope": "no rotary embedding"}, ())
    first, second = scheduler(), scheduler()
    monkeypatch.setattr(sched_mod, "_WORKERS", None)
    with pytest.raises(KVPolicyInvariantError, match="workers were not asked"):
        sched_mod.SchedulerEviction(first, Resolved(None, "none", 0))
    monkeypatch.setattr(sched_mod, "_WORKERS", (first.vllm_config, asked))
    assert sched_mod.SchedulerEviction(first, Resolved(None, "none", 0)).workers is asked
    with pytest.raises(KVPolicyInvariantError, match="workers were not asked"):
        sched_mod.SchedulerEviction(second, Resolved(None, "none", 0))
