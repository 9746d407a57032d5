"""A policy as vLLM's scheduler runs it: built once per distinct resolved policy, read by every
question the scheduler asks of a request's policy.

A request's policy is resolved from its sampling parameters once (``SchedulerEviction.plan``,
kept on vLLM's ``Request``), and each distinct policy is loaded and planned once per process:
its evicting schedule, each KV-cache group's schedule and per-head bound, whether its state
sees every query, whether its layer budgets are decided from the prompt, select mode's budget,
and why this server cannot serve it. The workers run the same rules on their own side
(``kvpolicy.vllm.requests.RequestPolicy.load``: ``settings.group_schedules`` and
``settings.group_head_caps``, the functions used here).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..policy import Policy
from ..schedule import Schedule
from .budgets import decides_from_prompt, evicting_schedule, group_head_caps, group_schedules
from .refusals import layer_group_refusal, model_refusal
from .settings import Resolved


@dataclass(frozen=True)
class PolicyPlan:
    """One resolved policy on this server (``build``)."""

    resolved: Resolved
    policy: Policy | None  # None: the policy ``none``, which never evicts
    schedule: Schedule | None  # the ledger's schedule (``settings.evicting_schedule``: None for select mode)
    group_schedules: list[Schedule | None]  # each KV-cache group's ([] when the server refuses the policy)
    head_caps: list[int | None]  # each group's per-head bound (None: every head keeps the budget)
    refusal: str | None  # why this server cannot serve it (a model fact missing, its groups), None: it can
    sees_every_query: bool  # its state must see every query of the request's tokens
    from_prompt: bool  # its layer budgets are decided at the request's first eviction (CAKE)
    select_budget: int | None  # select mode: the slots it attends (None: it evicts, or never)

    @staticmethod
    def build(resolved: Resolved, group_layers: list[int] | None, kv_heads: int, server_per_layer: bool,
              model_config: Any, missing: Mapping[str, str],
              fingerprints: Sequence[Mapping[str, Any] | None] = ()) -> PolicyPlan:
        """Plan ``resolved`` on a server of ``group_layers`` (None: one KV-cache group for every
        layer) with ``kv_heads`` KV heads per rank, whose workers cannot give the ``missing`` facts
        and hold models of these ``fingerprints`` (each rank's)."""
        policy = resolved.policy()
        groups = layer_group_refusal(policy, server_per_layer)
        refusal = model_refusal(policy, model_config, missing=missing, fingerprints=fingerprints) or groups
        return PolicyPlan(
            resolved, policy, evicting_schedule(policy),
            [] if groups is not None else group_schedules(policy, group_layers, kv_heads),
            [] if groups is not None else group_head_caps(policy, group_layers, kv_heads),
            refusal, policy is not None and policy.observes_queries, decides_from_prompt(policy),
            policy.budget if policy is not None and policy.mode == "select" else None,
        )
