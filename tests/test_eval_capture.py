"""Capturing attention inputs (``kvpolicy.eval.capture``): the scaling of the attention logits is
the model's own, read from it, or the capture is refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hf_util import tiny_qwen3

from kvpolicy.eval.capture import _capture_attention, capture_attention


def test_the_captured_scaling_is_the_models_per_layer():
    model = tiny_qwen3(layers=3, vocab=64)
    scalings = [0.05, 0.4, 1.5]  # none of them head_dim ** -0.5 = 0.25
    for layer, s in zip(model.model.layers, scalings, strict=True):
        layer.self_attn.scaling = s
    ids = list(range(3, 15))
    captured = capture_attention(model, ids, "cpu")
    assert [c[3] for c in captured] == pytest.approx(scalings)
    q, k, v, _ = captured[0]
    assert q.shape == (1, 4, len(ids), 16) and k.shape == v.shape == (1, 2, len(ids), 16)
    assert model.config._attn_implementation == "sdpa"  # switched back


def _qkv():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, 2, 5, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g),
            torch.randn(1, 2, 5, 8, generator=g))


def test_the_scaling_handed_to_attention_comes_first_then_the_modules():
    from kvpolicy.eval import capture

    module = SimpleNamespace(layer_idx=7, scaling=0.5, is_causal=True, num_key_value_groups=1, training=False)
    q, k, v = _qkv()
    capture._store.clear()
    try:
        _capture_attention(module, q, k, v, None, scaling=0.125)
        assert capture._store[7][3] == 0.125
        _capture_attention(module, q, k, v, None)
        assert capture._store[7][3] == 0.5
    finally:
        capture._store.clear()


def test_an_attention_module_without_scaling_is_refused():
    from kvpolicy.eval import capture

    module = SimpleNamespace(layer_idx=2, is_causal=True, num_key_value_groups=1, training=False)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"layer 2\).*`scaling`"):
        _capture_attention(module, q, k, v, None)
    with pytest.raises(ValueError, match="`scaling`"):
        _capture_attention(module, q, k, v, None, scaling=None)
    assert capture._store == {}
