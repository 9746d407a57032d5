"""The rules of *when*, written once in the core and asked by every engine: the prompt step
(``kvpolicy.schedule.step_phase`` / ``Schedule.step_due``), select mode's choose-now rule
(``kvpolicy.selection.choose_now``), the ring read oldest first (``kvpolicy.query_ring``) and
the block order of a compaction (``kvpolicy.vllm.ledger.compaction``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy import EvictingCache, load_policy
from kvpolicy.query_ring import filled, time_order
from kvpolicy.schedule import Schedule, step_phase
from kvpolicy.selection import choose_now
from kvpolicy.vllm.ledger import BlocksDisagree, SlotLedger, compaction


def test_the_phase_of_a_step():
    assert step_phase(0, 900, 900) == "prompt"  # the prompt in one step
    assert [step_phase(a, b, 900) for a, b in ((0, 256), (256, 512), (512, 768), (768, 900))] == [
        "prefill", "prefill", "prefill", "prompt"]
    assert step_phase(899, 900, 900) == "prompt"  # a one-token last chunk is still the prompt
    assert step_phase(900, 901, 900) == "decode" and step_phase(950, 1000, 900) == "decode"
    assert step_phase(0, 1000, 900) == "prompt"  # a recompute running past the prompt


@st.composite
def schedules(draw) -> Schedule:
    budget = draw(st.integers(8, 96))
    recent = draw(st.integers(0, budget - 1))
    interval = draw(st.integers(1, 32))
    window = draw(st.integers(0, max(recent, 1) if recent > interval else interval))
    return Schedule(budget=budget, recent=recent, interval=interval, window=window,
                    count=draw(st.sampled_from(["slots", "tokens"])), compress_prompt=draw(st.booleans()))


@settings(max_examples=150, deadline=None)
@given(schedules(), st.integers(1, 300), st.lists(st.integers(1, 97), min_size=1, max_size=12), st.integers(1, 80))
def test_a_prompt_in_chunks_evicts_where_the_prompt_in_one_step_does(schedule, prompt, chunks, decode):
    """vLLM's ledger with the prompt prefilled in any chunks evicts at the same token counts as
    with the prompt in one step, which is where ``EvictingCache`` evicts."""

    def eviction_points(sizes: list[int]) -> list[int]:
        ledger, done, points = SlotLedger(), 0, []
        ledger.track("r", schedule)
        for size in sizes:
            done += size
            if ledger.advance("r", done, prompt):
                ledger.evicted("r")
                points.append(done)
        return points

    cut, pieces = 0, []
    for c in chunks:
        if cut + c >= prompt:
            break
        pieces.append(c)
        cut += c
    pieces.append(prompt - cut)
    after = [1] * decode
    assert eviction_points(pieces + after) == eviction_points([prompt, *after])


def test_the_cache_and_the_ledger_ask_the_same_rule():
    """``EvictingCache`` (its first step is the prompt) and the ledger fire at the same tokens."""
    policy = load_policy("snapkv", budget=24, recent=4, interval=8, window=8, compress_prompt=True)
    cache = EvictingCache(policy, 1)
    ledger = SlotLedger()
    ledger.track("r", policy.schedule)
    k = torch.randn(1, 2, 60, 16)
    q = torch.randn(1, 4, 60, 16)
    cache_points, ledger_points = [], []
    bounds = [0, 30, *range(31, 61)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        cache.step(0, k[:, :, a:b], k[:, :, a:b], q[:, :, a:b])
        if cache.evict_due():
            cache_points.append(b)
        if ledger.advance("r", b, 30):
            ledger.evicted("r")
            ledger_points.append(b)
    assert cache_points == ledger_points and cache_points[0] == 30  # the long prompt compressed once in


def test_choose_now_for_ints_and_rows():
    s = Schedule(budget=16, recent=4, interval=4, window=1)
    assert choose_now(2, "decode", 40, -1, s) is None  # a chunk attends densely
    assert choose_now(1, "prompt", 40, -1, s) is None  # a one-token last prompt chunk too
    assert choose_now(1, "decode", 16, -1, s) == (-1, False)  # within the budget: every slot
    assert choose_now(1, "decode", 17, -1, s) == (17, True)
    assert choose_now(1, "decode", 20, 17, s) == (17, False) and choose_now(1, "decode", 21, 17, s) == (21, True)
    held = torch.tensor([17, 20, 21, 10])
    chosen_at, fresh = choose_now(1, "decode", held, torch.tensor([-1, 17, 17, -1]), s)
    assert chosen_at.tolist() == [17, 17, 21, -1] and fresh.tolist() == [True, False, True, False]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), st.integers(0, 40))
def test_rings_read_oldest_first(window, tokens):
    """A ring written one entry per token at ``token % window`` reads back its last tokens in order."""
    ring = torch.full((window,), -1)
    for t in range(tokens):
        ring[t % window] = t
    order = time_order(tokens % window, window)
    valid = filled(torch.tensor([tokens]), window)[0]
    assert ring[order][valid].tolist() == list(range(max(0, tokens - window), tokens))
    assert time_order(torch.tensor([tokens % window]), window)[0].tolist() == order.tolist()


def test_a_compaction_keeps_fresh_blocks_first_and_frees_the_rest():
    # 10 slots in blocks of 4 (3 blocks) keep 6 (2 blocks), in place: the third block is freed.
    moved = compaction([7, 8, 9], 10, 6, 4, fresh=False, req_id="r")
    assert (moved.kept, moved.freed, moved.copied) == ([7, 8], [9], [])
    # Under prefix caching a first eviction writes into the 2 fresh blocks appended: all old ones go.
    moved = compaction([7, 8, 9, 20, 21], 10, 6, 4, fresh=True, req_id="r")
    assert (moved.kept, moved.freed, moved.copied) == ([20, 21], [9], [7, 8])
    with pytest.raises(BlocksDisagree, match="expected 3 \\+ 2 fresh"):
        compaction([7, 8, 9, 20], 10, 6, 4, fresh=True, req_id="r")
