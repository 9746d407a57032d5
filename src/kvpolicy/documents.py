"""Reading policy documents: YAML under the rules of policy files, and ``PolicyError``.

The ground floor under ``kvpolicy.config`` (policy files) and ``kvpolicy.profile_format`` (head
profiles): both read YAML through ``read_policy_text`` and report a bad document as a
``PolicyError`` whose problems name the line. Nothing here knows what a policy holds.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

if sys.version_info >= (3, 11):
    from importlib.resources.abc import Traversable
else:  # Python 3.10 has it in importlib.abc only
    from importlib.abc import Traversable


def refuse_lax_scalar(model: Any, name: str | None, value: Any) -> Any:
    """The body of a pydantic ``field_validator("*", mode="before")`` of a policy document's model:
    refuse, naming the field, what pydantic's lax mode would convert, as its strict mode does:
    ``true``/``false`` for a field that takes a number (read as 1 and 0, ``interval: true`` would
    evict at every token), and a string for one that takes a number or a bool (``budget: '16'``,
    ``low_norm_first: 'true'``) unless the field names that string itself (``budget: schedule``).
    Overrides from the command line arrive parsed (``--set budget=16`` is an int). Returns
    ``value`` unchanged."""
    ann = model.model_fields[name].annotation if name in model.model_fields else None
    if isinstance(value, bool) and _takes(ann, (int, float)):
        raise ValueError(f"{name} must be a number, got {str(value).lower()} (a boolean)")
    if isinstance(value, str) and not _takes(ann, (str,)) and value not in _literals(ann):
        if _takes(ann, (int, float)):
            raise ValueError(f"{name} must be a number, got the string {value!r}: write it unquoted")
        if _takes(ann, (bool,)):
            raise ValueError(f"{name} must be true or false, got the string {value!r}: write it unquoted")
    return value


def _takes(annotation: Any, kinds: tuple[type, ...]) -> bool:
    """Whether a field annotated ``annotation`` takes one of ``kinds`` (int and float only where it
    takes no bool: a bool is an int to Python)."""
    if annotation in kinds:
        return True
    types = [a for a in get_args(annotation) if isinstance(a, type) or get_args(a)]  # not Literal values
    return (bool in kinds or bool not in types) and any(_takes(a, kinds) for a in types)


def _literals(annotation: Any) -> set[Any]:
    """The values of every ``Literal`` in ``annotation``."""
    if get_origin(annotation) is Literal:
        return set(get_args(annotation))
    return set().union(*(_literals(a) for a in get_args(annotation)))


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


class PolicyWarning(UserWarning):
    """A policy that loads and runs, in a setting where it is known to go wrong: the message says
    what goes wrong there and what to use instead (``cam``'s faithful merge under repeated
    evictions). Raised at load, once per setting; ``-W error::kvpolicy.PolicyWarning`` refuses it."""



#: Deepest nesting of mappings and lists a policy file may have (real ones nest under 20 levels;
#: the bound keeps the YAML composer and the line index far from Python's recursion limit).
MAX_YAML_DEPTH = 64


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
