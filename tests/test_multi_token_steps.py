"""Steps of several tokens after the prompt (a chunked decode, a second turn fed at once):

- the schedule's rule fires at the end of a step whose tokens, appended one at a time, would
  have made it fire (a multiple of ``interval`` passed while more than the budget is held),
  against a brute-force reading of it;
- a cache fed such steps keeps evicting: its slots stay bounded (steps of 2 after an odd prompt
  used to pass every multiple and never evict, growing without bound);
- a per-head layout (Ada-KV, thresholds) grows its buffers inside such a step without leaving
  the rows' fast path in the middle of it (it used to stop on an internal assertion).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy import EvictingCache, load_policy
from kvpolicy.schedule import Schedule


@given(count=st.sampled_from(["slots", "tokens"]), budget=st.integers(2, 60), interval=st.integers(1, 30),
       before=st.integers(0, 200), added=st.integers(0, 40), padding=st.integers(0, 9))
def test_due_when_a_step_reaches_a_multiple_of_the_interval(count, budget, interval, before, added, padding):
    s = Schedule(budget=budget, recent=1, interval=interval, window=1, count=count)
    slots, tokens = before + added, before + padding + added
    counted = slots if count == "slots" else tokens
    # appended one at a time: it fires at a multiple of interval passed while more than the budget is held
    want = any(k % interval == 0 and slots - (counted - k) > budget for k in range(counted - added + 1, counted + 1))
    assert bool(s.due(slots, tokens, added=added)) == want
    as_rows = s.due(torch.tensor([slots, slots]), torch.tensor([tokens, tokens]), added=torch.tensor([added, added]))
    assert as_rows.tolist() == [want, want]
    if added == 1:  # one token: the rule as it always read, on the count alone
        assert bool(s.due(slots, tokens)) == (slots > budget and counted % interval == 0)


def _qkv(g: torch.Generator, t: int, b: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(b, 4, t, 8, generator=g), torch.randn(b, 2, t, 8, generator=g), torch.randn(b, 2, t, 8, generator=g)


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(["snapkv", "h2o", "streamingllm", "rkv", "ada-snapkv", "dms"]), prompt=st.integers(1, 40),
       steps=st.lists(st.integers(1, 7), min_size=20, max_size=60), seed=st.integers(0, 2**16))
def test_a_cache_fed_several_tokens_a_step_stays_bounded(name, prompt, steps, seed):
    over = {"budget": 16, "recent": 4, "interval": 4} | ({"window": 4} if name != "streamingllm" else {"recent": 12})
    if name == "dms":
        over = {"budget": 16, "recent": 4, "interval": 4}
    policy = load_policy(name, **over)
    cache = EvictingCache(policy, num_layers=1, seed=0)
    g = torch.Generator().manual_seed(seed)
    cache.attend(0, *_qkv(g, prompt))
    top = max(prompt, policy.schedule.budget) + policy.schedule.interval
    for t in steps:
        cache.attend(0, *_qkv(g, t))
        # per-head counts: one head may hold more than the budget, the layer's heads together do not
        held = int(cache.layers[0].counts[0]) if not policy.per_head else int(cache.head_counts(0).sum()) / 2
        assert held <= top + t, (held, top, t)  # before the eviction due at this step's end
    assert sum(s.evictions for s in cache.stats()) > 0


@pytest.mark.parametrize("name", ["ada-snapkv", "dms"])
def test_a_per_head_layout_grows_inside_a_step_of_several_tokens(name):
    policy = load_policy(name, budget=16, recent=4, interval=4, **({"window": 3} if name == "ada-snapkv" else {}))
    cache = EvictingCache(policy, num_layers=1, seed=0)
    g = torch.Generator().manual_seed(0)
    cache.attend(0, *_qkv(g, 15))  # the prompt, within the budget
    for _ in range(12):  # steps of 3 grow the buffers while every row is alike
        out = cache.attend(0, *_qkv(g, 3))
        assert out.shape == (1, 4, 3, 8) and bool(torch.isfinite(out).all())
    counts = cache.head_counts(0)
    assert sum(s.evictions for s in cache.stats()) > 0 and int(counts.max()) <= 16 + 4 + 3


# -- a prompt declared, then fed in chunks (EvictingCache.expect_prompt) ---------------------------
def _decode(policy: str, splits: list[int], declare: bool, prompt: int = 70, new: int = 30, pad: int = 9, **over):
    """Two layers, a left-padded batch of two: the prompt fed in steps ending at ``splits`` (and
    at ``prompt``), then ``new`` one-token steps. Returns each layer's kept positions, the
    evictions, and every step's output."""
    g = torch.Generator().manual_seed(2)
    total = prompt + new
    q, k, v = (torch.randn(2, h, total, 8, generator=g) for h in (4, 2, 2))
    valid = torch.ones(2, total, dtype=torch.bool)
    valid[1, :pad] = False
    cache = EvictingCache(load_policy(policy, **over), 2)
    if declare:
        cache.expect_prompt(prompt)
    bounds = [0, *sorted(set(splits) - {0, prompt}), prompt, *range(prompt + 1, total + 1)]
    outs = []
    for s0, s1 in zip(bounds[:-1], bounds[1:], strict=False):
        for layer in (0, 1):
            outs.append(cache.attend(layer, q[:, :, s0:s1], k[:, :, s0:s1], v[:, :, s0:s1], valid[:, s0:s1]))
    return [view.positions for view in cache.layers], [s.evictions for s in cache.stats()], outs[-2:]


SMALL = {"budget": 32, "recent": 8, "interval": 8, "window": 8}


@settings(max_examples=12, deadline=None)
@given(policy=st.sampled_from(["snapkv", "h2o", "ada-snapkv", "pyramidkv", "random-prompt", "tova"]),
       splits=st.lists(st.integers(1, 69), max_size=5))
def test_a_declared_prompt_fed_in_chunks_keeps_what_one_step_keeps(policy, splits):
    over = {"budget": 96} if policy == "random-prompt" else {"budget": 32} if policy == "tova" else SMALL
    whole = _decode(policy, [], declare=False, **over)
    chunked = _decode(policy, splits, declare=True, **over)
    assert whole[1] == chunked[1]
    assert all(torch.equal(a, b) for a, b in zip(whole[0], chunked[0], strict=True))
    for a, b in zip(whole[2], chunked[2], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_undeclared_chunks_after_the_first_are_decode_steps():
    """Without ``expect_prompt`` the first step is the prompt (a custom loop's chunks after it
    are decode steps and evict): the rule the declaration exists to change."""
    assert _decode("snapkv", [16, 32, 48], declare=False, **SMALL)[1] != _decode("snapkv", [], declare=False, **SMALL)[1]


def test_expect_prompt_refuses_what_it_cannot_mean():
    from kvpolicy.state import CacheStateError

    cache = EvictingCache(load_policy("snapkv", **SMALL), 1)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="positive int"):
            cache.expect_prompt(bad)
    cache.expect_prompt(20)
    q, k, v = torch.randn(1, 4, 30, 8), torch.randn(1, 2, 30, 8), torch.randn(1, 2, 30, 8)
    with pytest.raises(ValueError, match=r"declared as 20 tokens .* runs from 0 to 30"):
        cache.attend(0, q, k, v)
    cache.attend(0, q[:, :, :12], k[:, :, :12], v[:, :, :12])
    with pytest.raises(ValueError, match=r"runs from 12 to 24"):
        cache.attend(0, q[:, :, 12:24], k[:, :, 12:24], v[:, :, 12:24])
    with pytest.raises(CacheStateError, match="holds tokens already"):
        cache.expect_prompt(40)
    cache.reset()  # forgets the declaration too: the first step is the prompt again
    cache.attend(0, q, k, v)
    assert cache.tokens_seen() == 30
