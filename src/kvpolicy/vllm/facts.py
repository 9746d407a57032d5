"""``ModelFacts`` of a loaded vLLM model, as one worker (tensor-parallel rank) holds it.

The worker (``kvpolicy.vllm.worker``) builds them at start-up for the stages that read the
model (``Stage.needs_model``: CriticalKV's value norms through the output projection, Expected
Attention's and TriAttention's RoPE), from the attention modules of the layers its KV cache
holds (vLLM's ``LlamaAttention``, ``Qwen3Attention``, ...: ``rotary_emb``, ``o_proj``,
``num_heads``, ``num_kv_heads``, ``head_dim`` and the ``attn`` layer named ``layer_name``):

- **RoPE**: the rotary embedding's own table (``cos_sin_cache``: ``[max_position, rotary_dim]``,
  cosines then sines), the rotation vLLM applies to the keys it caches, attention scaling
  included (``kvpolicy.engine_facts.table_rope``, which also reaches past the table). Only
  rotate-half (``is_neox_style``) embeddings over the whole head, of the classes whose table
  a position indexes directly, and one embedding for every layer.
- **Output projection**: each layer's ``o_proj`` (a ``RowParallelLinear``) holds, on a rank,
  the input columns of the rank's own query heads: ``[hidden, num_heads * head_dim]``, exactly
  what a per-head value norm of the rank's KV heads reads. The facts say which heads they hold
  (``ModelFacts.kv_head_offset``, ``kv_heads_held``); the shape fields stay the whole model's.
  vLLM's CPU backend packs unquantised weights for oneDNN and drops ``weight`` after loading:
  ``keep_weight`` (installed by ``kvpolicy.vllm.hooks`` while the model loads) keeps the
  unpacked tensor (no copy) where this module finds it.

A fact the model cannot give is left out with the reason (``ModelFacts.missing``), which the
refusal of a policy needing it reports. Nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..engine_facts import ModelShape, partial_rope, projections, table_rope
from ..stages.model_facts import ModelFacts, ModelFactsError, RopeFn

#: Where ``keep_weight`` leaves an ``o_proj``'s weight (in the module's ``__dict__``).
KEPT_WEIGHT = "_kvpolicy_weight"

#: vLLM 0.32's rotary embeddings whose ``cos_sin_cache`` row ``p`` is position ``p``'s rotation
#: (others index it with offsets, keep two tables, or rotate by more than one position index).
TABLE_ROPES = frozenset({
    "RotaryEmbedding", "LinearScalingRotaryEmbedding", "DynamicNTKScalingRotaryEmbedding",
    "DynamicNTKAlphaRotaryEmbedding", "NTKScalingRotaryEmbedding", "YaRNScalingRotaryEmbedding",
    "Llama3RotaryEmbedding",
})


def keep_weight(linear: torch.nn.Module) -> None:
    """Keep ``linear``'s unpacked weight where ``model_facts`` reads it, before vLLM's CPU GEMM
    dispatch replaces ``weight`` by an empty tensor (the same tensor, not a copy)."""
    weight = getattr(linear, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2 and not weight.is_meta:
        linear.__dict__[KEPT_WEIGHT] = weight.detach()


def o_proj_weight(linear: Any) -> Any:
    """The weight ``[hidden, local query heads x head_dim]`` of an ``o_proj``: the one kept before
    vLLM packed it (``keep_weight``), else its ``weight``."""
    kept = getattr(linear, "__dict__", {}).get(KEPT_WEIGHT)
    return kept if kept is not None else getattr(linear, "weight", None)


def model_facts(model: Any, config: Any, layers: Mapping[int, str], *, name: str, head_offset: int = 0) -> ModelFacts:
    """The facts of a loaded vLLM ``model`` on this rank.

    Args:
        model: the model runner's model (``runner.get_model()``).
        config: the model's transformers text configuration (``model_config.hf_text_config``):
            the whole model's shape.
        layers: the model's index of each attention layer this rank runs -> the name vLLM gives
            its ``Attention`` (``layer_name``: the KV cache's layer names).
        name: the model's name (``model_config.model``), for messages and calibration files.
        head_offset: the model's index of the first KV head this rank holds (tensor parallelism:
            ``rank * local KV heads``); its ``o_proj`` holds those heads' query heads' columns.
    """
    shape = ModelShape.of_config(config, name)
    modules = _attention_modules(model, layers)
    missing: dict[str, str] = {}
    absent = sorted(i for i, m in modules.items() if m is None)
    found = {i: m for i, m in modules.items() if m is not None}
    if absent or not found:
        why = (f"no attention module (with o_proj, rotary_emb and an attn layer named as the KV cache's) "
               f"found for layer(s) {absent[:5] or sorted(layers)[:5]}")
        return shape.facts(rope_fn=None, output_projection_fn=None,
                           missing={"rope": why, "output_projection": why}, kv_head_offset=head_offset)
    q_local, kv_local = _local_heads(found, shape)
    rope_fn, why_rope = _rope(found, shape.head_dim)
    if why_rope is not None:
        missing["rope"] = why_rope
    weights = {i: o_proj_weight(getattr(m, "o_proj", None)) for i, m in found.items()}
    projection_fn, why_projection = projections(weights, q_local, shape.head_dim, shape.hidden_size)
    if why_projection is not None:
        missing["output_projection"] = why_projection
    if head_offset + kv_local > shape.num_kv_heads:
        raise ModelFactsError(
            f"this rank's KV heads {head_offset} .. {head_offset + kv_local - 1} are not among the model's "
            f"{shape.num_kv_heads}"
        )
    return shape.facts(rope_fn=rope_fn, output_projection_fn=projection_fn, missing=missing,
                       kv_head_offset=head_offset, kv_heads_held=kv_local)


def _attention_modules(model: Any, layers: Mapping[int, str]) -> dict[int, Any]:
    """The attention module of each layer (by the model's index): the module whose ``attn`` is
    the ``Attention`` of that ``layer_name`` and that has an ``o_proj`` and a ``rotary_emb``."""
    index_of = {n: i for i, n in layers.items()}
    found: dict[int, Any] = dict.fromkeys(layers)
    for module in model.modules():
        attn = getattr(module, "attn", None)
        layer = index_of.get(getattr(attn, "layer_name", None))  # type: ignore[arg-type]
        if layer is not None and hasattr(module, "o_proj") and hasattr(module, "rotary_emb"):
            found[layer] = module
    return found


def _local_heads(modules: Mapping[int, Any], shape: ModelShape) -> tuple[int, int]:
    """The query and KV heads each layer's attention runs on this rank (the same for every layer)."""
    seen = {(int(m.num_heads), int(m.num_kv_heads), int(m.head_dim)) for m in modules.values()}
    if len(seen) != 1:
        raise ModelFactsError(f"the attention layers run different head counts or sizes on this rank: {sorted(seen)}")
    q, kv, d = seen.pop()
    if d != shape.head_dim or q != kv * shape.num_attention_heads // shape.num_kv_heads:
        raise ModelFactsError(
            f"this rank's attention runs {q} query heads over {kv} KV heads of size {d}, which does not fit the "
            f"model's {shape.num_attention_heads} over {shape.num_kv_heads} of size {shape.head_dim} (replicated KV "
            "heads?)"
        )
    return q, kv


def _rope(modules: Mapping[int, Any], head_dim: int) -> tuple[RopeFn | None, str | None]:
    """``(rope_fn, None)`` from the layers' one rotary embedding, or ``(None, why)``."""
    rotaries = {i: m.rotary_emb for i, m in modules.items()}
    first_layer = min(rotaries)
    rotary = rotaries[first_layer]
    kind = type(rotary).__name__
    if kind not in TABLE_ROPES:
        return None, f"its rotary embedding {kind} is not one whose table a position indexes directly ({sorted(TABLE_ROPES)})"
    if len(getattr(rotary, "scaling_factors", None) or [1.0]) > 1:
        return None, f"its rotary embedding {kind} keeps one table per scaling factor (read at offsets)"
    if not getattr(rotary, "is_neox_style", False):
        return None, ("its rotary embedding pairs dimensions 2i and 2i + 1 (is_neox_style False), not i and i + D/2: "
                      "the rotate-half convention cannot describe it")
    partial = partial_rope(int(rotary.rotary_dim), head_dim)
    if partial is not None or int(rotary.head_size) != head_dim:
        return None, partial or f"its rotary embedding's head_size {rotary.head_size} is not the head's {head_dim}"
    cache = getattr(rotary, "cos_sin_cache", None)
    if not isinstance(cache, torch.Tensor) or cache.dim() != 2 or cache.shape[-1] != head_dim:
        return None, f"its rotary embedding {kind} has no [positions, {head_dim}] cos_sin_cache"
    for layer, other in rotaries.items():
        same = other is rotary or (type(other) is type(rotary) and torch.equal(other.cos_sin_cache, cache))
        if not same:
            return None, f"layers {first_layer} and {layer} rotate differently (one RoPE for every layer is needed)"
    cos, sin = cache.chunk(2, dim=-1)
    return table_rope(cos, sin), None
