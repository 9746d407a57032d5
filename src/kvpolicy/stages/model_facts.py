"""Facts about the model a cache serves, for stages that need more than the cached tensors.

Most stages read only keys, values and queries. Some methods need the model itself: Expected
Attention and TriAttention carry query statistics to future positions through RoPE (and take
post-RoPE keys back to before it), CriticalKV weighs each value by its norm through the output
projection. ``ModelFacts`` is what a stage may ask of the model, in a general form: its shape,
the RoPE of any position, and a layer's output projection. A stage declares the facts it reads
(``Stage.needs_model``); a policy whose stages need a fact the cache was not given is refused
before any work (``Policy.check_model_facts``), naming the fact and why it is missing.

Where facts come from: ``KVPolicyCache(policy, model)`` builds them from the transformers model
(``kvpolicy.hf.facts.model_facts``); an ``EvictingCache`` in a loop of your own takes
``model_facts=``, and ``Policy.select`` ``model=``; ``ModelFacts.standard_rope`` builds the RoPE of
a plain (Llama-style) rotary embedding from its base.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch

from ..documents import PolicyError
from .fingerprint import ModelFingerprint, measure_fingerprint

#: The facts a stage may declare in ``Stage.needs_model``.
Fact = Literal["rope", "output_projection"]
FACTS: tuple[Fact, ...] = get_args(Fact)

RopeFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
ProjectionFn = Callable[[int], torch.Tensor]


class ModelFactsError(ValueError):
    """Model facts that are malformed, or that a stage asked for and the cache does not have."""


@dataclass(frozen=True)
class ModelFacts:
    """What a stage may ask of the model it serves (``EvictionInput.model``; None where unknown).

    Attributes:
        name: the model's name (a Hugging Face id or folder), for messages and calibration files.
        num_layers, num_attention_heads, num_kv_heads, head_dim, hidden_size: its shape.
        rope_fn: ``positions`` (a long tensor of any shape) -> ``(cos, sin)``, each
            ``[*positions.shape, head_dim]`` float32: the model's rotary embedding at those positions,
            attention scaling included, in the rotate-half convention (dimension ``i`` pairs with
            ``i + head_dim / 2``; ``post = pre * cos + rotate_half(pre) * sin``). None: unknown.
        output_projection_fn: ``layer`` -> ``[held query heads, head_dim, hidden_size]``: the
            slice of the layer's output projection that each query head's attention output is
            multiplied by (``o_proj.weight.T`` split by head), in the model's dtype and device,
            for the query heads of the KV heads held (every head, unless sharded). None: unknown.
        missing: why a fact is unknown, by fact (reported when a stage needs it).
        kv_head_offset, kv_heads_held: the KV heads whose output projection these facts hold,
            ``kv_head_offset .. kv_head_offset + kv_heads_held - 1`` among the model's (with
            their query heads). A tensor-parallel rank holds its own heads' shard of ``o_proj``
            only: exactly what a per-head value norm of its heads needs. ``kv_heads_held`` None:
            every head from ``kv_head_offset`` on. The shape fields above stay the whole model's.
        fingerprint: what identifies the model (``kvpolicy.stages.fingerprint``), where the
            facts were given it rather than the RoPE and output projection it is measured from
            (vLLM's engine core, from its workers). Read through ``model_fingerprint``.

    Read through ``rope`` and ``output_projection`` (or ``output_projection_heads``), which check
    what the functions return.
    """

    name: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int | None = None
    rope_fn: RopeFn | None = None
    output_projection_fn: ProjectionFn | None = None
    missing: Mapping[str, str] = field(default_factory=dict)
    kv_head_offset: int = 0
    kv_heads_held: int | None = None
    fingerprint: ModelFingerprint | None = None

    def __post_init__(self) -> None:
        for label in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, label)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModelFactsError(f"ModelFacts.{label} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ModelFactsError(
                f"ModelFacts.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ModelFactsError(f"ModelFacts.head_dim must be even (RoPE pairs dimensions), got {self.head_dim}")
        if self.output_projection_fn is not None and not self.hidden_size:
            raise ModelFactsError("ModelFacts.hidden_size is required with an output projection")
        offset, held = self.kv_head_offset, self.kv_heads_held
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < self.num_kv_heads:
            raise ModelFactsError(
                f"ModelFacts.kv_head_offset must be an int in [0, num_kv_heads = {self.num_kv_heads}), got {offset!r}"
            )
        if held is not None and (isinstance(held, bool) or not isinstance(held, int) or held < 1
                                 or offset + held > self.num_kv_heads):
            raise ModelFactsError(
                f"ModelFacts.kv_heads_held must be a positive int with kv_head_offset + kv_heads_held <= "
                f"num_kv_heads ({offset} + {held!r} > {self.num_kv_heads}?)"
            )

    @property
    def available(self) -> frozenset[str]:
        """The facts these can give (``FACTS`` with a function)."""
        have = {"rope": self.rope_fn, "output_projection": self.output_projection_fn}
        return frozenset(name for name, fn in have.items() if fn is not None)

    def why_missing(self, fact: str) -> str:
        return self.missing.get(fact, "not given")

    def model_fingerprint(self) -> tuple[ModelFingerprint | None, str | None]:
        """``(fingerprint, None)`` of the model (or of a tensor-parallel rank's heads): the one
        given, else measured from the RoPE and output projection; ``(None, why)`` where the
        model cannot give one (a reason recorded in ``missing`` for ``fingerprint``, ``rope``
        or ``output_projection``); ``(None, None)`` where it is not known yet (facts of a
        configuration alone, as vLLM's front end has before any worker loads the weights)."""
        if self.fingerprint is not None:
            return self.fingerprint, None
        if {"rope", "output_projection"} <= self.available:
            try:
                return measure_fingerprint(self), None
            except ValueError as exc:
                return None, str(exc)
        for fact in ("fingerprint", "output_projection", "rope"):
            if fact in self.missing:
                return None, f"its {fact.replace('_', ' ')} is unknown ({self.missing[fact]})"
        return None, None

    @property
    def group_size(self) -> int:
        return self.num_attention_heads // self.num_kv_heads

    @property
    def held_kv_heads(self) -> range:
        """The model's KV heads whose output projection these facts hold."""
        end = self.num_kv_heads if self.kv_heads_held is None else self.kv_head_offset + self.kv_heads_held
        return range(self.kv_head_offset, end)

    def check_heads(self, head_offset: int, kv_heads: int, q_heads: int | None = None) -> None:
        """Raise ``ModelFactsError`` unless a cache of the model's KV heads ``head_offset ..
        head_offset + kv_heads - 1`` (with ``q_heads`` query heads; None: not checked) can read
        these facts: the heads exist, have the model's query-head group, and their output
        projection is held (when the facts give one)."""
        end = head_offset + kv_heads
        if head_offset < 0 or kv_heads < 1 or end > self.num_kv_heads or (
                q_heads is not None and q_heads != kv_heads * self.group_size):
            raise ModelFactsError(
                f"KV heads {head_offset} .. {end - 1}{'' if q_heads is None else f' with {q_heads} query heads'} "
                f"were given, but the model facts of {self.name!r} have {self.num_kv_heads} KV heads with "
                f"{self.group_size} query heads each"
            )
        held = self.held_kv_heads
        if self.output_projection_fn is not None and (head_offset < held.start or end > held.stop):
            raise ModelFactsError(
                f"model facts of {self.name!r} hold the output projection of KV heads {held.start} .. "
                f"{held.stop - 1} (a tensor-parallel shard), not of heads {head_offset} .. {end - 1}: build "
                "the facts on the rank that holds them"
            )

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[*positions.shape, head_dim]`` float32 on ``positions``' device (see
        ``rope_fn``). Negative positions are allowed (a rotation backwards)."""
        if self.rope_fn is None:
            raise ModelFactsError(f"model facts of {self.name!r} have no RoPE: {self.why_missing('rope')}")
        if not isinstance(positions, torch.Tensor) or positions.is_floating_point() or positions.is_complex():
            raise ModelFactsError(f"rope(positions) takes an integer tensor, got {positions!r}")
        cos, sin = self.rope_fn(positions)
        want = (*positions.shape, self.head_dim)
        for label, t in (("cos", cos), ("sin", sin)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
                raise ModelFactsError(
                    f"model facts of {self.name!r}: rope gave {label} of shape {tuple(getattr(t, 'shape', ()))}, "
                    f"expected [*positions.shape, head_dim] = {want}"
                )
        return cos.to(torch.float32, copy=False), sin.to(torch.float32, copy=False)

    def output_projection(self, layer: int) -> torch.Tensor:
        """``[query heads held, head_dim, hidden_size]``: layer ``layer``'s output projection,
        split by query head (see ``output_projection_fn``): every query head of the model unless
        the facts are a shard (``held_kv_heads``)."""
        if self.output_projection_fn is None:
            raise ModelFactsError(
                f"model facts of {self.name!r} have no output projection: {self.why_missing('output_projection')}"
            )
        if not 0 <= layer < self.num_layers:
            raise ModelFactsError(f"layer {layer} out of range for a model of {self.num_layers} layers")
        w = self.output_projection_fn(layer)
        want = (len(self.held_kv_heads) * self.group_size, self.head_dim, self.hidden_size)
        if not isinstance(w, torch.Tensor) or tuple(w.shape) != want:
            raise ModelFactsError(
                f"model facts of {self.name!r}: output_projection({layer}) has shape "
                f"{tuple(getattr(w, 'shape', ()))}, expected [query heads held, head_dim, hidden] = {want}"
            )
        return w

    def output_projection_heads(self, layer: int, head_offset: int, kv_heads: int) -> torch.Tensor:
        """``[kv_heads * group_size, head_dim, hidden_size]``: the output projection of the query
        heads of the model's KV heads ``head_offset .. head_offset + kv_heads - 1`` (a cache's own
        heads, ``EvictionInput.head_offset``), which the facts must hold (``check_heads``)."""
        self.check_heads(head_offset, kv_heads)
        first = (head_offset - self.kv_head_offset) * self.group_size
        return self.output_projection(layer)[first : first + kv_heads * self.group_size]

    def check_shape(self, num_layers: int | None = None, num_kv_heads: int | None = None,
                    head_dim: int | None = None) -> None:
        """Raise ``ModelFactsError`` unless the facts describe a model of this shape (None: not checked)."""
        for label, given in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if given is not None and getattr(self, label) != given:
                raise ModelFactsError(
                    f"model facts of {self.name!r} give {label} = {getattr(self, label)}, but the cache serves "
                    f"{given}: were the facts built for another model?"
                )

    @staticmethod
    def standard_rope(head_dim: int, theta: float = 10000.0, attention_scaling: float = 1.0) -> RopeFn:
        """The ``rope_fn`` of a plain rotary embedding (Llama, Qwen, SmolLM2 without rope scaling):
        frequencies ``theta ** (-2i / head_dim)``, angles computed in float64."""
        if head_dim < 2 or head_dim % 2:
            raise ModelFactsError(f"head_dim must be even and positive, got {head_dim}")
        inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)

        def rope(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            angles = positions.to(torch.float64)[..., None] * inv_freq.to(positions.device)
            angles = torch.cat([angles, angles], dim=-1)
            return (angles.cos() * attention_scaling).float(), (angles.sin() * attention_scaling).float()

        return rope


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[-x2, x1]`` for ``x = [x1, x2]`` along the last axis: RoPE's rotate-half convention."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` rotated by ``(cos, sin)`` (``ModelFacts.rope``): ``x * cos + rotate_half(x) * sin``."""
    return x * cos + rotate_half(x) * sin


def unrotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The pre-RoPE vector of post-RoPE ``x`` at the positions of ``(cos, sin)``: the inverse of
    ``apply_rope``, attention scaling divided out (``cos^2 + sin^2`` is its square)."""
    return (x * cos - rotate_half(x) * sin) / (cos * cos + sin * sin)


def check_model_facts(
    stages: Sequence[Any], facts: ModelFacts | None, policy_name: str, *, num_layers: int | None = None,
    num_kv_heads: int | None = None, head_dim: int | None = None, head_offset: int | None = None,
    q_heads: int | None = None,
) -> None:
    """``Policy.check_model_facts``: refuse ``facts`` that cannot serve a policy whose ``stages``
    (every one, nested ones included: ``kvpolicy.stages.Stage``) read them, naming the stage and
    the missing fact or the field at fault (``PolicyError``). With ``head_offset``, the cache
    holds the model's KV heads ``head_offset ..`` (``num_kv_heads`` of them, ``q_heads`` query
    heads: a tensor-parallel shard), checked by ``ModelFacts.check_heads``; without it,
    ``num_kv_heads`` is the model's."""
    needed = frozenset().union(*(s.needs_model for s in stages))
    if not needed:
        return
    readers = {f: [s.type_name for s in stages if f in s.needs_model] for f in sorted(needed)}
    if facts is None:
        raise PolicyError(
            [f"stage {', '.join(r)} needs the model's {f}" for f, r in readers.items()]
            + ["no model facts were given: build KVPolicyCache with the model (not its config), pass "
               "model_facts= to EvictingCache or model= to Policy.select (kvpolicy.ModelFacts)"],
            policy_name,
        )
    if not isinstance(facts, ModelFacts):
        raise TypeError(f"model facts must be a kvpolicy.ModelFacts, got {type(facts).__name__}")
    missing = lacking(stages, facts.name, {f: facts.why_missing(f) for f in readers if f not in facts.available})
    if missing:
        raise PolicyError(missing, policy_name)
    try:
        if head_offset is None:
            facts.check_shape(num_layers, num_kv_heads, head_dim)
        else:
            facts.check_shape(num_layers, None, head_dim)
            facts.check_heads(head_offset, len(facts.held_kv_heads) if num_kv_heads is None else num_kv_heads, q_heads)
    except ValueError as exc:
        raise PolicyError([f"model facts: {exc}"], policy_name) from None
    problems = stage_problems(stages, facts)
    if problems:
        raise PolicyError(problems, policy_name)


def lacking(stages: Sequence[Any], model_name: str, missing: Mapping[str, str]) -> list[str]:
    """One problem per fact in ``missing`` (fact -> why the model cannot give it) that a stage
    reads, naming the stages."""
    readers = {f: [s.type_name for s in stages if f in s.needs_model] for f in sorted(missing)}
    return [f"stage {', '.join(r)} needs the model's {f}, which the model facts of {model_name!r} lack: {missing[f]}"
            for f, r in readers.items() if r]


def stage_problems(stages: Sequence[Any], facts: ModelFacts) -> list[str]:
    """What each stage that reads the model says against the model ``facts`` describe
    (``Stage.check_model_facts``: a calibration file for another model), by stage; the shape
    and name suffice, so an engine can ask before it has loaded the model."""
    problems = []
    for stage in stages:
        if stage.needs_model:
            try:
                stage.check_model_facts(facts)
            except ValueError as exc:
                problems.append(f"{stage.kind} {stage.type_name!r}: {exc}")
    return problems
