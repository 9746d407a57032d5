"""``KVPolicyCache``: a transformers ``Cache`` that evicts with a kvpolicy policy while decoding.

The cache is thin: its layers are ``CacheLayerMixin`` adapters over the layer views of an
internal ``EvictingCache``, which does all the work (static buffers, schedule, batched eviction,
attention). ``update`` returns the new keys tagged with the cache; the ``"kvpolicy"`` attention
function (``kvpolicy.hf.attention``), which ``KVPolicyCache(policy, model)`` switches the model
to, finds the cache on them and calls ``KVPolicyCache.attend``. The model stays switched, and
serves any other cache too: a later plain ``model.generate(**inputs)`` (a ``DynamicCache``), a
``StaticCache`` or a forward without cache runs as the attention implementation that the switch
replaced (recorded on the model's configs), with the same logits as a model that was never
switched.

Usage::

    cache = KVPolicyCache("vase-attnv", model)              # model now uses attn "kvpolicy"
    out = model.generate(**inputs, cache=cache, max_new_tokens=4096)   # or past_key_values=cache
    cache.stats(), cache.memory_bytes()   # cache.tier_stats(): a two-tier policy's tiers

Supported: greedy and sampled decoding, left-padded batches, ``num_return_sequences > 1``, beam
search (rows are reordered in the static buffers), a second turn reusing the cache, a chunked
prefill (``prefill_chunk_size``: the prompt is declared, ``KVPolicyCache.expect_prompt``), models
split across devices (``device_map="auto"``). Refused with an error: models with sliding-window,
chunked, linear or shared-KV layers (every layer must be full attention, since an evicting cache
cannot reproduce those masks exactly), rolling back (``crop``: assisted decoding) and offloading.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
import transformers
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin

from ..documents import PolicyWarning
from ..evicting import EvictingCache, LayerView
from ..loading import load_policy
from ..policy import Policy
from ..state import SELECT_GROWTH, EvictionStats
from ..tiers import TierStats
from .attention import ATTN_IMPLEMENTATION, KVPOLICY_KV_OFFSET, record_replaced, register, tag_keys
from .facts import model_facts


class KVPolicyLayer(CacheLayerMixin):
    """One layer's view of the cache, for transformers: ``keys``/``values`` ``[B, Hkv, L, D]`` are
    the held slots (after evictions), ``get_seq_length()`` the tokens seen (padding included)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: KVPolicyCache, layer_idx: int) -> None:
        # CacheLayerMixin.__init__ would assign keys/values, which are views of the state here.
        self._owner = owner
        self.layer_idx = layer_idx

    def __repr__(self) -> str:
        s = self.state
        return f"KVPolicyLayer(layer={self.layer_idx}, slots={s.length}, tokens_seen={s.stats.tokens_seen})"

    @property
    def state(self) -> LayerView:
        return self._owner.evicting.layers[self.layer_idx]

    # CacheLayerMixin declares these three as plain attributes that its own methods assign; here
    # they are read-only views of the shared state (every assigning method is overridden).
    @property
    def is_initialized(self) -> bool:  # type: ignore[override]
        return self.state.is_allocated

    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        return self.state.keys if self.state.is_allocated else None

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        return self.state.values if self.state.is_allocated else None

    @property
    def device(self) -> torch.device | None:
        group = self.state.group
        return None if group is None else group.device

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the ``EvictingCache`` allocates static buffers at the first append."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        """See ``KVPolicyCache.update``."""
        return self._owner.update(key_states, value_states, self.layer_idx)

    def get_seq_length(self) -> int:
        """Tokens seen so far (padded positions appended), never the slots held."""
        return self.state.tokens_seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(tokens seen + query_length, 0)``: the 2-D padding mask covers every token seen. The 0
        is ``KVPOLICY_KV_OFFSET``, which tells the ``"kvpolicy"`` mask function that it serves a
        ``KVPolicyCache`` (for any other cache it builds the replaced implementation's mask)."""
        return self.get_seq_length() + query_length, KVPOLICY_KV_OFFSET

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise RuntimeError("reset the whole KVPolicyCache (cache.reset), not one layer: layers share buffers")

    def offload(self) -> None:
        raise NotImplementedError("KVPolicyCache does not support offloading")

    def prefetch(self) -> None:
        raise NotImplementedError("KVPolicyCache does not support offloading")

    def crop(self, tokens_to_remove: int) -> None:
        self._owner.crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise RuntimeError("reorder the whole KVPolicyCache (cache.reorder_cache), not one layer: layers share buffers")

    batch_repeat_interleave = batch_select_indices = reorder_cache


class KVPolicyCache(Cache):
    """A transformers ``Cache`` that evicts KV slots with ``policy`` during decoding.

    Args:
        policy: a ``Policy``, a registered policy name, a YAML path or a mapping (see
            ``load_policy``; use ``load_policy(name, budget=...)`` for overrides).
        model_or_config: the model (preferred) or its config. Given a model, the cache switches
            it to the ``"kvpolicy"`` attention implementation (``model.set_attn_implementation``),
            records on its configs the implementation it replaced, and records each layer's
            device. The model stays switched and needs no switching back: steps with any other
            cache, or none, run as the replaced implementation (bit for bit). Given a config,
            load the model with ``attn_implementation="kvpolicy"`` after
            ``kvpolicy.hf.register()`` (other caches then run as ``"sdpa"``); a model not using
            it makes the cache raise. A policy whose stages read the model (``needs_model``:
            RoPE, output projections) needs the model: its facts (``kvpolicy.hf.facts``) are
            built from it, and a config alone is refused.
        seed: overrides the policy's ``seed`` (kept by ``reset()``: a reset cache decodes exactly
            as a fresh one).
        independent_rows: row ``r`` draws from random stream ``r`` (for several samples of one
            prompt, ``num_return_sequences``); by default a row's draws depend on that row alone,
            so a padded row decodes exactly as it would alone.
        select_growth: select mode only: how the buffers grow when a chunk does not fit (to this
            many times the slots needed; see ``EvictingCache``).

    ``get_seq_length()`` reports tokens seen (RoPE positions keep growing with it);
    ``stats()`` and ``memory_bytes()`` report eviction counters and static memory.
    """

    def __init__(
        self,
        policy: Policy | str | Any,
        model_or_config: Any,
        *,
        seed: int | None = None,
        independent_rows: bool = False,
        select_growth: float = SELECT_GROWTH,
    ) -> None:
        register()
        model = None if isinstance(model_or_config, PreTrainedConfig) else model_or_config
        config = model_or_config if model is None else getattr(model, "config", None)
        if not isinstance(config, PreTrainedConfig):
            raise TypeError(
                f"KVPolicyCache needs a transformers model or its config, got {type(model_or_config).__name__}"
            )
        text_config = config.get_text_config(decoder=True)
        num_layers = _check_layers(text_config)
        layer_devices = _layer_devices(model, num_layers) if model is not None else None
        self.policy = policy if isinstance(policy, Policy) else load_policy(policy)
        # Stages that read the model (RoPE, output projections) get its facts; a config has none,
        # and EvictingCache refuses such a policy then, before any work.
        facts = model_facts(model) if model is not None and self.policy.needs_model else None
        self.evicting = EvictingCache(
            self.policy, num_layers, layer_devices=layer_devices, seed=seed, independent_rows=independent_rows,
            num_kv_heads=getattr(text_config, "num_key_value_heads", None) or getattr(text_config, "num_attention_heads", None),
            select_growth=select_growth, model_facts=facts,
        )
        # The layer whose update returned keys that kvpolicy attention has not taken yet.
        self._staged_layer: int | None = None
        super().__init__(layers=[KVPolicyLayer(self, i) for i in range(num_layers)])
        if model is not None:
            _use_kvpolicy_attention(model)
            _declare_chunked_prompts(model)

    def __repr__(self) -> str:
        return f"KVPolicyCache({self.policy!r}, layers={len(self.layers)}, tokens_seen={self.get_seq_length()})"

    # -- the step: update, then the kvpolicy attention function calls attend --------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        """Called by the model's attention module with ``[B, Hkv, T, D]`` new keys/values: returns
        them unchanged, the keys tagged with this cache for the kvpolicy attention function, which
        appends them (with the padding validity) and attends."""
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < len(self.layers):
            raise IndexError(
                f"the model updated layer {layer_idx!r}, but this KVPolicyCache was built for {len(self.layers)} "
                "layers: build the cache with the model it serves"
            )
        if self._staged_layer is not None:
            raise RuntimeError(NOT_USING_KVPOLICY_ATTENTION.format(prev=self._staged_layer))
        self._staged_layer = layer_idx
        return tag_keys(key_states, self), value_states

    def unstage(self) -> None:
        """The kvpolicy attention function received the keys this cache's ``update`` returned."""
        self._staged_layer = None

    def attend(
        self,
        layer_idx: int,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        token_valid: torch.Tensor | None,
        *,
        scaling: float | None = None,
    ) -> torch.Tensor:
        """Evict what is due, append the step, record its queries, attend: ``[B, Hq, T, D]``."""
        self._staged_layer = None
        return self.evicting.attend(layer_idx, query, keys, values, token_valid, scaling=scaling)

    def expect_prompt(self, tokens: int) -> None:
        """The next ``tokens`` token positions, fed in any number of forwards, are the prompt
        (``EvictingCache.expect_prompt``). ``generate(prefill_chunk_size=...)`` declares it for
        you on a model this cache was built with."""
        self.evicting.expect_prompt(tokens)

    # -- reporting ---------------------------------------------------------------------------
    def memory_bytes(self) -> int:
        """Bytes held by the static buffers and query windows of every layer."""
        return self.evicting.memory_bytes()

    def held_bytes(self) -> int:
        """Bytes of the slots held now, per head (``EvictingCache.held_bytes``): at most
        ``memory_bytes``, less under a threshold whose heads keep fewer than the budget."""
        return self.evicting.held_bytes()

    def tier_stats(self) -> TierStats | None:
        """A two-tier policy's tiers (``EvictingCache.tier_stats``): bytes held in the fast and
        slow tiers, bytes moved each way and recall hits since the start; None for a policy
        without a ``recall`` block."""
        return self.evicting.tier_stats()

    def stats(self) -> list[EvictionStats]:
        """Per layer: evictions, tokens seen, slots held, slots evicted, slots held per head."""
        return self.evicting.stats()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if self._staged_layer is not None:
            raise RuntimeError(NOT_USING_KVPOLICY_ATTENTION.format(prev=self._staged_layer))
        return super().get_seq_length(layer_idx)

    @property
    def batch_size(self) -> int:
        for view in self.evicting.layers:
            if view.group is not None:
                return view.group.batch
        return -1

    # -- batch-row operations (num_return_sequences, beam search) -----------------------------
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.evicting.select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        b = self.batch_size
        if b > 0:
            self.evicting.select_rows(torch.arange(b).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        indices = torch.as_tensor(indices).reshape(-1)
        if indices.dtype == torch.bool:  # a mask, as DynamicCache indexes its tensors with one
            if indices.numel() != self.batch_size:
                raise IndexError(f"a row mask of {indices.numel()} entries for a batch of {self.batch_size} rows")
            indices = indices.nonzero().flatten()
        self.evicting.select_rows(indices)

    # -- unsupported --------------------------------------------------------------------------
    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0:
            return
        raise NotImplementedError(
            "KVPolicyCache cannot be cropped: evicted tokens cannot be restored (assisted/speculative decoding "
            "is not supported)"
        )

    def reset(self) -> None:
        """Forget every token: the cache is then exactly a fresh one (same seed)."""
        self._staged_layer = None
        self.evicting.reset()


NOT_USING_KVPOLICY_ATTENTION = (
    "KVPolicyCache.update ran for layer {prev} but the model never called the 'kvpolicy' attention "
    "function for it: the model does not use kvpolicy attention, so its attention would ignore the "
    "cache's slots and padding (or the previous forward stopped between the cache update and attention: "
    "call cache.reset()). Build the cache with the model (KVPolicyCache(policy, model) switches it), or "
    "call kvpolicy.hf.register() and load/set the model with attn_implementation='kvpolicy'."
)


def _check_layers(config: PreTrainedConfig) -> int:
    """Every decoder layer must be causal full attention; return their number."""
    if not getattr(config, "is_causal", True):
        raise ValueError("KVPolicyCache serves causal decoders only (config.is_causal is False)")
    num_layers = getattr(config, "num_hidden_layers", None)
    if not num_layers:
        raise ValueError(f"{type(config).__name__} has no num_hidden_layers")
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        if getattr(config, "sliding_window", None) is not None:
            layer_types = ["sliding_attention"] * num_layers
        elif getattr(config, "attention_chunk_size", None) is not None:
            layer_types = ["chunked_attention"] * num_layers
        else:
            layer_types = ["full_attention"] * num_layers
    if getattr(config, "kv_sharing_modes", None) is not None:
        raise ValueError("KVPolicyCache does not support models that share KV caches between layers")
    if getattr(config, "kv_lora_rank", None) is not None:  # DeepSeek-V2/V3 and their kin
        raise ValueError(
            "KVPolicyCache does not support multi-head latent attention (config.kv_lora_rank): its layers cache "
            "a compressed latent and a RoPE part, not one key and one value per KV head"
        )
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        raise ValueError(
            f"KVPolicyCache supports full-attention layers only; this model also has {other} layers "
            "(sliding-window, chunked or linear attention cannot be served exactly over an evicting cache)"
        )
    return num_layers


def _layer_devices(model: torch.nn.Module, num_layers: int) -> list[torch.device | None]:
    """The device of each attention layer's weights (models split with ``device_map``)."""
    devices: list[torch.device | None] = [None] * num_layers
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and 0 <= idx < num_layers and devices[idx] is None:
            param = next(module.parameters(recurse=True), None)
            if param is not None and param.device.type != "meta":
                devices[idx] = param.device
    return devices


def _use_kvpolicy_attention(model: Any) -> None:
    """Switch ``model`` to ``"kvpolicy"``, recording on every config it switches the implementation
    that config had (what steps of other caches then run)."""
    if model.config._attn_implementation == ATTN_IMPLEMENTATION:
        return
    if not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"{type(model).__name__} cannot switch its attention implementation")
    before = [(config, config._attn_implementation) for config in _configs(model)]
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    for config, implementation in before:
        if implementation not in (None, ATTN_IMPLEMENTATION) and config._attn_implementation == ATTN_IMPLEMENTATION:
            record_replaced(config, implementation)
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise RuntimeError(
            f"{type(model).__name__} did not switch to kvpolicy attention (it does not dispatch attention through "
            "transformers' AttentionInterface), so it cannot be served exactly by KVPolicyCache"
        )


def _declare_chunked_prompts(model: Any) -> None:
    """Make ``generate(prefill_chunk_size=...)`` on ``model`` declare its prompt to a fresh
    ``KVPolicyCache`` (``expect_prompt``) before the first chunk: the cache would otherwise take
    the first chunk for the whole prompt and evict inside the rest. A chunked prefill onto a
    cache that holds tokens (a second turn) is refused: its chunks would evict between them,
    where the turn fed at once evicts at its end. Wraps this model's ``_prefill`` (transformers
    5.x's prefill step, which chunks the prompt), once; other caches pass through untouched."""
    prefill = getattr(model, "_prefill", None)
    if prefill is None:  # another transformers: said, since the cache would evict inside a chunked prompt
        warnings.warn(
            f"{type(model).__name__} has no _prefill (transformers {transformers.__version__}): "
            "generate(prefill_chunk_size=...) cannot declare its prompt to a KVPolicyCache, which would then "
            "evict inside the prompt; leave prefill_chunk_size unset", PolicyWarning, stacklevel=3,
        )
        return
    if getattr(prefill, "__kvpolicy_wrapped__", False):
        return

    @functools.wraps(prefill)
    def prefill_declaring_the_prompt(input_ids: Any, generation_config: Any, model_kwargs: dict, *args: Any,
                                     **kwargs: Any) -> Any:
        # By type, not by the argument's name (cache, past_key_values: transformers renamed it once)
        cache = next((v for v in model_kwargs.values() if isinstance(v, KVPolicyCache)), None)
        if isinstance(cache, KVPolicyCache) and getattr(generation_config, "prefill_chunk_size", None) is not None:
            if cache.get_seq_length() > 0:
                raise NotImplementedError(
                    "generate(prefill_chunk_size=...) on a KVPolicyCache that holds tokens already (a second turn): "
                    "its chunks would evict between them, where the turn fed in one forward evicts at its end; "
                    "leave prefill_chunk_size unset for this call"
                )
            if input_ids.shape[-1] == 0:  # prompts given as inputs_embeds: their length is not the ids'
                raise NotImplementedError("generate(prefill_chunk_size=...) from inputs_embeds on a KVPolicyCache")
            cache.expect_prompt(int(input_ids.shape[-1]))
        return prefill(input_ids, generation_config, model_kwargs, *args, **kwargs)

    prefill_declaring_the_prompt.__kvpolicy_wrapped__ = True  # type: ignore[attr-defined]
    model._prefill = prefill_declaring_the_prompt


def _configs(model: torch.nn.Module) -> list[PreTrainedConfig]:
    """Every config of ``model``: its submodels' and modules' configs, and their sub-configs."""
    found: dict[int, PreTrainedConfig] = {}
    todo = [getattr(model, "config", None)] + [getattr(m, "config", None) for m in model.modules()]
    while todo:
        config = todo.pop()
        if isinstance(config, PreTrainedConfig) and id(config) not in found:
            found[id(config)] = config
            todo.extend(getattr(config, key, None) for key in getattr(config, "sub_configs", {}) or {})
    return list(found.values())

