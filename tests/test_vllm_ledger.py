"""kvpolicy.vllm's slot ledger: the schedule per request, as the scheduler and workers replay it."""

from __future__ import annotations

import pytest

from kvpolicy import load_policy
from kvpolicy.vllm.ledger import SlotLedger


def test_ledger_follows_the_schedule_per_request():
    sched = load_policy("snapkv", budget=128).schedule  # interval 64
    led = SlotLedger(sched)
    assert not led.advance("a", 300, 300)  # a long prompt never evicts (no compress_prompt)
    fired = [t for t in range(301, 600) if led.advance("a", t, 300) and led.evicted("a")]
    assert fired[0] == 320 and all(b - a == 64 for a, b in zip(fired, fired[1:], strict=False))
    assert led.get("a").offset == 599 - led.get("a").slots
    # Chunked prefill: chunks never evict; the decode steps after it do.
    assert not led.advance("b", 100, 150) and not led.advance("b", 150, 150)
    assert [t for t in range(151, 260) if led.advance("b", t, 150) and led.evicted("b")] == [192, 256]


def test_offsets_count_evicted_tokens_and_reset_forgets_a_request():
    led = SlotLedger(load_policy("snapkv", budget=32, recent=8, interval=16, window=8).schedule)
    for t in range(1, 49):
        if led.advance("r", t, 1):
            assert led.evicted("r") == 32
    state = led.get("r")
    assert (state.tokens, state.slots, state.evictions) == (48, 32, 1)  # fired at 48 slots
    assert led.offset("r") == 16 and led.offset("unknown") == 0
    led.reset("r")
    assert led.offset("r") == 0 and "r" not in led.requests


def test_compress_prompt_evicts_with_the_last_chunk_only():
    led = SlotLedger(load_policy("snapkv", budget=64, recent=16, compress_prompt=True).schedule)
    assert not led.advance("p", 100, 300)
    assert not led.advance("p", 200, 300)
    assert led.advance("p", 300, 300) and led.evicted("p") == 64
    short = SlotLedger(load_policy("snapkv", budget=64, recent=16, compress_prompt=True).schedule)
    assert not short.advance("s", 40, 40)  # a prompt under the budget is not compressed


def test_token_count_going_back_is_an_error():
    led = SlotLedger(load_policy("snapkv", budget=128).schedule)
    led.advance("r", 10, 10)
    with pytest.raises(RuntimeError, match="went back"):
        led.advance("r", 5, 10)
