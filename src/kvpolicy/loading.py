"""``load_policy``: a policy from a registered name, a file, YAML text, a mapping or a config."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .config import PolicyConfig, PolicyError, load_config
from .policy import Policy
from .registry import get_registry


def load_policy(
    source: str | bytes | bytearray | Path | Mapping[str, Any] | PolicyConfig | Policy, **overrides: Any
) -> Policy:
    """Load a policy: a registered name (``"vase-attnv"``), a YAML file, YAML text, a mapping or a config.

    What ``source`` is taken for:

    * a ``str``: a registered policy name if it is one; ``NAME@MODE`` for a registered policy in
      another mode (``"vase-attnv@select"``: the same stages choosing a sparse subset of a full
      cache at every step; named ``NAME@MODE``); else the path of an existing file; else
      YAML text if it holds a newline or a ``:`` (``"{name: p, schedule: {budget: 64}, ...}"``);
      else a missing file if it looks like a path (a suffix such as ``.yaml``, or a directory
      part); else an unknown policy name (the error lists the registered ones);
    * ``bytes``: YAML text, UTF-8 encoded;
    * a ``pathlib.Path`` (any ``os.PathLike``): a policy file, read as UTF-8;
    * a ``Mapping``: the policy as data, as a parsed policy file holds it;
    * a ``PolicyConfig`` or a ``Policy``: used as is (with ``overrides`` applied).

    ``overrides`` replace schedule fields (``budget``, ``recent``, ``interval``, ``window``,
    ``count``, ``compress_prompt``) or top-level ones (``seed``, ``name``, ``description``,
    ``mode``);
    everything is validated before any tensor work, with errors naming file, line and field.

    Raises:
        PolicyError: (a ``ValueError``) for anything wrong with the document, the file or an
            override: an unknown name, a missing or unreadable file, text that is not UTF-8,
            invalid YAML (policy files also refuse anchors and aliases, duplicate keys and
            nesting deeper than 64 levels), an unknown or invalid field, a value out of its
            bounds (``seed`` in ``[0, 2**63 - 1]``, finite floats only, stage sizes capped) or
            an inconsistent composition. Nothing else escapes for a bad document.
        TypeError: only when ``source`` is a Python object of none of the kinds above (an
            ``int``, ``None``, a list...): a programming error, not a bad document.
    """
    def is_file(path: str) -> bool:
        try:
            return Path(path).is_file()
        except (OSError, ValueError):  # a name too long for the OS, a NUL byte
            return False

    if isinstance(source, Policy):
        return source.with_overrides(**overrides) if overrides else source
    if isinstance(source, str):
        registry = get_registry()
        if source in registry.policies:
            registered = registry.policies[source].obj  # a plugin's: a file, YAML text or data
            if isinstance(registered, (Mapping, PolicyConfig, Policy, bytes, bytearray)):
                return load_policy(registered, **overrides)
            if isinstance(registered, str) and not is_file(registered):
                if "\n" not in registered and ":" not in registered and (
                    Path(registered).suffix or len(Path(registered).parts) > 1
                ):  # a path that is not there (never a policy document: those hold a ':')
                    plugin = registry.policies[source].plugin
                    raise PolicyError(
                        [f"no such policy file: {registered} (policy {source!r} of plugin {plugin!r})"], source
                    )
                return Policy(*load_config(registered, overrides, name=f"<{source}>"))
            if isinstance(registered, str):
                return Policy(*load_config(Path(registered), overrides, name=registered))
            return Policy(*load_config(registered, overrides))  # a path, or a Traversable (importlib.resources)
        if source.rpartition("@")[0] in registry.policies and not is_file(source):
            base, _, mode = source.rpartition("@")
            return load_policy(base, **{"mode": mode, "name": source, **overrides})
        if is_file(source):
            return Policy(*load_config(Path(source), overrides, name=source))
        if "\n" in source or ":" in source:
            return Policy(*load_config(source, overrides, name="<text>"))
        if Path(source).suffix or len(Path(source).parts) > 1:
            raise PolicyError([f"no such policy file: {source}"], source)
        known = ", ".join(sorted(registry.policies))
        raise PolicyError([f"unknown policy {source!r}; registered policies: {known}"], source)
    if not isinstance(source, (PolicyConfig, Mapping, bytes, bytearray, os.PathLike)):
        raise TypeError(
            "load_policy takes a registered policy name, a path, YAML text (str or bytes), a mapping, "
            f"a PolicyConfig or a Policy; got {type(source).__name__}"
        )
    return Policy(*load_config(source, overrides))


