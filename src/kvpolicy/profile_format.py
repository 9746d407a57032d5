"""The head-profile file format: a weight or a class for every (layer, KV head) of one model.

A profile tells a budget allocator which heads deserve more cache slots (HeadKV, DuoAttention;
the ``profile`` allocation, ``kvpolicy.stages.head_profile``, reads one). It is data only:
``HeadProfile`` is the file format; measuring one for a transformers model is
``kvpolicy.profiles.compute_profile`` (the command ``kvpolicy profile`` runs it).

The file (YAML, or JSON for a ``.json`` name)::

    kvpolicy_profile: 1            # format version
    model: SmolLM2-135M-Instruct   # free text, informative
    num_layers: 30
    num_kv_heads: 3
    method: concentration          # how it was computed (informative), or "manual"
    weights: [[0.3, 1.2, 0.8], ...]    # num_layers lists of num_kv_heads floats >= 0
    # or, instead of weights:
    classes: [[retrieval, streaming, streaming], ...]

``head_weights()`` gives the weights as a ``[num_layers, num_kv_heads]`` float64 tensor (a class
profile maps ``retrieval`` to 1.0 and ``streaming`` to 0.0). Every profile has at least one
positive weight (one retrieval head), so its weights can always be normalised.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from .documents import PolicyError, decode_policy_bytes, read_policy_text
from .files import replace_file

#: The profile format this kvpolicy reads and writes (``kvpolicy_profile`` in the file).
PROFILE_FORMAT = 1
#: Head classes and the weight each one stands for in ``head_weights()``.
CLASS_WEIGHTS: dict[str, float] = {"retrieval": 1.0, "streaming": 0.0}
_SUFFIXES = {".yaml": "yaml", ".yml": "yaml", ".json": "json"}
_EXPONENT_WITHOUT_DOT = re.compile(r"^[-+]?[0-9]+[eE][-+]?[0-9]+$")


class ProfileError(PolicyError):
    """A head-profile file that cannot be loaded; each problem names the line and the field.

    A ``PolicyError``, so that whatever reports bad policy files (the command line's
    ``FILE:LINE: field: problem``) reports bad profiles the same way.
    """

    def __init__(self, problems: list[str], source: str = "<profile>") -> None:
        super().__init__(problems, source)
        lines = "\n".join(f"  {p}" for p in self.problems)
        self.args = (f"invalid head profile {source}:\n{lines}",)


class _EntryProblem(ValueError):
    """A validation problem at one entry of ``weights`` / ``classes``: ``path`` = (layer,) or (layer, head)."""

    def __init__(self, message: str, path: tuple[int, ...]) -> None:
        super().__init__(message)
        self.path = path


class HeadProfile(BaseModel):
    """A weight or a class for every (layer, KV head) of one model: what a per-head allocator reads.

    Exactly one of ``weights`` and ``classes`` is given, with ``num_layers`` rows of
    ``num_kv_heads`` entries each. Weights are finite and ``>= 0``, and not all zero; classes are
    ``retrieval`` or ``streaming``, and at least one head is ``retrieval``. Higher weights mean
    that a head needs more slots. Build one from a tensor with ``from_weights``, from a file with
    ``load``, from a parsed mapping with ``parse``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kvpolicy_profile: int = Field(
        ..., strict=True, description=f"The profile format version: {PROFILE_FORMAT}."
    )
    model: str = Field("", description="The model the profile was computed for (informative).")
    num_layers: int = Field(..., strict=True, gt=0, description="Decoder layers of the model.")
    num_kv_heads: int = Field(..., strict=True, gt=0, description="KV heads per layer of the model.")
    method: str = Field("manual", description="How the profile was computed (informative).")
    weights: tuple[tuple[float, ...], ...] | None = Field(
        None, description="num_layers lists of num_kv_heads weights (finite, >= 0, not all zero)."
    )
    classes: tuple[tuple[str, ...], ...] | None = Field(
        None, description="num_layers lists of num_kv_heads classes: retrieval or streaming."
    )

    # The file it was loaded from (for messages); not part of the data.
    _source: str | None = PrivateAttr(None)

    @field_validator("kvpolicy_profile")
    @classmethod
    def _check_format(cls, version: int) -> int:
        if version != PROFILE_FORMAT:
            newer = " (written by a newer kvpolicy: upgrade it)" if version > PROFILE_FORMAT else ""
            raise ValueError(f"profile format {version} is unknown{newer}; this kvpolicy reads format {PROFILE_FORMAT}")
        return version

    @field_validator("weights", mode="before")
    @classmethod
    def _check_weight_entries(cls, rows: Any) -> Any:
        return _check_rows(rows, _check_weight)

    @field_validator("classes", mode="before")
    @classmethod
    def _check_class_entries(cls, rows: Any) -> Any:
        return _check_rows(rows, _check_class)

    @field_validator("weights", "classes")
    @classmethod
    def _check_shape_declared(cls, rows: tuple[tuple[Any, ...], ...] | None, info) -> Any:
        layers, heads = info.data.get("num_layers"), info.data.get("num_kv_heads")
        if rows is None or layers is None or heads is None:
            return rows  # a missing num_layers / num_kv_heads is its own error
        if len(rows) != layers:
            raise ValueError(f"{len(rows)} layers given, but the profile declares num_layers = {layers}")
        for i, row in enumerate(rows):
            if len(row) != heads:
                count = f"{len(row)} head" if len(row) == 1 else f"{len(row)} heads"
                raise _EntryProblem(f"layer {i} has {count}, but the profile declares num_kv_heads = {heads}", (i,))
        return rows

    @model_validator(mode="after")
    def _check_one_kind(self) -> HeadProfile:
        if (self.weights is None) == (self.classes is None):
            got = "both" if self.weights is not None else "neither"
            raise ValueError(f"a profile gives exactly one of 'weights' and 'classes', this one gives {got}")
        if self.weights is not None and not any(w > 0 for row in self.weights for w in row):
            raise ValueError("weights: every weight is 0; at least one head needs a positive weight")
        if self.classes is not None and not any(c == "retrieval" for row in self.classes for c in row):
            raise ValueError("classes: every head is streaming; at least one head must be retrieval")
        return self

    # -- construction -------------------------------------------------------------------------------
    @classmethod
    def from_weights(cls, weights: torch.Tensor | Sequence[Sequence[float]], *, model: str = "",
                     method: str = "manual") -> HeadProfile:
        """A weight profile from ``weights`` ``[num_layers, num_kv_heads]`` (validated like a file)."""
        rows = torch.as_tensor(weights, dtype=torch.float64)
        if rows.dim() != 2:
            raise ValueError(f"weights must be [num_layers, num_kv_heads], got shape {list(rows.shape)}")
        return cls(kvpolicy_profile=PROFILE_FORMAT, model=model, num_layers=rows.shape[0],
                   num_kv_heads=rows.shape[1], method=method, weights=rows.tolist())

    @classmethod
    def parse(cls, data: Any, source: str = "<profile>", lines: Mapping[tuple, int] | None = None) -> HeadProfile:
        """Validate a parsed profile mapping; every problem is reported in one ``ProfileError``.

        ``lines`` maps key paths to 1-based lines (``read_policy_text`` gives it) for the messages.
        """
        if not isinstance(data, Mapping):
            raise ProfileError([f"a profile file holds a mapping, got {type(data).__name__}"], source)
        try:
            profile = cls.model_validate(dict(data))
        except ValidationError as exc:
            raise ProfileError([_format_error(err, lines or {}) for err in exc.errors()], source) from None
        profile._source = source
        return profile

    @classmethod
    def load(cls, path: str | Path) -> HeadProfile:
        """Read a profile file: JSON for a ``.json`` name, YAML for ``.yaml`` / ``.yml``.

        YAML files follow the rules of policy files (no anchors, no duplicate keys). Raises
        ``ProfileError`` (a ``PolicyError``) naming the file, the line and the field.
        """
        path = Path(path)
        source = str(path)
        kind = _file_kind(path, source)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise ProfileError([f"no such profile file: {path}"], source) from None
        except OSError as exc:
            raise ProfileError([f"cannot read the profile file: {exc.strerror or exc}"], source) from None
        lines: dict[tuple, int] = {}
        try:
            if kind == "yaml":
                data, lines = read_policy_text(raw, source)
            else:
                data = json.loads(decode_policy_bytes(raw, source))
        except PolicyError as exc:  # the shared YAML / UTF-8 readers speak of policies
            raise ProfileError(exc.problems, source) from None
        except json.JSONDecodeError as exc:
            raise ProfileError([f"line {exc.lineno}, column {exc.colno}: not valid JSON: {exc.msg}"], source) from None
        except RecursionError:
            raise ProfileError(["nested too deeply"], source) from None
        return cls.parse(data, source, lines)

    def __eq__(self, other: object) -> bool:
        # The data only: where a profile was loaded from does not make it another profile.
        if not isinstance(other, HeadProfile):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash((self.kvpolicy_profile, self.model, self.num_layers, self.num_kv_heads, self.method,
                     self.weights, self.classes))

    # -- use ----------------------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Write the profile: JSON for a ``.json`` name, YAML for ``.yaml`` / ``.yml``.

        Floats are written exactly (``load`` gives back an equal profile). The file is replaced
        atomically (``kvpolicy.files.replace_file``).
        """
        path = Path(path)
        kind = _file_kind(path, str(path), error=ValueError)
        data = self.to_dict()
        if kind == "json":
            text = json.dumps(data, indent=1) + "\n"
        else:
            # Flow style for the innermost lists: one line per layer.
            text = "# kvpolicy head profile\n" + yaml.safe_dump(data, sort_keys=False, default_flow_style=None,
                                                                width=10_000)
        replace_file(path, text.encode("utf-8"))  # whole or not at all: a full disk leaves no truncated profile

    def to_dict(self) -> dict[str, Any]:
        """The profile as its file holds it (only one of ``weights`` and ``classes``)."""
        data: dict[str, Any] = {
            "kvpolicy_profile": self.kvpolicy_profile, "model": self.model, "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads, "method": self.method,
        }
        if self.weights is not None:
            data["weights"] = [list(row) for row in self.weights]
        else:
            data["classes"] = [list(row) for row in self.classes or ()]
        return data

    def head_weights(self) -> torch.Tensor:
        """``[num_layers, num_kv_heads]`` float64: the weights, or 1.0 for retrieval and 0.0 for streaming."""
        if self.weights is not None:
            return torch.tensor(self.weights, dtype=torch.float64)
        rows = self.classes or ()
        return torch.tensor([[CLASS_WEIGHTS[c] for c in row] for row in rows], dtype=torch.float64)

    def check_shape(self, num_layers: int, num_kv_heads: int) -> None:
        """Raise ``ValueError`` unless the profile is for a model of ``num_layers`` x ``num_kv_heads``."""
        if (self.num_layers, self.num_kv_heads) != (num_layers, num_kv_heads):
            raise ValueError(
                f"profile {self.describe()} is for a model with {self.num_layers} layers x {self.num_kv_heads} "
                f"KV heads, this model has {num_layers} x {num_kv_heads}"
            )

    def describe(self) -> str:
        """The file it came from, else the model it was computed for (for messages)."""
        if self._source is not None:
            return self._source
        return f"<{self.model or 'unnamed'}>"


def _file_kind(path: Path, source: str, error: type[Exception] = ProfileError) -> str:
    kind = _SUFFIXES.get(path.suffix.lower())
    if kind is None:
        message = f"a profile file name ends in .yaml, .yml or .json, not {path.name!r}"
        raise ProfileError([message], source) if error is ProfileError else error(message)
    return kind


def _check_rows(rows: Any, check_entry) -> Any:
    """The shape of a ``weights`` / ``classes`` value: a list of lists; each entry checked."""
    if rows is None:
        return None
    if not isinstance(rows, (list, tuple)):
        raise ValueError(f"expected a list of num_layers lists, got {type(rows).__name__}")
    for i, row in enumerate(rows):
        if not isinstance(row, (list, tuple)):
            raise _EntryProblem(f"layer {i}: expected a list of num_kv_heads entries, got {type(row).__name__}", (i,))
        for j, entry in enumerate(row):
            problem = check_entry(entry)
            if problem:
                raise _EntryProblem(f"layer {i}, head {j}: {problem}", (i, j))
    return rows


def _check_weight(value: Any) -> str | None:
    if isinstance(value, str) and _EXPONENT_WITHOUT_DOT.match(value.strip()):
        # YAML 1.1 reads 1e-5 (no dot) as text; 1.0e-5 is a number.
        return f"{value!r} is not a number (YAML reads it as text: write it with a dot, like 1.0e-5)"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{value!r} is not a number"
    try:
        float(value)
    except OverflowError:
        return f"an integer of {len(str(abs(value)))} digits is too large for a float"
    if not math.isfinite(value):
        return f"{value} is not a finite number"
    if value < 0:
        return f"{value} is negative; weights are >= 0"
    return None


def _check_class(value: Any) -> str | None:
    if value not in CLASS_WEIGHTS:
        return f"{value!r} is not a head class; the classes are {', '.join(CLASS_WEIGHTS)}"
    return None


def _format_error(err: Mapping[str, Any], lines: Mapping[tuple, int]) -> str:
    """``line N: field: problem``; entry problems give the entry's line, and their text names it."""
    loc = tuple(err.get("loc", ()))
    msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, _EntryProblem):
        loc = (*loc, *cause.path)
    elif not loc:  # a check of the whole profile that is about one field names it first
        head, sep, rest = msg.partition(": ")
        if sep and head in HeadProfile.model_fields:
            loc, msg = (head,), rest
    line = None
    for cut in range(len(loc), -1, -1):
        if loc[:cut] in lines:
            line = lines[loc[:cut]]
            break
    field = str(loc[0]) if loc else "profile"
    return f"{'' if line is None else f'line {line}: '}{field}: {msg}"
