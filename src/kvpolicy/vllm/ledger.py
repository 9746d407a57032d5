"""Slots held versus tokens seen, per request: the one rule the scheduler and every worker share.

vLLM's scheduler (engine-core process) and its workers (one process per tensor-parallel rank)
never exchange eviction results. They do not need to: when eviction fires depends only on the
policy's schedule and on each request's token counts, and every rank keeps exactly ``budget``
slots per request, so each process replays the same ``SlotLedger`` and agrees on every request's
slot count, and so on its number of blocks, at every step.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schedule import Schedule


@dataclass
class RequestSlots:
    tokens: int = 0  # tokens whose keys and values were computed (RoPE positions 0 .. tokens-1)
    slots: int = 0  # slots held in the request's blocks
    evictions: int = 0

    @property
    def offset(self) -> int:
        """Tokens evicted so far: slot ``s`` appended since the last eviction holds token ``s + offset``."""
        return self.tokens - self.slots


class SlotLedger:
    """Per-request slot accounting under a schedule (no tensors, no vLLM)."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.requests: dict[str, RequestSlots] = {}

    def get(self, req_id: str) -> RequestSlots:
        state = self.requests.get(req_id)
        if state is None:
            state = self.requests[req_id] = RequestSlots()
        return state

    def offset(self, req_id: str) -> int:
        state = self.requests.get(req_id)
        return 0 if state is None else state.offset

    def reset(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    def advance(self, req_id: str, tokens_after: int, prompt_len: int) -> bool:
        """Record a step that brought the request to ``tokens_after`` computed tokens; True when
        it is now due for eviction.

        The schedule runs on the request's own tokens, as ``EvictingCache`` does for a row: the
        step that completes the prompt (every prefill chunk before it, too) evicts only when the
        policy compresses long prompts; every later step evicts when ``Schedule.due`` says so.
        """
        state = self.get(req_id)
        before = state.tokens
        added = tokens_after - before
        if added < 0:
            raise RuntimeError(f"request {req_id}: token count went back from {before} to {tokens_after}")
        state.slots += added
        state.tokens = tokens_after
        if before < prompt_len:  # a prompt chunk (or a resumed request replaying its tokens)
            return tokens_after >= prompt_len and self.schedule.due(state.slots, state.tokens, prompt=True)
        return self.schedule.fires(state.slots, state.tokens)

    def evicted(self, req_id: str) -> int:
        """Record an eviction; returns the slots kept."""
        state = self.requests[req_id]
        state.slots = min(state.slots, self.schedule.budget)
        state.evictions += 1
        return state.slots
