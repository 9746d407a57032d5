"""Where kvpolicy attaches to vLLM: method wrappers installed once per process at plugin load.

Nothing is patched on disk and nothing changes for a server that does not ask for kvpolicy:
every wrapper calls the original and acts only when the instance carries a kvpolicy state, which
exists only when ``additional_config["kvpolicy"]`` was resolved by the front end.

| process | class.method (vllm 0.32) | what kvpolicy adds |
| --- | --- | --- |
| front end | ``vllm.engine.arg_utils.EngineArgs.create_engine_config`` | resolve the policy, default async scheduling off, refuse what cannot run |
| front end | ``vllm.v1.engine.input_processor.InputProcessor.process_inputs`` | resolve a request's own policy (``extra_args``); a bad one fails that request (``VLLMValidationError``: HTTP 400) |
| engine core | ``vllm.v1.core.sched.scheduler.Scheduler.__init__`` / ``update_from_output`` | a ``SlotLedger``; free the blocks past the kept slots after an eviction |
| engine core | ``vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager.get_num_blocks_to_allocate`` / ``allocate_new_blocks`` / ``free`` / ``pop_blocks_for_free`` | allocate for slots held, not tokens seen (and the fresh blocks of a first eviction under prefix caching) |
| engine core | ``SingleTypeKVCacheManager.cache_blocks`` / ``FullAttentionManager.cache_blocks``, ``KVCacheManager.get_computed_blocks`` | never cache the blocks of a request that has evicted; shorten a prefix hit that would skip queries its first eviction needs |
| worker | ``vllm.v1.worker.gpu_model_runner.GPUModelRunner.initialize_kv_cache`` / ``_update_states`` / ``_prepare_inputs`` / ``execute_model`` (``CPUModelRunner`` inherits them) | the per-rank state; attention length and slot mapping by slots; eviction after the forward |
| worker | ``forward`` / ``do_kv_cache_update`` of the ``AttentionImpl`` class of the model's attention layers (``install_backend``, when a runner starts evicting) | capture the window of post-RoPE queries; check the cache layout once |

Queries are captured where vLLM's attention op (``unified_attention_with_output``) hands them to
the layer's backend: every backend receives the same post-RoPE query there, and the op is opaque
to ``torch.compile`` (vLLM's CPU build compiles the model unless ``enforce_eager``), so the capture
runs eagerly at every step. ``Attention.forward`` itself is traced when the model is compiled: a
capture there would be baked into the graph.
"""

from __future__ import annotations

import functools
from typing import Any

_INSTALLED = False


def _wrap(cls: type, name: str, make) -> None:
    original = getattr(cls, name)
    if getattr(original, "__kvpolicy_wrapped__", False):
        return
    wrapper = functools.wraps(original)(make(original))
    wrapper.__kvpolicy_wrapped__ = True  # type: ignore[attr-defined]
    setattr(cls, name, wrapper)


def install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    _install_frontend()
    _install_scheduler()
    _install_worker()


def _install_frontend() -> None:
    from vllm.engine.arg_utils import EngineArgs

    from . import settings

    def make(original):
        def create_engine_config(self, *args: Any, **kwargs: Any):
            entry = settings.requested(self.additional_config)
            if entry is None:
                return original(self, *args, **kwargs)
            import vllm

            settings.check_version(vllm.__version__)
            resolved = settings.resolve(entry)
            # vLLM turns async scheduling on by default; kvpolicy needs it off. Asked for explicitly: refused.
            if self.async_scheduling is True:
                raise settings.KVPolicyVLLMError(
                    f"cannot serve policy {resolved.source!r} with this configuration:\n"
                    "  - async scheduling is on: pass async_scheduling=False (--no-async-scheduling)"
                )
            if self.async_scheduling is None:
                self.async_scheduling = False
            self.additional_config = {**(self.additional_config or {}), settings.KEY: resolved.to_dict()}
            config = original(self, *args, **kwargs)
            settings.check_config(config, resolved)
            return config

        return create_engine_config

    _wrap(EngineArgs, "create_engine_config", make)

    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    def make_process(original):
        def process_inputs(self, request_id, prompt, params, *args: Any, **kwargs: Any):
            extra = getattr(params, "extra_args", None)
            try:
                resolved_args = settings.resolve_request(extra)
                if resolved_args is not None and settings.Resolved.from_additional_config(
                    self.vllm_config.additional_config
                ) is None:
                    raise settings.KVPolicyVLLMError(
                        "this server runs without kvpolicy, so requests cannot choose a policy; start it with "
                        '--additional-config \'{"kvpolicy": {"policy": "none"}}\' (no eviction unless a request '
                        "asks) or with a default policy"
                    )
                tp = self.vllm_config.parallel_config.tensor_parallel_size
                if resolved_args is not None and tp > 1:  # only split heads can refuse: no policy load per request otherwise
                    own = settings.request_policy(resolved_args, settings.Resolved(None, "none", 0))
                    shard = settings.shard_refusal(own.policy(), tp)
                    if shard is not None:
                        raise settings.KVPolicyVLLMError(f"this request's kvpolicy settings: {shard}")
            except settings.KVPolicyVLLMError as exc:
                raise VLLMValidationError(str(exc), parameter="extra_args.kvpolicy") from None
            request = original(self, request_id, prompt, params, *args, **kwargs)
            if resolved_args is not None:
                # The request's private copy of its params: the caller's object is not changed.
                request.sampling_params.extra_args = resolved_args
            return request

        return process_inputs

    _wrap(InputProcessor, "process_inputs", make_process)


def _install_scheduler() -> None:
    from vllm.v1.core import single_type_kv_cache_manager as stm
    from vllm.v1.core.sched.scheduler import Scheduler

    from . import scheduler as sched_mod

    def make_init(original):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            sched_mod.init_scheduler(self)

        return __init__

    def make_update(original):
        def update_from_output(self, scheduler_output, model_runner_output):
            out = original(self, scheduler_output, model_runner_output)
            state = sched_mod.state_of(self)
            if state is not None:
                state.after_update(scheduler_output)
            return out

        return update_from_output

    def make_count(original):
        # For a full-attention manager only `num_tokens` sizes the allocation: the other counts
        # vLLM passes serve sliding windows (skipped tokens) and speculative decoding (the main
        # model's tokens), both refused at start-up.
        def counted(self, request_id, num_tokens, *args: Any, **kwargs: Any):
            state = sched_mod.state()
            if state is None:
                return original(self, request_id, num_tokens, *args, **kwargs)
            copies = state.copy_blocks(request_id, num_tokens, self.block_size)
            slots = num_tokens - state.ledger.offset(request_id)
            return original(self, request_id, slots + copies * self.block_size, *args, **kwargs)

        return counted

    def make_cache(original):
        def cache_blocks(self, request, *args: Any, **kwargs: Any):
            state = sched_mod.state()
            if state is not None and not state.caches(request.request_id):
                return None
            return original(self, request, *args, **kwargs)

        return cache_blocks

    def make_computed(original):
        def get_computed_blocks(self, request):
            found, hit, *rest = original(self, request)
            state = sched_mod.state()
            if state is None or not state.prefix_caching:
                return (found, hit, *rest)
            groups, hit = state.computed_blocks(request, found.blocks, hit, self.coordinator.single_type_managers[0].block_size)
            return (self.create_kv_cache_blocks(groups), hit, *rest)

        return get_computed_blocks

    def make_free(original):
        def freed(self, request_id, *args: Any, **kwargs: Any):
            ledger = sched_mod.ledger()
            if ledger is not None:
                ledger.reset(request_id)
            return original(self, request_id, *args, **kwargs)

        return freed

    _wrap(Scheduler, "__init__", make_init)
    _wrap(Scheduler, "update_from_output", make_update)
    base = stm.SingleTypeKVCacheManager
    _wrap(base, "get_num_blocks_to_allocate", make_count)
    _wrap(base, "allocate_new_blocks", make_count)
    _wrap(base, "free", make_free)
    _wrap(base, "pop_blocks_for_free", make_free)
    _wrap(base, "cache_blocks", make_cache)
    _wrap(stm.FullAttentionManager, "cache_blocks", make_cache)
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    _wrap(KVCacheManager, "get_computed_blocks", make_computed)


def _install_worker() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from . import worker

    def make_init_kv(original):
        def initialize_kv_cache(self, *args: Any, **kwargs: Any):
            out = original(self, *args, **kwargs)
            state = worker.init_runner(self)
            if state is not None:
                for impl_cls in state.impl_classes:
                    install_backend(impl_cls)
            return out

        return initialize_kv_cache

    def make_update_states(original):
        def _update_states(self, scheduler_output):
            state = worker.runner_eviction(self)
            if state is not None:
                state.on_update_states(scheduler_output)
            return original(self, scheduler_output)

        return _update_states

    def make_prepare(original):
        def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
            out = original(self, scheduler_output, num_scheduled_tokens)
            state = worker.runner_eviction(self)
            if state is not None:
                state.after_prepare_inputs(num_scheduled_tokens)
            return out

        return _prepare_inputs

    def make_execute(original):
        def execute_model(self, *args: Any, **kwargs: Any):
            state = worker.runner_eviction(self)
            if state is not None:
                state.plan = None
            out = original(self, *args, **kwargs)
            if state is not None:
                state.after_execute()
            return out

        return execute_model

    _wrap(GPUModelRunner, "initialize_kv_cache", make_init_kv)
    _wrap(GPUModelRunner, "_update_states", make_update_states)
    _wrap(GPUModelRunner, "_prepare_inputs", make_prepare)
    _wrap(GPUModelRunner, "execute_model", make_execute)


def install_backend(impl_cls: type) -> None:
    """Wrap an attention backend's ``AttentionImpl`` (once per class and process): capture the
    query window before its ``forward``, check the cache layout after its first cache write."""
    from . import worker

    def make_forward(original):
        def forward(self, layer, query, key, value, kv_cache, attn_metadata, *args: Any, **kwargs: Any):
            state = worker.active()
            if state is not None and attn_metadata is not None:
                state.capture_queries(getattr(layer, "layer_name", ""), query)
            return original(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)

        return forward

    def make_kv_update(original):
        def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
            out = original(self, layer, key, value, kv_cache, slot_mapping)
            state = worker.active()
            if state is not None and not state.layout_checked:
                state.check_layout(key, value, kv_cache, slot_mapping)
            return out

        return do_kv_cache_update

    _wrap(impl_cls, "forward", make_forward)
    if hasattr(impl_cls, "do_kv_cache_update"):
        _wrap(impl_cls, "do_kv_cache_update", make_kv_update)
