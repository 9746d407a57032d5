"""Layer budgets decided from the prompt (CAKE) in vLLM: at a request's first eviction the workers
decide each layer's budget from that layer's slots and query window, as ``EvictingCache`` decides
them for a batch of one (``Policy.prompt_schedules``, the one decision both engines run). The
scheduler learns them from the step's output (``kvpolicy.vllm.ledger``: ``SlotLedger.decide``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .support import KVPolicyVLLMError

if TYPE_CHECKING:
    from .paged_cache import PagedCache
    from .requests import BlockTable


def decide_layer_budgets(caches: list[PagedCache], dues: list[list[tuple[int, str]]],
                         tables: list[BlockTable]) -> dict[str, list[int]]:
    """Layer budgets decided from the prompt (``Allocation.from_prompt``: CAKE), for the requests
    of this step whose first eviction is due: from every layer's slots and query window of the
    request alone (``Policy.prompt_schedules``, as ``EvictingCache`` decides for a batch of one),
    given to each layer's cache before any evicts. ``caches``: one per KV-cache group, each holding
    one layer, in layer order; ``dues``, ``tables``: each one's ``advance_step`` and block table.
    Returns each deciding request's budgets, by layer (what the scheduler is told)."""
    out: dict[str, list[int]] = {}
    first = caches[0]
    for row, req_id in dues[0]:
        entry = first.ledger.get(req_id)
        if not entry.from_prompt or entry.evictions or entry.layer_schedule is not None:
            continue
        if len(caches) != first.model_layers or any(c.layers != 1 for c in caches):
            raise KVPolicyVLLMError(f"request {req_id}: layer budgets decided from the prompt need a KV-cache group "
                                    "per layer (a server started with a per-layer policy)")
        if any((row, req_id) not in due for due in dues):  # they all ran the policy's schedule on its tokens
            raise KVPolicyVLLMError(f"request {req_id}: its layers are not all due at its first eviction")
        policy = first.request_policy(req_id).policy
        if policy is None:
            raise KVPolicyVLLMError(f"request {req_id}: a first eviction due without a policy")
        inputs = [c.layer_input(row, req_id, t) for c, t in zip(caches, tables, strict=True)]
        schedules = policy.prompt_schedules(inputs)
        for cache, schedule in zip(caches, schedules, strict=True):
            cache.decided_here(req_id, schedule)
        out[req_id] = [s.budget for s in schedules]
    return out
