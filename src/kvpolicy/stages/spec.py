"""Pydantic field types for stages written as ``{type: NAME, ...params}`` in policy files.

A field typed ``ScorerSpec`` accepts either a built stage or such a mapping, which is resolved
through the registry, so plugin stages nest anywhere a built-in one can.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, PlainSerializer

from .base import Allocation, Reservation, Scorer, Selector, Stage, StageKind


def _builder(kind: StageKind, cls: type[Stage]):
    def build(value: Any) -> Any:
        if isinstance(value, cls):
            return value
        from ..registry import get_registry  # late: the registry imports the built-in stages

        return get_registry().build_stage(kind, value)

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
