"""The step driver (``kvpolicy.driver``): the one loop every engine runs over its slot store, checked
against a store that records what it is asked, and against the core it calls."""

from __future__ import annotations

import pytest
import torch
from helpers import make_tensors

import kvpolicy
from kvpolicy import driver, eviction
from kvpolicy.policy import eviction_input

N, BUDGET, RECENT = 12, 6, 2


def _input(policy, seed: int):
    keys, values, queries = make_tensors(b=2, hkv=2, hq=4, n=N, d=8, w=4, seed=seed)
    state = None
    query_positions = query_new = None
    if policy.keeps_state:
        g = torch.Generator().manual_seed(seed)
        state = policy.nest_state({name: torch.rand(2, 2, N, generator=g) for name in policy.state_fields})
        query_positions = torch.arange(N - 4, N).expand(2, 4)
        query_new = torch.ones(2, 4, dtype=torch.bool)
    return eviction_input(keys, values, queries, budget=BUDGET, recent=RECENT, seed=0, layer_idx=0, evictions=0,
                          state=state, query_positions=query_positions, query_new=query_new,
                          positions=torch.arange(N).expand(2, 2, N))


class Gathered:
    def __init__(self, inp):
        self.inp = inp


class RecordingStore:
    """A store of classes named by ints, each gathered from its own seeded tensors."""

    def __init__(self, policy, fail_compact: int | None = None):
        self.policy, self.fail_compact = policy, fail_compact
        self.calls: list[tuple[str, int]] = []
        self.kept: dict[int, eviction.Kept] = {}
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def gather(self, rows: int) -> Gathered:
        self.calls.append(("gather", rows))
        return Gathered(_input(self.policy, seed=rows))

    def compact(self, rows: int, gathered: Gathered, kept: eviction.Kept) -> str:
        self.calls.append(("compact", rows))
        if rows == self.fail_compact:
            raise RuntimeError("the store could not write")
        self.kept[rows] = kept
        return f"evicted {rows}"

    def write_state(self, rows: int, gathered: Gathered, state) -> None:
        self.calls.append(("write_state", rows))
        self.states[rows] = dict(state)

    def observed(self, rows: int) -> None:
        self.calls.append(("observed", rows))


def test_evict_runs_each_class_through_the_core_and_counts_it_observed_after_it_is_written():
    policy = kvpolicy.load_policy("snapkv", budget=BUDGET, recent=RECENT, interval=4, window=4)
    store = RecordingStore(policy)
    out = driver.evict(store, policy, [3, 5])
    assert out == ["evicted 3", "evicted 5"]
    assert store.calls == [("gather", 3), ("compact", 3), ("observed", 3),
                           ("gather", 5), ("compact", 5), ("observed", 5)]
    for rows in (3, 5):  # what the store was handed is the core's own decision on what it gathered
        want = eviction.evict(policy, _input(policy, seed=rows))
        assert store.kept[rows].slots is not None and want.slots is not None
        assert torch.equal(store.kept[rows].slots, want.slots)
        assert store.kept[rows].slots.shape[-1] == BUDGET


def test_a_class_whose_write_fails_is_not_counted_observed():
    policy = kvpolicy.load_policy("snapkv", budget=BUDGET, recent=RECENT, interval=4, window=4)
    store = RecordingStore(policy, fail_compact=5)
    with pytest.raises(RuntimeError, match="could not write"):
        driver.evict(store, policy, [3, 5, 7])
    assert store.calls == [("gather", 3), ("compact", 3), ("observed", 3), ("gather", 5), ("compact", 5)]


def test_observe_stores_the_cores_update_and_evicts_nothing():
    policy = kvpolicy.load_policy("h2o", budget=BUDGET, recent=RECENT, interval=4, window=4)
    store = RecordingStore(policy)
    driver.observe(store, policy, [1, 2])
    assert store.calls == [("gather", 1), ("write_state", 1), ("observed", 1),
                           ("gather", 2), ("write_state", 2), ("observed", 2)]
    assert not store.kept
    for rows in (1, 2):
        want = eviction.observe(policy, _input(policy, seed=rows))
        assert store.states[rows].keys() == want.keys() == set(policy.state_fields)
        for name, t in want.items():
            torch.testing.assert_close(store.states[rows][name], t, rtol=0, atol=0)
        # a real update: the new queries' attention was added to what the slots held
        g = torch.Generator().manual_seed(rows)
        before = torch.rand(2, 2, N, generator=g)
        assert bool((store.states[rows]["accumulated_attention.attention"] > before).any())
