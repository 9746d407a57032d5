"""A policy as a vLLM server runs it: built once per distinct resolved policy, read by every
question the front end and the scheduler ask of a request's policy.

A request's policy is resolved from its sampling parameters once, and each distinct policy is
loaded and planned once per front end (``kvpolicy.vllm.hooks``) and once per scheduler
(``SchedulerEviction.plan``, kept on vLLM's ``Request``): its evicting schedule, each KV-cache
group's schedule and per-head bound, whether its state sees every query, whether its layer
budgets are decided from the prompt, select mode's budget, and why this server cannot serve it.
Both ask one question of a request (``PolicyPlan.request_refusal``); the front end refuses it
before it is queued, the engine core again for clients that bypass the front end. The workers
run the same rules on their own side (``kvpolicy.vllm.requests.RequestPolicy.load``:
``budgets.group_schedules`` and ``budgets.group_head_caps``, the functions used here).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..policy import Policy
from ..schedule import Schedule
from .budgets import decides_from_prompt, evicting_schedule, group_head_caps, group_schedules, per_layer
from .ledger import peak_slots
from .refusals import (
    layer_group_refusal,
    model_refusal,
    page_refusal,
    per_layer_refusals,
    refusals,
    shard_refusal,
)
from .settings import Resolved
from .support import KVPolicyVLLMError


@dataclass(frozen=True)
class PolicyPlan:
    """One resolved policy on this server (``build``)."""

    resolved: Resolved
    policy: Policy | None  # None: the policy ``none``, which never evicts
    schedule: Schedule | None  # the ledger's schedule (``budgets.evicting_schedule``: None for select mode)
    group_schedules: list[Schedule | None]  # each KV-cache group's ([] when the server refuses the policy)
    head_caps: list[int | None]  # each group's per-head bound (None: every head keeps the budget)
    refusals: tuple[str, ...]  # every reason this server cannot serve it (its model, shards, pages, groups)
    sees_every_query: bool  # its state must see every query of the request's tokens
    from_prompt: bool  # its layer budgets are decided at the request's first eviction (CAKE)
    select_budget: int | None  # select mode: the slots it attends (None: it evicts, or never)

    @property
    def refusal(self) -> str | None:
        """Why this server cannot serve the policy (the first of ``refusals``; None: it can)."""
        return self.refusals[0] if self.refusals else None

    @staticmethod
    def build(resolved: Resolved, vllm_config: Any, group_layers: list[int] | None,
              missing: Mapping[str, str] | None = None,
              fingerprints: Sequence[Mapping[str, Any] | None] = ()) -> PolicyPlan:
        """Plan ``resolved`` on the server of ``vllm_config``, whose KV-cache groups hold
        ``group_layers`` (None: one group for every layer), whose workers cannot give the
        ``missing`` facts and hold models of these ``fingerprints`` (each rank's; the front end
        knows neither: ``refusals.model_refusal`` then checks what the configuration says)."""
        policy = resolved.policy()
        kv_heads = kv_heads_per_rank(vllm_config)
        groups = layer_group_refusal(policy, group_layers is not None)
        schedules: list[Schedule | None] = []
        caps: list[int | None] = []
        if groups is None:
            try:
                schedules = group_schedules(policy, group_layers, kv_heads)
                caps = group_head_caps(policy, group_layers, kv_heads)
            except KVPolicyVLLMError as exc:  # a budget these layers cannot share
                groups, schedules = str(exc).removeprefix("kvpolicy[vllm]: "), []
        reasons = (model_refusal(policy, vllm_config.model_config, missing=missing, fingerprints=fingerprints),
                   shard_refusal(policy, int(vllm_config.parallel_config.tensor_parallel_size)),
                   page_refusal(policy, int(vllm_config.cache_config.block_size)), groups)
        return PolicyPlan(
            resolved, policy, evicting_schedule(policy), schedules, caps, tuple(r for r in reasons if r is not None),
            policy is not None and policy.observes_queries, decides_from_prompt(policy),
            policy.budget if policy is not None and policy.mode == "select" else None,
        )

    @staticmethod
    def of_server(resolved: Resolved, vllm_config: Any) -> PolicyPlan:
        """``resolved`` planned as the policy a server starts with: its KV-cache groups are the
        ones that policy asks for (``server_group_layers``)."""
        return PolicyPlan.build(resolved, vllm_config, server_group_layers(resolved.policy(), vllm_config))

    def pool_tokens(self, max_model_len: int, block_size: int, prefix_caching: bool) -> int | None:
        """Slots each KV-cache group of the pool must hold, in whole blocks, for the server's
        policy to serve any one request of at most ``max_model_len`` tokens whose prompt is
        within the budget (longer prompts are checked per request: ``request_refusal``): the
        most such a request holds in its fullest group. Under prefix caching that counts a first
        eviction's fresh blocks, so it may be more than ``max_model_len``. None: the policy never
        evicts, so vLLM's own check holds."""
        s = self.schedule
        if s is None:
            return None
        if self.refusal is not None:
            raise KVPolicyVLLMError(self.refusal)
        prompt = min(s.budget, max_model_len)  # a request's peak grows with its prompt and its length
        return max(request_need_blocks(g, prompt, max_model_len, block_size, prefix_caching, cap)
                   for g, cap in zip(self.group_schedules, self.head_caps, strict=True)) * block_size

    def request_refusal(self, prompt_len: int, max_tokens: int | None, num_gpu_blocks: int | None, block_size: int,
                        prefix_caching: bool) -> str | None:
        """Why one request of this policy cannot run here (None: it can): the server cannot serve
        its policy (``refusal``), its policy must keep its whole prompt and the budget cannot
        hold it (``Policy.prompt_refusal``), or it needs more blocks than the KV pool has
        (``pool_refusal``). ``num_gpu_blocks``: vLLM's count, its null block included (None or 0:
        the pool is not sized yet, so the pool is not asked)."""
        if self.refusal is not None:
            return self.refusal
        new_tokens = None if max_tokens is None else int(max_tokens)
        if self.policy is not None:
            prompt = self.policy.prompt_refusal(prompt_len, new_tokens)
            if prompt is not None:
                return prompt
        if not num_gpu_blocks:
            return None
        return pool_refusal(self.group_schedules, prompt_len, new_tokens or 0, int(num_gpu_blocks) - 1, block_size,
                            prefix_caching, self.head_caps)  # vLLM's null block holds nothing


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def request_need_blocks(schedule: Schedule | None, prompt_len: int, total: int, block_size: int,
                        prefix_caching: bool, head_cap: int | None = None) -> int:  # one KV-cache group
    """Blocks one request holds at most: its peak slots, plus, under prefix caching, the fresh
    blocks its first eviction writes the kept slots into (held for one step beside the old ones).
    ``head_cap``: its policy's per-head bound (``budgets.head_cap``)."""
    blocks = cdiv(peak_slots(schedule, prompt_len, total, head_cap), block_size)
    if schedule is not None and prefix_caching and total > schedule.budget:
        blocks += cdiv(schedule.budget if head_cap is None else head_cap, block_size)
    return blocks


def pool_refusal(schedules: list[Schedule | None], prompt_len: int, max_tokens: int, pool_blocks: int,
                 block_size: int, prefix_caching: bool, head_caps: list[int | None] | None = None) -> str | None:
    """Why a request cannot run in a KV pool of ``pool_blocks`` blocks (None: it can), with
    ``schedules`` the request's schedule of each KV-cache group (``budgets.group_schedules``:
    one for all layers, or one per layer, whose blocks each hold one layer) and ``head_caps``
    its per-head bound in each (``budgets.group_head_caps``; None: none anywhere)."""
    caps = head_caps if head_caps is not None else [None] * len(schedules)
    need = sum(request_need_blocks(s, prompt_len, prompt_len + max_tokens, block_size, prefix_caching, cap)
               for s, cap in zip(schedules, caps, strict=True))
    if need <= pool_blocks:
        return None
    schedule = schedules[0]
    if schedule is None:
        what = "no eviction: it holds all its prompt and output tokens"
    else:  # what makes its peak: the interval, a whole prompt, a first eviction's fresh blocks
        what = f"its policy keeps {schedule.budget} slots and up to {schedule.interval} more between evictions"
        if prompt_len > schedule.budget:
            what += f"; its prompt of {prompt_len} tokens is held whole before the first eviction"
        if prefix_caching and prompt_len + max_tokens > schedule.budget:
            what += "; under prefix caching its first eviction writes the kept slots into fresh blocks beside the old ones"
    return (f"needs {need} KV blocks of {block_size} ({what}), more than the {pool_blocks} the KV pool has; "
            "shorten it (prompt or max_tokens) or choose a policy that evicts (with compress_prompt for long prompts)")


def check_config(vllm_config: Any, resolved: Resolved) -> None:
    """Refuse, with every reason at once, a server configuration that cannot run ``resolved`` as
    its policy: the engine's (``refusals.refusals``), the plan's, a per-layer policy's. (The vLLM
    release is checked before, as the front end resolves the settings: ``refusals.check_version``.)"""
    plan = PolicyPlan.of_server(resolved, vllm_config)
    reasons = [*refusals(vllm_config), *plan.refusals, *per_layer_refusals(plan.policy, vllm_config)]
    if reasons:
        lines = "\n".join(f"  - {r}" for r in reasons)
        raise KVPolicyVLLMError(f"cannot serve policy {resolved.source!r} with this configuration:\n{lines}")


def server_group_layers(policy: Policy | None, vllm_config: Any) -> list[int] | None:
    """The layer of each KV-cache group of a server started with ``policy``: one group per layer
    under a per-layer policy (``budgets.per_layer``), else None (one group for every layer)."""
    return list(range(num_layers(vllm_config))) if per_layer(policy) else None


def num_layers(vllm_config: Any) -> int:
    """The model's attention layers (pipeline parallelism is refused under per-layer budgets)."""
    return int(vllm_config.model_config.get_num_layers(vllm_config.parallel_config))


def kv_heads_per_rank(vllm_config: Any) -> int:
    """The KV heads of the model each tensor-parallel rank holds (what a per-head bound counts)."""
    return int(vllm_config.model_config.get_num_kv_heads(vllm_config.parallel_config))
