"""The two attention kernels over a cache's slots; each layout attends through one of them.

After eviction, slots are not positions: a layer holds a different subset of tokens per head,
rows of a batch hold different numbers of slots, and a multi-token chunk must be causal by token
order, not by slot index.

- ``attend``: slots as ``[B, Hkv, L, D]`` tensors. Even rows attend their buffers' views with the
  ``[B, 1, T, L]`` mask the step's plan holds (shared by every layer and head, since rows are
  packed), or none; select mode attends the slots it gathered, with a mask per KV head. It is
  also what transformers' attention function, the evaluation harness and the docs examples call.
- ``attend_split``: one decode query over two sets of slots held apart (a two-tier cache's
  recall buffer and its kept slots), without copying them into one.
- ``attend_heads``: per-head runs (heads of a row holding different counts), read in place
  through an index per head (``HeadLayout.band``): it gathers each head's own slots, then
  attends them in one call.

All compute exact softmax attention over the slots they are given; they differ in how the
slots are addressed.
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
        ``[B, Hq, T, Dv]``. A query whose row attends no real slot gets a finite, meaningless output.
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
        return out.reshape(b, hq, 1, values.shape[-1])
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=g > 1)


def attend_heads(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    index: torch.Tensor,
    mask: torch.Tensor,
    *,
    scaling: float | None = None,
) -> torch.Tensor:
    """Exact attention over a flat per-head layout (``kvpolicy.heads``).

    Args:
        query: ``[B, Hq, T, D]``; query head ``h*G + g`` reads KV head ``h``.
        keys: ``[N, D]`` the layer's slots, row after row and head after head; values ``[N, Dv]``.
        index: ``[B, Hkv, W]`` the slot (row into ``keys``) each KV head reads in column ``w``
            (``HeadLayout.band``).
        mask: ``[B, Hkv, T, W]`` bool, the columns each KV head's query ``t`` attends.

    Returns ``[B, Hq, T, Dv]``. Each head's columns are gathered into ``[B, Hkv, W, D]`` (rows of
    ``D`` contiguous values, so the copy streams), then one attention call reads them: the work
    follows the fullest head's count, not the ``Hkv`` times larger flat row that a masked product
    over every slot would score.
    """
    b, hq, t, d = query.shape
    hkv, width = index.shape[1], index.shape[2]
    g = hq // hkv
    flat = index.flatten()
    k = keys.index_select(0, flat).view(b, hkv, width, d)
    v = values.index_select(0, flat).view(b, hkv, width, -1)
    # A KV head's G query heads act as G * T query rows of it: no key or value repeat.
    q = query.reshape(b, hkv, g * t, d)
    if g > 1:
        mask = mask[:, :, None].expand(b, hkv, g, t, width).reshape(b, hkv, g * t, width)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    return out.view(b, hq, t, v.shape[-1])


def attend_split(
    query: torch.Tensor,
    first: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    second: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    *,
    scaling: float | None = None,
) -> torch.Tensor:
    """Attention of one decode query per row over two sets of slots, as if they were one.

    Args:
        query: ``[B, Hq, 1, D]``; query head ``h*G + g`` reads KV head ``h``.
        first, second: ``(keys [B, Hkv, L, D], values [B, Hkv, L, Dv], valid)``, ``valid``
            ``[B, Hkv or 1, L]`` bool or None (every slot). Each row must hold at least one valid
            slot in one of them.

    Returns ``[B, Hq, 1, Dv]``: one softmax over both sets' logits side by side, in float32
    (float64 for float64 inputs, which ``attend`` serves exactly too), and each set's values read
    where they are (the kept slots are not copied each step: only the logits, ``L1 + L2`` per
    query head, are joined). Float16 logits are computed in float32: a product of finite float16
    inputs overflows float16 (``|q . k| > 65504``) where ``attend`` does not.
    """
    b, hq, t, d = query.shape
    if t != 1:
        raise ValueError(f"attend_split attends one decode query per row, got {t}")
    hkv = first[0].shape[1]
    scale = d**-0.5 if scaling is None else scaling
    q = query.reshape(b, hkv, hq // hkv, d)
    split = first[0].shape[2]
    keys = (first[0], second[0])
    if query.dtype == torch.float16:  # float16 products overflow where attend's do not
        q, keys = q.float(), (keys[0].float(), keys[1].float())
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    logits = torch.cat([q @ keys[0].transpose(-1, -2), q @ keys[1].transpose(-1, -2)], dim=-1).to(acc)  # [B, Hkv, G, L1 + L2]
    for part, (_, _, valid) in zip((logits[..., :split], logits[..., split:]), (first, second), strict=True):
        if valid is not None:
            part.masked_fill_(~valid[:, :, None, :], float("-inf"))
    weights = torch.softmax(logits * scale, dim=-1)
    out = weights[..., :split].to(first[1].dtype) @ first[1] + weights[..., split:].to(second[1].dtype) @ second[1]
    return out.to(query.dtype).reshape(b, hq, 1, -1)
