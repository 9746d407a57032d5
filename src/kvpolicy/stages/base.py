"""The five kinds of stage and the input they all read.

A stage is a small, frozen pydantic model: its fields are its hyperparameters (validated, with the
published defaults), and it has exactly one abstract method. Stages are pure tensor functions over
``[B, Hkv, N]``: they never loop over rows or heads, never touch a model, and never move cache
memory (the executor does that).
"""

from __future__ import annotations

import hashlib
import json
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, get_args

import torch
from pydantic import BaseModel, ConfigDict

from .. import seeds
from ..documents import PolicyError
from .model_facts import Fact, ModelFacts

if TYPE_CHECKING:
    from ..schedule import Schedule
    from .recall import RecallInput

#: The kinds of stage. This is the one list of them: ``STAGE_KINDS``, ``STAGE_BASES`` (below), the
#: registry's tables, the JSON schema and ``kvpolicy policies`` all follow it, in this order.
StageKind = Literal["scorer", "reservation", "selector", "allocation", "merge"]
STAGE_KINDS: tuple[StageKind, ...] = get_args(StageKind)

#: Attributes of ``EvictionInput`` that plugin contract 1 (kvpolicy 0.1) had, and what replaced
#: them: reading one raises an ``AttributeError`` that says so, not a bare "no attribute".
REMOVED_INPUT_ATTRIBUTES = {
    "generator": "draw through the input's counter-based streams instead: inp.uniform(*shape, stream=NAME) "
    "and inp.normal(...) per row, inp.head_uniform(*shape, stream=NAME) and inp.head_normal(...) per KV head",
    "rows_per_layer": "rows of one call may come from different layers, and each row carries its own seeds: "
    "inp.layer_seed and inp.row_seed are [B]",
}


#: The dtypes a field with ``initial="position"`` may have: they hold ``-1`` (an empty slot) and
#: every position exactly (float32 up to ``2**24``, int32 up to ``2**31 - 1``, the others far beyond).
POSITION_DTYPES = (torch.int64, torch.int32, torch.float64, torch.float32)


@dataclass(frozen=True)
class StateField:
    """One field of state a stage keeps across evictions (``Stage.state_fields``).

    ``per="slot"``: one value per cached token, ``[B, Hkv, N]`` in the stage's input, carried
    with its token wherever the token's slot moves (compaction, padded rows, row reordering,
    per-head runs, select mode) and dropped with it. ``per="head"``: one value per row and KV
    head, ``[B, Hkv]`` (running statistics of a head). A new token (or a new row) starts at
    ``initial``:

    - a finite number, the same for every token (representable in ``dtype``: an integer within
      its range for an integer or bool dtype, within float range for a floating one);
    - ``"position"`` (plugin contract 4; per-slot fields only): the token's own position, the
      ``EvictionInput.positions`` value of its slot (what a field counting "since the token
      arrived" starts at, with no sentinel). An empty or padding slot (position ``-1``) holds
      ``-1``. Its ``dtype`` must hold every position exactly: ``POSITION_DTYPES`` (int64, int32,
      float64, or float32, exact up to ``2**24`` tokens); float16, bfloat16, bool, unsigned and
      narrower integer dtypes are refused, as is ``per="head"`` (a head has no position).

    Every store makes fresh values with ``initial_values`` (per slot) or ``initial_head_values``
    (per head), never from ``initial`` directly.
    """

    dtype: torch.dtype = torch.float32
    initial: float | Literal["position"] = 0.0
    per: Literal["slot", "head"] = "slot"

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, torch.dtype) or self.dtype.is_complex:
            raise TypeError(f"StateField.dtype must be a real torch dtype, got {self.dtype!r}")
        if self.per not in ("slot", "head"):
            raise ValueError(f'StateField.per must be "slot" or "head", got {self.per!r}')
        if isinstance(self.initial, str):
            if self.initial != "position":
                raise ValueError(f'StateField.initial must be a finite number or "position", got {self.initial!r}')
            if self.per != "slot":
                raise ValueError(
                    'StateField(initial="position") is for per-slot fields only (a token\'s own position); '
                    'a per="head" field has no position: give it a constant initial'
                )
            if self.dtype not in POSITION_DTYPES:
                raise ValueError(
                    f'StateField(initial="position") needs a dtype that holds every position and -1 exactly '
                    f"(torch.int64, torch.int32, torch.float64 or torch.float32), got {self.dtype}"
                )
            return
        if not isinstance(self.initial, (int, float)):
            raise TypeError(
                f'StateField.initial must be a finite number or "position", got {type(self.initial).__name__} '
                f"{self.initial!r}"
            )
        if not math.isfinite(self.initial):
            raise ValueError(f"StateField.initial must be finite, got {self.initial!r}")
        held = torch.tensor(float(self.initial), dtype=torch.float64).to(self.dtype)
        exact = self.dtype.is_floating_point or float(held) == self.initial
        if not exact or not bool(torch.isfinite(held)):
            raise ValueError(f"StateField.initial {self.initial!r} is not representable in its dtype {self.dtype}")

    def initial_values(self, positions: torch.Tensor) -> torch.Tensor:
        """Fresh values for slots holding the tokens at ``positions`` (a long tensor of any
        shape, ``[..., N]``; ``-1`` for an empty or padding slot): a new tensor of that shape, in
        ``dtype``, on ``positions``' device. A constant ``initial`` fills it; ``"position"``
        copies the positions (so an empty slot holds ``-1``). Every store of state calls it (or
        ``initial_head_values``) to make fresh state: buffers, new tokens, a fresh ``select``."""
        if self.initial == "position":
            return positions.to(self.dtype, copy=True)
        return torch.full(positions.shape, self.initial, dtype=self.dtype, device=positions.device)

    def initial_head_values(self, shape: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
        """Fresh values of a per-head field (``[..., B, Hkv]``, a new row's): ``initial`` everywhere."""
        if self.initial == "position":
            raise ValueError('a field with initial="position" starts per slot: use initial_values(positions)')
        return torch.full(tuple(shape), self.initial, dtype=self.dtype, device=device)


def state_field_names(stages: Mapping[str, Stage]) -> dict[str, tuple[str, str, StateField]]:
    """The name each field of state is stored under (``Policy.state_fields``): ``{stored name:
    (state_key, field, StateField)}``, from the stateful stages by ``state_key`` in file order
    (``Policy.stateful_stages``; equal stages, which share one state, are one entry).

    The names are what a cache stores and a user reads (``LayerView.state``,
    ``Policy.select(state=...)``, ``Policy.nest_state``); a stage reads its own fields by their
    own names (``inp.state_of(stage)``). They depend on the stage alone, not on its place among
    the policy's stages, so adding or removing another stage renames nothing:

    - a stage whose ``type_name`` no other stateful stage of the policy has stores field ``f``
      as ``"<type_name>.<f>"`` (H2O's ``"accumulated_attention.attention"``);
    - when stateful stages of one type with different hyperparameters (different ``state_key``)
      share a policy, each of them stores ``f`` as ``"<type_name>-<h>.<f>"``, ``h`` the first 8
      hex digits of the SHA-1 of its ``state_key`` (UTF-8): the same stage gets the same name in
      every policy that holds another one of its type.

    Raises:
        ValueError: two fields would share a name (two state keys of one type whose hashes
            begin alike, or a type named like another's hashed name): never for real policies.
    """
    per_type: dict[str, int] = {}
    for stage in stages.values():
        per_type[stage.type_name] = per_type.get(stage.type_name, 0) + 1
    names: dict[str, tuple[str, str, StateField]] = {}
    for key, stage in stages.items():
        prefix = stage.type_name
        if per_type[prefix] > 1:
            prefix = f"{prefix}-{hashlib.sha1(key.encode('utf-8')).hexdigest()[:8]}"
        for field, spec in stage.state_fields.items():
            name = f"{prefix}.{field}"
            if name in names:
                raise ValueError(f"two state fields of the policy would be stored as {name!r}: {names[name][0]} and {key}")
            names[name] = (key, field, spec)
    return names


def window_positions(query_valid: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``[B, W]`` long: the token index of each valid window entry (``query_valid [B, W]``, in
    time order) of rows that have seen ``tokens [B]`` real tokens, the last of which is the newest
    entry; ``-1`` for invalid entries. A window holds a row's latest real queries, so the entry
    with ``j`` valid ones after it is token ``tokens - 1 - j``."""
    later = query_valid.flip(-1).long().cumsum(-1).flip(-1)  # valid entries at or after each one
    return torch.where(query_valid, tokens.to(query_valid.device)[:, None] - later, -1)


@dataclass(frozen=True)
class EvictionInput:
    """Everything a stage may read for one eviction of one layer (or of a stack of equal layers).

    Shapes use ``B`` batch rows, ``Hkv`` KV heads, ``Hq = G * Hkv`` query heads, ``N`` cached slots,
    ``W`` window queries and ``D`` the head dimension.

    Attributes:
        keys: ``[B, Hkv, N, D]`` cached keys, after RoPE (and after ``k_norm`` on Qwen3).
        values: ``[B, Hkv, N, D]`` cached values.
        queries: ``[B, Hq, W, D]`` the window of most recent post-RoPE queries.
        budget: ``K = min(N, budget)``, the number of slots kept, protected ones included.
        num_candidates: ``C``; slots ``[0, C)`` are eviction candidates, slots ``[C, N)`` are the
            recent buffer, always kept and never scored.
        slot_valid: ``[B, Hkv, N]`` bool, False for padding slots (never kept while a valid one
            is not). Per head, since heads keep different slots after an eviction.
        query_valid: ``[B, W]`` bool, False for window entries that hold no real query yet.
        positions: ``[B, Hkv, N]`` long, the index of each slot's token among its row's real
            tokens (``-1`` for padding). Sinks are the slots at positions ``0 .. n-1``. Positions
            keep growing past ``N`` as tokens are evicted.
        seed_key: how the rows' random streams are keyed (``kvpolicy.seeds.SeedKey``; None: all 0).
            Stages read the seeds it derives, on first use:
        layer_seed: ``[B]`` int64, the fixed seed of each row's layer (the same at every
            eviction of that layer): for stages that draw once per layer and reuse it.
        row_seed: ``[B]`` int64, the seed of each row's current eviction: for stages that draw
            afresh at every eviction. Draw through ``uniform``/``normal`` below, never from a
            global generator: a row's draws then depend on that row alone (see ``kvpolicy.seeds``).
        head_offset: the model's index of the first KV head in ``keys`` (0 unless the heads are
            sharded: a tensor-parallel rank holds heads ``head_offset .. head_offset + Hkv - 1``).
            Per-head draws (``head_uniform``/``head_normal``) are keyed by the model's head, so a
            sharded run draws exactly what an unsharded one does.
        query_positions: ``[B, W]`` long, the token index of each window query among its row's
            real tokens (``-1`` where ``query_valid`` is False). Query ``w`` sees the slots whose
            position is at most ``query_positions[:, w]`` (causal attention). Always a tensor
            (plugin contract 4): an input built without it (None) gets, in ``__post_init__``,
            the window's valid entries as the row's latest real tokens, the newest at the
            row's largest slot position (``window_positions``), as ``eviction_input`` does.
        query_new: ``[B, W]`` bool, the window queries no stage's state has seen yet (those since
            the state was last brought up to date): what ``Stage.update_state`` adds. Always a
            tensor (plugin contract 4): built without it (None), every ``query_valid`` entry.
        state: every stateful stage's fields (``Stage.state_fields``), read with
            ``inp.state_of(stage)``. None when the policy keeps no state.
        model: facts about the model the cache serves (``ModelFacts``: its shape, the RoPE of
            any position, a layer's output projection), for stages that declare them in
            ``Stage.needs_model``; None where unknown (a policy needing them is then refused
            before any work). ``positions`` and ``query_positions`` are the RoPE positions when
            the model numbers its tokens among each row's real ones (what ``generate()`` does).
        prompt_lengths: ``[B]`` long on the keys' device, each row's prompt tokens (real ones):
            the slots whose ``positions`` are below it hold the prompt. A cache's prompt is its
            first step, vLLM's each request's own; ``Policy.select`` takes it as
            ``prompt_lengths=``. None where not given: read it through ``prompt_mask``, which
            refuses then, and declare ``Stage.needs_prompt`` so the policy is refused first.
    """

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    budget: int
    num_candidates: int
    slot_valid: torch.Tensor
    query_valid: torch.Tensor
    positions: torch.Tensor
    #: What keys the rows' random streams (None, as when a test builds an input by hand: all 0).
    seed_key: seeds.SeedKey | None = None
    #: ``{P: (min, max)}``, each ``[B, Hkv, ceil(N / P), D]``: the per-channel minimum and maximum
    #: of the keys of each page of ``P`` slots from slot 0, maintained by a cache that keeps every
    #: token (select mode) for the page sizes its stages ask for (``Stage.key_page_sizes``). A
    #: page's summary may cover slots past ``N`` that the cache holds; stages use only the pages
    #: that lie within the candidates and compute the rest from ``keys``. None: not maintained.
    key_pages: Mapping[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    head_offset: int = 0
    # Never None once built: None (the default, so that inputs built without them still build)
    # asks __post_init__ for the documented default. Typed as the tensors stages read.
    query_positions: torch.Tensor = None  # type: ignore[assignment]
    query_new: torch.Tensor = None  # type: ignore[assignment]
    state: Mapping[str, Mapping[str, torch.Tensor]] | None = None
    model: ModelFacts | None = None
    prompt_lengths: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # Frozen: fill the defaults the class docstring gives in place, once.
        if self.query_positions is None:
            b, n = self.positions.shape[0], self.positions.shape[-1]
            if n:
                # One index of each broadcast (stride 0) axis past the batch: select mode's
                # positions are an expanded arange, and flattening them would copy Hkv * N.
                pos = self.positions
                axes = [slice(0, 1) if pos.stride(a) == 0 else slice(None) for a in range(1, pos.dim())]
                pos = pos[tuple([slice(None), *axes])]
                newest = pos.flatten(1).amax(-1)
            else:
                newest = torch.full((b,), -1, dtype=torch.long, device=self.positions.device)
            object.__setattr__(self, "query_positions", window_positions(self.query_valid, newest + 1))
        if self.query_new is None:
            object.__setattr__(self, "query_new", self.query_valid)

    def state_of(self, stage: Stage) -> Mapping[str, torch.Tensor]:
        """``stage``'s state fields by name: ``[B, Hkv, N]`` per slot, ``[B, Hkv]`` per head (see
        ``StateField``). In ``Stage.update_state`` they hold the state before this eviction's
        new queries; in every other stage method, after them (the executor brings the state up
        to date before any stage scores)."""
        fields = None if self.state is None else self.state.get(stage.state_key)
        if fields is None:
            raise KeyError(
                f"{stage.kind} {stage.type_name!r} reads state this input does not carry: a stage with "
                "state_fields runs only where kvpolicy keeps its state (a cache, select mode, vLLM), or through "
                "Policy.select(..., state=...)"
            )
        return fields

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: explain the attributes contract 2 removed.
        hint = REMOVED_INPUT_ATTRIBUTES.get(name)
        if hint is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}", name=name, obj=self)
        raise AttributeError(
            f"EvictionInput.{name} was removed in kvpolicy 0.2 (plugin contract 2): {hint}. See the stage "
            "contract in docs/plugins.md and CHANGELOG.md",
            name=name, obj=self,
        )

    @property
    def layer_seed(self) -> torch.Tensor:
        """``[B]`` int64 on the keys' device (see the class docstring)."""
        return self._seed_key().layer.to(self.keys.device)

    @property
    def row_seed(self) -> torch.Tensor:
        """``[B]`` int64 on the keys' device (see the class docstring)."""
        return self._seed_key().row.to(self.keys.device)

    def _seed_key(self) -> seeds.SeedKey:
        if self.seed_key is None:
            object.__setattr__(self, "seed_key", seeds.SeedKey.zeros(self.keys.shape[0]))
        return self.seed_key  # type: ignore[return-value]

    def uniform(self, *shape: int, stream: str) -> torch.Tensor:
        """``[B, *shape]`` float32 in ``(0, 1)`` from each row's eviction seed, on the keys' device.

        ``stream`` names the draw (use the stage's ``type_name``), so two stages never share one.
        """
        return seeds.uniform(self.row_seed, shape, stream, self.keys.device)

    def normal(self, *shape: int, stream: str, per: Literal["eviction", "layer"] = "eviction") -> torch.Tensor:
        """``[B, *shape]`` float32 standard normal draws from each row's eviction seed, or from its
        layer seed (``per="layer"``: the same numbers at every eviction of the layer)."""
        seed = self.row_seed if per == "eviction" else self.layer_seed
        return seeds.normal(seed, shape, stream, self.keys.device)

    def head_uniform(self, *shape: int, stream: str) -> torch.Tensor:
        """``[B, Hkv, *shape]`` float32 in ``(0, 1)``: draws of their own for each KV head.

        Use it, not ``uniform(num_kv_heads, ...)``, for anything drawn per head: head ``h`` draws
        as the model's head ``head_offset + h``, so a tensor-parallel rank draws its heads' share
        of the unsharded draw (with ``head_offset`` 0 the two calls give the same numbers).
        """
        rest = math.prod(shape)
        full = (self.num_kv_heads, *shape)
        return seeds.uniform(self.row_seed, full, stream, self.keys.device, start=self.head_offset * rest)

    def head_normal(self, *shape: int, stream: str, per: Literal["eviction", "layer"] = "eviction") -> torch.Tensor:
        """``[B, Hkv, *shape]`` float32 standard normal draws per KV head (see ``head_uniform``)."""
        seed = self.row_seed if per == "eviction" else self.layer_seed
        rest = math.prod(shape)
        full = (self.num_kv_heads, *shape)
        return seeds.normal(seed, full, stream, self.keys.device, start=self.head_offset * rest)

    def prompt_mask(self, stage: Stage) -> torch.Tensor:
        """``[B, Hkv, N]`` bool: the valid slots holding a prompt token of their row (position
        below the row's ``prompt_lengths``), for ``stage`` (which declares ``needs_prompt``); a
        clear error where the input carries no prompt lengths."""
        if self.prompt_lengths is None:
            raise KeyError(
                f"{stage.kind} {stage.type_name!r} reads each row's prompt length, which this input does not "
                "carry: pass prompt_lengths= to Policy.select (caches and vLLM give it)"
            )
        lengths = self.prompt_lengths.to(self.positions.device)
        return self.slot_valid & (self.positions >= 0) & (self.positions < lengths[:, None, None])

    @property
    def layer_index(self) -> torch.Tensor:
        """``[B]`` long on the host: the model layer of each (stacked) row."""
        return self._seed_key().layer_idx

    def facts(self, stage: Stage) -> ModelFacts:
        """The model facts, for ``stage`` (which declares them in ``needs_model``); a clear error
        where the input carries none (``Policy.check_model_facts`` refuses such a policy before
        any work, so only a hand-built input reaches it)."""
        if self.model is None:
            raise KeyError(
                f"{stage.kind} {stage.type_name!r} reads model facts ({', '.join(sorted(stage.needs_model))}) this "
                "input does not carry: pass model_facts= to EvictingCache, model= to Policy.select, or build "
                "KVPolicyCache with the model"
            )
        return self.model

    def rows_by_layer(self) -> list[tuple[int, torch.Tensor]]:
        """``(layer, rows)`` for each model layer among the stacked rows (``rows``: a long tensor
        of row indices on the keys' device): for stages that read a per-layer fact."""
        layers = self.layer_index
        return [
            (int(layer), (layers == layer).nonzero().flatten().to(self.keys.device))
            for layer in torch.unique(layers).tolist()
        ]

    @property
    def batch(self) -> int:
        return self.keys.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[1]

    @property
    def num_slots(self) -> int:
        return self.keys.shape[2]

    @property
    def head_dim(self) -> int:
        return self.keys.shape[3]

    @property
    def group_size(self) -> int:
        return self.queries.shape[1] // self.keys.shape[1]

    @property
    def candidate_mask(self) -> torch.Tensor:
        """``[B, Hkv, N]`` bool: valid slots that are eviction candidates."""
        idx = torch.arange(self.num_slots, device=self.keys.device)
        return self.slot_valid & (idx < self.num_candidates)

    def require_same_tokens_in_every_head(self, stage: Stage) -> None:
        """Raise ``ValueError`` unless every KV head of each row holds the same tokens in the same
        slots (the same validity and positions): what a stage that combines the heads slot by
        slot needs, since slot ``j`` of two heads is otherwise two different tokens."""
        if self.num_kv_heads < 2:
            return
        valid = self.slot_valid
        pos = self.positions.masked_fill(~valid, -1)
        if bool((valid == valid[:, :1]).all()) and bool((pos == pos[:, :1]).all()):
            return
        raise ValueError(
            f"{stage.kind} {stage.type_name!r} combines the KV heads slot by slot, so every KV head of a row must "
            "hold the same tokens, but here they differ: a per-head allocation, or a stage that chose per head at "
            "an earlier eviction (a Range reservation, sampling), made them differ"
        )


@dataclass(frozen=True)
class DataFile:
    """Marks a stage field (``Annotated[str, DataFile("folder")]``) that names a data file: a path,
    or ``builtin:NAME`` for the file ``NAME`` shipped with kvpolicy in ``kvpolicy/policies/<folder>/``.
    An engine that takes policies from clients reads only built-in files for them (``Stage.data_files``:
    vLLM refuses a request whose policy names a file of the server)."""

    folder: str

    PREFIX: ClassVar[str] = "builtin:"

    def resolve(self, value: str, field: str = "") -> str:
        """The file ``value`` (of the stage field ``field``) names: itself, or for ``builtin:NAME``
        the file shipped with kvpolicy. Inside ``DataFile.builtin_only()`` a path is refused before
        anything reads it."""
        if not value.startswith(self.PREFIX):
            if _BUILTIN_ONLY.get():
                raise ValueError(f"{field + ': ' if field else ''}{value!r} is a file of this machine: only kvpolicy's built-in files "
                                 f"(builtin:NAME) may be named here")
            return value
        from importlib.resources import files

        return str(files("kvpolicy") / "policies" / self.folder / value.removeprefix(self.PREFIX))

    @classmethod
    def is_builtin(cls, value: str) -> bool:
        return value.startswith(cls.PREFIX)

    @staticmethod
    @contextmanager
    def builtin_only() -> Iterator[None]:
        """Policies loaded inside read built-in data files only (a policy a client sent)."""
        token = _BUILTIN_ONLY.set(True)
        try:
            yield
        finally:
            _BUILTIN_ONLY.reset(token)


_BUILTIN_ONLY: ContextVar[bool] = ContextVar("kvpolicy_builtin_data_files_only", default=False)


class Stage(BaseModel, ABC):
    """Base of every stage: a frozen pydantic model named by ``type`` in policy files."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: ClassVar[StageKind]
    type_name: ClassVar[str]
    #: True when the stage draws afresh at every eviction (``inp.uniform``, ``inp.normal``): its
    #: choice then depends on the seed as well as on the tensors. A stage whose draws are fixed
    #: per layer (``per="layer"``) is deterministic given the policy's seed and is not stochastic.
    stochastic: ClassVar[bool] = False
    #: True when the stage draws numbers fixed per layer (``inp.normal(..., per="layer")``):
    #: deterministic given a seed, but a policy with ``seed: null`` resolves a fresh seed at every
    #: ``select`` call (and for every cache), so ``Policy.stochastic`` then counts the stage.
    draws_per_layer: ClassVar[bool] = False
    #: True when the stage reads the window of queries (``inp.queries``): a policy using it needs
    #: ``schedule.window >= 1`` (refused at load otherwise), and ``select`` refuses queries with
    #: ``W = 0``. A window whose entries are all invalid (``query_valid`` False) is allowed.
    reads_queries: ClassVar[bool] = False
    #: The model facts the stage reads (``inp.model``; plugin contract 3): ``"rope"``,
    #: ``"output_projection"``. A policy using it is refused before any work where the cache
    #: cannot give them (``Policy.check_model_facts``). A nesting stage need not repeat its
    #: children's: the policy collects them from every stage, nested ones included.
    needs_model: ClassVar[frozenset[Fact]] = frozenset()
    #: True when the stage reads each row's prompt length (``inp.prompt_mask``): ``Policy.select``
    #: then refuses a call without ``prompt_lengths=`` before any work (caches and vLLM give it).
    needs_prompt: ClassVar[bool] = False

    def walk(self) -> Iterator[Stage]:
        """This stage, then every stage nested anywhere in its fields (a reservation's scorer, a
        combination's terms: stage-valued fields, lists of them, and models holding them), depth
        first, each object once. What a stage declares (``stochastic``, ``reads_queries``,
        ``couples_heads``, ``key_page_sizes``, ``needs_model``, ``state_fields``,
        ``validate_schedule``) is collected by the policy over every stage it walks, so a stage
        that nests others need not pass their declarations on."""
        seen: list[Stage] = []
        _walk(self, seen)
        return iter(seen)

    def describe(self) -> dict[str, Any]:
        """The stage as it appears in a resolved policy file."""
        data: dict[str, Any] = {"type": self.type_name}
        for name in type(self).model_fields:
            value = getattr(self, name)
            data[name] = value.describe() if isinstance(value, Stage) else _plain(value)
        return data

    def validate_schedule(self, schedule: Schedule) -> None:  # noqa: B027 - optional hook
        """Raise ``ValueError`` if the stage cannot run under this schedule (checked at load)."""

    def check_model_facts(self, facts: ModelFacts) -> None:  # noqa: B027 - optional hook
        """Raise ``ValueError`` naming the field if the stage cannot serve the model these facts
        describe (a calibration file measured on another model). Called before any work, by
        ``Policy.check_model_facts``, for stages that declare ``needs_model``."""

    @property
    def couples_heads(self) -> bool:
        """True when the result for one KV head depends on the other heads' tensors (a reduction
        over all query heads of the layer, as TOVA's): a shard of the heads (a tensor-parallel
        rank) cannot then choose alone, so such a policy is refused where heads are sharded."""
        return False

    @property
    def key_page_sizes(self) -> frozenset[int]:
        """Page sizes whose per-page key summaries the stage reads (``EvictionInput.key_pages``).
        A cache that keeps every token (select mode) maintains them as tokens arrive."""
        return frozenset()

    @property
    def data_files(self) -> dict[str, str]:
        """The data files this stage's own fields name (fields marked ``DataFile``), by field name,
        as written (``builtin:NAME`` or a path). ``Policy.data_files`` collects nested stages'."""
        return {name: getattr(self, name) for name, info in type(self).model_fields.items()
                if any(isinstance(m, DataFile) for m in info.metadata)}

    # -- state (plugin contract 3) ----------------------------------------------------------
    #: When ``update_state`` runs. ``"every_query"``: the state sees every query exactly once, in
    #: order (H2O's accumulated attention, LazyEviction's recurrences): at each eviction, with
    #: the window's unseen queries, and also before unseen queries would leave the window, and
    #: on a step longer than the window, as it is written. ``"eviction"``: once per eviction
    #: (or select-mode choice), with the window as it is then, every valid entry in
    #: ``query_new`` (G-KV's score smoothed across compressions).
    state_updates: ClassVar[Literal["every_query", "eviction"]] = "every_query"

    @property
    def state_fields(self) -> Mapping[str, StateField]:
        """Fields of state the stage keeps across evictions, by name (none: a stateless stage).

        kvpolicy stores them beside the keys and values, moves per-slot fields with their tokens
        everywhere slots move, counts them in ``memory_bytes()``, and calls ``update_state``
        whenever queries arrive that the state has not seen (at each eviction, before any stage
        scores; and before unseen queries would leave the window). The stage reads them with
        ``inp.state_of(self)``."""
        return {}

    def update_state(self, inp: EvictionInput) -> Mapping[str, torch.Tensor]:
        """The stage's state after the window queries ``inp.query_new`` (in time order, each
        seeing the slots at or before its position): every field of ``state_fields``, the shape
        and dtype it has in ``inp.state_of(self)``, finite. A pure function: kvpolicy checks the
        result (``kvpolicy.stages.guards.run_state_update``) and stores it only if the whole
        eviction succeeds, so a refused update leaves the cache as it was.

        Called with windows of any length (a long prompt arrives in chunks of queries), so the
        update must process queries in order and not assume one per step."""
        raise NotImplementedError(f"{self.kind} {self.type_name!r} declares state_fields but no update_state")

    @property
    def state_key(self) -> str:
        """What the stage's state is stored under: its type and hyperparameters, so two equal
        stages of one policy share one state (they would compute the same)."""
        return f"{self.type_name}:{json.dumps(self.describe(), sort_keys=True, default=str)}"


def _walk(stage: Stage, found: list[Stage]) -> None:
    if any(s is stage for s in found):
        return
    found.append(stage)
    _walk_fields(stage, found)


def _walk_fields(model: BaseModel, found: list[Stage]) -> None:
    for name in type(model).model_fields:
        value = getattr(model, name)
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, Stage):
                _walk(item, found)
            elif isinstance(item, BaseModel):
                _walk_fields(item, found)


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [v.describe() if isinstance(v, Stage) else _plain(v) for v in value]
    if isinstance(value, BaseModel):
        return {k: _plain(v) for k, v in value.model_dump().items()}
    return value


def declared_for(cls: type[Stage], declaration: str, method: str) -> bool:
    """Whether ``cls`` takes ``declaration`` from the class that gives it ``method`` or from one
    before it in its MRO (a subclass of it), so that it was made for that ``method``: a class
    that overrides ``method`` and inherits the declaration has not made it. (``Scorer`` itself
    defines ``score_packed``, None, and every scorer its own ``score``: a scorer that does not
    define ``score_packed`` is never asked.)"""
    mro = cls.__mro__
    owner = next(i for i, c in enumerate(mro) if declaration in c.__dict__)
    implementer = next(i for i, c in enumerate(mro) if method in c.__dict__)
    return owner <= implementer


class Scorer(Stage):
    """Scores every slot: higher means more worth keeping."""

    kind: ClassVar[StageKind] = "scorer"

    @abstractmethod
    def score(self, inp: EvictionInput) -> torch.Tensor:
        """Return ``[B, Hkv, N]`` float32 scores.

        Only the entries of valid candidate slots (``inp.candidate_mask``) are read by later
        stages; a scorer may put anything finite elsewhere. Checked at every call
        (``kvpolicy.stages.guards.run_scorer``): a result of another shape (``[B, N]`` is never
        broadcast), not floating or on another device, or NaN/inf on a valid candidate, is a
        ``SelectionError`` naming the scorer. The inputs are finite when a policy calls it, so
        compute in float32 (not float16, which overflows near 65504) and mind float32's range.
        """

    @property
    def may_be_negative(self) -> bool:
        """Whether scores can be negative (a sampling selector needs non-negative weights)."""
        return False

    def score_packed(self, inp: EvictionInput) -> torch.Tensor | None:
        """``score(inp)`` on select mode's packed rows, computed faster, or None (the default)
        to decline: a scorer that defines it declares that select mode may choose directly
        (``kvpolicy.selection.choose_directly``).

        Return ``[B, Hkv, N]`` float32 scores equal to ``score(inp)``'s on every candidate slot
        ``[0, C)`` (entries past ``C`` are not read), or None for an input it cannot score
        faster. Called only under a selector whose priority is the score
        (``Selector.priority_is_score``: greedy) and no reservation, on a cache's packed rows:
        every slot is valid (``slot_valid`` all True, ``positions`` ``0 .. N-1``, every head
        holding the same tokens) and every key, value and query was checked finite as it
        entered the cache, so masks, padding and those checks can be skipped. The state of a
        stateful scorer is up to date, as for ``score``.

        kvpolicy ranks these scores with the very call ``Policy.select`` ranks its priorities
        with (``kvpolicy.policy.keep_top``), ``+inf`` on the recent buffer: equal scores keep
        the slots the full pipeline keeps, ties included. Checked at every call
        (``kvpolicy.stages.guards.run_packed_scorer``) as ``score`` is: another shape, dtype or
        device, or NaN/inf on a candidate, is a ``SelectionError`` naming the scorer.

        Define it on the class that defines ``score``: a subclass that overrides ``score``
        without overriding ``score_packed`` is not asked (its promise was made for another
        score).
        """
        return None

    @property
    def choice_page_size(self) -> int | None:
        """``P`` when the scorer declares a *page choice* in select mode, else None (the default).

        A scorer that declares one is ranked by whole pages of ``P`` slots from slot 0, never by
        slot: at each choice select mode takes the ``k`` best whole candidate pages by
        ``score_pages`` and attends them together with the tail ``[(C // P) * P, N)`` (the
        candidates' last, short page and the recent buffer), where ``k`` is what fits the budget
        after the tail (``kvpolicy.selection.page_plan``). Such a policy is select mode only,
        with a selector whose priority is the score, no reservation and no per-head allocation
        (refused at load otherwise, naming the field), and ``Policy.select`` refuses it (it
        ranks slots; ``kvpolicy.selection.choose_pages`` is the page choice)."""
        return None

    def score_pages(self, inp: EvictionInput) -> torch.Tensor:
        """``[B, Hkv, C // P]`` float32: the score of each whole candidate page (``P`` =
        ``choice_page_size``), for select mode's page choice; higher is more worth attending.

        Called on a cache's packed rows only (as ``score_packed``: every slot valid, every key,
        value and query checked finite as it entered the cache). Checked at every call
        (``kvpolicy.stages.guards.run_page_scorer``): another shape, dtype or device, or NaN/inf,
        is a ``SelectionError`` naming the scorer."""
        raise NotImplementedError(f"scorer {self.type_name!r} declares choice_page_size but no score_pages")

    #: The page summaries (``kvpolicy.stages.recall.SUMMARIES``) this scorer reads when it ranks a
    #: slow tier's pages as a recall scorer (``PolicyConfig.recall``); empty, the default: it
    #: cannot serve as one (refused at load, naming ``recall.scorer``).
    recall_summaries: ClassVar[frozenset[str]] = frozenset()

    def score_summaries(self, inp: RecallInput) -> torch.Tensor:
        """``[B, Hkv, Np]`` float32: each slow-tier page's score from its summaries alone
        (``inp.summaries``, the kinds ``recall_summaries`` declares); higher is recalled first.
        Entries of empty page slots (``inp.page_valid`` False) are never read. Checked at every
        call (``kvpolicy.stages.guards.run_recall_scorer``): another shape, dtype or device, or
        NaN/inf on a page, is a ``SelectionError`` naming the scorer."""
        raise NotImplementedError(f"scorer {self.type_name!r} declares recall_summaries but no score_summaries")


class Reservation(Stage):
    """Protects slots before the selector runs; protected slots are always kept.

    Keeping them all is only possible while they fit in the budget, so the number of protected
    slots is checked twice (a violation is a ``SelectionError`` naming the stage):

    - at load, where the count is knowable: ``recent + sum(reserved_count(budget)) <= budget``
      over the policy's reservations;
    - at every eviction (``kvpolicy.stages.guards.run_reservation``): the protected slots of each row
      and head, recent buffer and earlier reservations included, must not exceed the budget,
      and a stage that overrides ``reserved_count`` must not add more candidate slots than it
      declares.

    A stage whose count depends on the sequence (every 16th position, say) grows with it and
    fails at run time once the budget is exceeded: bound it (protect at most ``n`` slots) and
    declare the bound.
    """

    kind: ClassVar[StageKind] = "reservation"

    @abstractmethod
    def reserve(self, inp: EvictionInput, protected: torch.Tensor) -> torch.Tensor:
        """Return the ``[B, Hkv, N]`` bool mask of slots this stage protects.

        ``protected`` is what earlier stages (and the recent buffer) already protect; the result
        is OR-ed into it by the executor. Another shape or dtype than ``[B, Hkv, N]`` bool is an
        error naming the stage.
        """

    def reserved_count(self, budget: int) -> int:
        """Upper bound, at ``budget``, of the candidate slots (slots ``[0, C)``) this stage adds to
        the protected ones in any row and head: ``load_policy`` checks ``recent + sum of the
        bounds <= budget``, and every eviction checks that the stage keeps to its bound.

        Override it whenever the bound is known (``sinks``: ``n``; ``top_scores``: its ``n``).
        The default declares nothing: it counts as 0 at load, and the stage is then only
        checked at run time against the budget itself (``kvpolicy.stages.guards.declared_count`` is
        None for it).
        """
        return 0

    def prompt_refusal(self, prompt_len: int, room: int) -> str | None:
        """Why a request whose prompt has ``prompt_len`` tokens cannot be served, where ``room``
        slots of the budget are left beside the recent buffer and the other reservations'
        declared counts (None, the default: it can). An engine that admits requests asks it up
        front (``Policy.prompt_refusal``) instead of failing at an eviction."""
        return None


class Selector(Stage):
    """Ranks the unprotected candidates; the executor keeps the top of the ranking."""

    kind: ClassVar[StageKind] = "selector"
    #: False for selectors that keep protected slots only and never read a score.
    needs_scores: ClassVar[bool] = True
    #: True when ``priority`` returns the scores themselves, unchanged, on every eligible slot
    #: (greedy): the policy then keeps the top-scoring candidates, and select mode may choose
    #: them directly from a scorer's ``Scorer.score_packed``. Set it on the class that
    #: defines ``priority``: a subclass that overrides ``priority`` without setting it again is
    #: not taken at its word.
    priority_is_score: ClassVar[bool] = False

    @abstractmethod
    def priority(self, scores: torch.Tensor | None, inp: EvictionInput) -> torch.Tensor:
        """Return ``[B, Hkv, N]`` float32 keys: the executor keeps protected slots, then the
        unprotected valid candidates with the largest keys until ``inp.budget`` slots are kept.
        """

    #: True when the selector decides how many slots each head keeps (``head_counts``: a score
    #: threshold), instead of every head keeping ``inp.budget``. The policy then runs per head,
    #: as under a per-head allocation (``Policy.per_head``): each head keeps its count of the
    #: highest priorities, at most the budget (the pool each head's slots are sized by), and the
    #: per-head layout holds the uneven counts. It cannot be combined with a per-head allocation.
    sets_counts: ClassVar[bool] = False

    def head_counts(self, priority: torch.Tensor, protected: torch.Tensor, inp: EvictionInput) -> torch.Tensor:
        """``[B, Hkv]`` long: slots each head keeps (``sets_counts`` selectors only), its protected
        ones included, from the policy's ``priority [B, Hkv, N]`` (``+inf`` protected, ``-inf`` not
        eligible, the clamped priorities elsewhere). Each count must lie between the head's
        protected slots and ``min(inp.budget, its valid slots)`` (checked by
        ``kvpolicy.stages.guards.run_selector_counts``); the counts need not add up to anything."""
        raise NotImplementedError(f"selector {self.type_name!r} does not set per-head counts")

    def check_pool(self, budget: int, protected: int) -> None:  # noqa: B027 - optional hook
        """Raise ``ValueError`` naming the field when a ``sets_counts`` selector cannot keep its
        promises with ``budget`` slots per head of which ``protected`` (recent buffer and
        declared reservations) are always kept. Called at load, before any work."""


class Allocation(Stage):
    """Shares a policy's total budget (``layers x KV heads x budget`` slots) among layers and heads.

    Two questions, asked at two times:

    - ``layer_budgets`` once, when a cache learns the model's shape: each layer's budget, the
      mean number of slots its heads keep after an eviction (it sizes that layer's buffers and
      drives its schedule). They must add up to ``num_layers * budget``.
    - ``head_counts`` at every eviction, only for stages with ``per_head = True``: how many of
      the layer's ``Hkv * budget`` slots each KV head keeps. The executor then keeps, per head,
      that many slots of the highest priority (protected slots first).

    The default shares evenly (the ``uniform`` stage): every layer and head keeps ``budget``.
    """

    kind: ClassVar[StageKind] = "allocation"
    #: True when heads of one layer keep different numbers of slots (``head_counts`` is called).
    per_head: ClassVar[bool] = False
    #: True when the layer budgets are decided from the prompt (``prompt_budgets``), once every
    #: layer holds it, before the first eviction (CAKE); ``layer_budgets`` then gives the
    #: provisional ones, and each layer gets buffers of its own. Evict mode only.
    from_prompt: ClassVar[bool] = False
    #: False for a ``per_head`` stage that shares each layer's own ``budget`` among its heads,
    #: every layer keeping the same (Ada-KV); True when ``layer_budgets`` may differ by layer
    #: (a paged engine then gives every layer blocks of its own: vLLM's KV-cache group per layer).
    layer_budgets_differ: ClassVar[bool] = True

    @property
    def uneven(self) -> bool:
        """Whether layers or heads may hold different budgets (vLLM cannot free such memory)."""
        return True

    def layer_budgets(self, budget: int, num_layers: int, recent: int) -> list[int]:
        """Each layer's budget (mean slots per head), ``num_layers`` ints adding up to
        ``num_layers * budget`` (``recent``: the schedule's recent buffer, which every layer
        keeps). Raise ``ValueError`` naming the field for an impossible share."""
        return [budget] * num_layers

    def prompt_budgets(self, budget: int, recent: int, inputs: Sequence[EvictionInput]) -> list[int]:
        """``from_prompt`` allocations: each layer's budget from what it holds before its first
        eviction (``inputs[l]``: layer ``l``'s slots and window, every row), ints above ``recent``
        adding up to ``len(inputs) * budget``."""
        raise NotImplementedError(f"allocation {self.type_name!r} does not decide its budgets from the prompt")

    def check_model(self, num_layers: int, num_kv_heads: int) -> None:  # noqa: B027 - optional hook
        """Raise ``ValueError`` if the stage cannot serve a model of this shape (a profile for
        another model, a per-layer list of the wrong length). Called before any work."""

    def head_counts(self, priority: torch.Tensor, protected: torch.Tensor, inp: EvictionInput) -> torch.Tensor:
        """``[B, Hkv]`` long: slots each head keeps (``per_head`` stages only).

        ``priority [B, Hkv, N]`` float32 ranks slots within a head (``+inf``: protected,
        ``-inf``: not eligible, padding included); ``protected [B, Hkv, N]`` bool. Each row's
        counts must add up to ``Hkv * inp.budget``, and each head's count must lie between its
        protected slots and its valid ones (``kvpolicy.stages.guards.run_allocation`` checks it).
        """
        raise NotImplementedError(f"allocation {self.type_name!r} does not share slots per head")

    def head_cap(self, budget: int, num_kv_heads: int) -> int | None:
        """``per_head`` stages: the most slots one KV head of a layer can keep at an eviction,
        whatever the data, with ``budget`` per head on average (a paged engine reserves this much
        room per request: vLLM). None: no such bound is known (vLLM then refuses the policy)."""
        return None

    def layer_head_cap(self, layer: int, layer_budget: int, num_kv_heads: int, recent: int) -> int | None:
        """``head_cap`` for layer ``layer``, which keeps ``layer_budget`` per head on average
        (``recent``: the schedule's recent buffer), where the bound differs by layer (a head
        profile's retrieval heads). The default: ``head_cap``, the same rule in every layer."""
        return self.head_cap(layer_budget, num_kv_heads)



    def layer_schedules(
        self, schedule: Schedule, reservations: Sequence[Any], num_layers: int, num_kv_heads: int | None,
        policy_name: str,
    ) -> list[Schedule]:
        """``Policy.layer_schedules``: each layer's schedule (its ``budget`` the layer's) for a
        policy of ``schedule`` and ``reservations`` under this allocation, or a ``PolicyError``
        naming the ``allocation`` field when it cannot serve this model or leaves a layer no
        candidate after its protected slots."""
        try:
            self.check_model(num_layers, num_kv_heads if num_kv_heads is not None else 0)
            budgets = self.layer_budgets(schedule.budget, num_layers, schedule.recent)
        except ValueError as exc:
            raise PolicyError([f"allocation: {exc}"], policy_name) from None
        if len(budgets) != num_layers or sum(budgets) != num_layers * schedule.budget:
            raise PolicyError(
                [f"allocation {self.type_name!r} gave {len(budgets)} layer budgets adding up to {sum(budgets)}; "
                 f"{num_layers} adding up to {num_layers * schedule.budget} were due"],
                policy_name,
            )
        schedules: dict[int, Schedule] = {}
        for layer, budget in enumerate(budgets):
            if budget in schedules:
                continue
            protected = schedule.recent + sum(r.reserved_count(budget) for r in reservations)
            if budget <= schedule.recent or protected > budget:
                raise PolicyError(
                    [f"allocation: layer {layer} gets a budget of {budget} slots, which leaves no candidate "
                     f"after its {protected} protected slots (recent {schedule.recent} and reservations): "
                     "raise the budget or flatten the allocation"],
                    policy_name,
                )
            schedules[budget] = schedule.model_copy(update={"budget": budget})
        return [schedules[b] for b in budgets]


@dataclass(frozen=True)
class MergeResult:
    """What a merge stage returns (``Merge.merge``).

    ``values [B, Hkv, N, Dv]``: the new value of every slot, in any floating dtype; only the kept
    slots' entries are read (kvpolicy casts them to the cache's dtype and writes them in place of
    the kept slots' values). ``state``: the stage's own state fields after the merge, by field
    name, as ``update_state`` returns them (empty for a stateless merge)."""

    values: torch.Tensor
    state: Mapping[str, torch.Tensor]


class Merge(Stage):
    """What becomes of the slots an eviction drops: folded into the values of kept slots.

    It runs once per eviction, after the kept set is chosen, on the same ``EvictionInput`` (state
    brought up to date). It never changes which slots are kept or how many (memory is unchanged),
    and it never changes a key: keys carry their position's RoPE rotation, and a mixture of keys
    rotated for different positions is no key of any position. The default, ``drop``, merges
    nothing and leaves every policy as it was without merging.

    A merge keeps its own state in ``state_fields`` (per-slot weights, moved with their slots)
    and returns it in ``MergeResult.state``. A merge that reads a scorer's state (``cam`` reads
    accumulated attention) nests that scorer as a stage-valued field (``ScorerSpec``) and reads
    ``inp.state_of(nested)``: the policy keeps every nested stage's state, and equal stages share
    one (``Stage.state_key``), so where the policy's scorer equals the nested one the merge reads
    the scorer's state and it is accumulated once.
    """

    kind: ClassVar[StageKind] = "merge"
    #: False for ``drop``: the eviction core then skips the stage (no values are written).
    merges: ClassVar[bool] = True

    @abstractmethod
    def merge(self, inp: EvictionInput, keep: torch.Tensor) -> MergeResult:
        """The merged values of the kept slots, ``keep [B, Hkv, N]`` bool (the eviction's kept set,
        every head's own). Slots ``keep`` leaves out (valid ones: ``inp.slot_valid``) are what the
        eviction drops; padding slots are neither kept nor merged. Checked at every call
        (``kvpolicy.stages.guards.run_merge``): another shape, a non-floating dtype, another device,
        or NaN/inf on a kept slot is a ``SelectionError`` naming the stage."""


#: The base class of each kind of stage, in ``STAGE_KINDS`` order.
STAGE_BASES: dict[StageKind, type[Stage]] = {
    base.kind: base for base in (Scorer, Reservation, Selector, Allocation, Merge)
}
