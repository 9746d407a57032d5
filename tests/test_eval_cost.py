"""Cost accounting (``kvpolicy.eval.cost``) and the executor's timing hook that it uses."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from hf_util import tiny_qwen3
from transformers import DynamicCache

from kvpolicy import EvictingCache, load_policy
from kvpolicy.eval.cost import PolicyTimer, cache_bytes, executor_of, runs_policy, time_policy
from kvpolicy.hf import KVPolicyCache

B, HKV, HQ, D = 1, 2, 4, 8


def _decode(cache: EvictingCache, steps: int, seed: int = 0) -> list[torch.Tensor]:
    """Attention outputs of a 10-token prompt and ``steps`` single-token steps through 2 layers."""
    g = torch.Generator().manual_seed(seed)
    outs = []
    for step in range(steps + 1):
        t = 10 if step == 0 else 1
        for layer in range(2):
            q = torch.randn(B, HQ, t, D, generator=g)
            k = torch.randn(B, HKV, t, D, generator=g)
            v = torch.randn(B, HKV, t, D, generator=g)
            outs.append(cache.attend(layer, q, k, v))
    return outs


def _policy(name: str):
    if name == "quest":
        return load_policy("quest", budget=24, recent=4)
    return load_policy(name, budget=16, recent=4, interval=4, window=4)


@pytest.mark.parametrize(("name", "kind"), [("snapkv", "evict"), ("vase-attnv", "evict"), ("quest", "select")])
def test_the_executor_calls_its_timer_around_the_policys_work_and_nothing_changes(name, kind):
    timed, plain = EvictingCache(_policy(name), 2), EvictingCache(_policy(name), 2)
    assert timed.executor.timer is None  # off unless set
    seen = []

    @contextmanager
    def timer(work: str):
        seen.append(work)
        yield

    timed.executor.timer = timer
    got, want = _decode(timed, 40), _decode(plain, 40)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert set(seen) == {kind}
    if kind == "evict":  # one call per due eviction of the layer group (both layers at once)
        assert len(seen) == timed.stats()[0].evictions == plain.stats()[0].evictions > 0
    else:  # one call per layer and step that attends a selection
        assert len(seen) >= 2 * (40 + 10 - 24)


def test_policy_timer_times_the_kinds_it_is_asked_for_and_is_removed_afterwards():
    cache = EvictingCache(_policy("snapkv"), 2)
    with time_policy(cache, PolicyTimer()) as timer:
        assert cache.executor.timer is timer
        _decode(cache, 40)
    assert cache.executor.timer is None
    assert timer.calls["evict"] == cache.stats()[0].evictions > 0
    assert timer.seconds["evict"] > 0 and timer.total == timer.seconds["evict"]
    assert timer.calls["select"] == 0

    select = EvictingCache(_policy("quest"), 2)
    with time_policy(select, PolicyTimer(kinds=("evict",))) as only_evictions:
        _decode(select, 40)
    assert only_evictions.calls == {"evict": 0, "select": 0}  # selections ran, untimed
    with time_policy(select, PolicyTimer()) as both:
        _decode(select, 4)
    assert both.calls["select"] > 0 and both.seconds["select"] > 0


def test_policy_timer_refuses_misuse_and_a_full_cache_costs_nothing():
    with pytest.raises(ValueError, match="unknown kind"):
        PolicyTimer(kinds=("evict", "prefill"))
    cache = EvictingCache(_policy("snapkv"), 2)
    with time_policy(cache, PolicyTimer()), pytest.raises(RuntimeError, match="already has a timer"):
        with time_policy(cache, PolicyTimer()):
            pass
    with time_policy(DynamicCache(), PolicyTimer()) as timer:  # the full cache: no policy, no time in one
        pass
    assert timer.total == 0.0 and not runs_policy(DynamicCache())


def test_a_cache_whose_executor_is_not_found_is_an_error_not_a_full_cache():
    """A renamed attribute must not pass for "no policy" (its time read as 0)."""
    with pytest.raises(TypeError, match=r"\.evicting\.executor.*\.executor"):
        executor_of(SimpleNamespace(layers=[]))
    with pytest.raises(TypeError, match="cannot tell whether a SimpleNamespace runs a policy"):
        with time_policy(SimpleNamespace(layers=[]), PolicyTimer()):
            pass
    with pytest.raises(TypeError, match="DynamicCache has no policy executor"):
        executor_of(DynamicCache())

    evicting = EvictingCache(_policy("snapkv"), 2)
    assert executor_of(evicting) is evicting.executor and runs_policy(evicting)
    del evicting.executor
    with pytest.raises(TypeError, match=r"EvictingCache\.executor is missing"):
        with time_policy(evicting, PolicyTimer()):
            pass

    model = tiny_qwen3(layers=2, vocab=64)
    cache = KVPolicyCache(_policy("snapkv"), model)
    assert executor_of(cache) is cache.evicting.executor and runs_policy(cache)
    cache.evicting = SimpleNamespace(layers=[])  # what a rename of EvictingCache.executor would leave
    with pytest.raises(TypeError, match=r"KVPolicyCache\.evicting\.executor is missing"):
        with time_policy(cache, PolicyTimer()):
            pass
    del cache.evicting
    with pytest.raises(TypeError, match=r"KVPolicyCache\.evicting\.executor is missing"):
        executor_of(cache)


def test_cache_bytes_reads_the_policy_cache_or_sums_the_full_caches_tensors():
    cache = EvictingCache(_policy("snapkv"), 2)
    _decode(cache, 5)
    assert cache_bytes(cache) == cache.memory_bytes() > 0
    k, v = torch.zeros(1, 2, 7, 8), torch.zeros(1, 2, 7, 8, dtype=torch.float16)
    full = SimpleNamespace(layers=[SimpleNamespace(keys=k, values=v), SimpleNamespace(keys=None, values=None)])
    assert cache_bytes(full) == 1 * 2 * 7 * 8 * (4 + 2)
