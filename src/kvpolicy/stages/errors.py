"""The error of an eviction refused at run time, raised by the guards and the eviction input alike
(a module of its own, so that both import it without importing each other)."""

from __future__ import annotations


class SelectionError(ValueError):
    """An eviction refused at run time; the message names the input (``keys``, ``values``,
    ``queries``) or the stage (``scorer 'attention'``, ``reservation 'sinks'``, ...) at fault."""
