"""Stages that remember: H2O's accumulated attention against float64 loop references, state moving
with the slots (padded rows, beams, per-head runs, select mode), and bad state refused."""

from __future__ import annotations

import math
from typing import ClassVar

import pytest
import torch
from helpers import assert_state_rows_alone, random_steps
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import kvpolicy
from kvpolicy import CacheStateError, EvictingCache, load_policy
from kvpolicy.policy import window_positions
from kvpolicy.schedule import Schedule
from kvpolicy.stages import Scorer, StateField
from kvpolicy.stages.guards import SelectionError


# -- a float64 loop reference of H2O ------------------------------------------------------------
class H2OReference:
    """H2O on one layer, token by token, in float64 Python: every held token of every (row, KV
    head) carries the attention it has received; each query adds its softmax over the tokens
    held at its own step (its own included), summed over the query heads of the KV head; after a
    step, a due row keeps its ``recent`` newest tokens and the ``budget - recent`` others of
    largest accumulated attention."""

    def __init__(self, schedule: Schedule, batch: int, hkv: int, hq: int):
        self.s, self.hkv, self.g = schedule, hkv, hq // hkv
        # per row and head: list of [position, key, value, accumulated]
        self.held = [[[] for _ in range(hkv)] for _ in range(batch)]
        self.tokens = [0] * batch
        self.prompt_done = False

    def step(self, k, v, q, valid) -> list[torch.Tensor | None]:
        """One step: ``k, v [B, Hkv, T, D]``, ``q [B, Hq, T, D]``, ``valid [B, T]``; returns each
        row's attention outputs ``[Hq, T_real, D]`` (its real queries, in order)."""
        outs = []
        d = k.shape[-1]
        for b in range(k.shape[0]):
            row_out = []
            for t in range(k.shape[2]):
                if not valid[b, t]:
                    continue
                pos = self.tokens[b]
                self.tokens[b] += 1
                for h in range(self.hkv):
                    self.held[b][h].append([pos, k[b, h, t].double(), v[b, h, t].double(), 0.0])
                heads = []
                for qh in range(self.g * self.hkv):
                    h = qh // self.g
                    entries = self.held[b][h]
                    logits = [float(q[b, qh, t].double() @ e[1]) / math.sqrt(d) for e in entries]
                    top = max(logits)
                    ex = [math.exp(x - top) for x in logits]
                    z = sum(ex)
                    probs = [x / z for x in ex]
                    for e, p in zip(entries, probs, strict=True):
                        e[3] += p
                    heads.append(sum(p * e[2] for e, p in zip(entries, probs, strict=True)))
                row_out.append(torch.stack(heads))
            outs.append(torch.stack(row_out, 1) if row_out else None)
        prompt = not self.prompt_done
        self.prompt_done = True
        for b in range(k.shape[0]):
            count = len(self.held[b][0])
            if bool(self.s.due(count, self.tokens[b], prompt=prompt)):
                for h in range(self.hkv):
                    entries = self.held[b][h]
                    cut = len(entries) - self.s.recent
                    old, recent = entries[:cut], entries[cut:]
                    best = sorted(old, key=lambda e: -e[3])[: self.s.budget - self.s.recent]
                    self.held[b][h] = sorted(best, key=lambda e: e[0]) + recent
        return outs

    def positions(self, b: int, h: int) -> list[int]:
        return [e[0] for e in self.held[b][h]]

    def scores(self, b: int, h: int) -> list[float]:
        return [e[3] for e in self.held[b][h]]


def _h2o(budget=12, recent=4, interval=4, window=4, **extra) -> kvpolicy.Policy:
    return load_policy("h2o", budget=budget, recent=recent, interval=interval, window=window, **extra)


_steps = random_steps

def _check_layer(cache: EvictingCache, ref: H2OReference, layer: int, label: str) -> int:
    """Held positions equal the reference's; so does the state of every row whose state has seen
    all its queries (the state is brought up to date lazily: at evictions, and before unseen
    queries would leave the window). Returns how many rows' states were compared."""
    view = cache.layers[layer]
    positions, valid = view.positions, view.valid
    state = view.state["state0.attention"]
    current = ~view.window_new.any(-1)
    for b in range(positions.shape[0]):
        for h in range(positions.shape[1]):
            held = valid[b, h]
            got = positions[b, h][held].tolist()
            assert got == ref.positions(b, h), (label, b, h)
            if not current[b]:
                continue
            torch.testing.assert_close(
                state[b, h][held].double(), torch.tensor(ref.scores(b, h), dtype=torch.float64),
                rtol=2e-5, atol=2e-6, msg=lambda m, b=b, h=h: f"{label} row {b} head {h}: {m}",
            )
    return int(current.sum())


@pytest.mark.parametrize("hkv,hq", [(2, 2), (2, 6)], ids=["mha", "gqa"])
@pytest.mark.parametrize("compress_prompt", [False, True])
@pytest.mark.parametrize("window,interval", [(4, 4), (2, 4), (4, 2)])
def test_h2o_cache_equals_float64_reference(hkv, hq, compress_prompt, window, interval):
    """Held positions, accumulated scores and attention outputs equal the loop reference after
    every step: a prompt five times the window (its queries counted in chunks at prefill),
    several evictions, windows shorter than the interval (updates between evictions) too."""
    policy = _h2o(interval=interval, window=window, compress_prompt=compress_prompt)
    cache = EvictingCache(policy, num_layers=2)
    refs = [H2OReference(policy.schedule, 2, hkv, hq) for _ in range(2)]
    compared = 0
    for step, (k, v, q, valid) in enumerate(_steps(2, hkv, hq, 8, prompt=20, n=30, seed=7 + hkv)):
        for layer in range(2):
            out = cache.attend(layer, q, k, v, token_valid=None)
            want = refs[layer].step(k, v, q, valid)
            for b in range(2):
                torch.testing.assert_close(out[b], want[b], rtol=1e-9, atol=1e-9)
        cache.evict_due()  # the reference evicts at the end of the step; the cache before the next
        for layer in range(2):
            compared += _check_layer(cache, refs[layer], layer, f"step {step}")
    assert cache.stats()[0].evictions >= 5 and compared >= 10


@pytest.mark.parametrize("pads", [(0, 5), (3, 0)])
def test_h2o_padded_rows_equal_rows_alone(pads):
    """A left-padded batch: each row's held positions and state equal the row run alone."""
    batch = assert_state_rows_alone(_h2o(), _steps(2, 2, 4, 8, prompt=14, n=25, seed=3, pads=pads), ["state0.attention"])
    assert batch.stats()[0].evictions >= 3


def test_h2o_chunked_prompt_equals_one_step():
    """A prompt fed in chunks of any length gives the state one long step gives."""
    policy = _h2o(budget=40, recent=4)
    whole, chunked = EvictingCache(policy, num_layers=1), EvictingCache(policy, num_layers=1)
    (k, v, q, _), *_ = _steps(1, 2, 4, 8, prompt=30, n=0, seed=5)
    whole.attend(0, q, k, v)
    for c0, c1 in ((0, 3), (3, 11), (11, 12), (12, 30)):
        chunked.attend(0, q[:, :, c0:c1], k[:, :, c0:c1], v[:, :, c0:c1])
    torch.testing.assert_close(
        chunked.layers[0].state["state0.attention"], whole.layers[0].state["state0.attention"], rtol=1e-6, atol=1e-7
    )


def test_state_moves_with_reordered_rows():
    """``select_rows`` (beams, repeated samples) carries each row's state with its slots."""
    policy = _h2o()
    cache = EvictingCache(policy, num_layers=1)
    steps = list(_steps(2, 2, 4, 8, prompt=14, n=12, seed=9))
    for k, v, q, _ in steps:
        cache.attend(0, q, k, v)
    before = cache.layers[0].state["state0.attention"]
    cache.select_rows(torch.tensor([1, 1, 0]))
    after = cache.layers[0].state["state0.attention"]
    assert torch.equal(after, before[[1, 1, 0]])
    assert cache.memory_bytes() > 0


def test_memory_bytes_count_the_state():
    """The state is one float32 per held slot and KV head, counted in ``memory_bytes``."""
    with_state, without = EvictingCache(_h2o(), num_layers=2), EvictingCache(
        load_policy("snapkv", budget=12, recent=4, interval=4, window=4), num_layers=2)
    for k, v, q, _ in _steps(1, 2, 4, 8, prompt=10, n=3, seed=1):
        for layer in range(2):
            with_state.attend(layer, q.float(), k.float(), v.float())
            without.attend(layer, q.float(), k.float(), v.float())
    group = with_state._groups[0]
    slots = group.buffers.keys.shape[:4].numel()
    assert with_state.memory_bytes() - without.memory_bytes() == slots * 4


# -- bad state is refused, naming the stage and the field, and the cache is left as it was -------
class _BadState(Scorer):
    type_name: ClassVar[str] = "bad_state_test"
    reads_queries: ClassVar[bool] = True
    fault: str = "shape"

    @property
    def state_fields(self):
        return {"seen": StateField(torch.float32, 0.0)}

    def update_state(self, inp):
        seen = inp.state_of(self)["seen"]
        if self.fault == "shape":
            return {"seen": seen[..., :-1] + 1}
        if self.fault == "dtype":
            return {"seen": (seen + 1).double()}
        if self.fault == "nan":
            return {"seen": seen + float("nan")}
        if self.fault == "missing":
            return {}
        return {"seen": seen + 1}

    def score(self, inp):
        return inp.state_of(self)["seen"]


@pytest.mark.parametrize("fault,message", [
    ("shape", r"scorer 'bad_state_test' state field 'seen' has shape .* expected \[B, Hkv, N\]"),
    ("dtype", r"scorer 'bad_state_test' state field 'seen' has dtype torch.float64, expected its declared torch.float32"),
    ("nan", r"scorer 'bad_state_test' state field 'seen' holds \d+ non-finite values"),
    ("missing", r"scorer 'bad_state_test' update_state returned fields \[\], expected exactly .*'seen'"),
])
def test_bad_state_is_refused_and_the_cache_kept(fault, message):
    policy = load_policy({
        "name": "bad", "schedule": {"budget": 12, "recent": 4, "interval": 4, "window": 4},
        "scorer": _BadState(fault=fault), "selector": "greedy"})
    cache = EvictingCache(policy, num_layers=1)
    steps = list(_steps(1, 2, 4, 8, prompt=4, n=12, seed=2))  # the first update: before step 2
    cache.attend(0, *(steps[0][i] for i in (2, 0, 1)))
    with pytest.raises(SelectionError, match=message):
        for k, v, q, _ in steps[1:]:
            # (positions are written out lazily: compared as the view derives them)
            before = {name: t.clone() for name, t in cache._groups[0].buffers.tensors() if name != "positions"}
            counts, positions = cache.layers[0].counts, cache.layers[0].positions.clone()
            cache.attend(0, q, k, v)
    after = {name: t for name, t in cache._groups[0].buffers.tensors() if name != "positions"}
    assert before.keys() == after.keys() and "state0.seen" in after
    for name in before:
        assert torch.equal(before[name], after[name]), name
    assert torch.equal(cache.layers[0].positions, positions)
    assert cache.layers[0].counts == counts
    # A prompt longer than the window updates the state as it is written: refused there too. The
    # layer's keys are written by then, but its state missed the queries: the layer does not count
    # as having written the step, so the next step (or another layer's) is refused until reset(),
    # and after reset() the cache is a fresh one.
    for layers in (1, 2):
        long = EvictingCache(policy, num_layers=layers)
        k, v, q, _ = next(_steps(1, 2, 4, 8, prompt=9, n=0, seed=2))
        with pytest.raises(SelectionError, match=message):
            long.attend(0, q, k, v)
        if layers == 2:  # the forward goes on to layer 1, refused there as well
            with pytest.raises(SelectionError, match=message):
                long.attend(1, q, k, v)
        with pytest.raises(CacheStateError, match=r"reset\(\)"):
            long.attend(0, q[:, :, :1], k[:, :, :1], v[:, :, :1])
        long.reset()
        for layer in range(layers):
            long.attend(layer, q[:, :, :3], k[:, :, :3], v[:, :, :3])
        assert long.layers[0].counts == [3]


def test_select_on_a_fresh_state_is_the_windows_attention():
    """``Policy.select`` without ``state=`` starts from a fresh state: H2O then ranks by the
    window's attention over every slot, as ``softmax_over: all`` with a summed window does."""
    h2o = _h2o(budget=8, recent=2)
    snap = load_policy({"name": "s", "schedule": {"budget": 8, "recent": 2, "interval": 4, "window": 4},
                        "scorer": {"type": "attention", "softmax_over": "all", "window_reduce": "sum",
                                   "pooling": "none"}, "selector": "greedy"})
    g = torch.Generator().manual_seed(0)
    k, v, q = torch.randn(2, 2, 20, 8, generator=g), torch.randn(2, 2, 20, 8, generator=g), torch.randn(2, 4, 4, 8, generator=g)
    assert torch.equal(h2o.select(k, v, q), snap.select(k, v, q))
    with pytest.raises(ValueError, match="state field 'state0.attention' must be a"):
        h2o.select(k, v, q, state={"state0.attention": torch.zeros(2, 2, 19)})
    with pytest.raises(ValueError, match="keeps no state"):
        snap.select(k, v, q, state={"x": torch.zeros(2, 2, 20)})


# -- per-head allocation and select mode, with the state ---------------------------------------
def _attend64(q, keys, values, d):
    """Float64 softmax attention of one query ``[D]`` over ``keys [M, D]``: (probs, output)."""
    probs = torch.softmax(keys.double() @ q.double() / math.sqrt(d), -1)
    return probs, probs @ values.double()


@pytest.mark.parametrize("hkv,hq", [(2, 2), (2, 4)], ids=["mha", "gqa"])
def test_h2o_per_head_allocation_equals_float64_reference(hkv, hq):
    """Ada-KV's per-head budgets over accumulated attention: heads keep different counts, each
    head's tokens carry their state through the per-head runs. The reference keeps per-head
    token lists in float64; at each eviction it asks the policy's allocation for the heads'
    counts from its own accumulated scores (the allocation is checked on its own elsewhere)."""
    over = {"budget": 12, "recent": 4, "interval": 4, "window": 4}
    policy = load_policy({"name": "ada-h2o", "schedule": over, "scorer": "accumulated_attention",
                          "selector": "greedy", "allocation": {"type": "adaptive"}})
    cache = EvictingCache(policy, num_layers=1)
    d, g = 8, hq // hkv
    held: list[list[list]] = [[[] for _ in range(hkv)]]  # one row: [position, key, value, acc]
    tokens = row_count = 0  # a row's count: its heads' mean (the budget after an eviction), plus new tokens
    heads_differ = False
    for step, (k, v, q, _) in enumerate(_steps(1, hkv, hq, d, prompt=10, n=40, seed=11 + hq)):
        out = cache.attend(0, q, k, v)
        for t in range(k.shape[2]):
            for h in range(hkv):
                held[0][h].append([tokens, k[0, h, t], v[0, h, t], 0.0])
            for qh in range(hq):
                entries = held[0][qh // g]
                probs, want = _attend64(q[0, qh, t], torch.stack([e[1] for e in entries]),
                                        torch.stack([e[2] for e in entries]), d)
                for e, p in zip(entries, probs.tolist(), strict=True):
                    e[3] += p
                torch.testing.assert_close(out[0, qh, t], want, rtol=1e-9, atol=1e-9)
            tokens += 1
            row_count += 1
        if bool(policy.schedule.due(row_count, tokens, prompt=step == 0)):
            row_count = policy.budget
            n = max(len(e) for e in held[0])
            keys = torch.zeros(1, hkv, n, d, dtype=torch.float64)
            values, valid = torch.zeros_like(keys), torch.zeros(1, hkv, n, dtype=torch.bool)
            acc, pos = torch.zeros(1, hkv, n), torch.full((1, hkv, n), -1)
            for h in range(hkv):  # right-aligned: every head's newest token in the last column
                es = held[0][h]
                for j, e in enumerate(es):
                    c = n - len(es) + j
                    keys[0, h, c], values[0, h, c], valid[0, h, c] = e[1], e[2], True
                    acc[0, h, c], pos[0, h, c] = e[3], e[0]
            keep, _ = policy.select_heads(keys, values, q[:, :, -1:].expand(-1, -1, 4, -1), slot_valid=valid,
                                          positions=pos, state={"state0.attention": acc},
                                          query_new=torch.zeros(1, 4, dtype=torch.bool))
            for h in range(hkv):
                kept = set(pos[0, h][keep[0, h]].tolist())
                held[0][h] = [e for e in held[0][h] if e[0] in kept]
            heads_differ |= len({len(e) for e in held[0]}) > 1
        cache.evict_due()
        view = cache.layers[0]
        current = not bool(view.window_new.any())
        for h in range(hkv):
            mask = view.valid[0, h]
            assert view.positions[0, h][mask].tolist() == [e[0] for e in held[0][h]], (step, h)
            if current:
                torch.testing.assert_close(view.state["state0.attention"][0, h][mask].double(),
                                           torch.tensor([e[3] for e in held[0][h]], dtype=torch.float64),
                                           rtol=2e-5, atol=2e-6)
    assert heads_differ and cache.stats()[0].evictions >= 5


@pytest.mark.parametrize("hkv,hq", [(2, 2), (2, 4)], ids=["mha", "gqa"])
def test_h2o_select_mode_equals_float64_reference(hkv, hq):
    """``h2o@select``: every token stays; the state accumulates each query's attention over the
    full cache; every ``interval`` decode steps past the budget, each layer chooses its recent
    buffer and the top candidates by accumulated attention (the current query's included), and
    the steps attend the choice plus the tokens appended since."""
    policy = load_policy("h2o@select", budget=12, recent=4, interval=4, window=4)
    s = policy.schedule
    cache = EvictingCache(policy, num_layers=1)
    d, g = 8, hq // hkv
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    acc = torch.zeros(hkv, 0, dtype=torch.float64)
    chosen: list[list[int]] | None = None
    chosen_at = -1
    choices = 0
    for step, (k, v, q, _) in enumerate(_steps(1, hkv, hq, d, prompt=10, n=40, seed=21 + hq)):
        out = cache.attend(0, q, k, v)
        t_new = k.shape[2]
        for t in range(t_new):
            keys.append(k[0, :, t])
            values.append(v[0, :, t])
            acc = torch.cat([acc, torch.zeros(hkv, 1, dtype=torch.float64)], 1)
            count = len(keys)
            kk, vv = torch.stack(keys, 1), torch.stack(values, 1)  # [Hkv, count, D]
            full = [_attend64(q[0, qh, t], kk[qh // g], vv[qh // g], d) for qh in range(hq)]
            for qh, (probs, _) in enumerate(full):
                acc[qh // g] += probs
            decode = t_new == 1 and step > 0
            if not decode:
                chosen, chosen_at = None, -1
            elif count > s.budget and (chosen_at < 0 or count - chosen_at >= s.interval):
                cand = count - s.recent
                chosen = [sorted(acc[h, :cand].topk(s.budget - s.recent).indices.tolist()) + list(range(cand, count))
                          for h in range(hkv)]
                chosen_at, choices = count, choices + 1
            for qh in range(hq):
                if decode and chosen is not None:
                    cols = chosen[qh // g] + list(range(chosen_at, count))
                    _, want = _attend64(q[0, qh, t], kk[qh // g, cols], vv[qh // g, cols], d)
                else:
                    want = full[qh][1]
                torch.testing.assert_close(out[0, qh, t], want, rtol=1e-9, atol=1e-9, msg=lambda m, step=step: f"step {step}: {m}")
        view = cache.layers[0]
        if not bool(view.window_new.any()):
            torch.testing.assert_close(view.state["state0.attention"][0].double(), acc, rtol=2e-5, atol=2e-6)
    assert choices >= 5


# -- every query seen exactly once, whatever the schedule, layout and feeding --------------------
class _QueryCounter(Scorer):
    """Counts, per row and KV head, the queries its state has seen (a per-head field), and per
    slot the queries that could see the slot (a per-slot field)."""

    type_name: ClassVar[str] = "query_counter_test"
    reads_queries: ClassVar[bool] = True

    @property
    def state_fields(self):
        return {"queries": StateField(torch.float64, 0.0, per="head"),
                "seen_by": StateField(torch.float32, 0.0)}

    def update_state(self, inp):
        state = inp.state_of(self)
        new = inp.query_new & inp.query_valid
        queries = state["queries"] + new.sum(-1, dtype=torch.float64)[:, None]
        sees = (inp.positions[..., None] <= inp.query_positions[:, None, None, :]) & new[:, None, None, :]
        seen_by = state["seen_by"] + (sees & inp.slot_valid[..., None]).sum(-1).float()
        return {"queries": queries, "seen_by": seen_by}

    def score(self, inp):
        return -inp.positions.float()  # keeps the oldest: any deterministic rule will do


def _counter_policy(mode, allocation, **schedule):
    doc = {"name": "counter", "mode": mode, "schedule": schedule, "scorer": _QueryCounter(), "selector": "greedy"}
    if allocation:
        doc["allocation"] = {"type": allocation}
    return load_policy(doc)


@settings(max_examples=40, deadline=None)
@given(
    layout=st.sampled_from([("evict", None), ("evict", "adaptive"), ("select", None)]),
    budget=st.integers(6, 14), recent=st.integers(1, 4), interval=st.integers(1, 6), window=st.integers(1, 6),
    prompt=st.integers(1, 20), pad=st.integers(0, 5), chunks=st.lists(st.integers(1, 7), min_size=3, max_size=12),
    reorder=st.booleans(),
)
def test_every_query_is_seen_exactly_once(layout, budget, recent, interval, window, prompt, pad, chunks, reorder):
    """A per-head counter of the queries the state has seen equals the real tokens each row has
    seen less the window's unseen queries (so none was skipped or counted twice, and every
    unseen one is still in the window), and a per-slot counter of the queries that saw each held
    token equals the queries at or after its position less the unseen ones. For any schedule,
    prompt, padding, chunking, layout and row reordering."""
    assume(recent < budget and (window <= max(recent, 1) or window <= interval))
    mode, allocation = layout
    policy = _counter_policy(mode, allocation, budget=budget, recent=recent, interval=interval, window=window)
    cache = EvictingCache(policy, num_layers=2)
    g = torch.Generator().manual_seed(budget * 31 + prompt)
    tokens = torch.zeros(2, dtype=torch.long)
    for i, t in enumerate([prompt + pad, *chunks]):
        k, v = torch.randn(2, 2, t, 4, generator=g), torch.randn(2, 2, t, 4, generator=g)
        q = torch.randn(2, 4, t, 4, generator=g)
        valid = torch.ones(2, t, dtype=torch.bool)
        if i == 0:
            valid[1, :pad] = False
        for layer in range(2):
            cache.attend(layer, q, k, v, token_valid=valid if not bool(valid.all()) else None)
        tokens += valid.sum(-1)
        if reorder and i == 2:
            cache.select_rows(torch.tensor([1, 0]))
            tokens = tokens[[1, 0]]
        if i % 2:
            cache.evict_due()  # evictions now (their updates too), or at the next step
        for layer in range(2):
            view = cache.layers[layer]
            state = view.state
            seen = state["state0.queries"]  # [B, Hkv]
            # The queries the state has not seen are exactly the window's unseen ones (newest).
            unseen = view.window_new
            assert torch.equal(seen, (tokens - unseen.sum(-1))[:, None].double().expand(-1, 2)), (i, layer)
            _, wvalid = view.window()
            qpos = window_positions(wvalid, tokens)
            unseen_sees = ((qpos[:, None, None, :] >= view.positions[..., None]) & unseen[:, None, None, :]).sum(-1)
            expected = (tokens[:, None, None] - view.positions - unseen_sees).float()
            assert torch.equal(state["state0.seen_by"][view.valid], expected[view.valid]), (i, layer)


def test_updated_state_then_select_is_select_on_the_old_state():
    """A caller that keeps the state itself (vLLM's worker): ``updated_state`` then ``select``
    with nothing new keeps what ``select`` on the old state and the new queries keeps."""
    policy = _h2o(budget=8, recent=2)
    g = torch.Generator().manual_seed(4)
    k, v, q = torch.randn(2, 2, 20, 8, generator=g), torch.randn(2, 2, 20, 8, generator=g), torch.randn(2, 4, 4, 8, generator=g)
    old = {"state0.attention": torch.rand(2, 2, 20, generator=g)}
    new = policy.updated_state(k, v, q, state=old)
    assert set(new) == {"state0.attention"} and bool((new["state0.attention"] >= old["state0.attention"]).all())
    nothing = torch.zeros(2, 4, dtype=torch.bool)
    assert torch.equal(policy.select(k, v, q, state=new, query_new=nothing), policy.select(k, v, q, state=old))
    assert load_policy("snapkv", budget=8, recent=2, window=4, interval=4).updated_state(k, v, q, state=None) == {}
