"""The ``"kvpolicy"`` attention and mask functions for transformers models.

Why a custom attention: after an eviction the cache's slots no longer line up with positions, and
different layers (and heads) hold different tokens, so the 4-D mask that transformers builds from
the 2-D padding mask (indexed by slot) would be wrong. Instead:

- the **mask function** (``AttentionMaskInterface["kvpolicy"]``) turns the 2-D padding mask into
  the padding validity of the *new* tokens only, ``[B, T]`` bool (``None`` when every new token is
  real). That is what the model hands each layer as ``attention_mask``;
- ``KVPolicyCache.update`` appends nothing: it returns the new keys tagged with the cache
  (``staged_cache(key)`` reads the tag), which is how the cache reaches the attention function
  explicitly, through the very tensor the model passes on;
- the **attention function** (``AttentionInterface["kvpolicy"]``) calls ``KVPolicyCache.attend``,
  which runs ``EvictingCache.attend``: evict what is due, append the keys/values with their padding
  validity, record the post-RoPE queries, attend over the layer's slots.

Both functions are registered by ``register()`` (called when a ``KVPolicyCache`` is built), never
at import.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ..attend import attend

ATTN_IMPLEMENTATION = "kvpolicy"
_CACHE_TAG = "_kvpolicy_cache"


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


# -- the mask function ------------------------------------------------------------------------
def kvpolicy_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """``AttentionMaskInterface`` entry: the padding validity ``[B, T]`` of the new tokens.

    ``attention_mask`` is the 2-D padding mask over every token seen so far plus the new ones
    (``[B, q_offset + T]``, ``q_offset`` = tokens seen = ``cache.get_seq_length()``). Returns
    ``None`` when every new token is real (the common decoding case), else a bool ``[B, T]``.
    Only plain causal masks can be expressed: sliding-window, chunked, bidirectional, packed or
    overlaid mask functions raise.
    """
    from transformers.masking_utils import causal_mask_function

    if mask_function is not None and mask_function is not causal_mask_function:
        name = getattr(mask_function, "__qualname__", repr(mask_function))
        raise NotImplementedError(
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


# -- the attention function -------------------------------------------------------------------
def kvpolicy_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``AttentionInterface`` entry.

    Args:
        module: the attention module (``module.layer_idx`` names the cache layer).
        query: ``[B, Hq, T, D]`` post-RoPE queries of the ``T`` new tokens.
        key, value: ``[B, Hkv, T, D]`` the new keys/values, as returned by ``KVPolicyCache.update``.
        attention_mask: ``[B, T]`` bool padding validity of the new tokens, or ``None`` (all real),
            as produced by ``kvpolicy_mask``.

    Returns:
        ``(attn_output [B, T, Hq, D], None)``; attention weights are never materialised.
    """
    cache = staged_cache(key)
    layer_idx = getattr(module, "layer_idx", None)
    if cache is not None:
        # The model did reach kvpolicy attention, whatever is refused below.
        cache.unstage()
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
    if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.dtype != torch.bool):
        raise ValueError(
            "kvpolicy attention expects the [B, T] bool validity made by its mask function, got "
            f"{tuple(attention_mask.shape)} {attention_mask.dtype}: was a 4-D mask passed to the model?"
        )
    if cache is None:
        # No KVPolicyCache in this forward: a plain causal pass with no cache is still exact.
        t = query.shape[2]
        if key.shape[2] != t:
            raise RuntimeError(
                "this model is set to kvpolicy attention, which only serves a KVPolicyCache (or no cache): "
                f"got {key.shape[2]} keys for {t} queries from another cache. Use a KVPolicyCache, or switch "
                "the model back with model.set_attn_implementation('sdpa')"
            )
        mask = None
        if attention_mask is not None:
            causal = torch.ones(t, t, dtype=torch.bool, device=query.device).tril()
            mask = attention_mask[:, None, None, :] & causal
            mask |= ~mask.any(-1, keepdim=True) & (torch.arange(t, device=query.device) == 0)
        out = attend(query, key, value, scaling=scaling, mask=mask)
        return out.transpose(1, 2).contiguous(), None
    if not isinstance(layer_idx, int):
        raise RuntimeError(f"{type(module).__name__} has no layer_idx: kvpolicy attention cannot find its cache layer")
    out = cache.attend(layer_idx, query, key, value, attention_mask, scaling=scaling)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``"kvpolicy"`` with transformers' ``AttentionInterface`` and ``AttentionMaskInterface``.

    Idempotent. Call it before ``from_pretrained(..., attn_implementation="kvpolicy")``; building
    a ``KVPolicyCache`` calls it too.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, kvpolicy_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, kvpolicy_mask)
