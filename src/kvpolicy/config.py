"""Policy files: pydantic models, YAML loading, and errors that point at file, line and field."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .schedule import Schedule
from .stages.spec import AllocationSpec, ReservationSpec, ScorerSpec, SelectorSpec
from .stages.uniform import UniformAllocation

if sys.version_info >= (3, 11):
    from importlib.resources.abc import Traversable
else:  # Python 3.10 has it in importlib.abc only
    from importlib.abc import Traversable


class PolicyError(ValueError):
    """A policy that cannot be loaded: each problem names where it is (file:line) and the field.

    Each problem is one line (whitespace runs, newlines included, are collapsed), so that the
    command line can print it as ``FILE:LINE: field: problem``.
    """

    def __init__(self, problems: list[str], source: str = "<policy>") -> None:
        self.problems = [" ".join(str(p).split()) for p in problems]
        self.source = source
        problems = self.problems
        lines = "\n".join(f"  {p}" for p in problems)
        super().__init__(f"invalid policy {source}:\n{lines}")


#: Largest ``seed``: seeds travel as int64 tensors (per layer and row), so they must fit one.
SEED_MAX = 2**63 - 1
#: Deepest nesting of mappings and lists a policy file may have (real ones nest under 20 levels;
#: the bound keeps the YAML composer and the line index far from Python's recursion limit).
MAX_YAML_DEPTH = 64


class PolicyConfig(BaseModel):
    """A policy as data: its schedule and its stages (scorer -> reservations -> selector)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(..., min_length=1)
    description: str = ""
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

    @model_validator(mode="after")
    def _check_composition(self) -> PolicyConfig:
        sched = self.schedule
        if self.mode == "select" and sched.compress_prompt:
            raise ValueError("compress_prompt evicts the prompt: it has no meaning in select mode")
        if self.mode == "select" and self.allocation.per_head and sched.recent < 1:
            raise ValueError(
                f"allocation {self.allocation.type_name!r} in select mode needs schedule.recent >= 1: a head "
                "may choose few slots, and the recent buffer keeps each head attending its newest token"
            )
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
        readers = self.query_readers()
        if readers and sched.window < 1:
            raise ValueError(
                f"schedule.window is {sched.window}, but {' and '.join(readers)} "
                f"{'reads' if len(readers) == 1 else 'read'} the window's queries: set schedule.window to "
                "at least 1"
            )
        for stage in [self.scorer, *self.reservations, self.selector]:
            if stage is not None:
                stage.validate_schedule(sched)
        return self

    def query_readers(self) -> list[str]:
        """The stages that read the window of queries (``Stage.reads_queries``), as
        ``"scorer 'current_attention'"``, ``"reservations[1] 'top_scores'"``, ..."""
        roles = [("scorer", self.scorer), *((f"reservations[{i}]", r) for i, r in enumerate(self.reservations)),
                 ("selector", self.selector)]
        return [f"{role} {stage.type_name!r}" for role, stage in roles if stage is not None and stage.reads_queries]

    def to_dict(self) -> dict[str, Any]:
        """The resolved policy, as a policy file would write it."""
        data = {
            "name": self.name,
            "description": self.description,
            "reference": self.reference,
            "seed": self.seed,
            "mode": self.mode,
            "schedule": self.schedule.model_dump(),
            "scorer": None if self.scorer is None else self.scorer.describe(),
            "reservations": [r.describe() for r in self.reservations],
            "selector": self.selector.describe(),
        }
        if self.allocation.uneven:  # uniform is the default: files without the field keep their form
            data["allocation"] = self.allocation.describe()
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
        data = apply_overrides(data, overrides)
    return parse_policy(data, name, lines), data



def read_policy_text(text: str | bytes, source: str) -> tuple[Any, dict[tuple, int]]:
    """Parse YAML text (``bytes``: UTF-8); return the data and the 1-based line of every mapping key path.

    Policy files are plain YAML with three restrictions, each reported as a ``PolicyError`` that
    names the line: no anchors or aliases (``&name``, ``*name``: a policy has no use for them,
    and refusing them rules out recursive documents and "billion laughs" alias bombs), no
    duplicate keys in a mapping (YAML would silently keep the last one), and no nesting deeper
    than ``MAX_YAML_DEPTH`` levels. Scalars that cannot be constructed (an integer of more than
    4,300 digits, an impossible date) are errors too.
    """
    if isinstance(text, (bytes, bytearray)):
        text = decode_policy_bytes(bytes(text), source)
    try:
        node, data = load_yaml(text)
    except yaml.YAMLError as exc:
        problem = f"{_yaml_error_where(exc, text)}not valid YAML: {_yaml_error_problem(exc)}"
        raise PolicyError([problem], source) from None
    lines: dict[tuple, int] = {}
    if node is not None:
        _index_lines(node, lines)
    return data, lines


def load_yaml(text: str) -> tuple[yaml.Node | None, Any]:
    """The node tree and the data of one YAML document, under the rules of policy files.

    Raises only ``yaml.YAMLError`` (a marked one where the position is known).
    """
    loader = _PolicyLoader(text)
    try:
        node = loader.get_single_node()
        data = None if node is None else loader.construct_document(node)
    except RecursionError:  # not expected with the depth bound; a last line of defence
        raise yaml.YAMLError(f"nested too deeply (more than {MAX_YAML_DEPTH} levels)") from None
    finally:
        loader.dispose()
    return node, data


def read_source(source: str | Path | Traversable, name: str | None = None) -> tuple[str, str]:
    """Text and display name of a policy file (UTF-8; ``name``, else the path, names it in errors);
    a file that cannot be read is a ``PolicyError``."""
    name = str(source) if name is None else name
    try:
        if isinstance(source, (str, Path)):
            path = Path(source)
            if not path.is_file():
                raise PolicyError([f"no such policy file: {path}"], name)
            raw = path.read_bytes()
        elif hasattr(source, "read_bytes"):
            raw = source.read_bytes()  # a Traversable (importlib.resources)
        else:
            raise PolicyError([f"not a policy file: a {type(source).__name__}"], name)
    except OSError as exc:
        raise PolicyError([f"cannot read the policy file: {exc.strerror or exc}"], name) from None
    except ValueError as exc:  # a path with a NUL byte, say
        raise PolicyError([f"no such policy file: {exc}"], name) from None
    return decode_policy_bytes(raw, name), name


def decode_policy_bytes(raw: bytes, source: str) -> str:
    """A policy file's bytes as text: UTF-8 (a leading byte-order mark is dropped), else ``PolicyError``."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise PolicyError(
            [f"line {line}: not UTF-8 text: byte {raw[exc.start]:#04x} at offset {exc.start} ({exc.reason})"],
            source,
        ) from None


class _PolicyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` without anchors and aliases, duplicate keys or unbounded nesting."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or event.anchor is not None:
            what = f"alias *{event.anchor}" if isinstance(event, yaml.AliasEvent) else f"anchor &{event.anchor}"
            raise yaml.composer.ComposerError(
                None, None, f"{what}: anchors and aliases are not allowed in policy files", event.start_mark
            )
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nested more than {MAX_YAML_DEPTH} levels deep", event.start_mark
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_object(self, node, deep=False):
        try:
            return super().construct_object(node, deep=deep)
        except yaml.YAMLError:
            raise
        except Exception as exc:  # a scalar that cannot be built: 5000 digits, month 13, ...
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read {_preview(node)}: {_construct_problem(exc)}", node.start_mark
            ) from None

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:
                    continue  # an unhashable key: SafeConstructor reports it
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (first at line {first})", key_node.start_mark
                    )
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _preview(node: yaml.ScalarNode | yaml.SequenceNode | yaml.MappingNode) -> str:
    if isinstance(node, yaml.ScalarNode):
        value = node.value if len(node.value) <= 40 else f"{node.value[:20]}...({len(node.value)} characters)"
        return f"the value {value!r}"
    return f"the {node.id}"


def _construct_problem(exc: Exception) -> str:
    message = str(exc)
    if isinstance(exc, ValueError) and "integer string conversion" in message:
        return f"an integer of more than {sys.get_int_max_str_digits()} digits"
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _yaml_error_where(exc: yaml.YAMLError, text: str) -> str:
    mark = getattr(exc, "problem_mark", None)
    if mark is not None:
        return f"line {mark.line + 1}, column {mark.column + 1}: "
    position = getattr(exc, "position", None)  # a ReaderError: a character YAML does not allow
    if isinstance(position, int):
        line = text.count("\n", 0, position) + 1
        return f"line {line}: "
    return ""


def _yaml_error_problem(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.reader.ReaderError):
        char = exc.character
        code = f"#x{char:04x}" if isinstance(char, int) else repr(char)
        return f"unacceptable character {code}: {exc.reason}"
    return str(getattr(exc, "problem", None) or exc)


def _index_lines(root: yaml.Node, out: dict[tuple, int]) -> None:
    """Record the line of every key path under ``root``, visiting each node once.

    Iterative, in document order, and each node is indexed at the first path that reaches it
    (where its anchor is): even a node tree that shares nodes (what aliases make) costs time
    linear in the number of nodes, never in the size of its expansion.
    """
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, tuple]] = [(root, ())]
    while stack:
        node, path = stack.pop()
        out.setdefault(path, node.start_mark.line + 1)
        if id(node) in seen:
            continue
        seen.add(id(node))
        children: list[tuple[yaml.Node, tuple]] = []
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if not isinstance(key, yaml.ScalarNode):
                    continue  # a complex key cannot be a field name
                child = (*path, key.value)
                out.setdefault(child, key.start_mark.line + 1)
                children.append((value, child))
        elif isinstance(node, yaml.SequenceNode):
            children = [(item, (*path, i)) for i, item in enumerate(node.value)]
        stack.extend(reversed(children))


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
