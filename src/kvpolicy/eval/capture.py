"""Capturing each layer's post-RoPE queries, keys and values from one full-cache forward.

A custom attention function (registered under ``"kvpolicy_eval_capture"``) records what the
model hands attention, then runs SDPA, so the forward itself is unchanged. The scaling of the
attention logits is read from the model (``attention_scaling``), never assumed.
"""

from __future__ import annotations

import torch

CAPTURE = "kvpolicy_eval_capture"
_store: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]] = {}


def attention_scaling(module, kwargs: dict) -> float:
    """The factor the model scales its attention logits by: the ``scaling`` it hands attention,
    else its attention module's ``scaling``. Neither is an error: a default such as
    ``head_dim ** -0.5`` would be wrong, silently, for a model that scales otherwise."""
    scaling = kwargs.get("scaling")
    if scaling is None:
        scaling = getattr(module, "scaling", None)
    if scaling is None:
        raise ValueError(
            f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) gives attention no "
            "`scaling` (neither as an argument nor as its attribute): the scaling of its attention logits "
            "is unknown, so its captured attention cannot be reproduced"
        )
    return float(scaling)


def _capture_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    _store[module.layer_idx] = (query.detach(), key.detach(), value.detach(), attention_scaling(module, kwargs))
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
        captured = [_store[i] for i in sorted(_store)]
    finally:
        model.set_attn_implementation(base_attn)
        _store.clear()
    return captured
