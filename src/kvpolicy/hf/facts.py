"""``ModelFacts`` of a transformers decoder: its shape, its rotary embedding, its output projections.

``KVPolicyCache(policy, model)`` builds them when the policy's stages read any
(``Policy.needs_model``); what the vLLM builder (``kvpolicy.vllm.facts``) makes the same way is
in ``kvpolicy.engine_facts``. A fact the model cannot give (no rotary embedding found; a partial,
interleaved, per-layer-type or length-dependent one; layers without RoPE; no ``o_proj`` in an
attention layer) is left out with the reason, which the refusal of a policy needing it reports.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..engine_facts import ModelShape, partial_rope, projections
from ..stages.model_facts import ModelFacts


def model_facts(model: Any) -> ModelFacts:
    """The facts a stage may ask of ``model`` (a transformers causal LM)."""
    config = model.config.get_text_config(decoder=True)
    name = str(getattr(config, "_name_or_path", "") or getattr(model, "name_or_path", "") or type(model).__name__)
    shape = ModelShape.of_config(config, name)
    missing: dict[str, str] = {}

    rope_fn = None
    rotary = _rotary_embedding(model)
    modules = _attention_modules(model, shape.num_layers)
    why = _rope_refusal(model, rotary, modules, shape.head_dim)
    if why is not None or rotary is None:
        missing["rope"] = why or "no rotary embedding"
    else:
        served = rotary

        def rope_fn(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return _call_rotary(served, positions)

    projection_fn = None
    linears = {i: getattr(m, "o_proj", None) for i, m in enumerate(modules)}
    absent = [i for i, p in linears.items() if not isinstance(p, torch.nn.Linear)]
    if absent:
        missing["output_projection"] = f"no o_proj linear layer found in attention layer(s) {absent[:5]}"
    else:
        weights = {i: p.weight for i, p in linears.items() if isinstance(p, torch.nn.Linear)}
        projection_fn, why = projections(weights, shape.num_attention_heads, shape.head_dim, shape.hidden_size)
        if why is not None:
            missing["output_projection"] = why

    return shape.facts(rope_fn=rope_fn, output_projection_fn=projection_fn, missing=missing)


#: Rotary embeddings whose rotation of a position depends on the sequence (transformers rescales
#: them, in place, from the longest position of a call): no fixed rotation per position.
_LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})


def _rope_refusal(model: Any, rotary: torch.nn.Module | None, modules: list[torch.nn.Module | None],
                  head_dim: int) -> str | None:
    """Why the model's RoPE cannot be ``ModelFacts.rope`` (one rotate-half rotation per position,
    the same in every layer), or None. Checked before the rotary embedding is first called."""
    if rotary is None:
        return f"{type(model).__name__} has no rotary embedding module (rotary_emb)"
    rope_type = getattr(rotary, "rope_type", None) or _configured_rope_type(model)
    if isinstance(rope_type, dict) or "layer_type" in inspect.signature(rotary.forward).parameters:
        return "its rotary embedding differs by layer type (local and global RoPE), one RoPE for every layer cannot describe it"
    if rope_type in _LENGTH_DEPENDENT_ROPE:
        return (f"its RoPE ({rope_type!r} scaling) rescales with the sequence's length, so a position has no fixed "
                "rotation to give")
    nope = [i for i, m in enumerate(modules) if m is not None and not getattr(m, "use_rope", True)]
    if nope:
        return f"layer(s) {nope[:5]} apply no RoPE (NoPE layers), which one RoPE for every layer cannot describe"
    try:
        cos, sin = _call_rotary(rotary, torch.tensor([0, 1, 7]))
    except (TypeError, ValueError) as exc:  # another calling convention (complex frequencies, MLA's)
        return f"its rotary embedding does not give (cos, sin) for position ids: {exc}"
    partial = partial_rope(int(cos.shape[-1]), head_dim)
    if partial is not None:
        return partial
    half = head_dim // 2
    if not (torch.equal(cos[..., :half], cos[..., half:]) and torch.equal(sin[..., :half], sin[..., half:])):
        return ("its rotary embedding is interleaved (each frequency rotates two adjacent dimensions), not rotate-half "
                "(frequency i rotating dimensions i and i + D/2)")
    return None


def _configured_rope_type(model: Any) -> str:
    """The RoPE type the model's config names (``rope_parameters`` or the older ``rope_scaling``),
    read where the rotary module does not carry it: a renamed attribute must not hide a scaling."""
    config = model.config.get_text_config(decoder=True)
    for field in ("rope_parameters", "rope_scaling"):
        found = getattr(config, field, None)
        if isinstance(found, dict):
            return str(found.get("rope_type", found.get("type", "default")))
    return "default"


def _rotary_embedding(model: Any) -> torch.nn.Module | None:
    """The model's shared rotary embedding (``model.model.rotary_emb`` on Llama-like decoders)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    rotary = getattr(decoder, "rotary_emb", None)
    return rotary if isinstance(rotary, torch.nn.Module) else None


def _call_rotary(rotary: torch.nn.Module, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[*positions.shape, D]`` float32 from a transformers rotary embedding, which
    takes ``(x, position_ids [B, T])`` and returns ``[B, T, D]`` in ``x``'s dtype."""
    buffer = next(iter(rotary.buffers()), None)
    device = buffer.device if buffer is not None else positions.device
    flat = positions.reshape(1, -1).to(device)
    probe = torch.zeros(1, dtype=torch.float32, device=device)
    with torch.no_grad():
        cos, sin = rotary(probe, flat)
    shape = (*positions.shape, cos.shape[-1])
    return cos.float().reshape(shape).to(positions.device), sin.float().reshape(shape).to(positions.device)


def _attention_modules(model: Any, layers: int) -> list[torch.nn.Module | None]:
    """Each decoder layer's attention module (the module with ``layer_idx`` and ``o_proj``)."""
    found: list[torch.nn.Module | None] = [None] * layers
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and 0 <= idx < layers and found[idx] is None and hasattr(module, "o_proj"):
            found[idx] = module
    return found
