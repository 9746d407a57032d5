"""Policy files: the pydantic model of a policy, overrides, and validation with errors that point
at file, line and field.

Reading the YAML (and ``PolicyError``) is ``kvpolicy.documents``'s job; ``load_config`` is the one
way from a document (text, file, mapping) to a validated ``PolicyConfig``.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from . import documents
from .documents import PolicyError, read_policy_text, read_source, refuse_lax_scalar
from .schedule import Schedule
from .stages.base import declared_for
from .stages.merge_drop import DropMerge
from .stages.spec import AllocationSpec, MergeSpec, ReservationSpec, ScorerSpec, SelectorSpec
from .stages.uniform import UniformAllocation
from .tiers.config import RecallConfig

if sys.version_info >= (3, 11):
    from importlib.resources.abc import Traversable
else:  # Python 3.10 has it in importlib.abc only
    from importlib.abc import Traversable

#: Longest ``summary``: a few words; `kvpolicy policies` cuts what its line cannot hold.
SUMMARY_MAX = 60

#: Largest ``seed``: seeds travel as int64 tensors (per layer and row), so they must fit one.
SEED_MAX = 2**63 - 1


class PolicyConfig(BaseModel):
    """A policy as data: its schedule and its stages (scorer -> reservations -> selector)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _strict_scalars(cls, value: Any, info: ValidationInfo) -> Any:
        return refuse_lax_scalar(cls, info.field_name, value)

    name: str = Field(..., min_length=1)
    description: str = ""
    summary: str = Field(
        "",
        max_length=SUMMARY_MAX,
        description=f"A few words on one line (at most {SUMMARY_MAX} characters) for `kvpolicy policies`; "
        "default: the description's first clause.",
    )
    reference: str = Field("", description="Paper or code the policy reproduces.")
    seed: int | None = Field(
        0,
        ge=0,
        le=SEED_MAX,
        description="Seed of stochastic stages: an int in [0, 2**63 - 1] (it keys every row's "
        "random streams), or null for fresh OS randomness.",
    )
    mode: Literal["evict", "select"] = Field(
        "evict",
        description="evict: keep `budget` slots and free the rest (on the schedule). select: keep every "
        "token and let each decode step attend only `budget` slots per KV head, chosen by the same "
        "stages (recomputed every `interval` steps, reused between).",
    )
    schedule: Schedule
    scorer: ScorerSpec | None = None
    reservations: list[ReservationSpec] = Field(default_factory=list)
    selector: SelectorSpec
    allocation: AllocationSpec = Field(
        default_factory=UniformAllocation,
        description="How the total budget (layers x KV heads x budget) is shared among layers and heads "
        "(default: uniform, every layer and head keeps `budget`).",
    )
    merge: MergeSpec = Field(
        default_factory=DropMerge,
        description="What becomes of the tokens an eviction drops (default: drop; cam, similar, d2o fold their "
        "values into kept slots' values, never keys, never changing how many slots are kept).",
    )
    recall: RecallConfig | None = Field(
        None,
        description="Two tiers: evicted tokens go, in pages, to a slow tier, and the best pages come back into a "
        "recall buffer that attention reads beside the kept slots (budget, page_size, interval, scorer, "
        "capacity, drop). Evict mode only.",
    )

    @field_validator("summary")
    @classmethod
    def _one_line(cls, summary: str) -> str:
        if summary and summary.splitlines() != [summary]:
            raise ValueError("one line only, without line breaks")
        return summary

    @model_validator(mode="after")
    def _check_composition(self) -> PolicyConfig:
        sched = self.schedule
        if self.mode == "select" and self.merge.merges:
            raise ValueError(
                f"merge {self.merge.type_name!r} folds evicted tokens into kept values, but select mode evicts "
                "nothing (every token is kept and each step only attends some): use merge: drop, or mode: evict"
            )
        if self.mode == "select" and sched.compress_prompt:
            raise ValueError("compress_prompt evicts the prompt: it has no meaning in select mode")
        if self.mode == "select" and self.allocation.per_head and sched.recent < 1:
            raise ValueError(
                f"allocation {self.allocation.type_name!r} in select mode needs schedule.recent >= 1: a head "
                "may choose few slots, and the recent buffer keeps each head attending its newest token"
            )
        if self.selector.sets_counts and self.allocation.per_head:
            raise ValueError(
                f"selector: {self.selector.type_name!r} sets each head's count, and allocation "
                f"{self.allocation.type_name!r} shares the layer's slots among its heads: use one or the other"
            )
        if self.mode == "select" and self.selector.sets_counts and sched.recent < 1:
            raise ValueError(
                f"selector {self.selector.type_name!r} in select mode needs schedule.recent >= 1: a head "
                "may choose few slots, and the recent buffer keeps each head attending its newest token"
            )
        if sched.evict_above is not None and not self.selector.sets_counts:
            raise ValueError(
                f"schedule.evict_above is for a selector that sets each head's count (threshold): selector "
                f"{self.selector.type_name!r} keeps the budget, so eviction below it would free nothing"
            )
        if self.selector.needs_scores and self.scorer is None:
            raise ValueError(f"selector {self.selector.type_name!r} ranks by score but the policy has no scorer")
        if self.selector.type_name == "stochastic" and self.scorer is not None and self.scorer.may_be_negative:
            raise ValueError("the stochastic selector samples in proportion to scores that must be non-negative")
        page = None if self.scorer is None else self.scorer.choice_page_size
        if page is not None:
            self._check_page_choice(page)
        readers = self.query_readers()
        if readers and sched.window < 1:
            raise ValueError(
                f"schedule.window is {sched.window}, but {' and '.join(readers)} "
                f"{'reads' if len(readers) == 1 else 'read'} the window's queries: set schedule.window to "
                "at least 1"
            )
        self.check_schedule(sched)
        self._check_heads_alike()
        if self.recall is not None:
            self.recall.check_policy(self.mode, sched, self.allocation, self.selector, self.merge)
            self._check_whole_pages(sched, self.recall.page_size)
        return self

    def check_schedule(self, sched: Schedule) -> None:
        """Raise ``ValueError`` naming the field if the stages cannot run under ``sched``: the
        policy's schedule at load, and each layer's own where layers keep different budgets
        (``Policy.layer_schedules``), so every budget is checked once it is known."""
        reserved = sum(r.reserved_beside(sched.budget, sched.recent) for r in self.reservations)
        if sched.recent + reserved > sched.budget:
            raise ValueError(
                f"the policy protects more slots than the budget holds: recent {sched.recent} + "
                f"reserved {reserved} > budget {sched.budget}"
            )
        if self.selector.sets_counts:  # the budget is each head's pool: the counts must fit it
            self.selector.check_pool(sched.budget, sched.recent + reserved)
        if not self.selector.needs_scores and sched.recent + reserved != sched.budget:
            raise ValueError(
                f"selector {self.selector.type_name!r} keeps the protected slots only, so recent "
                f"({sched.recent}) + reserved ({reserved}) must equal the budget ({sched.budget})"
            )
        for stage in [self.scorer, *self.reservations, self.selector, self.merge]:
            for s in stage.walk() if stage is not None else ():  # nested stages checked too
                s.validate_schedule(sched)

    def _check_heads_alike(self) -> None:
        """A stage that combines the KV heads slot by slot (``Stage.combines_heads``) needs every head
        to hold the same tokens at each eviction, so an evicting policy must choose alike in every
        head: where a stage is known to choose per head, the heads would differ after the first
        eviction and the next would be refused. (Select mode evicts nothing: every head holds every token.)"""
        stages = (self.scorer, *self.reservations, self.selector)
        combining = [s for stage in stages if stage is not None for s in stage.walk() if s.combines_heads]
        if self.mode != "evict" or not combining:
            return
        roles = [*([("scorer", self.scorer)] if self.selector.needs_scores else []),
                 *((f"reservations[{i}]", r) for i, r in enumerate(self.reservations)),
                 ("selector", self.selector), ("allocation", self.allocation)]
        apart = [f"{role} {stage.type_name!r}" for role, stage in roles if stage is not None and not stage.heads_alike]
        if apart:
            raise ValueError(
                f"{combining[0].kind} {combining[0].type_name!r} combines the KV heads slot by slot, so every head "
                f"must keep the same tokens, but {apart[0]} decides per head: the heads would hold different tokens "
                "after the first eviction; share its scores too (shared_heads), or drop the stage that combines them"
            )

    def _check_whole_pages(self, sched: Schedule, page: int) -> None:
        """A two-tier policy whose eviction ranks pages of the recall's size (ArkVale's design: one
        page is what is evicted, summarised and recalled) keeps whole pages only when the slots it
        keeps by rank, ``budget - recent``, are whole pages: otherwise every eviction keeps part of
        one page, and the slow tier's pages mix tokens that never were one page."""
        evicting = [s for stage in [self.scorer, *self.reservations] if stage is not None for s in stage.walk()]
        ranking = [s.type_name for s in evicting if page in s.key_page_sizes]
        ranked = sched.budget - sched.recent
        if ranking and ranked % page:
            raise ValueError(
                f"schedule.budget {sched.budget} - schedule.recent {sched.recent} = {ranked} is not whole pages of "
                f"recall.page_size {page}, which {ranking[0]!r} ranks the slots by: each eviction would keep part of "
                f"a page and send the rest to the slow tier as a page of its own; make budget - recent a multiple "
                f"of {page} (e.g. budget {sched.recent + -(-ranked // page) * page})"
            )

    def _check_page_choice(self, page: int) -> None:
        """A scorer that chooses whole pages (``Scorer.choice_page_size``) does so only where select
        mode chooses directly: a selector that ranks by the score, no reservation, one count per head."""
        assert self.scorer is not None
        why = f"scorer {self.scorer.type_name!r} chooses whole pages of {page} slots (granularity: page)"
        selector = type(self.selector)
        if self.mode != "select":
            raise ValueError(f"{why}, which only select mode does: set mode: select, or scorer.granularity: slot")
        if self.reservations:
            raise ValueError(f"{why}: reservations cannot protect slots of a page choice; remove them or set "
                             "scorer.granularity: slot")
        if not (selector.priority_is_score and declared_for(selector, "priority_is_score", "priority")):
            raise ValueError(f"{why}, ranked by their score: selector {self.selector.type_name!r} does not rank by "
                             "the score (use greedy, or scorer.granularity: slot)")
        if self.allocation.per_head:
            raise ValueError(f"{why}: allocation {self.allocation.type_name!r} gives heads different counts; use "
                             "scorer.granularity: slot")

    def query_readers(self) -> list[str]:
        """The stages that read the window of queries (``Stage.reads_queries``), as
        ``"scorer 'current_attention'"``, ``"reservations[1] 'top_scores'"``, ..."""
        roles = [("scorer", self.scorer), *((f"reservations[{i}]", r) for i, r in enumerate(self.reservations)),
                 ("selector", self.selector)]
        return [f"{role} {stage.type_name!r}" for role, stage in roles
                if stage is not None and any(s.reads_queries for s in stage.walk())]

    def to_dict(self) -> dict[str, Any]:
        """The resolved policy, as a policy file would write it."""
        data = {
            "name": self.name,
            "description": self.description,
            **({"summary": self.summary} if self.summary else {}),  # files without it keep their form
            "reference": self.reference,
            "seed": self.seed,
            "mode": self.mode,
            # evict_above is written only where set: files without it keep their form
            "schedule": self.schedule.model_dump(exclude={"evict_above"} if self.schedule.evict_above is None else None),
            "scorer": None if self.scorer is None else self.scorer.describe(),
            "reservations": [r.describe() for r in self.reservations],
            "selector": self.selector.describe(),
        }
        if self.allocation.uneven:  # uniform is the default: files without the field keep their form
            data["allocation"] = self.allocation.describe()
        if self.merge.merges:  # drop is the default: files without the field keep their form
            data["merge"] = self.merge.describe()
        if self.recall is not None:
            data["recall"] = {**self.recall.model_dump(exclude={"scorer"}), "scorer": self.recall.scorer.describe()}
        return data

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


SCHEDULE_KEYS = frozenset(Schedule.model_fields)
TOP_KEYS = frozenset({"name", "seed", "description", "mode"})


def apply_overrides(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Return ``data`` with ``budget=...``-style overrides applied to the schedule or top level."""
    out = dict(data)
    schedule = out.get("schedule")
    if schedule is None:
        schedule = {}
    elif isinstance(schedule, Schedule):
        schedule = schedule.model_dump()
    elif isinstance(schedule, Mapping):
        schedule = dict(schedule)
    elif any(key in SCHEDULE_KEYS for key in overrides):
        keys = ", ".join(sorted(k for k in overrides if k in SCHEDULE_KEYS))
        raise PolicyError(
            [f"schedule: cannot override {keys}: the schedule is not a mapping (got {type(schedule).__name__})"],
            "overrides",
        )
    for key, value in overrides.items():
        if key in SCHEDULE_KEYS:
            schedule[key] = value
        elif key in TOP_KEYS:
            out[key] = value
        else:
            allowed = ", ".join(sorted(SCHEDULE_KEYS | TOP_KEYS))
            raise PolicyError([f"unknown override {key!r}; allowed: {allowed}"], "overrides")
    if isinstance(schedule, dict):
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
    except RecursionError:
        raise PolicyError(["the policy is nested too deeply"], source) from None
    except (TypeError, ArithmeticError) as exc:
        # A stage validator that trips over a value of an unexpected kind (a plugin's, say):
        # still a bad document. The original error stays attached as the cause.
        raise PolicyError([f"invalid value: {type(exc).__name__}: {exc}"], source) from exc


def load_config(
    document: PolicyConfig | Mapping[str, Any] | str | bytes | bytearray | os.PathLike | Traversable,
    overrides: Mapping[str, Any] | None = None,
    *,
    name: str | None = None,
) -> tuple[PolicyConfig, Any]:
    """Validate a policy document, with ``overrides`` applied: ``(config, data)``, ``data`` the
    mapping the config was validated from (overrides re-apply to it later).

    ``document`` is a ``PolicyConfig``, a mapping (the policy as data), YAML text (a ``str``, or
    ``bytes`` in UTF-8) or a policy file (an ``os.PathLike`` or an ``importlib.resources``
    ``Traversable``). ``name`` names it in errors (default: ``<mapping>``, ``<bytes>``,
    ``<text>``, the file's path). Anything wrong with it is a ``PolicyError``.
    """
    lines: dict[tuple, int] = {}
    if isinstance(document, PolicyConfig):
        document = document.to_dict()
    if isinstance(document, Mapping):
        data: Any = dict(document)
        name = name or "<mapping>"
    else:
        text: str | bytes
        if isinstance(document, (bytes, bytearray)):
            text, name = bytes(document), name or "<bytes>"
        elif isinstance(document, str):
            text, name = document, name or "<text>"
        else:
            text, name = read_source(Path(document) if isinstance(document, os.PathLike) else document, name)
        data, lines = read_policy_text(text, name)
    if overrides and isinstance(data, Mapping):
        document, data = data, apply_overrides(data, overrides)
        try:
            return parse_policy(data, name, lines), data
        except PolicyError as exc:
            raise _blame_overrides(exc, document, overrides, name, lines) from None
    return parse_policy(data, name, lines), data


def _blame_overrides(
    exc: PolicyError, document: Mapping[str, Any], overrides: Mapping[str, Any], name: str, lines: dict[tuple, int]
) -> PolicyError:
    """``exc`` with each problem the document alone does not have put on the overrides: its line is
    the file's (``budget: 1024``), not the overriding value's."""
    try:
        parse_policy(document, name, lines)
        own: set[str] = set()
    except PolicyError as alone:
        own = set(alone.problems)
    said = "override " + ", ".join(f"{key}={value!r}" for key, value in overrides.items())
    return PolicyError(
        [p if p in own else f"{said}: {re.sub(r'^line [0-9]+: ', '', p)}" for p in exc.problems], name
    )



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


#: Moved to ``kvpolicy.documents`` (with ``PolicyError``, ``read_policy_text`` and
#: ``read_source``, which this module still uses and so still has).
_MOVED_TO_DOCUMENTS = ("MAX_YAML_DEPTH", "decode_policy_bytes", "load_yaml")


def __getattr__(name: str) -> Any:
    if name in _MOVED_TO_DOCUMENTS:
        warnings.warn(f"kvpolicy.config.{name} moved to kvpolicy.documents.{name}", DeprecationWarning, stacklevel=2)
        return getattr(documents, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
