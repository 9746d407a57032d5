"""Small stand-ins for a loaded vLLM 0.32 model, as one tensor-parallel rank holds it: the classes
and attributes ``kvpolicy.vllm.facts`` reads (``LlamaAttention.rotary_emb`` / ``o_proj`` /
``num_heads`` / ``num_kv_heads`` / ``head_dim`` / ``attn.layer_name``, a ``RotaryEmbedding`` with
its ``cos_sin_cache``, a ``RowParallelLinear`` holding its rank's input columns), without vLLM.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """vLLM's plain rotary embedding: ``cos_sin_cache [max_position, rotary_dim]``, each row the
    cosines then the sines of its position's angles, computed in float32 as vLLM does."""

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float,
                 is_neox_style: bool = True, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.head_size, self.rotary_dim, self.base = head_size, rotary_dim, base
        self.max_position_embeddings, self.is_neox_style = max_position_embeddings, is_neox_style
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
        inv_freq = 1.0 / base**exponents
        angles = torch.arange(max_position_embeddings, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos_sin_cache", torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype),
                             persistent=False)


class RowParallelLinear(nn.Module):
    """An ``o_proj`` on one rank: ``weight [hidden, input_size_per_partition]``, the rank's columns."""

    def __init__(self, weight: torch.Tensor, prefix: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.clone(), requires_grad=False)
        self.input_size_per_partition = weight.shape[1]
        self.prefix = prefix


class Attention(nn.Module):
    def __init__(self, layer_name: str) -> None:
        super().__init__()
        self.layer_name = layer_name


class LlamaAttention(nn.Module):
    def __init__(self, *, q_heads: int, kv_heads: int, head_dim: int, tp_size: int, o_proj: torch.Tensor,
                 rotary: nn.Module, prefix: str) -> None:
        super().__init__()
        self.total_num_heads, self.total_num_kv_heads = q_heads, kv_heads
        self.num_heads, self.num_kv_heads, self.head_dim = q_heads // tp_size, kv_heads // tp_size, head_dim
        self.o_proj = RowParallelLinear(o_proj, f"{prefix}.o_proj")
        self.rotary_emb = rotary
        self.attn = Attention(f"{prefix}.attn")


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: SimpleNamespace, layers: list[LlamaAttention]) -> None:
        super().__init__()
        self.config = config
        self.model = nn.Module()
        self.model.layers = nn.ModuleList()
        for attention in layers:
            decoder = nn.Module()
            decoder.self_attn = attention
            self.model.layers.append(decoder)


def layer_names(layers: int) -> dict[int, str]:
    """The KV cache's layer names, by the model's layer index (what the worker hands the builder)."""
    return {i: f"model.layers.{i}.self_attn.attn" for i in range(layers)}


def vllm_model(o_proj: torch.Tensor, *, kv_heads: int, head_dim: int, tp_size: int = 1, rank: int = 0,
               theta: float = 10000.0, max_position: int = 4096, name: str = "fake-llama",
               rope_dtype: torch.dtype = torch.float32):
    """``(model, config)``: rank ``rank`` of ``tp_size`` of a model whose layer ``i`` has the full
    output projection weight ``o_proj[i]`` (``[hidden, Hq * head_dim]``, transformers' layout),
    sharded by input columns as vLLM's ``RowParallelLinear`` loads it, and one rotary embedding."""
    layers, hidden, width = o_proj.shape
    q_heads = width // head_dim
    config = SimpleNamespace(num_hidden_layers=layers, num_attention_heads=q_heads, num_key_value_heads=kv_heads,
                             hidden_size=hidden, head_dim=head_dim, _name_or_path=name)
    rotary = RotaryEmbedding(head_dim, head_dim, max_position, theta, dtype=rope_dtype)
    cols = width // tp_size
    modules = [
        LlamaAttention(q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, tp_size=tp_size,
                       o_proj=o_proj[i][:, rank * cols : (rank + 1) * cols], rotary=rotary,
                       prefix=f"model.layers.{i}.self_attn")
        for i in range(layers)
    ]
    return LlamaForCausalLM(config, modules), config


def from_hf(model, *, tp_size: int = 1, rank: int = 0, max_position: int = 4096):
    """The fake vLLM model of a transformers Llama-like ``model``, on the same weights."""
    config = model.config
    weights = torch.stack([layer.self_attn.o_proj.weight.detach() for layer in model.model.layers])
    theta = float(getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"])
    return vllm_model(weights, kv_heads=config.num_key_value_heads, head_dim=config.head_dim, tp_size=tp_size,
                      rank=rank, theta=theta, max_position=max_position, name=config._name_or_path)
