"""The ``"kvpolicy"`` attention and mask functions for transformers models.

Why a custom attention: after an eviction the cache's slots no longer line up with positions, and
different layers (and heads) hold different tokens, so the 4-D mask that transformers builds from
the 2-D padding mask (indexed by slot) would be wrong. Instead:

- the **mask function** (``AttentionMaskInterface["kvpolicy"]``) turns the 2-D padding mask into
  the padding validity of the *new* tokens only, ``[B, T]`` bool (``None`` when every new token is
  real). That is what the model hands each layer as ``attention_mask``;
- ``KVPolicyCache.update`` only stages the layer's new keys/values and returns them unchanged;
- the **attention function** (``AttentionInterface["kvpolicy"]``) takes the staged step, runs
  ``EvictingCache.step`` (evicts what is due, appends the keys/values with their padding validity,
  records the post-RoPE queries in the layer's window) and attends over the layer's slots with the
  per-slot validity mask ``[B, Hkv, L]`` (plus causality inside a multi-token chunk).

The attention function finds the cache through a thread-local "staged step" that ``update`` sets
and the attention function consumes for the same ``layer_idx``; if the model does not run this
attention function, the next ``update`` finds the previous step unconsumed and raises.

Both functions are registered by ``register()`` (called when a ``KVPolicyCache`` is built), never
at import.
"""

from __future__ import annotations

import importlib.util
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from .cache import KVPolicyCache

ATTN_IMPLEMENTATION = "kvpolicy"

_HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None
_local = threading.local()


@dataclass
class _Staged:
    """A layer's step between ``KVPolicyCache.update`` and the attention function."""

    cache: KVPolicyCache
    layer_idx: int
    keys: torch.Tensor
    values: torch.Tensor


NOT_USING_KVPOLICY_ATTENTION = (
    "KVPolicyCache.update ran for layer {prev} but the model never called the 'kvpolicy' attention "
    "function for it: the model does not use kvpolicy attention, so its attention would ignore the "
    "cache's slots and padding. Build the cache with the model (KVPolicyCache(policy, model) switches "
    "it), or call kvpolicy.hf.register() and load/set the model with attn_implementation='kvpolicy'."
)


def stage(cache: KVPolicyCache, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Called by ``KVPolicyCache.update``: hand this layer's new keys/values to the attention."""
    prev = getattr(_local, "staged", None)
    if prev is not None:
        _local.staged = None
        raise RuntimeError(NOT_USING_KVPOLICY_ATTENTION.format(prev=prev.layer_idx))
    _local.staged = _Staged(cache, layer_idx, keys, values)


def discard_staged(cache: KVPolicyCache) -> None:
    """Drop a staged step of ``cache`` (after an interrupted forward, or on reset)."""
    prev = getattr(_local, "staged", None)
    if prev is not None and prev.cache is cache:
        _local.staged = None


def has_staged(cache: KVPolicyCache) -> bool:
    prev = getattr(_local, "staged", None)
    return prev is not None and prev.cache is cache


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
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    staged = getattr(_local, "staged", None)
    _local.staged = None
    t = query.shape[2]
    if staged is None:
        # No KVPolicyCache in this forward: a plain causal pass with no cache is still exact.
        if key.shape[2] != t:
            raise RuntimeError(
                "this model is set to kvpolicy attention, which only serves a KVPolicyCache (or no cache): "
                f"got {key.shape[2]} keys for {t} queries from another cache. Use a KVPolicyCache, or switch "
                "the model back with model.set_attn_implementation('sdpa')"
            )
        valid = None if attention_mask is None else attention_mask[:, None, :]
        out = attend(query, key, value, valid, scaling)
        return out.transpose(1, 2).contiguous(), None
    layer_idx = getattr(module, "layer_idx", staged.layer_idx)
    if layer_idx != staged.layer_idx or key is not staged.keys:
        raise RuntimeError(
            f"kvpolicy attention for layer {layer_idx} received keys that KVPolicyCache.update did not stage "
            f"(staged layer {staged.layer_idx}): the model changes keys between the cache update and attention"
        )
    out = staged.cache._attend(layer_idx, query, key, value, attention_mask, scaling)
    return out.transpose(1, 2).contiguous(), None


def attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor | None,
    scaling: float,
    slot_positions: torch.Tensor | None = None,
    query_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``T`` new queries over ``L`` slots.

    Args:
        query: ``[B, Hq, T, D]``.
        keys, values: ``[B, Hkv, L, D]`` (``Hq % Hkv == 0``; query head ``h*G + g`` reads KV head ``h``).
        valid: ``[B, H, L]`` bool slot validity with ``H`` in ``{1, Hkv}`` (1: shared by every head),
            or ``None`` when every slot is a real token.
        scaling: the softmax scale.
        slot_positions, query_positions: ``[B, H, L]`` and ``[B, T]`` token positions (``-1`` for a
            padding query). When given (a multi-token chunk over packed rows of different
            lengths), causality is ``slot position <= query position``; otherwise the new tokens
            are the last ``T`` slots of every row.

    Returns:
        ``[B, Hq, T, D]``. A padding query's output is finite and never read.
    """
    b, hq, t, d = query.shape
    hkv, length = keys.shape[1], keys.shape[2]
    g = hq // hkv
    if valid is None:
        if _HAS_FLASH_ATTN and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16):
            from flash_attn import flash_attn_func

            # flash-attn's causal mask is bottom-right aligned (>= 2.1): exactly "new tokens last".
            out = flash_attn_func(
                query.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                softmax_scale=scaling, causal=t > 1,
            )
            return out.transpose(1, 2)
        if t == 1:
            if g == 1:
                return F.scaled_dot_product_attention(query, keys, values, scale=scaling)
            q = query.reshape(b, hkv, g, d)  # the group's queries act as G query rows of KV head h
            return F.scaled_dot_product_attention(q, keys, values, scale=scaling).reshape(b, hq, 1, d)
        if t == length:
            return F.scaled_dot_product_attention(
                query, keys, values, is_causal=True, scale=scaling, enable_gqa=g > 1
            )
    q_idx = torch.arange(t, device=keys.device)
    k_idx = torch.arange(length, device=keys.device)
    if query_positions is not None:
        mask = slot_positions[:, :, None, :] <= query_positions[:, None, :, None]  # [B, H, T, L]
        if valid is not None:
            mask &= valid[:, :, None, :]
        # A padding query (position -1) sees nothing; give it slot 0 so its output stays finite.
        mask |= (query_positions < 0)[:, None, :, None] & (k_idx == 0)
    else:
        causal = k_idx[None, :] <= (length - t) + q_idx[:, None]  # [T, L]
        if valid is None:
            mask = causal[None, None]  # [1, 1, T, L]
        else:
            mask = valid[:, :, None, :] & causal  # [B, H, T, L]
            # A row holding no slot at all (only padding so far) attends to slot 0: finite, unread.
            mask |= ~mask.any(-1, keepdim=True) & (k_idx == 0)
    if mask.shape[1] == 1 and g > 1 and t > 1:
        return F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=True
        )
    if g == 1:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling)
    # Per-KV-head mask: fold the G query heads of a group into the query axis (no K/V repeat).
    q = query.reshape(b, hkv, g * t, d)
    if t > 1:
        mask = mask.repeat(1, 1, g, 1)  # row g*T + t reads the mask of query t
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling)
    return out.reshape(b, hq, t, d)


def register() -> None:
    """Register ``"kvpolicy"`` with transformers' ``AttentionInterface`` and ``AttentionMaskInterface``.

    Idempotent. Call it before ``from_pretrained(..., attn_implementation="kvpolicy")``; building
    a ``KVPolicyCache`` calls it too.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, kvpolicy_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, kvpolicy_mask)
