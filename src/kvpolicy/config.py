"""Policy files: pydantic models, YAML loading, and errors that point at file, line and field."""

from __future__ import annotations

from collections.abc import Mapping
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .schedule import Schedule
from .stages.spec import ReservationSpec, ScorerSpec, SelectorSpec


class PolicyError(ValueError):
    """A policy that cannot be loaded: each problem names where it is (file:line) and the field."""

    def __init__(self, problems: list[str], source: str = "<policy>") -> None:
        self.problems = problems
        self.source = source
        lines = "\n".join(f"  {p}" for p in problems)
        super().__init__(f"invalid policy {source}:\n{lines}")


class PolicyConfig(BaseModel):
    """A policy as data: its schedule and its stages (scorer -> reservations -> selector)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(..., min_length=1)
    description: str = ""
    reference: str = Field("", description="Paper or code the policy reproduces.")
    seed: int | None = Field(0, description="Seed of stochastic stages when no generator is given.")
    schedule: Schedule
    scorer: ScorerSpec | None = None
    reservations: list[ReservationSpec] = Field(default_factory=list)
    selector: SelectorSpec

    @model_validator(mode="after")
    def _check_composition(self) -> PolicyConfig:
        sched = self.schedule
        reserved = sum(r.reserved_count(sched.budget) for r in self.reservations)
        if sched.recent + reserved > sched.budget:
            raise ValueError(
                f"the policy protects more slots than the budget holds: recent {sched.recent} + "
                f"reserved {reserved} > budget {sched.budget}"
            )
        if self.selector.needs_scores:
            if self.scorer is None:
                raise ValueError(f"selector {self.selector.type_name!r} ranks by score but the policy has no scorer")
        elif sched.recent + reserved != sched.budget:
            raise ValueError(
                f"selector {self.selector.type_name!r} keeps the protected slots only, so recent "
                f"({sched.recent}) + reserved ({reserved}) must equal the budget ({sched.budget})"
            )
        if self.selector.type_name == "stochastic" and self.scorer is not None and self.scorer.may_be_negative:
            raise ValueError("the stochastic selector samples in proportion to scores that must be non-negative")
        for stage in [self.scorer, *self.reservations, self.selector]:
            if stage is not None:
                stage.validate_schedule(sched)
        return self

    def to_dict(self) -> dict[str, Any]:
        """The resolved policy, as a policy file would write it."""
        return {
            "name": self.name,
            "description": self.description,
            "reference": self.reference,
            "seed": self.seed,
            "schedule": self.schedule.model_dump(),
            "scorer": None if self.scorer is None else self.scorer.describe(),
            "reservations": [r.describe() for r in self.reservations],
            "selector": self.selector.describe(),
        }

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


SCHEDULE_KEYS = frozenset(Schedule.model_fields)
TOP_KEYS = frozenset({"name", "seed", "description"})


def apply_overrides(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Return ``data`` with ``budget=...``-style overrides applied to the schedule or top level."""
    out = dict(data)
    schedule = dict(out.get("schedule") or {})
    for key, value in overrides.items():
        if key in SCHEDULE_KEYS:
            schedule[key] = value
        elif key in TOP_KEYS:
            out[key] = value
        else:
            allowed = ", ".join(sorted(SCHEDULE_KEYS | TOP_KEYS))
            raise PolicyError([f"unknown override {key!r}; allowed: {allowed}"], "overrides")
    out["schedule"] = schedule
    return out


def parse_policy(data: Any, source: str = "<policy>", lines: dict[tuple, int] | None = None) -> PolicyConfig:
    """Validate a policy mapping, turning pydantic errors into one ``PolicyError``."""
    if not isinstance(data, Mapping):
        raise PolicyError([f"a policy file holds a mapping, got {type(data).__name__}"], source)
    try:
        return PolicyConfig.model_validate(dict(data))
    except ValidationError as exc:
        raise PolicyError([_format_error(err, lines or {}) for err in exc.errors()], source) from None


def read_policy_text(text: str, source: str) -> tuple[Any, dict[tuple, int]]:
    """Parse YAML text; return the data and the 1-based line of every mapping key path."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise PolicyError([f"{where}not valid YAML: {getattr(exc, 'problem', exc)}"], source) from None
    lines: dict[tuple, int] = {}
    if node is not None:
        _index_lines(node, (), lines)
    return data, lines


def read_source(source: str | Path | Traversable) -> tuple[str, str]:
    """Text and display name of a policy file."""
    name = str(source)
    try:
        return source.read_text(encoding="utf-8"), name  # type: ignore[union-attr]
    except AttributeError:
        path = Path(source)
        if not path.is_file():
            raise PolicyError([f"no such policy file: {path}"], name) from None
        return path.read_text(encoding="utf-8"), name


def _index_lines(node: yaml.Node, path: tuple, out: dict[tuple, int]) -> None:
    out.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            child = (*path, key.value)
            out[child] = key.start_mark.line + 1
            _index_lines(value, child, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _index_lines(item, (*path, i), out)


def _format_error(err: Mapping[str, Any], lines: dict[tuple, int]) -> str:
    loc = tuple(p for p in err.get("loc", ()) if p not in ("function-after",))
    # The deepest path that the YAML file itself has gives the line.
    line = None
    for cut in range(len(loc), -1, -1):
        key = tuple(str(p) if not isinstance(p, int) else p for p in loc[:cut])
        if key in lines:
            line = lines[key]
            break
    field = ".".join(str(p) for p in loc) or "(policy)"
    msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    where = f"line {line}: " if line is not None else ""
    return f"{where}{field}: {msg}"
