"""Capturing each layer's post-RoPE queries, keys and values from one full-cache forward.

A custom attention function (registered under ``"kvpolicy_eval_capture"``) records what the
model hands attention, then runs SDPA, so the forward itself is unchanged.
"""

from __future__ import annotations

import torch

CAPTURE = "kvpolicy_eval_capture"
_store: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]] = {}


def _capture_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    scaling = kwargs.get("scaling")
    if scaling is None:
        scaling = getattr(module, "scaling", query.shape[-1] ** -0.5)
    _store[module.layer_idx] = (query.detach(), key.detach(), value.detach(), float(scaling))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(CAPTURE, _capture_attention)
    AttentionMaskInterface.register(CAPTURE, sdpa_mask)


@torch.inference_mode()
def capture_attention(model, ids: list[int], device: str, base_attn: str = "sdpa"):
    """Per layer ``(queries [1, Hq, N, D], keys [1, Hkv, N, D], values, scaling)`` for ``ids``."""
    from transformers import DynamicCache

    from .decoding import cache_argument

    _register()
    _store.clear()
    model.set_attn_implementation(CAPTURE)
    try:
        x = torch.tensor([ids], dtype=torch.long, device=device)
        cache = {cache_argument(model): DynamicCache(config=model.config)}
        model(input_ids=x, use_cache=True, logits_to_keep=1, **cache)
    finally:
        model.set_attn_implementation(base_attn)
    captured = [_store[i] for i in sorted(_store)]
    _store.clear()
    return captured
