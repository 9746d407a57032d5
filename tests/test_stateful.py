"""Stages that remember: H2O's accumulated attention against float64 loop references, state moving
with the slots (padded rows, beams, per-head runs, select mode), and bad state refused."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import ClassVar

import pytest
import torch
from helpers import assert_state_rows_alone, random_steps
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from reference import TokenLoopCache

import kvpolicy
from kvpolicy import CacheStateError, EvictingCache, eviction, load_policy
from kvpolicy.policy import eviction_input
from kvpolicy.stages import Scorer, StateField
from kvpolicy.stages.base import window_positions
from kvpolicy.stages.guards import SelectionError


# -- a float64 loop reference of H2O ------------------------------------------------------------
class H2OReference(TokenLoopCache):
    """H2O on one layer, token by token, in float64 Python (``reference.TokenLoopCache``): every
    held token of every (row, KV head) carries the attention it has received; each query adds its
    softmax over the tokens held at its own step (its own included), summed over the query heads
    of the KV head; after a step, a due row keeps its ``recent`` newest tokens and the
    ``budget - recent`` others of largest accumulated attention."""

    def fresh(self, pos: int) -> dict:
        return {"acc": 0.0}

    def update(self, b, h, pos, entries, probs) -> None:
        for p in probs:
            for e, pj in zip(entries, p, strict=True):
                e["acc"] += pj

    def rank(self, b: int, h: int) -> tuple[list[float], None]:
        return [e["acc"] for e in self.candidates(b, h)], None

    def accumulated(self, b: int, h: int) -> list[float]:
        return [e["acc"] for e in self.held[b][h]]


def _h2o(budget=12, recent=4, interval=4, window=4, **extra) -> kvpolicy.Policy:
    return load_policy("h2o", budget=budget, recent=recent, interval=interval, window=window, **extra)


_steps = random_steps

def _check_layer(cache: EvictingCache, ref: H2OReference, layer: int, label: str) -> int:
    """Held positions equal the reference's; so does the state of every row whose state has seen
    all its queries (the state is brought up to date lazily: at evictions, and before unseen
    queries would leave the window). Returns how many rows' states were compared."""
    view = cache.layers[layer]
    positions, valid = view.positions, view.valid
    state = view.state["accumulated_attention.attention"]
    current = ~view.window_new.any(-1)
    for b in range(positions.shape[0]):
        for h in range(positions.shape[1]):
            held = valid[b, h]
            got = positions[b, h][held].tolist()
            assert got == ref.positions(b, h), (label, b, h)
            if not current[b]:
                continue
            torch.testing.assert_close(
                state[b, h][held].double(), torch.tensor(ref.accumulated(b, h), dtype=torch.float64),
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
    batch = assert_state_rows_alone(_h2o(), _steps(2, 2, 4, 8, prompt=14, n=25, seed=3, pads=pads), ["accumulated_attention.attention"])
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
        chunked.layers[0].state["accumulated_attention.attention"], whole.layers[0].state["accumulated_attention.attention"], rtol=1e-6, atol=1e-7
    )


def test_state_moves_with_reordered_rows():
    """``select_rows`` (beams, repeated samples) carries each row's state with its slots."""
    policy = _h2o()
    cache = EvictingCache(policy, num_layers=1)
    steps = list(_steps(2, 2, 4, 8, prompt=14, n=12, seed=9))
    for k, v, q, _ in steps:
        cache.attend(0, q, k, v)
    before = cache.layers[0].state["accumulated_attention.attention"]
    cache.select_rows(torch.tensor([1, 1, 0]))
    after = cache.layers[0].state["accumulated_attention.attention"]
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
    assert before.keys() == after.keys() and "bad_state_test.seen" in after
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
    with pytest.raises(ValueError, match="state field 'accumulated_attention.attention' must be a"):
        h2o.select(k, v, q, state={"accumulated_attention.attention": torch.zeros(2, 2, 19)})
    with pytest.raises(ValueError, match="keeps no state"):
        snap.select(k, v, q, state={"x": torch.zeros(2, 2, 20)})


# -- the names state is stored under (plugin contract 4) -----------------------------------------
def _sha8(stage) -> str:
    import hashlib

    return hashlib.sha1(stage.state_key.encode("utf-8")).hexdigest()[:8]


def _scorer_policy(scorer, **schedule):
    return load_policy({"name": "names", "schedule": {"budget": 12, "recent": 4, "interval": 4, "window": 4, **schedule},
                        "scorer": scorer, "selector": "greedy"})


def _terms(*scorers):
    return {"type": "combination", "terms": [{"weight": 1.0, "scorer": s} for s in scorers]}


def test_state_names_are_the_stages_types_and_stay_when_a_stage_is_added():
    """A stateful stage alone of its type stores ``<type_name>.<field>``, whatever stages come
    before it: adding a stateful stage (before or after) renames none of the others."""
    h2o = _scorer_policy("accumulated_attention")
    assert list(h2o.state_fields) == ["accumulated_attention.attention"]
    smoothed = {"type": "smoothed_attention", "alpha": 0.5}
    for scorer in (_terms(smoothed, "accumulated_attention"), _terms("accumulated_attention", smoothed),
                   _terms("key_norm", smoothed, "accumulated_attention")):
        both = _scorer_policy(scorer)
        assert set(both.state_fields) == {"accumulated_attention.attention", "smoothed_attention.score"}
        assert both.state_fields["accumulated_attention.attention"] == h2o.state_fields["accumulated_attention.attention"]
    # equal stages share one state, under the plain name
    twice = _scorer_policy(_terms("accumulated_attention", "accumulated_attention"))
    assert list(twice.state_fields) == ["accumulated_attention.attention"]
    # the names are what a cache stores and select takes
    cache = EvictingCache(both, num_layers=1)
    for k, v, q, _ in _steps(1, 2, 4, 8, prompt=14, n=6, seed=3):
        cache.attend(0, q, k, v)
    assert set(cache.layers[0].state) == set(both.state_fields)
    k, v, q, _ = next(_steps(1, 2, 4, 8, prompt=20, n=0, seed=4))
    state = {name: torch.zeros(1, 2, 20) for name in both.state_fields}
    assert both.select(k, v, q[:, :, -4:], state=state).shape == (1, 2, 12)


def test_two_stages_of_one_type_are_named_by_their_state_keys():
    """Stateful stages of one type with different hyperparameters: each stores
    ``<type_name>-<first 8 hex of sha1(state_key)>.<field>``, the same in every policy."""
    from kvpolicy.stages.accumulated_attention import AccumulatedAttentionScorer
    from kvpolicy.stages.base import state_field_names

    summed, maxed = AccumulatedAttentionScorer(), AccumulatedAttentionScorer(group_reduce="max")
    policy = _scorer_policy(_terms("accumulated_attention", {"type": "accumulated_attention", "group_reduce": "max"}))
    want = {f"accumulated_attention-{_sha8(summed)}.attention": summed.state_key,
            f"accumulated_attention-{_sha8(maxed)}.attention": maxed.state_key}
    assert {name: key for name, (key, _, _) in policy.state_fields.items()} == want
    assert all(field == "attention" for _, field, _ in policy.state_fields.values())
    # stable: a third stage of another type, and the order of the two, change nothing
    more = _scorer_policy(_terms({"type": "accumulated_attention", "group_reduce": "max"}, "smoothed_attention",
                                 "accumulated_attention"))
    assert set(more.state_fields) == {*want, "smoothed_attention.score"}
    # the function itself, on stages by state key
    assert state_field_names({}) == {}
    names = state_field_names({maxed.state_key: maxed})
    assert names == {"accumulated_attention.attention": (maxed.state_key, "attention", maxed.state_fields["attention"])}
    # both states kept apart in a cache, each the one its stage computes alone
    cache = EvictingCache(policy, num_layers=1)
    alone = {s.state_key: EvictingCache(_scorer_policy(s.describe()), num_layers=1) for s in (summed, maxed)}
    for k, v, q, _ in _steps(1, 2, 4, 8, prompt=10, n=1, seed=5):  # no eviction yet: both hold every token
        for c in (cache, *alone.values()):
            c.attend(0, q, k, v)
    for name, key in want.items():
        torch.testing.assert_close(cache.layers[0].state[name], alone[key].layers[0].state["accumulated_attention.attention"])


# -- StateField(initial="position") (plugin contract 4) ---------------------------------------------
class _Arrival(Scorer):
    """Keeps each token's position as it arrived (``initial="position"``), in two dtypes, and a
    per-head constant: the update leaves them as they are, the score is the position."""

    type_name: ClassVar[str] = "arrival_test"
    reads_queries: ClassVar[bool] = True

    @property
    def state_fields(self):
        return {"at": StateField(torch.int64, "position"), "at_f": StateField(torch.float32, "position"),
                "flag": StateField(torch.float32, 7.0, per="head")}

    def update_state(self, inp):
        state = inp.state_of(self)
        return {name: t.clone() for name, t in state.items()}

    def score(self, inp):
        return inp.state_of(self)["at_f"]


def test_initial_position_in_select_fresh_state():
    """``Policy.select`` without ``state=``: a position field starts at each slot's position, the
    ``positions`` given ([B, N] or [B, Hkv, N]) or select's default (0 .. among the valid slots)."""
    policy = _scorer_policy(_Arrival(), budget=6, recent=2)
    g = torch.Generator().manual_seed(1)
    k, v, q = torch.randn(2, 2, 12, 8, generator=g), torch.randn(2, 2, 12, 8, generator=g), torch.randn(2, 4, 4, 8, generator=g)
    # scored by position: the 4 candidates kept are those of the highest positions
    assert policy.select(k, v, q)[:, :, :4].tolist() == [[[6, 7, 8, 9]] * 2] * 2
    positions = torch.stack([torch.randperm(12, generator=g) + 30 for _ in range(2)])  # [B, N]
    kept = policy.select(k, v, q, positions=positions)
    for b in range(2):
        want = sorted(positions[b, :10].topk(4).indices.tolist())
        assert kept[b, :, :4].tolist() == [want, want]
    per_head = torch.stack([positions, positions.flip(-1)], 1)  # [B, Hkv, N]
    kept = policy.select(k, v, q, positions=per_head)
    assert kept[0, 1, :4].tolist() == sorted(per_head[0, 1, :10].topk(4).indices.tolist())
    # default positions count valid slots only: padding slots are never kept, the rest by rank
    slot_valid = torch.ones(2, 12, dtype=torch.bool)
    slot_valid[1, :3] = False
    kept = policy.select(k, v, q, slot_valid=slot_valid)
    assert kept[1, :, :4].tolist() == [[6, 7, 8, 9]] * 2
    # a state given is used as is, not re-filled
    state = {"arrival_test.at": torch.zeros(2, 2, 12, dtype=torch.long),
             "arrival_test.at_f": -torch.arange(12.0).expand(2, 2, 12).clone(), "arrival_test.flag": torch.zeros(2, 2)}
    assert policy.select(k, v, q, state=state)[:, :, :4].tolist() == [[[0, 1, 2, 3]] * 2] * 2


@pytest.mark.parametrize("layout", [("evict", None), ("evict", "adaptive"), ("select", None)])
def test_initial_position_through_the_cache(layout):
    """``EvictingCache``: every token's position fields hold its position from the step it
    arrives (padded rows, a long prompt, chunks, decode steps, evictions, reordered rows), and
    the per-head field its constant."""
    mode, allocation = layout
    doc = {"name": "arrival", "mode": mode, "schedule": {"budget": 8, "recent": 2, "interval": 3, "window": 2},
           "scorer": _Arrival(), "selector": "greedy"}
    if allocation:
        doc["allocation"] = {"type": allocation}
    cache = EvictingCache(load_policy(doc), num_layers=2)
    g = torch.Generator().manual_seed(7)
    checked = 0
    for i, t in enumerate([9, 3, 1, 1, 2, 1, 1, 1, 4, 1, 1, 1]):
        k, v, q = torch.randn(2, 2, t, 4, generator=g), torch.randn(2, 2, t, 4, generator=g), torch.randn(2, 4, t, 4, generator=g)
        valid = torch.ones(2, t, dtype=torch.bool)
        if i == 0:
            valid[1, :4] = False
        for layer in range(2):
            cache.attend(layer, q, k, v, token_valid=None if bool(valid.all()) else valid)
        if i == 6:
            cache.select_rows(torch.tensor([1, 0]))
        if i % 2:
            cache.evict_due()
        for layer in range(2):
            view = cache.layers[layer]
            state, held = view.state, view.valid
            assert state["arrival_test.at"].dtype == torch.int64 and state["arrival_test.at_f"].dtype == torch.float32
            assert torch.equal(state["arrival_test.at"][held], view.positions[held]), (i, layer)
            assert torch.equal(state["arrival_test.at_f"][held], view.positions[held].float()), (i, layer)
            assert bool((state["arrival_test.flag"] == 7.0).all())
            checked += 1
    assert int(cache.layers[0].evictions.min()) >= 2 and checked == 24  # evictions, or select mode's choices


@pytest.mark.parametrize("kwargs,error,message", [
    ({"initial": "position", "per": "head"}, ValueError, r"per-slot fields only"),
    ({"initial": "position", "dtype": torch.float16}, ValueError, r"holds every position .*got torch.float16"),
    ({"initial": "position", "dtype": torch.bfloat16}, ValueError, r"got torch.bfloat16"),
    ({"initial": "position", "dtype": torch.bool}, ValueError, r"got torch.bool"),
    ({"initial": "position", "dtype": torch.int16}, ValueError, r"got torch.int16"),
    ({"initial": "position", "dtype": torch.uint8}, ValueError, r"got torch.uint8"),
    ({"initial": "positions"}, ValueError, r'a finite number or "position", got \'positions\''),
    ({"initial": float("nan")}, ValueError, r"must be finite"),
    ({"initial": float("-inf")}, ValueError, r"must be finite"),
    ({"initial": None}, TypeError, r'a finite number or "position", got NoneType'),
    ({"initial": 0.5, "dtype": torch.int64}, ValueError, r"0.5 is not representable in its dtype torch.int64"),
    ({"initial": -1, "dtype": torch.uint8}, ValueError, r"not representable in its dtype torch.uint8"),
    ({"initial": 2, "dtype": torch.bool}, ValueError, r"not representable"),
    ({"initial": 1e39, "dtype": torch.float32}, ValueError, r"not representable"),
    ({"initial": 7e4, "dtype": torch.float16}, ValueError, r"not representable"),
    ({"dtype": torch.complex64}, TypeError, r"real torch dtype"),
    ({"per": "row"}, ValueError, r'"slot" or "head"'),
])
def test_bad_state_fields_are_refused_when_declared(kwargs, error, message):
    with pytest.raises(error, match=message):
        StateField(**kwargs)


def test_state_field_initial_values():
    """The one maker of fresh values: any shape, its dtype, the positions' device; a new tensor."""
    positions = torch.tensor([[[3, 4, -1]], [[0, -1, -1]]])
    for dtype in (torch.int64, torch.int32, torch.float64, torch.float32):
        fresh = StateField(dtype, "position").initial_values(positions)
        assert fresh.dtype == dtype and fresh.tolist() == positions.tolist()
    same = StateField(torch.int64, "position").initial_values(positions)
    assert same.data_ptr() != positions.data_ptr()  # never the positions themselves
    const = StateField(torch.float32, -2.5).initial_values(positions)
    assert const.shape == positions.shape and bool((const == -2.5).all())
    assert StateField(torch.int64, -1).initial_values(positions[0, 0]).tolist() == [-1, -1, -1]
    head = StateField(torch.float64, 3.0, per="head").initial_head_values((2, 4))
    assert head.shape == (2, 4) and head.dtype == torch.float64 and bool((head == 3.0).all())
    with pytest.raises(ValueError, match="initial_values"):
        StateField(torch.int64, "position").initial_head_values((2, 4))
    for ok in (StateField(torch.bool, True), StateField(torch.int8, -128), StateField(torch.float32, 0.1)):
        assert ok.initial_values(positions).dtype == ok.dtype


def test_eviction_input_always_has_query_positions_and_query_new():
    """Built without them (a hand-built input), the input fills ``query_positions`` (the window's
    valid entries are the row's latest tokens, the newest at its largest slot position) and
    ``query_new`` (every valid entry); given ones are kept."""
    from dataclasses import replace

    from kvpolicy import EvictionInput

    k = torch.randn(2, 2, 6, 4)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [-1, -1, 0, 1, 2, 3]])[:, None].expand(2, 2, 6)
    valid = torch.tensor([[True, True, True], [False, True, True]])
    inp = EvictionInput(keys=k, values=k, queries=torch.randn(2, 2, 3, 4), budget=4, num_candidates=4,
                        slot_valid=positions >= 0, query_valid=valid, positions=positions)
    assert inp.query_positions.tolist() == [[3, 4, 5], [-1, 2, 3]]
    assert inp.query_new is valid
    assert torch.equal(inp.query_positions, window_positions(valid, torch.tensor([6, 4])))
    again = replace(inp, budget=3)
    assert again.query_positions is inp.query_positions and again.query_new is inp.query_new
    given = EvictionInput(keys=k, values=k, queries=torch.randn(2, 2, 3, 4), budget=4, num_candidates=4,
                          slot_valid=positions >= 0, query_valid=valid, positions=positions,
                          query_positions=torch.full((2, 3), 9), query_new=torch.zeros(2, 3, dtype=torch.bool))
    assert given.query_positions.tolist() == [[9] * 3] * 2 and not bool(given.query_new.any())
    empty = EvictionInput(keys=k[:, :, :0], values=k[:, :, :0], queries=torch.randn(2, 2, 3, 4), budget=0,
                          num_candidates=0, slot_valid=positions[..., :0] >= 0, query_valid=valid,
                          positions=positions[..., :0])
    assert empty.query_positions.shape == (2, 3) and empty.query_positions.dtype == torch.long


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
                                          positions=pos, state={"accumulated_attention.attention": acc},
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
                torch.testing.assert_close(view.state["accumulated_attention.attention"][0, h][mask].double(),
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
            torch.testing.assert_close(view.state["accumulated_attention.attention"][0].double(), acc, rtol=2e-5, atol=2e-6)
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
            seen = state["query_counter_test.queries"]  # [B, Hkv]
            # The queries the state has not seen are exactly the window's unseen ones (newest).
            unseen = view.window_new
            assert torch.equal(seen, (tokens - unseen.sum(-1))[:, None].double().expand(-1, 2)), (i, layer)
            _, wvalid = view.window()
            qpos = window_positions(wvalid, tokens)
            unseen_sees = ((qpos[:, None, None, :] >= view.positions[..., None]) & unseen[:, None, None, :]).sum(-1)
            expected = (tokens[:, None, None] - view.positions - unseen_sees).float()
            assert torch.equal(state["query_counter_test.seen_by"][view.valid], expected[view.valid]), (i, layer)


def test_the_eviction_core_updates_the_state_once_and_ranks_as_select():
    """``eviction.evict`` (what every engine calls) keeps what ``Policy.select`` keeps on the old
    state and returns the state updated exactly once, for a stage updated at every query (H2O)
    and one updated once per eviction (G-KV: vLLM's worker once updated it twice)."""
    g = torch.Generator().manual_seed(4)
    k, v, q = torch.randn(2, 2, 20, 8, generator=g), torch.randn(2, 2, 20, 8, generator=g), torch.randn(2, 4, 4, 8, generator=g)
    for policy in (_h2o(budget=8, recent=2), load_policy("gkv", budget=8, recent=2, window=4, interval=4)):
        old = {name: torch.rand((2, 2, 20) if spec.per == "slot" else (2, 2), generator=g).to(spec.dtype)
               for name, (_, _, spec) in policy.state_fields.items()}
        inp = eviction_input(k, v, q, budget=8, recent=2, seed=0, state=policy.nest_state(old))
        kept = eviction.evict(policy, inp)
        assert torch.equal(kept.slots, policy.select(k, v, q, state=old, seed=0))
        once = policy.observe(inp)[1]
        twice = policy.observe(replace(inp, state=policy.observe(inp)[0].state))[1]
        assert set(kept.state) == set(old)
        for name in old:
            assert torch.equal(kept.state[name], once[name]), name
        assert any(not torch.equal(once[n], twice[n]) for n in old), "a second update must show"
    assert eviction.evict(load_policy("snapkv", budget=8, recent=2, window=4, interval=4),
                          eviction_input(k, v, q, budget=8, recent=2, seed=0)).state == {}


