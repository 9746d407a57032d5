"""Where kvpolicy attaches to vLLM: method wrappers installed once per process at plugin load.

Nothing is patched on disk and nothing changes for a server that does not ask for kvpolicy:
every wrapper calls the original and acts only when the instance carries a kvpolicy state, which
exists only when ``additional_config["kvpolicy"]`` was resolved by the front end.

| process | class.method (vllm 0.32) | what kvpolicy adds |
| --- | --- | --- |
| front end | ``vllm.engine.arg_utils.EngineArgs.create_engine_config`` | resolve the policy, refuse what cannot run |
| front end | ``vllm.v1.engine.input_processor.InputProcessor.process_inputs`` | resolve a request's own policy (``extra_args``); a bad one, one the server cannot serve, or a request its policy cannot run (``PolicyPlan.request_refusal``: a prompt it must keep whole and cannot, more blocks than the pool has) fails that request (``VLLMValidationError``: HTTP 400) |
| engine core | ``vllm.v1.core.sched.scheduler.Scheduler.__init__`` / ``schedule`` / ``update_from_output`` | a ``SlotLedger``; free the blocks past the kept slots when a step that evicts is scheduled; the trace |
| engine core | ``Scheduler._preempt_request`` / ``_reserve_prefill_lookahead`` | keep a preempted request's eviction points; cap its recompute's steps at them |
| engine core | ``vllm.v1.executor.abstract.Executor.initialize_from_config`` | once the workers start evicting: the model facts they cannot give and their model fingerprints, asked once of every rank (``collective_rpc``), and the executor, kept for the scheduler (``scheduler.Workers``), which asks the workers for the layer budgets they decided (CAKE) |
| engine core | ``vllm.v1.engine.core.EngineCore.preprocess_add_request`` | a request whose kvpolicy settings were not resolved by the front end, that cannot fit the KV pool, whose prompt its policy cannot keep whole, or whose policy needs a model fact the workers cannot give, fails alone |
| engine core | ``vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager.get_num_blocks_to_allocate`` / ``allocate_new_blocks`` / ``free`` / ``pop_blocks_for_free`` | allocate for slots held, not tokens seen (and the fresh blocks of a first eviction under prefix caching); admission keeps room for every admitted request's peak |
| engine core | ``SingleTypeKVCacheManager.cache_blocks`` / ``FullAttentionManager.cache_blocks``, ``KVCacheManager.get_computed_blocks`` | never cache the blocks of a request that has evicted; shorten a prefix hit that would skip queries its first eviction needs |
| worker | ``vllm.v1.worker.gpu_model_runner.GPUModelRunner.initialize_kv_cache`` / ``_update_states`` / ``_prepare_inputs`` / ``execute_model`` / ``sample_tokens`` (``CPUModelRunner`` inherits them) | the per-rank state; attention length and slot mapping by slots; eviction after the forward; seeded generators held out of discarded samples |
| worker | ``vllm.model_executor.layers.attention.attention.Attention.get_kv_cache_spec`` | under a per-layer policy (``budgets.per_layer``), each layer's spec of its own (``kvpolicy.vllm.layer_spec``): vLLM builds a KV-cache group, so a block table, per layer |
| worker | ``vllm.model_executor.layers.linear.UnquantizedLinearMethod.process_weights_after_loading`` (model loading, when the server uses kvpolicy) | keep each ``o_proj``'s unpacked weight for the model facts before the CPU backend drops it (``kvpolicy.vllm.facts.keep_weight``) |
| worker | ``build`` of the attention backend's metadata builder (``install_builder``, under per-layer budgets) | each KV-cache group's attention length (``seq_lens``) its own |
| worker | ``forward`` / ``do_kv_cache_update`` of the ``AttentionImpl`` class of the model's attention layers (``install_backend``, when a runner starts evicting) | capture the window of post-RoPE queries; check the cache layout once; a select-mode request's decode rows attend its chosen blocks (``kvpolicy.vllm.select``; a page choice's through the CPU kernel itself, ``kvpolicy.vllm.block_kernel``); a per-head request's rows each head's own slots |

Queries are captured where vLLM's attention op (``unified_attention_with_output``) hands them to
the layer's backend: every backend receives the same post-RoPE query there, and the op is opaque
to ``torch.compile`` (vLLM's CPU build compiles the model unless ``enforce_eager``), so the capture
runs eagerly at every step. ``Attention.forward`` itself is traced when the model is compiled: a
capture there would be baked into the graph.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .settings import PerPolicy

if TYPE_CHECKING:
    from .plans import PolicyPlan

_INSTALLED = False


def _wrap(owner: Any, name: str, wrapper: Callable[..., Any]) -> None:
    """Replace ``owner.name`` (a class's method, or a module's function), once per process, by a
    function that calls ``wrapper(original, *args, **kwargs)``: the wrapper calls the original."""
    original = getattr(owner, name)
    if getattr(original, "__kvpolicy_wrapped__", False):
        return

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return wrapper(original, *args, **kwargs)

    wrapped.__kvpolicy_wrapped__ = True  # type: ignore[attr-defined]
    setattr(owner, name, wrapped)


def _around(owner: Any, *names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: ``_wrap`` each of ``owner``'s ``names`` with the decorated wrapper."""

    def install(wrapper: Callable[..., Any]) -> Callable[..., Any]:
        for name in names:
            _wrap(owner, name, wrapper)
        return wrapper

    return install


def install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    _install_test_switches()
    _install_frontend()
    _install_scheduler()
    _install_engine_core()
    _install_worker()


#: Keep vLLM's async scheduling on with the CPU backend, which switches it off ("not required on
#: CPU") in every process that builds the config: the only way to run the async path here.
TEST_ASYNC_ON_CPU = "KVPOLICY_VLLM_TEST_ASYNC_ON_CPU"


def _install_test_switches() -> None:
    import os

    from vllm.platforms import cpu

    platform = cpu.CpuPlatform
    original = platform.check_and_update_config
    if getattr(original, "__kvpolicy_wrapped__", False):
        return

    def check_and_update_config(cls, vllm_config) -> None:
        original(vllm_config)
        if os.environ.get(TEST_ASYNC_ON_CPU) == "1":  # read per call: set by the tests around one engine
            vllm_config.scheduler_config.async_scheduling = True

    check_and_update_config.__kvpolicy_wrapped__ = True  # type: ignore[attr-defined]
    platform.check_and_update_config = classmethod(check_and_update_config)


def _install_frontend() -> None:
    from vllm.engine.arg_utils import EngineArgs

    from . import contract, settings
    from .plans import check_config
    from .refusals import check_version

    @_around(EngineArgs, "create_engine_config")
    def create_engine_config(original, self, *args: Any, **kwargs: Any):
        entry = settings.requested(self.additional_config)
        if entry is None:
            return original(self, *args, **kwargs)
        import vllm

        check_version(vllm.__version__)
        resolved = settings.resolve(entry)
        self.additional_config = {**(self.additional_config or {}), settings.KEY: resolved.to_dict()}
        config = original(self, *args, **kwargs)
        contract.check_config(config)  # every attribute the integration reads, by name
        check_config(config, resolved)
        return config

    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    @_around(InputProcessor, "process_inputs")
    def process_inputs(original, self, request_id, prompt, params, *args: Any, **kwargs: Any):
        extra = params.extra_args if isinstance(params, SamplingParams) else None  # PoolingParams carry none
        try:
            resolved_args = settings.resolve_request(extra)
            plan = _front_plan(self, resolved_args)
            if resolved_args is not None and plan is None:
                raise settings.KVPolicyVLLMError(
                    "this server runs without kvpolicy, so requests cannot choose a policy; start it with "
                    '--additional-config \'{"kvpolicy": {"policy": "none"}}\' (no eviction unless a request '
                    "asks) or with a default policy"
                )
            if resolved_args is not None and plan is not None and plan.refusal is not None:
                raise settings.KVPolicyVLLMError(f"this request's kvpolicy settings: {plan.refusal}")
        except settings.KVPolicyVLLMError as exc:
            raise VLLMValidationError(str(exc), parameter="extra_args.kvpolicy") from None
        request = original(self, request_id, prompt, params, *args, **kwargs)
        if resolved_args is not None:
            # The request's private copy of its params: the caller's object is not changed.
            request.sampling_params.extra_args = resolved_args
        # contract.ENGINE_CORE_REQUEST: params None for pooling, prompt ids None for embeddings
        params, prompt = request.sampling_params, request.prompt_token_ids
        if plan is None or params is None or prompt is None:
            return request
        cache = self.vllm_config.cache_config  # num_gpu_blocks: None until the engine has sized the pool
        refusal = plan.request_refusal(len(prompt), params.max_tokens, cache.num_gpu_blocks, int(cache.block_size),
                                       bool(cache.enable_prefix_caching))
        if refusal is not None:
            raise VLLMValidationError(f"kvpolicy[vllm]: this request {refusal}", parameter="max_tokens")
        return request


def _front_plan(processor: Any, resolved_args: Any) -> PolicyPlan | None:
    """A request's ``PolicyPlan`` on the front end's server (its own policy, else the server's;
    None: the server runs without kvpolicy), planned once per distinct policy and front end."""
    from . import settings
    from .plans import PolicyPlan, server_group_layers

    config = processor.vllm_config
    server = settings.Resolved.from_additional_config(config.additional_config)
    if server is None:
        return None
    r = settings.request_policy(resolved_args, server)
    plans = processor.__dict__.setdefault("_kvpolicy_plans", PerPolicy())

    def build() -> PolicyPlan:  # the KV-cache groups are the server policy's
        return PolicyPlan.build(r, config, server_group_layers(server.policy(), config))

    return plans.get_or_make(r.policy_yaml, build)


def _per_layer_server(vllm_config: Any) -> bool:
    """Whether the server's policy keeps per-layer budgets (``budgets.per_layer``)."""
    from . import budgets, settings

    server = settings.Resolved.from_additional_config(vllm_config.additional_config)
    return server is not None and budgets.per_layer(server.policy())


def _install_scheduler() -> None:
    from vllm.v1.core import single_type_kv_cache_manager as stm
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    from . import contract, settings
    from . import scheduler as sched_mod

    base = stm.SingleTypeKVCacheManager

    @_around(Scheduler, "__init__")
    def __init__(original, self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if settings.Resolved.from_additional_config(self.vllm_config.additional_config) is not None:
            contract.check_scheduler(self)  # every attribute the scheduler side reads, by name
        sched_mod.init_scheduler(self)

    @_around(Scheduler, "schedule")
    def schedule(original, self, *args: Any, **kwargs: Any):
        out = original(self, *args, **kwargs)
        state = sched_mod.state_of(self)
        if state is not None:
            state.after_schedule(out)
        return out

    @_around(Scheduler, "update_from_output")
    def update_from_output(original, self, scheduler_output, model_runner_output):
        out = original(self, scheduler_output, model_runner_output)
        state = sched_mod.state_of(self)
        if state is not None:
            state.after_update(scheduler_output)
        return out

    @_around(Scheduler, "_preempt_request")
    def _preempt_request(original, self, request, *args: Any, **kwargs: Any):
        state = sched_mod.state_of(self)
        if state is not None:
            state.on_preempt(request)
        return original(self, request, *args, **kwargs)

    # vLLM's last per-request cap on a step's tokens, in both its running and waiting paths.
    @_around(Scheduler, "_reserve_prefill_lookahead")
    def _reserve_prefill_lookahead(original, self, request, num_computed_tokens, num_new_tokens):
        n = original(self, request, num_computed_tokens, num_new_tokens)
        state = sched_mod.state_of(self)
        return n if state is None or n <= 0 else state.replay_cap(request, num_computed_tokens, n)

    # For a full-attention manager only `num_tokens` sizes the allocation: the other counts
    # vLLM passes serve sliding windows (skipped tokens) and speculative decoding (the main
    # model's tokens), both refused at start-up. `apply_admission_cap` marks vLLM's check that a
    # waiting request's whole sequence fits (it only compares the count with the free blocks):
    # there every admitted request's room to its peak counts too (`admission_reserve`).
    @_around(base, "get_num_blocks_to_allocate", "allocate_new_blocks")
    def counted(original, self, request_id, num_tokens, *args: Any, **kwargs: Any):
        state = sched_mod.state()
        if state is None:
            return original(self, request_id, num_tokens, *args, **kwargs)
        group = int(self.kv_cache_group_id)  # under per-layer budgets each group counts its own layer's slots
        copies = state.copy_blocks(request_id, num_tokens, self.block_size, group)
        slots = state.counted_slots(request_id, num_tokens, group)
        blocks = original(self, request_id, slots + copies * self.block_size, *args, **kwargs)
        if kwargs.get("apply_admission_cap"):
            blocks += state.admission_reserve(self, request_id, blocks)
        return blocks

    @_around(stm.FullAttentionManager, "cache_blocks")
    @_around(base, "cache_blocks")  # first: a subclass that inherits it keeps the one wrapper
    def cache_blocks(original, self, request, *args: Any, **kwargs: Any):
        state = sched_mod.state()
        if state is not None and not state.caches(request.request_id):
            return None
        return original(self, request, *args, **kwargs)

    @_around(KVCacheManager, "get_computed_blocks")
    def get_computed_blocks(original, self, request):
        found, hit, *rest = original(self, request)
        state = sched_mod.state()
        if state is None or not state.prefix_caching:
            return (found, hit, *rest)
        groups, hit = state.computed_blocks(request, found.blocks, hit, self.coordinator.single_type_managers[0].block_size)
        return (self.create_kv_cache_blocks(groups), hit, *rest)

    @_around(base, "free", "pop_blocks_for_free")
    def freed(original, self, request_id, *args: Any, **kwargs: Any):
        for ledger in sched_mod.ledgers():  # every KV-cache group's (vLLM frees a request's groups together)
            ledger.reset(request_id)
        return original(self, request_id, *args, **kwargs)


def _install_engine_core() -> None:
    from vllm.v1.engine import core
    from vllm.v1.executor.abstract import Executor

    from . import contract, settings
    from . import scheduler as sched_mod
    from .plans import PolicyPlan

    # Every request enters the engine core here, whichever client sent it: one that does not
    # fit is refused here, alone (vLLM answers it with an error), never inside the engine loop.
    @_around(core.EngineCore, "preprocess_add_request")
    def preprocess_add_request(original, self, request, *args: Any, **kwargs: Any):
        out = original(self, request, *args, **kwargs)
        state = sched_mod.state_of(self.scheduler)
        if state is not None:
            contract.check_once(out[0], contract.REQUEST)
            state.admit(out[0])
        elif out[0].sampling_params is not None and settings.REQUEST_KEY in (out[0].sampling_params.extra_args or {}):
            raise settings.KVPolicyVLLMError(
                f"request {out[0].request_id} names a kvpolicy policy, but this engine runs without kvpolicy"
            )
        return out

    # The workers start evicting in initialize_from_config (``init_runner``): ask them here,
    # once, which facts they cannot give, before the scheduler exists or any request arrives
    # (later, preprocess_add_request runs on the engine core's input thread, where a call to
    # the workers could interleave with a running step). EngineCore.__init__ itself loads the
    # plugins, so a wrapper of it would miss its first call in an engine-core process.
    @_around(Executor, "initialize_from_config")
    def initialize_from_config(original, self, *args: Any, **kwargs: Any):
        original(self, *args, **kwargs)
        if settings.Resolved.from_additional_config(self.vllm_config.additional_config) is not None:
            sched_mod.set_workers(self)  # their missing facts and fingerprints; later, CAKE's layer budgets

    @_around(core, "get_kv_cache_configs")
    def get_kv_cache_configs(original, vllm_config, *args: Any, **kwargs: Any):
        server = settings.Resolved.from_additional_config(vllm_config.additional_config)
        mc, cc = vllm_config.model_config, vllm_config.cache_config
        need = None if server is None else PolicyPlan.of_server(server, vllm_config).pool_tokens(
            mc.max_model_len, int(cc.block_size), bool(cc.enable_prefix_caching))
        if need is None:
            return original(vllm_config, *args, **kwargs)
        # vLLM asks the pool to hold one request of max_model_len tokens; under eviction one
        # request holds at most `need` (replays after preemption included), fewer, or more under
        # prefix caching (a first eviction's fresh blocks beside the old ones): ask for that.
        full = mc.max_model_len
        mc.max_model_len = need
        try:
            return original(vllm_config, *args, **kwargs)
        except ValueError as exc:
            raise settings.KVPolicyVLLMError(
                f"the KV cache cannot hold one request under the server's policy ({need} slots: "
                f"its peak, budget plus interval, in blocks{' plus the blocks of a first eviction under prefix caching' if cc.enable_prefix_caching else ''}). vLLM said: {exc}"
            ) from None
        finally:
            mc.max_model_len = full


def _install_worker() -> None:
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from . import contract, facts, settings, worker

    def _checked(layer: Any) -> Any:
        contract.check_once(layer, contract.LINEAR_LAYER)
        return layer

    def _kvpolicy_loading() -> bool:
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
        return config is not None and settings.Resolved.from_additional_config(config.additional_config) is not None

    @_around(UnquantizedLinearMethod, "process_weights_after_loading")
    def process_weights_after_loading(original, self, layer):
        # vLLM's CPU backend packs the weight for oneDNN and drops `weight`: the output
        # projections' are kept (not copied) for the model facts of policies that read them.
        if isinstance(layer, LinearBase) and _kvpolicy_loading() and _checked(layer).prefix.endswith(".o_proj"):
            facts.keep_weight(layer)
        return original(self, layer)

    @_around(Attention, "get_kv_cache_spec")
    def get_kv_cache_spec(original, self, vllm_config):
        spec = original(self, vllm_config)
        # A server under per-layer budgets: a KV-cache group (a block table) per layer.
        if type(spec) is FullAttentionSpec and _per_layer_server(vllm_config):
            from .layer_spec import layer_spec

            return layer_spec(spec, extract_layer_index(self.layer_name))
        return spec

    @_around(GPUModelRunner, "initialize_kv_cache")
    def initialize_kv_cache(original, self, *args: Any, **kwargs: Any):
        out = original(self, *args, **kwargs)
        state = worker.init_runner(self)
        if state is not None:
            for impl_cls in state.impl_classes:
                install_backend(impl_cls)
            for builder_cls in state.builder_classes:
                install_builder(builder_cls)
        return out

    @_around(GPUModelRunner, "_update_states")
    def _update_states(original, self, scheduler_output):
        state = worker.runner_eviction(self)
        if state is not None:
            state.on_update_states(scheduler_output)
        return original(self, scheduler_output)

    @_around(GPUModelRunner, "_prepare_inputs")
    def _prepare_inputs(original, self, scheduler_output, num_scheduled_tokens):
        out = original(self, scheduler_output, num_scheduled_tokens)
        state = worker.runner_eviction(self)
        if state is not None:
            state.after_prepare_inputs(num_scheduled_tokens)
        return out

    @_around(GPUModelRunner, "execute_model")
    def execute_model(original, self, *args: Any, **kwargs: Any):
        state = worker.runner_eviction(self)
        if state is not None:
            state.plan = None
        out = original(self, *args, **kwargs)
        if state is not None:
            state.after_execute()
            if out is not None:  # sampled already (or nothing to sample): sample_tokens is not called
                state.restore_generators()
        return out

    @_around(GPUModelRunner, "sample_tokens")
    def sample_tokens(original, self, *args: Any, **kwargs: Any):
        state = worker.runner_eviction(self)
        try:
            return original(self, *args, **kwargs)
        finally:
            if state is not None:
                state.restore_generators()


def install_backend(impl_cls: type) -> None:
    """Wrap an attention backend's ``AttentionImpl`` (once per class and process): capture the
    query window before its ``forward``, check the cache layout after its first cache write, and
    under per-head budgets move each head's new keys to its own slots after every write."""
    from . import worker

    @_around(impl_cls, "forward")
    def forward(original, self, layer, query, key, value, kv_cache, attn_metadata, *args: Any, **kwargs: Any):
        state = worker.active()
        if state is None or attn_metadata is None:
            return original(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
        state.capture_queries(layer, query)
        out = original(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
        if state.head_attention:
            state.attend_heads(layer, query, kwargs.get("output", out), self, kv_cache)  # heads of different counts
        if state.long_steps:
            state.after_attention(layer, query)  # the layer's keys are in
        if state.select.selecting:
            state.attend_selected(layer, query, kwargs.get("output", out), self, kv_cache)  # select mode
        return out

    @_around(impl_cls, "do_kv_cache_update")  # contract.ATTENTION_IMPL: the layout check lives there
    def do_kv_cache_update(original, self, layer, key, value, kv_cache, slot_mapping):
        out = original(self, layer, key, value, kv_cache, slot_mapping)
        state = worker.active()
        if state is not None and not state.layout_checked:
            state.check_layout(key, value, kv_cache, slot_mapping)
        if state is not None and state.head_attention:
            state.moved_tokens(layer)  # each head's copy of the new tokens to its own slots
        return out


def install_builder(builder_cls: type) -> None:
    """Under per-layer budgets (a KV-cache group per layer), wrap the attention backend's metadata
    builder (once per class and process): each group's metadata gets that group's attention
    length (``WorkerEviction.group_metadata``); vLLM gives every group the same ``seq_lens``."""
    from . import worker

    @_around(builder_cls, "build")
    def build(original, self, common_prefix_len, common_attn_metadata, *args: Any, **kwargs: Any):
        state = worker.active()
        if state is not None:
            common_attn_metadata = state.group_metadata(self, common_attn_metadata)
        return original(self, common_prefix_len, common_attn_metadata, *args, **kwargs)

