"""``Stage``: what every stage is (a frozen pydantic model named by ``type``, with one abstract
method in its kind), the one list of stage kinds, and the names a policy stores its stages'
state under (``state_field_names``)."""

from __future__ import annotations

import hashlib
import json
from abc import ABC
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal, get_args

import torch
from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from ..documents import refuse_lax_scalar
from .data_file import DataFile
from .model_facts import Fact, ModelFacts

if TYPE_CHECKING:
    from ..schedule import Schedule
    from .inputs import EvictionInput
    from .state import StateField


#: The kinds of stage. This is the one list of them: ``STAGE_KINDS``, ``STAGE_BASES`` (below), the
#: registry's tables, the JSON schema and ``kvpolicy policies`` all follow it, in this order.
StageKind = Literal["scorer", "reservation", "selector", "allocation", "merge"]
STAGE_KINDS: tuple[StageKind, ...] = get_args(StageKind)


class Stage(BaseModel, ABC):
    """Base of every stage: a frozen pydantic model named by ``type`` in policy files."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _strict_scalars(cls, value: Any, info: ValidationInfo) -> Any:
        return refuse_lax_scalar(cls, info.field_name, value)

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
    #: False when the stage never reads ``inp.values`` (nor passes them on): where no stage of a
    #: policy reads them, an engine may skip gathering them and pass a ``meta`` tensor of their
    #: shape (``Policy.reads_values``); reading it raises. True by default, so a stage that does
    #: not say is always given real values.
    reads_values: ClassVar[bool] = True
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
        first, each object once. What a stage declares (``stochastic``, ``reads_queries``, ``reads_values``,
        ``couples_heads``, ``combines_heads``, ``key_page_sizes``, ``needs_model``, ``state_fields``,
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
    def combines_heads(self) -> bool:
        """True when the stage combines the KV heads of a row slot by slot (``shared_heads``, TOVA's
        ``current_attention``), so every head must hold the same tokens at each eviction
        (``EvictionInput.require_same_tokens_in_every_head``): an evicting policy holding it is
        refused at load unless its scorer, reservations, selector and allocation are ``heads_alike``."""
        return False

    @property
    def heads_alike(self) -> bool:
        """Whether, given KV heads that hold the same tokens, the stage's result is the same in every
        head (a shared score; slots chosen by position or by alike scores; counts alike): False
        for a stage that chooses per head (per-head draws, fixed per-head shares). Default True;
        a scorer's default is False (one score per head)."""
        return True

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
