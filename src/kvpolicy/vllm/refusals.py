"""What the vLLM integration refuses, by name and with the reason: a policy it cannot serve
exactly (``refuse_unservable``, ``recall_refusal``, ``worker_refusal``, ``select_refusal``,
``page_refusal``, ``layer_group_refusal``, ``shard_refusal``, ``model_refusal``), a vLLM version (``check_version``) or an engine
configuration (``refusals``, ``per_layer_refusals``; ``plans.check_config`` gathers them) it does not support.
Nothing here imports vLLM at import time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..documents import PolicyError
from ..policy import Policy
from ..stages.model_facts import ModelFacts
from .budgets import _bounds_heads, decides_from_prompt, per_layer
from .support import SUPPORTED_VLLM, SUPPORTED_VLLM_TEXT, KVPolicyVLLMError


def refuse_unservable(policy: Policy) -> None:
    """Refuse a policy that loads but that vLLM serving cannot run (for a server or one request).

    Every request keeps exactly its budget on every layer and head: the scheduler's block
    accounting and the block table shared by all layers (and tensor-parallel ranks) rely on it;
    or, under per-head counts with a data-free bound on a head's count (Ada-KV's ``adaptive``
    allocation, DuoAttention's head shares, a threshold selector: ``head_cap``,
    ``layer_head_caps``), room for that bound in every head (the paged cache keeps each head's
    own count, and attends each head's own slots).

    Two tiers (a ``recall`` block) are refused first, by name: not served yet (the design:
    ``docs/vllm.md``, "Two tiers in vLLM (not served yet)").
    """
    why = recall_refusal(policy)
    if why is not None:
        raise KVPolicyVLLMError(why)
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


def recall_refusal(policy: Policy | None) -> str | None:
    """Why vLLM cannot serve a two-tier policy (a ``recall`` block: evicted pages kept in a slow
    tier and recalled into the fast one), None for any other: not served yet. Its blocks would
    have to leave the request's table for a host pool and come back into reserved slots of it
    before attention (the design: ``docs/vllm.md``, "Two tiers in vLLM (not served yet)")."""
    if policy is None or policy.config.recall is None:
        return None
    return (
        f"policy {policy.name!r} has a `recall` block (two tiers: evicted pages kept in a slow tier and recalled "
        "into the fast one), which vLLM does not serve yet: no recalled block can enter a request's block table "
        "(docs/vllm.md, \"Two tiers in vLLM (not served yet)\"). Run it with the transformers integration "
        "(EvictingCache, or KVPolicyCache under generate()), or serve its eviction alone (the policy without "
        "`recall`)"
    )


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
    if pc.decode_context_parallel_size > 1 or pc.prefill_context_parallel_size > 1:  # contract.PARALLEL_CONFIG
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


def model_refusal(policy: Policy | None, model_config: Any, missing: Mapping[str, str] | None = None,
                  fingerprints: Sequence[Mapping[str, Any] | None] = ()) -> str | None:
    """Why the served model cannot run ``policy`` (None: it can): a stage that reads the model
    and cannot serve this one (``Stage.check_model_facts``: TriAttention's calibration file
    measured on another model), or a fact it reads that the loaded model cannot give
    (``missing``: fact -> why, as the workers found), in ``KVPolicyCache``'s words. Asked in the
    front end from the model's configuration and name, before any worker loads it (a
    calibration's model fingerprint is not known there: its shape is checked); in the engine
    core with the workers' missing facts and each rank's fingerprint (``fingerprints``:
    ``ModelFingerprint.to_dict``, None where a rank has none), per request; each worker checks
    the facts it builds again (``worker_refusal``)."""
    if policy is None or not policy.needs_model or model_config is None:
        return None
    from ..engine_facts import ModelShape
    from ..stages.fingerprint import ModelFingerprint
    from ..stages.model_facts import lacking, stage_problems

    shape = ModelShape.of_config(model_config.hf_text_config, str(model_config.model))
    problems = lacking(policy.stages, shape.name, missing or {})
    for given in fingerprints or [None]:
        facts = shape.facts(rope_fn=None, output_projection_fn=None, missing=dict(missing or {}),
                            fingerprint=None if given is None else ModelFingerprint.from_dict(dict(given)))
        problems += [p for p in stage_problems(policy.stages, facts) if p not in problems]
    if not problems:
        return None
    return f"policy {policy.name!r} cannot serve the model {shape.name!r}: " + "; ".join(problems)


def worker_refusal(
    policy: Policy | None, facts: ModelFacts | None, *, head_dim: int, kv_heads: int, head_offset: int, q_heads: int,
    per_head: str | None,
) -> str | None:
    """Why a worker's paged cache cannot serve ``policy`` (None: it can), checked when it first
    loads it: a two-tier policy (``recall_refusal``: the front end refuses it, and a worker never
    serves its eviction alone in its place), a per-head or select-mode policy where kvpolicy's own
    plain-softmax attention cannot stand in for the model's (``per_head``: why not; None: it can),
    or stages that read model facts ``facts`` (this rank's share) cannot give
    (``Policy.check_model_facts``'s message)."""
    recall = recall_refusal(policy)
    if recall is not None or policy is None:
        return recall
    if per_head is not None and (policy.per_head or policy.mode == "select"):
        what = "keeps a count of its own per head" if policy.per_head else "attends its selection itself"
        return f"policy {policy.name!r} {what}, which this model's attention cannot serve: {per_head}"
    if not policy.needs_model:
        return None
    try:
        policy.check_model_facts(facts, head_dim=head_dim, num_kv_heads=kv_heads, head_offset=head_offset, q_heads=q_heads)
    except PolicyError as exc:
        return f"policy {policy.name!r} cannot serve this model:\n{exc}"
    return None


def per_layer_refusals(policy: Policy | None, vllm_config: Any) -> list[str]:
    """What a server under a per-layer policy (``per_layer``: a KV-cache group per layer) cannot
    run with: prefix caching (a request's groups would hit the prefix cache apart, and a first
    eviction's fresh blocks are implemented for one group), pipeline parallelism (each stage's
    layers would need their groups of their own: not implemented). A budget the layers cannot
    share is the plan's refusal (``PolicyPlan.build``)."""
    if policy is None or not per_layer(policy):
        return []
    out = []
    if vllm_config.cache_config.enable_prefix_caching:
        out.append(f"policy {policy.name!r} keeps per-layer budgets (a KV-cache group per layer), which is not "
                   "implemented with prefix caching: start the server with enable_prefix_caching=False "
                   "(--no-enable-prefix-caching)")
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        out.append(f"policy {policy.name!r} keeps per-layer budgets (a KV-cache group per layer), which is not "
                   "implemented with pipeline parallelism (pipeline_parallel_size must be 1)")
    return out

