"""DuoAttention-style heads: retrieval heads keep a large cache, streaming heads only their
sinks and recent tokens, by a head profile measured offline."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Annotated, Any, ClassVar

import torch
from pydantic import Field, PrivateAttr, model_validator

from ..profile_format import HeadProfile
from .adaptive import share_the_rest
from .base import Allocation, DataFile, EvictionInput

#: ``path: "builtin:NAME"`` reads a profile shipped with kvpolicy (``kvpolicy/policies/heads/NAME``).
PROFILE_FILE = DataFile("heads")
resolve_profile_path = PROFILE_FILE.resolve


def _hamilton(shares: list[Fraction], total: int) -> list[int]:
    """Exact largest remainders: floors, then one more to the largest remainders (earlier first)."""
    floors = [math.floor(s) for s in shares]
    order = sorted(range(len(shares)), key=lambda i: (-(shares[i] - floors[i]), i))
    for i in order[: max(0, total - sum(floors))]:
        floors[i] += 1
    return floors


class DuoAllocation(Allocation):
    """Streaming heads keep ``recent + sinks`` slots (their sink tokens and recent buffer, which
    the policy protects), retrieval heads share the rest of the model's total equally.

    A head is a retrieval head when its profile weight is at least ``threshold`` (default 0.5:
    DuoAttention deploys its trained gates with it; a class profile's retrieval heads weigh 1, streaming
    heads 0), or, with ``streaming_fraction``, the lowest-weighted fraction of the model's heads
    stream (kvpress's ``head_compression_ratio``: that fraction of the heads rounded to the
    nearest, halves to even, as Python's ``round``; ties of weight: the earlier layer and head
    stream first). The model's total, ``layers x KV heads x budget`` slots, is fixed: each retrieval
    head gets ``(total - streaming heads x (recent + sinks)) / retrieval heads``, rounded per
    layer so that every count is an int and each layer's heads add up to ``Hkv x`` its budget.

    Until a retrieval head holds its share (the first evictions of a layer that mixes the two
    classes), it keeps every slot it holds and the layer's spare slots go to the best-scored
    candidates of its streaming heads, so the layer still keeps its total; from then on every
    streaming head keeps exactly its protected slots.
    """

    type_name: ClassVar[str] = "duo"
    reads_values: ClassVar[bool] = False
    per_head: ClassVar[bool] = True

    path: Annotated[str, PROFILE_FILE] = Field(..., min_length=1, description='The head profile (see `kvpolicy profile`), or "builtin:NAME".')
    threshold: float | None = Field(
        None, ge=0.0, allow_inf_nan=False,
        description="Heads weighing at least this are retrieval heads; null: 0.5 (DuoAttention's deployment "
        "threshold) unless streaming_fraction is set.",
    )
    streaming_fraction: float | None = Field(
        None, ge=0.0, lt=1.0, allow_inf_nan=False,
        description="Instead of threshold: this fraction of the model's heads, the lowest-weighted, stream.",
    )
    sinks: int = Field(
        4, ge=0, le=1 << 24,
        description="Sink slots a streaming head keeps besides the recent buffer: the policy's sinks reservation's n.",
    )
    _profile: Any = PrivateAttr(default=None)
    _retrieval: Any = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _load(self) -> DuoAllocation:
        if self.streaming_fraction is not None and self.threshold is not None:
            raise ValueError("give threshold or streaming_fraction, not both")
        try:
            self._profile = HeadProfile.load(PROFILE_FILE.resolve(self.path, "path"))
        except ValueError as exc:  # ProfileError: one line per problem, with the file's lines
            problems = getattr(exc, "problems", [str(exc)])
            raise ValueError(f"cannot use the head profile {self.path}: {'; '.join(problems)}") from None
        weights = self._profile.head_weights()
        if self.streaming_fraction is None:
            threshold = 0.5 if self.threshold is None else self.threshold
            retrieval = weights >= threshold
            field = f"threshold {threshold}"
        else:
            streaming = round(self.streaming_fraction * weights.numel())  # as kvpress: to the nearest (halves to even)
            order = torch.sort(weights.flatten(), stable=True).indices  # lowest first; ties: earlier head
            retrieval = torch.ones(weights.numel(), dtype=torch.bool)
            retrieval[order[:streaming]] = False
            retrieval = retrieval.view_as(weights)
            field = f"streaming_fraction {self.streaming_fraction}"
        if not bool(retrieval.any()):
            raise ValueError(f"{field} leaves no retrieval head in the profile {self.path}")
        self._retrieval = tuple(tuple(row) for row in retrieval.tolist())  # comparable, unlike a tensor
        return self

    @property
    def retrieval(self) -> torch.Tensor:
        """``[L, Hkv]`` bool: the retrieval heads (the rest stream)."""
        return torch.tensor(self._retrieval, dtype=torch.bool)

    def check_model(self, num_layers: int, num_kv_heads: int) -> None:
        """Refuse a model of another shape than the profile's (``num_kv_heads`` 0: not known yet,
        the layers alone are compared, and the message claims no head count)."""
        p = self._profile
        if num_kv_heads:
            p.check_shape(num_layers, num_kv_heads)
        elif p.num_layers != num_layers:
            raise ValueError(f"profile {p.describe()} is for a model with {p.num_layers} layers x {p.num_kv_heads} "
                             f"KV heads, this model has {num_layers} layers")

    def _streaming_slots(self, recent: int) -> int:
        return recent + self.sinks

    @property
    def heads_alike(self) -> bool:
        return False  # fixed shares differ by head

    def layer_budgets(self, budget: int, num_layers: int, recent: int) -> list[int]:
        self.check_model(num_layers, 0)
        stream = self._streaming_slots(recent)
        if budget <= stream:
            raise ValueError(
                f"budget ({budget}) must be above a streaming head's recent + sinks ({recent} + {self.sinks}): "
                "otherwise retrieval heads keep no more than streaming ones"
            )
        retrieval = self.retrieval
        hkv = retrieval.shape[1]
        n_r = int(retrieval.sum())
        pool = Fraction(num_layers * hkv * budget - (retrieval.numel() - n_r) * stream, n_r)
        shares = [Fraction(int(r) * pool + (hkv - int(r)) * stream, hkv) for r in retrieval.sum(1).tolist()]
        return _hamilton(shares, num_layers * budget)

    def head_budgets(self, layer: int, layer_budget: int, recent: int) -> list[int]:
        """The slots each head of ``layer`` keeps when the layer keeps ``Hkv * layer_budget``."""
        row = list(self._retrieval[layer])
        stream = self._streaming_slots(recent)
        n_r = sum(row)
        spare = len(row) * layer_budget - (len(row) - n_r) * stream
        if n_r == 0:
            return [stream] * len(row)
        ret = _hamilton([Fraction(spare, n_r)] * n_r, spare)
        it = iter(ret)
        return [next(it) if r else stream for r in row]

    def layer_head_cap(self, layer: int, layer_budget: int, num_kv_heads: int, recent: int) -> int:
        """The largest of the layer's head shares (``head_budgets``). Every head of a layer holds
        the same slots at its first eviction, and a retrieval head keeps all it holds until it
        holds its share; the layer has spare slots only while a retrieval head holds less than
        its share, and they go to heads holding no more than it (a streaming head keeps at most
        what it holds, and grows no faster). So no head keeps more than the largest share. (An
        engine reserving this room checks every eviction against it: vLLM's paged cache.)"""
        return max(self.head_budgets(layer, layer_budget, recent))

    def head_counts(self, priority: torch.Tensor, protected: torch.Tensor, inp: EvictionInput) -> torch.Tensor:
        p = self._profile
        layers = inp.layer_index.tolist()
        if inp.num_kv_heads != p.num_kv_heads or max(layers) >= p.num_layers:
            raise ValueError(
                f"allocation 'duo': the head profile {self.path} is for {p.num_layers} layers x {p.num_kv_heads} KV "
                f"heads; this eviction has {inp.num_kv_heads} KV heads at layer {max(layers)}"
            )
        recent = inp.num_slots - inp.num_candidates
        tables: dict[int, list[int]] = {}
        for layer in layers:
            if layer not in tables:
                tables[layer] = self.head_budgets(layer, inp.budget, recent)
        device = priority.device
        share = torch.tensor([tables[layer] for layer in layers], device=device)
        streaming = ~self.retrieval.to(device)[torch.tensor(layers, device=device)]
        held = (priority > float("-inf")).sum(-1)
        kept = protected.sum(-1)
        stream = self._streaming_slots(recent)
        wrong = streaming & (held > stream) & (kept != stream)
        if bool(wrong.any()):
            r, h = wrong.nonzero()[0].tolist()
            raise ValueError(
                f"allocation 'duo': a streaming head keeps recent + sinks = {stream} slots, but row {r}, head {h} "
                f"protects {int(kept[r, h])}: set allocation.sinks to the n of the policy's sinks reservation"
            )
        guaranteed = torch.maximum(kept, torch.minimum(share, held))
        return share_the_rest(priority, guaranteed, priority.shape[1] * inp.budget)
