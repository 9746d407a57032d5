"""How a policy's budget is shared over a vLLM server's KV-cache groups: each group's schedule and
each head's bound (the scheduler's block accounting and every worker's eviction read them alike).

A server gives every layer one KV-cache group, or, under a policy that keeps budgets of its own
per layer (``per_layer``), a group per layer (``kvpolicy.vllm.layer_spec``), each running its
layer's schedule (``group_schedules``), with room for its fullest head under per-head counts
(``group_head_caps``).
"""

from __future__ import annotations

from ..config import PolicyError
from ..policy import Policy
from ..schedule import Schedule
from .support import KVPolicyVLLMError


def per_layer(policy: Policy | None) -> bool:
    """Whether ``policy`` keeps budgets of its own per layer (``pyramid``; ``cake``, whose budgets
    each request's first eviction decides from its prompt: ``decides_from_prompt``; ``duo``,
    whose layers' heads keep shares of their own: ``layer_head_caps``): a server started with it
    gives every attention layer a KV-cache group of its own (``kvpolicy.vllm.layer_spec``),
    whose blocks follow that layer's slots."""
    if policy is None or policy.mode != "evict" or not policy.allocation.uneven:
        return False
    allocation = policy.config.allocation
    return not policy.per_head or (allocation.per_head and allocation.layer_budgets_differ)


def decides_from_prompt(policy: Policy | None) -> bool:
    """Whether a request's layer budgets under ``policy`` are decided by the workers from its own
    prompt at its first eviction (``Allocation.from_prompt``: CAKE). Until the workers report them
    (``kvpolicy.vllm.scheduler``) the scheduler holds every layer's blocks."""
    return policy is not None and policy.mode == "evict" and policy.allocation.from_prompt


def layer_schedules(policy: Policy | None, num_layers: int, kv_heads: int) -> list[Schedule | None]:
    """Each layer's schedule under ``policy`` (``Policy.layer_schedules``, as ``EvictingCache``
    builds them: the policy's schedule with the layer's budget); None per layer for a request
    that never evicts (no policy, or select mode)."""
    if policy is None or evicting_schedule(policy) is None:
        return [None] * num_layers
    try:
        return list(policy.layer_schedules(num_layers, kv_heads))
    except PolicyError as exc:  # the allocation cannot share this budget among the model's layers
        raise KVPolicyVLLMError(f"policy {policy.name!r} cannot share its budget among the model's {num_layers} "
                                f"layers:\n{exc}") from None


def group_schedules(policy: Policy | None, group_layers: list[int] | None,
                    kv_heads: int | None) -> list[Schedule | None]:
    """A request's schedule in each KV-cache group: ``[its policy's]`` when one group holds every
    layer (``group_layers`` None); under per-layer budgets (group g holds layer
    ``group_layers[g]`` alone) that layer's (``layer_schedules``). The scheduler and every worker
    run one slot ledger per group on these schedules (``kvpolicy.vllm.ledger``): the same rule,
    ``Schedule.due`` on the group's own slot count, that ``EvictingCache`` runs per layer group."""
    if group_layers is None:  # kv_heads (a rank's, what an allocation's model check reads) unused
        return [evicting_schedule(policy)]
    if kv_heads is None:
        raise ValueError("group_schedules: per-layer groups need the KV heads of a rank")
    per = layer_schedules(policy, len(group_layers), kv_heads)
    return [per[layer] for layer in group_layers]


def head_cap(policy: Policy | None, kv_heads: int) -> int | None:
    """The most slots one of a layer's ``kv_heads`` KV heads keeps at an eviction of ``policy``
    when that differs from its budget (a per-head allocation: ``Allocation.head_cap``); None when
    every head keeps the budget. The scheduler and every worker reserve it alike
    (``kvpolicy.vllm.ledger``), per KV-cache group: ``group_head_caps``."""
    if policy is None or policy.mode != "evict" or not policy.per_head:
        return None
    if policy.config.selector.sets_counts:  # a threshold: each head keeps its own count, at most the budget
        return policy.budget
    return policy.config.allocation.head_cap(policy.budget, kv_heads)


def _bounds_heads(policy: Policy) -> bool:
    """Whether a per-head ``policy`` has a data-free bound on a head's count in every layer."""
    if policy.config.selector.sets_counts:
        return True
    allocation = policy.config.allocation
    return allocation.layer_head_cap(0, policy.budget, 1, policy.schedule.recent) is not None


def layer_head_caps(policy: Policy | None, num_layers: int, kv_heads: int) -> list[int | None]:
    """Per layer, ``head_cap`` with the layer's own budget (``layer_schedules``) and the
    allocation's own bound for it (``Allocation.layer_head_cap``: a DuoAttention layer's largest
    head share); None per layer where every head keeps the budget."""
    if policy is None or policy.mode != "evict" or not policy.per_head:
        return [None] * num_layers
    schedules = layer_schedules(policy, num_layers, kv_heads)
    if policy.config.selector.sets_counts:
        return [s.budget if s is not None else None for s in schedules]
    allocation = policy.config.allocation
    caps = [None if s is None else allocation.layer_head_cap(layer, s.budget, kv_heads, s.recent)
            for layer, s in enumerate(schedules)]
    if any(c is None for c in caps):  # refuse_unservable refused it already
        raise KVPolicyVLLMError(f"policy {policy.name!r}: allocation {allocation.type_name!r} bounds no head count")
    return caps


def group_head_caps(policy: Policy | None, group_layers: list[int] | None, kv_heads: int) -> list[int | None]:
    """A request's ``head_cap`` in each KV-cache group, beside ``group_schedules``: ``[head_cap]``
    with one group for every layer, else each group's layer's (``layer_head_caps``)."""
    if group_layers is None:
        return [head_cap(policy, kv_heads)]
    per = layer_head_caps(policy, len(group_layers), kv_heads)
    return [per[layer] for layer in group_layers]


def evicting_schedule(policy: Policy | None) -> Schedule | None:
    """The schedule a request's blocks follow: its policy's when it evicts; None (every token's
    block held, as under the policy ``none``) for no policy or a select-mode one, which keeps
    every token and attends a selection (``kvpolicy.vllm.select``)."""
    return policy.schedule if policy is not None and policy.mode == "evict" else None
