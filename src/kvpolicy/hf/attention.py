"""The ``"kvpolicy"`` attention and mask functions for transformers models.

Why a custom attention: after an eviction the cache's slots no longer line up with positions, and
different layers (and heads) hold different tokens, so the 4-D mask that transformers builds from
the 2-D padding mask (indexed by slot) would be wrong. Instead, for a step of a ``KVPolicyCache``:

- the **mask function** (``AttentionMaskInterface["kvpolicy"]``) turns the 2-D padding mask into
  the padding validity of the *new* tokens only, ``[B, T]`` bool (``None`` when every new token is
  real). That is what the model hands each layer as ``attention_mask``;
- ``KVPolicyCache.update`` appends nothing: it returns the new keys tagged with the cache
  (``staged_cache(key)`` reads the tag), which is how the cache reaches the attention function
  explicitly, through the very tensor the model passes on;
- the **attention function** (``AttentionInterface["kvpolicy"]``) calls ``KVPolicyCache.attend``,
  which runs ``EvictingCache.attend``: evict what is due, append the keys/values with their padding
  validity, record the post-RoPE queries, attend over the layer's slots.

**Any other step runs as the replaced implementation.** A model stays on ``"kvpolicy"`` after a
``KVPolicyCache`` run, so a later step with another cache (``DynamicCache``, ``StaticCache``, ...)
or with no cache is served by the implementation that ``KVPolicyCache(policy, model)`` replaced
(``sdpa``, ``eager``, flash attention, ...), recorded on the model's configs
(``replaced_implementation``); a model put on ``"kvpolicy"`` some other way (loaded with
``attn_implementation="kvpolicy"``, or ``set_attn_implementation``) has none recorded and uses
``"sdpa"``. Both functions tell the two cases apart without extra work on the kvpolicy path:

- the mask function sees ``kv_offset`` come from ``KVPolicyLayer.get_mask_sizes`` as
  ``KVPOLICY_KV_OFFSET`` (an ``int`` equal to 0, of a type no other cache returns); for any other
  ``kv_offset`` it returns what the replaced implementation's mask function returns for the same
  arguments (its 4-D mask, 2-D mask or ``None``);
- the attention function finds no cache tag on the keys, and calls the replaced implementation's
  attention function with everything it was given: the function that the module's own forward
  would have looked up (its module's ``ALL_ATTENTION_FUNCTIONS``, or its
  ``eager_attention_forward`` for ``"eager"``).

Such a step equals, logits bit for bit, the same step of a model that never left the replaced
implementation (tested for ``sdpa`` and ``eager``). Code outside these two functions that reads
``config._attn_implementation`` sees ``"kvpolicy"``: flash attention's kernel choice is handed
the replaced name, and a flash-replaced model refuses a static-size cache without a padding mask
(``generate()`` drops an all-ones mask unless the config names flash attention).

Both functions are registered by ``register()`` (called when a ``KVPolicyCache`` is built), never
at import.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any, Protocol

import torch

ATTN_IMPLEMENTATION = "kvpolicy"
# What a model on "kvpolicy" with no recorded implementation runs for steps of other caches.
DEFAULT_REPLACED_IMPLEMENTATION = "sdpa"
_CACHE_TAG = "_kvpolicy_cache"
_REPLACED_ATTR = "_kvpolicy_replaced_attn_implementation"


class StagedCache(Protocol):
    """What the attention function calls on the cache that staged the keys: ``KVPolicyCache``
    (``kvpolicy.hf.cache``, which imports this module, so it is not named here)."""

    def unstage(self) -> None: ...

    def attend(self, layer_idx: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               token_valid: torch.Tensor | None, *, scaling: float | None = None) -> torch.Tensor: ...


def tag_keys(keys: torch.Tensor, cache: StagedCache) -> torch.Tensor:
    """A view of ``keys`` that carries ``cache`` to the attention function (``staged_cache``)."""
    tagged = keys.view(keys.shape)
    setattr(tagged, _CACHE_TAG, cache)
    return tagged


def staged_cache(keys: torch.Tensor) -> StagedCache | None:
    """The ``KVPolicyCache`` whose ``update`` returned ``keys``, or None (no kvpolicy cache)."""
    return getattr(keys, _CACHE_TAG, None)


# -- the implementation "kvpolicy" replaced ----------------------------------------------------
def record_replaced(config: Any, implementation: str) -> None:
    """Record on ``config`` the attention implementation that ``"kvpolicy"`` replaces on it."""
    setattr(config, _REPLACED_ATTR, implementation)


def replaced_implementation(config: Any) -> str:
    """The attention implementation that steps of other caches run on a ``"kvpolicy"`` model.

    ``KVPolicyCache(policy, model)`` records it on each config it switches; otherwise
    ``DEFAULT_REPLACED_IMPLEMENTATION`` (``"sdpa"``). The record is a config attribute, so it
    follows ``copy.deepcopy`` and is written by ``save_pretrained``; it is read only while the
    config names ``"kvpolicy"``.
    """
    implementation = getattr(config, _REPLACED_ATTR, None)
    if not isinstance(implementation, str) or implementation == ATTN_IMPLEMENTATION:
        return DEFAULT_REPLACED_IMPLEMENTATION
    return implementation


def _is_flash(implementation: str) -> bool:
    # Flash attention (the packages or a hub kernel) reads its kernel's name from the config.
    return "flash" in implementation


# -- the mask function ------------------------------------------------------------------------
class _KVPolicyOffset(int):
    """The ``kv_offset`` (0) of a ``KVPolicyCache``: tells the mask function which cache it serves."""

    __slots__ = ()


KVPOLICY_KV_OFFSET: int = _KVPolicyOffset(0)


class _UnservableMask:
    """A mask kvpolicy attention cannot serve exactly (a sliding window, a chunk, an overlay), in
    place of the mask: refused by the layer that attends with it, so a model that builds such a
    mask for layer types it does not have (Qwen2-MoE builds a sliding one) is still served."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


def kvpolicy_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> Any:
    """``AttentionMaskInterface`` entry.

    For a ``KVPolicyCache`` (``kv_offset`` is ``KVPOLICY_KV_OFFSET``): the padding validity
    ``[B, T]`` of the new tokens. ``attention_mask`` is the 2-D padding mask over every token seen
    so far plus the new ones (``[B, q_offset + T]``, ``q_offset`` = tokens seen =
    ``cache.get_seq_length()``). Returns ``None`` when every new token is real (the common
    decoding case), else a bool ``[B, T]``. Only plain causal masks can be expressed:
    sliding-window, chunked, bidirectional, packed or overlaid mask functions raise.

    For any other cache, or none: what the replaced implementation's mask function returns for
    the same arguments (``replaced_implementation(config)``).
    """
    if not isinstance(kv_offset, _KVPolicyOffset):
        return _replaced_mask(
            batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
            kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask, **kwargs,
        )
    from transformers.masking_utils import causal_mask_function

    if mask_function is not None and mask_function is not causal_mask_function:
        name = getattr(mask_function, "__qualname__", repr(mask_function))
        return _UnservableMask(
            f"kvpolicy attention supports plain causal attention only; the model asked for mask "
            f"function {name} (sliding window, chunked, bidirectional, packed sequences or a mask "
            "overlay), which cannot be served exactly over an evicting cache"
        )
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise ValueError(f"kvpolicy attention needs a 2-D padding mask, got shape {tuple(attention_mask.shape)}")
    end = int(q_offset) + q_length
    if attention_mask.shape[-1] < end:
        raise ValueError(
            f"the 2-D attention_mask has {attention_mask.shape[-1]} columns but must cover every token seen "
            f"({int(q_offset)}) plus the {q_length} new ones"
        )
    valid = attention_mask[:, end - q_length : end].to(torch.bool)
    if bool(valid.all()):
        return None
    return valid


def _replaced_mask(**kwargs: Any) -> Any:
    """The mask the replaced implementation builds from these ``AttentionMaskInterface`` arguments."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    implementation = replaced_implementation(kwargs.get("config"))
    mask_interface = ALL_MASK_ATTENTION_FUNCTIONS.get(implementation)
    if mask_interface is None:
        # As create_causal_mask does for an implementation without a mask function.
        return None
    if _is_flash(implementation) and kwargs["attention_mask"] is None:
        if kwargs["kv_length"] > kwargs["q_offset"] + kwargs["q_length"]:  # a static-size cache
            raise NotImplementedError(
                f"this model replaced {implementation!r} by kvpolicy attention; a static-size cache with flash "
                "attention needs the padding mask, which generate() drops when the config does not name flash "
                f"attention: switch the model back first, model.set_attn_implementation({implementation!r})"
            )
    return mask_interface(**kwargs)


# -- the attention function -------------------------------------------------------------------
def kvpolicy_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """``AttentionInterface`` entry.

    Args:
        module: the attention module (``module.layer_idx`` names the cache layer).
        query: ``[B, Hq, T, D]`` post-RoPE queries of the ``T`` new tokens.
        key, value: ``[B, Hkv, T, D]`` the new keys/values, as returned by ``KVPolicyCache.update``.
        attention_mask: ``[B, T]`` bool padding validity of the new tokens, or ``None`` (all real),
            as produced by ``kvpolicy_mask``.

    Returns:
        ``(attn_output [B, T, Hq, D], None)``; attention weights are never materialised.

    Keys that no ``KVPolicyCache`` returned (another cache, or none) go, with every argument, to
    the replaced implementation's attention function, whose result is returned.
    """
    cache = staged_cache(key)
    if cache is None:
        function, target = _replaced_attention(module)
        return function(
            target, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            sliding_window=sliding_window, **kwargs,
        )
    # The model did reach kvpolicy attention, whatever is refused below.
    cache.unstage()
    layer_idx = getattr(module, "layer_idx", None)
    if dropout and module.training:
        raise NotImplementedError("kvpolicy attention is for inference: attention dropout is not supported")
    if sliding_window is not None:
        raise NotImplementedError("kvpolicy attention does not support sliding-window layers")
    if not getattr(module, "is_causal", True):
        raise NotImplementedError(
            f"kvpolicy attention is causal only; {type(module).__name__} is bidirectional (an encoder?): "
            "switch only the decoder to 'kvpolicy'"
        )
    for unsupported in ("softcap", "s_aux", "sinks"):
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(f"kvpolicy attention does not support {unsupported!r}")
    if kwargs.get("output_attentions"):  # said, as transformers says it for sdpa: not an empty tuple unexplained
        warnings.warn("kvpolicy attention returns no attention weights: output_attentions=True gives none",
                      UserWarning, stacklevel=2)
    if isinstance(attention_mask, _UnservableMask):
        raise NotImplementedError(attention_mask.why)
    if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.dtype != torch.bool):
        raise ValueError(
            "kvpolicy attention expects the [B, T] bool validity made by its mask function, got "
            f"{tuple(attention_mask.shape)} {attention_mask.dtype}: was a 4-D mask passed to the model?"
        )
    if not isinstance(layer_idx, int):
        raise RuntimeError(f"{type(module).__name__} has no layer_idx: kvpolicy attention cannot find its cache layer")
    out = cache.attend(layer_idx, query, key, value, attention_mask, scaling=scaling)
    return out.transpose(1, 2).contiguous(), None


# Per attention-module class: the AttentionInterface its forward reads, and its eager function.
_FORWARD_LOOKUPS: dict[type, tuple[Any, Callable[..., Any] | None]] = {}


def _forward_lookups(cls: type) -> tuple[Any, Callable[..., Any] | None]:
    """What ``cls.forward`` resolves ``ALL_ATTENTION_FUNCTIONS`` and ``eager_attention_forward`` to."""
    found = _FORWARD_LOOKUPS.get(cls)
    if found is None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        forward = getattr(cls, "forward", None)
        names = getattr(inspect.unwrap(forward), "__globals__", {}) if forward is not None else {}
        interface = names.get("ALL_ATTENTION_FUNCTIONS", ALL_ATTENTION_FUNCTIONS)
        eager = names.get("eager_attention_forward")
        found = _FORWARD_LOOKUPS[cls] = (interface, eager if callable(eager) else None)
    return found


def _replaced_attention(module: torch.nn.Module) -> tuple[Callable[..., Any], Any]:
    """``(function, module to pass it)``: the replaced implementation's attention for ``module``,
    looked up as the module's own forward would (``ALL_ATTENTION_FUNCTIONS.get_interface(name,
    eager_attention_forward)``)."""
    config = getattr(module, "config", None)
    implementation = replaced_implementation(config)
    interface, eager = _forward_lookups(type(module))
    get_interface = getattr(interface, "get_interface", None)
    function = get_interface(implementation, eager) if get_interface is not None else interface.get(implementation, eager)
    if function is None:
        raise RuntimeError(
            f"kvpolicy attention cannot find the {implementation!r} attention of {type(module).__name__} (no "
            f"eager_attention_forward where its forward is defined): switch the model back with "
            f"model.set_attn_implementation({implementation!r}) for a step with another cache"
        )
    if _is_flash(implementation) and config is not None:
        return function, _ModuleAs(module, _ConfigAs(config, implementation))
    return function, module


class _ConfigAs:
    """A config that reads as the original except ``_attn_implementation`` (flash attention picks
    its kernel by that name)."""

    def __init__(self, config: Any, implementation: str) -> None:
        self._config = config
        self._attn_implementation = implementation

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


class _ModuleAs:
    """An attention module seen through ``_ConfigAs``: every other attribute is the module's."""

    def __init__(self, module: torch.nn.Module, config: _ConfigAs) -> None:
        self._module = module
        self.config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def register() -> None:
    """Register ``"kvpolicy"`` with transformers' ``AttentionInterface`` and ``AttentionMaskInterface``.

    Idempotent. Call it before ``from_pretrained(..., attn_implementation="kvpolicy")``; building
    a ``KVPolicyCache`` calls it too.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, kvpolicy_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, kvpolicy_mask)
