"""The plugin contracts of kvpolicy (pluggy).

A plugin is any module or object with functions named like these hooks and marked with
``kvpolicy.hookimpl``. Third-party packages expose one through the ``kvpolicy`` entry-point
group; kvpolicy's own stages and policies are registered through exactly the same hooks
(``kvpolicy.builtin``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("kvpolicy")
hookimpl = pluggy.HookimplMarker("kvpolicy")


@hookspec
def kvpolicy_stages() -> Sequence[type]:
    """Return the stage classes this plugin provides.

    Called once per plugin when the registry is built. Each class subclasses ``Scorer``,
    ``Reservation`` or ``Selector`` and sets a ``type_name`` unique across plugins; it is then
    usable as ``{type: <type_name>, ...}`` in any policy file. A ``type_name`` already taken by an
    earlier plugin is refused with a warning naming both plugins (built-ins come first).
    """
    raise NotImplementedError  # a specification only: pluggy calls the plugins' implementations


@hookspec
def kvpolicy_policies() -> Mapping[str, Path | str | Mapping[str, Any]]:
    """Return named policies: name -> YAML file path, YAML text or a policy mapping.

    Called once per plugin when the registry is built. The names become loadable with
    ``kvpolicy.load_policy(name)`` and are listed by ``kvpolicy policies``. Policies are validated
    lazily, when loaded, so one broken policy does not hide the others.
    """
    raise NotImplementedError  # a specification only: pluggy calls the plugins' implementations
