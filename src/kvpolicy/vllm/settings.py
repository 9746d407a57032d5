"""Which policy a vLLM server runs, and whether this vLLM and configuration can run it.

Settings come from ``additional_config={"kvpolicy": {...}}`` (``--additional-config`` on
``vllm serve``) or, when that key is absent, from the environment:

* ``KVPOLICY_VLLM_POLICY``: a registered policy name, a policy file or YAML text;
* ``KVPOLICY_VLLM_OVERRIDES``: JSON object of overrides (``{"budget": 128}``);
* ``KVPOLICY_VLLM_TRACE``: a folder where the engine writes eviction and block traces.

In ``additional_config`` the keys are ``policy``, ``overrides`` (a mapping), any override given
directly (``budget``, ``recent``, ``interval``, ``window``, ``count``, ``compress_prompt``,
``seed``), and ``trace``. The front end resolves them once (``resolve``): the policy is loaded and
validated there, and the engine and worker processes receive the resolved YAML, seed included, so
every process and every tensor-parallel rank runs the same policy with the same random streams.
The policy ``none`` switches the plugin on without evicting by default (requests choose).

A request may name its own policy (``resolve_request``) in ``SamplingParams.extra_args`` (the
OpenAI server's ``vllm_xargs``): ``{"kvpolicy": "snapkv", "kvpolicy_budget": 128}`` (flat keys,
as ``vllm_xargs`` takes only strings and numbers), ``{"kvpolicy": {"policy": "snapkv", "budget":
128}}``, or the same object as JSON text; ``"none"`` keeps that request's full cache. Requests
naming nothing run the server's policy. The front end resolves each request's settings before it
reaches the engine, and a bad one fails that request alone.

This module imports nothing from vLLM at import time and nothing from ``kvpolicy.hf``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from ..config import PolicyError
from ..loading import load_policy
from ..policy import Policy
from ..schedule import Schedule
from ..stages.base import DataFile

#: The vLLM releases this integration is written against and tested with (``make test-vllm``).
SUPPORTED_VLLM = ((0, 32), (0, 33))  # >= 0.32, < 0.33
SUPPORTED_VLLM_TEXT = ">=0.32,<0.33"
KEY = "kvpolicy"
ENV_POLICY = "KVPOLICY_VLLM_POLICY"
ENV_OVERRIDES = "KVPOLICY_VLLM_OVERRIDES"
ENV_TRACE = "KVPOLICY_VLLM_TRACE"
_OVERRIDE_KEYS = ("budget", "recent", "interval", "window", "count", "compress_prompt", "seed")
_ALLOWED_KEYS = {"policy", "overrides", "trace", *_OVERRIDE_KEYS}
#: The policy that never evicts: the plugin on, every request's full cache unless it asks otherwise.
NO_POLICY = "none"
#: ``extra_args`` keys of a request: ``kvpolicy`` and flat overrides ``kvpolicy_budget`` etc.
REQUEST_KEY = "kvpolicy"
REQUEST_PREFIX = "kvpolicy_"


class KVPolicyVLLMError(ValueError):
    """A kvpolicy setting, or a vLLM configuration it cannot serve, refused at start-up."""

    def __init__(self, message: str) -> None:
        super().__init__(f"kvpolicy[vllm]: {message}")


@dataclass(frozen=True)
class Resolved:
    """What every engine process needs: the policy as validated YAML (overrides and seed applied);
    ``policy_yaml`` None for the policy ``none`` (no eviction)."""

    policy_yaml: str | None
    source: str
    seed: int
    trace: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"resolved": {"policy_yaml": self.policy_yaml, "source": self.source, "seed": self.seed,
                             "trace": self.trace}}

    @classmethod
    def from_additional_config(cls, additional: Any) -> Resolved | None:
        if not isinstance(additional, dict):
            return None
        entry = additional.get(KEY)
        if not isinstance(entry, dict) or "resolved" not in entry:
            return None
        r = entry["resolved"]
        return cls(r["policy_yaml"], r["source"], int(r["seed"]), r.get("trace"))

    def policy(self) -> Policy | None:
        return None if self.policy_yaml is None else load_policy(self.policy_yaml, seed=self.seed)


def requested(additional: Any) -> dict[str, Any] | None:
    """The user's kvpolicy settings (``additional_config`` first, then the environment), or None
    when kvpolicy is not switched on for this server."""
    if isinstance(additional, dict) and KEY in additional:
        entry = additional[KEY]
        if isinstance(entry, str):
            entry = {"policy": entry}
        if not isinstance(entry, dict):
            raise KVPolicyVLLMError(
                f'additional_config["{KEY}"] must be a mapping such as {{"policy": "snapkv", "budget": 128}}, '
                f"got {type(entry).__name__}"
            )
        return dict(entry)
    name = os.environ.get(ENV_POLICY)
    if not name:
        return None
    entry = {"policy": name}
    raw = os.environ.get(ENV_OVERRIDES)
    if raw:
        try:
            overrides = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise KVPolicyVLLMError(f"{ENV_OVERRIDES} is not valid JSON ({exc}): {raw!r}") from None
        if not isinstance(overrides, dict):
            raise KVPolicyVLLMError(f"{ENV_OVERRIDES} must be a JSON object, got {raw!r}")
        entry["overrides"] = overrides
    if os.environ.get(ENV_TRACE):
        entry["trace"] = os.environ[ENV_TRACE]
    return entry


def resolve(entry: dict[str, Any], *, per_request: bool = False) -> Resolved:
    """Load and validate the requested policy: every error names what is wrong.

    ``per_request``: settings a client sent with one request: no ``trace``, and no policy file
    (a client must not make the server read its files); names, YAML text and mappings only.
    """
    if "resolved" in entry and not per_request:  # already resolved by a front end (a config passed through twice)
        r = Resolved.from_additional_config({KEY: entry})
        assert r is not None
        return r
    allowed = _ALLOWED_KEYS - {"trace"} if per_request else _ALLOWED_KEYS
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise KVPolicyVLLMError(f"unknown setting(s) {unknown}; allowed: {sorted(allowed)}")
    source = entry.get("policy")
    if not (isinstance(source, str) and source) and not (per_request and isinstance(source, dict)):
        raise KVPolicyVLLMError('no policy given: set {"policy": NAME_OR_FILE} (or KVPOLICY_VLLM_POLICY)')
    if not isinstance(entry.get("overrides") or {}, dict):
        raise KVPolicyVLLMError(f'"overrides" must be a mapping, got {entry["overrides"]!r}')
    overrides = dict(entry.get("overrides") or {})
    overrides.update({k: entry[k] for k in _OVERRIDE_KEYS if k in entry})
    trace = entry.get("trace")
    trace = str(trace) if trace else None
    if source == NO_POLICY:
        if overrides:
            raise KVPolicyVLLMError(f"policy {NO_POLICY!r} (no eviction) takes no overrides, got {sorted(overrides)}")
        return Resolved(None, NO_POLICY, 0, trace)
    label = source if isinstance(source, str) else "<mapping>"
    if per_request and isinstance(source, str) and _is_file(source):
        raise KVPolicyVLLMError(
            f"policy {label!r}: a request may name a registered policy or send one as YAML text or a mapping, "
            "not a file of the server"
        )
    try:
        with DataFile.builtin_only() if per_request else nullcontext():
            policy = load_policy(source, **overrides)
    except PolicyError as exc:
        raise KVPolicyVLLMError(f"policy {label!r} does not load:\n{exc}") from None
    except (TypeError, ValueError) as exc:  # an override of the wrong kind (a list for a budget, ...)
        raise KVPolicyVLLMError(f"policy {label!r}: invalid override: {exc}") from None
    if per_request:
        refuse_server_files(policy, label)
    refuse_unservable(policy)
    seed = policy.resolve_seed()  # a `seed: null` policy draws once here: every rank shares it
    return Resolved(policy.with_overrides(seed=seed).to_yaml(), label, seed, trace)


def refuse_unservable(policy: Policy) -> None:
    """Refuse a policy that loads but that vLLM serving cannot run (for a server or one request).

    Every request keeps exactly its budget on every layer and head: the scheduler's block
    accounting and the block table shared by all layers (and tensor-parallel ranks) rely on it;
    or, under per-head counts with a data-free bound on a head's count (Ada-KV's ``adaptive``
    allocation, DuoAttention's head shares, a threshold selector: ``head_cap``,
    ``layer_head_caps``), room for that bound in every head (the paged cache keeps each head's
    own count, and attends each head's own slots).
    """
    allocation = policy.config.allocation
    if policy.per_head and _bounds_heads(policy):
        what = (f"allocation {allocation.type_name!r}" if allocation.per_head
                else f"selector {policy.config.selector.type_name!r}")
        if policy.observes_queries or policy.config.merge.merges:
            raise KVPolicyVLLMError(
                f"policy {policy.name!r} keeps a count of its own per head ({what}) and "
                f"{'keeps state that sees every query' if policy.observes_queries else 'merges evicted values'}: "
                "vLLM serves per-head counts for policies without merges whose state is updated once per eviction "
                "only (not implemented). Serve it with the transformers integration (KVPolicyCache)"
            )
        if allocation.uneven and not allocation.per_head:
            raise KVPolicyVLLMError(
                f"policy {policy.name!r} shares its budget unevenly (allocation {allocation.type_name!r}) and its "
                f"selector {policy.config.selector.type_name!r} sets each head's count: vLLM serves per-head counts "
                "of one allocation only (not implemented). Serve it with the transformers integration (KVPolicyCache)"
            )
    elif policy.allocation.uneven and (policy.per_head or policy.mode != "evict"):
        raise KVPolicyVLLMError(
            f"policy {policy.name!r} shares its budget unevenly (allocation {policy.allocation.type_name!r}) "
            f"{'with counts of its own per head and no bound on a head count known before the data' if policy.per_head else f'in {policy.mode!r} mode'}: "
            "vLLM serves per-layer budgets (a KV-cache group per layer) for evict-mode policies, and per-head "
            "counts where the allocation bounds the fullest head (Allocation.layer_head_cap). Serve it with the "
            "transformers integration (KVPolicyCache)"
        )
    if policy.mode == "select":
        why = select_refusal(policy)
        if why is not None:
            raise KVPolicyVLLMError(why)
    elif policy.mode != "evict":
        raise KVPolicyVLLMError(
            f"policy {policy.name!r} runs in {policy.mode!r} mode; vLLM serves evict and select modes only"
        )


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
    if evicting_schedule(policy) is None:
        return [None] * num_layers
    assert policy is not None
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


def layer_group_refusal(policy: Policy | None, server_per_layer: bool) -> str | None:
    """Why a request's ``policy`` cannot run on this server's KV-cache groups (None: it can).

    KV-cache groups are built at start-up from the server's policy: a server started with a
    per-layer policy has a group per layer, which serves per-layer and uniform evict-mode policies
    (every group then holds the uniform budget) and the full cache; one started otherwise has
    one group shared by every layer, where a layer keeping fewer slots frees no block."""
    if policy is None:
        return None
    if per_layer(policy) and not server_per_layer:
        return (f"policy {policy.name!r} keeps per-layer budgets (allocation {policy.allocation.type_name!r}), "
                "which need a KV-cache group per layer, built at start-up: this server was started with a policy "
                "whose layers keep one budget, so its layers share one block table. Start the server with a "
                "per-layer policy (pyramidkv) to serve such requests")
    if server_per_layer and policy.mode != "evict":
        what = "select mode" if policy.mode == "select" else f"{policy.mode!r} mode"
        return (f"policy {policy.name!r} runs {what}, which is not implemented on a server with a KV-cache group "
                "per layer (started with a per-layer policy); send it to a server started with a uniform policy")
    return None


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


def select_refusal(policy: Policy) -> str | None:
    """Why vLLM cannot serve a select-mode policy exactly (None: it can, ``kvpolicy.vllm.select``).

    vLLM serves selection with the full cache in its blocks and each decode step attending the
    choice of select mode's own call (``kvpolicy.eviction.choose``): whole blocks under a page
    choice (``quest`` with ``granularity: page``, whose pages must be the blocks:
    ``page_refusal``), else the chosen slots (the shipped ``quest``, ``oracle-topk``,
    ``NAME@select``). Refused: stages that keep state (select mode's per-slot state is not kept
    beside vLLM's blocks) and counts that differ by head."""
    if policy.keeps_state:
        return (
            f"policy {policy.name!r} runs in select mode with stages that keep state ({sorted(policy.state_fields)}): "
            "vLLM's select mode keeps no per-slot state beside its blocks. Serve it with the transformers "
            "integration (KVPolicyCache), or in evict mode"
        )
    if policy.per_head:
        return (
            f"policy {policy.name!r} runs in select mode with a count per head: vLLM's select mode attends the same "
            "number of slots on every head. Serve it with the transformers integration (KVPolicyCache)"
        )
    return None


def page_refusal(policy: Policy | None, block_size: int) -> str | None:
    """Why a page-choosing select-mode policy cannot run over KV blocks of ``block_size`` slots:
    its pages must be vLLM's blocks (None: they are, or the policy chooses no pages)."""
    if policy is None or policy.mode != "select":
        return None
    page = policy.chooses_pages
    if page is None or page == block_size:
        return None
    return (
        f"policy {policy.name!r} chooses pages of {page} slots (scorer.page_size), but vLLM's KV blocks hold "
        f"{block_size}: its pages are the blocks. Start vLLM with block_size={page} or set scorer.page_size: "
        f"{block_size} (with schedule.budget - schedule.recent a multiple of it)"
    )


def evicting_schedule(policy: Policy | None) -> Schedule | None:
    """The schedule a request's blocks follow: its policy's when it evicts; None (every token's
    block held, as under the policy ``none``) for no policy or a select-mode one, which keeps
    every token and attends a selection (``kvpolicy.vllm.select``)."""
    return policy.schedule if policy is not None and policy.mode == "evict" else None


def _is_file(source: str) -> bool:
    from pathlib import Path

    try:
        return Path(source).is_file()
    except (OSError, ValueError):
        return False


def refuse_server_files(policy: Policy, label: str) -> None:
    """A request's policy may read kvpolicy's built-in data files only (``builtin:NAME``): a path in
    a stage field (a calibration, a head profile) would make the server read a file a client named."""
    named = [f"{stage.kind} {stage.type_name!r} {field}: {value!r}" for stage, field, value in policy.data_files
             if not DataFile.is_builtin(value)]
    if named:
        raise KVPolicyVLLMError(
            f"policy {label!r} names a file of the server ({'; '.join(named)}): a request may use kvpolicy's "
            "built-in files only (builtin:NAME); a server names its own files in its policy (--additional-config)"
        )


def request_entry(extra_args: Any) -> dict[str, Any] | None:
    """The kvpolicy settings a request sent in ``extra_args``, as a ``resolve`` entry; None when it
    sent none. ``kvpolicy`` is a name or YAML text, JSON text of a settings object, or a mapping;
    ``kvpolicy_<override>`` keys add overrides."""
    if not isinstance(extra_args, dict):
        return None
    flat = {k[len(REQUEST_PREFIX):]: v for k, v in extra_args.items() if k.startswith(REQUEST_PREFIX)}
    if REQUEST_KEY not in extra_args:
        if flat:
            raise KVPolicyVLLMError(
                f"{sorted(REQUEST_PREFIX + k for k in flat)} given without {REQUEST_KEY!r}: name the policy too "
                f'(e.g. {{"{REQUEST_KEY}": "snapkv", "{REQUEST_PREFIX}budget": 128}})'
            )
        return None
    value = extra_args[REQUEST_KEY]
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = None  # YAML flow text of a policy, not a settings object
        if isinstance(parsed, dict) and "policy" in parsed:
            value = parsed
    if isinstance(value, str):
        entry: dict[str, Any] = {"policy": value}
    elif isinstance(value, dict):
        entry = dict(value)
    else:
        raise KVPolicyVLLMError(
            f"{REQUEST_KEY!r} must be a policy name, YAML text or a settings mapping, got {type(value).__name__}"
        )
    clash = sorted(set(flat) & set(entry))
    if clash:
        raise KVPolicyVLLMError(f"{clash} given twice (in {REQUEST_KEY!r} and as {REQUEST_PREFIX}<key>)")
    entry.update(flat)
    return entry


def resolve_request(extra_args: Any) -> dict[str, Any] | None:
    """A request's ``extra_args`` with its kvpolicy settings resolved (the form engine processes
    read: ``request_policy``), or None when it sent none. Raises ``KVPolicyVLLMError`` for a bad one."""
    try:
        entry = request_entry(extra_args)
        if entry is None:
            return None
        resolved = resolve(entry, per_request=True)
    except KVPolicyVLLMError as exc:
        raise KVPolicyVLLMError(f"this request's kvpolicy settings: {str(exc).removeprefix('kvpolicy[vllm]: ')}") from None
    assert isinstance(extra_args, dict)  # request_entry returned an entry
    rest = {k: v for k, v in extra_args.items() if k != REQUEST_KEY and not k.startswith(REQUEST_PREFIX)}
    return {**rest, REQUEST_KEY: resolved.to_dict()}


def request_policy(extra_args: Any, server: Resolved) -> Resolved:
    """The policy a request runs, in an engine process: its own as the front end resolved it, else
    the server's."""
    if not isinstance(extra_args, dict) or REQUEST_KEY not in extra_args:
        return server
    r = Resolved.from_additional_config({KEY: extra_args[REQUEST_KEY]})
    if r is None:
        raise KVPolicyVLLMError(
            f"a request reached the engine with kvpolicy settings the front end did not resolve "
            f"({extra_args[REQUEST_KEY]!r}): add requests through vLLM's input processor (LLM.generate, "
            "LLMEngine.add_request with a prompt, the OpenAI server), which validates and resolves them; "
            "this request is refused"
        )
    return r


def version_tuple(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        return (0, 0)


def check_version(version: str) -> None:
    lo, hi = SUPPORTED_VLLM
    if not lo <= version_tuple(version) < hi:
        raise KVPolicyVLLMError(
            f"vLLM {version} is not supported; kvpolicy[vllm] supports vllm {SUPPORTED_VLLM_TEXT} "
            "(it wraps engine internals that change between releases)"
        )


def refusals(vllm_config: Any) -> list[str]:
    """Every reason this engine configuration cannot evict correctly (empty: it can)."""
    from vllm.platforms import current_platform

    out: list[str] = []
    mc = vllm_config.model_config
    cc = vllm_config.cache_config
    pc = vllm_config.parallel_config
    if not current_platform.is_cpu():
        out.append(
            f"platform {current_platform.device_name!r}: GPU backends are refused until a GPU run has passed "
            "kvpolicy's vLLM engine tests (tests/engine_vllm); their cache layouts are implemented "
            "(kvpolicy.vllm.layout) and tested on CPU tensors only. Only vLLM's CPU backend (cpu_attn) runs"
        )
    if vllm_config.speculative_config is not None:
        out.append("speculative decoding is not supported (rejected draft tokens would desynchronise evictions)")
    if pc.data_parallel_size > 1:
        out.append("data parallelism is not supported (data_parallel_size must be 1)")
    if getattr(pc, "decode_context_parallel_size", 1) > 1 or getattr(pc, "prefill_context_parallel_size", 1) > 1:
        out.append("context parallelism is not supported")
    if vllm_config.kv_transfer_config is not None:
        out.append("KV transfer / offloading connectors are not supported")
    if cc.cache_dtype not in ("auto", None) and not str(cc.cache_dtype).startswith(("float32", "bfloat16", "float16")):
        out.append(f"quantised KV cache (kv_cache_dtype={cc.cache_dtype!r}) is not supported")
    if mc is not None:
        if mc.get_sliding_window() is not None:
            out.append("sliding-window models are not supported (every layer must be full attention)")
        layer_types = getattr(mc.hf_text_config, "layer_types", None)
        if layer_types and any(t != "full_attention" for t in layer_types):
            out.append(f"hybrid models are not supported (layer types {sorted(set(layer_types))})")
        if mc.is_hybrid or mc.is_attention_free:
            out.append("hybrid and attention-free models (Mamba, linear attention) are not supported")
        if mc.use_mla:
            out.append("MLA models (latent KV) are not supported")
        if mc.is_encoder_decoder:
            out.append("encoder-decoder models are not supported")
        if mc.is_multimodal_model or mc.uses_mrope:
            out.append("multimodal / M-RoPE models are not supported")
        if mc.runner_type != "generate":
            out.append(f"runner {mc.runner_type!r}: only generation is supported")
        tp = pc.tensor_parallel_size
        if tp > 1 and mc.get_total_num_kv_heads() % tp != 0:
            out.append(
                f"tensor_parallel_size {tp} does not divide the {mc.get_total_num_kv_heads()} KV heads: "
                "replicated KV heads would evict differently on each rank"
            )
    return out


def shard_refusal(policy: Policy | None, tensor_parallel_size: int) -> str | None:
    """Why ``policy`` cannot run with its KV heads split over ``tensor_parallel_size`` ranks
    (None: it can). Each rank evicts its own heads alone, which a policy whose heads choose
    together (``Policy.couples_heads``: TOVA's one decision per layer) cannot do, nor one whose
    layer budgets come from every head's attention (``decides_from_prompt``: CAKE's preference
    sums over all heads)."""
    if policy is None or tensor_parallel_size <= 1:
        return None
    if decides_from_prompt(policy):
        return (
            f"policy {policy.name!r} decides each layer's budget from its prompt's attention over all the layer's "
            f"heads (allocation {policy.allocation.type_name!r}), but tensor_parallel_size {tensor_parallel_size} "
            "gives each rank a share of the heads (not implemented: the ranks would have to add up their shares "
            "before deciding): serve it with tensor_parallel_size 1"
        )
    if not policy.couples_heads:
        return None
    if policy.config.allocation.per_head:
        return (
            f"policy {policy.name!r} shares each layer's slots among all its KV heads (allocation "
            f"{policy.config.allocation.type_name!r}: a head's count depends on every head's scores), but "
            f"tensor_parallel_size {tensor_parallel_size} gives each rank a share of the heads to evict alone: "
            "serve it with tensor_parallel_size 1"
        )
    return (
        f"policy {policy.name!r} chooses for all KV heads of a layer together (over all its query heads), but "
        f"tensor_parallel_size {tensor_parallel_size} gives each rank a share of the heads to evict alone: "
        "serve it with tensor_parallel_size 1"
    )


def model_refusal(policy: Policy | None, model_config: Any, missing: Mapping[str, str] | None = None) -> str | None:
    """Why the served model cannot run ``policy`` (None: it can): a stage that reads the model
    and cannot serve this one (``Stage.check_model_facts``: TriAttention's calibration file
    measured on another model), or a fact it reads that the loaded model cannot give
    (``missing``: fact -> why, as the workers found), in ``KVPolicyCache``'s words. Asked in the
    front end from the model's configuration and name, before any worker loads it; in the
    engine core with the workers' missing facts, per request; each worker checks the facts it
    builds again (``PagedCache.check_policy``)."""
    if policy is None or not policy.needs_model or model_config is None:
        return None
    from ..engine_facts import ModelShape
    from ..stages.model_facts import lacking, stage_problems

    facts = ModelShape.of_config(model_config.hf_text_config, str(model_config.model)).facts(
        rope_fn=None, output_projection_fn=None, missing=dict(missing or {}))
    problems = lacking(policy.stages, facts.name, missing or {}) + stage_problems(policy.stages, facts)
    if not problems:
        return None
    return f"policy {policy.name!r} cannot serve the model {facts.name!r}: " + "; ".join(problems)


def per_layer_refusals(policy: Policy | None, vllm_config: Any) -> list[str]:
    """What a server under a per-layer policy (``per_layer``: a KV-cache group per layer) cannot
    run with: prefix caching (a request's groups would hit the prefix cache apart, and a first
    eviction's fresh blocks are implemented for one group), pipeline parallelism (each stage's
    layers would need their groups of their own: not implemented)."""
    if not per_layer(policy):
        return []
    assert policy is not None
    out = []
    if vllm_config.cache_config.enable_prefix_caching:
        out.append(f"policy {policy.name!r} keeps per-layer budgets (a KV-cache group per layer), which is not "
                   "implemented with prefix caching: start the server with enable_prefix_caching=False "
                   "(--no-enable-prefix-caching)")
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        out.append(f"policy {policy.name!r} keeps per-layer budgets (a KV-cache group per layer), which is not "
                   "implemented with pipeline parallelism (pipeline_parallel_size must be 1)")
    elif getattr(vllm_config, "model_config", None) is not None:
        mc = vllm_config.model_config
        try:
            layer_schedules(policy, int(mc.get_num_layers(vllm_config.parallel_config)),
                            int(mc.get_num_kv_heads(vllm_config.parallel_config)))
        except KVPolicyVLLMError as exc:
            out.append(str(exc).removeprefix("kvpolicy[vllm]: "))
    return out


def check_config(vllm_config: Any, resolved: Resolved) -> None:
    import vllm

    check_version(vllm.__version__)
    reasons = refusals(vllm_config)
    policy = resolved.policy()
    shard = shard_refusal(policy, vllm_config.parallel_config.tensor_parallel_size)
    if shard is not None:
        reasons.append(shard)
    model = model_refusal(policy, vllm_config.model_config)
    if model is not None:
        reasons.append(model)
    page = page_refusal(policy, int(vllm_config.cache_config.block_size))
    if page is not None:
        reasons.append(page)
    reasons += per_layer_refusals(policy, vllm_config)
    if reasons:
        lines = "\n".join(f"  - {r}" for r in reasons)
        raise KVPolicyVLLMError(f"cannot serve policy {resolved.source!r} with this configuration:\n{lines}")
