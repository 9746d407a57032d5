"""Moved to ``kvpolicy.stages.guards``: the run-time guards are part of the stage layer (nested
stages call them). Importing a name from here still works, with a ``DeprecationWarning``;
``SelectionError`` is also ``kvpolicy.SelectionError``."""

from __future__ import annotations

import warnings
from typing import Any

from .stages import guards as _guards


def __getattr__(name: str) -> Any:
    value = getattr(_guards, name)  # AttributeError, naming kvpolicy.stages.guards, if it has none
    warnings.warn(f"kvpolicy.guards.{name} moved to kvpolicy.stages.guards.{name}", DeprecationWarning, stacklevel=2)
    return value
