"""Pydantic field types for stages written as ``{type: NAME, ...params}`` in policy files.

A field typed ``ScorerSpec`` accepts either a built stage or such a mapping (or a bare ``NAME``),
which is built by the registry, so plugin stages nest anywhere a built-in one can.

Stages are the ground floor: nothing under ``kvpolicy.stages`` imports the registry, which sits
above them (it lists the built-in stages). The registry hands its builder down instead:
``kvpolicy.registry`` calls ``set_stage_builder`` when it is imported, and ``import kvpolicy``
(which runs before any of its submodules) imports it, so the builder is in place before any policy
or stage is validated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BeforeValidator, PlainSerializer

from .base import Allocation, Merge, Reservation, Scorer, Selector, Stage, StageKind

#: Builds a stage of a kind from ``{type: NAME, ...}`` or ``NAME``: ``Registry.build_stage`` of
#: the process-wide registry, once ``kvpolicy.registry`` is imported.
StageBuilder = Callable[[StageKind, Any], Stage]
_build_stage: StageBuilder | None = None


def set_stage_builder(build: StageBuilder) -> None:
    """Make ``build`` turn nested ``{type: NAME, ...}`` specs into stages (``kvpolicy.registry``
    calls it at import; nothing else needs to)."""
    global _build_stage
    _build_stage = build


def _builder(kind: StageKind, cls: type[Stage]):
    def build(value: Any) -> Any:
        if isinstance(value, cls):
            return value
        if _build_stage is None:  # never after `import kvpolicy`
            raise RuntimeError(f"cannot build the {kind} {value!r}: no stage builder (import kvpolicy.registry)")
        return _build_stage(kind, value)

    return build


def _describe(stage: Stage) -> dict:
    return stage.describe()


ScorerSpec = Annotated[Scorer, BeforeValidator(_builder("scorer", Scorer)), PlainSerializer(_describe)]
ReservationSpec = Annotated[
    Reservation, BeforeValidator(_builder("reservation", Reservation)), PlainSerializer(_describe)
]
SelectorSpec = Annotated[Selector, BeforeValidator(_builder("selector", Selector)), PlainSerializer(_describe)]
AllocationSpec = Annotated[
    Allocation, BeforeValidator(_builder("allocation", Allocation)), PlainSerializer(_describe)
]
MergeSpec = Annotated[Merge, BeforeValidator(_builder("merge", Merge)), PlainSerializer(_describe)]
