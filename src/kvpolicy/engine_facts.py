"""Building ``ModelFacts`` from an engine's loaded model: the part every engine shares.

``kvpolicy.hf.facts`` (a transformers model) and ``kvpolicy.vllm.facts`` (a vLLM model, as one
tensor-parallel rank holds it) find the modules their own way; from there the facts are made
here, the same way for both: the model's shape from its configuration, each layer's output
projection split by query head, the reasons a fact is missing, and, for an engine that keeps its
RoPE as a table of rows (vLLM's ``cos_sin_cache``), the RoPE of any position from that table.
Pure torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .stages.fingerprint import ModelFingerprint
from .stages.model_facts import ModelFacts, ModelFactsError, ProjectionFn, RopeFn


@dataclass(frozen=True)
class ModelShape:
    """The shape fields of ``ModelFacts``: the whole model's, whatever share of it a process holds."""

    name: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int

    @staticmethod
    def of_config(config: Any, name: str) -> ModelShape:
        """The shape a transformers text configuration gives (``config.get_text_config()`` for a
        multimodal wrapper: what both engines read the model's architecture from)."""
        if hasattr(config, "get_text_config"):
            config = config.get_text_config(decoder=True)
        heads = int(config.num_attention_heads)
        hidden = int(config.hidden_size)
        return ModelShape(
            name=name, num_layers=int(config.num_hidden_layers), num_attention_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or hidden // heads), hidden_size=hidden,
        )

    def facts(
        self, *, rope_fn: RopeFn | None, output_projection_fn: ProjectionFn | None, missing: Mapping[str, str],
        kv_head_offset: int = 0, kv_heads_held: int | None = None, fingerprint: ModelFingerprint | None = None,
    ) -> ModelFacts:
        return ModelFacts(
            name=self.name, num_layers=self.num_layers, num_attention_heads=self.num_attention_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, hidden_size=self.hidden_size, rope_fn=rope_fn,
            output_projection_fn=output_projection_fn, missing=dict(missing), kv_head_offset=kv_head_offset,
            kv_heads_held=kv_heads_held, fingerprint=fingerprint,
        )


def partial_rope(rotary_dims: int, head_dim: int) -> str | None:
    """Why a rotary embedding over ``rotary_dims`` of the head's ``head_dim`` dimensions cannot be
    ``ModelFacts.rope`` (None: it can)."""
    if rotary_dims == head_dim:
        return None
    return (
        f"its rotary embedding's table has {rotary_dims} entries for the head's {head_dim} dimensions "
        "(a partial or interleaved RoPE), which the rotate-half convention over the whole head cannot describe"
    )


def projections(
    weights: Mapping[int, torch.Tensor], q_heads: int, head_dim: int, hidden: int
) -> tuple[ProjectionFn | None, str | None]:
    """``(output_projection_fn, None)`` from each layer's ``o_proj`` weight ``[hidden, q_heads *
    head_dim]`` (by the model's layer index; ``q_heads``: the query heads whose input columns it
    holds, every head or a tensor-parallel shard), or ``(None, why)`` when a weight is not one."""
    for layer, w in sorted(weights.items()):
        if not isinstance(w, torch.Tensor) or not w.is_floating_point():
            kind = type(w).__name__ if not isinstance(w, torch.Tensor) else f"a {w.dtype} tensor"
            return None, f"the o_proj weight of layer {layer} is {kind}, not a float matrix (a quantised layer?)"
        if tuple(w.shape) != (hidden, q_heads * head_dim):
            return None, (
                f"the o_proj weight of layer {layer} has shape {tuple(w.shape)}, expected [hidden, query heads x "
                f"head_dim] = {(hidden, q_heads * head_dim)} (a packed or removed weight?)"
            )
    held = dict(weights)

    def projection_fn(layer: int) -> torch.Tensor:
        w = held.get(layer)
        if w is None:
            raise ModelFactsError(
                f"layer {layer}'s output projection is not held here (held: {sorted(held)[:8]}...; another "
                "pipeline stage's layer?)"
            )
        return by_head(w, q_heads, head_dim)

    return projection_fn, None


def by_head(weight: torch.Tensor, q_heads: int, head_dim: int) -> torch.Tensor:
    """``[q_heads, head_dim, hidden]``: an ``o_proj`` weight ``[hidden, q_heads * head_dim]``
    (``out = attn_out @ weight.T``) split by the query head whose output each row multiplies (a view)."""
    return weight.t().unflatten(0, (q_heads, head_dim))


def table_rope(cos: torch.Tensor, sin: torch.Tensor) -> RopeFn:
    """The ``rope_fn`` of a rotary embedding kept as a table: ``cos[p], sin[p]`` ``[M, D / 2]``
    for positions ``p`` in ``0 .. M - 1`` (rotate-half: frequency ``i`` rotates dimensions ``i``
    and ``i + D / 2``), attention scaling included.

    Positions in the table are its rows, as the engine applies them. A negative position is the
    rotation backwards (cosine even, sine odd); a position past the table (a future distance a
    stage asks about beyond the engine's ``max_position``) is reached by rotating the row of
    ``p mod (M - 1)`` by ``p // (M - 1)`` times the angle of row ``M - 1``, in float64: the same
    float32-angle precision as the table's own rows.
    """
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] < 2:
        raise ModelFactsError(f"a RoPE table needs cos and sin of one shape [positions >= 2, D / 2], got "
                              f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    table_cos, table_sin = cos.detach().float(), sin.detach().float()
    rows = table_cos.shape[0]
    stride = rows - 1
    step_angle = torch.atan2(table_sin[stride].double(), table_cos[stride].double())  # [D / 2]
    on_device: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def tables(device: torch.device) -> tuple[torch.Tensor, ...]:
        got = on_device.get(device)
        if got is None:
            got = on_device[device] = tuple(t.to(device) for t in (table_cos, table_sin, step_angle))
        return got

    def rope(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t_cos, t_sin, step = tables(positions.device)
        p = positions.long()
        a = p.abs()
        turns, rest = a // stride, a % stride
        inside = a < rows
        row = torch.where(inside, a, rest)
        c, sn = t_cos[row], t_sin[row]  # [..., D / 2]
        if not bool(inside.all()):
            angle = turns.double()[..., None] * step  # rotated on from row `rest` by turns x row M - 1
            c_far = (c.double() * angle.cos() - sn.double() * angle.sin()).float()
            s_far = (sn.double() * angle.cos() + c.double() * angle.sin()).float()
            c = torch.where(inside[..., None], c, c_far)
            sn = torch.where(inside[..., None], sn, s_far)
        sn = torch.where((p < 0)[..., None], -sn, sn)
        return torch.cat([c, c], dim=-1), torch.cat([sn, sn], dim=-1)

    return rope
