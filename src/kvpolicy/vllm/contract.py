"""The vLLM attributes kvpolicy reads, each with why, checked at start-up and refused by name.

A vLLM release that renames one must stop the server naming it, never switch a refusal or a fix
off without a word (as a ``getattr`` default would). Each ``Contract`` lists what the integration
reads on one vLLM class. Live objects are checked where kvpolicy first holds them (the config in
the front end, the scheduler in the engine core, the model runner and its attention layers when
a worker starts evicting); per-step objects' classes by their declared fields. The code then
reads the attributes directly; one vLLM sets to None when unused (``sinks``) must still exist.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .support import SUPPORTED_VLLM_TEXT, KVPolicyVLLMError

#: The vLLM release these lists were read from (the Makefile's ``VLLM_VERSION``).
CONTRACT_VLLM = "0.32.0"

_ABSENT = object()


@dataclass(frozen=True)
class Contract:
    """What kvpolicy reads on one vLLM class: ``reads`` maps each attribute to why."""

    owner: str  # the vLLM class, as messages name it
    reads: Mapping[str, str]

    def only(self, *names: str) -> Contract:
        """The part of this contract about ``names`` (a check that needs no more)."""
        return Contract(self.owner, {n: self.reads[n] for n in names})


VLLM_CONFIG = Contract("vllm.config.VllmConfig", {
    "model_config": "the model's shape and kind, for refusals and facts",
    "cache_config": "block size, KV dtype, prefix caching, pool size",
    "parallel_config": "tensor, pipeline, data and context parallelism",
    "scheduler_config": "async scheduling, the CPU test switch",
    "speculative_config": "speculative decoding is refused",
    "kv_transfer_config": "KV transfer connectors are refused",
    "additional_config": "where the server's kvpolicy settings travel",
})
PARALLEL_CONFIG = Contract("vllm.config.ParallelConfig", {
    "tensor_parallel_size": "each rank evicts its own KV heads",
    "pipeline_parallel_size": "refused under per-layer budgets",
    "data_parallel_size": "data parallelism is refused",
    "decode_context_parallel_size": "context parallelism is refused",
    "prefill_context_parallel_size": "context parallelism is refused",
})
CACHE_CONFIG = Contract("vllm.config.CacheConfig", {
    "block_size": "slots per KV block", "cache_dtype": "a quantised KV cache is refused",
    "enable_prefix_caching": "prefix hits and first-eviction copies",
    "num_gpu_blocks": "a request longer than the pool is refused",
    "kv_cache_layout": "how each layer's blocks are strided, kvpolicy.vllm.layout",
})
EXECUTOR = Contract("vllm.v1.executor.abstract.Executor", {
    "vllm_config": "the engine whose scheduler takes the workers' answers",
    "collective_rpc": "one question of every rank: missing model facts, fingerprints, CAKE's budgets",
})
MODEL_RUNNER = Contract("vllm.v1.worker.gpu_model_runner.GPUModelRunner", {
    "vllm_config": "the server's settings in the worker",
    "kv_cache_config": "the KV-cache groups and their layers",
    "compilation_config": "the attention layers, static_forward_context",
    "requests": "each request's block ids follow its evictions",
    "input_batch": "the step's requests, token counts and block tables",
    "seq_lens": "the attention length follows the slots held",
    "optimistic_seq_lens_cpu": "the attention length follows the slots held",
    "positions": "RoPE positions count tokens, slots are positions minus evicted",
    "query_start_loc": "the slot mapping of the step's tokens",
    "discard_request_mask": "seeded generators held out of discarded samples: CPU ones cannot rewind",
    "get_model": "the model's facts: RoPE, o_proj",
})
INPUT_BATCH = Contract("vllm.v1.worker.gpu_input_batch.InputBatch", {
    "num_reqs": "the step's requests", "req_ids": "the step's requests",
    "req_id_to_index": "a trimmed request's block-table row",
    "num_computed_tokens_cpu": "tokens seen before the step", "num_prompt_tokens": "where prefill ends",
    "block_table": "each group's block table and slot mapping",
    "generators": "seeded generators held out of discarded samples",
})
KV_CACHE_GROUP = Contract("vllm.v1.kv_cache_interface.KVCacheGroupSpec", {
    "layer_names": "the layers of a KV-cache group",
    "kv_cache_spec": "the group's block size, and its layer under per-layer budgets",
})
ATTENTION_LAYER = Contract("vllm.model_executor.layers.attention.attention.Attention", {
    "layer_name": "finds a running layer's query window", "kv_cache": "the layer's blocks",
    "impl": "the backend's head counts and attention options",
    "attn_backend": "the backend's name and metadata builder",
})
ATTENTION_IMPL = Contract("vllm.v1.attention.backend.AttentionImpl", {
    "num_heads": "query heads per rank", "head_size": "the head size",
    "scale": "per-head and select-mode attention's softmax scale",
    "alibi_slopes": "per-head attention refuses ALiBi",
    "logits_soft_cap": "per-head attention refuses soft-capping",
    "sinks": "per-head attention refuses attention sinks",
    "sliding_window": "per-head attention refuses a sliding window",
    "forward": "wrapped: queries captured, rows recomputed",
    "do_kv_cache_update": "wrapped: the cache layout is checked against the first keys written",
})
LINEAR_LAYER = Contract("vllm.model_executor.layers.linear.LinearBase", {
    "prefix": "finds each o_proj, whose weight the model facts keep"})
METADATA_BUILDER = Contract("vllm.v1.attention.backend.AttentionMetadataBuilder", {
    "layer_names": "which KV-cache group's attention length a build gets",
    "build": "wrapped under per-layer budgets",
})
SCHEDULER = Contract("vllm.v1.core.sched.scheduler.Scheduler", {
    "vllm_config": "the server's settings in the engine core", "scheduler_config": "async scheduling",
    "kv_cache_config": "the KV-cache groups, one per layer under per-layer budgets",
    "kv_cache_manager": "each group's blocks, freed past the kept slots",
    "requests": "each request's policy, replay points and budgets", "waiting": "the trace's queue lengths",
    "running": "the trace's queue lengths, and the room admission reserves for their peaks",
    "policy": "admission keeps room for every admitted request's peak under first-come-first-served only",
})
KV_CACHE_MANAGER = Contract("vllm.v1.core.kv_cache_manager.KVCacheManager", {
    "coordinator": "each KV-cache group's manager",
    "block_pool": "blocks freed by eviction return to the pool",
    "create_kv_cache_blocks": "a prefix hit shortened before the first eviction's window",
})
KV_CACHE_COORDINATOR = Contract("vllm.v1.core.kv_cache_coordinator.KVCacheCoordinator", {
    "single_type_managers": "each KV-cache group's manager",
})
SINGLE_TYPE_MANAGER = Contract("vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager", {
    "req_to_blocks": "a request's blocks, trimmed past its kept slots",
    "block_pool": "blocks freed by eviction return to the pool", "block_size": "slots per block",
    "kv_cache_group_id": "each group counts its own layer's slots",
})
#: Parameters of a vLLM method that kvpolicy's wrapper reads (``check_parameters``).
BLOCKS_TO_ALLOCATE = Contract("vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager.get_num_blocks_to_allocate", {
    "apply_admission_cap": "marks vLLM's admission check, which also counts every admitted request's room to its peak",
})
BLOCK_POOL = Contract("vllm.v1.core.block_pool.BlockPool", {"free_blocks": "freed blocks return to the pool"})
# Per-step objects, checked on their classes (declared fields); a Request when the first arrives.
SCHEDULER_OUTPUT = Contract("vllm.v1.core.sched.output.SchedulerOutput", {
    "finished_req_ids": "finished requests leave the paged cache",
    "scheduled_new_reqs": "new requests start afresh",
    "scheduled_cached_reqs": "resumed requests replay their evictions",
    "num_scheduled_tokens": "the step's tokens per request, for the ledger",
    "total_num_scheduled_tokens": "the trace",
})
REQUEST = Contract("vllm.v1.request.Request", {
    "request_id": "the ledger's key", "sampling_params": "a request's own kvpolicy settings and length",
    "num_prompt_tokens": "where prefill ends",
    "num_computed_tokens": "tokens seen, for a recompute's eviction points",
    "num_tokens": "tokens seen, for admission", "is_finished": "finished requests leave the ledger",
})
CACHED_REQUEST_DATA = Contract("vllm.v1.core.sched.output.CachedRequestData", {
    "resumed_req_ids": "resumed requests replay their evictions",
})
NEW_REQUEST_DATA = Contract("vllm.v1.core.sched.output.NewRequestData", {"req_id": "new requests start anew"})
CACHED_REQUEST_STATE = Contract("vllm.v1.worker.gpu_input_batch.CachedRequestState", {
    "sampling_params": "a request's own kvpolicy settings",
    "block_ids": "a request's block ids follow its evictions",
})
COMMON_ATTENTION_METADATA = Contract("vllm.v1.attention.backend.CommonAttentionMetadata", {
    "seq_lens": "each KV-cache group's own attention length",
    "max_seq_len": "each KV-cache group's own attention length",
})
SAMPLING_PARAMS = Contract("vllm.sampling_params.SamplingParams", {
    "extra_args": "a request's own kvpolicy settings",
    "max_tokens": "a request longer than the pool is refused",
})
ENGINE_CORE_REQUEST = Contract("vllm.v1.engine.EngineCoreRequest", {
    "sampling_params": "a request's own kvpolicy settings",
    "prompt_token_ids": "a prompt longer than the pool is refused",
})
PER_STEP = (SCHEDULER_OUTPUT, CACHED_REQUEST_DATA, NEW_REQUEST_DATA, CACHED_REQUEST_STATE,
            COMMON_ATTENTION_METADATA, SAMPLING_PARAMS, ENGINE_CORE_REQUEST)
_CHECKED: set[tuple[type, str]] = set()  # check_once's


def has(obj: Any, name: str) -> bool:
    """Whether ``obj`` (an object, or a class) has ``name``, without running a property: on a
    class, a declared field (dataclass, msgspec, annotation) counts."""
    if inspect.getattr_static(obj, name, _ABSENT) is not _ABSENT:
        return True
    if not isinstance(obj, type):
        return False
    return any(name in getattr(k, "__dataclass_fields__", ()) or name in vars(k).get("__annotations__", {})
               or name in getattr(k, "__struct_fields__", ()) for k in obj.__mro__)


def missing(obj: Any, contract: Contract) -> list[str]:
    return [name for name in contract.reads if not has(obj, name)]


def check(obj: Any, contract: Contract) -> None:
    """Refuse ``obj`` (an instance or class of ``contract.owner``) if it lacks an attribute kvpolicy reads."""
    absent = missing(obj, contract)
    if absent:
        cls = obj if isinstance(obj, type) else type(obj)
        raise _refusal(contract, f"{cls.__module__}.{cls.__qualname__}, ", "attribute", absent)


def check_parameters(func: Any, contract: Contract) -> None:
    """Refuse a vLLM method (``func``) that lacks a parameter kvpolicy's wrapper of it reads."""
    params = inspect.signature(func).parameters
    absent = [name for name in contract.reads if name not in params]
    if absent:
        raise _refusal(contract, "", "parameter", absent)


def _refusal(contract: Contract, where: str, kind: str, absent: list[str]) -> KVPolicyVLLMError:
    reasons = "; ".join(f"{name!r} (read for: {contract.reads[name]})" for name in absent)
    return KVPolicyVLLMError(
        f"{contract.owner} ({where}vLLM {installed_version()}) has no {kind} {reasons}: kvpolicy[vllm] is written "
        f"against vLLM {CONTRACT_VLLM} (supported {SUPPORTED_VLLM_TEXT}) and refuses to run without it rather than "
        "serve with it missing"
    )


def check_once(obj: Any, contract: Contract) -> None:
    """``check`` for objects first seen after start-up (a ``Request`` declares no fields): once per class."""
    if (type(obj), contract.owner) not in _CHECKED:
        check(obj, contract)
        _CHECKED.add((type(obj), contract.owner))


def check_all(pairs: Iterable[tuple[Any, Contract]]) -> None:
    for obj, contract in pairs:
        check(obj, contract)


def installed_version() -> str:
    try:
        import vllm
    except ImportError:
        return "not installed"
    return str(vllm.__version__)


def check_config(vllm_config: Any) -> None:
    """At start-up in the front end: the engine's configuration, and the classes of the per-step
    objects the scheduler and workers will read."""
    check(vllm_config, VLLM_CONFIG)
    check(vllm_config.parallel_config, PARALLEL_CONFIG)
    check(vllm_config.cache_config, CACHE_CONFIG)
    check_all(zip(per_step_classes(), PER_STEP, strict=True))


def per_step_classes() -> list[type]:
    """vLLM's classes of ``PER_STEP``, in its order."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    return [SchedulerOutput, CachedRequestData, NewRequestData, CachedRequestState, CommonAttentionMetadata,
            SamplingParams, EngineCoreRequest]


def check_scheduler(scheduler: Any) -> None:
    """At start-up in the engine core: the scheduler and its KV-cache managers, as built."""
    check(scheduler, SCHEDULER)
    manager = scheduler.kv_cache_manager
    check(manager, KV_CACHE_MANAGER)
    check(manager.block_pool, BLOCK_POOL)
    check(manager.coordinator, KV_CACHE_COORDINATOR)
    check_all((m, SINGLE_TYPE_MANAGER) for m in manager.coordinator.single_type_managers)
    for m in manager.coordinator.single_type_managers:
        check_parameters(type(m).get_num_blocks_to_allocate, BLOCKS_TO_ALLOCATE)
