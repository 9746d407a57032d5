"""The attention kernel over a cache's slots: the one used by ``EvictingCache.attend``, the
transformers integration, the evaluation harness and the docs examples.

After eviction, slots are not positions: a layer holds a different subset of tokens per head,
rows of a batch hold different numbers of slots, and a multi-token chunk must be causal by token
order, not by slot index. ``LayerGroup`` plans one ``[B, 1, T, L]`` mask per step that says all of
that (shared by every layer and head, since rows are packed); this kernel applies it.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


def attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    scaling: float | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``T`` new queries over ``L`` cached slots.

    Args:
        query: ``[B, Hq, T, D]`` post-RoPE queries.
        keys: ``[B, Hkv, L, D]`` (``Hq % Hkv == 0``; query head ``h*G + g`` reads KV head ``h``).
        values: ``[B, Hkv, L, Dv]``.
        scaling: the softmax scale (default ``D ** -0.5``).
        mask: ``[B, 1, T, L]`` bool, which slots each query attends (shared by the heads), or
            ``None`` when every slot holds a real token and the new tokens are the last ``T``
            slots (plain causal attention, aligned bottom-right). A one-token step (``T = 1``)
            may also pass ``[B, Hkv, 1, L]``, a mask per KV head.

    Returns:
        ``[B, Hq, T, D]``. A query whose row attends no real slot gets a finite, meaningless output.
    """
    b, hq, t, d = query.shape
    hkv, length = keys.shape[1], keys.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    g = hq // hkv
    if scaling is None:
        scaling = d**-0.5
    if mask is None:
        if HAS_FLASH_ATTN and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16):
            from flash_attn import flash_attn_func

            # flash-attn's causal mask is bottom-right aligned (>= 2.1): exactly "new tokens last".
            out = flash_attn_func(
                query.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                softmax_scale=scaling, causal=t > 1,
            )
            return out.transpose(1, 2)
        if t == length:
            return F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scaling, enable_gqa=g > 1)
        if t > 1:  # SDPA's is_causal is top-left aligned: spell out "new tokens last"
            q_idx = torch.arange(t, device=keys.device)
            mask = (torch.arange(length, device=keys.device) <= (length - t) + q_idx[:, None])[None, None]
    if t == 1 and g > 1:
        # The group's queries act as G query rows of KV head h: no K/V repeat, one SDPA call.
        q = query.reshape(b, hkv, g, d)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling)
        return out.reshape(b, hq, 1, d)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=g > 1)
