"""The JSON schema of a policy file, built from the registry so that plugin stages are included.

Point an editor at it (``kvpolicy schema --output policy.schema.json``, then
``# yaml-language-server: $schema=policy.schema.json`` at the top of a policy file) for completion
and checks as you type. The schema mirrors what ``load_policy`` accepts: a stage is written as
``{type: NAME, ...fields}`` (or a bare ``NAME`` when it has no required field) and every field
typed as a scorer, reservation, selector or allocation, at any depth, accepts every registered stage of
that kind. Checks that span fields (budget against reservations, say) are left to
``kvpolicy validate``.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

from pydantic import BaseModel
from pydantic.errors import PydanticInvalidForJsonSchema, PydanticUserError
from pydantic.json_schema import GenerateJsonSchema

from .config import PolicyConfig
from .registry import Registry, get_registry
from .schedule import _RELATIVE, Schedule
from .stages.base import STAGE_BASES, STAGE_KINDS, StageKind

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
#: The ``$defs`` entry holding the union of every registered stage of a kind (``ScorerSpec``, ...:
#: named after the field types of ``kvpolicy.stages.spec``).
UNION_DEFS: dict[StageKind, str] = {kind: f"{kind.capitalize()}Spec" for kind in STAGE_KINDS}
_BASES: dict[type, StageKind] = {base: kind for kind, base in STAGE_BASES.items()}
_KIND_MARKER = "x-kvpolicy-stage-kind"


class _StageFieldsAsUnions(GenerateJsonSchema):
    """Writes a field typed ``Scorer``/``Reservation``/``Selector`` as a marker, later the union."""

    def model_schema(self, schema):
        kind = _BASES.get(schema["cls"])
        if kind is not None:
            return {_KIND_MARKER: kind}
        return super().model_schema(schema)


def policy_json_schema(registry: Registry | None = None) -> dict[str, Any]:
    """The JSON schema (draft 2020-12) of a policy file, with every stage of ``registry``.

    Args:
        registry: where the stages come from (default: the process-wide registry, built-ins and
            installed plugins).
    """
    registry = registry or get_registry()
    defs: dict[str, Any] = {}
    for kind in STAGE_KINDS:
        variants: dict[str, str] = {}
        shorthand: list[str] = []
        for type_name, registered in sorted(registry.stages[kind].items()):
            def_name = f"{kind}.{type_name}"
            body = _stage_schema(registered.obj, type_name, registered.plugin, def_name, defs)
            defs[def_name] = body
            variants[type_name] = f"#/$defs/{def_name}"
            if body.get("required") == ["type"]:
                shorthand.append(type_name)
        defs[UNION_DEFS[kind]] = _union_schema(kind, variants, shorthand)

    top, nested = _generate(PolicyConfig)
    _merge_defs(defs, nested, "policy", top)
    defs["Schedule"] = schedule_json_schema()
    top["properties"]["schedule"] = {"$ref": "#/$defs/Schedule"}
    schema = {
        "$schema": JSON_SCHEMA_DIALECT,
        "title": "kvpolicy policy file",
        **{k: v for k, v in top.items() if k != "title"},
        "$defs": dict(sorted(defs.items())),
    }
    return schema


def schedule_json_schema() -> dict[str, Any]:
    """``Schedule`` as JSON schema, with the strings its before-validator resolves: ``recent`` as an
    int or ``"budget - N"``, ``evict_above`` as an int, ``"recent"`` or null."""
    body, _ = _generate(Schedule)
    recent = body["properties"]["recent"]
    integer = {"type": "integer", "minimum": recent.pop("minimum", 0)}
    recent.pop("type", None)
    recent["anyOf"] = [integer, {"type": "string", "pattern": _RELATIVE.pattern}]
    body["properties"]["evict_above"]["anyOf"].insert(1, {"const": "recent"})
    return body


def _stage_schema(cls: type[BaseModel], type_name: str, plugin: str, def_name: str, defs: dict) -> dict:
    """One stage class as an object schema whose ``type`` is the constant ``type_name``."""
    summary = first_sentence(cls.__doc__)
    try:
        body, nested = _generate(cls)
    except (PydanticInvalidForJsonSchema, PydanticUserError):
        # A field with no JSON form (a plugin's own type): still offer the type name.
        body, nested = {"type": "object", "properties": {}}, {}
    _merge_defs(defs, nested, def_name, body)
    properties = {"type": {"const": type_name, "description": summary}, **body.get("properties", {})}
    out: dict[str, Any] = {
        "type": "object",
        "title": f"{type_name} ({cls.__name__})",
        "description": inspect.cleandoc(cls.__doc__ or summary),
        "properties": properties,
        "required": ["type", *body.get("required", [])],
        "additionalProperties": body.get("additionalProperties", False),
        "x-kvpolicy-plugin": plugin,
    }
    return out


def _union_schema(kind: StageKind, variants: dict[str, str], shorthand: list[str]) -> dict:
    tagged = {
        "oneOf": [{"$ref": ref} for ref in variants.values()],
        "discriminator": {"propertyName": "type", "mapping": variants},
    }
    if not variants:
        tagged = {"not": {}}  # no stage of this kind is registered
    title = f"{kind} stage"
    description = f"A {kind}: {{type: NAME, ...fields}}, NAME one of: {', '.join(variants) or 'none'}."
    if not shorthand:
        return {"title": title, "description": description, **tagged}
    bare = {"type": "string", "enum": shorthand, "description": f"A {kind} with default fields, by name."}
    return {"title": title, "description": description, "anyOf": [tagged, bare]}


def _generate(model: type[BaseModel]) -> tuple[dict, dict]:
    """``model``'s validation schema and its ``$defs``, stage-kind fields still as markers."""
    schema = model.model_json_schema(schema_generator=_StageFieldsAsUnions, ref_template="#/$defs/{model}")
    nested = schema.pop("$defs", {})
    return schema, nested


def _merge_defs(defs: dict, nested: dict, owner: str, *bodies: dict) -> None:
    """Move ``nested`` into ``defs``, mapping stage markers to unions and renaming clashes.

    References are rewritten inside the nested definitions themselves and inside ``bodies``
    (the schemas that referred to them).
    """
    renames: dict[str, str] = {}
    for name, body in nested.items():
        if set(body) == {_KIND_MARKER}:
            renames[name] = UNION_DEFS[body[_KIND_MARKER]]
        elif name in defs and defs[name] != body:
            renames[name] = f"{owner}.{name}"
        else:
            renames[name] = name
    for name, body in nested.items():
        target = renames[name]
        if target in UNION_DEFS.values():
            continue
        defs[target] = _rewrite_refs(copy.deepcopy(body), renames)
    for body in bodies:
        rewritten = _rewrite_refs(body, renames)
        body.clear()
        body.update(rewritten)


def _rewrite_refs(node: Any, renames: dict[str, str]) -> Any:
    if isinstance(node, dict):
        if set(node) == {_KIND_MARKER}:
            return {"$ref": f"#/$defs/{UNION_DEFS[node[_KIND_MARKER]]}"}
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and value.startswith("#/$defs/"):
                name = value.removeprefix("#/$defs/")
                out[key] = f"#/$defs/{renames.get(name, name)}"
            else:
                out[key] = _rewrite_refs(value, renames)
        return out
    if isinstance(node, list):
        return [_rewrite_refs(v, renames) for v in node]
    return node


def first_sentence(text: str | None) -> str:
    """The first sentence of a description or docstring, on one line."""
    paragraph = " ".join(inspect.cleandoc(text or "").split("\n\n", 1)[0].split())
    end = paragraph.find(". ")
    return paragraph if end < 0 else paragraph[: end + 1]
