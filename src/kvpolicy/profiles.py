"""Head profiles: a weight or a class for every (layer, KV head) of one model, in a file.

A profile tells a budget allocator which heads deserve more cache slots (HeadKV, DuoAttention).
It is data only: ``HeadProfile`` is the file format, ``compute_profile`` measures one for a
transformers decoder from a calibration text, and ``concentration_calibration`` /
``passkey_calibration`` build that text's token ids. The command ``kvpolicy profile`` runs them.

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

import inspect
import json
import math
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

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

from .config import PolicyError, decode_policy_bytes, read_policy_text

#: The profile format this kvpolicy reads and writes (``kvpolicy_profile`` in the file).
PROFILE_FORMAT = 1
#: Head classes and the weight each one stands for in ``head_weights()``.
CLASS_WEIGHTS: dict[str, float] = {"retrieval": 1.0, "streaming": 0.0}
METHODS = ("concentration", "passkey")
Method = Literal["concentration", "passkey"]
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

        Floats are written exactly (``load`` gives back an equal profile).
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
        path.write_text(text, encoding="utf-8")

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


# -- computing a profile -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Calibration:
    """Token ids to profile a model on, and what ``compute_profile`` scores in them.

    ``window``: how many final positions' queries are scored. ``key_span``: ``(start, end)``
    positions of the passkey's tokens (``passkey`` method only). ``description``: for reports.
    """

    input_ids: list[int]
    window: int
    key_span: tuple[int, int] | None
    description: str


def concentration_calibration(tokenizer, text: str, tokens: int, window: int = 32) -> Calibration:
    """The first ``tokens`` tokens of ``text``, scored at its last ``window`` queries."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if tokens <= window:
        raise ValueError(f"tokens ({tokens}) must exceed the window ({window})")
    if len(ids) < tokens:
        raise ValueError(f"the calibration text has {len(ids)} tokens, fewer than the {tokens} asked for")
    return Calibration(list(ids[:tokens]), window, None, f"{tokens} tokens, last {window} queries")


#: The planted sentence is PASSKEY_HEAD, a space and the key, then PASSKEY_TAIL.
PASSKEY_HEAD = " The pass key is"
PASSKEY_TAIL = ". Remember it."
PASSKEY_QUESTION = " What is the pass key? The pass key is"


def passkey_calibration(tokenizer, text: str, tokens: int, seed: int = 0, depth: float = 0.5) -> Calibration:
    """A passkey planted in ``text`` and asked for at the end, with the answer teacher-forced.

    The ids are: the text's first tokens, with the sentence ``PASSKEY_HEAD`` + key +
    ``PASSKEY_TAIL`` (a 5-digit key drawn from ``seed``) inserted at the fraction ``depth`` of
    them, then ``PASSKEY_QUESTION`` and the key's tokens but the last, ``tokens`` ids in all. The scored queries are the last ``A`` positions
    (``A`` = the key's token count): the ones whose next token is a token of the key. ``key_span``
    covers the key's tokens in the needle.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    key = str(random.Random(f"kvpolicy-profile-passkey-{seed}").randint(10000, 99999))

    def encode(piece: str) -> list[int]:
        return list(tokenizer(piece, add_special_tokens=False)["input_ids"])

    head_ids = encode(PASSKEY_HEAD)
    with_key = encode(f"{PASSKEY_HEAD} {key}")
    if with_key[: len(head_ids)] != head_ids:  # the span below would be off
        raise ValueError("the tokenizer merges the passkey with the words before it; cannot locate its tokens")
    key_ids = with_key[len(head_ids):]  # the key as it follows "is" (a leading space token included)
    tail_ids, question = encode(PASSKEY_TAIL), encode(PASSKEY_QUESTION)
    fixed = len(with_key) + len(tail_ids) + len(question) + len(key_ids) - 1
    room = tokens - fixed
    if room < 2:
        raise ValueError(f"tokens ({tokens}) leave no room for text around the passkey ({fixed} tokens)")
    filler = encode(text)
    if len(filler) < room:
        raise ValueError(f"the calibration text has {len(filler)} tokens, fewer than the {room} needed")
    cut = round(depth * room)
    start = cut + len(head_ids)
    ids = filler[:cut] + with_key + tail_ids + filler[cut:room] + question + key_ids[:-1]
    return Calibration(ids, len(key_ids), (start, start + len(key_ids)),
                       f"{tokens} tokens, passkey {key} at depth {depth:g}")


def compute_profile(
    model: Any,
    input_ids: torch.Tensor | Sequence[int],
    method: Method = "concentration",
    *,
    window: int = 32,
    key_span: tuple[int, int] | None = None,
    model_name: str | None = None,
) -> HeadProfile:
    """Measure a ``HeadProfile`` of a transformers decoder in one forward pass over ``input_ids``.

    The model runs once, without a cache, on eager attention (its attention implementation, and
    train/eval mode, are restored afterwards); a hook on each layer's attention module reads the
    attention weights ``A`` (``[Hq, T, T]``, row ``t`` a softmax over keys ``0..t``) as the layer
    runs, so only one layer's weights are held at a time. With ``Q`` the last ``window`` query
    positions and ``G = Hq / Hkv`` query heads per KV head (query head ``h`` reads KV head
    ``h // G``), the weight of (layer ``l``, KV head ``k``), in float64, is the mean over the
    ``G`` query heads of KV head ``k`` and over ``t`` in ``Q`` of:

    - ``concentration``: the normalised entropy of the row,
      ``-sum_j A[t, j] log A[t, j] / log(t + 1)``, in ``[0, 1]``: 0 when a head reads one key, 1
      when it spreads evenly over all ``t + 1``. Spread heads get high weights (Ada-KV gives them
      more slots).
    - ``passkey``: the attention mass on the passkey's tokens, ``sum_{j in key_span} A[t, j]``,
      in ``[0, 1]`` (a retrieval score in the spirit of HeadKV and DuoAttention); with
      ``passkey_calibration``'s ids, ``Q`` are the positions that predict the key.

    Args:
        model: a transformers causal LM whose attention modules have ``layer_idx`` and return
            their weights on eager attention (Llama, Qwen, Mistral, SmolLM, ...).
        input_ids: ``[T]`` or ``[1, T]`` token ids (one row, no padding).
        method: ``"concentration"`` or ``"passkey"``.
        window: how many final positions' queries are scored, ``1 <= window < T``.
        key_span: ``(start, end)`` positions of the passkey's tokens, before the scored queries
            (``passkey`` only).
        model_name: written to the profile's ``model`` field (default: the model's
            ``name_or_path``).

    Returns:
        A weight profile of ``[num_hidden_layers, num_key_value_heads]``.
    """
    if method not in METHODS:
        raise ValueError(f"unknown profile method {method!r}; methods: {', '.join(METHODS)}")
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"input_ids must be [T] or [1, T] (one row), got shape {list(ids.shape)}")
    length = ids.shape[0]
    if not 1 <= window < length:
        raise ValueError(f"window must be in [1, {length - 1}] for {length} tokens, got {window}")
    first_query = length - window
    if method == "passkey":
        if key_span is None:
            raise ValueError("the passkey method needs key_span, the (start, end) positions of the passkey")
        start, end = key_span
        if not 0 <= start < end <= first_query:
            raise ValueError(f"key_span {key_span} must satisfy 0 <= start < end <= {first_query} "
                             f"(the passkey comes before the {window} scored queries)")
    elif key_span is not None:
        raise ValueError("key_span is for the passkey method only")

    span = key_span or (0, 0)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    num_layers = int(config.num_hidden_layers)
    num_kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    scores: dict[int, torch.Tensor] = {}

    def reduce(attn: torch.Tensor) -> torch.Tensor:
        rows = attn[0, :, first_query:, :].to(torch.float64)  # [Hq, W, T]
        if method == "concentration":
            visible = torch.arange(first_query, length, dtype=torch.float64, device=rows.device) + 1
            per_query = torch.special.entr(rows).sum(-1) / visible.log()  # [Hq, W]
        else:
            per_query = rows[..., span[0]:span[1]].sum(-1)
        heads = per_query.mean(-1)  # [Hq]
        if heads.shape[0] % num_kv_heads:
            raise ValueError(f"{heads.shape[0]} query heads do not split into {num_kv_heads} KV heads")
        return heads.view(num_kv_heads, -1).mean(-1).cpu()  # [Hkv]

    def hook(module, args, output) -> None:
        layer = module.layer_idx
        if layer in scores or not isinstance(output, tuple) or len(output) < 2:
            return  # the innermost module with this layer_idx (the attention) ran first
        attn = output[1]
        if isinstance(attn, torch.Tensor) and attn.dim() == 4 and attn.shape[-2:] == (length, length):
            scores[layer] = reduce(attn)

    handles = [m.register_forward_hook(hook) for m in model.modules()
               if isinstance(getattr(m, "layer_idx", None), int)]
    previous = model.config._attn_implementation
    was_training = model.training
    device = next(model.parameters()).device
    kwargs: dict[str, Any] = {"use_cache": False}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kwargs["logits_to_keep"] = 1  # the logits of every position are not needed (T x vocab floats)
    if not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"{type(model).__name__} cannot switch to eager attention (no set_attn_implementation)")
    try:
        model.set_attn_implementation("eager")
        model.eval()
        with torch.no_grad():
            model(input_ids=ids[None].to(device), **kwargs)
    finally:
        for handle in handles:
            handle.remove()
        model.set_attn_implementation(previous)
        model.train(was_training)
    missing = [i for i in range(num_layers) if i not in scores]
    if missing:
        raise ValueError(
            f"{type(model).__name__} returned no attention weights for layers {missing[:8]}: compute_profile needs "
            "attention modules with a layer_idx that return their weights on eager attention"
        )
    weights = torch.stack([scores[i] for i in range(num_layers)])
    name = model_name if model_name is not None else str(getattr(config, "name_or_path", "") or type(model).__name__)
    return HeadProfile.from_weights(weights, model=name, method=method)
